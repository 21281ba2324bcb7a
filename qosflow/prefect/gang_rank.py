"""The command every rank of a multi-host gang runs: `python -m qosflow.prefect.gang_rank` instead of `python -m
prefect.engine`.

The worker launches a gang placed on several hosts (host agents; Kubernetes pods) as one process per host, each
with the same command and flow run (`PREFECT__FLOW_RUN_ID`) and its own `QOSFLOW_GANG_RANK`. Each rank ran
Prefect's engine for that one flow run: the run went Running twice and Completed twice (`run_count` 2), its log
had every engine line once per rank, two results and two progress artifacts were written, and the pipeline read
whichever rank's return value came last. Every rank must run the stage's body (a distributed training step needs
all of them), but only one may report to Prefect:

* rank 0 (or no rank: a stage on one host) runs Prefect's engine, exactly as `python -m prefect.engine`: states,
  logs, result, progress artifact;
* every other rank reads the stage's payload (the flow run's `payload` parameter, from the result storage) and
  calls the stage's function in its placement's environment, with no engine: no state, no result, no artifact.
  It writes one line to the run's log when it starts, and its traceback when the function raises; it exits 0 when
  the function returns, 1 when it raises (or the code of a `sys.exit`), which ends the gang as a failed rank always
  did. Its stdout and stderr (file descriptors 1 and 2) go to its own output (the agent's or the pod's log) and to
  the run's log through Prefect's logs API, each line prefixed `rank 1 of 2 on gpu-b:` (`... (stderr):`), bounded:
  sent in a batch every second, at most 1000 lines (FORWARD_MAX_LINES); past that, only its last 100 lines
  (FORWARD_TAIL_LINES) when it ends, after a line saying how many were left out; a line is cut at 2000 characters.
  A stage with `log_prints=False` has none of it forwarded. When it has ended it writes that on the run, as the label
  `qosflow.gang.rank1.ended` = `ok@<attempt>` (`failed@...`, `exit 3@...`; the attempt is the launch's
  `QOSFLOW_STAGE_ID` and the id of the run's latest Pending state, `_attempt`, so that an earlier launch's label
  does not count), read back (again a second later) and written again if a concurrent label merge dropped it; if it
  cannot be written, the rank exits 1 (its gang is stopped). A function that leaves by `os._exit` writes it too.

Rank 0's engine, once the stage's function returned there, waits before it reports the run `Completed` until every
other rank (1 .. QOSFLOW_GANG_SIZE - 1) has written its end label: it reads the run every 0.5 s (GANG_WAIT_POLL_S),
says on the run's log that it waits (again every minute), and reports `Completed`, with its own return value as the
result, when all ended well. Before 2026-11-28 it reported `Completed` at once: the pipeline read the result and
went on while another rank still ran (its GPUs busy), and a rank that failed after that left the run `Completed`.

A rank that raises reports the run `Failed` itself, with its exception persisted as the engine does (message
`qosflow gang: rank 1 of 2 on gpu-b failed: ValueError: ...`), so that the pipeline raises that exception; the
gang's other ranks are then stopped (SIGTERM), and rank 0's engine, which reported such a stop as `Crashed`
("aborted by a termination signal") over it, leaves a run that a rank failed so as it is. Rank 0 waiting for its
other ranks ends the same way: it finds the run ended (Failed by that rank) and takes that state, or is stopped with
the gang first; a rank that ended badly but could not report the run Failed (a `sys.exit(3)`) makes rank 0's engine
report it `Failed` (GangRankFailed). A rank killed before it could write anything (SIGKILL, its host lost) is not
waited for in vain: the worker stops the gang, rank 0's wait ends with it, and its engine reports `Crashed` as before
(or, the host lost, the worker runs the gang again). A rank whose process ends without writing its label and without
stopping its gang (an `exit(0)` from C code, which the `os._exit` wrapper does not see) had rank 0 wait until the run
was cancelled: the worker, which watches the gang's ranks, writes the label for it when the run lacks one of this
attempt (`QosflowWorker._write_rank_end`, `unlabelled_outcome`: `exit 0 without its end label`, never `ok`), and rank
0 fails the run with it; a rank's own end, once read, is kept over a label the worker wrote later. A stage on one host
does not run this module at all (the worker gives it `-m prefect.engine`), and a rank 0 without QOSFLOW_GANG_RANK, or
of a gang of one, waits for nothing (no call to Prefect's API beyond its engine's own).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any


def gang_rank() -> int:
    try:
        return int(os.environ.get("QOSFLOW_GANG_RANK") or 0)
    except ValueError:
        return 0


def gang_size() -> int:
    """The number of ranks of this process's gang (`QOSFLOW_GANG_SIZE`); 1 when it is not a gang (or not said)."""
    try:
        return max(1, int(os.environ.get("QOSFLOW_GANG_SIZE") or 1))
    except ValueError:
        return 1


#: the start of the message of the Failed state a rank other than 0 reports when the stage's function raised there
GANG_FAILED_PREFIX = "qosflow gang: "
#: the label a rank other than 0 writes on the run when it has ended: `GANG_END_LABEL.format(rank=1)` =
#: `"<outcome>@<attempt>"`, outcome `ok`, `failed` or `exit N`, attempt the launch's `QOSFLOW_STAGE_ID#<the run's
#: latest Pending state id>` (`_attempt`: a launch that ran before, on the same run, left its own)
GANG_END_LABEL = "qosflow.gang.rank{rank}.ended"
#: seconds between two readings of the run by rank 0 while it waits for the other ranks to end
GANG_WAIT_POLL_S = 0.5
#: seconds between two notes on the run's log that rank 0 still waits
GANG_WAIT_NOTE_S = 60.0
#: what of a rank's output reaches the run's log: lines batched every FORWARD_EVERY_S, at most FORWARD_MAX_LINES in all;
#: past that, its last FORWARD_TAIL_LINES when it ends; a line is cut at FORWARD_LINE_CHARS characters
FORWARD_EVERY_S = 1.0
FORWARD_MAX_LINES = 1000
FORWARD_TAIL_LINES = 100
FORWARD_LINE_CHARS = 2000


class GangRankFailed(RuntimeError):
    """A rank other than 0 ended badly after rank 0's function returned and could not report the run Failed itself
    (e.g. it left by `sys.exit(3)`): rank 0 reports the run Failed with this."""


def _attempt(client: Any, flow_run_id: Any) -> str:
    """This launch of the gang, as its end labels name it: its `QOSFLOW_STAGE_ID` and the id of the run's latest
    Pending state. A run the worker takes from the queue again (rescheduled: a worker stopped, or recovery) gets the
    stage id of its first launch again, but the worker proposes Pending each time it takes it: without that id, an end
    label an earlier launch left (`ok@...`) counted, and rank 0 reported Completed while rank 1 still ran."""
    return attempt_of(os.environ.get("QOSFLOW_STAGE_ID") or "", client.read_flow_run_states(flow_run_id))


def attempt_of(stage_id: str, states: Any) -> str:
    """`_attempt` from a launch's stage id and the run's states (the worker, writing a rank's end for it, has both)."""
    pending = [s for s in states or () if str(getattr(s.type, "value", s.type)) == "PENDING"]
    return f"{stage_id}#{max(pending, key=lambda s: s.timestamp).id}" if pending else stage_id


#: the end of the outcome the worker writes as a rank's end label when the rank's process ended without writing it
#: (`unlabelled_outcome`)
UNLABELLED = "without its end label"


def unlabelled_outcome(code: int | None) -> str:
    """The outcome the worker writes for a rank (> 0) whose process ended, with exit status `code` (negative: killed by
    that signal; None: unknown), without writing its end label: never `ok`. A rank whose function returned writes its
    label before it exits 0 (`run_rank`, an `os._exit` of Python code too), and exits 1 when it cannot; so a rank that
    exited 0 without it left by a path the rank's code does not see (`exit()` or `_exit()` called from C code, an
    extension's fatal path): whether its function's work was done is not known, and a gang run reported Completed
    without it would hand the pipeline a result one rank may not have finished. Rank 0 fails the run with it
    (GangRankFailed: `rank 1 of 2 on gpu-b ended badly (exit 0 without its end label) ...`); the stage's retries apply."""
    if code is None:
        return f"ended {UNLABELLED}"
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} {UNLABELLED}"
    return f"exit {code} {UNLABELLED}"


def _by_worker(outcome: str) -> bool:
    return outcome.endswith(UNLABELLED)


def _keep_a_rank_failure() -> None:
    """Rank 0's engine, stopped because another rank failed (the worker stops a gang whose rank ended badly), must
    not report its run `Crashed` over the `Failed` state that rank reported: Prefect's engine forces its crash state.
    Its `handle_crash` is wrapped: for a termination signal, a run the server shows `Failed` by a rank is left so.
    (Prefect's internals: if they differ, nothing is wrapped and the engine reports as before.)"""
    try:
        from prefect.exceptions import TerminationSignal
        from prefect.flow_engine import FlowRunEngine
    except ImportError:
        return
    orig = getattr(FlowRunEngine, "handle_crash", None)
    if orig is None or getattr(orig, "_qosflow_gang", False):
        return

    def handle_crash(self: Any, exc: BaseException) -> None:
        if isinstance(exc, TerminationSignal):
            try:
                state = self.client.read_flow_run(self.flow_run.id).state
            except Exception:  # noqa: BLE001 - cannot tell: report as Prefect does
                state = None
            if state is not None and state.is_failed() and (state.message or "").startswith(GANG_FAILED_PREFIX):
                self.logger.info("qosflow gang: rank 0 stopped with its gang; the run stays %s as another rank "
                                 "reported it", state.name)
                _flush_logs()  # (the process ends at once: the line would not reach the run's log)
                self.flow_run.state = state
                self._raised = exc
                return
        return orig(self, exc)

    handle_crash._qosflow_gang = True  # type: ignore[attr-defined]
    FlowRunEngine.handle_crash = handle_crash  # type: ignore[method-assign]


def _ended_ranks(labels: dict[str, Any] | None, size: int, attempt: str) -> dict[int, str]:
    """The ranks (1 .. size-1) whose end label of this attempt is on the run, and how each ended."""
    out: dict[int, str] = {}
    for r in range(1, size):
        v = (labels or {}).get(GANG_END_LABEL.format(rank=r))
        if isinstance(v, str) and "@" in v:
            outcome, _, att = v.rpartition("@")
            if att == attempt:
                out[r] = outcome
    return out


def _wait_for_ranks(engine: Any, size: int) -> bool:
    """Rank 0's function has returned: wait until every other rank has ended (its end label, `GANG_END_LABEL`), reading
    the run every GANG_WAIT_POLL_S. True: all ended well, rank 0's engine reports as it would. False: the run ended
    meanwhile (a rank reported it Failed with its exception): the engine takes that state and reports nothing. A rank
    that ended badly without the run being Failed raises GangRankFailed (the engine reports the run Failed with it).
    A rank killed before it could say so is not waited for in vain: the worker stops its gang, so rank 0 gets SIGTERM
    here, and its engine leaves a run a rank reported Failed as it is (`_keep_a_rank_failure`) or reports it Crashed."""
    import time

    attempt: str | None = None
    fid = engine.flow_run.id
    t0 = last_note = time.monotonic()
    said = warned = False
    seen: dict[int, str] = {}
    while True:
        try:
            fr = engine.client.read_flow_run(fid)
            if attempt is None:
                attempt = _attempt(engine.client, fid)
        except Exception as exc:  # noqa: BLE001 - the server may be back on the next reading; it is needed to report anyway
            if not warned:
                engine.logger.warning("qosflow gang: cannot read the run to see whether its other ranks ended: %s", exc)
                warned = True
            time.sleep(GANG_WAIT_POLL_S)
            continue
        st = fr.state
        if st is not None and st.is_final():
            engine.logger.info("qosflow gang: the run ended while rank 0 waited for its other ranks: %s%s", st.name,
                               f" ({st.message})" if st.message else "")
            engine.flow_run.state = st
            engine.flow_run.state_name = st.name
            engine.flow_run.state_type = st.type
            return False
        # (an end once read counts: a label merge at the same moment may drop it from the run later; a rank's own end,
        # once read, is not replaced by one the worker wrote for it afterwards, `unlabelled_outcome`)
        for r, o in _ended_ranks(getattr(fr, "labels", None), size, attempt).items():
            if r not in seen or _by_worker(seen[r]):
                seen[r] = o
        ended = seen
        bad = sorted((r, o) for r, o in ended.items() if o != "ok")
        if bad:
            r, outcome = bad[0]
            raise GangRankFailed(f"{GANG_FAILED_PREFIX}{_where(r)} ended badly ({outcome}) after rank 0's function returned")
        if len(ended) >= size - 1:
            if said:
                engine.logger.info("qosflow gang: every rank has ended (rank 0 waited %.1fs for them)", time.monotonic() - t0)
            return True
        now = time.monotonic()
        if not said or now - last_note >= GANG_WAIT_NOTE_S:
            left = ", ".join(str(r) for r in range(1, size) if r not in ended)
            engine.logger.info("qosflow gang: rank 0's function returned; the run is reported once rank %s of %d ha%s "
                               "ended too (%.0fs so far)", left, size, "ve" if "," in left else "s", now - t0)
            said, last_note = True, now
        time.sleep(GANG_WAIT_POLL_S)


def _wait_before_reporting(size: int) -> None:
    """Rank 0 of a gang of `size` ranks (> 1): its engine, once the stage's function returned, reports the run Completed
    only when every other rank has ended well (`_wait_for_ranks`). Its `handle_success` is wrapped; rank 0's return
    value and result are its own, as before. (Prefect's internals: if they differ, nothing is wrapped.)"""
    try:
        from prefect.flow_engine import FlowRunEngine
    except ImportError:
        return
    orig = getattr(FlowRunEngine, "handle_success", None)
    if orig is None or getattr(orig, "_qosflow_gang", False):
        return

    gang_run = os.environ.get("PREFECT__FLOW_RUN_ID") or ""

    def handle_success(self: Any, result: Any) -> Any:
        # (only the gang's run: a flow the stage's function calls runs its own engine, and no rank ends that run)
        if str(getattr(self.flow_run, "id", "")) != gang_run or _wait_for_ranks(self, size):
            return orig(self, result)
        return result

    handle_success._qosflow_gang = True  # type: ignore[attr-defined]
    FlowRunEngine.handle_success = handle_success  # type: ignore[method-assign]


def _run_engine(size: int = 1) -> None:
    import runpy
    import warnings

    _keep_a_rank_failure()
    if size > 1:
        _wait_before_reporting(size)

    with warnings.catch_warnings():  # ('prefect.engine' found in sys.modules after importing 'prefect': -m says the same)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


def _where(rank: int) -> str:
    """"rank R of N on HOST", said by this process of the gang of `rank` (its own, or another's). Its own host is its
    QOSFLOW_NODE. Another rank's host is its place in QOSFLOW_GANG_HOSTS where the ranks follow that order (host agents
    launch rank i on the i-th host); on Kubernetes an Indexed Job's pods take the nodes in any order (nothing ties a
    completion index to a node), which shows as this rank's own node not being its place in the list: then another rank
    is named by the hosts left, or by none."""
    import socket

    size = os.environ.get("QOSFLOW_GANG_SIZE") or "?"
    hosts = (os.environ.get("QOSFLOW_GANG_HOSTS") or "").split(",")
    node = os.environ.get("QOSFLOW_NODE") or ""
    try:
        own = int(os.environ.get("QOSFLOW_GANG_RANK") or "")
    except ValueError:
        own = None
    listed = hosts[rank] if 0 <= rank < len(hosts) and hosts[rank] else ""
    # (an Indexed Job's pod has JOB_COMPLETION_INDEX: there its own node at its own place in the list is chance, and
    # says nothing of the others' when the gang has 3 or more ranks)
    indexed = bool(os.environ.get("JOB_COMPLETION_INDEX"))
    if rank == own:
        host = node or listed or socket.gethostname()
    elif not node or (not indexed and own is not None and 0 <= own < len(hosts) and hosts[own] == node):
        host = listed or "an unknown host"
    else:  # (the list's order is not the ranks': Kubernetes)
        others = sorted({h for h in hosts if h and h != node})
        host = others[0] if len(others) == 1 else f"one of {', '.join(others)}" if others else "an unknown host"
    return f"rank {rank} of {size} on {host}"


def run_rank(flow_run_id: str, rank: int) -> int:
    """Rank `rank` (> 0) of the gang running flow run `flow_run_id`: the stage's function, not reported. Its output
    goes to the run's log too (`_OutputForwarder`); its end is written on the run (`_mark_end`). Its exit code."""
    from prefect.client.orchestration import get_client
    from prefect.logging.loggers import flow_run_logger

    from qosflow.prefect.stage import _call, _unpack

    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(flow_run_id)
    logger = flow_run_logger(flow_run=fr)
    params: dict[str, Any] = dict(fr.parameters or {})
    stage = params.get("stage") or fr.name
    where = _where(rank)
    code = 0
    outcome = "ok"
    try:
        (fn, args, kwargs), log_prints = _unpack(_call("read_path", params["payload"]))
        logger.info("stage %s: %s runs the stage's function (rank 0 reports the run's state and result)", stage, where)
        forward = _OutputForwarder(fr.id, where).start() if log_prints and _logs_to_api() else None
        real_exit, me = os._exit, os.getpid()

        def _exit(status: int) -> None:  # the function's os._exit skips the `finally` below: its end is written first,
            if os.getpid() == me:  # else rank 0 would wait for ever (an exit 0 does not stop the gang); not in a fork
                os._exit = real_exit  # type: ignore[assignment]
                if forward is not None:
                    forward.stop()
                if not _mark_end(fr.id, rank, "ok" if status == 0 else f"exit {status}", logger) and status == 0:
                    status = 1
                _flush_logs()
            real_exit(status)

        os._exit = _exit  # type: ignore[assignment]
        try:
            fn(*args, **kwargs)
        finally:
            os._exit = real_exit  # type: ignore[assignment]
            if forward is not None:
                forward.stop()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            outcome = f"exit {code}"
            logger.error("stage %s: %s exited with code %d (sys.exit)", stage, where, code)
    except BaseException as exc:  # (KeyboardInterrupt too: the rank ends, and its gang with it)
        code = 1
        outcome = "failed"
        logger.error("stage %s: %s failed: %s: %s\n%s", stage, where, type(exc).__name__, exc,
                     "".join(traceback.format_exception(exc)).rstrip())
        if isinstance(exc, Exception):
            _report_failed(fr, exc, where, logger)
    finally:
        # (after the run was reported Failed: rank 0, which waits for this label, then finds the run Failed)
        if not _mark_end(fr.id, rank, outcome, logger) and code == 0:
            logger.error("stage %s: %s could not write its end on the run; it exits 1 so that its gang is stopped "
                         "rather than rank 0 waiting for it", stage, where)
            code = 1
        _flush_logs()
    return code


def _mark_end(flow_run_id: Any, rank: int, outcome: str, logger: Any, *, budget_s: float = 60.0,
              settle_s: float = 1.0) -> bool:
    """Write `outcome` as this rank's end label (`GANG_END_LABEL`) on the run and read it back: Prefect's server merges
    labels by reading then writing the row, so a merge at the same moment can drop it (it is written again then), and
    on SQLite a write between them is refused with 503 (retried here after a short pause, until `budget_s`). Read
    back once more `settle_s` later: on PostgreSQL a merge that read the row before this write may commit after the
    first reading (another rank ending at the same moment), and the rank, gone, would leave rank 0 waiting for ever.
    True when the label is on the run."""
    import random
    import time

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    key, value = GANG_END_LABEL.format(rank=rank), None
    give_up = time.monotonic() + budget_s
    attempt = 0
    err: Exception | None = None
    with get_client(sync_client=True) as client:
        while time.monotonic() < give_up:
            attempt += 1
            try:
                with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
                    if value is None:
                        value = f"{outcome}@{_attempt(client, flow_run_id)}"
                    client.update_flow_run_labels(flow_run_id, {key: value})
                    if (client.read_flow_run(flow_run_id).labels or {}).get(key) == value:
                        time.sleep(settle_s)
                        if (client.read_flow_run(flow_run_id).labels or {}).get(key) == value:
                            return True
            except Exception as exc:  # noqa: BLE001 - a 503 (or the server away a moment): tried again
                err = exc
            time.sleep(random.uniform(0.05, 0.2) * min(attempt, 10))
    logger.warning("could not write %s=%s on the run after %d attempts: %s", key, value, attempt, err)
    return False


def _logs_to_api() -> bool:
    try:
        from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED

        return bool(PREFECT_LOGGING_TO_API_ENABLED.value())
    except Exception:  # noqa: BLE001
        return True


class _OutputForwarder:
    """A rank's stdout and stderr (its file descriptors 1 and 2: what the function, its C libraries and the processes
    it starts write) still go to the rank's own output (the agent's or the pod's log), and are sent to the run's log as
    well through Prefect's logs API, one record per line prefixed `rank 1 of 2 on gpu-b:` (`... (stderr):`).
    Bounded: lines are sent in a batch every FORWARD_EVERY_S, at most FORWARD_MAX_LINES of them; past that only the
    last FORWARD_TAIL_LINES are kept and sent when the rank ends, after a line saying how many were left out. A line
    is cut at FORWARD_LINE_CHARS characters; a line redrawn with carriage returns (a progress bar) is sent as last drawn."""

    def __init__(self, flow_run_id: Any, where: str, *, every_s: float = FORWARD_EVERY_S, max_lines: int = FORWARD_MAX_LINES,
                 tail: int = FORWARD_TAIL_LINES, line_chars: int = FORWARD_LINE_CHARS) -> None:
        import collections
        import threading

        self.flow_run_id = flow_run_id
        self.where = where
        self.every_s = every_s
        self.line_chars = line_chars
        self._budget = max_lines
        self.max_lines = max_lines
        self._pending: list[tuple[float, str, str]] = []
        self._tail: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=max(0, tail))
        self.left_out = 0
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._readers: list[threading.Thread] = []
        self._saved: list[tuple[int, int]] = []  # (fd, its copy: where the rank's output went before)
        self._sender: threading.Thread | None = None
        self._line_buffering: list[tuple[Any, bool]] = []

    def start(self) -> "_OutputForwarder":
        import threading

        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = getattr(sys, name, None)
            try:
                if stream is not None:
                    stream.flush()
                saved = os.dup(fd)
            except (OSError, ValueError):
                continue
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            self._saved.append((fd, saved))
            t = threading.Thread(target=self._read, args=(r, saved, name), name=f"qosflow-gang-{name}", daemon=True)
            t.start()
            self._readers.append(t)
            if stream is not None and hasattr(stream, "reconfigure") and not getattr(stream, "line_buffering", True):
                try:  # (a print reaches the run's log within a second, not when a block buffer fills)
                    stream.reconfigure(line_buffering=True)
                    self._line_buffering.append((stream, False))
                except Exception:  # noqa: BLE001
                    pass
        self._sender = threading.Thread(target=self._send_loop, name="qosflow-gang-logs", daemon=True)
        self._sender.start()
        return self

    def stop(self) -> None:
        """Give the rank its own output back and send what is left (the tail, if the budget ran out)."""
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name, None)
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self._saved:
            os.dup2(saved, fd)  # (closes the pipe's end at fd: its reader sees its end unless a child still holds it)
        for t in self._readers:
            t.join(timeout=2.0)
        for stream, was in self._line_buffering:
            try:
                stream.reconfigure(line_buffering=was)
            except Exception:  # noqa: BLE001
                pass
        self._stop.set()
        if self._sender is not None:
            self._sender.join(timeout=30.0)
        for (_fd, saved), t in zip(self._saved, self._readers):
            if not t.is_alive():  # (a reader still running writes there: left open)
                os.close(saved)

    def _read(self, r: int, saved: int, stream: str) -> None:
        partial = b""
        limit = self.line_chars * 4
        try:
            while True:
                try:
                    chunk = os.read(r, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                _write_all(saved, chunk)
                partial += chunk
                *lines, partial = partial.split(b"\n")
                if len(partial) > limit:
                    lines.append(partial)
                    partial = b""
                if lines:
                    self._add(lines, stream)
            if partial:
                self._add([partial], stream)
        finally:
            os.close(r)

    def _add(self, lines: list[bytes], stream: str) -> None:
        import time

        now = time.time()
        with self._lock:
            for raw in lines:
                text = raw.decode("utf-8", errors="replace").rstrip("\r")
                if "\r" in text:
                    text = text.rsplit("\r", 1)[-1]
                if not text.strip():
                    continue
                if len(text) > self.line_chars:
                    text = text[: self.line_chars] + f" [... {len(text) - self.line_chars} characters cut]"
                if self._budget > 0:
                    self._budget -= 1
                    self._pending.append((now, stream, text))
                else:
                    self.left_out += 1
                    self._tail.append((now, stream, text))

    def _send_loop(self) -> None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                while not self._stop.wait(self.every_s):
                    self._send(client)
                self._send(client, last=True)
        except Exception as exc:  # noqa: BLE001 - the output is in the rank's own log still
            self._note(f"qosflow gang: {self.where} could not send its output to the run's log: {exc}")

    def _send(self, client: Any, last: bool = False) -> None:
        import time

        with self._lock:
            batch, self._pending = self._pending, []
            if last and self.left_out:
                kept = list(self._tail)
                note = (f"printed {self.left_out} line(s) more than the {self.max_lines} sent to this log; "
                        + (f"its last {len(kept)} follow; " if kept else "") + "all are in its agent's or pod's log")
                batch.append((kept[0][0] if kept else time.time(), "note", note))
                batch.extend(kept)
        if not batch:
            return
        from datetime import datetime, timezone

        from prefect.client.schemas.actions import LogCreate

        logs = [LogCreate(name="qosflow.gang", level=20, flow_run_id=self.flow_run_id,
                          timestamp=datetime.fromtimestamp(t, timezone.utc),
                          message=f"{self.where}{'' if s in ('stdout', 'note') else f' ({s})'}: {text}") for t, s, text in batch]
        try:
            client.create_logs(logs)
            self.sent += len(batch)
        except Exception as exc:  # noqa: BLE001
            self._note(f"qosflow gang: {self.where} could not send {len(batch)} line(s) of its output to the run's log: {exc}")

    def _note(self, text: str) -> None:
        saved = next((s for fd, s in self._saved if fd == 2), None)
        try:
            _write_all(saved if saved is not None else 2, (text + "\n").encode())
        except OSError:
            pass


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except OSError:
            return
        data = data[n:]


def _report_failed(fr: Any, exc: Exception, where: str, logger: Any) -> None:
    """The run is Failed with this rank's exception, persisted as the engine persists a stage's (the pipeline raises it);
    not forced: a run that already ended (rank 0 reported first) keeps its state."""
    from prefect.client.orchestration import get_client
    from prefect.results import get_result_store
    from prefect.states import exception_to_failed_state
    from prefect.utilities.asyncutils import run_coro_as_sync

    from qosflow.prefect.stage import qosflow_stage

    try:
        store = get_result_store().update_for_flow(qosflow_stage)
        state = run_coro_as_sync(exception_to_failed_state(exc, result_store=store, write_result=True,
                                                           message=f"{GANG_FAILED_PREFIX}{where} failed:"))
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(fr.id, state)
    except Exception as err:  # noqa: BLE001 - its traceback is on the run's log already
        logger.warning("could not report the run Failed from %s: %s", where, err)


def _flush_logs() -> None:
    """Send the lines the process logged so far to the run's log (at most 5 s). (`APILogHandler.flush` is a method of
    a handler: called on the class, as until 2026-11-28, it raised a TypeError, swallowed here, and flushed nothing.)"""
    try:
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()
    except Exception:
        pass


def main(argv: list[str]) -> int:
    rank = gang_rank()
    if rank <= 0:
        _run_engine(gang_size() if os.environ.get("QOSFLOW_GANG_RANK") else 1)
        return 0
    fid = argv[1] if len(argv) > 1 else os.environ.get("PREFECT__FLOW_RUN_ID")
    if not fid:
        print("qosflow gang rank: no flow run id (PREFECT__FLOW_RUN_ID)", file=sys.stderr)
        return 1
    return run_rank(fid, rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

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
  Its prints go to its own output (the agent's or the pod's log). It writes one line to the run's log when it
  starts, and its traceback when the function raises; it exits 0 when the function returns, 1 when it raises
  (or the code of a `sys.exit`), which ends the gang as a failed rank always did.

A rank that raises reports the run `Failed` itself, with its exception persisted as the engine does (message
`qosflow gang: rank 1 of 2 on gpu-b failed: ValueError: ...`), so that the pipeline raises that exception; the
gang's other ranks are then stopped (SIGTERM), and rank 0's engine, which reported such a stop as `Crashed`
("aborted by a termination signal") over it, leaves a run that a rank failed so as it is.
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


#: the start of the message of the Failed state a rank other than 0 reports when the stage's function raised there
GANG_FAILED_PREFIX = "qosflow gang: "


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
                self.logger.info("stopped with its gang: %s", state.message)
                self.flow_run.state = state
                self._raised = exc
                return
        return orig(self, exc)

    handle_crash._qosflow_gang = True  # type: ignore[attr-defined]
    FlowRunEngine.handle_crash = handle_crash  # type: ignore[method-assign]


def _run_engine() -> None:
    import runpy
    import warnings

    _keep_a_rank_failure()

    with warnings.catch_warnings():  # ('prefect.engine' found in sys.modules after importing 'prefect': -m says the same)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


def _where(rank: int) -> str:
    import socket

    size = os.environ.get("QOSFLOW_GANG_SIZE") or "?"
    hosts = (os.environ.get("QOSFLOW_GANG_HOSTS") or "").split(",")
    host = hosts[rank] if 0 <= rank < len(hosts) and hosts[rank] else socket.gethostname()
    return f"rank {rank} of {size} on {host}"


def run_rank(flow_run_id: str, rank: int) -> int:
    """Rank `rank` (> 0) of the gang running flow run `flow_run_id`: the stage's function, not reported. Its exit code."""
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
    try:
        (fn, args, kwargs), _ = _unpack(_call("read_path", params["payload"]))
        logger.info("stage %s: %s runs the stage's function (rank 0 reports the run's state and result)", stage, where)
        fn(*args, **kwargs)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            logger.error("stage %s: %s exited with code %d (sys.exit)", stage, where, code)
    except BaseException as exc:  # (KeyboardInterrupt too: the rank ends, and its gang with it)
        code = 1
        logger.error("stage %s: %s failed: %s: %s\n%s", stage, where, type(exc).__name__, exc,
                     "".join(traceback.format_exception(exc)).rstrip())
        if isinstance(exc, Exception):
            _report_failed(fr, exc, where, logger)
    finally:
        _flush_logs()
    return code


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
    try:
        from prefect.logging.handlers import APILogHandler

        APILogHandler.flush()
    except Exception:
        pass


def main(argv: list[str]) -> int:
    rank = gang_rank()
    if rank <= 0:
        _run_engine()
        return 0
    fid = argv[1] if len(argv) > 1 else os.environ.get("PREFECT__FLOW_RUN_ID")
    if not fid:
        print("qosflow gang rank: no flow run id (PREFECT__FLOW_RUN_ID)", file=sys.stderr)
        return 1
    return run_rank(fid, rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

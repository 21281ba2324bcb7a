"""Lightweight progress reporting from inside a stage: the predictor's step timestamps.

Stage code calls

    qosflow.report_progress(step, total)        # after finishing step `step` (1-based) of `total`
    for batch in qosflow.track(loader):         # or wrap the training loop's iterable
        ...

A stage that picks its work up from a checkpoint says so before its first step, so that the worker
learns the duration of a whole run, not of the part this run did, and reads its speed from the steps
done since it started:

    qosflow.report_resumed(done, total)         # `done` steps of `total` were done by an earlier run
    for batch in qosflow.track(rest, total=total, start=done):   # or: the iterable of the steps left
        ...

Each call appends one JSON line ``{"t": <unix time>, "step": s, "total": n, "pid": p}`` to the file
named by the environment variable ``QOSFLOW_PROGRESS_FILE`` (the worker sets it and reads the file).
Without that variable both are no-ops costing a dictionary look-up, so stage code can call them
unconditionally; their arguments are checked either way (a bad step fails on a laptop as on the cluster). `read_progress` parses such a file (tolerating a half-written last line).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import IO, Iterable, Iterator, TypeVar

ENV_VAR = "QOSFLOW_PROGRESS_FILE"
#: "stderr": every line also goes to standard error, after ECHO_PREFIX, at most one per ECHO_INTERVAL_S (a
#: line that starts a resumed run or reaches `total` always; the last one held back at exit), for a worker
#: that sees the stage only through its log (a Kubernetes pod)
ECHO_ENV = "QOSFLOW_PROGRESS_ECHO"
ECHO_PREFIX = "qosflow-progress "
ECHO_INTERVAL_S = 0.5

T = TypeVar("T")

_fh: IO[str] | None = None
_fh_path: str | None = None
_fh_pid: int | None = None


def _channel() -> IO[str] | None:
    global _fh, _fh_path, _fh_pid
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    pid = os.getpid()
    if _fh is None or path != _fh_path or pid != _fh_pid:  # new file, or we were forked
        if _fh is not None and pid == _fh_pid:
            try:
                _fh.close()
            except OSError:
                pass
        _fh = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: one write(2) per line
        _fh_path, _fh_pid = path, pid
    return _fh


_echo_last = -1e9
_echo_held: str | None = None
_echo_timer: "threading.Timer | None" = None
_echo_lock = threading.Lock()
_echo_atexit = False


def _echo(line: str, force: bool) -> None:
    """Copy a progress line to standard error when ECHO_ENV asks for it: at most one per ECHO_INTERVAL_S;
    a line held back goes out when the interval ends (a timer) unless a newer one replaced it, or at exit."""
    global _echo_held, _echo_timer, _echo_atexit
    if os.environ.get(ECHO_ENV) != "stderr":
        return
    with _echo_lock:
        wait = ECHO_INTERVAL_S - (time.monotonic() - _echo_last)
        if force or wait <= 0:
            _emit(line)
            return
        _echo_held = line
        if _echo_timer is None:
            _echo_timer = threading.Timer(wait, _echo_flush)
            _echo_timer.daemon = True
            _echo_timer.start()
        if not _echo_atexit:
            import atexit

            atexit.register(_echo_flush)
            _echo_atexit = True


def _echo_after_fork() -> None:
    """A forked child has no timer thread and must not inherit a lock another thread held."""
    global _echo_lock, _echo_timer, _echo_held
    _echo_lock, _echo_timer, _echo_held = threading.Lock(), None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_echo_after_fork)


def _emit(line: str) -> None:
    global _echo_last, _echo_held
    _echo_last, _echo_held = time.monotonic(), None
    try:
        os.write(2, (ECHO_PREFIX + line).encode())
    except OSError:
        pass


def _echo_flush() -> None:
    global _echo_timer
    with _echo_lock:
        _echo_timer = None
        if _echo_held is not None:
            _emit(_echo_held)


def _write(fh: IO[str], line: str, force_echo: bool) -> None:
    fh.write(line)
    _echo(line, force_echo)


def report_progress(step: int, total: int | None = None) -> None:
    """Record that `step` steps (of `total`, if known) are done, with the current time.

    `step` and `total` are whole numbers >= 0 (an int, a numpy integer, or a float such as 3.0); anything
    else fails here, with or without a worker reading the progress."""
    if not (type(step) is int and step >= 0 and (total is None or type(total) is int and total >= 0)):
        step, total = _check_steps("report_progress", "step", step, total)
    fh = _channel()
    if fh is None:
        return
    if total is None:
        _write(fh, '{"t":%.6f,"step":%d,"pid":%d}\n' % (time.time(), step, _fh_pid), False)
    else:
        _write(fh, '{"t":%.6f,"step":%d,"total":%d,"pid":%d}\n' % (time.time(), step, total, _fh_pid), step >= total)


def report_resumed(step: int, total: int | None = None) -> None:
    """Record that this run starts with `step` steps (of `total`) already done by an earlier run, e.g. from
    a checkpoint. Call it once, before the first `report_progress`."""
    step, total = _check_resumed("report_resumed", "step", step, total)
    fh = _channel()
    if fh is None:
        return
    total_part = "" if total is None else ',"total":%d' % total
    _write(fh, '{"t":%.6f,"step":%d%s,"resumed":true,"pid":%d}\n' % (time.time(), step, total_part, _fh_pid), True)


def _whole(fn: str, arg: str, value) -> int:
    """`value` as an int, if it is a whole number (an int, a numpy integer, a float such as 3.0), else a
    SpecError naming the call and the argument. Without it a text, NaN or 2.5 was silently ignored where
    no worker reads the progress (a notebook, a test), and in the worker failed the stage with "%d format:
    a real number is required, not str" or was cut to a whole number."""
    import math
    import numbers
    import operator

    from qosflow.errors import SpecError

    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            if isinstance(value, numbers.Real):  # a float, numpy's float32 too, such as 3.0
                f = float(value)
                if math.isfinite(f) and f.is_integer():
                    return int(f)
    raise SpecError(arg, f"must be a whole number of steps, got {value!r}", where=fn)


def _check_steps(fn: str, arg: str, step, total) -> tuple[int, int | None]:
    """`step` and `total` (None: unknown) as whole numbers >= 0."""
    from qosflow.errors import SpecError

    step = _whole(fn, arg, step)
    if step < 0:
        raise SpecError(arg, f"must be >= 0 (the steps done so far), got {step}", where=fn)
    if total is not None:
        total = _whole(fn, "total", total)
        if total < 0:
            raise SpecError("total", f"must be >= 0 (the run's number of steps) or None (unknown), got {total}", where=fn)
    return step, total


def _check_resumed(fn: str, arg: str, done: int, total: int | None) -> tuple[int, int | None]:
    from qosflow.errors import SpecError

    done = _whole(fn, arg, done)
    total = None if total is None else _whole(fn, "total", total)
    if done < 0:
        raise ValueError(f"{fn}: {arg} must be >= 0 (the steps an earlier run did), got {done}")
    if total is not None and total < 0:  # was "start=0 is more than the run's total of -1 steps"
        raise SpecError("total", f"must be >= 0 (the run's number of steps) or None (unknown), got {total}", where=fn)
    if total is not None and done > total:
        raise ValueError(f"{fn}: {arg}={done} is more than the run's total of {total} steps")
    return done, total


def track(iterable: Iterable[T], total: int | None = None, *, start: int = 0) -> Iterator[T]:
    """Yield the items of `iterable`, reporting a step each time the loop body for one item finishes.

    `start`: steps an earlier run already did (a run resumed from a checkpoint; `iterable` then holds the
    steps left): reported with `report_resumed`, and the steps counted on from it. `total` (default
    `start` + the iterable's length, when it has one) is the whole run's step count. A bad `start` fails
    here, not at the first step."""
    start = _whole("track", "start", start)  # before len(): a text start is no TypeError of `+`
    if total is None:
        try:
            total = start + len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    start, total = _check_resumed("track", "start", start, total)
    return _tracked(iterable, total, start)


def _tracked(iterable: Iterable[T], total: int | None, start: int) -> Iterator[T]:
    if _channel() is None:
        yield from iterable
        return
    if start:
        report_resumed(start, total)
    else:
        report_progress(0, total)
    step = start
    for item in iterable:
        yield item
        step += 1
        report_progress(step, total)


@dataclass(frozen=True)
class ProgressEvent:
    t: float
    step: int
    total: int | None
    pid: int | None
    #: the run starts here with `step` steps done by an earlier run (`report_resumed`)
    resumed: bool = False


def read_progress(path: str | os.PathLike[str]) -> list[ProgressEvent]:
    """The events of a progress file, in file order. A malformed or half-written line is skipped."""
    out: list[ProgressEvent] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    break  # being written right now
                try:
                    d = json.loads(line)
                    out.append(ProgressEvent(float(d["t"]), int(d["step"]), d.get("total"), d.get("pid"),
                                             bool(d.get("resumed", False))))
                except (ValueError, KeyError, TypeError):
                    continue
    except FileNotFoundError:
        return []
    return out


def step_times(events: list[ProgressEvent]) -> list[float]:
    """Durations of the individual steps (seconds) from consecutive events of one run."""
    out = []
    for a, b in zip(events, events[1:]):
        ds = b.step - a.step
        if ds > 0 and b.t >= a.t:
            out.extend([(b.t - a.t) / ds] * ds)
    return out

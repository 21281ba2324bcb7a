"""Worker processes for independent runs (simulations, packing seeds): how many, and how they start.

The runs of `qosflow simulate` and `qosflow pack` are independent and deterministic, so they may go
to worker processes at once and give the same results. Two rules shared by both:

- **How many** (`default_workers`): one per CPU core this process may use, at most one per run; none
  for a small batch, whose runs take less time than workers take to start.
- **How they start** (`start_pool`): forked when this process runs no other thread (at once, sharing
  what is loaded), else spawned (a fresh interpreter each, a second or so), because a forked child
  of a threaded process can deadlock on a lock another thread held at the fork. So start the pool
  before a progress bar that redraws from a thread of its own.

Workers ignore Ctrl-C: it reaches the whole process group, and the parent stops them
(`Pool.terminate`) rather than each printing a traceback of its own. SIGTERM, which that sends, kills
a worker whatever handler a forked one inherited.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")


def cpu_cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers(runs: int, size: int, small: int) -> int:
    """One worker per CPU core, at most one per run; 1 (this process) when `runs x size < small`."""
    if runs * size < small:
        return 1
    return max(1, min(runs, cpu_cores()))


def remote_runs(runs: Sequence[T], workers: int, movable: Callable[[T], bool]) -> list[T]:
    """The runs that go to worker processes, in their order: those `movable` (importable in a fresh
    interpreter), when `workers` > 1; none if fewer than two (one run alone gains nothing from a
    worker). Callers submit them costliest first, so that no long run starts last while the other
    workers idle."""
    remote = [r for r in runs if workers > 1 and movable(r)]
    return remote if len(remote) >= 2 else []


def _init(initializer: Callable[..., None], args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM is how `Pool.terminate` stops a worker. A forked worker inherits the parent's handler; one
    # that returns (uvicorn's only sets a flag) keeps the worker alive, and terminate's join waits for it
    # (a test run hung so once: a worker idle on the task queue's lock after terminate).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    initializer(*args)


def start_pool(workers: int, initializer: Callable[..., None], initargs: tuple, start_method: str | None = None) -> tuple[Any, Any, str]:
    """(pool, a queue its workers may report on, start method): `workers` processes, each running
    `initializer(queue, *initargs)` first. `start_method` None chooses as the module doc says."""
    import multiprocessing as mp
    import threading

    method = start_method or ("fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    pool = ctx.Pool(workers, initializer=_init, initargs=(initializer, (queue, *initargs)))
    return pool, queue, method

"""Run several simulations of one workload -- one per (policy, estimator) -- one after another or in
worker processes at once.

Each run is independent and deterministic (its seed fixes deadlines, failures and noise), so running
them in parallel changes nothing but the wall time: every run's result is the same job by job. The
runs' results come back in the order they were asked for, whatever order they finish in.

Only qosflow's own policies go to worker processes: a policy registered at run time by the caller's
code (`qosflow.policies.register`) may not exist in a fresh interpreter, so its runs stay in this
process.
"""

from __future__ import annotations

import queue as queue_mod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.core.speed import SpeedModel
from qosflow.sim.engine import SimConfig, SimResult, SimulationError, Simulator
from qosflow.workers import default_workers as workers_for
from qosflow.workers import remote_runs, start_pool


@dataclass(frozen=True)
class RunSpec:
    """One simulation of the batch: a policy with its options, under one kind of estimates."""

    label: str
    policy: str
    estimator: str = "oracle"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunOutcome:
    """A run's result, or why it stopped (a `SimulationError`'s message); `estimator` is the
    estimator's own name (e.g. ``noisy±30%``)."""

    spec: RunSpec
    result: SimResult | None
    estimator: str
    error: str | None = None


#: (label, jobs done, jobs in all) -- what a run reports as it goes
Progress = Callable[[str, int, int], None]


def _run(spec: RunSpec, jobs: Sequence[Job], cluster: ClusterSpec, speed: SpeedModel, config: SimConfig,
         seed: int, error: float, on_progress: Callable[[int, int], None] | None) -> RunOutcome:
    """One run, the same in this process and in a worker."""
    from qosflow.core.estimate import make_estimator
    from qosflow.policies import get_policy

    est = make_estimator(spec.estimator, speed, seed=seed, error=error)
    name = getattr(est, "name", spec.estimator)
    sim = Simulator(jobs, cluster, get_policy(spec.policy, **spec.options), estimator=est, speed=speed, config=config)
    try:
        return RunOutcome(spec, sim.run(on_progress=on_progress), name)
    except SimulationError as exc:  # one policy stalling must not hide the others' results
        return RunOutcome(spec, None, name, str(exc))


# ------------------------------------------------------------------ worker side
_WORKER: dict[str, Any] = {}


def _worker_init(progress_queue, jobs, cluster, speed, config, seed, error) -> None:
    _WORKER.update(queue=progress_queue, args=(jobs, cluster, speed, config, seed, error))


def _worker_run(index: int, spec: RunSpec) -> RunOutcome:
    q = _WORKER["queue"]
    step = {"last": -1}

    def report(done: int, total: int) -> None:
        # at most about 200 messages per run: the parent redraws a bar, it needs no more
        if done == total or done - step["last"] >= max(1, total // 200):
            step["last"] = done
            q.put((index, done, total))

    return _run(spec, *_WORKER["args"], report)


def _in_worker(spec: RunSpec) -> bool:
    """May this run go to a worker process (is its policy one of qosflow's own, importable there)?"""
    from qosflow.policies import is_builtin

    return is_builtin(spec.policy)


#: below this many job-runs (jobs x runs) a batch runs in this process by default: its runs take
#: well under a second each, less than worker processes take to start
SMALL_BATCH = 2000


def default_workers(runs: int, jobs: int) -> int:
    """One worker per CPU core this process may use, at most one per run; 1 for a small batch."""
    return workers_for(runs, jobs, SMALL_BATCH)


class Batch:
    """Runs every spec over `jobs` on `cluster`; up to `workers` at once in worker processes (1: all
    in this process, one after another). Use it as a context manager; `run` returns the outcomes in
    the order of `specs`.

    The worker processes start when the batch is entered, forked or spawned as `qosflow.workers`
    says: enter the batch before starting a progress bar. `start_method` chooses instead.

    Results are the same job by job whichever way the runs go (tests/test_sim_batch.py checks it)."""

    def __init__(
        self,
        specs: Sequence[RunSpec],
        jobs: Sequence[Job],
        cluster: ClusterSpec,
        speed: SpeedModel,
        config: SimConfig,
        *,
        seed: int = 0,
        error: float = 0.3,
        workers: int = 1,
        start_method: str | None = None,
    ):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.specs = list(specs)
        self.args = (list(jobs), cluster, speed, config, seed, error)
        #: indexes of the runs that go to worker processes
        self.remote = remote_runs(range(len(self.specs)), workers, lambda i: _in_worker(self.specs[i]))
        self.workers = min(workers, len(self.remote)) if self.remote else 1
        #: how the workers start: "fork", "spawn", or None (chosen when the batch is entered)
        self.start_method = start_method
        self._pool = self._queue = None

    def __enter__(self) -> "Batch":
        if self.remote:
            self._pool, self._queue, self.start_method = start_pool(self.workers, _worker_init, self.args, self.start_method)
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.terminate()  # (after `run` every worker is idle: nothing is lost)
            self._pool.join()
            self._pool = None

    def run(self, on_progress: Progress | None = None) -> list[RunOutcome]:
        specs, out = self.specs, [None] * len(self.specs)
        if self.remote and self._pool is None:
            raise RuntimeError("enter the batch (`with Batch(...) as batch:`) before running it")
        # the costliest first (`qosflow.workers.remote_runs`); the outcomes keep the order of `specs`
        order = sorted(self.remote, key=lambda i: -_cost(specs[i]))
        pending = {i: self._pool.apply_async(_worker_run, (i, specs[i])) for i in order}
        # the runs that stay here go while the workers compute
        for i, spec in enumerate(specs):
            if i not in pending:
                out[i] = _run(spec, *self.args, _reporter(on_progress, spec.label))
        while pending:
            try:
                i, done, total = self._queue.get(timeout=0.2)
                if on_progress is not None and i in pending:  # (a finished run's last report may come late)
                    on_progress(specs[i].label, done, total)
            except queue_mod.Empty:
                pass
            for i in [i for i, r in pending.items() if r.ready()]:
                out[i] = pending.pop(i).get()  # re-raises a worker's unexpected error here
                if on_progress is not None and out[i].result is not None:
                    n = len(self.args[0])
                    on_progress(specs[i].label, n, n)
        return out


def _cost(spec: RunSpec) -> float:
    """A run's rough cost, for the order in which runs start: its policy's `relative_cost` (the
    estimator hardly matters: on the Muri trace a learned run takes about as long as an oracle one)."""
    from qosflow.policies import policy_class

    return policy_class(spec.policy).relative_cost


def _reporter(on_progress: Progress | None, label: str) -> Callable[[int, int], None] | None:
    if on_progress is None:
        return None
    return lambda done, total: on_progress(label, done, total)

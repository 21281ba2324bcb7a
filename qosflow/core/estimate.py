"""What policies know: estimates of durations, remaining times and slowdowns.

Policies never read a job's true duration. They ask an `Estimator`:

* `OracleEstimator` -- the truth (an upper bound on what prediction can give);
* `NoisyEstimator` -- the truth times a seeded per-job error (e.g. +-30 %), for sensitivity studies;
* `DeclaredEstimator` -- what the user declared (`expected_duration`) or, failing that, a default;
* the learned predictor (`qosflow.predict`) implements the same protocol.

An estimator may also say how far off it may be: `remaining_high` and `pair_slowdown_high` give
pessimistic values (about the `HIGH_QUANTILE` quantile of the truth given the estimate). They are
optional; `remaining_high(est, js)` and `pair_slowdown_high(est, a, b)` below fall back to the point
estimate, i.e. no stated uncertainty -- which is exact for the oracle. The qosflow policy checks
deadline promises against them (docs/policies.md, "Deadline checks on the stated error band").

On a cluster of mixed GPU models an estimator may also say how fast a job runs on each model:
`gpu_speed(job, gpu_model)`, relative to the GPU its `duration` is for (optional; `gpu_speed(est, ...)`
below falls back to 1.0, every model alike).
"""

from __future__ import annotations

import hashlib
import math
from statistics import NormalDist
from typing import Protocol, runtime_checkable

from qosflow.core.job import Job, JobState
from qosflow.core.speed import SpeedModel


#: the quantile of the truth a pessimistic ("high") estimate stands for
HIGH_QUANTILE = 0.9
#: the standard normal's HIGH_QUANTILE quantile (1.2816): a normal band's "high" is the mean + Z_HIGH sd
Z_HIGH = round(NormalDist().inv_cdf(HIGH_QUANTILE), 4)
#: the log-normal sd of a user's declared duration (declarations are rough): the band every live
#: estimator states around one until the stage's own runs say more
DECLARED_LOG_SD = 0.5
#: a declared duration's pessimistic factor: the HIGH_QUANTILE quantile of that log-normal band (x 1.9)
DECLARED_HIGH_FACTOR = math.exp(Z_HIGH * DECLARED_LOG_SD)


@runtime_checkable
class Estimator(Protocol):
    name: str

    def duration(self, job: Job) -> float:
        """Estimated isolated running time of the whole job (seconds)."""

    def remaining(self, js: JobState) -> float:
        """Estimated isolated time left, given the job's observed progress."""

    def pair_slowdown(self, a: Job, b: Job) -> tuple[float, float]:
        """Estimated (xi_a, xi_b) if a and b share GPUs."""

    def spread_slowdown(self, job: Job, num_nodes: int, min_nodes: int) -> float: ...

    def cpu_factor(self, job: Job, cores: float) -> float: ...


def remaining_high(est, js: JobState) -> float:
    """A pessimistic remaining time of `js` (about the HIGH_QUANTILE quantile of the truth), from an
    estimator that states one; otherwise its point estimate (no stated uncertainty)."""
    f = getattr(est, "remaining_high", None)
    return f(js) if f is not None else est.remaining(js)


def gpu_speed(est, job: Job, gpu_model: str) -> float:
    """The job's speed on a GPU of `gpu_model` relative to the GPU its estimated duration is for, from
    an estimator that knows GPU models; 1.0 (every model alike) from one that does not."""
    f = getattr(est, "gpu_speed", None)
    return f(job, gpu_model) if f is not None else 1.0


def placement_gpu_speed(est, job: Job, placement, node_models) -> float:
    """The job's speed on the GPUs of `placement` (`gpu_speed`; `node_models`: per node, its GPU model):
    its slowest GPU's, the pace of a gang spread over models."""
    return min(gpu_speed(est, job, node_models[n]) for n in {n for n, _ in placement.gpus})


def pair_slowdown_high(est, a: Job, b: Job) -> tuple[float, float]:
    """Pessimistic (xi_a, xi_b) if a and b share GPUs; the point estimate from an estimator that
    states no uncertainty."""
    f = getattr(est, "pair_slowdown_high", None)
    return f(a, b) if f is not None else est.pair_slowdown(a, b)


class OracleEstimator:
    """Exact knowledge of every job (the simulator's truth)."""

    name = "oracle"

    def __init__(self, speed: SpeedModel | None = None):
        self.speed = speed or SpeedModel()

    def duration(self, job: Job) -> float:
        return job.duration

    def remaining(self, js: JobState) -> float:
        return self.duration(js.job) * max(0.0, 1.0 - js.progress)

    def pair_slowdown(self, a: Job, b: Job) -> tuple[float, float]:
        return self.speed.pair_slowdown(a, b)

    # the truth has no error band: the pessimistic values are the point estimates (subclasses that
    # override the point estimates without these state no band either)
    def remaining_high(self, js: JobState) -> float:
        return self.remaining(js)

    def pair_slowdown_high(self, a: Job, b: Job) -> tuple[float, float]:
        return self.pair_slowdown(a, b)

    def spread_slowdown(self, job: Job, num_nodes: int, min_nodes: int) -> float:
        return self.speed.spread_slowdown(job, num_nodes, min_nodes)

    def cpu_factor(self, job: Job, cores: float) -> float:
        return self.speed.cpu_factor(job, cores)

    def gpu_speed(self, job: Job, gpu_model: str) -> float:
        return self.speed.gpu_speed(job, gpu_model)


def _unit(seed: int, key: str) -> float:
    """A deterministic number in [0, 1) for (seed, key), stable across processes."""
    h = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


class NoisyEstimator(OracleEstimator):
    """The truth times a per-job error drawn once, uniformly in [1 - error, 1 + error] (seeded).

    Slowdown estimates get the same relative error on their excess over 1.

    It states its error band honestly: the truth is the estimate over f, f uniform in
    [1 - error, 1 + error] and independent of the truth (with a scale-free prior on the truth, the
    posterior of f given the estimate is that same uniform law). So the q-quantile of the truth is
    the estimate / (1 - error * (2q - 1)) -- for q = HIGH_QUANTILE and +-30 %, x 1.316. The error of
    a running job's remaining time is its duration's (its progress does not correct the estimate).
    """

    def __init__(self, speed: SpeedModel | None = None, *, error: float = 0.3, seed: int = 0):
        super().__init__(speed)
        if not 0 <= error < 1:
            from qosflow.errors import SpecError

            raise SpecError("error", f"the noisy estimator's relative error must be in [0, 1) (0.3 = +-30 %), got {error!r}")
        self.error = error
        self.seed = seed
        self.name = f"noisy±{error * 100:g}%"
        self._dur: dict[str, float] = {}
        #: the truth is at most the estimate times this, with probability HIGH_QUANTILE
        self.high_factor = 1.0 / (1.0 - error * (2.0 * HIGH_QUANTILE - 1.0))

    def _factor(self, key: str) -> float:
        return 1.0 + self.error * (2.0 * _unit(self.seed, key) - 1.0)

    def duration(self, job: Job) -> float:
        d = self._dur.get(job.job_id)
        if d is None:
            d = job.duration * self._factor("dur:" + job.job_id)
            self._dur[job.job_id] = d
        return d

    def pair_slowdown(self, a: Job, b: Job) -> tuple[float, float]:
        xa, xb = self.speed.pair_slowdown(a, b)
        fa = self._factor(f"xi:{a.job_id}:{b.job_id}")
        fb = self._factor(f"xi:{b.job_id}:{a.job_id}")
        return 1.0 + (xa - 1.0) * fa, 1.0 + (xb - 1.0) * fb

    def gpu_speed(self, job: Job, gpu_model: str) -> float:
        # a profile on each model measures the speed ratio: off by the same error as a duration
        v = self.speed.gpu_speed(job, gpu_model)
        return v if v == 1.0 else v * self._factor(f"gpu:{job.job_id}:{gpu_model}")

    def remaining_high(self, js: JobState) -> float:
        return self.remaining(js) * self.high_factor

    def pair_slowdown_high(self, a: Job, b: Job) -> tuple[float, float]:
        xa, xb = self.pair_slowdown(a, b)
        h = self.high_factor
        return 1.0 + (xa - 1.0) * h, 1.0 + (xb - 1.0) * h


class DeclaredEstimator(OracleEstimator):
    """Only what was declared: `Job.expected_duration`, else `default_duration`.

    Used by the live worker before the learned predictor has data; the truth is never read.

    A declaration is rough, so it states the band every live estimator states around one: log-normal
    with sd DECLARED_LOG_SD (the truth is below the declared time x 1.9 with probability
    HIGH_QUANTILE). The default duration is no statement about the job at all and states no band;
    pair slowdowns are the speed model's, without a band.
    """

    name = "declared"

    def __init__(self, speed: SpeedModel | None = None, *, default_duration: float = 600.0):
        super().__init__(speed)
        self.default_duration = default_duration

    def duration(self, job: Job) -> float:
        return job.expected_duration or self.default_duration

    def remaining_high(self, js: JobState) -> float:
        r = self.remaining(js)
        return r * DECLARED_HIGH_FACTOR if js.job.expected_duration else r


def make_estimator(kind: str, speed: SpeedModel | None = None, *, seed: int = 0, error: float = 0.3):
    from qosflow.errors import UnknownNameError

    kinds = {"oracle", "noisy", "declared"}
    if kind == "oracle":
        return OracleEstimator(speed)
    if kind == "noisy":
        return NoisyEstimator(speed, error=error, seed=seed)
    if kind == "declared":
        return DeclaredEstimator(speed)
    if kind == "learned":
        from qosflow.predict.estimator import LearnedEstimator  # noqa: PLC0415  (issue 4)

        return LearnedEstimator(speed, seed=seed)
    raise UnknownNameError("estimator", kind, sorted(kinds | {"learned"}))

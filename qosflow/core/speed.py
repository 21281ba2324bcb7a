"""How fast a job runs where it is placed: the interference and speed model.

Three effects slow a job below its isolated speed (rate 1.0), and a fourth sets that speed on a
cluster of mixed GPU models:

* co-location with another whole-GPU job on the same GPUs (slowdown xi >= 1, from a measured
  interference table such as Gavel's, or from the two jobs' per-iteration resource profiles);
* spreading a gang over more nodes than it needs (cross-node traffic; Gavel measured
  "unconsolidated" throughputs, the Philly study found locality drives JCT);
* too few CPU cores to feed its GPUs (CODA: speed grows with cores until it saturates);
* the GPU model it runs on (`gpu_speed`: its speed there relative to the GPU its duration is given
  for; a gang spread over models runs at its slowest GPU's pace). Gavel's table measured three models:
  a K80 runs ResNet-50 at 0.14 x a V100, its recommender at 1.4 x.

The simulator advances jobs with a `SpeedModel` (the truth); policies see the same effects only
through an `Estimator` (oracle, noisy or learned).
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence, runtime_checkable

from qosflow.core.job import Job
from qosflow.core.placement import Placement


@runtime_checkable
class InterferenceSource(Protocol):
    """A table of measured pair slowdowns and spread penalties, keyed by job type (`Job.model`)."""

    def pair_slowdown(self, model_a: str, model_b: str, gpus: int = 1) -> tuple[float, float] | None:
        """(xi_a, xi_b) >= 1 when the two share GPUs, or None if the table does not know the pair."""

    def spread_slowdown(self, model: str, gpus: int) -> float | None:
        """Slowdown of a `gpus`-GPU job spread over nodes instead of consolidated, or None."""

    # optional: gpu_speed(model, gpus, gpu_model) -> float | None, the job type's solo speed on GPUs of
    # that model relative to the GPU type the table (and a trace's durations) is for


#: default cores per GPU that saturate a training job's input pipeline (CODA measured 4-6 for CV models)
DEFAULT_CPU_SATURATION = 4.0
#: default pair slowdown when nothing is known about either job (Gavel's table: median about 1.4)
DEFAULT_PAIR_SLOWDOWN = 1.4
#: default slowdown of a spread gang when nothing is known (Gavel: unconsolidated median about 1.2)
DEFAULT_SPREAD_SLOWDOWN = 1.2


def profile_pair_slowdown(pa: Sequence[float], pb: Sequence[float]) -> tuple[float, float]:
    """Slowdown of two co-located jobs from their per-iteration resource profiles (Muri's idea).

    Each profile gives the time one iteration spends on each resource stage (data loading/CPU,
    GPU compute, network). Two jobs interleave their stages: on each resource they queue behind
    each other, so a pair's combined iteration takes about max(sum per resource, each job's own
    iteration) -- jobs with different bottlenecks overlap well, jobs with the same one do not.
    """
    ta, tb = float(sum(pa)), float(sum(pb))
    if ta <= 0 or tb <= 0:
        return DEFAULT_PAIR_SLOWDOWN, DEFAULT_PAIR_SLOWDOWN
    k = max(len(pa), len(pb))
    a = list(pa) + [0.0] * (k - len(pa))
    b = list(pb) + [0.0] * (k - len(pb))
    # one interleaved round runs one iteration of each job; its length is bounded below by the busiest
    # resource and by each job's own iteration
    round_time = max(max(x + y for x, y in zip(a, b)), ta, tb)
    # small context-switch cost of sharing (Muri/SJF-BSBF measured a few per cent)
    round_time *= 1.03
    return max(1.0, round_time / ta), max(1.0, round_time / tb)


def width_fraction(job: Job, placement: Placement) -> float:
    """The share of its declared GPUs an elastic job (`QoSSpec.min_gpus`) started on: width / gpus,
    1.0 for a job on all of them (and for fractional and CPU-only placements)."""
    g = job.qos.gpus
    w = len(placement.gpus)
    return w / g if 0 < w < g and placement.gpu_milli >= 1000 else 1.0


class SpeedModel:
    """The true speed of jobs in the simulator; also the basis of the oracle estimator."""

    def __init__(
        self,
        interference: InterferenceSource | None = None,
        *,
        default_pair: float = DEFAULT_PAIR_SLOWDOWN,
        default_spread: float = DEFAULT_SPREAD_SLOWDOWN,
        cpu_exponent: float = 0.8,
    ):
        self.interference = interference
        self.default_pair = default_pair
        self.default_spread = default_spread
        self.cpu_exponent = cpu_exponent
        self._pair_cache: dict[tuple[str, str, int, tuple | None, tuple | None], tuple[float, float]] = {}
        self._speed_cache: dict[tuple[str, int, str], float] = {}

    def describe(self) -> str:
        """Where pair and spread slowdowns come from, in a line (the simulate report prints it)."""
        fallback = f"the jobs' per-iteration resource profiles where both have one, else {self.default_pair:g}x per pair"
        if self.interference is None:
            return f"pair slowdowns: {fallback}; spread: {self.default_spread:g}x"
        src = getattr(self.interference, "describe", None)
        return f"pair and spread slowdowns: {src() if src is not None else repr(self.interference)}; other models: {fallback}"

    # -------------------------------------------------------------- components
    def pair_slowdown(self, a: Job, b: Job) -> tuple[float, float]:
        key = (a.model, b.model, a.qos.gpus, a.resource_profile, b.resource_profile)
        hit = self._pair_cache.get(key)
        if hit is not None:
            return hit
        res = None
        if self.interference is not None:
            res = self.interference.pair_slowdown(a.model, b.model, a.qos.gpus)
        if res is None and a.resource_profile and b.resource_profile:
            res = profile_pair_slowdown(a.resource_profile, b.resource_profile)
        if res is None:
            res = (self.default_pair, self.default_pair)
        res = (max(1.0, float(res[0])), max(1.0, float(res[1])))
        self._pair_cache[key] = res
        return res

    def spread_slowdown(self, job: Job, num_nodes: int, min_nodes: int) -> float:
        if num_nodes <= min_nodes:
            return 1.0
        s = None
        if self.interference is not None:
            s = self.interference.spread_slowdown(job.model, job.qos.gpus)
        if s is None:
            s = self.default_spread
        # more extra nodes, more cross-node traffic: scale the measured penalty with the excess
        extra = (num_nodes - min_nodes) / max(1, num_nodes - 1)
        return 1.0 + (max(1.0, s) - 1.0) * min(1.0, extra * 2.0)

    def gpu_speed(self, job: Job, gpu_model: str) -> float:
        """The job's solo speed on a GPU of `gpu_model` relative to the GPU its duration is for (1.0 where
        the table does not know the job type or the model, or there is no table)."""
        key = (job.model, job.qos.gpus, gpu_model)
        hit = self._speed_cache.get(key)
        if hit is None:
            f = getattr(self.interference, "gpu_speed", None)
            v = f(job.model, max(1, job.qos.gpus), gpu_model) if f is not None else None
            hit = self._speed_cache[key] = float(v) if v and v > 0 and math.isfinite(v) else 1.0
        return hit

    def gpu_types_matter(self, gpu_models: Sequence[str]) -> bool:
        """Do these GPU models (a cluster's) run any job at other than its given speed -- does the table
        know any of them other than its own type? False without a table that knows GPU types."""
        types = getattr(self.interference, "type_solo", None)
        base = getattr(self.interference, "gpu_type", None)
        if not types:
            return False
        from qosflow.core.gpu_names import short_gpu_model  # noqa: PLC0415

        return any(short_gpu_model(m) in types and short_gpu_model(m) != base for m in set(gpu_models))

    def cpu_factor(self, job: Job, cores: float) -> float:
        """Speed multiplier (<= 1) from the CPU cores a job holds (CODA's saturating curve).

        The curve saturates at `job.cpu_saturation` cores per GPU when that is known (profiled);
        otherwise at the cores the job asked for: a job given what it asked for runs at full speed.
        A GPU job that asked for no cores (`cpu_cores=0`, which `QoSSpec` allows) runs at full speed on
        none: it holds no core of its own, and the model cannot tell how much of the node's others it
        uses. (Its speed was 0: it held its GPUs for ever, and the simulator stopped with it running.)
        """
        gpus = max(job.qos.gpus, 1)
        if job.cpu_saturation is not None and job.qos.gpus > 0:
            sat = job.cpu_saturation * gpus
        else:
            sat = max(job.qos.cpu_cores, 1e-9)
        if cores >= sat:
            return 1.0
        if cores <= 0:
            return 1.0 if job.qos.cpu_cores <= 0 else 0.0
        return (cores / sat) ** self.cpu_exponent

    # -------------------------------------------------------------- combined
    def rate(
        self,
        job: Job,
        placement: Placement,
        co_runners: Sequence[Job] = (),
        *,
        gpus_per_node: int = 8,
        gpu_models: Sequence[str] = (),
    ) -> float:
        """Fraction of isolated speed the job runs at under this placement (at most 1, unless a GPU model in
        `gpu_models` -- those of its GPUs, given on a cluster of mixed models -- runs it faster than the GPU
        its duration is for). A gang runs at the pace of its slowest GPU."""
        r = min([self.gpu_speed(job, m) for m in gpu_models]) if gpu_models else 1.0
        if co_runners and placement.gpu_milli >= 1000:
            worst = 1.0
            for other in co_runners:
                worst = max(worst, self.pair_slowdown(job, other)[0])
            r /= worst
        width = len(placement.gpus)
        f = width_fraction(job, placement)
        if width > 1:
            n_nodes = len({n for n, _ in placement.gpus})
            min_nodes = -(-width // max(1, gpus_per_node))
            r /= self.spread_slowdown(job, n_nodes, min_nodes)
        if placement.cpu:
            # (on fewer GPUs than asked for, the cores that feed them are fewer in proportion)
            r *= self.cpu_factor(job, placement.cpu_cores / f)
        # an elastic start on fewer GPUs: each optimizer step accumulates gpus / width passes of the same
        # per-GPU batch, so the job runs at width / gpus of its speed (no credit taken for the gradient
        # exchange it saves)
        r *= f
        if placement.sub_batch is not None:
            # gradient accumulation with smaller sub-batches costs a little GPU efficiency (SJF-BSBF measured
            # a few per cent); one small-batch pass per accumulation step
            r /= 1.0 + 0.02 * (placement.sub_batch.accumulation_steps - 1)
        return r

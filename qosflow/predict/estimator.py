"""`LearnedEstimator`: the policies' `Estimator` protocol answered by the predictor.

Policies see estimates only through `qosflow.core.estimate.Estimator` (duration, remaining,
pair_slowdown, spread_slowdown, cpu_factor). This module answers those questions from what can be
known in practice -- a lightweight profile per job signature, the shipped reference table and every
finished stage -- never from a job's true duration:

* **durations**: (a) for a job with a known number of iterations, iterations x its step time, the
  step time coming from the measurements of its signature at its GPU count (profiling, then every
  finished stage: the history), else from the predictor's step-time models; (b) for a job without
  iterations, the history of durations of its signature (same user first); a declared
  ``expected_duration`` is the prior these measurements update (`_declared_and_measured`), and the
  answer while nothing is measured; (c) a default, said to be one;
* **remaining time** from progress: for an iteration-counted job, the predicted duration times the
  work left (the elapsed wall time includes co-location and spreading slowdowns, so it says little
  about the *isolated* rate the protocol asks for); otherwise `Predictor.predict_remaining`, which
  blends the observed rate with the prior;
* **pair slowdowns** from the interference model (cold-started from the reference table plus the job's
  profile: solo 1-GPU step time and co-located speed with the reference jobs, both ways), replaced by
  measurements once the pair has been seen sharing GPUs;
* **spread slowdowns** from the solo-scaling model (predicted spread vs consolidated step time),
  calibrated by the measured penalties of the signature's spread jobs;
* **CPU factor** from the CPU model (CODA's saturating curve, fitted to two core counts when profiled);
* **GPU speeds** (`gpu_speed(job, model)`: the job's speed on a GPU model relative to the *reference GPU*,
  the one its durations are for) from the signature's own measurements on both models, else the
  reference table's per-type step times, else the ratio pooled over the signatures measured on both,
  else 1.0 (`predict_gpu_speed` says which). Measurements taken on another model are converted to the
  reference GPU with it, so that a duration divided by the speed on a model is what that model measured.

Two ways to build one:

* live (the worker): ``LearnedEstimator.from_store(store)`` (``make_estimator("learned")`` without a
  speed model opens the default store) -- the predictor loads the store's samples and profiles, the
  duration history comes from the stage history, and `observe(job, actual_s)` (the worker's hook)
  writes every finished stage back. No simulator truth is involved.
* simulation: ``LearnedEstimator(speed, seed=...)`` (what ``make_estimator("learned", speed)`` builds).
  A fresh predictor starts from the reference table only (never the user's store, so runs are
  reproducible). *Profiling is simulated*: the first time a job signature is seen, a
  `SimulatedProfiler` "measures" what lightweight profiling would -- the job's step time at its GPU
  count, its co-located speed with the fixed reference jobs (and theirs with it) and its speed at two
  CPU core counts -- from the simulator's truth `SpeedModel` and the job's true step time, times seeded
  log-normal measurement noise. The simulator calls `observe_finished(job_state, now)` when a job
  finishes; the estimator then learns the job's per-iteration time and duration, its slowdown next to
  the jobs it shared GPUs with and its spread penalty (with the same measurement noise). Running jobs
  are also read from their progress whenever a policy asks for their remaining time (`_in_flight`), as a
  worker reads progress reports.

Every answer is available with its basis: `predict_duration`, `predict_remaining`, `predict_pair`,
`predict_spread`, `predict_cpu` return `qosflow.predict.Prediction` objects; the protocol methods
return their values. Answers are cached per job (durations), per signature pair (slowdowns) and per
signature and GPU count (spread), and invalidated when what they rest on changes.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from qosflow.core.estimate import DECLARED_HIGH_FACTOR, DECLARED_LOG_SD
from qosflow.core.estimate import Z_HIGH as Z90
from qosflow.core.estimate import _unit, placement_gpu_speed
from qosflow.core.speed import width_fraction
from qosflow.core.gpu_names import CPU_ONLY, short_gpu_model
from qosflow.core.job import Job, JobState
from qosflow.predict.cpu import CpuCurve, fit_curve
from qosflow.predict.prediction import INFEASIBLE_SLOWDOWN, Prediction
from qosflow.predict.reference import parse_signature
from qosflow.predict.stats import SINGLE_SAMPLE_LOG_SD, LogStat

if TYPE_CHECKING:
    from qosflow.core.speed import SpeedModel
    from qosflow.predict.predictor import Predictor

log = logging.getLogger(__name__)

#: log-normal sd of one simulated profiling measurement (a step time over a few dozen steps, a speed ratio)
PROFILE_NOISE = 0.05
#: How cautiously the scheduler plans with the slowdown of a pair never measured together: the
#: geometric point this far from the model's estimate toward its 90th percentile (0: the estimate,
#: 1: the percentile). The costs are not symmetric: co-locating a deadline job next to a partner that
#: slows it more than predicted loses the deadline, while overestimating a slowdown only forgoes some
#: sharing. Measured pairs (samples, Gavel's reference table) are planned with their estimate. On the
#: Muri trace (8 seeds) this halved the deadlines lost to learned estimates (docs/bench/learned_sim.md).
UNMEASURED_PAIR_CAUTION = 0.5
#: duration assumed when nothing is known (seconds), and its log sd
DEFAULT_DURATION = 600.0
DEFAULT_LOG_SD = 1.0
#: slowdown bounds handed to policies: at most what the predictor says of pairs measured failing together
MAX_SLOWDOWN = INFEASIBLE_SLOWDOWN
#: refit the interference model after this many newly measured co-located pairs
PAIR_REFIT_EVERY = 8
#: simulation: a running job's slowdown is read from its progress over intervals of at least this (seconds)
IN_FLIGHT_INTERVAL = 1800.0
#: log sd of a job's speed on a GPU model taken from *other* signatures' measured ratios, while fewer than
#: MIN_SAMPLES of them are pooled: jobs differ a lot (Gavel's K80 runs ResNet-50 at 0.14 x a V100, its
#: recommender at 1.4 x; the log ratios of its table spread by about this much)
POOLED_SPEED_LOG_SD = 0.6
#: the band (x/÷) of the speed on a GPU model nothing was measured on
UNMEASURED_SPEED_BAND = 4.0
#: GPU type names that say nothing about the GPU model
_NO_MODEL = frozenset({"generic", "unknown", CPU_ONLY})


def job_signature(job: Job) -> str:
    """The predictor signature of a job: its model and batch size ('resnet18/bs128'); a model name that
    already carries its batch size ('ResNet-50 (batch size 64)') or has none is used as it is."""
    return signature_of(job.model, job.batch_size)


def signature_of(model: str, batch_size: int | None) -> str:
    """`job_signature` from its parts (what `qosflow profile` stores a @qos_task's samples under: the
    signature the worker gives the stage, module.function plus its batch size)."""
    if batch_size and parse_signature(model)[1] is None:
        return f"{model}/bs{batch_size}"
    return model


def _steps_run(job: Job, steps: int | None) -> int | None:
    """How many steps a finished stage ran: its declared iterations, else the steps it reported."""
    return job.iterations or (steps if steps and steps > 0 else None)


#: the stage_history columns the estimator learns durations from (`_load_history`, `refresh_from_store`)
_HISTORY_COLUMNS = ("duration_s", "state", "signature", "co_runner", "resumed_from", "steps", "gpus", "gpu_type")
#: what `where` may give a stage's store rows (the stage_history columns)
_WHERE_FIELDS = ("host", "gpu_type", "placement", "cpu_cores", "started_at", "finished_at")


def run_share(job: Job, steps: int | None, resumed_from: int) -> tuple[int | None, float] | None:
    """(steps this run did, the fraction of the whole run's steps they are) of a finished stage run that
    started with `resumed_from` steps done (1.0 for a run from the start); None when a resumed run's
    steps are not known, so that what it did cannot be told from a whole run."""
    total = _steps_run(job, steps)
    if not resumed_from or resumed_from <= 0:
        return total, 1.0
    if not total or total <= resumed_from:
        return None
    n = total - int(resumed_from)
    return n, n / total


def _key(signature: str) -> str:
    from qosflow.predict.predictor import canonical

    return canonical(signature)


def gpu_model_of(name: str | None) -> str | None:
    """The GPU model measurements and speeds are keyed by (`short_gpu_model`: ``Tesla K80`` -> ``k80``);
    None when the name says nothing about it (empty, ``generic``, ``unknown``, CPU-only)."""
    m = short_gpu_model(name)
    return None if m in _NO_MODEL else m


def _merged(a: LogStat, b: LogStat) -> "_LogStat":
    """Two running statistics as one (the pairwise update of Chan et al.)."""
    out = _LogStat()
    out.n = a.n + b.n
    if out.n:
        d = b.mean - a.mean
        out.mean = a.mean + d * b.n / out.n
        out.m2 = a.m2 + b.m2 + d * d * a.n * b.n / out.n
    return out


def _blend(measured: Prediction, model: Prediction, n: int) -> Prediction:
    """`measured` (from n measurements) in place of the model's prediction from MIN_SAMPLES measurements
    on; with fewer, the two blended in log space with weight n/(n+1) on the measurements, the interval
    covering both."""
    from qosflow.predict.predictor import MIN_SAMPLES

    if n >= MIN_SAMPLES:
        return measured
    w = n / (n + 1.0)
    v = math.exp(w * math.log(measured.value) + (1 - w) * math.log(max(model.value, 1e-9)))
    return Prediction(v, min(measured.low, model.low, v), max(measured.high, model.high, v), n,
                      f"{measured.basis}+{model.basis}")


def _same_speed(basis: str) -> Prediction:
    return Prediction(1.0, 1.0, 1.0, 0, basis)


class _LogStat(LogStat):
    """A `LogStat` that also gives its values as a prediction."""

    def prediction(self, factor: float, basis: str) -> Prediction:
        # geometric mean; the interval is that of one more value (their spread), never narrower than +-2 %
        sd = max(self.sd, 0.02)
        v = math.exp(self.mean) * factor
        return Prediction(v, v * math.exp(-Z90 * sd), v * math.exp(Z90 * sd), self.n, basis)

    def calibrate(self, model: Prediction) -> Prediction:
        """The measurements (factor 1) in place of the model's prediction from `min_samples` values on;
        with fewer, the two blended in log space with weight n/(n+1) on the measurements, the interval
        covering both. No measurement: the model's prediction."""
        if not self.n:
            return model
        return _blend(self.prediction(1.0, f"samples(n={self.n})"), model, self.n)


def _declared_and_measured(declared: Prediction, measured: Prediction) -> Prediction:
    """A declared duration updated by what the signature's runs measured (log-normal, conjugate).

    The declaration is a prior on the log duration with sd DECLARED_LOG_SD; `measured` is the estimate
    of one more run from n runs whose spread is its band (log sd = ln(high / value) / Z90). Their mean
    is known to sd / sqrt(n), so the posterior mean moves toward the measurements as runs come in
    (one run at the usual 10 % spread already carries 96 % of the weight) and a declaration that was
    off stops steering the schedule. The band is that of one more run: the spread of the runs plus
    what is left of the uncertainty of their mean. A measurement without a band (n = 0) is not used."""
    n = measured.n_samples
    if n < 1 or not (measured.value > 0 and math.isfinite(measured.value)):
        return declared
    sd = max(math.log(measured.high / measured.value) / Z90, 0.02) if measured.high > measured.value else 0.02
    w0, w1 = 1.0 / DECLARED_LOG_SD**2, n / sd**2
    mu = (w0 * math.log(declared.value) + w1 * math.log(measured.value)) / (w0 + w1)
    band = Z90 * math.sqrt(sd**2 + 1.0 / (w0 + w1))
    v = math.exp(mu)
    return Prediction(v, v * math.exp(-band), v * math.exp(band), n, f"declared+{measured.basis}")


def _normal(seed: int, key: str) -> float:
    u = min(max(_unit(seed, key), 1e-12), 1 - 1e-12)
    return statistics.NormalDist().inv_cdf(u)


# ---------------------------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class SimulatedProfile:
    signature: str
    solo_step_time_s: float
    ref_speeds: dict[str, float]
    ref_partner_speeds: dict[str, float]
    #: (cores per GPU, step time) at two core counts
    cpu_points: tuple[tuple[float, float], ...]


class SimulatedProfiler:
    """What lightweight profiling would measure, in the simulator (sim-only; see the module docstring).

    Truth comes from the simulator's `SpeedModel` (co-location with the reference jobs, CPU curve) and
    from the job itself (its step time: the trace's ``iteration_time`` if given, else duration /
    iterations); every measurement is multiplied by exp(noise x N(0, 1)), drawn from (seed, what is
    measured), so a run is reproducible and two runs with different seeds measure differently.
    """

    def __init__(self, speed: "SpeedModel", *, seed: int = 0, noise: float = PROFILE_NOISE,
                 refs: Sequence[str] | None = None):
        from qosflow.predict.evaluate import REFERENCE_JOBS

        if not 0 <= noise < 1:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        self.speed = speed
        self.seed = seed
        self.noise = noise
        self.refs = list(refs) if refs is not None else list(REFERENCE_JOBS)
        self._ref_jobs = {r: self._ref_job(r) for r in self.refs}
        self.measurements = 0

    @staticmethod
    def _ref_job(name: str) -> Job:
        from qosflow.core.qos import QoSSpec

        return Job(job_id=f"reference:{name}", submit_time=0.0, qos=QoSSpec(gpus=1), duration=1.0, model=name)

    def _noisy(self, value: float, key: str) -> float:
        self.measurements += 1
        return value * math.exp(self.noise * _normal(self.seed, key)) if self.noise else value

    @staticmethod
    def true_step_time(job: Job) -> float | None:
        it = job.meta.get("iteration_time") if job.meta else None
        if isinstance(it, (int, float)) and it > 0:
            return float(it)
        if job.iterations:
            return job.duration / job.iterations
        return None

    def true_solo_step_time(self, job: Job) -> float:
        """The job's solo 1-GPU step time in the world the simulator's speed model describes: 1 / the
        throughput its interference table measured for the job's type when it has one (the table the
        truth's slowdowns come from), else the job's own step time, else 1 s."""
        table = getattr(self.speed, "interference", None)
        thr = getattr(table, "throughput", None)
        if thr is not None:
            try:
                v = thr(job.model, 1)
            except Exception:  # noqa: BLE001 - an interference source without throughputs
                v = None
            if v:
                return 1.0 / float(v)
        return self.true_step_time(job) or 1.0

    def step_time(self, job: Job) -> float | None:
        """Measured step time of the job at its own GPU count (None: the job has no iteration count)."""
        t = self.true_step_time(job)
        if t is None:
            return None
        return self._noisy(t, f"step:{_key(job_signature(job))}:{job.qos.gpus}")

    def step_time_on(self, job: Job, gpu_model: str) -> float | None:
        """Measured step time of the job at its own GPU count on a GPU of `gpu_model` (GENIE-style: a few
        steps on each GPU type it may run on): its true step time over the truth's speed there."""
        t = self.true_step_time(job)
        if t is None:
            return None
        return self._noisy(t / self.speed.gpu_speed(job, gpu_model),
                           f"step:{_key(job_signature(job))}:{job.qos.gpus}:{gpu_model}")

    def profile(self, job: Job) -> SimulatedProfile:
        sig = job_signature(job)
        k = _key(sig)
        solo = self._noisy(self.true_solo_step_time(job), f"solo:{k}")
        with_ref, of_ref = {}, {}
        for r, rj in self._ref_jobs.items():
            xa, xb = self.speed.pair_slowdown(job, rj)
            with_ref[r] = min(1.0, self._noisy(1.0 / xa, f"with:{k}:{r}"))
            of_ref[r] = min(1.0, self._noisy(1.0 / xb, f"of:{k}:{r}"))
        gpus = max(job.qos.gpus, 1)
        c_full = max(job.qos.cpu_cores / gpus, 1e-3) if job.qos.gpus > 0 else max(job.qos.cpu_cores, 1e-3)
        pts = []
        for c in (c_full / 2.0, c_full):
            f = self.speed.cpu_factor(job, c * (gpus if job.qos.gpus > 0 else 1))
            if f > 0:
                pts.append((c, self._noisy(solo / f, f"cpu:{k}:{c:g}")))
        return SimulatedProfile(sig, solo, with_ref, of_ref, tuple(pts))

    def colocated_slowdown(self, job: Job, partner: Job) -> float:
        """Slowdown of `job` measured while it shared its GPUs with `partner` (its progress reports)."""
        xa, _ = self.speed.pair_slowdown(job, partner)
        return max(1.0, self._noisy(xa, f"co:{job.job_id}:{partner.job_id}"))

    def spread_slowdown(self, job: Job, num_nodes: int, min_nodes: int) -> float:
        """Slowdown of `job` measured while it ran over `num_nodes` nodes (`min_nodes` would do)."""
        return max(1.0, self._noisy(self.speed.spread_slowdown(job, num_nodes, min_nodes), f"spread:{job.job_id}"))

    def finished_step_time(self, job: Job) -> float | None:
        """Per-iteration solo time of a finished job (what a worker learns from its progress reports)."""
        if not job.iterations:
            return None
        return self._noisy(job.duration / job.iterations, f"done-step:{job.job_id}")

    def finished_duration(self, job: Job) -> float:
        return self._noisy(job.duration, f"done:{job.job_id}")


# ---------------------------------------------------------------------------------------- estimator
_REF_CACHE: dict[tuple, Any] = {}


def reference_predictor(reference: Any = "auto", *, seed: int = 0, gpu_type: str | None = None) -> "Predictor":
    """A predictor fitted to the reference table only (Gavel's, when present), cached per process
    and handed out as a copy, so each simulation run starts from the same cold state."""
    import copy

    from qosflow.predict.predictor import Predictor
    from qosflow.predict.reference import ThroughputTable, default_gavel_path

    table = None
    if reference is not None:
        path = default_gavel_path() if reference == "auto" else reference
        key = (str(path), seed, gpu_type)
        hit = _REF_CACHE.get(key)
        if hit is not None:
            return copy.deepcopy(hit)
        try:
            table = ThroughputTable.load(path)
        except Exception:  # noqa: BLE001 - no reference table: learn from profiles and samples alone
            if reference != "auto":
                raise
            table = None
    kw = {"gpu_type": gpu_type} if gpu_type and (table is None or gpu_type in table.workers) else {}
    p = Predictor(table, seed=seed, **kw)
    p.refit()
    if table is not None:
        _REF_CACHE[(str(table.source), seed, gpu_type)] = copy.deepcopy(p)
    return p


def _planning_value(p: Prediction) -> float:
    """A slowdown to plan with: cautious for a pair that was never measured (UNMEASURED_PAIR_CAUTION)."""
    if p.basis.startswith(("samples(", "reference:")) or not p.high > p.value > 0:
        return p.value
    a = UNMEASURED_PAIR_CAUTION
    return math.exp((1 - a) * math.log(p.value) + a * math.log(p.high))


class LearnedEstimator:
    """The `Estimator` protocol from the predictor (see the module docstring)."""

    name = "learned"

    def __init__(
        self,
        speed: "SpeedModel | None" = None,
        *,
        seed: int = 0,
        store: Any = None,
        predictor: "Predictor | None" = None,
        profiler: SimulatedProfiler | None = None,
        reference: Any = "auto",
        default_duration: float = DEFAULT_DURATION,
        profile_noise: float = PROFILE_NOISE,
        persist: bool | None = None,
        background_writes: bool = False,
    ):
        if profiler is None and speed is not None:
            profiler = SimulatedProfiler(speed, seed=seed, noise=profile_noise)
        if store is None and speed is None and predictor is None:
            from qosflow.store import Store

            store = Store.open()  # the live worker: the user's store (or QOSFLOW_DATABASE_URL)
        solo: list[tuple] | None = None
        last_sample = [0]  # the last sample the predictor read (`refresh_from_store` reads those stored since)
        if predictor is None:
            if store is not None:
                from qosflow.predict.predictor import Predictor

                # the predictor reads every sample; the solo step times `_load_history` needs are kept as it
                # goes, not read a second time
                solo = []
                keep = solo.append

                def on_sample(s: Any) -> None:
                    last_sample[0] = s.id  # (oldest first)
                    if s.co_runner is None and s.placement == "consolidated" and s.source != "reference":
                        keep((s.signature, s.gpus, s.gpu_type, s.step_time_s))

                predictor = Predictor.open(store, reference=reference, seed=seed, on_sample=on_sample)
            else:
                gt = getattr(getattr(speed, "interference", None), "gpu_type", None)
                predictor = reference_predictor(reference, seed=seed, gpu_type=gt)
        self.speed = speed  # the simulator's truth: read only by the simulated profiler
        self.seed = seed
        self.predictor = predictor
        self.profiler = profiler
        self.store = store
        self.persist = (store is not None) if persist is None else persist
        #: write finished stages to the store from one background thread, in order (the worker: its event
        #: loop must not wait on the database); `flush()` waits for them, `close()` also ends the thread
        self.background_writes = background_writes
        self._writer: Any = None
        self.default_duration = float(default_duration)
        self._sig: dict[str, tuple[str, str]] = {}  # job id -> (signature, canonical key)
        self._steps: dict[tuple[str, int], _LogStat] = {}  # (key, gpus) -> per-iteration solo times
        self._hist: dict[tuple[str, str | None], _LogStat] = {}  # (key, user) -> durations
        self._version: dict[str, int] = {}  # key -> bumped when its step times or durations change
        self._dur: dict[str, tuple[int, Prediction, str]] = {}  # job id -> (version, duration prediction, key)
        self._rem: dict[str, tuple[float, float, int, Prediction]] = {}
        self._pair: dict[tuple[str, str], tuple[Prediction, Prediction]] = {}  # answers handed out
        self._pair_val: dict[tuple[str, str], tuple[float, float]] = {}  # the same, values only
        self._pmodel: dict[tuple[str, str], Prediction] = {}  # (key a, key b) -> the predictor's slowdown of a
        self._co_obs: dict[tuple[str, str], _LogStat] = {}  # (key a, key b) -> measured slowdowns of a next to b
        self._new_pairs = 0  # co-located pairs given to the predictor since the last refit
        self._fed_pairs: set[tuple[str, str]] = set()
        self._spread: dict[tuple[str, int], Prediction] = {}
        self._cpu: dict[str, CpuCurve] = {}
        self._known: dict[str, str] = {}  # key -> signature, every signature asked about (ordered)
        self._profiled: set[str] = set()
        self._step_profiled: set[tuple[str, int]] = set()
        self._reference_sigs: dict[str, bool] = {}
        self._jobs: dict[str, Job] = {}  # job id -> job, every job asked about
        #: running jobs as last seen by `remaining` (job id -> (placement, its GPUs)): who shares with whom
        self._where: dict[str, tuple] = {}
        self._spread_obs: dict[tuple[str, int], _LogStat] = {}  # (key, gpus) -> measured spread penalties
        self._spread_m: dict[tuple[str, int], Prediction] = {}  # (key, gpus) -> the scaling model's penalty
        self._spread_resid: dict[str, _LogStat] = {}  # key -> measured / model penalty, over GPU counts
        #: GPUs per node, as seen in placements (the spread penalty depends on the nodes a job needs)
        self.gpus_per_node = 0
        self._dirty = False
        self.stats = {"profiles": 0, "refits": 0, "finished_observed": 0, "pair_batches": 0,
                      "colocations_observed": 0, "spreads_observed": 0, "in_flight_measured": 0}
        #: simulation: the first duration prediction made for each job (what it was queued on), for error reports
        self.first_duration: dict[str, Prediction] = {}
        #: the GPU model durations (and `_steps`) are for, that every GPU speed is relative to: the
        #: predictor's type (v100 with Gavel's table; what a trace's durations are computed on). A live
        #: estimator adopts the first model its measurements name (its store's, else its first stage's:
        #: `_set_reference`), so a homogeneous cluster's durations stay as measured there
        self.reference_gpu: str = gpu_model_of(predictor.gpu_type) or predictor.gpu_type
        self._reference_fixed = profiler is not None
        self._ptype = predictor.gpu_type  # the predictor's name of the reference GPU (`Predictor.type_key`)
        #: simulation: per node, its GPU model, for an engine that runs jobs at their speed on mixed models
        #: (read by `_in_flight`, which then tells a slow GPU from a slowdown); None: every GPU alike
        self.node_gpu_models: Sequence[str] | None = None
        # measured on a model other than the reference GPU, as measured (converted when asked: `_step_stat`,
        # `_hist_stat`, with the speed there as it is then):
        self._off: dict[tuple[str, int, str], _LogStat] = {}  # (key, gpus, model) -> solo step times
        self._hist_off: dict[tuple[str, str | None, str], _LogStat] = {}  # (key, user, model) -> durations
        self._off_models: dict[str, set[str]] = {}  # key -> the models it has such measurements on
        #: simulation: (key, gpus, model) -> step times profiled on a model (evidence for its speed only)
        self._profiled_on: dict[tuple[str, int, str], _LogStat] = {}
        self._speed_keys: set[str] = set()  # keys with measurements on a model other than the reference
        self._speed: dict[tuple[str, int, str], tuple[tuple[int, int], Prediction]] = {}
        #: model -> (generation, per-signature and total (count, sum, sum of squares) of log speed ratios)
        self._pools: dict[str, tuple[int, dict[str, tuple[int, float, float]], tuple]] = {}
        self._speed_gen = 0  # bumped when measurements on other models (or their signatures') change
        self._models: dict[str, str | None] = {}  # GPU name -> `gpu_model_of` it
        self._model_profiled: set[tuple[str, int, str]] = set()
        #: the last sample and stage_history row read from the store (`refresh_from_store` reads those after)
        self._cursor = {"sample": last_sample[0], "stage_history": 0}
        #: ids of the sample and stage_history rows this estimator wrote (`_write_stage`): `observe_stage` learned
        #: them already, so `refresh_from_store` skips them. Its writer holds `_own_lock` from before a write
        #: until the ids are kept, so a refresh that read a row before then waits for its id
        self._own: dict[str, set[int]] = {"sample": set(), "stage_history": set()}
        self._own_lock = threading.Lock()
        #: held by every public method (`_LOCKED`) and by `refresh_from_store` while it applies what it read:
        #: a refresh runs in a thread of its own while the worker's event loop predicts and observes
        self._lock = threading.RLock()
        self._refresh_lock = threading.Lock()  # one refresh at a time
        #: refreshes that failed (database down: logged, retried at the next) and rows taken from the store since built
        self.refresh_failures = 0
        self.refreshed_rows = 0
        if store is not None:
            self._load_history(store, solo)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_store(cls, store: Any = None, *, reference: Any = "auto", seed: int = 0, persist: bool = True,
                   **kw: Any) -> "LearnedEstimator":
        """The live worker's estimator: predictor and history from `store` (default: `Store.open()`)."""
        if store is None:
            from qosflow.store import Store

            store = Store.open()
        return cls(None, seed=seed, store=store, reference=reference, persist=persist, **kw)

    @classmethod
    def for_simulation(cls, speed: "SpeedModel", *, seed: int = 0, **kw: Any) -> "LearnedEstimator":
        return cls(speed, seed=seed, **kw)

    def _load_history(self, store: Any, solo_samples: list[tuple] | None = None) -> None:
        """Per-iteration times (solo, consolidated samples) and stage durations already in the store.
        `solo_samples`: (signature, gpus, gpu_type, step time) of those samples, in the order they were
        stored, when the caller read them already (the predictor's `load_store`); else they are read here.

        The reference GPU is the first model they name (samples first, in the order they were stored: the
        model the estimator adopted when it measured it, so a restart keeps it); measurements on other
        models are kept as measured, and converted when asked."""
        if solo_samples is None:
            solo_samples = []
            for s in store.sample_rows("signature", "gpus", "gpu_type", "step_time_s", "co_runner", "placement", "source"):
                self._cursor["sample"] = max(self._cursor["sample"], s.id)
                if s.co_runner is None and s.placement == "consolidated" and s.source != "reference":
                    solo_samples.append((s.signature, s.gpus, s.gpu_type, s.step_time_s))
        rows = store.history_rows(*_HISTORY_COLUMNS)
        if rows:
            self._cursor["stage_history"] = max(self._cursor["stage_history"], rows[-1].id)
        self._learn_stored(solo_samples, rows, bump=False)

    def _learn_stored(self, solo_samples: Sequence[tuple], history: Sequence[Any], *, bump: bool = True) -> set[str]:
        """Learn stored solo step times ((signature, gpus, gpu_type, step time)) and stage runs (rows of
        `_HISTORY_COLUMNS`), as `_load_history` (and a restart) does. `bump`: the signatures' cached
        durations are stale (a refresh). Returns the keys of the signatures learned about."""
        solo = [(sig, int(gpus), self._model(gt), t) for sig, gpus, gt, t in solo_samples]
        hist = []
        for _id, duration_s, state, sig, co_runner, resumed_from, steps, gpus, gpu_type in history:
            # (a run shared with one partner the whole time is not an isolated duration: see observe_stage)
            if duration_s and duration_s > 0 and state == "COMPLETED" and sig and not co_runner:
                whole = duration_s
                if resumed_from:  # a run resumed from a checkpoint: the time of a whole run at its pace
                    if not steps:
                        continue
                    whole *= (steps + resumed_from) / steps
                hist.append((sig, int(gpus or 0), self._model(gpu_type), whole))
        first = next((m for rows in (solo, hist) for _s, _g, m, _v in rows if m is not None), None)
        if first is not None and not self._reference_fixed:
            self._set_reference(first)
        keys: set[str] = set()
        for sig, gpus, m, t in solo:
            keys.add(_key(sig))
            self._add_measured(self._steps, self._off, (_key(sig), gpus), self._off_reference(m), t)
        for sig, _gpus, m, d in hist:
            keys.add(_key(sig))
            self._add_measured(self._hist, self._hist_off, (_key(sig), None), self._off_reference(m), d)
        if bump:
            for key in keys:
                self._bump(key)
        return keys

    # ------------------------------------------------------------------ what other workers learned

    def refresh_from_store(self) -> int:
        """Learn what was written to the store since this estimator last read it -- by the other workers of
        the pool, by `qosflow profile` -- as a restart would: new samples and profiles (the predictor) and
        new stage runs (durations, solo step times). Rows this estimator wrote itself are skipped
        (`observe_stage` learned them already). Returns the number of rows taken.

        Safe to call from a thread while the event loop predicts (the worker: `asyncio.to_thread` every
        QOSFLOW_PREDICTOR_REFRESH_SECONDS): the database is read without any lock the event loop takes; what
        was read is applied under the estimator's lock (O(rows)); a model refit that new configurations call
        for runs on a copy of the aggregates outside it, and its models are swapped in. A failed read (the
        database down) is logged and counted (`refresh_failures`), never raised: the same rows are read at
        the next call."""
        if self.store is None:
            return 0
        with self._refresh_lock:
            try:
                return self._refresh()
            except Exception as exc:  # noqa: BLE001 - a database hiccup must not take the worker down
                self.refresh_failures += 1
                log.warning("learned estimator: could not read what other workers stored in %s (retried at the next "
                            "refresh): %s", getattr(self.store, "safe_url", "the store"), exc)
                return 0

    def _refresh(self) -> int:
        from qosflow.store.store import SAMPLE_VALUE_COLUMNS

        store, p = self.store, self.predictor
        # read (no state of the estimator touched); profiles first, as `Predictor.load_store`
        profiles = store.profiles_for(since_id=p.last_profile_id)
        samples = list(store.sample_rows(*SAMPLE_VALUE_COLUMNS, since_id=self._cursor["sample"]))
        runs = store.history_rows(*_HISTORY_COLUMNS, since_id=self._cursor["stage_history"])
        with self._own_lock:  # (waits for a write of ours in progress to keep its ids)
            own_s, own_h = self._own["sample"], self._own["stage_history"]
            new_samples = [r for r in samples if r.id not in own_s]
            new_runs = [r for r in runs if r.id not in own_h]
            own_s.difference_update(r.id for r in samples)  # (seen: never read again)
            own_h.difference_update(r.id for r in runs)
        taken = len(new_samples) + len(new_runs) + len(profiles)
        with self._lock:
            solo: list[tuple] = []

            def on_sample(s: Any) -> None:
                if s.co_runner is None and s.placement == "consolidated" and s.source != "reference":
                    solo.append((s.signature, s.gpus, s.gpu_type, s.step_time_s))

            p.apply_store_rows(store, new_samples, profiles, on_sample=on_sample)
            if samples:
                self._cursor["sample"] = max(self._cursor["sample"], samples[-1].id)
            if runs:
                self._cursor["stage_history"] = max(self._cursor["stage_history"], runs[-1].id)
            self._learn_stored(solo, new_runs)
            if new_samples or profiles:  # answers that rest on the predictor's samples
                for sig in {r.signature for r in new_samples} | {r.signature for r in profiles}:
                    self._bump(_key(sig))
                self._clear_model_answers()
            snap = p.refit_snapshot() if p.needs_refit() else None
        if snap is not None:  # (new configurations: off the lock, on a copy)
            try:
                done = snap.refit()
            except Exception:
                with self._lock:
                    p.restore_refit_marks(snap)
                raise
            with self._lock:
                p.install_refit(snap, done)
                self._clear_model_answers()
                self.stats["refits"] += 1
        self.refreshed_rows += taken
        return taken

    def _clear_model_answers(self) -> None:
        """Forget the answers that came from the predictor (after it learned or refitted)."""
        # (not `_dur`: it keeps the prediction each job was planned with, which `observe` stores; its entries
        # are stale once their signature's version moves: `_bump`)
        for cache in (self._rem, self._pair, self._pair_val, self._pmodel, self._spread, self._spread_m,
                      self._cpu, self._reference_sigs, self._speed):
            cache.clear()
        self._speed_gen += 1

    # ------------------------------------------------------------------ helpers

    def _sig_of(self, job: Job) -> tuple[str, str]:
        hit = self._sig.get(job.job_id)
        if hit is None:  # a job id names one job: its signature is computed once
            sig = job_signature(job)
            hit = self._sig[job.job_id] = (sig, _key(sig))
            self._known.setdefault(hit[1], sig)
            self._jobs[job.job_id] = job
        return hit

    def _bump(self, key: str) -> None:
        self._version[key] = self._version.get(key, 0) + 1
        if key in self._speed_keys:  # its ratios are part of the pooled GPU speeds
            self._speed_gen += 1

    def _in_reference(self, sig: str, key: str) -> bool:
        hit = self._reference_sigs.get(key)
        if hit is None:
            hit = self.predictor.predict_solo_step_time(sig, 1, gpu_type=self._ptype).basis.startswith("reference:")
            self._reference_sigs[key] = hit
        return hit

    def _ensure_profiled(self, job: Job) -> None:
        """Simulation only: profile a signature (and its step time at a GPU count) the first time."""
        prof = self.profiler
        if prof is None:
            return
        sig, key = self._sig_of(job)
        sk = (key, job.qos.gpus)
        if sk not in self._step_profiled:
            self._step_profiled.add(sk)
            t = prof.step_time(job)
            if t is not None:
                self._steps.setdefault(sk, _LogStat()).add(t)
                self._bump(key)
        if key not in self._profiled:
            self._profiled.add(key)
            p = prof.profile(job)
            if p.cpu_points:
                curve = fit_curve([c for c, _ in p.cpu_points], [t for _, t in p.cpu_points])
                if curve is not None:
                    self._cpu[key] = curve
            if self._in_reference(sig, key):
                return  # the reference table measured this job type: nothing to learn from a profile
            self.predictor.observe_profile(sig, p.solo_step_time_s, ref_speeds=p.ref_speeds,
                                           ref_partner_speeds=p.ref_partner_speeds)
            self.stats["profiles"] += 1
            self._dirty = True

    def _refit_if_dirty(self) -> None:
        if self._dirty:
            self.predictor.refit()
            self._dirty = False
            self.stats["refits"] += 1
            self._pair.clear()
            self._pair_val.clear()
            self._pmodel.clear()
            self._spread.clear()
            self._spread_m.clear()
            self._new_pairs = 0

    # ------------------------------------------------------------------ durations

    def step_time(self, job: Job) -> Prediction:
        """Per-iteration solo time of the job at its GPU count."""
        self._ensure_profiled(job)
        sig, key = self._sig_of(job)
        st = self._step_stat(job)
        if st is not None and st.n:
            return st.prediction(1.0, f"samples(n={st.n})")
        return self.predictor.predict_solo_step_time(sig, max(job.qos.gpus, 1), gpu_type=self._ptype)

    def predict_duration(self, job: Job) -> Prediction:
        self._ensure_profiled(job)
        sig, key = self._sig_of(job)
        v = self._stamp(key)
        hit = self._dur.get(job.job_id)
        if hit is not None and hit[0] == v:
            return hit[1]
        pred = self._duration(job, sig, key)
        self._dur[job.job_id] = (v, pred, key)
        if self.profiler is not None:  # simulations report the error of what jobs were first queued on
            self.first_duration.setdefault(job.job_id, pred)
        return pred

    def _duration(self, job: Job, sig: str, key: str) -> Prediction:
        measured = self._measured_duration(job, key)
        d = job.expected_duration
        if d:
            declared = Prediction(d, d / DECLARED_HIGH_FACTOR, d * DECLARED_HIGH_FACTOR, 0, "declared")
            return declared if measured is None else _declared_and_measured(declared, measured)
        if measured is not None:
            return measured
        d = self.default_duration
        return Prediction(d, d * math.exp(-Z90 * DEFAULT_LOG_SD), d * math.exp(Z90 * DEFAULT_LOG_SD), 0,
                          f"prior:default({d:g}s)")

    def _measured_duration(self, job: Job, key: str) -> Prediction | None:
        """The duration from measurements of the job's signature: iterations x its step time (a job that
        states its iteration count), else the durations of its past runs (same user first); None when
        nothing was measured."""
        if job.iterations:
            p = self.step_time(job)
            if math.isfinite(p.value) and p.value > 0 and not p.basis.startswith("prior:"):
                n = job.iterations
                return Prediction(p.value * n, p.low * n, p.high * n, p.n_samples, f"iterations×step-time:{p.basis}")
        for hk in ((key, job.user), (key, None)) if job.user else ((key, None),):
            st = self._hist_stat(job, hk)
            if st is not None and st.n:
                who = f",user={job.user}" if hk[1] else ""
                return st.prediction(1.0, f"history(n={st.n}{who})")
        return None

    def _track(self, js: JobState) -> None:
        """Follow a running job: where it runs (who shares with whom), and -- in the simulator -- its
        progress between two looks, from which its current slowdown is measured (`_in_flight`)."""
        p = js.placement
        if p is None:
            if self._where:
                self._where.pop(js.job_id, None)
            return
        hit = self._where.get(js.job_id)
        if hit is None or hit[0] is not p:
            gset = frozenset(p.gpus)
            # (placement, GPUs, progress and attained time at the mark, co-runners at the mark, looks)
            self._where[js.job_id] = (p, gset, js.progress, js.attained, None, 0)
            self.gpus_per_node = max(self.gpus_per_node, 1 + max((g for _n, g in p.gpus), default=-1))
        elif self.profiler is not None and js.attained - hit[3] >= IN_FLIGHT_INTERVAL:
            self._in_flight(js, hit)

    def _partners(self, job_id: str, placement: Any, gpus: frozenset) -> frozenset:
        out = {j for j in placement.colocated_with if j in self._jobs and j in self._where}
        for jid, e in self._where.items():
            if jid != job_id and e[0].gpu_milli >= 1000 and e[1] & gpus:
                out.add(jid)
        return frozenset(out)

    def _in_flight(self, js: JobState, mark: tuple) -> None:
        """What a worker reads from a running stage's progress reports: time taken for the work done since
        the last mark, against its predicted isolated time, is its slowdown where it runs now. Attributed
        to the one co-runner when it shares whole GPUs, to spreading when it runs alone over more nodes
        than it needs; an interval whose co-runners changed, the first after a (re)start (restart
        overhead), CPU-starved or sub-batched intervals are not used."""
        p, gset, prog0, att0, partners0, looks = mark
        job = js.job
        partners = self._partners(job.job_id, p, gset) if p.gpu_milli >= 1000 else frozenset()
        self._where[job.job_id] = (p, gset, js.progress, js.attained, partners, looks + 1)
        dp, da = js.progress - prog0, js.attained - att0
        if looks == 0 or partners != partners0 or dp <= 0 or p.sub_batch is not None or width_fraction(job, p) < 1.0:
            return  # (on fewer GPUs than asked for, an elastic start, it is slower by design: no slowdown)
        if p.cpu and p.cpu_cores < job.qos.cpu_cores - 1e-9:
            return
        d = self.predict_duration(job)
        if not d.basis.startswith("iterations×"):
            return
        slow = da / (dp * d.value) * self._placement_speed(job, p)  # (a slower GPU is no slowdown)
        gpn = max(self.gpus_per_node, 1)
        nodes = len({n for n, _g in p.gpus})
        need = -(-job.qos.gpus // gpn) if job.qos.gpus > 0 else 1
        spread = job.qos.gpus > 1 and nodes > need
        if spread and not partners:
            shape = min(1.0, 2.0 * (nodes - need) / max(1, nodes - 1))
            self.observe_spread(job, 1.0 + (max(slow, 1.0) - 1.0) / shape)
            self.stats["in_flight_measured"] += 1
        elif len(partners) == 1 and not spread:
            other = self._jobs.get(next(iter(partners)))
            if other is not None:
                self.observe_colocated(job, other, max(slow, 1.0), to_predictor=False)
                self.stats["in_flight_measured"] += 1

    def predict_remaining(self, js: JobState) -> Prediction:
        self._track(js)
        f = min(max(js.progress, 0.0), 1.0)
        d = self.predict_duration(js.job)
        if f <= 0:
            return d
        if f >= 1:
            return Prediction(0.0, 0.0, 0.0, d.n_samples, "finished")
        key = self._sig_of(js.job)[1]
        v = self._stamp(key)
        hit = self._rem.get(js.job_id)
        if hit is not None and hit[0] == f and hit[1] == js.attained and hit[2] == v:
            return hit[3]
        if d.basis.startswith(("iterations×", "declared+iterations×")):
            pred = d.scaled(1.0 - f, f"progress(f={f:.2f})×{d.basis}")
        else:
            pred = self.predictor.predict_remaining(self._sig_of(js.job)[0], f, js.attained, prior_total=d,
                                                    gpus=max(js.job.qos.gpus, 1), start_fraction=js.progress_start)
        self._rem[js.job_id] = (f, js.attained, v, pred)
        return pred

    # ------------------------------------------------------------------ slowdowns

    def predict_pair(self, a: Job, b: Job) -> tuple[Prediction, Prediction]:
        """(slowdown of a next to b, slowdown of b next to a)."""
        sa, ka = self._sig_of(a)
        sb, kb = self._sig_of(b)
        hit = self._pair.get((ka, kb))
        if hit is not None:
            return hit
        self._ensure_profiled(a)
        self._ensure_profiled(b)
        self._refit_if_dirty()
        if (ka, kb) not in self._pmodel or (kb, ka) not in self._pmodel:
            # one model call for every pair of a or b with every signature seen so far
            queries: list[tuple[str, str]] = []
            keys: list[tuple[str, str]] = []
            for k0, s0 in ((ka, sa), (kb, sb)):
                for k, s in self._known.items():
                    for kk, q in (((k0, k), (s0, s)), ((k, k0), (s, s0))):
                        if kk not in self._pmodel and kk not in keys:
                            keys.append(kk)
                            queries.append(q)
            self._pmodel.update(zip(keys, self.predictor.predict_slowdown_batch(queries, gpu_type=self._ptype)))
            self.stats["pair_batches"] += 1
        hit = self._pair[(ka, kb)] = (self._with_obs(ka, kb), self._with_obs(kb, ka))
        self._pair_val[(ka, kb)] = (_planning_value(hit[0]), _planning_value(hit[1]))
        return hit

    def _with_obs(self, x: str, y: str) -> Prediction:
        """The model's slowdown of x next to y, corrected by measured co-locations of the two: the
        measurements alone from MIN_SAMPLES on, blended (weight n/(n+1)) before."""
        p = self._pmodel[(x, y)]
        st = self._co_obs.get((x, y))
        return self._clamp(p if st is None else st.calibrate(p))

    @staticmethod
    def _clamp(p: Prediction) -> Prediction:
        v = min(max(p.value, 1.0), MAX_SLOWDOWN)
        return p if v == p.value else Prediction(v, min(max(p.low, 1.0), v), min(max(p.high, v), MAX_SLOWDOWN), p.n_samples, p.basis)

    def predict_spread(self, job: Job) -> Prediction:
        """Slowdown of the job spread over nodes vs consolidated, at its GPU count (Gavel's notion).

        The solo-scaling model's answer, calibrated by what finished spread jobs of the same signature
        measured: at this GPU count, the measurements alone from MIN_SAMPLES on (blended before); at
        other GPU counts, the model times the signature's measured/predicted ratio (shrunk by n/(n+1)).
        """
        sig, key = self._sig_of(job)
        gpus = job.qos.gpus
        hit = self._spread.get((key, gpus))
        if hit is not None:
            return hit
        if gpus <= 1:
            pred = Prediction(1.0, 1.0, 1.0, 0, "single-gpu")
        else:
            pred = self._spread_model(job, sig, key)
            r = self._spread_resid.get(key)
            if r is not None and r.n:
                f = math.exp(r.mean * r.n / (r.n + 1.0))
                pred = Prediction(max(1.0, pred.value * f), max(1.0, pred.low * f), max(1.0, pred.high * f),
                                  r.n, f"{pred.basis}×calibration(n={r.n})")
            st = self._spread_obs.get((key, gpus))
            if st is not None:
                pred = st.calibrate(pred)
        self._spread[(key, gpus)] = pred
        return pred

    def _spread_model(self, job: Job, sig: str, key: str) -> Prediction:
        """The solo-scaling model's spread / consolidated step time at the job's GPU count."""
        gpus = job.qos.gpus
        hit = self._spread_m.get((key, gpus))
        if hit is not None:
            return hit
        self._ensure_profiled(job)
        self._refit_if_dirty()
        # the reference table measured spreading up to its largest GPU count: beyond, the same penalty
        n = min(gpus, self._max_reference_gpus())
        cons, spread = self.predictor.predict_solo_step_time_batch([(sig, n, True), (sig, n, False)], gpu_type=self._ptype)
        v = max(1.0, spread.value / cons.value)
        lo = max(1.0, spread.low / cons.high) if cons.high > 0 else 1.0
        hi = max(v, spread.high / cons.low) if cons.low > 0 else v
        pred = Prediction(v, min(lo, v), hi, min(cons.n_samples, spread.n_samples),
                          f"spread/consolidated at {n} GPUs: {spread.basis}")
        self._spread_m[(key, gpus)] = pred
        return pred

    def _max_reference_gpus(self) -> int:
        t = getattr(self.predictor, "reference", None)
        counts = getattr(t, "gpu_counts", None) if t is not None else None
        return max(counts) if counts else 8

    def curve(self, job: Job) -> CpuCurve:
        self._ensure_profiled(job)
        sig, key = self._sig_of(job)
        c = self._cpu.get(key)
        if c is None:
            c = self.predictor.cpu_curve(sig)
            self._cpu[key] = c
        return c

    def predict_cpu(self, job: Job, cores: float) -> Prediction:
        gpus = max(job.qos.gpus, 1)
        per = 1 if job.qos.gpus == 0 else gpus
        full = job.cpu_saturation * per if job.cpu_saturation is not None and job.qos.gpus > 0 else job.qos.cpu_cores
        if cores >= full:
            return Prediction(1.0, 1.0, 1.0, 0, "asked-for cores")
        if cores <= 0:
            return Prediction(0.0, 0.0, 0.0, 0, "no cores")
        c = self.curve(job)
        v = min(1.0, c.step_time(full / per) / c.step_time(cores / per))
        rel = 0.05 if c.n_samples >= 2 else 0.3
        return Prediction(v, v * (1 - rel), min(1.0, v * (1 + rel)), c.n_samples, c.basis)

    # ------------------------------------------------------------------ GPU models

    def predict_gpu_speed(self, job: Job, gpu_model: str) -> Prediction:
        """The job's solo speed on a GPU of `gpu_model` relative to the reference GPU (`reference_gpu`, the
        one its durations are for): 0.5 takes twice as long there. From, in order of trust:

        a. the signature's own step times at its GPU count on both models (finished stages alone on
           their GPUs and, in the simulator, a profile on each model): alone from MIN_SAMPLES on each,
           before that blended (weight n/(n+1)) with what follows;
        a'. the same at the nearest other GPU count where both models were measured;
        b. the reference table's solo step times of the signature on both types (Gavel's K80 runs
           ResNet-50 at 0.14 x a V100 but its recommender at 1.4 x);
        c. the ratio pooled over the signatures measured on both models (their geometric mean), for a
           signature measured on one of them only;
        d. 1.0: nothing measured on that model.

        The reference GPU itself is exactly 1.0, and so is a model that is not known (``generic``, empty)."""
        if job.qos.gpus <= 0:
            return _same_speed("no GPU")
        m = self._model(gpu_model)
        if m is None:
            return _same_speed(f"gpu-model-unknown({gpu_model or ''})")
        if m == self.reference_gpu:
            return _same_speed(f"reference-gpu({m})")
        self._ensure_model_profiled(job, m)
        return self._speed_on(self._sig_of(job)[0], job.qos.gpus, m)

    def gpu_speed(self, job: Job, gpu_model: str) -> float:
        """The Estimator protocol's (optional) speed on a GPU model: `predict_gpu_speed`'s value."""
        return self.predict_gpu_speed(job, gpu_model).value

    def _model(self, name: str | None) -> str | None:
        """`gpu_model_of(name)`, remembered (policies ask about the same few names all the time)."""
        try:
            return self._models[name]
        except KeyError:
            m = self._models[name] = gpu_model_of(name)
            return m

    def _speed_on(self, sig: str, gpus: int, m: str) -> Prediction:
        """Sources (a) to (d) of `predict_gpu_speed` for a signature at a GPU count on model `m` (not the
        reference), cached until the signature's or another model's measurements change."""
        key = _key(sig)
        stamp = (self._version.get(key, 0), self._speed_gen)
        hit = self._speed.get((key, gpus, m))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        prior = self._other_count_speed(key, gpus, m) or self._table_speed(sig, gpus, m) or self._pooled_speed(m, key) or Prediction(
            1.0, 1.0 / UNMEASURED_SPEED_BAND, UNMEASURED_SPEED_BAND, 0, f"no measurement on {m}")
        measured = self._measured_speed(key, gpus, m)
        pred = prior if measured is None else _blend(measured, prior, measured.n_samples)
        self._speed[(key, gpus, m)] = (stamp, pred)
        return pred

    def _measured_speed(self, key: str, gpus: int, m: str) -> Prediction | None:
        """(a): the ratio of the signature's mean step times on the reference GPU and on `m`; its band is
        that of the ratio of two means. None unless both were measured."""
        on_m, on_ref = self._measured_on((key, gpus, m)), self._steps.get((key, gpus))
        if on_m is None or on_ref is None or not (on_m.n and on_ref.n):
            return None
        sd = max(math.sqrt(on_ref.sd**2 / on_ref.n + on_m.sd**2 / on_m.n), 0.02)
        v = math.exp(on_ref.mean - on_m.mean)
        return Prediction(v, v * math.exp(-Z90 * sd), v * math.exp(Z90 * sd), min(on_m.n, on_ref.n),
                          f"samples(n={on_m.n} on {m},{on_ref.n} on {self.reference_gpu})")

    def _other_count_speed(self, key: str, gpus: int, m: str) -> Prediction | None:
        """(a'): the signature's own speed ratio on `m` measured at another GPU count -- the one nearest to
        `gpus` (a 2-GPU gang of a signature seen on both models at 1 GPU only); None if there is none."""
        counts = [g for (k, g) in self._steps if k == key and g != gpus and self._measured_speed(key, g, m) is not None]
        if not counts:
            return None
        g = min(counts, key=lambda c: (abs(math.log(c / max(gpus, 1))), c))
        p = self._measured_speed(key, g, m)
        return Prediction(p.value, p.low, p.high, p.n_samples, f"{p.basis} at {g} GPU(s)")

    def _table_speed(self, sig: str, gpus: int, m: str) -> Prediction | None:
        """(b): the reference table's speed of the signature on `m` relative to the reference GPU."""
        v = self.predictor.reference_speed(sig, gpus, m, self.reference_gpu)
        if v is None:
            return None
        band = math.exp(Z90 * SINGLE_SAMPLE_LOG_SD)
        return Prediction(v, v / band, v * band, 0, f"reference:gavel/{m}÷{self.reference_gpu}")

    def _pooled_speed(self, m: str, own: str) -> Prediction | None:
        """(c): the geometric mean of the speed ratios on `m` of the *other* signatures measured both on `m`
        and on the reference GPU (one ratio per signature and GPU count); None if there is none. Its band
        is their spread, at least POOLED_SPEED_LOG_SD while fewer than MIN_SAMPLES are pooled."""
        from qosflow.predict.predictor import MIN_SAMPLES

        n, s1, s2 = self._pool_sums(m, own)
        if not n:
            return None
        mean = s1 / n
        sd = math.sqrt(max(s2 - n * mean * mean, 0.0) / (n - 1)) if n > 1 else POOLED_SPEED_LOG_SD
        if n < MIN_SAMPLES:
            sd = max(sd, POOLED_SPEED_LOG_SD)
        v = math.exp(mean)
        return Prediction(v, v * math.exp(-Z90 * sd), v * math.exp(Z90 * sd), 0,
                          f"pooled:{n} other ratio(s) on {m}/{self.reference_gpu}")

    def _pool_sums(self, m: str, own: str) -> tuple[int, float, float]:
        """(count, sum, sum of squares) of the log speed ratios on `m` of every signature but `own`; the
        per-signature sums are gathered once per change of the measurements (`_speed_gen`)."""
        hit = self._pools.get(m)
        if hit is None or hit[0] != self._speed_gen:
            per_key: dict[str, tuple[int, float, float]] = {}
            for key, gpus, model in dict.fromkeys([*self._off, *self._profiled_on]):  # (ordered: the same sums)
                on_m, on_ref = self._measured_on((key, gpus, model)), self._steps.get((key, gpus))
                if model == m and on_ref is not None and on_ref.n and on_m.n:
                    r = on_ref.mean - on_m.mean
                    c, a, b = per_key.get(key, (0, 0.0, 0.0))
                    per_key[key] = (c + 1, a + r, b + r * r)
            total = tuple(sum(v[i] for v in per_key.values()) for i in range(3))
            hit = self._pools[m] = (self._speed_gen, per_key, total)
        _gen, per_key, (n, s1, s2) = hit
        c, a, b = per_key.get(own, (0, 0.0, 0.0))
        return int(n - c), s1 - a, s2 - b

    def _measured_on(self, k: tuple[str, int, str]) -> "_LogStat | None":
        """The solo step times of (key, gpus) measured on a model: by finished runs, and profiled."""
        a, b = self._off.get(k), self._profiled_on.get(k)
        return a if b is None else b if a is None else _merged(a, b)

    def _ensure_model_profiled(self, job: Job, m: str) -> None:
        """Simulation only: profile the job's step time on model `m` the first time it is asked about (the
        simulator's truth speed there, with the profiler's noise), next to its profile on the reference."""
        if self.profiler is None:
            return
        self._ensure_profiled(job)
        sig, key = self._sig_of(job)
        mk = (key, job.qos.gpus, m)
        if mk not in self._model_profiled:
            self._model_profiled.add(mk)
            t = self.profiler.step_time_on(job, m)
            if t is not None:
                self._add_off(self._profiled_on, mk, t)

    def _add_measured(self, on_ref: dict, off: dict, k: tuple, model: str | None, value: float) -> None:
        """A value measured on the reference GPU (`model` None: into `on_ref` under `k`) or on GPU `model`
        (into `off` under `k + (model,)`, kept as measured: `_add_off`)."""
        if model is None:
            on_ref.setdefault(k, _LogStat()).add(value)
        else:
            self._add_off(off, k + (model,), value)

    def _add_off(self, table: dict, k: tuple, value: float) -> None:
        """A value measured on a model other than the reference GPU (`k`: (key, ..., model)), into `table`
        (`_off`, `_hist_off` or `_profiled_on`); GPU speeds change with it."""
        table.setdefault(k, _LogStat()).add(value)
        self._speed_keys.add(k[0])
        if table is not self._profiled_on:  # (the simulator's profiles inform speeds only, not durations)
            self._off_models.setdefault(k[0], set()).add(k[-1])
        self._speed_gen += 1

    def _off_reference(self, m: str | None) -> str | None:
        """`m` when measurements on it must be converted to the reference GPU (a known model, not the
        reference); None when they are on the reference (or on a model nobody named, taken as it, as
        before GPU models were recorded). The first model a live estimator measures on becomes its
        reference when its store named none."""
        if m is None:
            return None
        if not self._reference_fixed:
            self._set_reference(m)
        return None if m == self.reference_gpu else m

    def _set_reference(self, m: str) -> None:
        """Make model `m` the reference GPU (once). The predictor is then asked about it under its name for
        `m` (`Predictor.type_key`: its own type for a model its table does not know, as before)."""
        self._reference_fixed = True
        if m == self.reference_gpu:
            return
        self.reference_gpu = m
        self._speed_gen += 1
        ptype = self.predictor.type_key(m)
        if ptype != self._ptype:
            self._ptype = ptype
            for cache in (self._dur, self._rem, self._pair, self._pair_val, self._pmodel, self._spread,
                          self._spread_m, self._reference_sigs):
                cache.clear()

    def _to_reference(self, sig: str, gpus: int, m: str) -> float:
        """The factor that converts a time measured on model `m` to the reference GPU: the speed there."""
        return self._speed_on(sig, gpus, m).value if gpus > 0 else 1.0

    def _stamp(self, key: str) -> Any:
        """What a signature's durations rest on: its version, and the GPU speeds when some of its
        measurements are on another model (they are converted with them)."""
        v = self._version.get(key, 0)
        return (v, self._speed_gen) if key in self._off_models else v

    def _with_off(self, st: "_LogStat | None", off: dict, key: str, k: tuple, sig: str, gpus: int) -> "_LogStat | None":
        """`st` (on the reference GPU) with the signature's measurements on other models in `off` (under
        `k` + (model,)) converted to it: a value measured t times on a model of speed s counts t x s."""
        for m in sorted(self._off_models.get(key, ())):
            o = off.get((*k, m))
            if o is not None and o.n:
                conv = _LogStat(o.n, o.mean + math.log(self._to_reference(sig, gpus, m)), o.m2)
                st = conv if st is None or not st.n else _merged(st, conv)
        return st

    def _step_stat(self, job: Job) -> "_LogStat | None":
        """The job signature's solo step times at its GPU count, on the reference GPU."""
        sig, key = self._sig_of(job)
        st = self._steps.get((key, job.qos.gpus))
        return st if key not in self._off_models else self._with_off(st, self._off, key, (key, job.qos.gpus), sig, job.qos.gpus)

    def _hist_stat(self, job: Job, hk: tuple[str, str | None]) -> "_LogStat | None":
        """The durations of the job signature's past runs (of a user, or everyone's), on the reference GPU."""
        sig, key = self._sig_of(job)
        st = self._hist.get(hk)
        return st if key not in self._off_models else self._with_off(st, self._hist_off, key, hk, sig, job.qos.gpus)

    def _placement_speed(self, job: Job, placement: Any) -> float:
        """Simulation: the estimated speed of the GPUs a placement holds (a gang runs at its slowest GPU's
        pace); 1.0 unless the engine gave `node_gpu_models`."""
        models = self.node_gpu_models
        if not models or job.qos.gpus <= 0:
            return 1.0
        return placement_gpu_speed(self, job, placement, models)

    # ------------------------------------------------------------------ the Estimator protocol

    # (the fast paths below answer cached questions without building Prediction objects: policies ask
    # hundreds of thousands of them per simulated trace)

    def duration(self, job: Job) -> float:
        hit = self._dur.get(job.job_id)
        if hit is not None and self._stamp(hit[2]) == hit[0]:
            return hit[1].value
        return self.predict_duration(job).value

    def remaining(self, js: JobState) -> float:
        if js.placement is None and js.progress <= 0:
            if self._where:
                self._where.pop(js.job_id, None)
            return self.duration(js.job)
        return self.predict_remaining(js).value

    def pair_slowdown(self, a: Job, b: Job) -> tuple[float, float]:
        """The slowdowns the scheduler plans with: `predict_pair`'s, except that a pair nobody has measured
        (the interference model's guess, or the default) is planned with a cautious value (see
        UNMEASURED_PAIR_CAUTION)."""
        sa, sb = self._sig.get(a.job_id), self._sig.get(b.job_id)
        if sa is not None and sb is not None:
            hit = self._pair_val.get((sa[1], sb[1]))
            if hit is not None:
                return hit
        self.predict_pair(a, b)
        return self._pair_val[(self._sig_of(a)[1], self._sig_of(b)[1])]

    def remaining_high(self, js: JobState) -> float:
        """The 90th percentile of the remaining time: its Prediction's `high` (the step time's or the
        history's band; once the job's signature has measured samples the band narrows to theirs)."""
        if js.placement is None and js.progress <= 0:
            p = self.predict_duration(js.job)  # cached per job, as `duration` reads it
        else:
            p = self.predict_remaining(js)
        return max(p.high, p.value) if math.isfinite(p.high) else p.value

    def pair_slowdown_high(self, a: Job, b: Job) -> tuple[float, float]:
        """The 90th percentiles of the pair's slowdowns (never below the values planned with)."""
        pa, pb = self.predict_pair(a, b)
        va, vb = self.pair_slowdown(a, b)
        return max(pa.high, va), max(pb.high, vb)

    def spread_slowdown(self, job: Job, num_nodes: int, min_nodes: int) -> float:
        if num_nodes <= min_nodes:
            return 1.0
        s = self.predict_spread(job).value
        # more extra nodes, more cross-node traffic (the same shape the simulator assumes)
        extra = (num_nodes - min_nodes) / max(1, num_nodes - 1)
        return 1.0 + (s - 1.0) * min(1.0, extra * 2.0)

    def cpu_factor(self, job: Job, cores: float) -> float:
        return self.predict_cpu(job, cores).value

    def basis(self, job: Job) -> str:
        """What the duration estimate of `job` rests on (the worker shows it)."""
        return self.predict_duration(job).basis

    def samples(self, job: Job) -> int:
        return self.predict_duration(job).n_samples

    # ------------------------------------------------------------------ online updates

    def observe_finished(self, js: JobState, now: float) -> None:
        """Simulator hook: a job finished (its placement is still set). Learn its per-iteration time, its
        duration, its slowdown next to the jobs it shared GPUs with and its penalty if it was spread --
        measured with the profiler's noise, as a live worker measures them from progress reports."""
        job = js.job
        sig, key = self._sig_of(job)
        last = self._where.pop(job.job_id, None)
        self._jobs.pop(job.job_id, None)  # finished: no longer anyone's co-runner
        where = js.placement if js.placement is not None else (last[0] if last is not None else None)
        if self.profiler is not None:
            t = self.profiler.finished_step_time(job)
            d = self.profiler.finished_duration(job)
            if where is not None:
                self._learn_placement(job, sig, key, where, frozenset(where.gpus))
        else:  # no simulated measurements: what the simulator saw (wall time, slowdowns included)
            d = js.attained if js.attained > 0 else None
            if d is not None and where is not None:
                d *= width_fraction(job, where)  # (an elastic start on fewer GPUs: its time on all of them)
            t = d / job.iterations if d and job.iterations else None
        self._learn(job, key, d, t)

    def _learn_placement(self, job: Job, sig: str, key: str, placement: Any, gpus: frozenset) -> None:
        """What a finished job's last placement measured (simulated): its slowdown next to each job that
        shared its GPUs (a co-located sample for the interference model) and its penalty if spread."""
        prof = self.profiler
        if placement.gpu_milli >= 1000 and job.qos.gpus > 0:
            partners = dict.fromkeys(j for j in placement.colocated_with if j in self._jobs)
            for jid, e in self._where.items():
                if e[0].gpu_milli >= 1000 and e[1] & gpus:
                    partners.setdefault(jid)
            for jid in partners:
                other = self._jobs.get(jid)
                if other is None or jid == job.job_id:
                    continue
                osig, okey = self._sig_of(other)
                base = self.predictor.predict_solo_step_time(sig, 1, gpu_type=self._ptype)
                if not (base.value > 0 and math.isfinite(base.value)) or base.basis.startswith("prior:"):
                    continue
                x = prof.colocated_slowdown(job, other)
                self.observe_colocated(job, other, x, _base=base.value)
        self.gpus_per_node = max(self.gpus_per_node, 1 + max((g for _n, g in placement.gpus), default=-1))
        gpn = max(self.gpus_per_node, 1)
        nodes = len({n for n, _g in placement.gpus})
        need = -(-job.qos.gpus // gpn) if job.qos.gpus > 0 else 1
        if job.qos.gpus > 1 and nodes > need:
            obs = prof.spread_slowdown(job, nodes, need)
            shape = min(1.0, 2.0 * (nodes - need) / max(1, nodes - 1))
            self.observe_spread(job, 1.0 + (obs - 1.0) / shape)

    def observe_spread(self, job: Job, penalty: float) -> None:
        """`job` measured `penalty` (spread / consolidated step time, Gavel's notion) while spread."""
        if not (math.isfinite(penalty) and penalty > 0):
            return
        sig, key = self._sig_of(job)
        model = self._spread_model(job, sig, key)
        self._spread_obs.setdefault((key, job.qos.gpus), _LogStat()).add(penalty)
        self._spread_resid.setdefault(key, _LogStat()).add(penalty / model.value)
        for k in [k for k in self._spread if k[0] == key]:
            del self._spread[k]
        self.stats["spreads_observed"] += 1

    def observe(self, job: Job, actual_s: float, *, steps: int | None = None, resumed_from: int = 0,
                where: Mapping[str, Any] | None = None) -> None:
        """Worker hook: a stage finished after `actual_s` seconds, alone on its GPUs (or where nothing is
        known about who shared them). `steps` is how many steps it reported (`report_progress`'s total),
        for a stage that does not state its iterations; `resumed_from`, how many of them an earlier run
        had done when this one started (`qosflow.report_resumed`); `where`, where it ran, for the store's rows
        (`QoSScheduler.where_ran`: host, gpu_type, placement, cpu_cores, started_at, finished_at). Learned, and
        written to the store. Measured on a GPU model other than the reference GPU (`where`'s gpu_type), its
        step time is evidence for the speed there; it and the duration are kept as measured and converted
        to the reference GPU when asked (`_step_stat`, `_hist_stat`), so a duration divided by the speed on
        that model stays what it measured. The store's sample names the model."""
        if not (isinstance(actual_s, (int, float)) and math.isfinite(actual_s) and actual_s > 0):
            return
        sig, key = self._sig_of(job)
        run = run_share(job, steps, resumed_from)
        if run is None:
            self._learn(job, key, None, None)
            return
        n, covered = run
        t = actual_s / n if n else None
        pred = self._dur.get(job.job_id)
        here = where or {}
        off = self._off_reference(self._model(here.get("gpu_type")))
        solo = here.get("placement", "consolidated") == "consolidated"
        cores = here.get("cpu_cores")
        if t is not None and cores and job.qos.gpus <= 1 and solo:
            f = 1.0 if off is None else self._to_reference(sig, job.qos.gpus, off)
            self.predictor.observe_cpu(sig, cores, t * f)  # CODA's curve learns from the stage's own runs
            self._cpu.pop(key, None)
        self._learn(job, key, float(actual_s) / covered, t if solo or off is None else None, model=off)
        self._persist(job, sig, float(actual_s), pred, t, n, resumed_from=resumed_from, where=where)

    def observe_stage(self, job: Job, actual_s: float, *, steps: int | None = None, partners: Sequence[Job] = (),
                      ran_alone: bool = True, resumed_from: int = 0, where: Mapping[str, Any] | None = None) -> None:
        """Worker hook with what the worker saw of the stage's GPUs: `partners`, every stage that shared
        them at some point, and `ran_alone`, whether it also ran without one.

        * alone the whole time: as `observe` (a solo step-time sample when it reported its steps);
        * one partner the whole time, with its steps reported and the signature's solo step time already
          measured: the ratio is a measured slowdown next to that partner (`observe_colocated`, and a
          co-located sample in the store); its wall time stays out of the duration history, which
          holds isolated durations (the store's row names the partner, so a restart skips it too);
        * anything else (partners coming and going): the wall time goes to the history as it is, and no
          step-time sample is taken (it would mix solo and shared intervals).

        A run resumed from a checkpoint (`resumed_from` steps done before it) did only part of the work:
        its step time is its time over the steps it ran, and the history gets the time a whole run would
        have taken at its pace (its time over the fraction of the steps it ran).
        """
        if not (isinstance(actual_s, (int, float)) and math.isfinite(actual_s) and actual_s > 0):
            return
        if not partners:
            self.observe(job, actual_s, steps=steps, resumed_from=resumed_from, where=where)
            return
        sig, key = self._sig_of(job)
        run = run_share(job, steps, resumed_from)
        if run is None:
            self._learn(job, key, None, None)
            return
        n, covered = run
        pred = self._dur.get(job.job_id)
        solo = self._step_stat(job)
        off = self._off_reference(self._model((where or {}).get("gpu_type")))
        if len(partners) == 1 and not ran_alone and n and solo is not None and solo.n:
            t = float(actual_s) / n
            f = 1.0 if off is None else self._to_reference(sig, job.qos.gpus, off)  # (to the reference GPU)
            slowdown = t * f / math.exp(solo.mean)
            if math.isfinite(slowdown) and slowdown > 0:
                partner = partners[0]
                self.observe_colocated(job, partner, max(slowdown, 1.0), _base=math.exp(solo.mean))
                self._learn(job, key, None, None, model=off)  # (its wall time includes the partner's slowdown)
                self._persist(job, sig, float(actual_s), pred, t, n, co_runner=self._sig_of(partner)[0],
                              resumed_from=resumed_from, where=where)
                return
        self._learn(job, key, float(actual_s) / covered, None, model=off)
        self._persist(job, sig, float(actual_s), pred, None, n, resumed_from=resumed_from, where=where)

    def forget(self, job: Job) -> None:
        """The worker is done with a stage (whatever its end): drop what is kept per job, so that a
        long-running worker's memory does not grow with every stage it has run."""
        for per_job in (self._sig, self._dur, self._rem, self._where, self._jobs, self.first_duration):
            per_job.pop(job.job_id, None)

    def _persist(self, job: Job, sig: str, actual_s: float, pred: Any, t: float | None, n: int | None, *,
                 co_runner: str | None = None, resumed_from: int = 0, where: Mapping[str, Any] | None = None) -> None:
        """Write a finished stage to the store: the duration prediction it was planned with and its
        outcome, its history row, and its step time as a sample (solo, or next to `co_runner`)."""
        if self.store is None or not self.persist:
            return
        if self.background_writes:
            if self._writer is None:
                from concurrent.futures import ThreadPoolExecutor

                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qosflow-store")
            self._writer.submit(self._write_stage, job, sig, actual_s, pred, t, n, co_runner, resumed_from, where)
        else:
            self._write_stage(job, sig, actual_s, pred, t, n, co_runner, resumed_from, where)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the finished stages handed to the store so far are written (background writes);
        False if `timeout` seconds passed first."""
        if self._writer is None:
            return True
        import concurrent.futures

        try:
            self._writer.submit(lambda: None).result(timeout)  # one thread, in order: the last to run
        except concurrent.futures.TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Write what is pending and end the background writer (the worker's teardown)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _write_stage(self, job: Job, sig: str, actual_s: float, pred: Any, t: float | None, n: int | None,
                     co_runner: str | None, resumed_from: int = 0, where: Mapping[str, Any] | None = None) -> None:
        here = {k: v for k, v in (where or {}).items() if k in _WHERE_FIELDS and v is not None}
        with self._own_lock:  # (until the ids are kept: `refresh_from_store` skips these rows)
            self._write_stage_rows(job, sig, actual_s, pred, t, n, co_runner, resumed_from, here)

    def _write_stage_rows(self, job: Job, sig: str, actual_s: float, pred: Any, t: float | None, n: int | None,
                          co_runner: str | None, resumed_from: int, here: Mapping[str, Any]) -> None:
        try:
            if not resumed_from:  # (a resumed run did part of what it was predicted on: no error to measure)
                if pred is not None:
                    self.store.record_prediction(pred[1], signature=sig, target="duration", stage_run_id=job.job_id)
                self.store.record_outcome(job.job_id, actual_s, signature=sig, target="duration")
            rid = self.store.record_stage(stage_run_id=job.job_id, signature=sig, stage=job.model, state="COMPLETED",
                                          gpus=job.qos.gpus, steps=n, duration_s=actual_s, step_time_s=t,
                                          flow_run_id=job.pipeline, co_runner=co_runner, resumed_from=resumed_from or None,
                                          **here)
            self._own["stage_history"].add(rid)
            if t is not None:  # (on the GPU model it ran on, when that is known)
                model = gpu_model_of(here.get("gpu_type"))  # (pure: this may run on the writer thread)
                sid = self.store.add_sample(signature=sig, gpus=job.qos.gpus, step_time_s=t, steps=n, source="stage",
                                      stage_run_id=job.job_id, co_runner=co_runner,
                                      **({"gpu_type": model} if model else {}),
                                      **{k: here[k] for k in ("placement", "cpu_cores") if k in here})
                self._own["sample"].add(sid)
        except Exception as exc:  # noqa: BLE001 - a database hiccup must not take the worker down
            log.warning("learned estimator: could not record stage %s in the store: %s", job.job_id, exc)

    def observe_colocated(self, job: Job, partner: Job, slowdown: float, *, _base: float | None = None,
                          to_predictor: bool = True) -> None:
        """`job` ran `slowdown` times slower while sharing its GPUs with `partner` (a measured sample).

        Answers for this pair follow the measurements at once; the sample also goes to the predictor,
        whose interference model is refitted after every PAIR_REFIT_EVERY newly measured pairs (so
        that the pairs not measured yet learn from it too)."""
        if not (math.isfinite(slowdown) and slowdown > 0):
            return
        sig, key = self._sig_of(job)
        osig, okey = self._sig_of(partner)
        self._co_obs.setdefault((key, okey), _LogStat()).add(slowdown)
        if to_predictor:  # (in-flight readings are many per run: kept here only)
            base = _base if _base is not None else self.predictor.predict_solo_step_time(
                sig, 1, gpu_type=self._ptype).value
            if base > 0 and math.isfinite(base):
                self.predictor.observe({"signature": sig, "co_runner": osig, "gpus": 1, "source": "stage",
                                        "step_time_s": base * slowdown, "gpu_type": self._ptype})
                if (key, okey) not in self._fed_pairs:
                    self._fed_pairs.add((key, okey))
                    self._new_pairs += 1
                    if self._new_pairs >= PAIR_REFIT_EVERY:
                        self._dirty = True
        for k in ((key, okey), (okey, key)):
            self._pair.pop(k, None)
            self._pair_val.pop(k, None)
        self.stats["colocations_observed"] += 1

    def _learn(self, job: Job, key: str, duration: float | None, step: float | None, *,
               model: str | None = None) -> None:
        """A finished run's duration and step time, measured on the reference GPU, or on GPU `model` (kept as
        measured there, and converted when asked: `_step_stat`, `_hist_stat`)."""
        if step is not None and step > 0:
            self._add_measured(self._steps, self._off, (key, job.qos.gpus), model, step)
        if duration is not None and duration > 0:
            for user in (None, job.user) if job.user else (None,):
                self._add_measured(self._hist, self._hist_off, (key, user), model, duration)
        self._bump(key)
        self._dur.pop(job.job_id, None)
        self._rem.pop(job.job_id, None)
        self._jobs.pop(job.job_id, None)
        self.stats["finished_observed"] += 1


#: the public methods of `LearnedEstimator` that hold its lock (`refresh_from_store` applies what it read from
#: the store under it, from a thread of its own, while the worker's event loop calls these)
_LOCKED = ("step_time", "predict_duration", "predict_remaining", "predict_pair", "predict_spread", "curve",
           "predict_cpu", "predict_gpu_speed", "gpu_speed", "duration", "remaining", "pair_slowdown",
           "remaining_high", "pair_slowdown_high", "spread_slowdown", "cpu_factor", "basis", "samples",
           "observe_finished", "observe_spread", "observe", "observe_stage", "forget", "observe_colocated")


def _locked(fn: Any) -> Any:
    @functools.wraps(fn)
    def holding_the_lock(self: LearnedEstimator, *args: Any, **kw: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kw)

    return holding_the_lock


for _name in _LOCKED:
    setattr(LearnedEstimator, _name, _locked(getattr(LearnedEstimator, _name)))
del _name

"""The online predictor: step times, co-location slowdowns, CPU curves and remaining times.

    p = Predictor.open()                 # samples from the store + Gavel's table (if present) as cold start
    p.predict_solo_step_time("resnet50/bs64", gpus=4, consolidated=False)
    p.predict_slowdown("resnet50/bs64", "lm/bs20")
    p.observe({"signature": "resnet50/bs64", "gpus": 4, "step_time_s": 0.11})   # after a finished stage
    p.refit()

Every answer is a `Prediction(value, low, high, n_samples, basis)`; docs/predictor.md lists the bases.
Samples are aggregated as they arrive (per signature, GPU type, GPUs, placement, cores, co-runner:
count, mean and variance of log step time), so `observe` is O(1) and `refit` works on the aggregates,
whose number does not grow with the number of samples. Answers are cached until the next
`observe`/`refit` that could change them; the `*_batch` methods run the models once per batch.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from qosflow.core.estimate import Z_HIGH as Z90
from qosflow.core.gpu_names import CPU_ONLY, short_gpu_model
from qosflow.predict.cpu import CpuCurve, default_curve, fit_curve
from qosflow.predict.interference import InterferenceModel, JobMeta
from qosflow.predict.prediction import INFEASIBLE_SLOWDOWN, Prediction
from qosflow.predict.reference import ThroughputTable, parse_signature
from qosflow.predict.scaling import ScalingModel, ScalingRow
from qosflow.predict.stats import SINGLE_SAMPLE_LOG_SD, LogStat

#: samples of the exact configuration needed before they alone are trusted
MIN_SAMPLES = 3
DEFAULT_PAIR_SLOWDOWN = 1.4


@functools.lru_cache(maxsize=8192)  # (a store's samples name a few hundred signatures, read again and again)
def canonical(signature: str) -> str:
    """A signature's matching key: lower-case alphanumeric family + batch size ('ResNet-50 (batch size 64)'
    and 'resnet50/bs64' both give 'resnet50|bs64')."""
    fam, bs = parse_signature(signature)
    f = re.sub(r"[^a-z0-9]", "", fam.lower()) or fam
    return f"{f}|bs{bs}" if bs is not None else f


def _interval(log_mean: float, log_sd: float) -> tuple[float, float, float]:
    return math.exp(log_mean), math.exp(log_mean - Z90 * log_sd), math.exp(log_mean + Z90 * log_sd)


class Predictor:
    def __init__(
        self,
        reference: ThroughputTable | None = None,
        *,
        gpu_type: str | None = None,
        refs: Sequence[str] | None = None,
        seed: int = 0,
        n_estimators: int = 100,
    ):
        from qosflow.predict.evaluate import REFERENCE_JOBS, choose_references

        self.reference = reference
        self.seed = seed
        self.n_estimators = n_estimators
        if gpu_type is None:
            gpu_type = "v100" if reference is not None and "v100" in reference.workers else (
                reference.workers[0] if reference is not None else "unknown")
        self.gpu_type = gpu_type
        ref_names = list(refs) if refs is not None else (
            choose_references(reference.jobs) if reference is not None else list(REFERENCE_JOBS))
        self.refs = [canonical(r) for r in ref_names]
        self._names: dict[str, str] = {}  # canonical -> a display signature
        # (canonical sig, gpu_type, gpus, consolidated, cpu_cores|None, co_runner canonical|None) -> LogStat
        self._stats: dict[tuple, LogStat] = {}
        self._cpu: dict[str, list[tuple[float, float]]] = {}  # sig -> [(cores, step time)] at 1 GPU solo
        #: a pooled (all core counts) solo stat's key -> {cores the samples ran with (None: not said): count}
        self._pool_cores: dict[tuple, dict[float | None, int]] = {}
        self._ref_solo: dict[tuple[str, str, int, bool], float] = {}  # (sig, gpu_type, gpus, cons) -> step time
        self._ref_pair: dict[tuple[str, str, str], float] = {}  # (a, b, gpu_type) -> speed of a next to b
        if reference is not None:
            self._load_reference(reference)
        #: the GPU types the reference table measured (`type_key`)
        self._table_types = frozenset(g for (_s, g, _n, _c) in self._ref_solo)
        self._cache: dict[tuple, Prediction] = {}
        self.scaling: ScalingModel | None = None
        self.interference: dict[str, InterferenceModel] = {}
        self._dirty_scaling = True
        self._dirty_pairs: set[str] = set(self._gpu_types())
        self.n_observed = 0
        #: the last profile `load_store` read (its next call reads those stored since)
        self.last_profile_id = 0
        #: `_profile_key`s of the profiling runs read as samples (`apply_store_rows`)
        self._profiled_runs: set[tuple] = set()

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(cls, store: Any = None, *, reference: ThroughputTable | str | None = "auto",
             on_sample: Callable[[Any], None] | None = None, **kw) -> "Predictor":
        """A predictor over `store` (a `qosflow.store.Store`, default `Store.open()`) and the reference table
        ('auto': Gavel's shared table when present, None: samples only). `on_sample`: see `load_store`."""
        if isinstance(reference, str):
            from qosflow.predict.reference import default_gavel_path

            path = default_gavel_path() if reference == "auto" else reference
            try:
                reference = ThroughputTable.load(path)
            except Exception:  # noqa: BLE001 - no reference table: learn from samples alone
                if reference != "auto":
                    raise
                reference = None
        p = cls(reference, **kw)
        if store is None:
            from qosflow.store import Store

            store = Store.open()
        p.load_store(store, on_sample=on_sample)
        p.refit()
        return p

    def _load_reference(self, t: ThroughputTable) -> None:
        for (w, cons, n), arr in t.solo.items():
            for j in t.jobs:
                thr = arr[t.index[j]]
                if thr > 0:
                    self._ref_solo[(canonical(j), w, n, cons)] = 1.0 / float(thr)
        for w, M in t.pair_speed.items():
            for a in t.jobs:
                for b in t.jobs:
                    v = M[t.index[a], t.index[b]]
                    if not np.isnan(v):
                        self._ref_pair[(canonical(a), canonical(b), w)] = float(v)
        for j in t.jobs:
            self._names.setdefault(canonical(j), j)

    def load_store(self, store: Any, since_id: int = 0, *, on_sample: Callable[[Any], None] | None = None,
                   profiles_since_id: int | None = None) -> int:
        """Observe the store's samples (those with ids above `since_id`) and profiles (above
        `profiles_since_id`; default: the last one this predictor read, `last_profile_id`, so a second call
        does not observe a profile twice). A stored sample that fails today's validation (written
        by an older qosflow, e.g. an infinite step time) is skipped with a warning naming its id, so one
        bad row does not stop the predictor from loading the rest (`self.skipped_samples` lists them).
        `on_sample` is called with every stored sample read (valid or not: a row with Sample's columns but
        created_at as attributes), so that a caller that needs them too (`LearnedEstimator`) does not read
        them a second time. Returns the id of the last sample read (`since_id` when none)."""
        from qosflow.store.store import SAMPLE_VALUE_COLUMNS

        # profiles first: `qosflow profile` stores a run's samples before its profile, so every profile read
        # here has its samples among those read next (one run observed once: `apply_store_rows`)
        profiles = store.profiles_for(since_id=self.last_profile_id if profiles_since_id is None else profiles_since_id)
        rows = store.sample_rows(*SAMPLE_VALUE_COLUMNS, since_id=since_id)
        return self.apply_store_rows(store, rows, profiles, since_id=since_id, on_sample=on_sample)

    def apply_store_rows(self, store: Any, rows: Iterable[Any], profiles: Sequence[Any] = (), *, since_id: int = 0,
                         on_sample: Callable[[Any], None] | None = None) -> int:
        """Observe sample rows (`Store.sample_rows(*SAMPLE_VALUE_COLUMNS)`) and profiles read from `store`
        (`load_store`, or a caller that read them itself: `LearnedEstimator.refresh_from_store`). Returns the
        id of the last sample row (`since_id` when none)."""
        from qosflow.errors import SpecError
        from qosflow.store.store import SAMPLE_VALUE_COLUMNS

        last = since_id
        skipped: list[tuple[int, str]] = []
        # the runs `qosflow profile` stored as samples (it stores its best as a profile too), kept from one
        # call to the next: a profile read later than its samples is still that run once
        profiled = self._profiled_runs
        # rows of values, not ORM instances: building those was half of a worker's start. What `observe`
        # validates is what a `Sample` read back gave it: its columns but id, None left out (created_at,
        # always a valid time when read back, is not read)
        for s in rows:
            if on_sample is not None:
                on_sample(s)
            try:
                self.observe({k: v for k, v in zip(SAMPLE_VALUE_COLUMNS, s[1:]) if v is not None})
            except SpecError as exc:
                skipped.append((s.id, str(exc)))
            else:
                if getattr(s, "source", None) == "profile":
                    profiled.add(_profile_key(s.signature, s.gpu_type, s.gpus, s.cpu_cores, s.step_time_s))
            last = max(last, s.id)
        self.skipped_samples = getattr(self, "skipped_samples", []) + skipped
        _warn_skipped(store, skipped, "sample")
        bad_profiles: list[tuple[int, str]] = []
        for prof in profiles:
            import json

            self.last_profile_id = max(self.last_profile_id, int(prof.id))
            gpus = _profile_gpus(prof.gpu_type)
            # a profile whose solo run is also a stored sample is that run once, not twice
            solo = _profile_key(prof.signature, prof.gpu_type, gpus, prof.cpu_cores, prof.solo_step_time_s) not in profiled
            try:
                self.observe_profile(prof.signature, prof.solo_step_time_s, gpu_type=prof.gpu_type,
                                     ref_speeds=json.loads(prof.ref_speeds_json),
                                     ref_partner_speeds=json.loads(prof.ref_partner_speeds_json),
                                     cpu_cores=prof.cpu_cores, solo=solo)
            except SpecError as exc:
                bad_profiles.append((prof.id, str(exc)))
        self.skipped_profiles = getattr(self, "skipped_profiles", []) + bad_profiles
        _warn_skipped(store, bad_profiles, "profile")
        return last

    # ------------------------------------------------------------------ online updates

    def observe(self, sample: Mapping[str, Any] | Any) -> None:
        """Add one measured sample (a dict in the store's sample format, or a `qosflow.store.Sample`)."""
        from qosflow.store.store import validate_sample

        d = validate_sample(sample)
        sig = canonical(d["signature"])
        self._names.setdefault(sig, d["signature"])
        co = canonical(d["co_runner"]) if d.get("co_runner") else None
        gt = self.type_key(d.get("gpu_type"))
        cons = d["placement"] == "consolidated"
        log_t = math.log(d["step_time_s"])
        cores = d.get("cpu_cores")
        for key in dict.fromkeys([(sig, gt, d["gpus"], cons, None, co), (sig, gt, d["gpus"], cons, cores, co)]):
            st = self._stats.get(key)
            if st is None:  # a configuration not seen before changes what the models train on
                st = self._stats[key] = LogStat()
                if co is not None or d["gpus"] == 1:
                    self._dirty_pairs.add(gt)
                if co is None or sig in self.refs or co in self.refs:
                    self._dirty_scaling = True
            st.add_log(log_t)
        if co is None:
            mix = self._pool_cores.setdefault((sig, gt, d["gpus"], cons, None, None), {})
            mix[cores] = mix.get(cores, 0) + 1
        if cores is not None and co is None and d["gpus"] <= 1:
            self._cpu.setdefault(sig, []).append((float(cores), d["step_time_s"]))
        self.n_observed += 1
        self._cache.clear()

    def observe_profile(self, signature: str, solo_step_time_s: float, *, gpu_type: str | None = None,
                        ref_speeds: Mapping[str, float] | None = None,
                        ref_partner_speeds: Mapping[str, float] | None = None, cpu_cores: int | None = None,
                        solo: bool = True) -> None:
        """A lightweight profile: solo 1-GPU step time and co-located speeds with the reference jobs.
        With `solo=False` the solo step time is not observed again (it is already a sample: `load_store`
        passes that for the profiles `qosflow profile` stores next to its samples); it still scales the
        co-located speeds.

        A CPU-only profile (`gpu_type="cpu"`, what `qosflow profile` stores on a machine without a GPU) is a
        step time on `cpu_cores` cores and no GPU: it is observed as a 0-GPU sample, so it informs the job's
        CPU-core curve but no GPU step-time or scaling model (it was taken as a 1-GPU time on a GPU type
        named "cpu"). It cannot carry co-located speeds, which are measured sharing a GPU."""
        gpus = _profile_gpus(gpu_type)
        if gpus == 0:
            for name, speeds in (("ref_speeds", ref_speeds), ("ref_partner_speeds", ref_partner_speeds)):
                if speeds:
                    from qosflow.errors import SpecError

                    raise SpecError(name, "co-located speeds are measured sharing a GPU, but this profile is "
                                    f"CPU-only (gpu_type={CPU_ONLY!r}): give the GPU type they were measured on, "
                                    f"or leave {name} out", where=f"profile of {signature!r}")
            gt = CPU_ONLY  # and no co-located speeds below: checked above
        else:
            gt = self.type_key(gpu_type)
        if solo:
            self.observe({"signature": signature, "step_time_s": solo_step_time_s, "gpus": gpus, "gpu_type": gt,
                          "cpu_cores": cpu_cores, "source": "profile"})
        for ref, speed in (ref_speeds or {}).items():
            if speed > 0:
                self.observe({"signature": signature, "co_runner": ref, "gpu_type": gt, "gpus": 1,
                              "step_time_s": solo_step_time_s / speed, "source": "profile"})
        for ref, speed in (ref_partner_speeds or {}).items():
            base = self._solo_log(canonical(ref), gt, 1, True)
            if speed > 0 and base is not None:
                self.observe({"signature": ref, "co_runner": signature, "gpu_type": gt, "gpus": 1,
                              "step_time_s": math.exp(base[0]) / speed, "source": "profile"})

    def type_key(self, gpu_type: str | None) -> str:
        """The GPU type a sample measured on `gpu_type` is kept (and asked) under: its own (short) name when
        the predictor has data of that type to relate it to -- the reference table measured it, or it is the
        predictor's own type, or CPU-only; otherwise (no type, 'unknown', 'generic', or a model the table
        does not know, such as an A100 next to Gavel's K80/P100/V100) the predictor's own type, as samples
        without a type always were. So a homogeneous cluster's samples meet the models whatever its GPUs are
        called, and a K80's samples are not mistaken for a V100's."""
        if not gpu_type or gpu_type in (self.gpu_type, CPU_ONLY):
            return gpu_type or self.gpu_type
        short = short_gpu_model(gpu_type)
        return short if short in self._table_types else self.gpu_type

    def reference_speed(self, signature: str, gpus: int, gpu_type: str, base_type: str) -> float | None:
        """The reference table's solo, consolidated speed of `signature` on `gpu_type` relative to `base_type`
        at `gpus` GPUs (its step time on `base_type` over that on `gpu_type`). A GPU count the table did not
        measure is read at the largest one below it, scaled linearly, as the simulator extrapolates
        (`qosflow.sim.interference.GavelInterference.gpu_speed`). None when the table lacks the signature
        on either type."""
        sig = canonical(signature)
        here, base = (self._reference_step_time(sig, g, gpus) for g in (gpu_type, base_type))
        return base / here if here and base else None

    def _reference_step_time(self, sig: str, gt: str, gpus: int) -> float | None:
        """The table's solo consolidated step time of `sig` on `gt` at `gpus` GPUs, or extrapolated."""
        gpus = max(1, gpus)
        hit = self._ref_solo.get((sig, gt, gpus, True))
        if hit:
            return hit
        ns = [n for (s, g, n, cons) in self._ref_solo if s == sig and g == gt and cons and n <= gpus]
        return self._ref_solo[(sig, gt, max(ns), True)] * max(ns) / gpus if ns else None

    # ------------------------------------------------------------------ model fitting

    def _solo_log(self, sig: str, gt: str, gpus: int, cons: bool) -> tuple[float, float, int, str] | None:
        """(log step time, log sd, n, basis) from samples (>= 1) or the reference table, else None."""
        st = self._stats.get((sig, gt, gpus, cons, None, None))
        if st is not None and st.n >= 1:
            return st.mean, st.sd, st.n, f"samples(n={st.n})"
        ref = self._ref_solo.get((sig, gt, gpus, cons))
        if ref is not None:
            return math.log(ref), SINGLE_SAMPLE_LOG_SD / 2, 0, f"reference:gavel/{gt}"
        return None

    def _meta(self, sig: str, gt: str) -> JobMeta:
        fam, bs = sig.split("|bs")[0], None
        if "|bs" in sig:
            try:
                bs = float(sig.split("|bs")[1])
            except ValueError:
                bs = None
        base = self._solo_log(sig, gt, 1, True)
        return JobMeta(fam, bs, 1, base[0] if base else None)

    def _pair_obs(self, gt: str) -> dict[tuple[str, str], float]:
        """Every known co-located speed on `gt`: reference table, overridden by samples."""
        obs = {(a, b): v for (a, b, w), v in self._ref_pair.items() if w == gt}
        for (sig, g, n, cons, cores, co), st in self._stats.items():
            if co is None or g != gt or n != 1 or cores is not None:
                continue
            base = self._solo_log(sig, gt, 1, True)
            if base is not None:
                obs[(sig, co)] = math.exp(base[0] - st.mean)
        return obs

    def _profiles(self, gt: str, obs: Mapping[tuple[str, str], float]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for (a, b), v in obs.items():
            if b in self.refs:
                out.setdefault(a, {})[f"with:{b}"] = v
            if a in self.refs:
                out.setdefault(b, {})[f"of:{a}"] = v
        return out

    def _gpu_types(self) -> set[str]:
        return {k[1] for k in self._stats} | {k[1] for k in self._ref_solo} | {self.gpu_type}

    def refit(self, full: bool = False) -> dict[str, bool]:
        """Refit the models whose training set changed shape since the last refit (a new configuration,
        pair or job); `full=True` refits everything. Cost is bounded by the number of distinct
        configurations, not samples: new samples of known configurations only move the aggregates,
        which the direct look-ups read at prediction time. Returns which models were refitted."""
        gts = self._gpu_types()
        done = {"scaling": False}
        if full or self._dirty_scaling:
            self._refit_scaling(gts)
            done["scaling"] = True
        for g in sorted(gts):
            if full or g in self._dirty_pairs:
                self._refit_pairs(g)
                done[f"interference/{g}"] = True
        self._dirty_scaling = False
        self._dirty_pairs = set()
        self._cache.clear()
        return done

    def needs_refit(self) -> bool:
        """Whether a model's training set changed shape since the last refit (`refit` would refit one)."""
        return bool(self._dirty_scaling or self._dirty_pairs)

    def refit_snapshot(self) -> "Predictor":
        """A copy of what `refit` reads (the aggregates, as they are now), to refit in another thread while
        this predictor goes on answering and observing: `snap.refit()` there, then `install_refit(snap)`
        (both under the caller's lock but the refit itself). This predictor's marks of what needs a refit
        move to the copy; whatever marks a model after this call stays marked here."""
        import copy

        snap = copy.copy(self)
        snap._stats = {k: copy.copy(v) for k, v in self._stats.items()}
        snap._names = dict(self._names)
        snap._pool_cores = {k: dict(v) for k, v in self._pool_cores.items()}
        snap._cpu = {k: list(v) for k, v in self._cpu.items()}
        snap._cache = {}
        snap.interference = dict(self.interference)
        snap._dirty_pairs = set(self._dirty_pairs)
        self._dirty_scaling, self._dirty_pairs = False, set()
        return snap

    def install_refit(self, snap: "Predictor", done: Mapping[str, bool]) -> None:
        """Take the models `snap.refit()` fitted (`done`: what it returned) from a `refit_snapshot`."""
        if done.get("scaling"):
            self.scaling = snap.scaling
        for key, did in done.items():
            if did and key.startswith("interference/"):
                g = key.split("/", 1)[1]
                if g in snap.interference:
                    self.interference[g] = snap.interference[g]
                else:
                    self.interference.pop(g, None)
        self._cache.clear()

    def restore_refit_marks(self, snap: "Predictor") -> None:
        """A refit of `snap` failed: mark again what it was to refit."""
        self._dirty_scaling = self._dirty_scaling or snap._dirty_scaling
        self._dirty_pairs |= snap._dirty_pairs

    def _refit_scaling(self, gts: set[str]) -> None:
        rows, metas, profs = [], {}, {}
        seen: set = set()
        keys = {(s, g, n, c) for (s, g, n, c, cores, co) in self._stats if co is None and cores is None}
        keys |= set(self._ref_solo)
        for sig, g, n, cons in sorted(keys):  # sorted: set order varies between processes (hash seed)
            if n <= 1 or (sig, g, n, cons) in seen:
                continue
            seen.add((sig, g, n, cons))
            tn = self._solo_log(sig, g, n, cons)
            t1 = self._solo_log(sig, g, 1, True)
            if tn is None or t1 is None:
                continue
            rows.append(ScalingRow(f"{sig}@{g}", g, n, cons, math.exp(t1[0] - tn[0])))
        for g in sorted(gts):
            obs = self._pair_obs(g)
            pr = self._profiles(g, obs)
            for sig in sorted({r.job.split("@")[0] for r in rows if r.gpu_type == g} | set(pr)):
                metas[f"{sig}@{g}"] = self._meta(sig, g)
                profs[f"{sig}@{g}"] = pr.get(sig, {})
        self.scaling = ScalingModel(self.refs, n_estimators=self.n_estimators, seed=self.seed).fit(rows, metas, profs) if len(rows) >= 5 else None

    def _refit_pairs(self, g: str) -> None:
        obs = {k: v for k, v in self._pair_obs(g).items() if v > 0}
        jobs = {k for ab in obs for k in ab}
        self.interference.pop(g, None)
        if len(obs) >= 20 and len(jobs) >= 4:
            metas_g = {s: self._meta(s, g) for s in sorted(jobs)}
            self.interference[g] = InterferenceModel(
                [r for r in self.refs if r in jobs], regime="new_job", n_estimators=self.n_estimators,
                inner_folds=3, seed=self.seed, max_train_rows=800).fit(obs, metas_g)

    # ------------------------------------------------------------------ solo step time

    def predict_solo_step_time(self, signature: str, gpus: int = 1, consolidated: bool = True,
                               cpu_cores: int | None = None, *, gpu_type: str | None = None) -> Prediction:
        return self.predict_solo_step_time_batch([(signature, gpus, consolidated, cpu_cores)], gpu_type=gpu_type)[0]

    def predict_solo_step_time_batch(self, queries: Sequence[tuple], *, gpu_type: str | None = None) -> list[Prediction]:
        """Queries are (signature, gpus[, consolidated[, cpu_cores]]) tuples. `gpus` 0 asks for a CPU-only
        stage's step time: from its CPU-only samples (`qosflow profile` on a machine without a GPU, a 0-GPU
        stage's runs), whatever `gpu_type` says, else from the other signatures' (`_prior`)."""
        gt = self.type_key(gpu_type)  # (asked under the name its samples are kept under)
        out: list[Prediction | None] = [None] * len(queries)
        need_model: list[tuple[int, str, int, bool, int | None, tuple]] = []
        for i, q in enumerate(queries):
            sig_raw, gpus = q[0], int(q[1])
            if gpus < 0:
                raise ValueError(f"solo step time of {sig_raw!r}: gpus must be 0 (CPU-only) or more, got {gpus}")
            cons = bool(q[2]) if len(q) > 2 else True
            cores = q[3] if len(q) > 3 else None
            qt = CPU_ONLY if gpus == 0 else gt  # (a CPU-only sample is kept under "cpu")
            key = ("solo", sig_raw, qt, gpus, cons, cores)
            hit = self._cache.get(key)
            if hit is not None:
                out[i] = hit
                continue
            sig = canonical(sig_raw)
            if gpus <= 1 and not cons:
                cons = True  # one GPU (or none) cannot be spread
            pred = self._solo_direct(sig, qt, gpus, cons, cores)
            if pred is None:
                need_model.append((i, sig, gpus, cons, cores, key))
            else:
                out[i] = self._cache[key] = pred
        if need_model:
            preds = self._solo_model([(sig, gpus, cons, cores) for _i, sig, gpus, cons, cores, _k in need_model], gt)
            for (i, *_rest, key), pred in zip(need_model, preds):
                out[i] = self._cache[key] = pred
        return out  # type: ignore[return-value]

    def _cpu_adjust(self, sig: str, pred: Prediction, cores: int | None, measured: tuple | None = None) -> Prediction:
        """`pred` (a step time) at `cores` CPU cores, on the job's CPU curve. `measured`: the key of the
        pooled samples `pred` comes from; they ran at their own core counts (their geometric-mean speed
        fraction is the base), not at unlimited cores: a step time measured at 4 cores and asked at 4
        cores was slowed down once more by the curve's fraction at 4 (0.2 s -> 0.21 s)."""
        if cores is None:
            return pred
        curve = self.cpu_curve(sig)
        mix = self._pool_cores.get(measured) if measured is not None else None
        base = 1.0
        if mix:
            n = sum(mix.values())
            base = math.exp(sum(k * math.log(curve.speed_fraction(c) if c else 1.0) for c, k in mix.items()) / n)
        f = base / curve.speed_fraction(cores)
        if abs(f - 1) < 1e-9:
            return pred
        return pred.scaled(f, f"{pred.basis}+cpu:{curve.basis}")

    def _solo_direct(self, sig: str, gt: str, gpus: int, cons: bool, cores: int | None) -> Prediction | None:
        # a CPU-only stage (gpus 0) has no GPU model to fall back on: its own samples count from the first
        need = 1 if gpus == 0 else MIN_SAMPLES
        if cores is not None:
            st = self._stats.get((sig, gt, gpus, cons, cores, None))
            if st is not None and st.n >= need:
                return Prediction(*_interval(st.mean, st.sd), st.n, f"samples(n={st.n},cores={cores})")
        st = self._stats.get((sig, gt, gpus, cons, None, None))
        if st is not None and st.n >= need:
            return self._cpu_adjust(sig, Prediction(*_interval(st.mean, st.sd), st.n, f"samples(n={st.n})"), cores,
                                    (sig, gt, gpus, cons, None, None))
        if st is None:
            ref = self._ref_solo.get((sig, gt, gpus, cons))
            if ref is not None:
                lm = math.log(ref)
                return self._cpu_adjust(sig, Prediction(*_interval(lm, SINGLE_SAMPLE_LOG_SD), 0, f"reference:gavel/{gt}"), cores)
        if gpus == 1:
            base = self._solo_log(sig, gt, 1, True)
            if base is not None:
                return self._cpu_adjust(sig, Prediction(*_interval(base[0], base[1]), base[2], base[3]), cores,
                                        (sig, gt, 1, True, None, None) if base[2] else None)
            return self._cpu_adjust(sig, self._prior(sig, gt), cores)
        if gpus == 0:  # no CPU-only sample of its own: the other signatures' median
            return self._cpu_adjust(sig, self._prior(sig, gt, gpus=0), cores)
        return None

    def _prior(self, sig: str, gt: str, gpus: int = 1) -> Prediction:
        """Nothing measured for this job: the median step time on `gpus` GPUs (1, or 0: CPU-only) of all jobs
        known on this GPU type."""
        vals = [math.exp(st.mean) for (s, g, n, c, cores, co), st in self._stats.items()
                if g == gt and n == gpus and co is None and cores is None]
        vals += [t for (s, g, n, c), t in self._ref_solo.items() if g == gt and n == gpus]
        v = float(np.median(vals)) if vals else 1.0
        return Prediction(v, v / 10, v * 10, 0, "prior:none" + (f"(median of {len(vals)} jobs)" if vals else "(1 s)"))

    def _solo_model(self, qs: list[tuple[str, int, bool, int | None]], gt: str) -> list[Prediction]:
        out = []
        model_q, model_idx = [], []
        bases = []
        for k, (sig, gpus, cons, cores) in enumerate(qs):
            base = self._solo_log(sig, gt, 1, True)
            bases.append(base)
            if base is None:
                out.append(self._cpu_adjust(sig, self._prior(sig, gt).scaled(1.0 / gpus, f"prior:none/{gpus}gpus"), cores))
                continue
            out.append(None)
            if self.scaling is not None:
                model_q.append((f"{sig}@{gt}", gt, gpus, cons))
                model_idx.append(k)
        ratios = {}
        if model_q:
            extra = {f"{qs[k][0]}@{gt}": self._meta(qs[k][0], gt) for k in model_idx}
            # profiles as of the last refit (a new profile marks the scaling model dirty)
            r, lo, hi = self.scaling.predict(model_q, extra_meta=extra)
            ratios = {k: (r[i], lo[i], hi[i]) for i, k in enumerate(model_idx)}
        for k, (sig, gpus, cons, cores) in enumerate(qs):
            if out[k] is not None:
                continue
            lm, lsd, n, basis = bases[k]
            t1, t1lo, t1hi = _interval(lm, lsd)
            st = self._stats.get((sig, gt, gpus, cons, None, None))
            if k in ratios:
                r, rlo, rhi = ratios[k]
                pred = Prediction(t1 / r, t1lo / rhi, t1hi / rlo, n, f"{basis}+scaling-model(train={self.scaling.n_train})")
            else:
                eff = 0.85 ** math.log2(max(gpus, 1)) * (1.0 if cons else 0.8)
                r = gpus * eff
                pred = Prediction(t1 / r, t1lo / gpus, t1hi / (gpus * 0.4), n, f"{basis}+fallback:linear-scaling")
            if st is not None and st.n > 0:  # one or two samples of this exact config: blend (precision-weighted)
                w_s = st.n / (st.n + 1.0)
                lv = w_s * st.mean + (1 - w_s) * math.log(pred.value)
                pred = Prediction(math.exp(lv), min(pred.low, math.exp(st.mean)) , max(pred.high, math.exp(st.mean)),
                                  st.n + n, f"samples(n={st.n})+{pred.basis}")
            # (the samples the 1-GPU base comes from, else this configuration's own)
            out[k] = self._cpu_adjust(sig, pred, cores, (sig, gt, 1, True, None, None) if n else (sig, gt, gpus, cons, None, None))
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ co-location

    def predict_slowdown(self, sig_a: str, sig_b: str, *, gpu_type: str | None = None) -> Prediction:
        """How many times longer a's steps take while sharing its GPU(s) with b (>= 1 usually)."""
        return self.predict_slowdown_batch([(sig_a, sig_b)], gpu_type=gpu_type)[0]

    def predict_colocated_speed(self, sig_a: str, sig_b: str, *, gpu_type: str | None = None) -> Prediction:
        p = self.predict_slowdown(sig_a, sig_b, gpu_type=gpu_type)
        return Prediction(1.0 / p.value, 1.0 / p.high, 1.0 / p.low, p.n_samples, p.basis)

    def predict_slowdown_batch(self, pairs: Sequence[tuple[str, str]], *, gpu_type: str | None = None) -> list[Prediction]:
        gt = self.type_key(gpu_type)  # (asked under the name its samples are kept under)
        out: list[Prediction | None] = [None] * len(pairs)
        todo = []
        for i, (a_raw, b_raw) in enumerate(pairs):
            key = ("slow", a_raw, b_raw, gt)
            hit = self._cache.get(key)
            if hit is not None:
                out[i] = hit
                continue
            a, b = canonical(a_raw), canonical(b_raw)
            pred = self._slowdown_direct(a, b, gt)
            if pred is None:
                todo.append((i, a, b, key))
            else:
                out[i] = self._cache[key] = pred
        if todo:
            model = self.interference.get(gt)
            if model is not None:
                # only what the model has not seen at its last refit (usually nothing): rebuilding the
                # model's look-up context costs a factorisation
                extra = {s: self._meta(s, gt) for _i, a, b, _k in todo for s in (a, b) if s not in model.meta}
                asked = {s for _i, a, b, _k in todo for s in (a, b)}
                obs_extra = {k: v for k, v in self._pair_obs(gt).items()
                             if (k[0] in asked or k[1] in asked) and v > 0 and k not in model.obs}
                sp, lo, hi, support = model.predict([(a, b) for _i, a, b, _k in todo], extra_obs=obs_extra, extra_meta=extra)
                for j, (i, a, b, key) in enumerate(todo):
                    prof = sum(1 for r in self.refs if (a, r) in model.obs or (a, r) in obs_extra)
                    basis = f"{'profile' if prof else 'no-profile'}+interference-model(obs={len(model.obs)},ref-pairs={prof})"
                    out[i] = self._cache[key] = Prediction(1 / sp[j], 1 / hi[j], 1 / lo[j], int(support[j]), basis)
            else:
                for i, a, b, key in todo:
                    out[i] = self._cache[key] = Prediction(DEFAULT_PAIR_SLOWDOWN, 1.0, 2.5, 0, "fallback:default-slowdown")
        return out  # type: ignore[return-value]

    def _slowdown_direct(self, a: str, b: str, gt: str) -> Prediction | None:
        st = self._stats.get((a, gt, 1, True, None, b))
        base = self._solo_log(a, gt, 1, True)
        if st is not None and base is not None and st.n >= MIN_SAMPLES:
            sd = math.sqrt(st.sd**2 + base[1] ** 2)
            v, lo, hi = _interval(st.mean - base[0], sd)
            return Prediction(v, lo, hi, st.n, f"samples(n={st.n})")
        ref = self._ref_pair.get((a, b, gt))
        if ref is not None and st is None:
            if ref <= 0:
                return Prediction(INFEASIBLE_SLOWDOWN, INFEASIBLE_SLOWDOWN, INFEASIBLE_SLOWDOWN, 0,
                                  f"reference:gavel/{gt}(failed together)")
            v, lo, hi = _interval(-math.log(ref), SINGLE_SAMPLE_LOG_SD)
            return Prediction(v, lo, hi, 0, f"reference:gavel/{gt}")
        return None

    # ------------------------------------------------------------------ CPU cores

    def observe_cpu(self, signature: str, cores: float, step_time_s: float) -> None:
        """A solo step time measured with `cores` CPU cores (at most one GPU): a point of CODA's curve."""
        if cores > 0 and step_time_s > 0 and math.isfinite(step_time_s):
            self._cpu.setdefault(canonical(signature), []).append((float(cores), float(step_time_s)))
            self._cache.clear()

    def cpu_curve(self, signature: str) -> CpuCurve:
        sig = canonical(signature)
        pts = self._cpu.get(sig, [])
        curve = fit_curve([c for c, _ in pts], [t for _, t in pts]) if pts else None
        return curve or default_curve()

    def predict_cpu_speedup(self, signature: str, cores: float, *, base_cores: float = 1.0) -> Prediction:
        """Speed with `cores` cores relative to `base_cores` (CODA's curve; >= 1 while adding cores helps)."""
        key = ("cpu", signature, cores, base_cores)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        curve = self.cpu_curve(signature)
        v = curve.speedup(cores, base_cores)
        rel = 0.05 if curve.n_samples >= MIN_SAMPLES else 0.3
        pred = Prediction(v, max(min(v, 1.0) if cores >= base_cores else 0.0, v * (1 - rel)), v * (1 + rel),
                          curve.n_samples, f"{curve.basis};saturation={curve.saturation_cores:.1f}cores")
        self._cache[key] = pred
        return pred

    # ------------------------------------------------------------------ remaining time

    def predict_remaining(self, signature: str, progress_fraction: float, elapsed: float, *,
                          total_steps: int | None = None, gpus: int = 1, consolidated: bool = True,
                          gpu_type: str | None = None, prior_total: Prediction | None = None,
                          start_fraction: float = 0.0) -> Prediction:
        """Time left for a running stage from its progress (fraction done) and time spent so far.

        The observed rate (elapsed / progress) is blended with the prior from the predicted step time
        (when `total_steps` is known) or, failing that, from `prior_total` (a prediction of the whole
        stage's time, e.g. from its history), trusting the observation more as progress grows.
        `start_fraction`: the progress an earlier run had made when this one, whose `elapsed` it is,
        started (a resumed run): the rate is read from the progress since.
        """
        f = min(max(float(progress_fraction), 0.0), 1.0)
        if f >= 1.0:
            return Prediction(0.0, 0.0, 0.0, 0, "finished")
        f0 = min(max(float(start_fraction), 0.0), f)
        prior = None
        if total_steps:
            p = self.predict_solo_step_time(signature, gpus, consolidated, gpu_type=gpu_type)
            left = total_steps * (1 - f)
            prior = Prediction(p.value * left, p.low * left, p.high * left, p.n_samples, p.basis)
        elif prior_total is not None and math.isfinite(prior_total.value):
            prior = prior_total.scaled(1 - f)
        label = f"progress(f={f:.2f})" if f0 <= 0 else f"progress(f={f:.2f},resumed at {f0:.2f})"
        if f0 > 0:  # the observation covers this run's own work only: read it as a run of that work
            f = (f - f0) / (1.0 - f0)
        if f <= 0 or elapsed <= 0:
            if prior is not None:
                return Prediction(prior.value, prior.low, prior.high, prior.n_samples, f"prior:{prior.basis}")
            return Prediction(math.inf, 0.0, math.inf, 0, "prior:none(no progress yet)")
        obs = elapsed * (1 - f) / f
        # the observed rate's error shrinks as more of the stage is seen
        rel = 0.25 * math.sqrt((1 - f) / max(f, 1e-6)) / (1 + 4 * f) + 0.02
        if prior is None:
            return Prediction(obs, obs / (1 + rel), obs * (1 + rel), 0, label)
        w = f / (f + 0.1)
        lv = w * math.log(obs) + (1 - w) * math.log(prior.value)
        v = math.exp(lv)
        return Prediction(v, min(v / (1 + rel), prior.low if w < 0.5 else v / (1 + rel)),
                          max(v * (1 + rel), prior.high if w < 0.5 else v * (1 + rel)), prior.n_samples,
                          f"{label}+prior:{prior.basis}")


def _profile_gpus(gpu_type: str | None) -> int:
    """GPUs of a profile's solo run: none for a CPU-only profile, else one. `observe_profile` observes the
    run with it and `load_store` finds the run among the stored samples with it."""
    return 0 if gpu_type == CPU_ONLY else 1


def _profile_key(signature: str, gpu_type: str | None, gpus: int | None, cpu_cores: Any, step_time_s: float) -> tuple:
    """What identifies one profiling run, to match a stored profile with the sample of the same run."""
    cores = None if cpu_cores is None else round(float(cpu_cores), 6)
    return (signature, gpu_type, int(gpus or 0), cores, round(float(step_time_s), 12))


def _warn_skipped(store: Any, skipped: list[tuple[int, str]], table: str) -> None:
    """One warning naming the invalid rows of `table` that loading the store skipped."""
    if not skipped:
        return
    import logging

    where = getattr(store, "safe_url", "the store")
    logging.getLogger(__name__).warning(
        "skipped %d invalid %s(s) in %s (fix or delete those rows of table '%s'): %s",
        len(skipped), table, where, table, "; ".join(f"id={i}: {m}" for i, m in skipped[:5]))

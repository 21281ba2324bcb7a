"""Measured interference: Gavel's throughput table as a `qosflow.core.speed.InterferenceSource`.

Gavel (Narayanan et al., OSDI'20) measured the throughput (steps/s) of 26 job types at scale factors
1, 2, 4 and 8 on K80, P100 and V100 GPUs, alone and co-located in pairs, consolidated on one server
and spread over servers. The file (``../shared/data/throughputs/gavel_simulation_throughputs.json``)
is organised as::

    {"v100": {"('ResNet-18 (batch size 32)', 1)": {"null": 29.9,                  # alone
                                                    "('A3C', 1)": [5.76, 3.66],  # [this, other] together
                                                    ...}, ...},
     "v100_unconsolidated": {...same keys, the job spread over servers...},
     "p100": ..., "k80": ..., ...}

From it:

* pair slowdown ``xi = solo / co-located throughput`` for each of the two jobs, clamped to >= 1;
* spread slowdown ``consolidated / unconsolidated`` solo throughput at the same scale factor,
  clamped to >= 1 (a few spread placements measured slightly faster: noise);
* the solo throughput a trace loader needs to turn Gavel's ``total_steps`` into a duration.

Missing and zero entries. Gavel only measured pairs at scale factor 1 (every multi-GPU pair entry
is ``[0, 0]``); a multi-GPU pair therefore uses the 1-GPU pair's slowdown of the same two job types.
At scale factor 1, a ``[0, 0]`` entry means the pair was tried and failed (out of memory: it is
always a memory-heavy ResNet-50/Transformer/LM pair); it is reported as `FAILED_PAIR_SLOWDOWN`
(sharing is then never worth it) and `pair_failed` says so. A job type the table does not know
gives ``None`` so the `SpeedModel` falls back to resource profiles or its defaults.

Trace model names map to Gavel job types with `MODEL_TO_GAVEL` (docs/workloads.md justifies each
choice); Gavel job types map to themselves.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from qosflow.core.speed import SpeedModel
from qosflow.errors import TraceFormatError

#: GPU types of the table (each also has an ``<type>_unconsolidated`` variant)
GPU_TYPES = ("v100", "p100", "k80")
DEFAULT_GPU_TYPE = "v100"
#: slowdown reported for a pair Gavel measured as failing together (out of GPU memory): at xi >= 2
#: for both jobs, sharing is slower than running them one after the other, so no policy shares them
FAILED_PAIR_SLOWDOWN = 4.0

#: trace model name -> Gavel job type (the closest measured job; see docs/workloads.md)
MODEL_TO_GAVEL: dict[str, str] = {
    # Muri / Philly trace (Zhao et al., SIGCOMM'22), batch sizes as in that trace
    "resnet18": "ResNet-18 (batch size 128)",  # same network, same batch size
    "shufflenet_v2_x1_0": "ResNet-18 (batch size 32)",  # light CNN: about half resnet18-128's GPU time per step
    "shufflenet_v2": "ResNet-18 (batch size 32)",
    "shufflenet": "ResNet-18 (batch size 32)",
    "vgg16": "ResNet-50 (batch size 16)",  # compute-heavy ImageNet CNN, batch 16
    "vgg19": "ResNet-50 (batch size 16)",
    "dqn": "A3C",  # deep RL: CPU-bound environment steps, a small network on the GPU
    "a2c": "A3C",
    "bert": "Transformer (batch size 128)",  # transformer, ~2k tokens per step (4 x 510 vs 128 sentences)
    "gpt2": "LM (batch size 80)",  # language model, the most GPU-heavy LM variant (~2.8k tokens per step)
}

#: GPU memory (MiB) per job, as profiled by SJF-BSBF (Chen et al., arXiv 2407.13088) for Muri's models
MURI_GPU_MEM_MB: dict[str, float] = {
    "resnet18": 6432.0,
    "shufflenet_v2_x1_0": 5252.0,
    "shufflenet_v2": 5252.0,
    "vgg19": 4304.0,
    "vgg16": 4224.0,
    "dqn": 2230.0,
    "a2c": 2094.0,
    "bert": 8058.0,
    "gpt2": 10532.0,
}

#: GPU memory (MiB) per GPU of Gavel's job types. Gavel published no memory figures: these are
#: estimates (CUDA context ~0.7 GiB + weights and optimizer state + activations growing with the
#: batch), consistent with the pairs Gavel found failing on 16 GiB V100s (ResNet-50, Transformer and
#: LM at large batches). See docs/workloads.md.
GAVEL_GPU_MEM_MB: dict[str, float] = {
    "ResNet-18 (batch size 16)": 1300.0,  # CIFAR-10, 11M parameters, 32x32 images
    "ResNet-18 (batch size 32)": 1500.0,
    "ResNet-18 (batch size 64)": 1900.0,
    "ResNet-18 (batch size 128)": 2700.0,
    "ResNet-18 (batch size 256)": 4300.0,
    "ResNet-50 (batch size 16)": 3600.0,  # ImageNet, 25M parameters, 224x224 images
    "ResNet-50 (batch size 32)": 5600.0,
    "ResNet-50 (batch size 64)": 9500.0,
    "ResNet-50 (batch size 128)": 15000.0,
    "Transformer (batch size 16)": 2000.0,  # Multi30k translation
    "Transformer (batch size 32)": 2500.0,
    "Transformer (batch size 64)": 3400.0,
    "Transformer (batch size 128)": 5200.0,
    "Transformer (batch size 256)": 8800.0,
    "LM (batch size 5)": 1600.0,  # LSTM language model, WikiText-2
    "LM (batch size 10)": 1800.0,
    "LM (batch size 20)": 2200.0,
    "LM (batch size 40)": 3000.0,
    "LM (batch size 80)": 4600.0,
    "Recommendation (batch size 512)": 1400.0,  # autoencoder recommender, ML-20M
    "Recommendation (batch size 1024)": 1700.0,
    "Recommendation (batch size 2048)": 2300.0,
    "Recommendation (batch size 4096)": 3500.0,
    "Recommendation (batch size 8192)": 5900.0,
    "A3C": 1200.0,  # Atari Pong, small conv net
    "CycleGAN": 4600.0,  # two generators, two discriminators, 256x256 images
}

_BATCH_RE = re.compile(r"\(batch size (\d+)\)")


#: names a throughput table in Gavel's format to use instead of the shared one (`qosflow simulate
#: --throughputs` sets it for its run)
THROUGHPUTS_ENV = "QOSFLOW_THROUGHPUTS"


def default_throughputs_path() -> Path:
    """Gavel's throughput table: QOSFLOW_THROUGHPUTS if set, else the shared data's copy."""
    env = os.environ.get(THROUGHPUTS_ENV)
    if env:
        return Path(env).expanduser()
    from qosflow.paths import shared_data

    return shared_data() / "throughputs" / "gavel_simulation_throughputs.json"


def gavel_family(job_type: str) -> str:
    """'ResNet-18 (batch size 32)' -> 'ResNet-18'."""
    return job_type.split(" (", 1)[0]


def gavel_batch_size(job_type: str) -> int | None:
    m = _BATCH_RE.search(job_type)
    return int(m.group(1)) if m else None


def gpu_mem_mb(model: str) -> float | None:
    """GPU memory (MiB) one GPU of a job of this model needs, or None if unknown."""
    if model in GAVEL_GPU_MEM_MB:
        return GAVEL_GPU_MEM_MB[model]
    key = model.strip().lower()
    return MURI_GPU_MEM_MB.get(key)


def _parse_key(path: Path, gpu: str, key: str) -> tuple[str, int]:
    try:
        val = ast.literal_eval(key)
    except (ValueError, SyntaxError):
        val = None
    if not (isinstance(val, tuple) and len(val) == 2 and isinstance(val[0], str) and isinstance(val[1], int)):
        raise TraceFormatError(path, None, f"[{gpu!r}]: job key {key!r} is not \"('<job type>', <scale factor>)\"")
    if val[1] < 1:
        raise TraceFormatError(path, None, f"[{gpu!r}][{key!r}]: scale factor must be >= 1")
    return val[0], val[1]


def _at_scale(table: dict[tuple[str, int], float], jt: str, gpus: int) -> float | None:
    """Steps/s of job type `jt` at `gpus` GPUs in a (job type, scale) table: measured, else extrapolated
    linearly from the largest scale measured below it."""
    hit = table.get((jt, gpus))
    if hit:
        return hit
    ss = [s for (t, s) in table if t == jt and s <= max(1, gpus)]
    if not ss:
        return None
    s = max(ss)
    return table[(jt, s)] * max(1, gpus) / s


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return 0.0
    return v if math.isfinite(v) and v > 0 else 0.0


class GavelInterference:
    """Pair and spread slowdowns and solo throughputs from Gavel's measured table.

    `gpu_type` picks the GPU the numbers come from (``v100`` by default). Model names are resolved
    with `resolve` (trace names through `MODEL_TO_GAVEL`, Gavel job types as themselves).
    """

    def __init__(self, path: str | Path | None = None, *, gpu_type: str = DEFAULT_GPU_TYPE):
        self.path = Path(path) if path is not None else default_throughputs_path()
        gpu_type = gpu_type.lower()
        if not self.path.is_file():
            raise TraceFormatError(self.path, None, "Gavel throughput table not found (expected the JSON from Gavel's simulator)")
        try:
            with open(self.path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(self.path, exc.lineno, f"not valid JSON: {exc.msg}; expected Gavel's JSON throughput "
                                   "table (GPU type -> job -> throughputs, e.g. simulation_throughputs.json from "
                                   "Gavel's repository)") from None
        except UnicodeDecodeError:
            raise TraceFormatError(self.path, None, "not a text file; expected Gavel's JSON throughput table "
                                   "(GPU type -> job -> throughputs)") from None
        if not isinstance(raw, dict) or not raw:
            raise TraceFormatError(self.path, None, "expected a non-empty object keyed by GPU type (k80, p100, v100, ...), "
                                   "each holding job -> throughputs, as in Gavel's simulation_throughputs.json")
        if gpu_type not in raw:
            known = ", ".join(k for k in raw if not k.endswith("_unconsolidated")) or "none (only *_unconsolidated keys)"
            raise TraceFormatError(self.path, None, f"no GPU type {gpu_type!r} in the table; it has: {known}")
        self.gpu_type = gpu_type
        #: (job type, scale) -> solo steps/s, consolidated and spread
        self.solo: dict[tuple[str, int], float] = {}
        self.solo_spread: dict[tuple[str, int], float] = {}
        #: (type a, type b, scale) -> (tput a, tput b) when together; (0, 0) = failed
        self.pairs: dict[tuple[str, str, int], tuple[float, float]] = {}
        #: scales at which at least one pair was actually measured (non-zero)
        self.pair_scales: set[int] = set()
        self._load(raw.get(gpu_type), raw.get(f"{gpu_type}_unconsolidated"))
        #: other GPU types' solo, consolidated steps/s: GPU type -> (job type, scale) -> steps/s (`gpu_speed`)
        self.type_solo: dict[str, dict[tuple[str, int], float]] = {gpu_type: self.solo}
        for gt, table in raw.items():
            if gt == gpu_type or gt.endswith("_unconsolidated"):
                continue
            # (checked as the table's own type is)
            self.type_solo[gt.lower()] = {(jt, sf): v for jt, sf, _key, _entry, v in self._solo_entries(gt, table) if v > 0}
        self.job_types: tuple[str, ...] = tuple(sorted({t for t, _ in self.solo}))
        self._scales: dict[str, tuple[int, ...]] = {}
        for t, s in self.solo:
            self._scales.setdefault(t, ())
            self._scales[t] = tuple(sorted(set(self._scales[t]) | {s}))
        self._lower = {t.lower(): t for t in self.job_types}

    # ------------------------------------------------------------------ loading
    def _solo_entries(self, gpu: str, table: Any):
        """(job type, scale, key, entry, solo steps/s) for each job key of GPU type `gpu`'s section; a
        section that is not an object, or an entry without its "null" solo throughput, is an error."""
        if not isinstance(table, dict):
            raise TraceFormatError(self.path, None, f"[{gpu!r}] is not an object of job keys")
        for key, entry in table.items():
            jt, sf = _parse_key(self.path, gpu, key)
            if not isinstance(entry, dict) or "null" not in entry:
                raise TraceFormatError(self.path, None, f"[{gpu!r}][{key!r}]: needs a \"null\" (solo throughput) entry")
            yield jt, sf, key, entry, _num(entry["null"])

    def _load(self, table: Any, spread: Any) -> None:
        gpu = self.gpu_type
        for jt, sf, key, entry, solo in self._solo_entries(gpu, table):
            if solo > 0:
                self.solo[(jt, sf)] = solo
            for other, val in entry.items():
                if other == "null":
                    continue
                ot, osf = _parse_key(self.path, gpu, other)
                if not (isinstance(val, (list, tuple)) and len(val) == 2):
                    raise TraceFormatError(
                        self.path, None, f"[{gpu!r}][{key!r}][{other!r}]: expected [this throughput, other throughput]"
                    )
                a, b = _num(val[0]), _num(val[1])
                if osf != sf:
                    continue  # Gavel only pairs jobs of the same scale factor
                self.pairs[(jt, ot, sf)] = (a, b)
                if a > 0 and b > 0:
                    self.pair_scales.add(sf)
        if isinstance(spread, dict):
            for key, entry in spread.items():
                jt, sf = _parse_key(self.path, f"{gpu}_unconsolidated", key)
                if isinstance(entry, dict):
                    v = _num(entry.get("null"))
                    if v > 0:
                        self.solo_spread[(jt, sf)] = v

    # ------------------------------------------------------------------ names
    def resolve(self, model: str) -> str | None:
        """The Gavel job type a trace model name stands for, or None if unknown."""
        if model in self._scales:
            return model
        key = model.strip()
        hit = self._lower.get(key.lower()) or self._lower.get(" ".join(key.split()).lower())
        if hit:
            return hit
        mapped = MODEL_TO_GAVEL.get(key.lower())
        if mapped and mapped in self._scales:
            return mapped
        return None

    def scales(self, job_type: str) -> tuple[int, ...]:
        """Scale factors with a measured solo throughput for this job type."""
        return self._scales.get(job_type, ())

    def _scale_at_most(self, job_type: str, gpus: int) -> int | None:
        ss = [s for s in self.scales(job_type) if s <= max(1, gpus)]
        return max(ss) if ss else None

    # ------------------------------------------------------------------ throughput
    def throughput(self, model: str, scale_factor: int = 1, *, consolidated: bool = True) -> float | None:
        """Solo steps/s of `model` at `scale_factor` GPUs, or None if the type is unknown.

        A scale factor Gavel did not measure (e.g. 16, or 4 for A3C) is extrapolated from the largest
        measured one below it, linearly in the number of GPUs (see `throughput_source`).
        """
        jt = self.resolve(model)
        if jt is None:
            return None
        if consolidated:
            return _at_scale(self.solo, jt, scale_factor)
        table = self.solo_spread
        if (jt, scale_factor) in table:
            return table[(jt, scale_factor)]
        # (spread: at the largest scale measured consolidated below it, if measured spread there too)
        s = self._scale_at_most(jt, scale_factor)
        if s is None:
            return None
        base = table.get((jt, s))
        if base is None:
            return None
        return base * scale_factor / s

    def gpu_speed(self, model: str, gpus: int, gpu_model: str) -> float | None:
        """`model`'s solo, consolidated speed on GPUs of `gpu_model` relative to the table's own type
        (`gpu_type`, what a trace's durations are computed on): Gavel's throughput on that type over its
        throughput on this one, at the job's scale factor (extrapolated as in `throughput`). Gavel's
        K80s run ResNet-50 at 0.14 x a V100 but its recommender at 1.4 x: jobs differ in what a faster
        GPU is worth to them. None when the table does not know the job type or the GPU model (NVML or
        Kubernetes names are shortened first: ``Tesla K80`` is ``k80``)."""
        from qosflow.core.gpu_names import short_gpu_model  # noqa: PLC0415

        gm = short_gpu_model(gpu_model)
        if gm == self.gpu_type:
            return 1.0
        table = self.type_solo.get(gm)
        jt = self.resolve(model)
        if table is None or jt is None:
            return None
        here, base = _at_scale(table, jt, gpus), _at_scale(self.solo, jt, gpus)
        return here / base if here and base else None

    def gpu_types(self) -> tuple[str, ...]:
        """The GPU types the table measured (besides its `_unconsolidated` variants)."""
        return tuple(sorted(self.type_solo))

    def throughput_source(self, model: str, scale_factor: int = 1) -> str:
        jt = self.resolve(model)
        if jt is None:
            return "unknown"
        if (jt, scale_factor) in self.solo:
            return "measured"
        s = self._scale_at_most(jt, scale_factor)
        return f"extrapolated from {s} GPU(s)" if s else "unknown"

    # ------------------------------------------------------------------ InterferenceSource
    def _pair_entry(self, a: str, b: str, gpus: int) -> tuple[int, tuple[float, float]] | None:
        """(scale, (tput a, tput b) together): at the job's own scale if Gavel measured pairs there,
        else the 1-GPU measurement of the same two types."""
        for s in dict.fromkeys((gpus, 1)):
            if s not in self.pair_scales:
                continue
            e = self.pairs.get((a, b, s))
            if e is None:
                r = self.pairs.get((b, a, s))
                e = (r[1], r[0]) if r is not None else None
            if e is not None:
                return s, e
        return None

    def pair_failed(self, model_a: str, model_b: str, gpus: int = 1) -> bool:
        """True if Gavel measured these two types failing together (out of memory)."""
        a, b = self.resolve(model_a), self.resolve(model_b)
        if a is None or b is None:
            return False
        hit = self._pair_entry(a, b, gpus)
        return hit is not None and (hit[1][0] <= 0 or hit[1][1] <= 0)

    def pair_slowdown(self, model_a: str, model_b: str, gpus: int = 1) -> tuple[float, float] | None:
        a, b = self.resolve(model_a), self.resolve(model_b)
        if a is None or b is None:
            return None
        hit = self._pair_entry(a, b, gpus)
        if hit is None:
            return None
        s, (ta, tb) = hit
        if ta <= 0 or tb <= 0:
            return FAILED_PAIR_SLOWDOWN, FAILED_PAIR_SLOWDOWN
        sa, sb = self.solo.get((a, s)), self.solo.get((b, s))
        if not sa or not sb:
            return None
        return max(1.0, sa / ta), max(1.0, sb / tb)

    def spread_slowdown(self, model: str, gpus: int) -> float | None:
        if gpus <= 1:
            return 1.0
        jt = self.resolve(model)
        if jt is None:
            return None
        if (jt, gpus) in self.solo and (jt, gpus) in self.solo_spread:
            s = gpus
        else:
            cands = [x for x in self.scales(jt) if 1 < x <= gpus and (jt, x) in self.solo_spread]
            if not cands:
                return None
            s = max(cands)
        c, u = self.solo[(jt, s)], self.solo_spread[(jt, s)]
        return max(1.0, c / u)

    def __repr__(self) -> str:
        return f"GavelInterference({str(self.path)!r}, gpu_type={self.gpu_type!r}, {len(self.job_types)} job types)"

    def describe(self) -> str:
        return f"Gavel's measured table ({self.gpu_type}, {len(self.job_types)} job types; {self.path})"


_CACHE: dict[tuple[str, str, float], GavelInterference] = {}


def load_gavel_interference(path: str | Path | None = None, *, gpu_type: str = DEFAULT_GPU_TYPE) -> GavelInterference | None:
    """The table (cached per file and GPU type), or None if the file does not exist."""
    p = Path(path) if path is not None else default_throughputs_path()
    if not p.is_file():
        return None
    key = (str(p.resolve()), gpu_type.lower(), os.path.getmtime(p))
    hit = _CACHE.get(key)
    if hit is None:
        hit = GavelInterference(p, gpu_type=gpu_type)
        _CACHE[key] = hit
    return hit


def default_speed_model(path: str | Path | None = None, *, gpu_type: str = DEFAULT_GPU_TYPE, **kwargs: Any) -> SpeedModel:
    """`SpeedModel(GavelInterference(...))` when the table exists, else a plain `SpeedModel()`
    (which falls back to the jobs' resource profiles, then to its default slowdowns)."""
    table = load_gavel_interference(path, gpu_type=gpu_type)
    return SpeedModel(table, **kwargs)

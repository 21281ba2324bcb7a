"""The QoS spec a stage or trace job declares.

A spec says what a job needs (GPUs or a fraction of one, GPU memory, CPU cores), how it may run
(may it share a GPU with another job, must all its GPUs start together) and what it was promised
(a deadline or a latency SLO, an optional minimum throughput, a priority class).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import Enum
from typing import Any

from qosflow.errors import SpecError


class PriorityClass(str, Enum):
    """Priority classes, highest first. `guaranteed` jobs carry a deadline or SLO that qosflow keeps;
    `best-effort` jobs take what is left (but are never starved)."""

    CRITICAL = "critical"
    GUARANTEED = "guaranteed"
    NORMAL = "normal"
    BEST_EFFORT = "best-effort"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @classmethod
    def parse(cls, value: "PriorityClass | str | int", *, where: str | None = None) -> "PriorityClass":
        if isinstance(value, PriorityClass):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            # numeric priorities as in traces: larger is more important
            if value >= 2:
                return cls.CRITICAL
            return cls.GUARANTEED if value == 1 else cls.NORMAL if value == 0 else cls.BEST_EFFORT
        if isinstance(value, str):
            try:  # a job variable or CLI value is a string: "2" means what the integer 2 means
                return cls.parse(int(value.strip()), where=where)
            except ValueError:
                pass
            key = value.strip().lower().replace("_", "-")
            for member in cls:
                if member.value == key:
                    return member
        raise SpecError(
            "priority",
            f"{value!r} is not a priority class; use one of {', '.join(m.value for m in cls)} or an integer "
            "(as in traces, larger is more important: 2 or more critical, 1 guaranteed, 0 normal, below 0 best-effort)",
            where=where,
        )


_RANK = {
    PriorityClass.CRITICAL: 3,
    PriorityClass.GUARANTEED: 2,
    PriorityClass.NORMAL: 1,
    PriorityClass.BEST_EFFORT: 0,
}

#: Hard upper bound on GPUs one job may ask for; a cluster check gives the real limit.
MAX_GPUS = 4096


@dataclass(frozen=True, slots=True)
class QoSSpec:
    """What one job (a pipeline stage or a trace job) needs and was promised.

    Times are seconds. `deadline` is relative to the job's submission (a budget); `latency_slo` is the
    per-step (per-request) latency the job must see wherever it is placed.

    GPU demand: `gpus` whole GPUs, or, with `gpus=1` and `gpu_milli < 1000`, a fraction of one GPU
    (an MPS or time-slice share, as Alibaba's pods ask with `gpu_milli`). `gpus=0` is a CPU-only stage.
    `shareable=True` lets a whole-GPU training job be co-located with one other such job on the same
    GPUs (at most two, memory permitting), at a slowdown the scheduler predicts.

    `gpu_model` restricts the job to nodes of that GPU model; several accepted models are separated
    by `|` (`"A100|H100"`, as Alibaba's `gpu_spec` lists them). None accepts any model.

    `min_gpus` (elastic start, None: rigid) lets a multi-GPU job start on fewer GPUs than `gpus` when
    the full width is not free: on `w` GPUs, `w` a divisor of `gpus` and at least `min_gpus`, with
    `gpus / w` steps of gradient accumulation per optimizer step, so the global batch -- and with it
    the convergence -- stays as declared, at about `w / gpus` of the speed. The width is fixed at the
    start; the stage reads it from `QOSFLOW_GPUS` and `QOSFLOW_GRAD_ACCUMULATION`
    (`qosflow.accumulation_steps()`). A `min_gpus` below `gpus` must leave such a width below `gpus`
    (`gpus=4, min_gpus=3` would allow 4 only: a SpecError). A policy that starts jobs narrower
    (`Policy.elastic_starts`) admits one whose full width never fits the cluster if a narrower
    width does (`ClusterSpec.why_never_fits`).
    """

    gpus: int = 1
    gpu_milli: int = 1000
    gpu_mem_mb: float | None = None
    cpu_cores: float = 1.0
    mem_mb: float = 0.0
    deadline: float | None = None
    latency_slo: float | None = None
    min_throughput: float | None = None
    priority: PriorityClass = PriorityClass.NORMAL
    shareable: bool = False
    gang: bool = True
    gpu_model: str | None = None
    min_gpus: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    #: who submitted the job (fairness between users, `QosflowPolicy(fair_share=...)`); not part of the
    #: request: specs that differ only in it compare equal (placement searches keyed by the request
    #: are shared). A pipeline stage's comes from `@qos_task(user=...)` or its run's `user:NAME` tag
    user: str | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", PriorityClass.parse(self.priority))
        if isinstance(self.gpu_model, str) and ("|" in self.gpu_model or self.gpu_model != self.gpu_model.strip()):
            # one spelling per set of accepted models, so equal requests compare (and group) equal
            object.__setattr__(self, "gpu_model", "|".join(m.strip() for m in self.gpu_model.split("|")))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self, *, where: str | None = None) -> "QoSSpec":
        def bad(fieldname: str, msg: str) -> SpecError:
            return SpecError(fieldname, msg, where=where)

        for name, unit in NUMBER_FIELDS.items():
            value = getattr(self, name)
            if value is not None and (isinstance(value, (bool, str)) or not _finite(value) and not isinstance(value, float)):
                raise bad(name, f"must be a number ({unit}), got {value!r}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int):
            raise bad("gpus", f"must be a whole number of GPUs, got {self.gpus!r} (use gpu_milli for a fraction)")
        if self.gpus < 0:
            raise bad("gpus", f"must be >= 0, got {self.gpus}")
        if self.gpus > MAX_GPUS:
            raise bad("gpus", f"{self.gpus} GPUs is more than any cluster qosflow supports ({MAX_GPUS})")
        if not isinstance(self.gpu_milli, int) or isinstance(self.gpu_milli, bool):
            raise bad("gpu_milli", f"must be an integer in 1..1000 (thousandths of a GPU), got {self.gpu_milli!r}")
        if not 1 <= self.gpu_milli <= 1000:
            raise bad("gpu_milli", f"must be in 1..1000 (thousandths of one GPU), got {self.gpu_milli}")
        if self.gpu_milli < 1000 and self.gpus != 1:
            raise bad("gpu_milli", f"a fractional GPU share ({self.gpu_milli}/1000) needs gpus=1, got gpus={self.gpus}")
        if self.gpu_mem_mb is not None:
            if not _finite(self.gpu_mem_mb) or self.gpu_mem_mb <= 0:
                raise bad("gpu_mem_mb", f"must be a positive number of MiB per GPU, got {self.gpu_mem_mb!r}")
            if self.gpus == 0:
                raise bad("gpu_mem_mb", "a CPU-only stage (gpus=0) cannot ask for GPU memory")
        if not _finite(self.cpu_cores) or self.cpu_cores < 0:
            raise bad("cpu_cores", f"must be a number of cores >= 0, got {self.cpu_cores!r}")
        if self.gpus == 0 and self.cpu_cores <= 0:
            raise bad("cpu_cores", "a CPU-only stage (gpus=0) needs cpu_cores > 0")
        if not _finite(self.mem_mb) or self.mem_mb < 0:
            raise bad("mem_mb", f"must be >= 0 MiB, got {self.mem_mb!r}")
        if self.deadline is not None and (not _finite(self.deadline) or self.deadline <= 0):
            raise bad("deadline", f"must be a positive number of seconds after submission, got {self.deadline!r}")
        if self.latency_slo is not None and (not _finite(self.latency_slo) or self.latency_slo <= 0):
            raise bad("latency_slo", f"must be a positive number of seconds, got {self.latency_slo!r}")
        if self.min_throughput is not None and (not _finite(self.min_throughput) or self.min_throughput <= 0):
            raise bad("min_throughput", f"must be a positive rate (steps/s), got {self.min_throughput!r}")
        if self.shareable and self.gpus == 0:
            raise bad("shareable", "a CPU-only stage (gpus=0) has no GPU to share")
        if self.min_gpus is not None:
            if isinstance(self.min_gpus, bool) or not isinstance(self.min_gpus, int):
                raise bad("min_gpus", f"must be a whole number of GPUs, got {self.min_gpus!r}")
            if self.gpus < 1 or self.fractional:
                raise bad("min_gpus", f"only a job of whole GPUs can start on fewer of them (gpus={self.gpus}, gpu_milli={self.gpu_milli})")
            if not 1 <= self.min_gpus <= self.gpus:
                raise bad("min_gpus", f"must be in 1..gpus ({self.gpus}), got {self.min_gpus}")
            if self.min_gpus < self.gpus and len(self.widths) == 1:
                # (a job starts only on a divisor of its GPUs: below gpus, none is as large as min_gpus)
                divisors = [w for w in range(self.gpus, 0, -1) if self.gpus % w == 0]
                smaller = " or ".join(map(str, divisors[1:]))
                raise bad("min_gpus", f"{self.min_gpus} allows no width below gpus={self.gpus}, so it would have no effect: a job "
                          f"starts only on a divisor of its GPUs ({', '.join(map(str, divisors))}: gradient accumulation needs a "
                          f"whole number of steps); use min_gpus={smaller} to let it start narrower, or leave min_gpus unset")
        if self.user is not None and (not isinstance(self.user, str) or not self.user.strip() or self.user != self.user.strip()):
            raise bad("user", f"must be a user's name (a non-empty string without leading or trailing spaces), got {self.user!r}")
        if self.gpu_model is not None:
            if not isinstance(self.gpu_model, str):
                raise bad("gpu_model", f"must be a GPU model name (or several separated by '|'), got {self.gpu_model!r}")
            if any(not m for m in self.gpu_model.split("|")):
                raise bad("gpu_model", f"{self.gpu_model!r} has an empty model name; leave gpu_model unset to accept any model")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def gpu_models(self) -> tuple[str, ...] | None:
        """The accepted GPU models, or None for any."""
        return None if self.gpu_model is None else tuple(self.gpu_model.split("|"))

    def accepts_gpu_model(self, model: str) -> bool:
        return self.gpu_model is None or model.lower() in {m.lower() for m in self.gpu_model.split("|")}

    @property
    def widths(self) -> tuple[int, ...]:
        """The GPU counts the job may start on, widest first: `gpus`, and with `min_gpus` every smaller
        divisor of `gpus` down to it (gradient accumulation needs a whole number of steps)."""
        if self.min_gpus is None or self.min_gpus >= self.gpus:
            return (self.gpus,)
        return tuple(w for w in range(self.gpus, self.min_gpus - 1, -1) if self.gpus % w == 0)

    def narrowed(self, width: int) -> "QoSSpec":
        """This request on `width` of its GPUs (one of `widths`): CPU cores and host memory in
        proportion, GPU memory per GPU as declared (each GPU runs the same per-GPU batch)."""
        if width == self.gpus:
            return self
        if width not in self.widths:
            raise SpecError("min_gpus", f"{width} GPUs is not a width this job may start on ({', '.join(map(str, self.widths))})")
        f = width / self.gpus
        return replace(self, gpus=width, cpu_cores=self.cpu_cores * f, mem_mb=self.mem_mb * f, min_gpus=None)

    @property
    def fractional(self) -> bool:
        return self.gpus == 1 and self.gpu_milli < 1000

    @property
    def gpu_demand(self) -> float:
        """GPUs asked for, counting a fractional share as its fraction."""
        return self.gpu_milli / 1000.0 if self.fractional else float(self.gpus)

    @property
    def has_qos_target(self) -> bool:
        return self.deadline is not None or self.latency_slo is not None or self.min_throughput is not None

    def with_(self, **changes: Any) -> "QoSSpec":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "gpus": self.gpus,
            "gpu_milli": self.gpu_milli,
            "gpu_mem_mb": self.gpu_mem_mb,
            "cpu_cores": self.cpu_cores,
            "mem_mb": self.mem_mb,
            "deadline": self.deadline,
            "latency_slo": self.latency_slo,
            "min_throughput": self.min_throughput,
            "priority": self.priority.value,
            "shareable": self.shareable,
            "gang": self.gang,
            "gpu_model": self.gpu_model,
        }
        if self.min_gpus is not None:
            d["min_gpus"] = self.min_gpus
        if self.user is not None:
            d["user"] = self.user
        if self.extra:
            d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str | None = None) -> "QoSSpec":
        known = {f for f in cls.__dataclass_fields__}  # type: ignore[attr-defined]
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(unknown[0], f"unknown QoS field; known fields: {', '.join(sorted(known))}", where=where)
        try:
            return cls(**data)
        except SpecError as exc:
            if where and not exc.where:
                raise SpecError(exc.field, str(exc).split(": ", 1)[-1], where=where) from None
            raise
        except TypeError as exc:  # wrong types that dataclass init itself rejects
            raise SpecError("qos", str(exc), where=where) from None


#: numeric QoS fields and their units (a string or a bool there is a user error, named as such)
NUMBER_FIELDS = {
    "gpu_mem_mb": "MiB per GPU",
    "cpu_cores": "CPU cores",
    "mem_mb": "MiB",
    "deadline": "seconds after submission",
    "latency_slo": "seconds",
    "min_throughput": "steps/s",
}


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


#: a duration's units (by their first letter) -> seconds; y is 365 days
_UNIT_S = {"y": 365 * 86400.0, "w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(days?|d|hours?|hrs?|h|minutes?|mins?|m|seconds?|secs?|s|w|y)(?![a-z])",
                   re.IGNORECASE)

#: how to write a duration (for error messages)
DURATION_FORMS = "seconds, a datetime.timedelta or a string such as '90s', '15min', '2h' or '1h30m'"


def parse_duration(text: str) -> float | None:
    """Seconds of a duration string, None if it is not one: parts of a number and a unit, in any case, apart or
    not, separated by spaces or commas: s, sec(s), second(s); m, min(s), minute(s); h, hr(s), hour(s); d, day(s);
    w (7 days); y (365 days). '90s', '15 min', '1h30m', '1.5d', '3 mins, 4 secs', '12w'. The one parser of
    `to_seconds` (a @qos_task's deadline, expected_duration) and `qosflow.store.store.parse_age` (--older-than)."""
    text = text.strip()
    pos, total, parts = 0, 0.0, 0
    for m in _PART.finditer(text):
        if text[pos:m.start()].strip(" ,"):
            return None
        total += float(m.group(1)) * _UNIT_S[m.group(2)[0].casefold()]
        pos, parts = m.end(), parts + 1
    if parts == 0 or text[pos:].strip():
        return None
    return total


def to_seconds(value: Any) -> Any:
    """Seconds from a `datetime.timedelta` or a duration string ('90s', '15 min', '2h', '1h30m',
    '1.5d': `parse_duration`); any other value is returned as it is, for the caller's own check to accept or name."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if not isinstance(value, str):
        return value
    seconds = parse_duration(value)
    return value if seconds is None else seconds

"""QoS arguments of `@qos_task`: validation at decoration time, and their encoding as Prefect tags and
work-pool job variables (both survive `Task.with_options()` and travel with every flow run)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

from qosflow.core.qos import DURATION_FORMS, NUMBER_FIELDS, PriorityClass, QoSSpec, to_seconds
from qosflow.errors import SpecError

#: QoSSpec fields a stage may set
QOS_FIELDS = (
    "gpus",
    "min_gpus",
    "gpu_milli",
    "gpu_mem_mb",
    "cpu_cores",
    "mem_mb",
    "deadline",
    "latency_slo",
    "min_throughput",
    "priority",
    "shareable",
    "gang",
    "gpu_model",
)
#: stage-level fields beyond the QoSSpec
STAGE_FIELDS = ("expected_duration", "batch_size", "early_check")
#: QoSSpec fields a stage may set that are not work-pool job variables: who submitted it (fairness between
#: users), carried by the stage run's tags (`qos:user=NAME`) instead
WHO_FIELDS = ("user",)

TAG_PREFIX = "qos:"
#: a flow run's (or deployment's) tag naming the user it runs for: `user:alice`
USER_TAG = "user:"


def build_spec(where: str, **kw: Any) -> QoSSpec:
    """A QoSSpec from decorator arguments; every error names the argument and the stage."""
    for k in ("gpus", "gpu_milli", "min_gpus"):
        v = kw.get(k)
        if isinstance(v, float) and v.is_integer():
            kw[k] = int(v)
    if isinstance(kw.get("gpus"), float):
        g = kw["gpus"]
        if 0 < g < 1:
            raise SpecError("gpus", f"{g!r} is a fraction of a GPU; write gpus=1, gpu_milli={round(g * 1000)}", where=where)
    for k in ("shareable", "gang"):
        if k in kw and not isinstance(kw[k], bool):
            raise SpecError(k, f"must be True or False, got {kw[k]!r}", where=where)
    for k in DURATION_KW:
        if k in kw:
            kw[k] = to_seconds(kw[k])
    for k, unit in NUMBER_FIELDS.items():  # here with a hint how to write it
        v = kw.get(k)
        if v is not None and not _is_number(v):
            raise SpecError(k, f"must be {_number_of(k, unit)}, got {v!r}{number_hint(k, v)}", where=where)
    if "priority" in kw:
        kw["priority"] = PriorityClass.parse(kw["priority"], where=where)
    if kw.get("user") is not None and not isinstance(kw["user"], str):
        raise SpecError("user", f"must be a user's name (a string), got {kw['user']!r}", where=where)
    if kw.get("gpu_model") is not None and not isinstance(kw["gpu_model"], str):
        raise SpecError("gpu_model", f"must be a GPU model name (string), got {kw['gpu_model']!r}", where=where)
    try:
        spec = QoSSpec(**kw)
    except SpecError as exc:
        if exc.where:
            raise
        raise SpecError(exc.field, str(exc).split(": ", 1)[-1], where=where) from None
    except TypeError as exc:
        raise SpecError("qos", str(exc), where=where) from None
    return spec


#: arguments that take a duration: a number of seconds, a timedelta or a string such as '2h'
DURATION_KW = ("deadline", "latency_slo", "expected_duration", "early_check")


def _number_of(k: str, unit: str) -> str:
    return f"a number of {unit} or a duration ({DURATION_FORMS})" if k in DURATION_KW else f"a number ({unit})"


def number_hint(k: str, v: Any, *, duration: bool | None = None) -> str:
    """How to write a number given as a string ('45'): as a number, or for a duration with its unit."""
    if isinstance(v, str) and _finite(v):
        duration = k in DURATION_KW if duration is None else duration
        return f"; write {k}={v.strip()}" + (f" (seconds) or {k}='{v.strip()}s'" if duration else "")
    return ""


def stage_durations(stage_kw: dict[str, Any]) -> dict[str, Any]:
    """`stage_kw` with its duration arguments (expected_duration, early_check) in seconds where they were
    given as a timedelta or a duration string; other values are left for `check_stage_args` to judge."""
    return {k: to_seconds(v) if k in DURATION_KW else v for k, v in stage_kw.items()}


def check_stage_args(
    where: str,
    spec: QoSSpec,
    *,
    expected_duration: Any = None,
    batch_size: Any = None,
    early_check: Any = None,
    retries: Any = None,
    retry_delay_seconds: Any = None,
    timeout_seconds: Any = None,
    tags: Any = None,
    name: Any = None,
) -> None:
    """Prefect-level checks on top of QoSSpec's own validation."""

    def bad(f: str, msg: str) -> SpecError:
        return SpecError(f, msg, where=where)

    if expected_duration is not None:
        if not _is_number(expected_duration) or not _finite(expected_duration) or float(expected_duration) <= 0:
            raise bad("expected_duration", f"must be a positive number of seconds or a duration ({DURATION_FORMS}), got {expected_duration!r}{number_hint('expected_duration', expected_duration)}")
        if spec.deadline is not None and float(expected_duration) > spec.deadline:
            raise bad(
                "deadline",
                f"{spec.deadline:g}s is shorter than the stage's own expected_duration ({float(expected_duration):g}s); "
                "it could never be met",
            )
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0):
        raise bad("batch_size", f"must be a positive integer (the global batch), got {batch_size!r}")
    if early_check is not None and (not _is_number(early_check) or not _finite(early_check) or float(early_check) < 0):
        raise bad("early_check", f"must be seconds >= 0 (0: never check) or a duration ({DURATION_FORMS}), got {early_check!r}{number_hint('early_check', early_check)}")
    if early_check and spec.gpus < 1:
        raise bad("early_check", "runs a stage briefly on one GPU first; this stage uses no GPU (gpus=0), so there is nothing to check")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise bad("retries", f"must be a whole number >= 0, got {retries!r}")
    if retry_delay_seconds is not None and not callable(retry_delay_seconds):
        vals = retry_delay_seconds if isinstance(retry_delay_seconds, (list, tuple)) else [retry_delay_seconds]
        for v in vals:
            if not _is_number(v) or not _finite(v) or float(v) < 0:  # Prefect takes numbers only
                raise bad("retry_delay_seconds", f"must be seconds >= 0 (or a list of them), got {retry_delay_seconds!r}")
    if timeout_seconds is not None:
        if isinstance(timeout_seconds, bool) or not _finite(timeout_seconds) or float(timeout_seconds) <= 0:
            raise bad("timeout_seconds", f"must be a positive number of seconds, got {timeout_seconds!r}")
        if expected_duration and float(timeout_seconds) < float(expected_duration):
            # Prefect would kill every run before the time the stage itself says it needs
            raise bad(
                "timeout_seconds",
                f"{float(timeout_seconds):g}s is shorter than the stage's expected_duration ({float(expected_duration):g}s), "
                "so Prefect would stop every run before it can finish; raise timeout_seconds or lower expected_duration",
            )
    if tags is not None:
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise bad("tags", f"must be a list of strings, got {tags!r}")
        for t in tags:
            if t.startswith(TAG_PREFIX):
                raise bad("tags", f"tag {t!r} uses the reserved prefix {TAG_PREFIX!r}; pass QoS as arguments instead")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise bad("name", f"must be a non-empty string, got {name!r}")


def qos_tags(spec: QoSSpec, *, expected_duration: float | None = None) -> list[str]:
    """Tags that carry a stage's QoS (shown in the UI, kept by `with_options`)."""
    tags = [f"{TAG_PREFIX}class={spec.priority.value}", f"{TAG_PREFIX}gpus={spec.gpus}"]
    if spec.min_gpus is not None:
        tags.append(f"{TAG_PREFIX}min_gpus={spec.min_gpus}")
    if spec.fractional:
        tags.append(f"{TAG_PREFIX}gpu_milli={spec.gpu_milli}")
    if spec.cpu_cores:
        tags.append(f"{TAG_PREFIX}cpu_cores={spec.cpu_cores:g}")
    if spec.gpu_mem_mb is not None:
        tags.append(f"{TAG_PREFIX}gpu_mem_mb={spec.gpu_mem_mb:g}")
    if spec.mem_mb:
        tags.append(f"{TAG_PREFIX}mem_mb={spec.mem_mb:g}")
    if spec.deadline is not None:
        tags.append(f"{TAG_PREFIX}deadline={spec.deadline:g}")
    if spec.latency_slo is not None:
        tags.append(f"{TAG_PREFIX}latency_slo={spec.latency_slo:g}")
    if spec.min_throughput is not None:
        tags.append(f"{TAG_PREFIX}min_throughput={spec.min_throughput:g}")
    if spec.shareable:
        tags.append(f"{TAG_PREFIX}shareable=true")
    if not spec.gang:
        tags.append(f"{TAG_PREFIX}gang=false")
    if spec.gpu_model:
        tags.append(f"{TAG_PREFIX}gpu_model={spec.gpu_model}")
    if expected_duration is not None:
        tags.append(f"{TAG_PREFIX}expected_duration={float(expected_duration):g}")
    if spec.user is not None:
        tags.append(f"{TAG_PREFIX}user={spec.user}")
    return tags


def user_from_tags(tags: Iterable[str] | None) -> str | None:
    """The user a run is for, from its tags: the stage's own `qos:user=NAME` (written by qosflow at its
    dispatch), else its `user:NAME` tag (a pipeline run's, or its deployment's, which Prefect's server
    adds to the runs it creates, as a set: with several, the first in alphabetical order, so that the
    answer does not hang on the order the server returns them in); None when there is neither."""
    found = None
    for t in tags or ():
        if not isinstance(t, str):
            continue
        if t.startswith(f"{TAG_PREFIX}user="):
            name = t[len(TAG_PREFIX) + 5:].strip()
            if name:
                return name
        elif t.startswith(USER_TAG):
            name = t[len(USER_TAG):].strip()
            if name and (found is None or name < found):
                found = name
    return found


def qos_from_tags(tags: Iterable[str]) -> tuple[QoSSpec | None, dict[str, Any]]:
    """Inverse of `qos_tags`: (spec or None if no QoS tags, stage extras)."""
    kw: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for t in tags:
        if not t.startswith(TAG_PREFIX) or "=" not in t:
            continue
        k, v = t[len(TAG_PREFIX):].split("=", 1)
        if k == "class":
            kw["priority"] = v
        elif k in ("gpus", "gpu_milli", "min_gpus"):
            kw[k] = int(v)
        elif k in ("shareable", "gang"):
            kw[k] = v == "true"
        elif k in ("gpu_model", "user"):
            kw[k] = v
        elif k in QOS_FIELDS:
            kw[k] = float(v)
        elif k in STAGE_FIELDS:
            extra[k] = float(v)
    if not kw:
        return None, extra
    return QoSSpec(**kw), extra


def job_variables(spec: QoSSpec, **stage: Any) -> dict[str, Any]:
    """The per-run job variables of the `qosflow` work pool for one stage."""
    out: dict[str, Any] = {"role": "stage"}
    for k in QOS_FIELDS:
        v = getattr(spec, k)
        if k == "priority":
            v = v.value
        if v is not None:
            out[k] = v
    for k, v in stage.items():
        if v is not None:
            out[k] = v
    return out


def spec_from_job_variables(cfg: Any, where: str) -> QoSSpec:
    """A QoSSpec from a job configuration's QoS fields (None: QoSSpec's default), with the user its flow
    run's tags name (`run_user`)."""
    kw: dict[str, Any] = {}
    for k in QOS_FIELDS:
        v = getattr(cfg, k, None)
        if v is not None:
            kw[k] = v
    user = run_user(cfg)
    if user is not None:
        kw["user"] = user
    return build_spec(where, **kw)


def run_user(cfg: Any) -> str | None:
    """The user of the flow run a job configuration was prepared for (`user_from_tags` of its tags), or
    None. Prefect's `BaseJobConfiguration.prepare_for_flow_run` keeps the run among the configuration's
    related objects; the pool's job variables cannot carry it (Prefect keeps only the variables of
    the pool's base job template, and pools made before this field would drop a new one)."""
    related = getattr(cfg, "_related_objects", None)
    flow_run = related.get("flow-run") if isinstance(related, dict) else None
    name = user_from_tags(getattr(flow_run, "tags", None))
    if name is None:
        return None
    try:
        return QoSSpec(user=name).user
    except SpecError:  # (not a name qosflow wrote: left out rather than failing the stage)
        return None


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy scalars included


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False

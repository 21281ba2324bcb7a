"""What a running stage can ask about where it was placed: `qosflow.placement()`.

The worker launches every stage with `QOSFLOW_PLACEMENT` (JSON, written by
`qosflow.backends.base.placement_env`). A stage reads it to size its threads and, when the
scheduler put it on a shared GPU with a smaller sub-batch, to honour the gradient-accumulation plan:

    p = qosflow.placement()
    for step in range(steps):
        for micro in p.micro_batches(batch_size):   # [batch_size] when not sub-batched
            ...

Outside the worker (a plain local run) `placement()` returns an unplaced record (`placed=False`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

#: env var naming a file the stage appends progress lines to (read by the worker's CODA feedback loop)
PROGRESS_FILE_ENV = "QOSFLOW_PROGRESS_FILE"
#: env vars of an elastic start (`@qos_task(min_gpus=...)`): the GPUs a stage got, and the gradient
#: accumulation that keeps its global batch on them (set by `qosflow.backends.base.placement_env`)
GPUS_ENV = "QOSFLOW_GPUS"
GRAD_ACCUMULATION_ENV = "QOSFLOW_GRAD_ACCUMULATION"


@dataclass(frozen=True)
class PlacementInfo:
    placed: bool
    job_id: str | None = None
    node: str | None = None
    nodes: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    gpu_milli: int = 1000
    cpu_cores: float = 0.0
    cpuset: tuple[int, ...] = ()
    colocated_with: tuple[str, ...] = ()
    sub_batch: dict[str, int] | None = None
    virtual_gpus: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def shared(self) -> bool:
        return self.gpu_milli < 1000 or bool(self.colocated_with)

    @property
    def accumulation_steps(self) -> int:
        return int(self.sub_batch["accumulation_steps"]) if self.sub_batch else 1

    def sub_batch_size(self, global_batch: int) -> int:
        """The batch size one forward/backward pass should use (the global batch when not sub-batched)."""
        global_batch = _global_batch("sub_batch_size", global_batch)
        if not self.sub_batch:
            return global_batch
        acc = self.accumulation_steps
        return max(1, global_batch // acc)

    def micro_batches(self, global_batch: int) -> list[int]:
        """Sizes of the passes that make one optimizer step of `global_batch` samples."""
        global_batch = _global_batch("micro_batches", global_batch, minimum=0)  # 0: an empty last batch
        acc = self.accumulation_steps
        if acc <= 1:
            return [global_batch]
        base, rest = divmod(global_batch, acc)
        return [base + (1 if i < rest else 0) for i in range(acc) if base + (1 if i < rest else 0) > 0]

    @property
    def threads(self) -> int:
        """Threads a stage should use: its allocated cores (at least 1)."""
        if self.cpu_cores:
            return max(1, int(self.cpu_cores))
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1))


def _global_batch(fn: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int >= `minimum` (an int, a numpy integer, a float such as 128.0), else a SpecError. Without it
    a batch size read as text ("128" from a config or the environment) or 0 came back unchanged in a local
    run, and on a shared GPU failed the stage with a TypeError (or became 1)."""
    import math
    import numbers
    import operator

    from qosflow.errors import SpecError

    n = None
    if not isinstance(value, bool):
        try:
            n = operator.index(value)
        except TypeError:
            if isinstance(value, numbers.Real):  # a float, numpy's float32 too, such as 128.0
                f = float(value)
                if math.isfinite(f) and f.is_integer():
                    n = int(f)
    if n is None or n < minimum:
        hint = f" (int({value!r}) if it comes from a config or the environment)" if isinstance(value, str) else ""
        raise SpecError("global_batch", f"must be a whole number of samples >= {minimum}, got {value!r}{hint}", where=f"placement().{fn}")
    return n


def accumulation_steps() -> int:
    """How many micro-batches a stage accumulates per optimizer step because it was started on fewer
    GPUs than it asked for (`@qos_task(gpus=G, min_gpus=N)`, an elastic start on W of its G GPUs):
    G // W, from `QOSFLOW_GRAD_ACCUMULATION`; 1 at full width and outside the worker (unset).

    Each GPU keeps its per-GPU batch; the stage runs this many forward/backward passes per optimizer
    step, so the global batch -- and with it the training -- is as declared::

        n = qosflow.accumulation_steps()
        for i, batch in enumerate(loader):
            loss = model(batch) / n          # average over the n micro-batches of one step
            loss.backward()
            if (i + 1) % n == 0:
                optimizer.step()
                optimizer.zero_grad()

    (A shared GPU's sub-batch plan, `qosflow.placement().micro_batches(...)`, is separate from this.)
    A value that is not a whole number >= 1 raises a `QosflowError` naming the variable.
    """
    n = _env_count(GRAD_ACCUMULATION_ENV, "accumulation_steps", minimum=1)
    return 1 if n is None else n


def granted_gpus() -> int | None:
    """The GPUs this stage got, on all its nodes together (`QOSFLOW_GPUS`): its `gpus` at full width,
    fewer after an elastic start (`min_gpus`). Size data parallelism by it (e.g. the world size of a
    one-process-per-GPU launch); `accumulation_steps()` gives the matching gradient accumulation.
    None outside the worker and for a CPU-only stage (unset). A value that is not a whole number >= 1
    raises a `QosflowError` naming the variable."""
    return _env_count(GPUS_ENV, "granted_gpus", minimum=1)


def elastic_note(requested_gpus: int | None, grad_accumulation: int | None, *, unit: str = " GPUs") -> str:
    """"4 of 8 GPUs, gradient accumulation x2" for a stage started on fewer GPUs than it asked for (an
    elastic start), from the GPUs it asked for and its gradient accumulation; "" at full width or when
    either is unknown. `unit` follows the two counts ("" where a column already says GPUs)."""
    if not grad_accumulation or grad_accumulation <= 1 or not requested_gpus:
        return ""
    return f"{requested_gpus // grad_accumulation} of {requested_gpus}{unit}, gradient accumulation x{grad_accumulation}"


def _env_count(name: str, fn: str, *, minimum: int) -> int | None:
    """The whole number >= `minimum` in environment variable `name`; None if it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        from qosflow.errors import QosflowError

        raise QosflowError(
            f"qosflow.{fn}(): environment variable {name}={os.environ[name]!r} is not a whole number >= {minimum}; "
            "the qosflow worker sets it when it starts a stage: unset it outside the worker"
        )
    return value


def placement() -> PlacementInfo:
    """The placement of the current stage (from `QOSFLOW_PLACEMENT`), or an unplaced record."""
    raw = os.environ.get("QOSFLOW_PLACEMENT")
    if not raw:
        return PlacementInfo(placed=False)
    try:
        d = json.loads(raw)
    except json.JSONDecodeError:
        return PlacementInfo(placed=False)
    return PlacementInfo(
        placed=True,
        job_id=d.get("job_id"),
        node=d.get("node"),
        nodes=tuple(d.get("nodes") or ()),
        gpus=tuple(int(g) for g in d.get("gpus") or ()),
        gpu_milli=int(d.get("gpu_milli", 1000)),
        cpu_cores=float(d.get("cpu_cores") or 0.0),
        cpuset=tuple(int(c) for c in d.get("cpuset") or ()),
        colocated_with=tuple(d.get("colocated_with") or ()),
        sub_batch=d.get("sub_batch"),
        virtual_gpus=bool(d.get("virtual_gpus", False)),
        raw=d,
    )


def write_progress(step: float, total: float | None = None, **extra: Any) -> bool:
    """Append one progress line for the worker (no-op outside a placed stage). Returns True if written.

    This is the transport the worker reads; `qosflow.report_progress` (the predictor's API) can call it.
    """
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return False
    rec = {"t": time.time(), "step": float(step)}
    if total is not None:
        rec["total"] = float(total)
    rec.update(extra)
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
    except OSError:
        return False
    return True


def read_resumed(path: str) -> int:
    """Steps an earlier run had done when this one started (a run resumed from a checkpoint that said so
    with `qosflow.report_resumed` or `qosflow.track(..., start=k)`), else 0. A run says it before its
    first step, so only the head of the file is read."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096).decode("utf-8", "replace")
    except OSError:
        return 0
    start = 0
    for line in head.splitlines()[:-1] if not head.endswith("\n") else head.splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict) and d.get("resumed") and isinstance(d.get("step"), (int, float)) and d["step"] >= 0:
            start = int(d["step"])
    return start


def read_progress(path: str) -> dict[str, Any] | None:
    """The last progress record in a progress file, or None."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            lines = fh.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None

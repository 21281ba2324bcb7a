"""Muri's Philly-derived trace (Zhao et al., SIGCOMM'22; the Muri simulator's input format).

Columns: ``job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,interval,
iteration_time,resource_time_0..N,priority``. ``submit_time``, ``duration``, ``interval``,
``iteration_time`` and ``resource_time_*`` are milliseconds (the Muri simulator divides them by
1000); ``iteration_time x iterations ~= duration``.

Each row becomes a `Job`:

* ``submit_time`` and ``duration`` in seconds: duration is the trace's ``duration / 1000``, which is
  what Muri's simulator runs its time-based policies (``dlas-gpu``, ``shortest``) on. Its
  iteration-based (multi-resource) modes also multiply ``iteration_time`` by 1.015, a calibration
  overhead; pass ``iteration_overhead=1.015`` to reproduce those;
  a row with duration 0 has nothing to run and is rejected (with its line), not an error;
* ``resource_profile`` = the ``resource_time_*`` columns / 1000: seconds per iteration spent on
  data loading/CPU, GPU compute and network (Muri's interleaving model);
* QoS: ``gpus=num_gpu``, shareable (two jobs may share GPUs, as in Muri and SJF-BSBF), gang,
  ``gpu_mem_mb`` from SJF-BSBF's profile of the model (for a model it did not profile, the largest
  profiled figure, with ``meta["gpu_mem_assumed"]``), 4 CPU cores per GPU;
* priority: Muri's column (as used by its AntMan baseline) is 0 for a resource-guaranteed job and
  1 for an opportunistic one, so 0 -> `normal`, 1 -> `best-effort` (kept in ``meta["trace_priority"]``).
  The column (and ``interval``, ``resource_time_*``) may be missing, or a cell empty: Muri's simulator
  then draws a random priority; we leave the job without a trace priority (``meta["trace_priority"]``
  None), so deadlines decide its class as for Gavel's traces.
"""

from __future__ import annotations

from pathlib import Path

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.core.qos import PriorityClass
from qosflow.errors import SpecError, TraceFormatError
from qosflow.sim.interference import MURI_GPU_MEM_MB
from qosflow.sim.traces._common import CORES_PER_GPU, Rejected, csv_rows, make_job, make_qos, number, split_rejected

#: GPU memory (MiB) assumed for a model SJF-BSBF did not profile: the largest profiled figure (GPT-2),
#: so such a job shares a GPU only with partners that leave that much room (or with a sub-batch).
#: Without a figure, qosflow would never co-locate it, while the baselines placed it as if it
#: needed no memory at all.
UNKNOWN_MODEL_GPU_MEM_MB = max(MURI_GPU_MEM_MB.values())

REQUIRED = (
    "job_id",
    "num_gpu",
    "submit_time",
    "iterations",
    "model_name",
    "batch_size",
    "duration",
    "iteration_time",
    # optional: interval, resource_time_*, priority (Muri's simulator draws a random priority for
    # AntMan when a trace has no such column)
)
MS = 1000.0


def muri_priority(value: int) -> PriorityClass:
    """Muri's priority column: 0 resource-guaranteed, 1 opportunistic (AntMan's two classes)."""
    return PriorityClass.NORMAL if value <= 0 else PriorityClass.BEST_EFFORT


def load_muri(
    path: str | Path,
    *,
    cluster: ClusterSpec | None = None,
    iteration_overhead: float = 1.0,
    cores_per_gpu: float = CORES_PER_GPU,
) -> tuple[list[Job], list[Rejected]]:
    """Jobs of a Muri trace CSV, and (job id, reason) for those that can never fit `cluster`."""
    p = Path(path)
    if not iteration_overhead >= 1.0:
        raise SpecError("iteration_overhead", f"must be >= 1 (a calibration slowdown), got {iteration_overhead!r}")
    jobs: list[Job] = []
    zero: list[Rejected] = []  # rows with duration 0: nothing to run (rejected, not an error)
    seen: dict[str, int] = {}
    rt_cols: list[str] | None = None
    for line, row in csv_rows(p, REQUIRED, "Muri trace", known=("interval", "priority", "resource_time_0", "resource_time_1",
                                                                 "resource_time_2")):
        if rt_cols is None:
            rt_cols = sorted((c for c in row if c.startswith("resource_time_")), key=lambda c: (len(c), c))
        jid = row["job_id"]
        if not jid:
            raise TraceFormatError(p, line, "column 'job_id': empty job id")
        if jid in seen:
            raise TraceFormatError(p, line, f"column 'job_id': job {jid!r} already appears on line {seen[jid]}")
        seen[jid] = line
        gpus = int(number(p, line, "num_gpu", row["num_gpu"], "number of GPUs", integer=True, positive=True))
        submit = number(p, line, "submit_time", row["submit_time"], "submit time in ms") / MS
        iters = int(number(p, line, "iterations", row["iterations"], "number of iterations", integer=True))
        model = row["model_name"]
        if not model:
            raise TraceFormatError(p, line, "column 'model_name': empty model name")
        batch = int(number(p, line, "batch_size", row["batch_size"], "batch size", integer=True, positive=True))
        duration = number(p, line, "duration", row["duration"], "duration in ms") / MS
        it_time = number(p, line, "iteration_time", row["iteration_time"], "iteration time in ms") / MS
        prio_raw = (
            int(number(p, line, "priority", row["priority"], "priority (0 or 1)", integer=True, minimum=None))
            if row.get("priority", "") != ""
            else None
        )
        interval = (
            number(p, line, "interval", row["interval"], "interval in ms") / MS if row.get("interval", "") != "" else None
        )
        profile = tuple(
            number(p, line, c, row[c], "resource time in ms") / MS for c in rt_cols if row.get(c, "") != ""
        )
        if duration == 0:
            zero.append((jid, f"line {line}: duration 0 ms, nothing to run"))
            continue
        mem = MURI_GPU_MEM_MB.get(model.lower())
        qos = make_qos(
            p,
            line,
            gpus=gpus,
            gpu_mem_mb=mem if mem is not None else UNKNOWN_MODEL_GPU_MEM_MB,
            cpu_cores=cores_per_gpu * gpus,
            priority=muri_priority(prio_raw) if prio_raw is not None else PriorityClass.NORMAL,
            shareable=True,
            gang=True,
        )
        jobs.append(
            make_job(
                p,
                line,
                job_id=jid,
                submit_time=submit,
                qos=qos,
                duration=duration * iteration_overhead,
                model=model,
                batch_size=batch,
                iterations=iters,
                resource_profile=profile or None,
                meta={
                    "trace": "muri",
                    "line": line,
                    "trace_priority": prio_raw,
                    "priority_from_trace": prio_raw is not None,
                    "iteration_time": it_time * iteration_overhead,
                    "interval": interval,
                    # no profile of this model's GPU memory: the largest profiled figure was assumed
                    "gpu_mem_assumed": mem is None,
                },
            )
        )
    if not jobs and not zero:
        raise TraceFormatError(p, None, "the trace has a header but no jobs")
    ok, never = split_rejected(jobs, cluster)
    return ok, zero + never

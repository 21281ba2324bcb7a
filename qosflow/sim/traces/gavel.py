"""Gavel's Philly-derived ``.trace`` files (Narayanan et al., OSDI'20; ``traces/msr/seed=N/<vc>.trace``).

One job per line, tab-separated, no header. The published msr traces have 7 fields::

    job_type  command  num_steps_arg  needs_data_dir  total_steps  arrival_time(s)  scale_factor

Gavel's later generator writes 9 fields (``... total_steps scale_factor priority_weight SLO
arrival_time``), and its latest ``parse_trace`` reads 10 (the same with ``working_directory`` after
the command); all three are read. A job's isolated duration is ``total_steps / throughput``, the
solo, consolidated throughput of its job type at its scale factor on a V100 from Gavel's throughput
table (exactly how Gavel's generator turned durations into steps). Scale factors the table lacks
(16, 32, ..., or multi-GPU A3C/CycleGAN/Recommendation) use the largest measured scale below,
scaled linearly in GPUs; ``meta["throughput_source"]`` says which. A job type the table does not
know has no duration: the job is rejected with that reason (and its line), the others still run.

A positive ``SLO`` (9- and 10-field forms) is the job's deadline as a multiple of its duration, as in
Gavel's scheduler (``SLO x duration`` after arrival): such a job always gets that deadline
(`qosflow.sim.deadlines`); ``-1`` (Gavel's "none") leaves it to the drawn deadlines like a 7-field job.

QoS: ``gpus = scale_factor``, shareable, gang, ``gpu_mem_mb`` from
`qosflow.sim.interference.GAVEL_GPU_MEM_MB`, 4 CPU cores per GPU. Job ids are ``<file stem>-<n>``
with n counting jobs from 0 (Gavel's own job ids).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.errors import TraceFormatError
from qosflow.sim.interference import (
    DEFAULT_GPU_TYPE,
    THROUGHPUTS_ENV,
    GavelInterference,
    default_throughputs_path,
    gavel_batch_size,
    gpu_mem_mb,
    load_gavel_interference,
)
from qosflow.sim.traces._common import CORES_PER_GPU, Rejected, check_text, make_job, make_qos, number, split_rejected

FIELDS_7 = ("job_type", "command", "num_steps_arg", "needs_data_dir", "total_steps", "arrival_time", "scale_factor")
FIELDS_9 = (
    "job_type",
    "command",
    "num_steps_arg",
    "needs_data_dir",
    "total_steps",
    "scale_factor",
    "priority_weight",
    "SLO",
    "arrival_time",
)
#: the form of Gavel's later `parse_trace`: the 9 fields with the job's working directory after the command
FIELDS_10 = FIELDS_9[:2] + ("working_directory",) + FIELDS_9[2:]
FORMS = {7: FIELDS_7, 9: FIELDS_9, 10: FIELDS_10}


def _separator_hint(text: str, fields: int) -> str:
    """'; ...' when a line that is not tab-separated is separated otherwise (an editor that turned tabs into
    spaces, a CSV export), else ''."""
    if fields != 1:
        return ""
    for sep, name in ((",", "commas"), (";", "semicolons")):
        if text.count(sep) + 1 in FORMS:
            return (f": the line is separated by {name}; a Gavel trace separates its fields by tabs (its job types "
                    "and commands hold spaces and commas)")
    if re.search(r"\S {2,}\S", text):
        return ": the line has no tab, only spaces (an editor may have turned its tabs into spaces); separate the fields by tabs"
    return ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load_gavel(
    path: str | Path,
    *,
    cluster: ClusterSpec | None = None,
    throughputs: GavelInterference | str | Path | None = None,
    gpu_type: str = DEFAULT_GPU_TYPE,
    cores_per_gpu: float = CORES_PER_GPU,
) -> tuple[list[Job], list[Rejected]]:
    """Jobs of one Gavel ``.trace`` file, and (job id, reason) for those that never fit `cluster`."""
    p = Path(path)
    if p.is_dir():
        raise TraceFormatError(p, None, "is a directory; give one .trace file (one virtual cluster)")
    if not p.is_file():
        raise TraceFormatError(p, None, "Gavel trace not found")
    check_text(p, "Gavel trace")
    table = throughputs if isinstance(throughputs, GavelInterference) else load_gavel_interference(throughputs, gpu_type=gpu_type)
    if table is None:
        raise TraceFormatError(
            throughputs or default_throughputs_path(),
            None,
            "not found: Gavel traces need Gavel's throughput table (gavel_simulation_throughputs.json) to turn "
            f"steps into seconds. Give its path with --throughputs PATH (qosflow simulate), {THROUGHPUTS_ENV}=PATH, "
            "or QOSFLOW_SHARED_DATA=DIR holding throughputs/gavel_simulation_throughputs.json "
            "(in Python: load_gavel(..., throughputs=PATH))",
        )
    stem = p.stem
    jobs: list[Job] = []
    rejected: list[Rejected] = []  # job types without a throughput
    n = 0  # Gavel's job id: every job line counts
    with open(p, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of the first job type
        for line, text in enumerate(f, 1):
            text = text.rstrip("\r\n")
            if not text.strip():
                continue
            parts = text.split("\t")
            names = FORMS.get(len(parts))
            if names is None:
                raise TraceFormatError(
                    p, line, f"expected 7 tab-separated fields ({', '.join(FIELDS_7)}), or Gavel's 9- or 10-field "
                             f"form (10: {', '.join(FIELDS_10)}), got {len(parts)}{_separator_hint(text, len(parts))}"
                )
            row = dict(zip(names, (x.strip() for x in parts)))
            if not jobs and not rejected and not _is_number(row["total_steps"]) and not _is_number(row["arrival_time"]):
                raise TraceFormatError(
                    p, line, f"looks like a header ({text.strip()[:60]!r}): Gavel traces have none, every line is a job "
                             "(fields in the order above); remove this line"
                )
            jt = row["job_type"]
            if not jt:
                raise TraceFormatError(p, line, "field 'job_type' is empty")
            resolved = table.resolve(jt)
            steps = int(number(p, line, "total_steps", row["total_steps"], "total steps", integer=True, positive=True))
            arrival = number(p, line, "arrival_time", row["arrival_time"], "arrival time in seconds")
            sf = int(number(p, line, "scale_factor", row["scale_factor"], "scale factor (GPUs)", integer=True, positive=True))
            needs = row["needs_data_dir"]
            if needs not in ("0", "1"):
                raise TraceFormatError(p, line, f"field 'needs_data_dir': expected 0 or 1, got {needs!r}")
            jid = f"{stem}-{n}"
            n += 1
            tput = table.throughput(resolved, sf) if resolved is not None else None
            if tput is None or not math.isfinite(tput) or tput <= 0:
                # a job type the table lacks has no duration: rejected with its reason, not fatal
                why = "is not in" if resolved is None else f"has no throughput at {sf} GPU(s) in"
                rejected.append((jid, f"line {line}: job type {jt!r} {why} Gavel's throughput table ({table.path.name}), "
                                      "so its steps cannot be turned into seconds"))
                continue
            meta = {
                "trace": "gavel",
                "line": line,
                "total_steps": steps,
                "throughput": tput,
                "throughput_source": table.throughput_source(resolved, sf),
                "priority_from_trace": False,
                "command": row["command"],
            }
            if "SLO" in row:
                meta["priority_weight"] = number(p, line, "priority_weight", row["priority_weight"], "priority weight")
                meta["SLO"] = slo = number(p, line, "SLO", row["SLO"], "SLO factor", minimum=None)
                if slo > 0:  # Gavel: deadline = arrival + SLO x duration; its generator writes -1 for none
                    meta["wants_deadline"] = True
                    meta["trace_deadline_factor"] = slo
            qos = make_qos(p, line, gpus=sf, gpu_mem_mb=gpu_mem_mb(resolved), cpu_cores=cores_per_gpu * sf, shareable=True, gang=True)
            jobs.append(
                make_job(
                    p,
                    line,
                    job_id=jid,
                    submit_time=arrival,
                    qos=qos,
                    duration=steps / tput,
                    model=resolved,
                    batch_size=gavel_batch_size(resolved),
                    iterations=steps,
                    meta=meta,
                )
            )
    if not jobs and not rejected:
        raise TraceFormatError(p, None, "the trace has no jobs")
    ok, never = split_rejected(jobs, cluster)
    return ok, rejected + never

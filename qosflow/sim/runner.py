"""Resolve a (trace, format, cluster) request from the CLI or a benchmark into jobs and a cluster."""

from __future__ import annotations

import re
from pathlib import Path

from qosflow.core.cluster import ClusterSpec
from qosflow.errors import QosflowError


def guess_format(trace: str) -> str:
    if trace == "synthetic":
        return "synthetic"
    p = Path(trace)
    if not p.exists():
        raise QosflowError(f"trace file {trace!r} does not exist (use --trace synthetic for the embedded workload)")
    if p.suffix == ".trace":
        return "gavel"
    if p.is_dir():
        raise QosflowError(f"{trace} is a directory; give a trace file in it (e.g. a Gavel .trace, a Muri or Alibaba CSV)")
    head = ""
    if p.is_file():
        from qosflow.sim.traces._common import check_text

        check_text(p, "trace")  # a gzip file or a spreadsheet: say so, not "cannot tell the format"
        with open(p, encoding="utf-8-sig", errors="replace") as f:  # a BOM is not part of the header
            head = f.readline()
        if not head.strip():
            raise QosflowError(f"{trace}: the first line is empty; a trace starts with its header (a Muri or an "
                               "Alibaba CSV) or, for Gavel, with its first tab-separated job line")
        if head.lstrip().startswith(("{", "[")):  # was "cannot tell the trace format from its header ({)"
            raise QosflowError(f"{trace}: this is JSON, not a trace (a Muri or Alibaba CSV, or a Gavel .trace): a Gavel "
                               "cluster_specs.json goes to --cluster; Gavel's throughput table is read by simulate itself "
                               "(throughputs/ under QOSFLOW_SHARED_DATA) and evaluated by 'qosflow predict eval --throughputs FILE'")
    cols = {c.strip().strip('"') for c in head.split(",")}
    # by the columns that mark each format, in any order and with extra columns; a header with at least
    # half of one format's marks is taken as that format, whose loader then names the columns it lacks
    # (file, line and the columns it needs)
    fmt, marks = max(FORMAT_MARKS.items(), key=lambda kv: len(kv[1] & cols))
    if len(marks & cols) >= len(marks) / 2:
        return fmt
    from qosflow.sim.traces.gavel import FORMS as GAVEL_FORMS

    if head.count("\t") + 1 in GAVEL_FORMS:  # a Gavel trace under another name: one of its tab-separated forms, no header
        return "gavel"
    shown = ", ".join(c for c in head.strip().split(",")[:8] if c) or "(empty)"
    lower = {c.lower() for c in cols}
    for what, marks, hint in NOT_TRACES:
        if marks <= lower:
            raise QosflowError(f"{trace}: this is {what}, not a trace ({shown}); {hint}")
    for delim, name in ((";", "semicolons"), ("\t", "tabs")):
        # a Muri or Alibaba trace saved with another delimiter (spreadsheets write semicolons in many
        # locales): --format would only lead to "missing columns"
        alt = {c.strip().strip('"') for c in head.split(delim)}
        if any(len(m & alt) >= len(m) / 2 for m in FORMAT_MARKS.values()):
            raise QosflowError(f"{trace}: its header is separated by {name} ({shown}); a Muri or Alibaba trace "
                               "must be comma-separated: save it as CSV with commas")
    raise QosflowError(f"{trace}: cannot tell the trace format from its header ({shown}); "
                       "pass --format muri|gavel|alibaba|synthetic")


#: columns that mark a CSV trace's format (each loader checks the full list it needs)
FORMAT_MARKS = {
    "muri": frozenset({"job_id", "num_gpu", "submit_time", "duration", "model_name"}),
    "alibaba": frozenset({"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"}),
}
#: files of the other inputs, told apart from traces so the error says where they go
NOT_TRACES = (
    ("an Alibaba node list", frozenset({"sn", "gpu", "cpu_milli"}),
     "pass it as --cluster, with an Alibaba pod list as --trace"),
    ("a Muri cluster spec", frozenset({"num_switch", "num_node_p_switch", "num_gpu_p_node"}),
     "pass it as --cluster, with a Muri trace as --trace"),
    ("a co-location pair table", frozenset({"model1", "model2", "speed1", "speed2"}),
     "evaluate the predictor on it with 'qosflow predict eval --pairs FILE'"),
)


def check_trace_format(trace: str, fmt: str | None) -> None:
    """A SpecError when --format contradicts --trace: `--format synthetic --trace FILE` simulated the embedded
    generator's 400 jobs and never read FILE (its name, and the results, said 'synthetic-400-seed0' only), and
    `--format muri` without --trace read a file named 'synthetic' ('synthetic: Muri trace not found')."""
    from qosflow.errors import SpecError

    from qosflow.sim.workload import FORMATS

    key = str(fmt).strip().lower() if fmt is not None else None
    if key not in FORMATS:  # none given (guessed from the trace), or unknown: resolve_workload names the formats
        return
    if key == "synthetic" and trace != "synthetic":
        raise SpecError("--format", f"synthetic is the embedded generator, which reads no file, so {trace} would not be "
                                    "read: leave --format out (the trace's format is guessed) or give its format "
                                    "(muri, gavel, alibaba); for the generator, --trace synthetic")
    if key != "synthetic" and trace == "synthetic":
        raise SpecError("--format", f"{key} is the format of a trace file: give the file with --trace FILE "
                                    "(without --trace the workload is the embedded generator, --format synthetic)")


def resolve_workload(trace: str, fmt: str | None, cluster: str | None, *, seed: int = 0, deadline_share: float = 0.5, jobs: int | None = None,
                     min_gpus_share: float | None = None, throughputs: str | Path | None = None,
                     cores_per_gpu: float | None = None, users: int | list[float] | None = None):
    """(workload, cluster spec) as `qosflow simulate` takes them; `throughputs`: Gavel's throughput
    table to use instead of the default one (a Gavel trace's durations, the synthetic job types);
    `cores_per_gpu`: CPU cores a job takes per GPU, for the formats that give none (all but alibaba);
    `users`: the synthetic workload's users (a number of users or their shares, `generate_synthetic`),
    drawn with its jobs; the traces name none, so any other format with `users` is an error."""
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.workload import load_workload

    fmt = fmt or guess_format(trace)
    from qosflow.sim.workload import FORMATS

    if str(fmt).strip().lower() not in FORMATS:  # before --jobs: "synthetic (xyz) is simulated whole" misled
        from qosflow.errors import UnknownNameError

        raise UnknownNameError("trace format", str(fmt), FORMATS)
    check_trace_format(trace, fmt)
    if jobs is not None:
        from qosflow.errors import SpecError

        if str(fmt).strip().lower() != "synthetic":
            raise SpecError("--jobs", f"only the synthetic workload takes a number of jobs; {trace} ({fmt}) is simulated whole: leave --jobs out, or use --trace synthetic")
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs <= 0:
            raise SpecError("--jobs", f"must be a positive number of jobs, got {jobs!r}")
    if users is not None and str(fmt).strip().lower() != "synthetic":
        from qosflow.errors import SpecError

        raise SpecError("--users", f"only the synthetic workload is given users; the Muri, Gavel and Alibaba traces name "
                                   f"none, so the jobs of {trace} are all one user: leave --users out, or use --trace synthetic")
    if cores_per_gpu is not None:
        from qosflow.errors import SpecError

        if str(fmt).strip().lower() == "alibaba":
            raise SpecError("--cores-per-gpu", f"{trace} is an Alibaba pod list, which gives each pod's cores (cpu_milli); "
                                               "--cores-per-gpu is for traces that give none (muri, gavel, synthetic)")
        if isinstance(cores_per_gpu, bool) or not isinstance(cores_per_gpu, (int, float)) or not 0 < cores_per_gpu < float("inf"):
            raise SpecError("--cores-per-gpu", f"must be a number of CPU cores > 0 (e.g. 2), got {cores_per_gpu!r}")
    spec: ClusterSpec = load_cluster(cluster or "8x8")
    _check_has_gpus(spec, cluster)
    opts: dict = {}
    if cores_per_gpu is not None:
        opts["cores_per_gpu"] = float(cores_per_gpu)
    if jobs is not None:
        opts["num_jobs"] = jobs
    if min_gpus_share is not None:
        opts["min_gpus_share"] = min_gpus_share
    if users is not None:
        opts["users"] = users
    if throughputs is not None:
        key = str(fmt).strip().lower()
        if key == "gavel":
            opts["throughputs"] = throughputs
        elif key == "synthetic":
            from qosflow.sim.interference import load_gavel_interference

            opts["table"] = load_gavel_interference(throughputs)
    wl = load_workload(trace, fmt, cluster=spec, seed=seed, deadline_share=deadline_share, **opts)
    if cluster is None and getattr(wl, "cluster_hint", None):
        hinted = load_cluster(wl.cluster_hint) if isinstance(wl.cluster_hint, str) else wl.cluster_hint
        if hinted != spec:  # (the synthetic workload's hint is the default 8x8: loaded once)
            spec = hinted
            _check_has_gpus(spec, wl.cluster_hint if isinstance(wl.cluster_hint, str) else spec.name)
            wl = load_workload(trace, fmt, cluster=spec, seed=seed, deadline_share=deadline_share, **opts)
    if not wl.jobs:
        # grouped by reason without its "line N: " prefix (each rejected row has its own line), the
        # first few lines of each kept so the user can look them up
        reasons: dict[str, list[str]] = {}
        for _, why in wl.rejected:
            m = re.match(r"line (\d+): ", why)
            reasons.setdefault(why[m.end():] if m else why, []).append(m.group(1) if m else "")

        def shown(why: str, lines: list[str]) -> str:
            at = [ln for ln in lines if ln]
            where = f" (line{'s' if len(at) > 1 else ''} {', '.join(at[:5])}{', ...' if len(at) > 5 else ''})" if at else ""
            return f"{len(lines)} x {why}{where}"

        top = "; ".join(shown(why, lines) for why, lines in sorted(reasons.items(), key=lambda kv: -len(kv[1]))[:3])
        raise QosflowError(
            f"{trace}: no job left to simulate on {spec.name}: all {len(wl.rejected)} were rejected ({top}); "
            "check the trace's columns and --cluster"
        )
    return wl, spec


def _check_has_gpus(spec: ClusterSpec, given) -> None:
    """A cluster without a single GPU (an Alibaba node list of CPU nodes only) is an error: it was simulated,
    every GPU job rejected with 'the cluster has 0 that fit it', the rest compared at 0 % GPU allocation."""
    if spec.num_gpus == 0:
        from qosflow.errors import SpecError

        raise SpecError("--cluster", f"{given}: the cluster has no GPUs ({len(spec.nodes)} node(s), none with a GPU); "
                                     "give a cluster with GPU nodes (e.g. 8x8, or a node list whose 'gpu' column is > 0 on "
                                     "the GPU nodes)")


def fewest_cores_per_gpu(spec: ClusterSpec) -> float | None:
    """The fewest CPU cores per GPU of the cluster's GPU nodes (None without GPU nodes)."""
    per = [n.cpu_cores / n.gpus for n in spec.nodes if n.gpus]
    return min(per) if per else None

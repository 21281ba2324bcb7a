"""Resolve a (trace, format, cluster) request from the CLI or a benchmark into jobs and a cluster."""

from __future__ import annotations

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
    head = p.read_text(errors="replace").splitlines()[0] if p.is_file() else ""
    if head.startswith("job_id,num_gpu"):
        return "muri"
    if head.startswith("name,cpu_milli"):
        return "alibaba"
    raise QosflowError(f"{trace}: cannot tell the trace format from its header; pass --format muri|gavel|alibaba|synthetic")


def resolve_workload(trace: str, fmt: str | None, cluster: str | None, *, seed: int = 0, deadline_share: float = 0.5, jobs: int | None = None):
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.workload import load_workload

    fmt = fmt or guess_format(trace)
    spec: ClusterSpec = load_cluster(cluster or "8x8")
    opts = {}
    if jobs is not None:
        opts["num_jobs"] = jobs
    wl = load_workload(trace, fmt, cluster=spec, seed=seed, deadline_share=deadline_share, **opts)
    if cluster is None and getattr(wl, "cluster_hint", None):
        spec = load_cluster(wl.cluster_hint) if isinstance(wl.cluster_hint, str) else wl.cluster_hint
        wl = load_workload(trace, fmt, cluster=spec, seed=seed, deadline_share=deadline_share, **opts)
    return wl, spec

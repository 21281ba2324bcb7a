"""What each host of a worker's cluster holds now, as the Prefect UI's cluster table (`qosflow-cluster-<pool>`)
and the worker's Prometheus series show it: one reading of the scheduler's `ClusterState` for both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterator


@dataclass(frozen=True)
class NodeUsage:
    name: str
    gpu_model: str
    gpus: int
    allocated: int  # GPUs holding at least one stage
    shared: int  # GPUs holding two or more stages
    cpu_cores: float
    cpu_free: float
    down: bool
    stages: int  # stages (this worker's and other workers' leases) placed on the node


#: the key prefix of a pipeline run's cores held in the policy's view (`QosflowWorker._hold_pipeline`): not a stage
PIPELINE_HOLD = "pipeline:"
#: the key prefix of what the pods that are not qosflow's stages take on a Kubernetes node (`foreign_pods`): not a stage
PODS_HOLD = "pods:"


def is_hold(key: str) -> bool:
    """Whether a key of the policy's allocations is a hold that is no stage (a pipeline run's cores, other pods)."""
    return str(key).startswith((PIPELINE_HOLD, PODS_HOLD))


def node_usage(state: Any) -> Iterator[NodeUsage]:
    """Each node of `state` (a ClusterState), in order."""
    per_node: dict[int, int] = {}
    for key, p in list(state.allocs.items()):
        if is_hold(key):  # (a pipeline run's cores on an agent's host, other pods: not stages)
            continue
        for n in set(p.nodes):
            per_node[n] = per_node.get(n, 0) + 1
    for i, node in enumerate(state.spec.nodes):
        jobs = state.njobs[i][state.exists[i]]
        yield NodeUsage(node.name, str(node.gpu_model), int(state.gpu_count[i]), int((jobs > 0).sum()), int((jobs > 1).sum()),
                        float(node.cpu_cores), max(0.0, float(state.cpu_free[i])), bool(state.down[i]), per_node.get(i, 0))


def cluster_rows(state: Any, *, draining: Collection[str] = (), outage: bool = False) -> list[dict[str, Any]]:
    """The cluster table: one row per host (state: up, down, or draining: removed from the cluster's
    description, its stages still running), then a total row."""
    rows = []
    total = {"gpus": 0, "allocated": 0, "shared": 0, "stages": 0, "up": 0}
    for u in node_usage(state):
        status = "draining" if u.name in draining else ("down (outage)" if outage and u.down else ("down" if u.down else "up"))
        rows.append({"host": u.name, "state": status, "GPU model": u.gpu_model, "GPUs": u.gpus,
                     "GPUs in use": u.allocated, "GPUs shared": u.shared, "cores free": f"{u.cpu_free:g} of {u.cpu_cores:g}",
                     "stages": u.stages})
        total["gpus"] += u.gpus
        total["allocated"] += u.allocated
        total["shared"] += u.shared
        total["stages"] += u.stages
        total["up"] += not u.down
    rows.append({"host": f"all ({total['up']} of {len(rows)} up)", "state": "", "GPU model": "", "GPUs": total["gpus"],
                 "GPUs in use": total["allocated"], "GPUs shared": total["shared"], "cores free": "", "stages": total["stages"]})
    return rows

"""qosflow's scheduling core: QoS specs, jobs, clusters and placements (no Prefect import)."""

from qosflow.core.cluster import ClusterSpec, ClusterState, NodeSpec
from qosflow.core.job import FailurePlan, Job, JobState, JobStatus
from qosflow.core.placement import JobIdPair, Placement, SubBatchPlan
from qosflow.core.qos import PriorityClass, QoSSpec

__all__ = [
    "ClusterSpec",
    "ClusterState",
    "FailurePlan",
    "Job",
    "JobIdPair",
    "JobState",
    "JobStatus",
    "NodeSpec",
    "Placement",
    "PriorityClass",
    "QoSSpec",
    "SubBatchPlan",
]

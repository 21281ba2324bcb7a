"""GPU-sharing packing: the FGD experiment (Weng et al., USENIX ATC'23) and its policies.

Pure Python + numpy, no Prefect import. See docs/packing.md.
"""

from qosflow.packing.model import MILLI, Node, PackingError, PackState, Placement, Pod
from qosflow.packing.policies import PackingPolicy, make_policy, policy_names, register_policy
from qosflow.packing.workload import WorkloadDistribution

__all__ = [
    "MILLI",
    "Node",
    "PackState",
    "PackingError",
    "PackingPolicy",
    "Placement",
    "Pod",
    "WorkloadDistribution",
    "make_policy",
    "policy_names",
    "register_policy",
]

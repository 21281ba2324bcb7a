"""qosflow's Prefect integration: `@qos_task`, blocks, the `qosflow` work pool type and its worker.

This module is the `prefect.collections` entry point: Prefect imports it to discover the `qosflow`
worker type (`prefect work-pool create gpu --type qosflow`) and the blocks.
"""

from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster, QoSPolicy
from qosflow.prefect.worker import QosflowWorker

__all__ = ["BareMetalGPUCluster", "KubernetesGPUCluster", "QoSPolicy", "QosflowWorker", "qos_flow", "qos_task"]


def __getattr__(name: str):
    if name in ("qos_task", "qos_flow", "QoSTask"):
        from qosflow.prefect import tasks

        return getattr(tasks, name)
    raise AttributeError(name)

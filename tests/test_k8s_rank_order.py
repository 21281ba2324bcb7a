"""A gang's pods in rank order (`_rank0_first`: rank 0's log is the one whose progress lines the worker copies, and
`logs` gives the pods' output in that order) when the gang is one Job per node (82b322f: every gang whose nodes'
placements differ). Such a pod has no completion index; its rank is its QOSFLOW_GANG_RANK value (`pod_rank`). They were
ordered by name: qf-...-r0, -r1, -r10, -r11, -r2: rank 10 before rank 2 in a gang of 11 nodes or more."""

from __future__ import annotations

import random

from kubernetes import client

from qosflow.backends.kubernetes import _rank0_first, pod_rank


def _per_node_pod(rank: int) -> client.V1Pod:
    return client.V1Pod(metadata=client.V1ObjectMeta(name=f"qf-train-1a2b3c4d-r{rank}-{random.randrange(16**5):05x}"),
                        spec=client.V1PodSpec(containers=[client.V1Container(name="stage", env=[
                            client.V1EnvVar(name="QOSFLOW_GANG_RANK", value=str(rank))])]))


def _indexed_pod(index: int) -> client.V1Pod:
    return client.V1Pod(metadata=client.V1ObjectMeta(name=f"qf-train-1a2b3c4d-{index}-{random.randrange(16**5):05x}",
                                                     annotations={"batch.kubernetes.io/job-completion-index": str(index)}),
                        spec=client.V1PodSpec(containers=[client.V1Container(name="stage", env=[client.V1EnvVar(
                            name="QOSFLOW_GANG_RANK", value_from=client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(
                                field_path="metadata.annotations['batch.kubernetes.io/job-completion-index']")))])]))


def test_the_pods_of_a_gang_of_one_job_per_node_come_in_rank_order():
    pods = [_per_node_pod(r) for r in range(12)]
    random.Random(7).shuffle(pods)
    assert [pod_rank(p) for p in _rank0_first(pods)] == list(range(12))


def test_the_pods_of_an_indexed_gang_job_come_in_rank_order_as_before():
    pods = [_indexed_pod(i) for i in range(12)]
    random.Random(7).shuffle(pods)
    assert [pod_rank(p) for p in _rank0_first(pods)] == list(range(12))

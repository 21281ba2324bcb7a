"""A worker that cannot read the pods on its nodes says so at WARNING, once per cause, with the fix.

The worker books what the pods that are not its stages take on each node (`KubernetesBackend.foreign_pod_usage`, read
at every heartbeat by the worker's `_read_pods`). A failed reading was logged at debug only: a worker whose account may
not `list pods` (RBAC) booked nothing of other pods' GPUs, cores and memory, silently, and placed stages into room
kube-scheduler gave those pods. Now the backend says it at WARNING (what a Prefect worker shows of a qosflow.* logger),
once per distinct cause and not at every heartbeat, and for a 403 names the RBAC rule to add and the manifest that has
it (deploy/kubernetes/worker-rbac.yaml). Run on qosflow's API emulator (EMULATED: no cluster) with the manifest's RBAC
in force (tests/test_k8s_rbac.py's account), through the official `kubernetes` client and the worker's `_read_pods`."""

from __future__ import annotations

import asyncio
import copy
import logging
from pathlib import Path

import pytest
import yaml

from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.k8s_emulator.rbac import service_account_user

pytestmark = pytest.mark.timeout(120)
RBAC = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "worker-rbac.yaml"
NS = "ml"
WORKER = service_account_user(NS, "qosflow-worker")


def manifests(*, pods_list: bool = True) -> list[dict]:
    """worker-rbac.yaml for namespace NS; without `list` on pods anywhere (the Role's and the ClusterRole's rule)."""
    docs = [d for d in yaml.safe_load_all(RBAC.read_text().replace("qosflow-stages", NS)) if d]
    if not pods_list:
        docs = copy.deepcopy(docs)
        for d in docs:
            for rule in d.get("rules") or []:
                if rule["apiGroups"] == [""] and "pods" in rule["resources"]:
                    rule["verbs"] = [v for v in rule["verbs"] if v != "list"]
            if "rules" in d:
                d["rules"] = [r for r in d["rules"] if r["verbs"]]
    return docs


class Records(logging.Handler):
    """The records of the backend's logger, kept (on the logger itself: Prefect's logging configuration, set up when the
    worker is imported, may stop them from reaching the root logger, and pytest's caplog with them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def said(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and "cannot read the pods bound to its nodes" in r.getMessage()]


def test_pods_that_cannot_be_read_are_said_once_per_cause_at_warning_with_the_rbac_rule():
    from qosflow.prefect.worker import QosflowWorker

    caplog = Records()

    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        emu.set_rbac(manifests(pods_list=False))

        async def go():
            be = KubernetesBackend(namespace=NS, image="busybox:1.36", api_client=emu.api_client(user=WORKER), cluster_name="rbac",
                                   watch_pods=False)
            be.pod_usage_every_s = 0.0  # (a reading at each call, as at each heartbeat past POD_READ_S)
            w = QosflowWorker(work_pool_name="k8s-pods-unread", backend=be)
            try:
                await be.inventory()
                got = [await w._read_pods(be) for _ in range(4)]  # (four heartbeats)
                assert got == [None] * 4  # (the holds stay as they are, as before)
                first = len(said(caplog))
                # another cause (the API server failing): said once more; then the pods are read again
                emu.set_rbac(manifests())
                emu.add_fault(r"/pods$", method="GET", status=500, count=2 * (be.api_retries + 1))
                got = [await w._read_pods(be) for _ in range(2)]
                assert got == [None, None]
                second = len(said(caplog))
                assert await w._read_pods(be) == {}
                # the account loses the rule again: a new episode, said again
                emu.set_rbac(manifests(pods_list=False))
                await w._read_pods(be)
                await w._read_pods(be)
                return first, second, be.stats.get("pod_read_failures_said", 0)
            finally:
                await be.aclose()

        logger = logging.getLogger("qosflow.backends.kubernetes")
        logger.addHandler(caplog)
        try:
            first, second, n = asyncio.run(go())
        finally:
            logger.removeHandler(caplog)
    lines = [r.getMessage() for r in said(caplog)]
    assert first == 1 and second == 2 and len(lines) == 3 and n == 3, lines
    forbidden = lines[0]
    assert f"the account {WORKER} may not list pods in namespace {NS}" in forbidden, forbidden
    assert 'resources: ["pods"], verbs: ["list", "watch"]' in forbidden and "qosflow-worker-pods" in forbidden, forbidden
    assert "deploy/kubernetes/worker-rbac.yaml" in forbidden and f"namespace {NS}" in forbidden, forbidden
    assert "500" in lines[1] and "Grant" not in lines[1], lines[1]
    assert lines[2] == forbidden

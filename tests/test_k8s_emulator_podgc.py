"""The Kubernetes API emulator's pod garbage collector (kube-controller-manager's PodGC), through the official client.

Before, the emulator had none: a pod bound to a deleted node ran on (to its end) and stayed, and terminated pods were
never deleted. Now, as upstream's gc_controller.go:
* orphaned pods: once a node bound pods name has been missing for the quarantine (`pod_gc_quarantine_s`; upstream
  40 s), each pod there is marked Failed with the condition DisruptionTarget / DeletionByPodGC / "PodGC: node no
  longer exists" (a MODIFIED event), then deleted (DELETED), and its Job counts it failed;
* terminated pods beyond `terminated_pod_gc_threshold` are deleted, evicted ones first, then the oldest.
And qosflow's KubernetesBackend, when it learns of the node's deletion only from its pod (no node watch, no heartbeat),
ends the stage with the reason it gives DeletionByPodGC (an infrastructure failure), not as the user's error.
EMULATED: no cluster here.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
from kubernetes import client, watch

from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.placement import Placement
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.k8s_emulator.state import Cluster

pytestmark = pytest.mark.timeout(60)
NS = "default"


def until(cond, what: str, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g}s waiting until {what}")


def pod(name: str, *, node: str | None = None, ann: dict | None = None) -> dict:
    spec: dict = {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox", "command": ["true"]}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": ann or {}}, "spec": spec}


def job_on(name: str, node: str, run_s: float) -> dict:
    tpl = pod("x", node=node, ann={"emulator.qosflow.dev/run-seconds": str(run_s)})
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"annotations": tpl["metadata"]["annotations"]}, "spec": tpl["spec"]}}}


def test_the_defaults_are_upstreams_but_a_short_quarantine():
    c = Cluster()
    assert c.terminated_pod_gc_threshold == 12500  # kube-controller-manager's --terminated-pod-gc-threshold
    assert 0 < c.pod_gc_quarantine_s <= 40  # upstream: 40 s
    c.shutdown()


def test_the_pods_of_a_deleted_node_are_marked_failed_then_deleted_after_the_quarantine():
    quarantine = 0.5
    with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)], pod_gc_quarantine_s=quarantine) as emu:
        core, batch = client.CoreV1Api(emu.api_client()), client.BatchV1Api(emu.api_client())
        batch.create_namespaced_job(NS, job_on("on-0", "gpu-0", 60))
        batch.create_namespaced_job(NS, job_on("on-1", "gpu-1", 60))

        def both_running():
            pods = [p for p in core.list_namespaced_pod(NS).items if p.status.phase == "Running"]
            return pods if len(pods) == 2 else None

        running = until(both_running, "both pods running")
        victim = next(p.metadata.name for p in running if p.spec.node_name == "gpu-0")
        rv = core.list_namespaced_pod(NS).metadata.resource_version
        events: list[tuple[float, str, dict, client.V1Pod]] = []
        w = watch.Watch()

        def follow() -> None:
            for ev in w.stream(core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=20):
                if ev["raw_object"]["metadata"]["name"] == victim:
                    events.append((time.monotonic(), ev["type"], ev["raw_object"], ev["object"]))
                    if ev["type"] == "DELETED":
                        w.stop()

        th = threading.Thread(target=follow, daemon=True)
        th.start()
        until(lambda: emu.state()["watches"]["by_resource"].get("pods", 0) >= 1, "the pod watch is open")
        t0 = time.monotonic()
        core.delete_node("gpu-0")  # kubectl delete node gpu-0
        th.join(20)
        assert [e[1] for e in events] == ["MODIFIED", "DELETED"], [(e[1], e[2]["status"]) for e in events]
        (t_mod, _, marked, _), (_, _, deleted, model) = events
        assert t_mod - t0 >= quarantine, f"deleted {t_mod - t0:.2f}s after its node, before the quarantine"
        for obj in (marked, deleted):  # the wire format: status.phase and status.conditions[] as the API serves them
            assert obj["status"]["phase"] == "Failed"
            dis = [c for c in obj["status"]["conditions"] if c["type"] == "DisruptionTarget"]
            assert len(dis) == 1, obj["status"]["conditions"]
            assert {k: dis[0][k] for k in ("status", "reason", "message")} == {
                "status": "True", "reason": "DeletionByPodGC", "message": "PodGC: node no longer exists"}
            assert dis[0]["lastTransitionTime"].endswith("Z")
            assert "reason" not in obj["status"]  # (no pod-level reason: the condition says it)
        # the official client's model reads it as a client of a real API server does
        dis = next(c for c in model.status.conditions if c.type == "DisruptionTarget")
        assert (model.status.phase, dis.status, dis.reason) == ("Failed", "True", "DeletionByPodGC")
        assert core.list_namespaced_pod(NS, label_selector="job-name=on-0").items == []
        # its Job counts it failed (backoffLimit 0: the Job fails; no replacement pod), the other node's pod runs on
        until(lambda: any(c.type == "Failed" and c.status == "True" for c in (batch.read_namespaced_job("on-0", NS).status.conditions or [])),
              "Job on-0 failed")
        st = batch.read_namespaced_job("on-0", NS).status
        assert st.failed == 1 and not st.active, st
        time.sleep(0.2)
        assert core.list_namespaced_pod(NS, label_selector="job-name=on-0").items == []
        other = core.list_namespaced_pod(NS, label_selector="job-name=on-1").items
        assert len(other) == 1 and other[0].status.phase == "Running"
        assert emu.state()["pod_gc"] == {"orphaned": 1, "terminated": 0}


def test_a_node_back_within_its_quarantine_keeps_its_pods():
    with EmulatorServer([gpu_node("gpu-0", 2)], pod_gc_quarantine_s=1.0) as emu:
        core = client.CoreV1Api(emu.api_client())
        core.create_namespaced_pod(NS, pod("p", node="gpu-0", ann={"emulator.qosflow.dev/run-seconds": "60"}))
        until(lambda: core.read_namespaced_pod("p", NS).status.phase == "Running", "p running")
        core.delete_node("gpu-0")
        time.sleep(0.3)
        emu.add_node(name="gpu-0", gpus=2)  # (a kubelet registering its node again)
        time.sleep(1.5)
        p = core.read_namespaced_pod("p", NS)
        assert p.status.phase == "Running" and not any(c.type == "DisruptionTarget" for c in p.status.conditions or [])
        assert emu.state()["pod_gc"]["orphaned"] == 0


def test_terminated_pods_beyond_the_threshold_are_deleted_evicted_first_then_oldest():
    with EmulatorServer([gpu_node("gpu-0", 4)], terminated_pod_gc_threshold=0) as emu:  # (0: off, until set below)
        core = client.CoreV1Api(emu.api_client())
        core.create_namespaced_pod(NS, pod("z-old", ann={"emulator.qosflow.dev/run-seconds": "0.05"}))
        time.sleep(1.05)  # (creationTimestamp has a resolution of one second)
        core.create_namespaced_pod(NS, pod("a-new", ann={"emulator.qosflow.dev/run-seconds": "0.05"}))
        core.create_namespaced_pod(NS, pod("m-evicted", ann={"emulator.qosflow.dev/fail": "Evicted", "emulator.qosflow.dev/fail-after-s": "0.05"}))
        core.create_namespaced_pod(NS, pod("r-running", ann={"emulator.qosflow.dev/run-seconds": "60"}))

        def phases() -> dict[str, str]:
            return {p.metadata.name: p.status.phase for p in core.list_namespaced_pod(NS).items}

        until(lambda: phases() == {"z-old": "Succeeded", "a-new": "Succeeded", "m-evicted": "Failed", "r-running": "Running"}, "the pods ended")
        assert core.read_namespaced_pod("m-evicted", NS).status.reason == "Evicted"
        emu.cluster.terminated_pod_gc_threshold = 1  # 3 terminated pods, 1 kept
        until(lambda: set(phases()) == {"a-new", "r-running"}, "two terminated pods deleted")
        time.sleep(0.2)
        assert set(phases()) == {"a-new", "r-running"}  # the newest terminated pod kept, the running one untouched
        assert emu.state()["pod_gc"] == {"orphaned": 0, "terminated": 2}


def test_the_backend_ends_a_stage_whose_node_was_deleted_with_deletion_by_pod_gc():
    """No node watch and no heartbeat: the backend learns of the deletion from its stage's pod alone, which the pod
    garbage collector marks Failed (DisruptionTarget: DeletionByPodGC) with its container still shown running. Before,
    the emulator never deleted it (the wait went on); and the backend took a Failed pod without a terminated
    container for the stage's own error ("Error", a user error) instead of reading its DisruptionTarget."""

    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)], pod_gc_quarantine_s=0.3) as emu:
            emu.add_rule(selector="qosflow.dev/stage-id=s0", run_s=120)
            be = KubernetesBackend(api_client=emu.api_client(), watch_nodes=False)
            core = client.CoreV1Api(emu.api_client())
            try:
                cluster = await be.inventory()
                h = await be.launch(LaunchSpec("s0", ["true"], Placement("s0", ((0, 0),), ((0, 0.5),)), cluster))

                def running() -> bool:
                    pods = core.list_namespaced_pod(NS, label_selector="qosflow.dev/stage-id=s0").items
                    return bool(pods) and pods[0].status.phase == "Running" and pods[0].spec.node_name == "gpu-0"

                await asyncio.to_thread(until, running, "s0 running on gpu-0")
                waiting = asyncio.ensure_future(be.wait(h))
                await asyncio.to_thread(until, lambda: (be._waiting.get("s0") or {}).get("watch") is not None, "the wait watches its pod")
                await asyncio.to_thread(core.delete_node, "gpu-0")
                return await asyncio.wait_for(waiting, 20)
            finally:
                await be.aclose()

    st = asyncio.run(go())
    assert st.kind is ExitKind.INFRA, st
    assert st.reason.startswith("DeletionByPodGC: the node was lost and the pod garbage-collected"), st
    assert "PodGC: node no longer exists" in st.reason and "on node gpu-0" in st.reason, st


def test_the_cli_takes_the_quarantine_and_the_threshold():
    out = subprocess.run([sys.executable, "-m", "qosflow.k8s_emulator", "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--pod-gc-quarantine" in out.stdout and "--terminated-pod-gc-threshold" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "qosflow.k8s_emulator", "--pod-gc-quarantine", "-1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--pod-gc-quarantine must be at least 0" in bad.stderr

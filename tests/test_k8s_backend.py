"""The Kubernetes backend through the official client: against the API emulator by default, or a
real cluster (kind, k3s) with QOSFLOW_K8S_E2E=1 (see scripts/k8s_e2e.sh). Tests that need failure
injection (OOM, eviction, node loss, watch expiry, 500s) run on the emulator only.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qosflow.agent.testing import FirstFitPlacer
from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.kubernetes import GPU, GPU_SHARED, KubernetesBackend, job_name
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.placement import Placement
from qosflow.errors import QosflowError
from qosflow.failures import run_with_failover
from qosflow.k8s_emulator import EmulatorServer, gpu_node

E2E = os.environ.get("QOSFLOW_K8S_E2E") == "1"
pytestmark = pytest.mark.timeout(300 if E2E else 60)
emulator_only = pytest.mark.skipif(E2E, reason="needs the emulator's failure injection")


class Env:
    def __init__(self, emu: EmulatorServer | None):
        self.emu = emu
        self.namespace = os.environ.get("QOSFLOW_K8S_NAMESPACE", "qosflow-e2e") if E2E else "default"
        self.image = os.environ.get("QOSFLOW_K8S_IMAGE", "busybox:1.36")

    def backend(self, **kw) -> KubernetesBackend:
        if self.emu is not None:
            kw.setdefault("api_client", self.emu.api_client())
        kw.setdefault("unschedulable_timeout_s", 1.0 if self.emu else 20.0)
        return KubernetesBackend(namespace=self.namespace, image=self.image, **kw)

    def placement(self, cluster: ClusterSpec, job: str, node: int = -1, gpus: int = 1, cores: float = 0.1) -> Placement:
        node = node % len(cluster.nodes)  # default: the last node (kind's workers sort after its control plane)
        if cluster.nodes[node].gpus == 0:
            gpus = 0
        return Placement(job, tuple((node, g) for g in range(gpus)), ((node, cores),))


@pytest.fixture(scope="module")
def env():
    if E2E:
        yield Env(None)
        return
    with EmulatorServer([gpu_node("gpu-0", 4, gpu_mem_mb=40960), gpu_node("gpu-1", 4, gpu_mem_mb=40960)]) as emu:
        yield Env(emu)


def run(coro):
    return asyncio.run(coro)


async def until(cond, what: str, timeout: float = 60.0) -> None:
    """Wait (asynchronously) until cond() holds: a condition with a generous timeout, not a fixed sleep
    that is too short on a loaded machine and too long on an idle one."""
    end = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting until {what}")
        await asyncio.sleep(0.02)


def watching(emu: EmulatorServer) -> bool:
    """A watch stream is open on the emulator (the backend's wait has listed and watches from there)."""
    return emu.state()["watches"]["by_resource"].get("pods", 0) >= 1  # (pods': the backend also watches its nodes)


def expire_watch(emu: EmulatorServer) -> None:
    """Expire the resourceVersion of the open watch: an event after it, then compaction, then an event to
    wake the stream (whose next look finds its version compacted: 410)."""
    emu.add_node(name=f"extra-{time.monotonic_ns()}", gpus=1)
    emu.compact()
    emu.add_node(name=f"extra-{time.monotonic_ns()}", gpus=1)


def test_manifests():
    """Pure translation: GPUs, CPU requests, node affinity, sharing, labels, gangs, PodGroups."""
    cluster = ClusterSpec((NodeSpec("n0", 4, virtual=True), NodeSpec("n1", 4, virtual=True), NodeSpec("n2", 4, virtual=True)))
    be = KubernetesBackend(api_client=client.ApiClient(), image="img:1")
    spec = LaunchSpec("run-42/train a1", ["python", "t.py"], Placement("train", ((1, 0), (1, 1)), ((1, 3.5),)), cluster,
                      labels={"prefect.io/flow-run-id": "1b2c-uuid", "prefect.io/flow-run-name": "brave-fox"})
    (job,), pg = be.manifests(spec)
    assert pg is None and job["metadata"]["name"] == job_name("run-42/train a1") and len(job["metadata"]["name"]) <= 63
    pod = job["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"] == {GPU: "2"} and c["resources"]["requests"]["cpu"] == "3500m"
    assert c["image"] == "img:1" and c["command"] == ["python", "t.py"]
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0] == {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1"]}
    env = {e["name"]: e for e in c["env"]}
    assert "CUDA_VISIBLE_DEVICES" not in env and env["OMP_NUM_THREADS"]["value"] == "3"
    assert env["QOSFLOW_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod["metadata"]["labels"]["prefect.io/flow-run-id"] == "1b2c-uuid"
    assert pod["metadata"]["annotations"]["qosflow.dev/stage-id"] == "run-42/train a1"
    assert job["spec"]["backoffLimit"] == 0
    # a fractional share asks for the device plugin's shared resource and passes the MPS share on
    frac = LaunchSpec("f", ["x"], Placement("f", ((0, 2),), ((0, 1.0),), gpu_milli=250), cluster)
    (fj,), _ = be.manifests(frac)
    fc = fj["spec"]["template"]["spec"]["containers"][0]
    assert fc["resources"]["limits"] == {GPU_SHARED: "1"}
    assert {e["name"]: e.get("value") for e in fc["env"]}["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    # an even gang is one Indexed Job, one pod per node, created together
    gang = LaunchSpec("g", ["x"], Placement("g", ((0, 0), (0, 1), (2, 0), (2, 1)), ((0, 2.0), (2, 2.0))), cluster)
    (gj,), _ = be.manifests(gang)
    assert gj["spec"]["completionMode"] == "Indexed" and gj["spec"]["parallelism"] == gj["spec"]["completions"] == 2
    assert gj["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    # an uneven gang: one Job per node; with Volcano, a PodGroup for all of them
    vbe = KubernetesBackend(api_client=client.ApiClient(), gang_scheduler="volcano")
    uneven = LaunchSpec("u", ["x"], Placement("u", ((0, 0), (0, 1), (0, 2), (1, 0)), ((0, 3.0), (1, 1.0))), cluster)
    jobs, pg = vbe.manifests(uneven)
    assert len(jobs) == 2 and pg["apiVersion"] == "scheduling.volcano.sh/v1beta1" and pg["spec"]["minMember"] == 2
    for j in jobs:
        assert j["spec"]["template"]["spec"]["schedulerName"] == "volcano"
        assert j["spec"]["template"]["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == pg["metadata"]["name"]


def test_manifests_carry_no_credentials():
    """The Job a stage is submitted as had PREFECT_API_KEY (and every other setting the Prefect worker
    passes, its API auth string and database URL included) as plain `value`s: readable by anyone who
    may read Jobs. Now they are secretKeyRefs to the attempt's Secret (base64 `data`); without any,
    no Secret; with credentials_in_secret=False, plain values as before."""
    import base64

    cluster = ClusterSpec((NodeSpec("n0", 4, virtual=True), NodeSpec("n1", 4, virtual=True)))
    be = KubernetesBackend(api_client=client.ApiClient(), namespace="ml")
    env = {"PREFECT_API_KEY": "pnu_SeCrEt", "PREFECT_API_AUTH_STRING": "admin:pw-SeCrEt", "PREFECT_API_URL": "http://prefect:4200/api",
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": "postgresql+asyncpg://prefect:SeCrEt@db/prefect", "WANDB_API_KEY": "w-SeCrEt",
           "AWS_SECRET_ACCESS_KEY": "a-SeCrEt", "MY_DB": "postgresql://u:SeCrEt@h/d", "TOKENIZERS_PARALLELISM": "false", "PREFECT_API_KEY_X": ""}
    uneven = Placement("u", ((0, 0), (0, 1), (1, 0)), ((0, 2.0), (1, 1.0)))  # two Jobs: both reference the one Secret
    spec = LaunchSpec("run-7/train", ["python", "t.py"], uneven, cluster, env=env)
    jobs, _ = be.manifests(spec)
    assert len(jobs) == 2 and "SeCrEt" not in json.dumps(jobs)
    sec = be.secret_manifest(spec)
    assert sec["metadata"]["name"] == job_name("run-7/train", "-env") and sec["metadata"]["namespace"] == "ml" and sec["type"] == "Opaque"
    moved = {k for k, v in env.items() if "SeCrEt" in v}
    assert {k: base64.b64decode(v).decode() for k, v in sec["data"].items()} == {k: env[k] for k in moved}
    for j in jobs:
        c_env = {e["name"]: e for e in j["spec"]["template"]["spec"]["containers"][0]["env"]}
        for k in moved:
            assert c_env[k] == {"name": k, "valueFrom": {"secretKeyRef": {"name": sec["metadata"]["name"], "key": k}}}
        assert c_env["PREFECT_API_URL"]["value"] == "http://prefect:4200/api" and c_env["TOKENIZERS_PARALLELISM"]["value"] == "false"
        assert c_env["PREFECT_API_KEY_X"]["value"] == ""
    plain = LaunchSpec("p", ["x"], uneven, cluster, env={"PREFECT_API_URL": "http://prefect:4200/api"})
    assert be.secret_manifest(plain) is None
    off = KubernetesBackend(api_client=client.ApiClient(), credentials_in_secret=False)
    assert off.secret_manifest(spec) is None and "pnu_SeCrEt" in json.dumps(off.manifests(spec)[0])


def test_the_cluster_blocks_gpu_resource_and_credentials_setting_reach_the_backend():
    """KubernetesGPUCluster had a gpu_resource field that nothing read (the backend asked for nvidia.com/gpu
    whatever the block said), and no way to the backend's credentials_in_secret. Both now reach it: the
    block's resource name is what pods ask for (shared: name + '.shared'), tolerate, and inventory counts."""
    from types import SimpleNamespace

    from qosflow.prefect.blocks import KubernetesGPUCluster

    block = KubernetesGPUCluster(api_url="http://127.0.0.1:1", gpu_resource="example.com/gpu", credentials_in_secret=False,
                                 sharing="time-slicing")
    be = block.make_backend()
    assert be.gpu_resource == "example.com/gpu" and be.shared_resource == "example.com/gpu.shared" and not be.credentials_in_secret
    cluster = ClusterSpec((NodeSpec("n0", 4, virtual=True),))
    (job,), _ = be.manifests(LaunchSpec("w", ["x"], Placement("w", ((0, 0), (0, 1)), ((0, 2.0),)), cluster,
                                        env={"PREFECT_API_KEY": "pnu_x"}))
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"example.com/gpu": "2"}
    assert {"key": "example.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert be.secret_manifest(LaunchSpec("w", ["x"], Placement("w", ((0, 0),), ((0, 1.0),)), cluster, env={"PREFECT_API_KEY": "pnu_x"})) is None
    (fj,), _ = be.manifests(LaunchSpec("f", ["x"], Placement("f", ((0, 2),), ((0, 1.0),), gpu_milli=250), cluster))
    assert fj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"example.com/gpu.shared": "1"}
    node = SimpleNamespace(metadata=SimpleNamespace(name="n0", labels={}),
                           status=SimpleNamespace(allocatable={"example.com/gpu": "8", "cpu": "16", "memory": "64Gi"}))
    assert be._node_spec(node, {}).gpus == 8
    assert KubernetesBackend(api_client=client.ApiClient()).shared_resource == GPU_SHARED  # (NVIDIA's, as before)


def test_inventory(env):
    async def go():
        be = env.backend()
        try:
            return await be.inventory(), await be.healthy_nodes()
        finally:
            await be.aclose()

    cluster, healthy = run(go())
    assert set(healthy) <= set(cluster.node_names) and healthy
    if not E2E:
        n0 = cluster.nodes[0]
        # the nvidia.com/gpu.product label NVIDIA-A100-SXM4-40GB names the model a100, as gpu_model requests do
        assert (n0.name, n0.gpus, n0.gpu_mem_mb, n0.gpu_model, n0.virtual) == ("gpu-0", 4, 40960.0, "a100", True)


def test_stage_runs_labelled_on_its_node(env):
    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            node = len(cluster.nodes) - 1
            spec = LaunchSpec("ok-1", ["sh", "-c", "echo qosflow-stage-ran $QOSFLOW_NODE"], env.placement(cluster, "ok", node), cluster,
                              labels={"prefect.io/flow-run-id": "fr-123"})
            h = await be.launch(spec)
            st = await be.wait(h)
            lines = [ln async for ln in be.logs(h)]
            j = await asyncio.to_thread(be.batch.read_namespaced_job, h.ref["jobs"][0], env.namespace)
            pods = (await asyncio.to_thread(be.core.list_namespaced_pod, env.namespace, label_selector=h.ref["selector"])).items
            await be.kill(h)
            return cluster.nodes[node].name, st, lines, j, pods
        finally:
            await be.aclose()

    node, st, lines, j, pods = run(go())
    assert st.kind is ExitKind.OK, st
    assert j.metadata.labels["prefect.io/flow-run-id"] == "fr-123" and j.metadata.labels["app.kubernetes.io/managed-by"] == "qosflow"
    assert [p.spec.node_name for p in pods] == [node]
    assert lines and (E2E and any("qosflow-stage-ran" in ln for ln in lines) or not E2E)


def test_stopped_waits_and_late_kills_leave_no_entry_behind(env, monkeypatch):
    """The backend kept one entry per stage whose wait the worker stopped (its stop event) and one per kill
    whose wait had already ended (its kill reason, which a later wait of the same attempt reports): the
    worker's memory grew with every such stage. A stopped wait drops its event; kill reasons are bounded."""
    import dataclasses

    from qosflow.backends import kubernetes as k8s

    monkeypatch.setattr(k8s, "KILLED_KEPT", 2)

    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            h = await be.launch(LaunchSpec("long-1", ["sh", "-c", "sleep 600"], env.placement(cluster, "long"), cluster))
            waiting = asyncio.ensure_future(be.wait(h))
            await until(lambda: h.stage_id in be._stop, "the wait has started")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert h.stage_id not in be._stop
            await be.kill(h, grace=0)
            for i in range(3):  # kills whose waits ended long ago
                await be.kill(dataclasses.replace(h, stage_id=f"gone-{i}", ref={"jobs": [], "namespace": h.ref["namespace"]}))
            return dict(be._killed)
        finally:
            await be.aclose()

    assert list(run(go())) == ["gone-1", "gone-2"]


@emulator_only
def test_a_stage_whose_own_secret_is_gone_runs_again_rather_than_fail_as_the_users_error():
    """A pod whose credentials Secret (qosflow's own, one per attempt) is gone before it starts (deleted by
    hand, a namespace clean-up) waits in CreateContainerConfigError; that was reported USER, so the stage
    failed for good though nothing in the user's code or template was wrong. It is INFRA now (the stage
    runs again, its launch makes a new Secret)."""
    with EmulatorServer([gpu_node("gpu-0", 2)], start_delay_s=2.0) as emu:  # (pods start 2 s after their Job)

        async def go():
            be = KubernetesBackend(api_client=emu.api_client(), image="busybox:1.36", unschedulable_timeout_s=1.0)
            try:
                cluster = await be.inventory()
                spec = LaunchSpec("nosecret-1", ["sh", "-c", "true"], Placement("ns", ((0, 0),), ((0, 0.1),)), cluster,
                                  env={"PREFECT_API_KEY": "pnu_x"})
                h = await be.launch(spec)
                assert h.ref["secret"]
                await asyncio.to_thread(be.core.delete_namespaced_secret, h.ref["secret"], "default")
                return await asyncio.wait_for(be.wait(h), 60)
            finally:
                await be.aclose()

        st = run(go())
    assert st.kind is ExitKind.INFRA and "credentials Secret" in st.reason and "not found" in st.reason, st


def test_user_errors(env):
    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            if env.emu:
                env.emu.add_rule(selector="qosflow.dev/stage-id=exit3", exit_code=3)
            h = await be.launch(LaunchSpec("exit3", ["sh", "-c", "exit 3"], env.placement(cluster, "e"), cluster))
            st1 = await be.wait(h)
            h = await be.launch(LaunchSpec("badimg", ["true"], env.placement(cluster, "b"), cluster, image="registry.invalid/qosflow/nope:0"))
            st2 = await be.wait(h)
            jobs = (await asyncio.to_thread(be.batch.list_namespaced_job, env.namespace, label_selector="qosflow.dev/stage-id=badimg")).items
            return st1, st2, jobs
        finally:
            await be.aclose()

    st1, st2, jobs = run(go())
    assert st1.kind is ExitKind.USER and st1.code == 3 and "exited with code 3" in st1.reason
    assert st2.kind is ExitKind.USER and "ImagePullBackOff" in st2.reason and "image name" in st2.reason
    assert jobs == []  # a failed stage's Job is deleted


def test_unschedulable_is_infra(env):
    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            p = env.placement(cluster, "huge", cores=100000)
            return await be.wait(await be.launch(LaunchSpec("huge", ["true"], p, cluster)))
        finally:
            await be.aclose()

    st = run(go())
    assert st.kind is ExitKind.INFRA and st.reason.startswith("Unschedulable") and "Insufficient cpu" in st.reason


def test_cancel_deletes_the_job(env):
    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            if env.emu:
                env.emu.add_rule(selector="qosflow.dev/stage-id=long", run_s=60)
            h = await be.launch(LaunchSpec("long", ["sleep", "600"], env.placement(cluster, "long"), cluster))
            waiter = asyncio.ensure_future(be.wait(h))
            end = time.monotonic() + 120
            while time.monotonic() < end:
                pods = (await asyncio.to_thread(be.core.list_namespaced_pod, env.namespace, label_selector=h.ref["selector"])).items
                if pods and pods[0].status.phase == "Running":
                    break
                await asyncio.sleep(0.1)
            await be.kill(h, reason="user cancelled the flow run")
            st = await asyncio.wait_for(waiter, 60)
            with pytest.raises(ApiException) as e:
                await asyncio.to_thread(be.batch.read_namespaced_job, h.ref["jobs"][0], env.namespace)
            return st, e.value.status
        finally:
            await be.aclose()

    st, code = run(go())
    assert st.kind is ExitKind.CANCELLED and "user cancelled" in st.reason and code == 404


def test_a_killed_attempt_id_launched_again_runs(env):
    """kill() marked the attempt id cancelled for good (a dict that only grew, one entry per cancelled
    stage): the same id launched again -- a stage's early check or first attempt run again for the same
    flow run -- was reported CANCELLED at once without waiting for its pod. The mark now ends with the
    wait that reports it, and a new launch of the id clears an older one."""
    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            spec = LaunchSpec("again", ["true"], env.placement(cluster, "a"), cluster)
            h = await be.launch(spec)
            await be.kill(h, reason="cancelled by the user")
            st1 = await be.wait(h)
            await be.kill(h)  # (once more, after its wait: e.g. the worker's clean-up)
            h2 = await be.launch(spec)
            st2 = await asyncio.wait_for(be.wait(h2), 60)
            await be.kill(h2)
            return st1, st2
        finally:
            await be.aclose()

    st1, st2 = run(go())
    assert st1.kind is ExitKind.CANCELLED and "cancelled by the user" in st1.reason
    assert st2.kind is ExitKind.OK, st2


def test_launch_twice_adopts_the_same_attempt(env):
    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            creds = {"PREFECT_API_KEY": "pnu_twice"}  # (its Secret too is made once, and reused)
            spec = LaunchSpec("twice", ["true"], env.placement(cluster, "t"), cluster, env=creds)
            h1 = await be.launch(spec)
            h2 = await be.launch(spec)  # e.g. a worker retrying a request whose answer it lost
            st = await be.wait(h2)
            jobs = (await asyncio.to_thread(be.batch.list_namespaced_job, env.namespace, label_selector=h1.ref["selector"])).items
            other = LaunchSpec("twice", ["true"], env.placement(cluster, "t"), cluster, env=creds)
            await asyncio.to_thread(be.batch.patch_namespaced_job, h1.ref["jobs"][0], env.namespace, {"metadata": {"annotations": {"qosflow.dev/stage-id": "someone-else"}}},
                                    _content_type="application/merge-patch+json")
            with pytest.raises(QosflowError, match="belongs to another stage"):
                await be.launch(other)
            secrets = (await asyncio.to_thread(be.core.list_namespaced_secret, env.namespace, label_selector=h1.ref["selector"])).items
            await be.kill(h1)
            return st, len(jobs), be.stats["adopted_409"], secrets
        finally:
            await be.aclose()

    st, njobs, adopted, secrets = run(go())
    assert st.ok and njobs == 1 and adopted == 1
    assert secrets == []  # the refused launch took back the Secret it had made


@emulator_only
@pytest.mark.parametrize(
    "fail, kind, words",
    [
        ("OOMKilled", ExitKind.INFRA, "ran out of memory"),
        ("Evicted", ExitKind.INFRA, "evicted"),
        ("NodeLost", ExitKind.INFRA, "node was lost"),
    ],
)
def test_infra_failures_are_retried_on_another_node(fail, kind, words):
    with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client())
            try:
                cluster = await be.inventory()
                placer = FirstFitPlacer(cluster)
                emu.add_rule(fail=fail, node="gpu-0", after_s=0.1)
                return await run_with_failover(be, "train", placer.place_fn("train", ["python", "train.py"], gpus=2, prefer="gpu-0"), release=placer.release)
            finally:
                await be.aclose()

        res = asyncio.run(go())
    assert res.ok
    assert [a.nodes for a in res.attempts] == [["gpu-0"], ["gpu-1"]]
    first = res.attempts[0].status
    assert first.kind is kind and fail in first.reason and words in first.reason and "gpu-0" in first.reason


def gated(gate) -> list[str]:
    """A stage command that runs until the test creates the file `gate` (the process kubelet runs it)."""
    return ["sh", "-c", f"while [ ! -e '{gate}' ]; do sleep 0.05; done"]


@emulator_only
def test_watch_expiry_and_api_errors_are_survived(tmp_path):
    """Launch through 500s, two expired watches (410) whose relists get 500s: the stage's end is still seen.
    (The stage runs until the test is done with it, and each step waits on what it needs, no sleep.)"""
    with EmulatorServer([gpu_node("gpu-0", 2)], window=50, run_processes=True) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client(), watch_timeout_s=5)
            try:
                cluster = await be.inventory()
                emu.add_fault(r"/namespaces/default/jobs$", method="POST", status=500, count=2)
                h = await be.launch(LaunchSpec("w", gated(tmp_path / "go"), Placement("w", ((0, 0),), ((0, 1.0),)), cluster))
                waiter = asyncio.ensure_future(be.wait(h))
                await until(lambda: watching(emu), "the wait watches its pods")
                emu.add_fault(r"/namespaces/default/pods$", method="GET", status=500, count=2)  # its relists get 500s
                for i in range(2):  # expire the watch's resourceVersion under it, twice
                    expire_watch(emu)
                    await until(lambda: be.stats["watch_410"] > i and watching(emu), f"the wait relisted and watches again ({i + 1})")
                assert not waiter.done()
                (tmp_path / "go").touch()  # the stage ends
                return await asyncio.wait_for(waiter, 60), dict(be.stats)
            finally:
                await be.aclose()

        st, stats = asyncio.run(go())
    assert st.ok, st
    assert stats["api_5xx_retried"] >= 4 and stats["watch_410"] >= 2


@emulator_only
def test_watch_gone_410_relists(tmp_path):
    """A watch whose resourceVersion expired gets 410 twice (the client's own retry too): relist. (It
    waited 0.3 s for the watch to be open before compacting: on a loaded machine the wait had not
    listed yet, so no 410 came; now it waits until the emulator has the watch open.)"""
    with EmulatorServer([gpu_node("gpu-0", 2)], run_processes=True) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client(), watch_timeout_s=5)
            try:
                cluster = await be.inventory()
                h = await be.launch(LaunchSpec("g", gated(tmp_path / "go"), Placement("g", ((0, 0),), ((0, 1.0),)), cluster))
                waiter = asyncio.ensure_future(be.wait(h))
                await until(lambda: watching(emu), "the wait watches its pods")
                expire_watch(emu)
                await until(lambda: be.stats["watch_410"] >= 1, "the watch got 410")
                (tmp_path / "go").touch()  # the stage ends: its end is seen through the new list and watch
                return await asyncio.wait_for(waiter, 60), dict(be.stats)
            finally:
                await be.aclose()

        st, stats = asyncio.run(go())
    assert st.ok and stats["watch_410"] >= 1


@emulator_only
def test_volcano_gang_all_or_nothing():
    with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 1)]) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client(), gang_scheduler="volcano", unschedulable_timeout_s=0.8)
            try:
                cluster = await be.inventory()
                ok = LaunchSpec("gang-ok", ["x"], Placement("gang-ok", ((0, 0), (1, 0)), ((0, 1.0), (1, 1.0))), cluster)
                h = await be.launch(ok)
                pg = await asyncio.to_thread(be.custom.get_namespaced_custom_object, "scheduling.volcano.sh", "v1beta1", "default", "podgroups", h.ref["podgroup"]["name"])
                st_ok = await be.wait(h)
                # 2 GPUs on gpu-0 + 2 on gpu-1 (which has 1): no member may start alone
                bad = LaunchSpec("gang-bad", ["x"], Placement("gang-bad", ((0, 0), (0, 1), (1, 0), (1, 1)), ((0, 1.0), (1, 1.0))), cluster)
                h2 = await be.launch(bad)
                seen_bound = []

                async def spy():
                    while True:
                        pods = (await asyncio.to_thread(be.core.list_namespaced_pod, "default", label_selector=h2.ref["selector"])).items
                        seen_bound.extend(p.spec.node_name for p in pods if p.spec.node_name)
                        await asyncio.sleep(0.05)

                t = asyncio.ensure_future(spy())
                st_bad = await be.wait(h2)
                t.cancel()
                return pg, st_ok, st_bad, seen_bound
            finally:
                await be.aclose()

        pg, st_ok, st_bad, bound = asyncio.run(go())
    assert pg["spec"]["minMember"] == 2 and st_ok.ok
    assert st_bad.kind is ExitKind.INFRA and "Unschedulable" in st_bad.reason and "pod group" in st_bad.reason
    assert bound == []  # all or nothing: not even the member that would fit was bound


@emulator_only
@pytest.mark.parametrize("scheduler, group, version", [("volcano", "scheduling.volcano.sh", "v1beta1"), ("kai", "scheduling.run.ai", "v2alpha2")])
def test_a_gangs_podgroup_goes_with_it(tmp_path, scheduler, group, version):
    """A gang's PodGroup was deleted only by kill: every gang that succeeded left its PodGroup behind for
    good (its Job goes after ttlSecondsAfterFinished, the PodGroup had no owner), and a worker that
    adopted a running gang did not know its PodGroup, so not even a kill deleted it. Now the Job(s) own
    it, the stage's end deletes it, and adopt finds it."""
    with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)], run_processes=True) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client(), gang_scheduler=scheduler)
            pgs = lambda: asyncio.to_thread(be.custom.list_namespaced_custom_object, group, version, "default", "podgroups")  # noqa: E731
            try:
                cluster = await be.inventory()
                h = await be.launch(LaunchSpec("gang", gated(tmp_path / "go"), Placement("gang", ((0, 0), (1, 0)), ((0, 1.0), (1, 1.0))), cluster))
                job = await asyncio.to_thread(be.batch.read_namespaced_job, h.ref["jobs"][0], "default")
                [pg] = (await pgs())["items"]
                adopted = await be.adopt("gang")
                (tmp_path / "go").touch()
                st = await be.wait(h)
                left = (await pgs())["items"]
                return job, pg, adopted, st, left
            finally:
                await be.aclose()

        job, pg, adopted, st, left = asyncio.run(go())
    assert st.ok, st
    assert [(o["kind"], o["uid"]) for o in pg["metadata"]["ownerReferences"]] == [("Job", job.metadata.uid)]
    assert adopted.ref["podgroup"] == {"group": group, "version": version, "name": pg["metadata"]["name"]}
    assert left == []


def _dead_api(retries: int | None = None) -> tuple[int, "client.Configuration"]:
    """A free local port nothing listens on, and an API client configuration pointing at it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    if retries is not None:
        cfg.retries = retries
    return port, cfg


@emulator_only
def test_unreachable_api_or_bad_kubeconfig_says_where_and_what_to_fix(tmp_path):
    """A wrong api_url/port or a missing kubeconfig: the worker's set-up error was urllib3's
    'HTTPConnectionPool(...): Max retries exceeded' or kubernetes' 'Invalid kube-config file. No
    configuration found.' with no word of which cluster or which setting; now both name them."""
    port, cfg = _dead_api(retries=0)
    be = KubernetesBackend(api_client=client.ApiClient(cfg), cluster_name="k8s-a100")
    with pytest.raises(QosflowError, match=rf"cluster 'k8s-a100': cannot reach the API server at http://127.0.0.1:{port} .*api_url or kubeconfig"):
        run(be.inventory())
    with pytest.raises(QosflowError, match=rf"cluster 'k8s-a100': cannot load kubeconfig {tmp_path}/nokube: .*kubeconfig .* context, or api_url"):
        KubernetesBackend(kubeconfig=str(tmp_path / "nokube"), cluster_name="k8s-a100")


def test_every_call_to_an_unreachable_api_says_so_alike(tmp_path):
    """The unreachable API server was recognised in three places (node list, launch, wait): a stage's
    kill or adoption raised urllib3's 'Max retries exceeded', which the worker did not take for an
    outage. Every call of the backend now raises BackendUnreachable, saying what it was doing."""
    from qosflow.backends.base import BackendUnreachable, StageHandle

    port, cfg = _dead_api(retries=0)
    be = KubernetesBackend(api_client=client.ApiClient(cfg), cluster_name="k8s-a100")
    handle = StageHandle("s1", be.name, "gpu-0", {"namespace": "default", "jobs": ["qosflow-s1"], "podgroup": None})
    where = rf"cluster 'k8s-a100': cannot reach the API server at http://127.0.0.1:{port} to"
    with pytest.raises(BackendUnreachable, match=where + " list its nodes .*api_url or kubeconfig"):
        run(be.healthy_nodes())
    with pytest.raises(BackendUnreachable, match=where + " delete job "):
        run(be.kill(handle))
    with pytest.raises(BackendUnreachable, match=where + " list job "):
        run(be.adopt("s1"))


def test_unreachable_api_is_one_message_not_urllib3_retry_warnings(caplog):
    """With the client's default retries, every call to an unreachable API server logged urllib3's
    'Retrying (Retry(total=2, ...)) after connection broken by ...' three times before qosflow's error,
    again at every heartbeat. Now the error alone; the retries are in qosflow's debug log; urllib3's
    warnings outside qosflow's calls are untouched."""
    import logging
    import urllib3

    port, cfg = _dead_api()  # retries left at the client's default
    be = KubernetesBackend(api_client=client.ApiClient(cfg), cluster_name="k8s-a100")
    with caplog.at_level(logging.DEBUG):
        for _ in range(2):
            with pytest.raises(QosflowError, match=rf"cluster 'k8s-a100': cannot reach the API server at http://127.0.0.1:{port}"):
                run(be.healthy_nodes())
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    retried = [r for r in caplog.records if r.name == "qosflow.backends.kubernetes" and "urllib3: Retrying" in r.getMessage()]
    assert len(retried) >= 2 and all(r.levelno == logging.DEBUG for r in retried)
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(urllib3.exceptions.MaxRetryError):
        urllib3.PoolManager(retries=1).request("GET", f"http://127.0.0.1:{port}/")
    assert any(r.name == "urllib3.connectionpool" and "Retrying" in r.getMessage() for r in caplog.records)


class _CuttableProxy:
    """A TCP proxy to the emulator that can be cut (listener and connections closed: the API server is
    unreachable, connections are refused) and restored on the same port."""

    def __init__(self, target_port: int):
        import socket

        self.target = target_port
        self.socket_mod = socket
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.conns: list = []
        self.listener = None
        self.restore()

    def restore(self) -> None:
        import threading

        s = self.socket_mod.socket()
        s.setsockopt(self.socket_mod.SOL_SOCKET, self.socket_mod.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self.listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s) -> None:
        import threading

        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            u = self.socket_mod.create_connection(("127.0.0.1", self.target))
            self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.close()
            except OSError:
                pass

    def cut(self) -> None:
        try:
            self.listener.shutdown(self.socket_mod.SHUT_RDWR)  # wakes the accept() (close alone does not)
        except OSError:
            pass
        self.listener.close()
        for c in self.conns:
            try:
                c.shutdown(self.socket_mod.SHUT_RDWR)
                c.close()
            except OSError:
                pass
        self.conns = []


@emulator_only
def test_a_stage_is_followed_through_an_api_outage(caplog, tmp_path):
    """The API server unreachable while a stage runs (urllib3's retries run out): the pods run on, so the
    wait keeps looking, says so once, and reports the stage's real end; it used to raise at once. (The
    stage runs until the test lets it end; the outage lasts until the wait has looked through it twice,
    not a fixed 2 s.)"""
    import logging

    from kubernetes import client

    with EmulatorServer([gpu_node("gpu-0", 2)], run_processes=True) as emu:
        proxy = _CuttableProxy(emu.port)
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{proxy.port}"
        cfg.retries = 1

        async def go():
            be = KubernetesBackend(api_client=client.ApiClient(cfg), watch_timeout_s=2)
            try:
                cluster = await be.inventory()
                h = await be.launch(LaunchSpec("o", gated(tmp_path / "go"), Placement("o", ((0, 0),), ((0, 1.0),)), cluster))
                waiter = asyncio.ensure_future(be.wait(h))
                await until(lambda: watching(emu), "the wait watches its pods")
                proxy.cut()
                await until(lambda: be.stats["wait_api_unreachable"] >= 2 or waiter.done(), "the wait looked through the outage")
                assert not waiter.done(), "the wait gave up during the outage"
                (tmp_path / "go").touch()  # the stage ends during the outage: seen once the API answers
                proxy.restore()
                return await asyncio.wait_for(waiter, 60), dict(be.stats)
            finally:
                await be.aclose()

        with caplog.at_level(logging.WARNING, logger="qosflow"):
            st, stats = asyncio.run(go())
    assert st.ok, st
    assert stats["wait_api_unreachable"] >= 1
    said = [r.getMessage() for r in caplog.records if "cannot reach the API server" in r.getMessage()]
    assert len(said) == 1 and "stage o" in said[0], said
    assert any("answers again" in r.getMessage() for r in caplog.records)


@emulator_only
def test_a_pods_progress_reaches_the_worker_through_its_log(tmp_path):
    """The pod's stage writes its progress to a file in the container and echoes it, prefixed, to its
    log (at most two lines a second, a resumed run's first line and the last step always); `sync_progress`
    copies the new lines from rank 0's log -- the whole log first, then its tail -- to the file the
    worker's scheduler reads. (The emulator's kubelet runs the container command as a local process.)"""
    from progress_stage import run_resumed_stage

    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2)], run_processes=True) as emu:
            be = KubernetesBackend(namespace="default", image="python:3.11-slim", api_client=emu.api_client())
            try:
                r = await run_resumed_stage(be, tmp_path / "go", cores=0.5)
                r["log"] = [ln async for ln in be.logs(r["handle"])]
                return r
            finally:
                await be.aclose()

    r = run(go())
    assert r["status"].kind is ExitKind.OK, r["status"]
    assert r["mid"]["step"] == 60 and r["resumed"] == 40  # (step 60, held back by the throttle, goes out when its interval ends)
    assert r["last"]["step"] == 100 and r["last"]["total"] == 100  # the last step is always echoed
    steps = [json.loads(x)["step"] for x in r["lines"]]
    assert steps == sorted(steps) and len(steps) == len(set(steps)) and len(steps) < 60  # throttled, never twice
    assert "training starts" in r["log"] and "done" in r["log"]


def test_a_long_api_outage_is_logged_every_5_minutes_and_its_end_with_its_duration():
    """An outage was logged once, when it began: an hour of it then showed nothing. Now a reminder (how
    long so far, how many stages wait) at most every OUTAGE_REMINDER_S (5 min) of the heartbeats that see
    it, and its end with its duration. (The worker's clock is set by hand; no server is needed.)"""
    from types import SimpleNamespace

    from qosflow.prefect import worker as wmod

    w = wmod.QosflowWorker(work_pool_name="outage-log", name="outage-log")
    said: list[tuple[str, str]] = []
    w._logger = SimpleNamespace(**{lvl: (lambda m, *a, lvl=lvl: said.append((lvl, m % a))) for lvl in ("warning", "info", "debug")})
    w.scheduler = SimpleNamespace(queued=lambda: ["a", "b", "c"], cluster=SimpleNamespace(nodes=[]), wake=lambda: None)
    clock = [1000.0]
    w._clock = lambda: clock[0]
    why = "cannot reach the Kubernetes API server at https://k8s:6443"
    for t in range(0, 1321, 2):  # heartbeats every 2 s for 22 min
        clock[0] = 1000.0 + t
        w._enter_outage(why)
    assert len(said) == 5, said  # the start, then at 5, 10, 15 and 20 min
    assert said[0][1].startswith(why + ": no stage is launched")
    assert said[1] == ("warning", f"the backend's API still does not answer after 5 min 0 s ({why}): 3 stage(s) wait "
                                  "in the QoS queue; none is launched until it answers"), said[1]
    assert "after 20 min 0 s" in said[4][1]
    w._end_outage()
    assert said[-1][0] == "info" and "answers again after an outage of 22 min 0 s" in said[-1][1], said[-1]
    assert "(3 waiting)" in said[-1][1] and w.outage is None
    clock[0] += 10.0
    w._enter_outage(why)  # a new outage: logged at once, its reminders counted from it
    clock[0] += 299.0
    w._enter_outage(why)
    assert len(said) == 7 and said[-1][1].startswith(why), said[-2:]
    assert wmod._span(42.4) == "42 s" and wmod._span(7265) == "2 h 01 min"


def test_a_cluster_that_does_not_share_gpus_gives_shared_stages_whole_gpus():
    """A Kubernetes block's default sharing is 'none': every pod asks for whole nvidia.com/gpu devices.
    The worker still let the policy put a fractional or shareable stage on a GPU another stage held,
    so the pod got a device of its own the policy counted as free (or did not fit)."""
    from types import SimpleNamespace

    from qosflow.core.qos import QoSSpec
    from qosflow.prefect.worker import _whole_gpus_only

    none, shared = SimpleNamespace(shares_gpus=False), SimpleNamespace(shares_gpus=True)
    frac = QoSSpec(gpus=1, gpu_milli=250)
    pair = QoSSpec(gpus=2, shareable=True)
    cpu = QoSSpec(gpus=0)
    spec, why = _whole_gpus_only(frac, none)
    assert (spec.gpu_milli, spec.fractional, spec.shareable) == (1000, False, False) and "250/1000 of a GPU" in why
    spec, why = _whole_gpus_only(pair, none)
    assert spec.gpus == 2 and not spec.shareable and "sharing is 'none'" in why
    assert _whole_gpus_only(cpu, none) == (cpu, "")
    assert _whole_gpus_only(frac, shared) == (frac, "") and _whole_gpus_only(pair, shared) == (pair, "")
    assert _whole_gpus_only(frac, object()) == (frac, "")  # backends that share (local, agents)
    assert not KubernetesBackend(api_client=client.ApiClient(), gpu_sharing="none").shares_gpus
    assert KubernetesBackend(api_client=client.ApiClient(), gpu_sharing="mps").shares_gpus


def _secret_env():
    import uuid

    key = "pnu_" + uuid.uuid4().hex
    return key, {"PREFECT_API_KEY": key, "PREFECT_API_AUTH_STRING": f"admin:{key}", "HF_TOKEN": f"hf_{key}",
                 "QOSFLOW_DATABASE_URL": f"postgresql://qf:{key}@db:5432/qf"}


@pytest.fixture
def proc_env():
    """The emulator with its process kubelet (a pod's command runs with the pod's environment), or the real cluster."""
    if E2E:
        yield Env(None)
        return
    with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)], run_processes=True) as emu:
        yield Env(emu)


def test_credentials_reach_the_stage_through_a_secret_not_the_job(proc_env):
    """PREFECT_API_KEY (and the other credentials a Prefect worker passes: the API's auth string, the
    database URL with its password, tokens by name) was a plain `value` in the Job's container env, so
    anyone who may read Jobs (kubectl get job -o yaml) read the key. Now each stage attempt's credentials
    are in a Secret of its own, referenced by secretKeyRef and owned by the Job; the stage still gets
    them (its command checks its environment and exits 0 only if it has them all), and the Secret is
    deleted when the stage ends, however it ends: none is left after the stages."""
    env = proc_env
    key, creds = _secret_env()
    # (the check must not carry the key itself: it compares with the key's two halves, joined)
    halves = {"PLAIN": "plain", "KA": key[:12], "KB": key[12:]}
    check = " && ".join(f'test "${k}" = "{v.replace(key, "${KA}${KB}")}"' for k, v in creds.items()) + ' && test "$PLAIN" = plain'
    managed = "app.kubernetes.io/managed-by=qosflow"

    async def go():
        be = env.backend()
        try:
            cluster = await be.inventory()
            secrets = lambda: asyncio.to_thread(be.core.list_namespaced_secret, env.namespace, label_selector=managed)  # noqa: E731
            h = await be.launch(LaunchSpec("cred-ok", ["sh", "-c", f"sleep 1; {check}"], env.placement(cluster, "c"), cluster,
                                           env={**creds, **halves}))
            job = await asyncio.to_thread(be.batch.read_namespaced_job, h.ref["jobs"][0], env.namespace)
            sec = await asyncio.to_thread(be.core.read_namespaced_secret, h.ref["secret"], env.namespace)
            st = await be.wait(h)
            left_ok = (await secrets()).items
            # a failed stage and a cancelled one leave none either
            h_fail = await be.launch(LaunchSpec("cred-fail", ["sh", "-c", "exit 3"], env.placement(cluster, "f"), cluster, env=creds))
            st_fail = await be.wait(h_fail)
            h_kill = await be.launch(LaunchSpec("cred-kill", ["sleep", "600"], env.placement(cluster, "k"), cluster, env=creds))
            waiter = asyncio.ensure_future(be.wait(h_kill))
            end = time.monotonic() + 60
            while time.monotonic() < end:
                pods = (await asyncio.to_thread(be.core.list_namespaced_pod, env.namespace, label_selector=h_kill.ref["selector"])).items
                if pods and pods[0].status.phase == "Running":
                    break
                await asyncio.sleep(0.1)
            adopted = await be.adopt("cred-kill")  # (a restarted worker finds the attempt's Secret too)
            await be.kill(h_kill, reason="cancelled")
            st_kill = await asyncio.wait_for(waiter, 60)
            left = (await secrets()).items
            # no credential, no Secret
            h_plain = await be.launch(LaunchSpec("cred-none", ["sh", "-c", "test -z \"$PREFECT_API_KEY\""], env.placement(cluster, "n"), cluster,
                                                 env={"PLAIN": "plain"}))
            none_made = (await secrets()).items
            st_plain = await be.wait(h_plain)
            for hh in (h, h_plain):
                await be.kill(hh)
            return job, sec, st, left_ok, st_fail, adopted, st_kill, left, h_plain, none_made, st_plain
        finally:
            await be.aclose()

    job, sec, st, left_ok, st_fail, adopted, st_kill, left, h_plain, none_made, st_plain = run(go())
    manifest = json.dumps(client.ApiClient().sanitize_for_serialization(job))
    assert key not in manifest  # not the key, nor the auth string, token or database URL that contain it
    c_env = {e.name: e for e in job.spec.template.spec.containers[0].env}
    for name in creds:
        ref = c_env[name].value_from.secret_key_ref
        assert c_env[name].value is None and ref.name == sec.metadata.name and ref.key == name
    assert c_env["PLAIN"].value == "plain"
    import base64

    assert {k: base64.b64decode(v).decode() for k, v in sec.data.items()} == creds
    assert [(o.kind, o.name, o.uid) for o in sec.metadata.owner_references] == [("Job", job.metadata.name, job.metadata.uid)]
    assert st.kind is ExitKind.OK, st  # the stage's check of its environment passed
    assert st_fail.kind is ExitKind.USER and st_fail.code == 3 and st_kill.kind is ExitKind.CANCELLED
    assert adopted is not None and adopted.ref["secret"] == f"{job_name('cred-kill')}-env"
    assert left_ok == [] and left == []
    assert h_plain.ref["secret"] is None and none_made == [] and st_plain.kind is ExitKind.OK, st_plain


@emulator_only
def test_an_account_that_may_not_create_secrets_is_told_so():
    """The stage's Secret is created before its Job: refused (403), the launch fails saying which Secret
    and what the worker's account needs, and no Job is created (its pods would wait for the Secret)."""
    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client())
            try:
                cluster = await be.inventory()
                emu.add_fault(r"/namespaces/default/secrets$", method="POST", status=403)
                h = await be.launch(LaunchSpec("nosec", ["true"], Placement("n", ((0, 0),), ((0, 1.0),)), cluster, env={"PREFECT_API_KEY": "pnu_x"}))
                st = await be.wait(h)
                jobs = (await asyncio.to_thread(be.batch.list_namespaced_job, "default")).items
                return st, jobs
            finally:
                await be.aclose()

        st, jobs = asyncio.run(go())
    assert st.kind is ExitKind.INFRA and "403 Forbidden" in st.reason and "create Secret qf-nosec-" in st.reason
    assert "get, list, create, patch and delete on secrets" in st.reason and jobs == []


@emulator_only
def test_a_refused_pod_list_is_said_once(caplog):
    """The API refusing the wait's pod list (403 after an RBAC change, 401 for an expired token) logged
    'listing pods of S: Forbidden' every 0.5 s for as long as it lasted; now once (naming the cluster and
    the status), with the retries spaced out, and once more when the list works again."""
    import logging

    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client(), cluster_name="k8s-a")
            try:
                cluster = await be.inventory()
                emu.add_rule(selector="qosflow.dev/stage-id=r", run_s=0.3)
                h = await be.launch(LaunchSpec("r", ["x"], Placement("r", ((0, 0),), ((0, 1.0),)), cluster))
                emu.add_fault(r"/namespaces/default/pods$", method="GET", status=403, count=3)
                return await asyncio.wait_for(be.wait(h), 60)
            finally:
                await be.aclose()

        with caplog.at_level(logging.WARNING, logger="qosflow"):
            st = asyncio.run(go())
    assert st.ok, st
    said = [r.getMessage() for r in caplog.records if r.name == "qosflow.backends.kubernetes"]
    assert len([m for m in said if "403 Forbidden" in m]) == 1, said
    assert "cluster 'k8s-a'" in said[0] and "stage r" in said[0] and any("listed again (after 3 refusal(s))" in m for m in said), said


@emulator_only
def test_orphaned_stage_secrets_are_deleted_and_no_one_elses():
    """A stage attempt's Secret (its credentials: the Prefect API key) is created before its Job, which
    then owns it. A launch whose Job creation failed and whose clean-up failed too, or a worker that died
    in between, left a Secret owned by nothing, kept for ever (the garbage collector deletes only what
    has owners). `sweep_orphan_secrets` deletes qosflow's own unowned stage Secrets older than the grace
    period, in its namespace only; one whose Job exists gets the Job as its owner; a Secret it did not
    create is never touched, whatever its name or labels."""
    from qosflow.backends.kubernetes import ANN_STAGE, LABEL_STAGE, label_value, secret_name

    creds = {"PREFECT_API_KEY": "pnu_orphan"}
    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client(), api_retries=0)
            ml = KubernetesBackend(api_client=emu.api_client(), namespace="ml")
            core = be.core
            try:
                cluster = await be.inventory()
                await be._sweep_task  # (the start's sweep: nothing to do yet)

                def spec(stage: str) -> LaunchSpec:
                    return LaunchSpec(stage, ["sleep", "60"], Placement(stage, ((0, 0),), ((0, 0.1),)), cluster, env=creds)

                # 1. the Job's creation fails, then the clean-up's delete of the Secret too
                emu.add_fault(r"/namespaces/default/jobs$", method="POST", status=500, count=1)
                emu.add_fault(r"/namespaces/default/secrets/", method="DELETE", status=500, count=1)
                with pytest.raises(ApiException):
                    await be.launch(spec("failed-1"))
                # 2. a worker that died after the Secret (what a launch does first), 3. after the Job too
                await be._put_secret(be.secret_manifest(spec("died-1")), "died-1", "test")
                await be._put_secret(be.secret_manifest(spec("died-2")), "died-2", "test")
                (job2,), _ = be.manifests(spec("died-2"))
                job2 = await asyncio.to_thread(be.batch.create_namespaced_job, "default", job2)
                # 4. a stage launched as usual (its Secret is its Job's)
                h = await be.launch(spec("normal-1"))
                # 5. another namespace's orphan (another pool's worker): not this backend's
                await ml._put_secret(ml.secret_manifest(spec("other-ns")), "other-ns", "test")
                # 6. Secrets of the users': qosflow's name for a stage, no labels; qosflow's labels, another
                # name; qosflow's labels and annotation, not qosflow's name for that stage; qosflow's name and labels
                # but owned by something of theirs
                mine = {"metadata": {"name": secret_name("user-stage")}, "stringData": {"K": "v"}}
                labels = {"app.kubernetes.io/managed-by": "qosflow", LABEL_STAGE: label_value("user-2")}
                copied = {"metadata": {"name": "qf-user-2-env", "labels": labels}, "stringData": {"K": "v"}}
                named = {"metadata": {"name": "user-3-creds", "labels": labels, "annotations": {ANN_STAGE: "user-2"}}, "stringData": {"K": "v"}}
                owned = be.secret_manifest(spec("user-4"))
                owned["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": job2.metadata.uid}]
                for body in (mine, copied, named, owned):
                    await asyncio.to_thread(core.create_namespaced_secret, "default", body)

                names = lambda: {s.metadata.name for s in core.list_namespaced_secret("default").items}  # noqa: E731
                before = await asyncio.to_thread(names)
                fresh = await be.sweep_orphan_secrets()  # all younger than the grace period: none is an orphan yet
                later = await be.sweep_orphan_secrets(now=time.time() + 3600)
                after = await asyncio.to_thread(names)
                s2 = await asyncio.to_thread(core.read_namespaced_secret, secret_name("died-2"), "default")
                in_ml = [s.metadata.name for s in core.list_namespaced_secret("ml").items]
                await be.kill(h)
                return before, fresh, later, after, s2, job2, in_ml
            finally:
                await be.aclose()
                await ml.aclose()

        before, fresh, later, after, s2, job2, in_ml = asyncio.run(go())
    orphans = {secret_name("failed-1"), secret_name("died-1")}
    assert orphans <= before and fresh == []
    assert sorted(later) == sorted(orphans)
    assert after == before - orphans
    assert {secret_name("died-2"), secret_name("normal-1"), secret_name("user-stage"), "qf-user-2-env", "user-3-creds",
            secret_name("user-4")} <= after
    assert [(o.kind, o.uid) for o in s2.metadata.owner_references] == [("Job", job2.metadata.uid)]  # its Job owns it now
    assert in_ml == [secret_name("other-ns")]


@emulator_only
def test_the_worker_start_and_its_heartbeats_sweep_orphaned_secrets(caplog):
    """The sweep runs at `inventory()` (the worker's start: what a worker that died left) and then every
    `orphan_sweep_s` at `healthy_nodes()` (the heartbeat), in the background; a refused list is said once."""
    import logging

    from qosflow.backends.kubernetes import secret_name

    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        async def go():
            dead = KubernetesBackend(api_client=emu.api_client())
            cluster = await dead.inventory()
            spec = lambda s: LaunchSpec(s, ["true"], Placement(s, ((0, 0),), ((0, 0.1),)), cluster, env={"HF_TOKEN": "hf_x"})  # noqa: E731
            await dead._put_secret(dead.secret_manifest(spec("dead-1")), "dead-1", "test")
            await dead.aclose()
            be = KubernetesBackend(api_client=emu.api_client(), orphan_secret_grace_s=0, orphan_sweep_s=0)
            names = lambda: {s.metadata.name for s in be.core.list_namespaced_secret("default").items}  # noqa: E731
            try:
                await be.inventory()
                await be._sweep_task
                at_start = await asyncio.to_thread(names)
                await be._put_secret(be.secret_manifest(spec("dead-2")), "dead-2", "test")
                emu.add_fault(r"/namespaces/default/secrets$", method="GET", status=403, count=2)
                for _ in range(3):  # refused twice (said once), then it works
                    await be.healthy_nodes()
                    await be._sweep_task
                at_beat = await asyncio.to_thread(names)
                return at_start, at_beat, dict(be.stats)
            finally:
                await be.aclose()

        with caplog.at_level(logging.WARNING, logger="qosflow.backends.kubernetes"):
            at_start, at_beat, stats = asyncio.run(go())
    assert secret_name("dead-1") not in at_start and secret_name("dead-2") not in at_beat
    assert stats["orphan_secrets_deleted"] == 2
    refused = [r.getMessage() for r in caplog.records if "could not look for orphaned stage Secrets" in r.getMessage()]
    # (the hint names what the sweep does: list, patch and delete secrets, list jobs; it read "get on jobs", never asked)
    assert len(refused) == 1 and "list, patch and delete on secrets and list on jobs in namespace default" in refused[0], refused
    assert "get on jobs" not in refused[0] and "worker-rbac.yaml" in refused[0], refused


@emulator_only
def test_a_secret_reused_while_the_sweep_looks_at_it_is_not_deleted():
    """The sweep deletes a Secret on condition that it is as it read it (uid and resourceVersion
    preconditions): the same attempt launched again meanwhile (its launch re-writes the Secret, then makes
    the new Job its owner) keeps its Secret. Here the re-write comes between the sweep's list and its delete."""
    from qosflow.backends.kubernetes import secret_name

    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client())
            try:
                cluster = await be.inventory()
                await be._sweep_task
                spec = LaunchSpec("again-1", ["true"], Placement("a", ((0, 0),), ((0, 0.1),)), cluster, env={"PREFECT_API_KEY": "pnu_a"})
                await be._put_secret(be.secret_manifest(spec), "again-1", "test")
                list_jobs = be.batch.list_namespaced_job

                def reused_meanwhile(*a, **kw):  # (the sweep looks for the stage's Job after it read the Secret)
                    be.core.patch_namespaced_secret(secret_name("again-1"), "default", {"data": {"PREFECT_API_KEY": "cG51X2I="}})
                    return list_jobs(*a, **kw)

                be.batch.list_namespaced_job = reused_meanwhile
                dropped = await be.sweep_orphan_secrets(now=time.time() + 3600)
                be.batch.list_namespaced_job = list_jobs
                left = [s.metadata.name for s in be.core.list_namespaced_secret("default").items]
                return dropped, left
            finally:
                await be.aclose()

        dropped, left = asyncio.run(go())
    assert dropped == [] and left == [secret_name("again-1")]


@emulator_only
def test_a_pipeline_job_is_killed_with_sigterm_and_adopted_by_label(tmp_path):
    """`launch_unplaced` (a pipeline run on a Kubernetes pool): one Job with no GPU, no node affinity, a small CPU/memory
    request and its credentials in a Secret; another backend (a new worker) adopts it from its labels, and `kill` deletes
    it so that its pod's process gets SIGTERM (a pipeline then cancels the stage runs it waited for), not an immediate
    SIGKILL: the emulator's kubelet SIGKILLed a deleted pod's process at once, whatever its grace period."""
    term = tmp_path / "term"
    script = f"trap 'echo term > {term}; exit 0' TERM; touch {tmp_path / 'up'}; while true; do sleep 0.1; done"
    with EmulatorServer([gpu_node("gpu-0", 2)], run_processes=True) as emu:
        async def go():
            be = KubernetesBackend(api_client=emu.api_client())
            other = KubernetesBackend(api_client=emu.api_client())
            try:
                await be.inventory()
                h = await be.launch_unplaced("pipe-1", ["sh", "-c", script], {"PREFECT_API_KEY": "pnu_x", "A": "1"}, labels={"prefect.io/flow-run-id": "pipe-1"})
                job = await asyncio.to_thread(be.batch.read_namespaced_job, h.ref["jobs"][0], "default")
                await until(lambda: (tmp_path / "up").exists(), "the pipeline's process runs")
                waiter = asyncio.ensure_future(be.wait(h))
                await until(lambda: watching(emu), "the wait watches its pod")
                adopted = await other.adopt("pipe-1", [])
                await other.kill(adopted, "flow run cancelled")
                st = await asyncio.wait_for(waiter, 30)
                await until(lambda: term.exists(), "the process got SIGTERM", 10)
                return job, adopted, st
            finally:
                await be.aclose()
                await other.aclose()

        job, adopted, st = asyncio.run(go())
    ctr = job.spec.template.spec.containers[0]
    assert ctr.resources.requests == {"cpu": "250m", "memory": "512Mi"} and not ctr.resources.limits
    assert job.spec.template.spec.affinity is None and job.metadata.labels["qosflow.dev/role"] == "pipeline"
    assert [e.value_from.secret_key_ref.key for e in ctr.env if e.name == "PREFECT_API_KEY"] == ["PREFECT_API_KEY"]
    assert adopted is not None and adopted.ref["role"] == "pipeline" and adopted.ref["jobs"] == [job.metadata.name]
    assert st.kind is not ExitKind.OK and term.read_text().strip() == "term"

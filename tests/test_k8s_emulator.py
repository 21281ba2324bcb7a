"""The Kubernetes API emulator, driven through the official `kubernetes` client.

These tests check the emulator itself (it is what the backend tests run against): real REST paths
and JSON, watch streams with resourceVersion and 410 Gone, 409 conflicts, injected 500s, and the
pod phases/reasons it produces for injected failures.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from qosflow.k8s_emulator import EmulatorServer, gpu_node

pytestmark = pytest.mark.timeout(60)
NS = "default"


@pytest.fixture(scope="module")
def emu():
    with EmulatorServer([gpu_node("gpu-0", 4), gpu_node("gpu-1", 2, replicas=4)], window=200) as e:
        yield e


@pytest.fixture
def api(emu):
    c = emu.api_client()
    yield client.CoreV1Api(c), client.BatchV1Api(c)
    c.close()


def job(name: str, *, gpus: int = 1, node: str | None = None, parallelism: int = 1, labels=None, ann=None) -> dict:
    spec = {
        "restartPolicy": "Never",
        "containers": [{"name": "c", "image": "busybox", "command": ["true"], "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
    }
    if node:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"backoffLimit": 0, "parallelism": parallelism, "completions": parallelism,
                 "template": {"metadata": {"labels": labels or {}, "annotations": ann or {}}, "spec": spec}},
    }


def wait_pods(core, selector: str, pred, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pods = core.list_namespaced_pod(NS, label_selector=selector).items
        if pods and all(pred(p) for p in pods):
            return pods
        time.sleep(0.05)
    raise AssertionError(f"pods {selector} never reached the wanted state: {[p.status for p in pods]}")


def test_nodes_pods_crud(api, emu):
    core, _ = api
    nodes = {n.metadata.name: n for n in core.list_node().items}
    assert nodes["gpu-0"].status.allocatable["nvidia.com/gpu"] == "4"
    assert nodes["gpu-1"].status.allocatable["nvidia.com/gpu.shared"] == "8"
    assert nodes["gpu-1"].metadata.labels["nvidia.com/gpu.replicas"] == "4"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p1", "labels": {"app": "x"}},
           "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}
    created = core.create_namespaced_pod(NS, pod)
    assert created.metadata.uid and created.metadata.resource_version
    assert core.read_namespaced_pod("p1", NS).metadata.labels == {"app": "x"}
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector="app=x").items] == ["p1"]
    assert core.list_namespaced_pod(NS, label_selector="app!=x,app").items == []
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("nope", NS)
    assert e.value.status == 404 and json.loads(e.value.body)["reason"] == "NotFound"
    core.delete_namespaced_pod("p1", NS)
    with pytest.raises(ApiException):
        core.read_namespaced_pod("p1", NS)


def test_conflicts_are_409(api):
    core, batch = api
    batch.create_namespaced_job(NS, job("dup"))
    with pytest.raises(ApiException) as e:
        batch.create_namespaced_job(NS, job("dup"))
    body = json.loads(e.value.body)
    assert e.value.status == 409 and body["reason"] == "AlreadyExists" and body["message"] == 'jobs.batch "dup" already exists'
    batch.delete_namespaced_job("dup", NS, propagation_policy="Background")
    # optimistic concurrency: a write with a stale resourceVersion is a Conflict
    cur = core.read_node("gpu-0")
    stale = cur.metadata.resource_version
    cur.metadata.labels["team"] = "a"
    assert core.replace_node("gpu-0", cur).metadata.labels["team"] == "a"
    cur.metadata.resource_version = stale
    cur.metadata.labels["team"] = "b"
    with pytest.raises(ApiException) as e:
        core.replace_node("gpu-0", cur)
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "Conflict"
    assert core.read_node("gpu-0").metadata.labels["team"] == "a"


def test_watch_streams_and_expires_with_410(api, emu):
    core, batch = api
    rv = core.list_namespaced_pod(NS, label_selector="job-name=w1").metadata.resource_version
    batch.create_namespaced_job(NS, job("w1"))
    seen = []
    w = watch.Watch()
    for ev in w.stream(core.list_namespaced_pod, NS, label_selector="job-name=w1", resource_version=rv, timeout_seconds=10):
        seen.append((ev["type"], ev["object"].status.phase, int(ev["object"].metadata.resource_version)))
        if ev["object"].status.phase == "Succeeded":
            w.stop()
    assert seen[0][0] == "ADDED" and seen[-1][1] == "Succeeded"
    assert [s[2] for s in seen] == sorted(s[2] for s in seen)
    # the raw stream is chunked JSON lines, and an expired version gets an ERROR event with 410
    emu.compact()
    with httpx.stream("GET", f"{emu.url}/api/v1/namespaces/{NS}/pods", params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": 2}) as r:
        assert r.headers.get("transfer-encoding") == "chunked"
        first = json.loads(next(r.iter_lines()))
    assert first["type"] == "ERROR" and first["object"]["code"] == 410 and first["object"]["reason"] == "Expired"
    with pytest.raises(ApiException) as e:  # the official client retries once, then raises 410
        for _ in watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=2):
            pass
    assert e.value.status == 410
    batch.delete_namespaced_job("w1", NS, propagation_policy="Background")


def test_injected_500(api, emu):
    core, _ = api
    emu.add_fault(r"^/api/v1/nodes$", method="GET", status=500, count=1)
    with pytest.raises(ApiException) as e:
        core.list_node()
    assert e.value.status == 500 and json.loads(e.value.body)["reason"] == "InternalError"
    assert len(core.list_node().items) == 2


@pytest.mark.parametrize(
    "fail, check",
    [
        ("OOMKilled", lambda p: p.status.phase == "Failed" and p.status.container_statuses[0].state.terminated.reason == "OOMKilled"
         and p.status.container_statuses[0].state.terminated.exit_code == 137),
        ("Evicted", lambda p: p.status.phase == "Failed" and p.status.reason == "Evicted" and "low on resource" in p.status.message),
        ("ImagePullBackOff", lambda p: p.status.phase == "Pending" and p.status.container_statuses[0].state.waiting.reason == "ImagePullBackOff"),
        ("Unschedulable", lambda p: p.status.phase == "Pending" and any(c.reason == "Unschedulable" for c in p.status.conditions)),
    ],
)
def test_injected_pod_failures(api, emu, fail, check):
    core, batch = api
    name = f"f-{fail.lower()}"
    emu.add_rule(fail=fail, selector=f"job-name={name}")
    batch.create_namespaced_job(NS, job(name))
    wait_pods(core, f"job-name={name}", check)
    batch.delete_namespaced_job(name, NS, propagation_policy="Background")


def test_node_lost_fails_its_pods_and_job(emu, api):
    core, batch = api
    with EmulatorServer([gpu_node("a", 1), gpu_node("b", 1)]) as e2:
        c = e2.api_client()
        core2, batch2 = client.CoreV1Api(c), client.BatchV1Api(c)
        batch2.create_namespaced_job(NS, job("long", node="a", ann={"emulator.qosflow.dev/run-seconds": "30"}))
        wait_pods(core2, "job-name=long", lambda p: p.status.phase == "Running")
        e2.lose_node("a")
        pods = wait_pods(core2, "job-name=long", lambda p: p.status.phase == "Failed")
        assert pods[0].status.reason == "NodeLost"
        assert any(cd.type == "DisruptionTarget" for cd in pods[0].status.conditions)
        node = core2.read_node("a")
        assert [cd.status for cd in node.status.conditions if cd.type == "Ready"] == ["Unknown"]
        end = time.monotonic() + 30
        while not batch2.read_namespaced_job("long", NS).status.conditions and time.monotonic() < end:
            time.sleep(0.05)
        assert batch2.read_namespaced_job("long", NS).status.conditions[0].reason == "BackoffLimitExceeded"
        c.close()


def test_job_delete_propagation(api):
    core, batch = api
    for name, policy in (("bg", "Background"), ("orph", None)):
        batch.create_namespaced_job(NS, job(name, ann={"emulator.qosflow.dev/run-seconds": "30"}))
        wait_pods(core, f"job-name={name}", lambda p: p.status.phase == "Running")
        if policy:
            batch.delete_namespaced_job(name, NS, propagation_policy=policy)
        else:
            batch.delete_namespaced_job(name, NS)
    assert core.list_namespaced_pod(NS, label_selector="job-name=bg").items == []
    orphans = core.list_namespaced_pod(NS, label_selector="job-name=orph").items
    assert len(orphans) == 1 and not orphans[0].metadata.owner_references  # the API's default orphans
    core.delete_namespaced_pod(orphans[0].metadata.name, NS)


def test_resources_and_affinity_are_honoured(api):
    core, batch = api
    batch.create_namespaced_job(NS, job("big", gpus=3, node="gpu-1"))  # gpu-1 offers only the shared resource
    pods = wait_pods(core, "job-name=big", lambda p: any(c.reason == "Unschedulable" for c in (p.status.conditions or [])))
    msg = next(c.message for c in pods[0].status.conditions if c.type == "PodScheduled")
    assert msg.startswith("0/2 nodes are available:") and "Insufficient nvidia.com/gpu" in msg
    batch.delete_namespaced_job("big", NS, propagation_policy="Background")


def test_standalone_emulator_mistakes_are_messages():
    """`python -m qosflow.k8s_emulator` on a port in use was an OSError traceback, and --nodes -1 ran
    an emulator without nodes; both are now usage errors saying what to change."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, says in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"), (["--nodes", "-1"], "--nodes must be at least 1")):
            r = subprocess.run([sys.executable, "-m", "qosflow.k8s_emulator", *args], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_pod_log_tail_lines(api, emu):
    """GET .../log?tailLines=N gives the last N lines, as the API server does; a value that is not an
    integer is a 400 naming the parameter."""
    core, batch = api
    batch.create_namespaced_job(NS, job("logs-1", labels={"t": "logs"}))
    [pod] = wait_pods(core, "t=logs", lambda p: p.status.phase in ("Running", "Succeeded"))
    name = pod.metadata.name
    whole = core.read_namespaced_pod_log(name, NS)
    lines = whole.splitlines(keepends=True)
    assert len(lines) >= 2
    assert core.read_namespaced_pod_log(name, NS, tail_lines=1) == lines[-1]
    assert core.read_namespaced_pod_log(name, NS, tail_lines=len(lines) + 5) == whole
    r = httpx.get(f"{emu.url}/api/v1/namespaces/{NS}/pods/{name}/log", params={"tailLines": "many"})
    assert r.status_code == 400 and "tailLines" in r.json()["message"]


def test_standalone_emulator_says_that_run_processes_answers_anyone():
    """The emulator has no authentication; with --run-processes any user of the machine who could connect
    ran commands as the user who started it (POST a Job: its command ran), and neither --help nor the
    banner said so."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "qosflow.k8s_emulator", "--help"], capture_output=True, text=True, timeout=60)
    assert "no authentication" in " ".join(r.stdout.split())
    import queue
    import threading

    p = subprocess.Popen([sys.executable, "-m", "qosflow.k8s_emulator", "--port", "0", "--nodes", "1", "--run-processes"],
                         stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in p.stdout], daemon=True).start()
    try:
        banner = lines.get(timeout=30)  # printed once it listens; the warning is flushed right after it
        warning = lines.get(timeout=30)  # (no fixed wait: the line as soon as it comes, a failure if it never does)
    finally:
        p.terminate()
        p.wait(10)
    assert "Kubernetes API emulator" in banner and "no authentication" in warning and "run commands as you" in warning


def test_secrets_wire_format_and_secret_key_refs(api, emu):
    """core/v1 Secrets as the API serves them: `data` is base64 (a value that is not: 400), `stringData`
    is merged into it on write and never read back, keys must be config keys (422), `type` defaults to
    Opaque. A pod whose env names a Secret (or a key) that does not exist does not start: it stays
    Pending, its container waiting with CreateContainerConfigError and the kubelet's message, and
    starts once the Secret exists (the kubelet retries); with the process kubelet, the process gets the
    decoded values. (The emulator had no Secrets: 404 for /api/v1/namespaces/NS/secrets.)"""
    import base64

    core, batch = api
    s = core.create_namespaced_secret(NS, {"metadata": {"name": "wire"}, "data": {"A": base64.b64encode(b"a-value").decode()},
                                           "stringData": {"B": "b-value"}})
    assert s.type == "Opaque" and s.string_data is None
    assert {k: base64.b64decode(v) for k, v in core.read_namespaced_secret("wire", NS).data.items()} == {"A": b"a-value", "B": b"b-value"}
    raw = httpx.get(f"{emu.url}/api/v1/namespaces/{NS}/secrets/wire").json()
    assert "stringData" not in raw and raw["data"]["B"] == base64.b64encode(b"b-value").decode() and "status" not in raw
    for body, code in (({"data": {"A": "not base64!"}}, 400), ({"stringData": {"bad key": "x"}}, 422)):
        with pytest.raises(ApiException) as e:
            core.create_namespaced_secret(NS, {"metadata": {"name": "bad"}, **body})
        assert e.value.status == code
    core.patch_namespaced_secret("wire", NS, {"stringData": {"A": "new"}}, _content_type="application/merge-patch+json")
    assert base64.b64decode(core.read_namespaced_secret("wire", NS).data["A"]) == b"new"

    ref = lambda name, key: {"valueFrom": {"secretKeyRef": {"name": name, "key": key}}}  # noqa: E731
    for jname, env, says in (("nosecret", [{"name": "X", **ref("absent", "A")}], 'secret "absent" not found'),
                             ("nokey", [{"name": "X", **ref("wire", "C")}], f"couldn't find key C in Secret {NS}/wire")):
        j = job(jname, labels={"t": jname})
        j["spec"]["template"]["spec"]["containers"][0]["env"] = env
        batch.create_namespaced_job(NS, j)
        [pod] = wait_pods(core, f"t={jname}", lambda p: p.status.container_statuses
                          and p.status.container_statuses[0].state.waiting is not None
                          and p.status.container_statuses[0].state.waiting.reason == "CreateContainerConfigError")
        assert pod.status.phase == "Pending" and pod.status.container_statuses[0].state.waiting.message == says
    core.create_namespaced_secret(NS, {"metadata": {"name": "absent"}, "stringData": {"A": "late"}})  # created late: the pod starts
    wait_pods(core, "t=nosecret", lambda p: p.status.phase in ("Running", "Succeeded"))
    assert core.list_namespaced_pod(NS, label_selector="t=nokey").items[0].status.phase == "Pending"
    for name in ("nosecret", "nokey"):
        batch.delete_namespaced_job(name, NS, propagation_policy="Background")
    for name in ("wire", "absent"):
        core.delete_namespaced_secret(name, NS)


def test_process_kubelet_resolves_secret_refs(tmp_path):
    """With the process kubelet, the process's environment has the Secret's decoded values (env
    secretKeyRef, and envFrom with its prefix)."""
    out = tmp_path / "env.txt"
    with EmulatorServer([gpu_node("gpu-0", 1)], run_processes=True) as e:
        c = e.api_client()
        core, batch = client.CoreV1Api(c), client.BatchV1Api(c)
        core.create_namespaced_secret(NS, {"metadata": {"name": "creds"}, "stringData": {"KEY": "k-1", "OTHER": "o-2"}})
        j = job("proc", labels={"t": "proc"})
        ctr = j["spec"]["template"]["spec"]["containers"][0]
        ctr["command"] = ["sh", "-c", f'echo "$MY_KEY $S_OTHER" > {out}']
        ctr["env"] = [{"name": "MY_KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "KEY"}}}]
        ctr["envFrom"] = [{"secretRef": {"name": "creds"}, "prefix": "S_"}]
        batch.create_namespaced_job(NS, j)
        wait_pods(core, "t=proc", lambda p: p.status.phase == "Succeeded", timeout=30)
        c.close()
    assert out.read_text().split() == ["k-1", "o-2"]


def test_garbage_collector_deletes_what_a_deleted_job_owned(api):
    """A Secret whose ownerReferences name a Job goes when the Job is deleted (any propagation but
    Orphan, which removes the Job from its owners and keeps it), as Kubernetes' garbage collector does."""
    core, batch = api
    for name, policy in (("gc-bg", "Background"), ("gc-orph", None)):
        j = batch.create_namespaced_job(NS, job(name, ann={"emulator.qosflow.dev/run-seconds": "30"}))
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": j.metadata.uid}
        core.create_namespaced_secret(NS, {"metadata": {"name": name, "ownerReferences": [owner]}, "stringData": {"K": "v"}})
        if policy:
            batch.delete_namespaced_job(name, NS, propagation_policy=policy)
        else:
            batch.delete_namespaced_job(name, NS)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(s.metadata.name == "gc-bg" for s in core.list_namespaced_secret(NS).items):
        time.sleep(0.05)
    names = {s.metadata.name for s in core.list_namespaced_secret(NS).items}
    assert "gc-bg" not in names and "gc-orph" in names
    assert not core.read_namespaced_secret("gc-orph", NS).metadata.owner_references
    core.delete_namespaced_secret("gc-orph", NS)
    for p in core.list_namespaced_pod(NS, label_selector="job-name=gc-orph").items:
        core.delete_namespaced_pod(p.metadata.name, NS)


def test_patch_content_types_are_honoured(api, emu):
    """The emulator applied every PATCH as a merge patch, whatever its Content-Type. The API server
    refuses a strategic merge patch of a custom resource (415) and a JSON patch that is not a list (400);
    the emulator now does too. Merge patches, and strategic merge patches of built-in kinds (applied as
    merge patches), go through, as the official client sends them."""
    core, batch = api
    custom = client.CustomObjectsApi(emu.api_client())
    pg = {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": {"name": "pg-patch"}, "spec": {"minMember": 2}}
    custom.create_namespaced_custom_object("scheduling.volcano.sh", "v1beta1", NS, "podgroups", pg)
    body = {"metadata": {"labels": {"k": "v"}}}
    url = f"{emu.url}/apis/scheduling.volcano.sh/v1beta1/namespaces/{NS}/podgroups/pg-patch"
    assert httpx.patch(url, json=body, headers={"content-type": "application/strategic-merge-patch+json"}).status_code == 415
    custom.patch_namespaced_custom_object("scheduling.volcano.sh", "v1beta1", NS, "podgroups", "pg-patch", body)  # (a merge patch)
    got = custom.get_namespaced_custom_object("scheduling.volcano.sh", "v1beta1", NS, "podgroups", "pg-patch")
    assert got["metadata"]["labels"]["k"] == "v" and got["spec"]["minMember"] == 2
    custom.delete_namespaced_custom_object("scheduling.volcano.sh", "v1beta1", NS, "podgroups", "pg-patch")
    batch.create_namespaced_job(NS, job("patchy", ann={"emulator.qosflow.dev/run-seconds": "30"}))
    r = httpx.patch(f"{emu.url}/apis/batch/v1/namespaces/{NS}/jobs/patchy", json=body, headers={"content-type": "application/json-patch+json"})
    assert r.status_code == 400 and "jsonpatch.Patch" in r.json()["message"]
    batch.patch_namespaced_job("patchy", NS, body)  # (the client sends a dict as a strategic merge patch)
    assert batch.read_namespaced_job("patchy", NS).metadata.labels["k"] == "v"
    batch.delete_namespaced_job("patchy", NS, propagation_policy="Background")


def test_process_kubelet_ends_what_a_container_left_running(tmp_path):
    """A container's main process exited leaving a background child (`sleep 600 &`): the pod was
    Succeeded and the sleep ran on, and deleting the pod did not stop it either (its stop found the main
    process gone). A container's processes end with its main one, as when a real container's pid 1 exits."""
    from procs import alive

    out = tmp_path / "pid"
    with EmulatorServer([gpu_node("gpu-0", 1)], run_processes=True) as e:
        c = e.api_client()
        core, batch = client.CoreV1Api(c), client.BatchV1Api(c)
        j = job("leaves", labels={"t": "leaves"})
        j["spec"]["template"]["spec"]["containers"][0]["command"] = ["sh", "-c", f"sleep 600 & echo $! > {out}"]
        batch.create_namespaced_job(NS, j)
        wait_pods(core, "t=leaves", lambda p: p.status.phase == "Succeeded", timeout=30)
        left = int(out.read_text())
        try:
            end = time.monotonic() + 5
            while alive(left) and time.monotonic() < end:
                time.sleep(0.05)
            assert not alive(left)
        finally:
            if alive(left):
                import os
                import signal

                os.kill(left, signal.SIGKILL)
        batch.delete_namespaced_job("leaves", NS, propagation_policy="Background")
        c.close()


def test_delete_preconditions_and_an_immutable_creation_timestamp(api):
    """DeleteOptions' preconditions (uid, resourceVersion) were ignored: a delete meant for the object as
    read deleted it after it changed (or a new one of the same name). The API server answers 409 Conflict
    ('Precondition failed'); so does the emulator. An update's or patch's creationTimestamp was taken as
    given; the API server keeps its own (and refuses a changed uid)."""
    core, _ = api
    s = core.create_namespaced_secret(NS, {"metadata": {"name": "pre"}, "stringData": {"K": "v"}})
    md = s.metadata
    for pre in ({"uid": "00000000-0000-0000-0000-000000000000"}, {"resourceVersion": "1"}):
        with pytest.raises(ApiException) as ei:
            core.delete_namespaced_secret("pre", NS, body={"preconditions": pre})
        assert ei.value.status == 409 and "Precondition failed" in json.loads(ei.value.body)["message"]
    patched = core.patch_namespaced_secret("pre", NS, {"metadata": {"creationTimestamp": "2001-01-01T00:00:00Z", "labels": {"a": "b"}}})
    assert patched.metadata.creation_timestamp == md.creation_timestamp and patched.metadata.labels == {"a": "b"}
    with pytest.raises(ApiException) as ei:
        core.replace_namespaced_secret("pre", NS, {"metadata": {"name": "pre", "uid": "11111111-1111-1111-1111-111111111111"}})
    assert ei.value.status == 422 and "immutable" in ei.value.body
    with pytest.raises(ApiException) as ei:  # (its resourceVersion changed with the patch)
        core.delete_namespaced_secret("pre", NS, body={"preconditions": {"uid": md.uid, "resourceVersion": md.resource_version}})
    assert ei.value.status == 409
    core.delete_namespaced_secret("pre", NS, body={"preconditions": {"uid": md.uid, "resourceVersion": patched.metadata.resource_version}})
    assert "pre" not in {x.metadata.name for x in core.list_namespaced_secret(NS).items}


def test_label_selectors_are_parsed_as_the_api_server_parses_them(api, emu):
    """The emulator took any string as a selector (`app==x==y`, `app in (x`, `a b` all listed something
    or nothing, silently); a real API server answers a malformed one with 400 BadRequest, and code that
    builds selectors must see that here too. Valid forms keep their meaning, including `in`/`notin`,
    `!key` and the integer comparisons `>`/`<`."""
    core, _ = api
    for name, labels in (("sel-a", {"app": "x", "tier": "1"}), ("sel-b", {"app": "y", "tier": "5"}), ("sel-c", {"other": "z"})):
        core.create_namespaced_pod(NS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                                        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}})
    try:
        def names(sel):
            return sorted(p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=sel).items if p.metadata.name.startswith("sel-"))
        assert names("app in (x, y)") == ["sel-a", "sel-b"]
        assert names("app notin (x),app") == ["sel-b"]
        assert names("!app") == ["sel-c"]
        assert names("app==y") == ["sel-b"]
        assert names("tier>2") == ["sel-b"] and names("tier<2") == ["sel-a"]
        assert names("app=x, tier=1") == ["sel-a"]
        for bad in ("app==x==y", "app in (x", "a b", "app=x y", "tier>z", "-bad-=x", "app=", "app in x", "=x", "app,,tier"):
            if bad == "app=":  # an empty value is valid: no pod has app=""
                assert names(bad) == []
                continue
            with pytest.raises(ApiException) as e:
                core.list_namespaced_pod(NS, label_selector=bad)
            assert e.value.status == 400, bad
            body = json.loads(e.value.body)
            assert body["reason"] == "BadRequest" and "unable to parse requirement" in body["message"], (bad, body)
        with pytest.raises(ApiException) as e:  # a watch is refused before its stream starts
            core.list_namespaced_pod(NS, label_selector="app in (x", watch=True, timeout_seconds=1, _preload_content=False)
        assert e.value.status == 400
    finally:
        for name in ("sel-a", "sel-b", "sel-c"):
            core.delete_namespaced_pod(name, NS)


def test_a_node_watch_gets_bookmarks_and_outlives_other_resources_churn():
    """As the API server: an established watch is not broken because changes to other resources rolled the event
    window past its own last event; with allowWatchBookmarks it gets BOOKMARK events (kind and resourceVersion only)
    carrying the version it has reached, from which a new watch resumes without a 410 and without a LIST."""
    with EmulatorServer([gpu_node("gpu-0", 4)], window=20) as emu:
        emu.cluster.store.bookmark_s = 0.2
        core = client.CoreV1Api(emu.api_client())
        rv = core.list_node().metadata.resource_version
        seen, marks = [], []
        w = watch.Watch()
        for ev in w.stream(core.list_node, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=30):
            if ev["type"] == "BOOKMARK":
                marks.append(ev["raw_object"])
                if len(marks) == 1:  # the watch is established: more than the window (20) of changes, none a node's
                    for i in range(30):
                        core.create_namespaced_config_map(NS, {"metadata": {"name": f"churn-{i}"}, "data": {"i": str(i)}})
                if len(marks) == 2:
                    core.patch_node("gpu-0", {"metadata": {"labels": {"churned": "yes"}}})
                if len(marks) == 3:
                    w.stop()
            else:
                seen.append((ev["type"], ev["object"].metadata.name))
        assert seen == [("MODIFIED", "gpu-0")], seen  # no 410: the stream lived through the churn
        assert marks[0]["kind"] == "Node" and set(marks[0]) == {"kind", "apiVersion", "metadata"}
        assert int(marks[1]["metadata"]["resourceVersion"]) >= int(rv) + 30  # past the other resources' changes
        assert emu.state()["compacted_rv"] > int(rv)  # (which rolled the window past the watch's start)
        with pytest.raises(ApiException) as e:  # (a new watch from there is too old: 410, as the API server says)
            list(watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=1))
        assert e.value.status == 410
        # from the bookmark's version: nothing missed, nothing expired
        assert list(watch.Watch().stream(core.list_node, resource_version=marks[-1]["metadata"]["resourceVersion"], timeout_seconds=1)) == []
        # a watch that did not ask for bookmarks gets none
        assert list(watch.Watch().stream(core.list_node, resource_version=marks[-1]["metadata"]["resourceVersion"], timeout_seconds=1)) == []


def test_traffic_is_counted_per_verb_and_resource(api, emu):
    """GET /emulator/state counts the API's requests and response bytes (LIST nodes, WATCH nodes, GET nodes...)."""
    core, _ = api
    before = emu.state()["traffic"]
    n = len(httpx.get(f"{emu.url}/api/v1/nodes").content)
    core.read_node("gpu-0")
    after = emu.state()["traffic"]

    def delta(key: str, what: str) -> int:
        return after.get(key, {}).get(what, 0) - before.get(key, {}).get(what, 0)

    assert delta("LIST nodes", "requests") == 1 and delta("LIST nodes", "bytes") == n
    assert delta("GET nodes", "requests") == 1 and delta("GET nodes", "bytes") > 0


def test_the_scheduler_reserves_init_containers_sidecars_and_overhead_as_kube_scheduler_does():
    """A pod's reservation is the larger of its containers' sum (sidecars added) and its largest init container (with
    the sidecars started before it), plus its overhead: here a 500m sidecar, then a 3-cpu init container, 1 cpu of
    containers and 250m of overhead hold 3.75 of the node's 4 cpu for the pod's life. The emulator counted the
    containers only (1 cpu), so pods were bound beside it where kube-scheduler leaves them Pending."""

    def pod(name: str, cpu: str, **spec) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "reserve", "pod": name}},
                "spec": {"restartPolicy": "Never", **spec,
                         "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": cpu}}}]}}

    def settled(p) -> bool:
        return p.status.phase == "Running" or any(cd.reason == "Unschedulable" for cd in (p.status.conditions or []))

    with EmulatorServer([gpu_node("small", 0, cpu="4")]) as e:
        e.add_rule(selector="app=reserve", run_s=60)
        c = e.api_client()
        core = client.CoreV1Api(c)
        try:
            core.create_namespaced_pod(NS, pod("init-heavy", "1", overhead={"cpu": "250m"}, initContainers=[
                {"name": "proxy", "image": "busybox", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m"}}},
                {"name": "fetch", "image": "busybox", "resources": {"requests": {"cpu": "3"}}}]))
            wait_pods(core, "pod=init-heavy", lambda p: p.status.phase == "Running")
            for name, cpu, runs in (("two", "2", False), ("half", "500m", False), ("quarter", "250m", True)):
                core.create_namespaced_pod(NS, pod(name, cpu))
                (p,) = wait_pods(core, f"pod={name}", settled)
                if runs:  # (3.75 + 0.25 <= 4)
                    assert p.status.phase == "Running" and p.spec.node_name == "small", (name, p.status)
                else:  # (3.75 + 0.5 > 4: the sidecar counts beside the init container)
                    assert p.status.phase == "Pending" and not p.spec.node_name, (name, p.status)
                    msg = next(cd.message for cd in p.status.conditions if cd.type == "PodScheduled")
                    assert "Insufficient cpu" in msg, msg
        finally:
            c.close()


def test_env_expansion_reads_on_after_a_reference_never_closed():
    """The kubelet (Kubernetes' expansion.Expand) keeps a `$(` that is never closed and reads on after it: a later `$$`
    is still one `$`. The emulator's kubelet kept the rest of the value as written."""
    from qosflow.k8s_emulator.state import expand_env

    assert expand_env("$(A$$", {"A": "a"}) == "$(A$"
    assert expand_env("x$(N)y$$(N)$", {"N": "n0"}) == "xn0y$(N)$"
    assert expand_env("$(NONE) $x $", {}) == "$(NONE) $x $"


def test_process_kubelet_expands_references_in_command_and_args(tmp_path):
    """A kubelet expands `$(VAR)` in a container's command and args from its variables (any of them, not only those
    defined before: ExpandContainerCommandAndArgs), `$$` is a `$`; the emulator's ran them as written."""
    out = tmp_path / "argv.txt"
    with EmulatorServer([gpu_node("gpu-0", 1)], run_processes=True) as e:
        c = e.api_client()
        core, batch = client.CoreV1Api(c), client.BatchV1Api(c)
        j = job("argv", labels={"t": "argv"})
        ctr = j["spec"]["template"]["spec"]["containers"][0]
        ctr["command"] = ["python", "-c", "import sys; open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))"]
        ctr["args"] = [str(out), "$(WHERE)", "$$(WHERE)", "$(NONE)", "$(LATER)"]
        ctr["env"] = [{"name": "WHERE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}, {"name": "LATER", "value": "l"}]
        batch.create_namespaced_job(NS, j)
        wait_pods(core, "t=argv", lambda p: p.status.phase in ("Succeeded", "Failed"), timeout=30)
        c.close()
    assert out.read_text().split() == ["gpu-0", "$(WHERE)", "$(NONE)", "l"]

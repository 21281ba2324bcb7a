"""The worker's RBAC (deploy/kubernetes/worker-rbac.yaml) against what the backend really asks of the API.

The backend runs its features (inventory and node watch, stages with credentials in a Secret, a launch answered 409,
adoption, logs, kill, a pipeline run as a Job, the orphan-Secret sweep, a wait that reads its node, foreign pods,
Volcano and KAI PodGroups, capacity placeholders made, adopted and deleted) on qosflow's API emulator (EMULATED: no
cluster) as the manifest's ServiceAccount (a bearer token), with the manifest's RBAC in force after the README's
namespace substitution. The emulator records every request in RBAC's terms; the tests check that each was allowed,
that each verb the manifest grants was used (at the scope its binding grants it), that removing any of them refuses a
request, and that a refusal reaches the stage's and the worker's error naming the verb, resource and namespace and
the manifest to apply.
"""

from __future__ import annotations

import asyncio
import copy
import re
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from k8s_lab import until
from qosflow.backends.base import CapacityWant, ExitKind, LaunchSpec
from qosflow.backends.kubernetes import KubernetesBackend, secret_name
from qosflow.core.placement import Placement
from qosflow.errors import QosflowError
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.k8s_emulator.rbac import Authorizer, RequestAttributes, rule_allows, service_account_user
from qosflow.store.leases import holder_id

pytestmark = pytest.mark.timeout(120)
RBAC = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "worker-rbac.yaml"
NS = "ml"  # (the stages' namespace, put in as deploy/kubernetes/README.md says)
WORKER = service_account_user(NS, "qosflow-worker")
KEY = {"PREFECT_API_KEY": "pnu_rbac-test-not-a-key"}


def manifests() -> list[dict]:
    """worker-rbac.yaml with the stages' namespace put in, as the README's `sed 's/qosflow-stages/NS/g'` does."""
    return [d for d in yaml.safe_load_all(RBAC.read_text().replace("qosflow-stages", NS)) if d]


def attrs(r: dict) -> RequestAttributes:
    return RequestAttributes(r["verb"], r["group"], r["resource"], r["subresource"], r["namespace"], "")


def asked(emu: EmulatorServer, verb: str, resource: str, namespace: str) -> bool:
    return any(r["verb"] == verb and r["resource"] == resource and r["namespace"] == namespace for r in emu.requests(WORKER))


def spec(name: str, cluster, nodes=((0, 0),), cores=((0, 0.5),), env=KEY) -> LaunchSpec:
    return LaunchSpec(name, ["true"], Placement(name, tuple(nodes), tuple(cores)), cluster, env=dict(env))


def backend(emu: EmulatorServer, **kw) -> KubernetesBackend:
    return KubernetesBackend(namespace=NS, image="busybox:1.36", api_client=emu.api_client(user=WORKER), cluster_name="rbac",
                             unschedulable_timeout_s=5.0, **kw)


async def stages(emu: EmulatorServer) -> None:
    """Inventory, node watch, foreign pods, a stage with credentials (launched twice: 409s), adopted, waited for, its
    log read; a stage killed; a pipeline run as a Job; the orphan-Secret sweep (one deleted, one given its Job)."""
    be = backend(emu, orphan_secret_grace_s=3600)
    try:
        cluster = await be.inventory()
        await until(lambda: asked(emu, "watch", "nodes", ""), "the node watch open")
        await be.foreign_pod_usage()
        await until(lambda: asked(emu, "watch", "pods", ""), "the pod informer's watch open")
        emu.add_rule(selector="qosflow.dev/stage-id=s1", run_s=0.3)
        h = await be.launch(spec("s1", cluster))
        await be.launch(spec("s1", cluster))  # (the same attempt again: its Secret and Job answer 409 and are read)
        assert be.stats["adopted_409"] == 1 and await be.adopt("s1") is not None
        st = await be.wait(h)
        assert st.ok, st
        _ = [line async for line in be.logs(h)]
        assert any(r["subresource"] == "log" for r in emu.requests(WORKER))
        emu.add_rule(selector="qosflow.dev/stage-id=s2", run_s=60)
        await be.kill(await be.launch(spec("s2", cluster)))
        run = await be.launch_unplaced("run-1", ["true"], dict(KEY))
        await be.kill(run)
        dead = backend(emu)  # (a worker that died after making a stage's Secret, before or after its Job)
        await dead._put_secret(dead.secret_manifest(spec("dead-1", cluster)), "dead-1", "test")
        await dead._put_secret(dead.secret_manifest(spec("half", cluster)), "half", "test")
        (job,), _ = dead.manifests(spec("half", cluster))
        await dead._create_job(job, "half", "test", "stage")
        await dead.aclose()
        swept = await be.sweep_orphan_secrets(grace_s=0)
        assert swept == [secret_name("dead-1")] and be.stats["orphan_secrets_owned"] == 1, (swept, be.stats)
    finally:
        await be.aclose()
    listing = backend(emu, watch_nodes=False)  # (no node view: a wait reads its pod's node)
    try:
        cluster = await listing.inventory()
        emu.add_rule(selector="qosflow.dev/stage-id=s3", run_s=1.0)
        h = await listing.launch(spec("s3", cluster, env={}))
        admin = client.CoreV1Api(emu.api_client())
        await until(lambda: [p.status.phase for p in admin.list_namespaced_pod(NS, label_selector="qosflow.dev/stage-id=s3").items] == ["Running"],
                    "stage s3's pod running (its wait's first look then finds it on its node)")
        st = await listing.wait(h)
        assert st.ok and asked(emu, "get", "nodes", ""), st
    finally:
        await listing.aclose()


async def gangs(emu: EmulatorServer) -> None:
    for scheduler in ("volcano", "kai"):
        be = backend(emu, gang_scheduler=scheduler)
        try:
            cluster = await be.inventory()
            h = await be.launch(spec(f"gang-{scheduler}", cluster, nodes=((0, 0), (1, 0)), cores=((0, 1.0), (1, 1.0)), env={}))
            assert h.ref["podgroup"] and not h.ref["launch_error"], h.ref
            await be.kill(h)
        finally:
            await be.aclose()


async def placeholders(emu: EmulatorServer) -> None:
    """Worker A asks for capacity and dies; B takes its stage over, adopts A's placeholder, then deletes it."""
    want = CapacityWant("s9", "train", gpus=1, cpu_cores=1)
    a_id, b_id, pool = holder_id("wa"), holder_id("wb"), "gpu@x"
    # (the class the placeholders name, made by the cluster's administrator: the worker never reads it, the API server's
    # Priority admission resolves it, and refuses a pod naming one that does not exist)
    await asyncio.to_thread(client.SchedulingV1Api(emu.api_client()).create_priority_class,
                            {"metadata": {"name": "qosflow-capacity"}, "value": -10, "preemptionPolicy": "Never"})
    a = backend(emu, request_capacity=True, capacity_priority_class="qosflow-capacity")  # (priorityClassName: no rule)
    b = backend(emu, request_capacity=True, capacity_priority_class="qosflow-capacity", capacity_peer_check_s=0)
    try:
        a.capacity_peers(a_id, pool, None)
        await a.sync_capacity_requests([want])
        assert a.stats["capacity_requested"] == 1, a.stats
        admin = client.CoreV1Api(emu.api_client())
        await until(lambda: [p.status.phase for p in admin.list_namespaced_pod(NS, label_selector="qosflow.dev/capacity-for=s9").items]
                    == ["Running"], "A's placeholder running (bound: no change under B's adoption, whose PATCH is conditional)")
        b.capacity_peers(b_id, pool, lambda p: {b_id})  # (A has no live presence: dead, its placeholder left)
        await b.sync_capacity_requests([want])
        await b.sync_capacity_requests([])
        assert b.stats["capacity_adopted"] == 1 and b.stats["capacity_dropped"] == 1 and b._capacity == {}, b.stats
    finally:
        await b.aclose()
        await a.aclose()


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    """The worker's requests in every scenario, with the manifest's RBAC in force."""
    with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
        emu.set_rbac(manifests())

        async def go():
            await stages(emu)
            await gangs(emu)
            await placeholders(emu)

        try:
            asyncio.run(go())
        except AssertionError as e:  # (a scenario broken by a refusal: say which)
            refused = [r for r in emu.requests(WORKER) if not r["allowed"]]
            raise AssertionError(f"{e}; requests that {RBAC.name} refused: {refused}") from e
        return emu.requests(WORKER)


def granted() -> list[tuple[str, int, str, str, str, str]]:
    """(role kind, rule index, verb, group, resource, namespace its binding grants it in: "" the cluster scope) of
    every verb the manifest grants."""
    out = []
    for d in manifests():
        if d["kind"] in ("Role", "ClusterRole"):
            ns = d["metadata"].get("namespace", "") if d["kind"] == "Role" else ""
            for i, r in enumerate(d["rules"]):
                out += [(f"{d['kind']} {d['metadata']['name']}", i, v, g, res, ns) for v in r["verbs"] for g in r["apiGroups"] for res in r["resources"]]
    return out


def without(*removed: tuple[str, str, str, str]) -> list[dict]:
    """The manifests less some verbs: each (role kind and name, API group, resource, verb) taken out of the rule of that
    role that grants it (the rule gone when it was its only verb)."""
    docs = copy.deepcopy(manifests())
    for role, group, resource, verb in removed:
        (d,) = [d for d in docs if f"{d['kind']} {d['metadata']['name']}" == role]
        for rule in d["rules"]:
            if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
                rule["verbs"] = [v for v in rule["verbs"] if v != verb]
        d["rules"] = [r for r in d["rules"] if r["verbs"]]
    return docs


def test_every_request_of_the_worker_is_allowed_by_the_manifest_and_every_verb_it_grants_is_used(recorded):
    assert recorded, "no request of the worker's account was recorded"
    refused = [r for r in recorded if not r["allowed"]]
    assert refused == [], refused
    rbac = Authorizer(manifests())  # (the manifest read here too, not only by the emulator)
    assert all(rbac.allows(WORKER, attrs(r)) for r in recorded)
    assert not any(r["resource"] == "priorityclasses" for r in recorded)  # (a placeholder's priorityClassName needs no rule)
    unused = [g for g in granted()
              if not any(rule_allows({"verbs": [g[2]], "apiGroups": [g[3]], "resources": [g[4]]}, attrs(r)) and r["namespace"] == g[5]
                         for r in recorded)]
    assert unused == [], f"granted, never asked for at that scope (a rule too many, or a scenario missing): {unused}"


def test_removing_any_granted_verb_refuses_a_request_the_worker_makes(recorded):
    """The check fails when the manifest lacks a rule: each verb removed in turn (from every rule that grants it: list
    and watch on pods are the Role's in the namespace and, optionally, the ClusterRole qosflow-worker-pods') refuses at
    least one request."""
    grants = granted()
    for role, i, verb, group, resource, ns in grants:
        rbac = Authorizer(without(*{(r2, g2, res2, v2) for r2, _, v2, g2, res2, _ in grants if (v2, g2, res2) == (verb, group, resource)}))
        refused = [r for r in recorded if not rbac.allows(WORKER, attrs(r))]
        assert refused, f"{role} rule {i} without {verb!r}: nothing refused"
        if role == "Role qosflow-worker" and resource == "jobs" and verb == "create":
            assert {(r["verb"], r["group"], r["resource"], r["namespace"]) for r in refused} == {("create", "batch", "jobs", NS)}
        if role == "ClusterRole qosflow-worker-nodes" and verb == "list":
            assert {(r["verb"], r["resource"], r["namespace"]) for r in refused} == {("list", "nodes", "")}


def test_a_refused_request_names_its_verb_resource_and_namespace_and_the_manifest(caplog):
    """Through the real client and HTTP: the emulator refuses by the manifest less one rule. A stage whose Secret may not
    be created fails saying so; a worker whose account may not list nodes does not start, saying so; one that may not
    watch nodes, or list pods in all namespaces, says once which rule it lacks (it LISTs, or books its namespace's pods)."""
    import logging

    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        async def go():
            emu.set_rbac(without(("Role qosflow-worker", "", "secrets", "create"), ("ClusterRole qosflow-worker-pods", "", "pods", "list"),
                                 ("ClusterRole qosflow-worker-nodes", "", "nodes", "watch")))
            be = backend(emu)
            try:
                cluster = await be.inventory()
                await be.foreign_pod_usage()
                await until(lambda: any("node watch broke" in r.getMessage() for r in caplog.records), "the refused node watch said")
                st = await be.wait(await be.launch(spec("s1", cluster)))
            finally:
                await be.aclose()
            emu.set_rbac(without(("ClusterRole qosflow-worker-nodes", "", "nodes", "list")))
            with pytest.raises(QosflowError) as refused:
                await backend(emu).inventory()
            return st, str(refused.value)

        with caplog.at_level(logging.WARNING, logger="qosflow.backends.kubernetes"):
            st, start = asyncio.run(go())
        jobs = [r for r in emu.requests(WORKER) if r["resource"] == "jobs" and r["verb"] == "create"]  # (none: its pods would wait)
    assert st.kind is ExitKind.INFRA and jobs == [], (st, jobs)
    assert re.search(rf"403 Forbidden to: create Secret qf-s1-\S+ .*: the account {WORKER} may not create secrets in namespace {NS}: "
                     r"apply deploy/kubernetes/worker-rbac\.yaml", st.reason), st.reason
    assert re.search(rf"cluster 'rbac': the API server at http://127\.0\.0\.1:\d+ answered 403 Forbidden to listing nodes; the account "
                     rf"{WORKER} may not list nodes at the cluster scope: apply deploy/kubernetes/worker-rbac\.yaml", start), start
    said = [r.getMessage() for r in caplog.records if "node watch broke" in r.getMessage()]
    assert len(said) == 1 and f"the account {WORKER} may not watch nodes at the cluster scope: apply deploy/kubernetes/worker-rbac.yaml" in said[0], said
    said = [r.getMessage() for r in caplog.records if "may not list pods in all namespaces" in r.getMessage()]
    assert len(said) == 1 and "qosflow-worker-pods of deploy/kubernetes/worker-rbac.yaml" in said[0], said


def test_the_deployment_runs_the_documented_worker_command_as_the_manifest_s_account():
    from typer.testing import CliRunner

    from qosflow.cli.main import app

    deploy = [d for d in yaml.safe_load_all((RBAC.parent / "worker-deployment.yaml").read_text().replace("qosflow-stages", NS)) if d]
    (dep,) = [d for d in deploy if d["kind"] == "Deployment"]
    (sa,) = [d for d in manifests() if d["kind"] == "ServiceAccount"]
    pod = dep["spec"]["template"]["spec"]
    assert dep["metadata"]["namespace"] == sa["metadata"]["namespace"] == NS
    assert service_account_user(NS, pod["serviceAccountName"]) == WORKER
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["PREFECT_API_URL"]["valueFrom"]["configMapKeyRef"]["name"] in {d["metadata"]["name"] for d in deploy if d["kind"] == "ConfigMap"}
    assert c["command"][:3] == ["qosflow", "worker", "start"]
    help_text = CliRunner().invoke(app, ["worker", "start", "--help"], terminal_width=200).output
    assert all(opt in help_text for opt in c["command"][3:] if opt.startswith("--")), help_text

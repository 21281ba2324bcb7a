"""The qosflow worker reads its cluster block again while it runs (`QosflowWorker.reload_cluster`).

Three real agents on 127.0.0.1 (`qosflow agent start --virtual-gpus 2`), a bare-metal cluster block naming
some of them, a `qosflow` pool whose `cluster_reload_s` is 0.5 s, and pipelines sent through the session's
Prefect server (conftest.prefect_server). The block is edited with `asave` as an administrator would in the
UI: a host removed while a stage runs there takes no new stage and its stage completes and is recorded; a
host added takes stages; an edit that no longer validates is not used and is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from procs import marks, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
TOKEN = "reload-test-token-71fa"
POOL = "reload-agents"
BLOCK = "reload-lab"
RELOAD_S = 0.5






def save_block(agents: dict, hosts: list[str]) -> None:
    from pydantic import SecretStr

    from qosflow.prefect.blocks import BareMetalGPUCluster

    block = BareMetalGPUCluster(hosts=hosts, backend="agents", agent_urls={h: agents[h].url for h in hosts},
                                agent_token=SecretStr(TOKEN), heartbeat_s=0.5, gpus_per_host=2, cpu_cores=4, virtual_gpus=True)
    asyncio.run(block.asave(BLOCK, overwrite=True))


@pytest.fixture(scope="module")
def lab(prefect_server, tmp_path_factory):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    from qosflow.agent.testing import AgentProcess
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    d = tmp_path_factory.mktemp("reload")
    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = pypath  # the agents (and so their stages) inherit it
    agents = {}
    w = None
    try:
        for name in ("host-a", "host-b", "host-c"):
            agents[name] = AgentProcess(name, TOKEN, virtual_gpus=2, args=["--cpu-cores", "4"], log=d / f"{name}.log").start()
        save_block(agents, ["host-a", "host-b"])

        async def pool() -> None:
            await setup_pool(POOL, cluster_block=BLOCK, policy=QoSPolicy(policy="fifo", options={"backfill": True}),
                             stream_output=False, env={"PYTHONPATH": pypath})
            async with get_client() as c:  # the pool's variable, as set in the UI (work pool -> base job template)
                t = (await c.read_work_pool(POOL)).base_job_template
                t["variables"]["properties"]["cluster_reload_s"]["default"] = RELOAD_S
                await c.update_work_pool(POOL, WorkPoolUpdate(base_job_template=t))

        asyncio.run(pool())
        w = WorkerThread(POOL, metrics_port=0).wait_ready(120)  # (its events counted in its Prometheus metrics)
        os.environ["QOSFLOW_POOL"] = POOL
        yield {"worker": w, "agents": agents, "dir": d}
    finally:
        os.environ.pop("QOSFLOW_POOL", None)
        if w is not None:
            w.stop()
        for a in agents.values():
            a.stop()


def use_hosts(lab, hosts: list[str]) -> None:
    """Describe these hosts in the block and wait until the worker plans on exactly them."""
    w = lab["worker"].worker
    save_block(lab["agents"], hosts)
    wait_for(lambda: list(w.scheduler.cluster.node_names) == hosts and not w._draining, 30, f"the worker planning on {hosts}")


def record_of(w, fid: str) -> dict:
    wait_for(lambda: any(r["flow_run_id"] == fid for r in w.records), 30, f"the record of {fid}")
    return next(r for r in w.records if r["flow_run_id"] == fid)


def test_the_pool_sets_how_often_the_block_is_read(lab):
    w = lab["worker"].worker
    assert w.cluster_reload_s == RELOAD_S and w._cluster_source == ("block", BLOCK)
    assert list(w.scheduler.cluster.node_names) == ["host-a", "host-b"]


def test_a_removed_host_takes_no_new_stage_and_its_running_stage_completes(lab, tmp_path):
    """Take the host of a running stage out of the block: the worker says so, the policy sees the host down (a
    stage that comes meanwhile goes to the other host although this one has a free GPU), the stage runs to its
    end there and is recorded, its lease released; then the host is forgotten, the other host renumbered while
    a stage of its runs, and that stage completes and is recorded too."""
    import infra_pipelines as ip

    w = lab["worker"].worker
    use_hosts(lab, ["host-a", "host-b"])
    out: dict = {}
    m1, m2 = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    t1 = threading.Thread(target=lambda: out.setdefault("first", ip.agent_lost(str(m1), 10.0)), daemon=True)
    t1.start()
    wait_for(lambda: any(e["event"] == "start" for e in marks(m1)), 120, "the first stage's start")
    first = marks(m1)[0]
    victim = first["node"]
    other = "host-b" if victim == "host-a" else "host-a"
    save_block(lab["agents"], [other])
    said = f"host {victim} removed (1 stage still running there, no new ones)"
    wait_for(lambda: any(line == said for _, line in w.cluster_events), 10, "the removal")
    sched = w.scheduler
    assert victim in sched.cluster.node_names and sched.state.down[sched.cluster.index_of(victim)]
    assert victim not in asyncio.run_coroutine_threadsafe(w._backend.healthy_nodes(), lab["worker"]._loop).result(10)

    t2 = threading.Thread(target=lambda: out.setdefault("second", ip.agent_lost(str(m2), 8.0)), daemon=True)
    t2.start()
    t1.join(120)
    assert out.get("first") == victim  # completed where it ran, on the removed host
    assert [e["node"] for e in marks(m1)] == [victim, victim]  # started and done there, once
    rec = record_of(w, first["attempt"])
    assert rec["exit"] == "ok" and rec["host"] == victim and len(rec["attempts"]) == 1, rec
    wait_for(lambda: victim not in w.scheduler.cluster.node_names, 10, "the removed host forgotten")
    assert any(line == f"host {victim} removed: its last stage ended" for _, line in w.cluster_events)
    assert victim not in w._backend.state and list(w.scheduler.cluster.node_names) == [other]
    t2.join(120)
    assert out.get("second") == other
    assert {e["node"] for e in marks(m2)} == {other}
    second = marks(m2)[0]
    rec2 = record_of(w, second["attempt"])
    assert rec2["exit"] == "ok" and rec2["host"] == other, rec2
    wait_for(lambda: not w.scheduler.state.allocs, 10, "every slot free")
    w.scheduler.state.check_invariants()
    wait_for(lambda: w.leases.leases(w._pool_key) == [], 10, "every lease released")


def test_an_added_host_takes_stages(lab, tmp_path):
    import infra_pipelines as ip

    w = lab["worker"].worker
    use_hosts(lab, ["host-a"])
    save_block(lab["agents"], ["host-c"])  # host-a (idle) goes, host-c comes
    wait_for(lambda: list(w.scheduler.cluster.node_names) == ["host-c"], 10, "host-c planned on")
    assert any(line == "host host-c added (2 GPUs, virtual, 4 cores)" for _, line in w.cluster_events), w.cluster_events
    assert any(line == "host host-a removed" for _, line in w.cluster_events)
    # each change is a Prefect event too (qosflow.node.added / removed / changed), for automations
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    counted = {s.labels.get("event"): s.value for fam in text_string_to_metric_families(generate_latest(w.metrics.registry).decode())
               for s in fam.samples if s.name == "qosflow_events_total"}
    assert counted.get("qosflow.node.added", 0) >= 1 and counted.get("qosflow.node.removed", 0) >= 1, counted
    wait_for(lambda: not w.scheduler.state.down[0], 10, "host-c up")
    m = tmp_path / "added.jsonl"
    assert ip.agent_lost(str(m), 0.5) == "host-c"
    assert [e["node"] for e in marks(m)] == ["host-c", "host-c"]


def test_a_block_that_no_longer_validates_is_not_used_and_said_once(lab):
    """An edit that breaks the block (saved through the API, as a UI edit could be): the worker keeps the cluster
    it has, logs one error naming the block and what is wrong (not one per reading), one more for another
    error, and takes the block again once it is fixed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import BlockDocumentUpdate

    w = lab["worker"].worker
    use_hosts(lab, ["host-a", "host-b"])
    said: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record)

    handler = Keep(level=logging.INFO)
    w._logger.addHandler(handler)

    async def edit(data: dict) -> None:
        async with get_client() as c:
            doc = await c.read_block_document_by_name(BLOCK, "qosflow-bare-metal-cluster")
            await c.update_block_document(doc.id, BlockDocumentUpdate(data=data))

    try:
        asyncio.run(edit({"hosts": []}))
        time.sleep(8 * RELOAD_S)
        errors = [r.getMessage() for r in said if r.levelno >= logging.ERROR]
        assert len(errors) == 1, errors
        assert f"cluster block '{BLOCK}'" in errors[0] and "at least one host" in errors[0], errors[0]
        assert "keeps the cluster it has (hosts host-a, host-b)" in errors[0]
        assert list(w.scheduler.cluster.node_names) == ["host-a", "host-b"] and not w._draining
        assert not w.scheduler.state.down.any()
        asyncio.run(edit({"hosts": ["host-a"], "agent_urls": {"host-a": "127.0.0.1:1"}}))  # another error: said too
        wait_for(lambda: len([r for r in said if r.levelno >= logging.ERROR]) == 2, 10, "the second error")
        time.sleep(4 * RELOAD_S)
        errors = [r.getMessage() for r in said if r.levelno >= logging.ERROR]
        assert len(errors) == 2 and "agent_urls['host-a']" in errors[1], errors
        assert list(w.scheduler.cluster.node_names) == ["host-a", "host-b"]
        save_block(lab["agents"], ["host-a"])  # fixed
        wait_for(lambda: list(w.scheduler.cluster.node_names) == ["host-a"], 10, "the fixed block taken")
        infos = [r.getMessage() for r in said if r.levelno == logging.INFO]
        assert f"cluster block '{BLOCK}' can be used again" in infos
        assert f"cluster block '{BLOCK}': host host-b removed" in infos
    finally:
        w._logger.removeHandler(handler)


def test_the_allocation_state_follows_a_resize_and_a_renumbering():
    """A host resized while a stage runs there: more GPUs and cores at once, fewer GPUs than the stage uses
    not (`_why_not_resized`); the host before it removed, its index changes with the stage's placement."""
    from qosflow.core.cluster import ClusterSpec, ClusterState, NodeSpec, default_cpu_split
    from qosflow.core.placement import Placement
    from qosflow.core.qos import QoSSpec
    from qosflow.prefect.worker import _moved_state, _why_not_resized

    a, b = NodeSpec("a", 2, cpu_cores=4), NodeSpec("b", 4, cpu_cores=8)
    st = ClusterState(ClusterSpec((a, b)))
    q = QoSSpec(gpus=1, cpu_cores=2)
    p = Placement("j", ((1, 3),), default_cpu_split(q, [(1, 3)]))
    st.allocate(p, q)
    small = NodeSpec("b", 2, cpu_cores=8)
    assert "GPUs 2..3 that go away are in use" == _why_not_resized(b, small, st, 1)
    bigger = NodeSpec("b", 8, cpu_cores=16)
    assert _why_not_resized(b, bigger, st, 1) is None

    def move(pl):
        return Placement(pl.job_id, tuple((0, g) for _, g in pl.gpus), tuple((0, c) for _, c in pl.cpu))

    new = _moved_state(st, ClusterSpec((bigger,)), {1: 0}, move)
    new.check_invariants()
    assert new.allocs["j"].gpus == ((0, 3),) and new.cpu_free[0] == 14 and new.empty[0] == 7 and new.n_empty == 7
    new.release("j")
    new.check_invariants()
    assert new.cpu_free[0] == 16 and new.empty[0] == 8


def test_what_an_edit_cannot_change_under_running_stages_is_said_not_applied():
    """The agents' token and heartbeat (every open connection and the stages' followers use them): not applied,
    said. A Kubernetes block's image is taken for the next launches; its namespace (where the running stages'
    Jobs are) is not."""
    from qosflow.backends.agent import AgentBackend, AgentHost
    from qosflow.backends.kubernetes import KubernetesBackend
    from qosflow.k8s_emulator import EmulatorServer, gpu_node

    async def agents():
        hosts = [AgentHost("h1", "http://127.0.0.1:9", gpus=2)]
        be, new = AgentBackend(hosts, "old-token"), AgentBackend(hosts, "new-token", heartbeat_s=1.0)
        try:
            upd = await be.update_cluster(new)
        finally:
            await be.aclose()
        return upd

    upd = asyncio.run(agents())
    assert [n.name for n in upd.nodes] == ["h1"] and len(upd.not_applied) == 2, upd
    assert "agent token changed" in upd.not_applied[0] and "restarted" in upd.not_applied[0]
    assert "heartbeat_s changed from 2.0 to 1.0" in upd.not_applied[1]

    with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
        async def k8s():
            be = KubernetesBackend(namespace="default", image="train:1", api_client=emu.api_client())
            new = KubernetesBackend(namespace="ml", image="train:2", api_client=emu.api_client())
            try:
                return be, await be.update_cluster(new)
            finally:
                await be.aclose()
                await new.aclose()

        be, upd = asyncio.run(k8s())
    assert be.image == "train:2" and be.namespace == "default"
    assert [n.name for n in upd.nodes] == ["gpu-0"]
    assert upd.applied == ["image 'train:1' -> 'train:2' (for the stages launched from now on)"]
    assert upd.not_applied == ["its namespace changed from 'default' to 'ml'; the worker keeps 'default' until it is restarted"]


def test_a_cluster_file_is_read_again_too(tmp_path):
    """A worker started from a cluster file reads the file again: a host added is planned on (down while its agent
    does not answer), an idle host removed is forgotten at once, a file that no longer parses is said once."""
    from qosflow.backends.agent import load_cluster_file
    from qosflow.policies import get_policy
    from qosflow.prefect.scheduler import QoSScheduler
    from qosflow.prefect.worker import QosflowWorker, _fingerprint

    f = tmp_path / "lab.yaml"

    def write(hosts: list[str]) -> None:
        # (nothing answers there; one URL per host, whatever the list: a file giving two hosts one URL is refused)
        lines = "".join(f"  - {{name: {h}, agent_url: 'http://127.0.0.1:{9 + 10 * int(h[1:])}'}}\n" for h in hosts)
        f.write_text(f"name: lab\ntoken: t\nheartbeat_s: 0.5\ngpus_per_host: 2\ncpu_cores: 4\nhosts:\n{lines}")

    errors: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    async def go() -> tuple[list[str], list[str], list[str]]:
        write(["h1", "h2"])
        cf = load_cluster_file(f)
        be = cf.backend(request_timeout_s=0.5)
        w = QosflowWorker(work_pool_name="reload-file", backend=be)
        w.scheduler = QoSScheduler(await be.inventory(), get_policy("fifo"))
        w._cluster_source, w._cluster_seen = ("file", str(f)), _fingerprint(cf)
        w.cluster_reload_s = 60.0
        w._logger.addHandler(Keep())
        try:
            assert await w.reload_cluster() == []  # no edit
            write(["h2", "h3"])
            said = await w.reload_cluster()
            names = list(w.scheduler.cluster.node_names)
            assert w.scheduler.state.down.tolist() == [False, True]  # (h3's agent does not answer; h2 was not checked)
            assert "h1" not in be.state and be.hosts.keys() == {"h2", "h3"}
            f.write_text("name: lab\nhosts: [")  # broken
            await w.reload_cluster()
            await w.reload_cluster()
            return said, names, list(w.scheduler.cluster.node_names)
        finally:
            await be.aclose()

    said, names, after = asyncio.run(go())
    assert said == ["host h1 removed", "host h3 added (2 GPUs, virtual, 4 cores)"]
    assert names == after == ["h2", "h3"]
    assert len(errors) == 1 and f"cluster file {f} cannot be used as it is now" in errors[0] and "not valid YAML" in errors[0], errors
    assert "keeps the cluster it has (hosts h2, h3)" in errors[0]

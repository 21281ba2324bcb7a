"""Which backend the qosflow worker runs on (cluster blocks and files), and the scheduler's rerun of a
stage away from the node it failed on. No Prefect server; a few seconds."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import SecretStr

from qosflow.backends.agent import AgentBackend
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.backends.local import LocalBackend
from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job, JobState
from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec
from qosflow.policies import get_policy
from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster
from qosflow.prefect.scheduler import QoSScheduler, StageEntry


def test_bare_metal_block_gives_local_or_agent_backend(tmp_path):
    assert isinstance(BareMetalGPUCluster.virtual(2, 4).make_backend(), LocalBackend)
    blk = BareMetalGPUCluster(hosts=["a", "b"], backend="agents", agent_url="http://{host}:8701",
                              agent_urls={"b": "http://10.0.0.2:9000"}, agent_token=SecretStr("s3cret"), heartbeat_s=0.5,
                              fence_after_s=0.75, gpus_per_host=2)
    be = blk.make_backend()
    try:
        assert isinstance(be, AgentBackend)
        assert {h.name: h.url for h in be.hosts.values()} == {"a": "http://a:8701", "b": "http://10.0.0.2:9000"}
        assert be.heartbeat_s == 0.5 and be.fence_after_s == 0.75 and be.hosts["a"].gpus == 2
        assert be._client(be.state["a"]).headers["authorization"] == "Bearer s3cret"
    finally:
        asyncio.run(be.aclose())
    with pytest.raises(Exception, match="agent_token"):
        BareMetalGPUCluster(hosts=["a"], backend="agents", agent_url="http://{host}:1").make_backend()
    with pytest.raises(ValueError, match="agent_urls names host"):
        BareMetalGPUCluster(hosts=["a"], backend="agents", agent_urls={"a": "http://x:1", "z": "http://y:1"})
    # a cluster file becomes the same block (agents by URL, the file's token)
    (tmp_path / "tok").write_text("tok-1\n")
    f = tmp_path / "lab.yaml"
    f.write_text("name: lab\ntoken_file: tok\nheartbeat_s: 1\ngpus_per_host: 4\nhosts:\n  - {name: h1, agent_url: 'http://127.0.0.1:8801'}\n"
                 "  - {name: h2, agent_url: 'http://127.0.0.1:8802'}\n")
    fb = BareMetalGPUCluster.from_cluster_file(str(f))
    assert fb.backend == "agents" and fb.agent_urls == {"h1": "http://127.0.0.1:8801", "h2": "http://127.0.0.1:8802"}
    assert fb.agent_token.get_secret_value() == "tok-1" and fb.gpus_per_host == 4 and fb.heartbeat_s == 1
    # hosts of different GPU models keep theirs (the first host's is the block's gpu_model)
    f.write_text("name: lab\ntoken_file: tok\nhosts:\n  - {name: h1, agent_url: 'http://127.0.0.1:8801', gpu_model: a100}\n"
                 "  - {name: h2, agent_url: 'http://127.0.0.1:8802', gpu_model: rtx3090}\n")
    fb = BareMetalGPUCluster.from_cluster_file(str(f))
    assert fb.gpu_model == "a100" and fb.host_gpu_models == {"h2": "rtx3090"}
    assert [n.gpu_model for n in fb.to_cluster_spec().nodes] == ["a100", "rtx3090"]
    be = fb.make_backend()
    try:
        assert {h.name: h.gpu_model for h in be.hosts.values()} == {"h1": "a100", "h2": "rtx3090"}
    finally:
        asyncio.run(be.aclose())


def test_kubernetes_block_gives_kubernetes_backend_with_inventory_from_nodes():
    from qosflow.k8s_emulator import EmulatorServer, gpu_node

    with EmulatorServer([gpu_node("gpu-0", 4), gpu_node("gpu-1", 2)]) as emu:
        blk = KubernetesGPUCluster(api_url=emu.url, namespace="default", image="img:1", sharing="mps")
        be = blk.make_backend()
        assert isinstance(be, KubernetesBackend) and be.gpu_sharing == "mps" and be.image == "img:1"

        async def go():
            return await be.inventory(), await be.healthy_nodes()

        spec, healthy = asyncio.run(go())
        asyncio.run(be.aclose())
    assert [(n.name, n.gpus, n.virtual) for n in spec.nodes] == [("gpu-0", 4, True), ("gpu-1", 2, True)]
    assert healthy == {"gpu-0", "gpu-1"}


def test_rerun_after_infra_failure_avoids_the_failed_node():
    """A stage that failed on node0 for infrastructure reasons is placed elsewhere even though node0 is
    free (first-fit would pick it); when no other node could ever hold it, it may go back."""
    cl = ClusterSpec.uniform(2, 2, virtual=True, cpu_cores=4)

    async def go():
        sched = QoSScheduler(cl, get_policy("fifo"), coda=False)
        e = StageEntry(JobState(Job("s1", 0.0, QoSSpec(gpus=1), duration=5.0)), "s1")
        e.meta["avoid_nodes"] = {0}
        sched.start()
        try:
            g = await asyncio.wait_for(sched.request(e), 5)
            assert g.placement.nodes == (1,)
            sched.release("s1")
            big = StageEntry(JobState(Job("s2", 0.0, QoSSpec(gpus=2, cpu_cores=1), duration=5.0)), "s2")
            big.meta["avoid_nodes"] = {0, 1}  # nowhere else: the avoidance is dropped
            g2 = await asyncio.wait_for(sched.request(big), 5)
            assert len(g2.placement.gpus) == 2
        finally:
            await sched.stop()

    asyncio.run(go())


async def _worker_takes_and_fails_setup(flow_run_id, error, match, **worker_kw):
    """Let a qosflow worker poll its pool once, check that its set-up fails with `error` matching
    `match`, and return (the runs it took, the flow run's state afterwards)."""
    from prefect.client.orchestration import get_client

    from qosflow.prefect.worker import QosflowWorker

    async with QosflowWorker(create_pool_if_not_found=False, **worker_kw) as w:
        await w.sync_with_backend()
        taken = await w.get_and_submit_flow_runs()
        with pytest.raises(error, match=match):
            await w._ensure_qos()
    async with get_client() as c:
        return taken, (await c.read_flow_run(flow_run_id)).state


def test_worker_with_a_broken_cluster_file_takes_no_flow_run(prefect_server, tmp_path):
    """A worker whose cluster file is malformed says so and leaves the pool's runs scheduled (for a fixed
    or another worker) instead of taking each one and reporting it Crashed."""
    from prefect.client.orchestration import get_client

    from qosflow.prefect.local import setup_pool

    bad = tmp_path / "lab.yaml"
    bad.write_text("name: lab\ntoken: x\nhosts:\n  - {name: a, agent_url: 'http://127.0.0.1:9', gpus: two}\n")
    pool = "broken-cluster-file"

    async def go():
        await setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1))
        async with get_client() as c:
            dep = await c.read_deployment_by_name(f"qosflow-stage/{pool}")
            fr = await c.create_flow_run_from_deployment(dep.id, parameters={"payload": "none"}, job_variables={"role": "stage", "gpus": 1})
        return await _worker_takes_and_fails_setup(fr.id, Exception, r"lab.yaml: hosts\[0\]: invalid gpus", work_pool_name=pool, cluster_file=str(bad))

    taken, state = asyncio.run(go())
    assert taken == [] and state.is_scheduled(), state


def test_qosflow_worker_and_stages_refuse_a_pool_of_another_type(prefect_server, capsys):
    """A qosflow worker started on a `process` pool takes none of its runs (it used to serve them on a
    default virtual cluster), `qosflow worker start` says so at once, and a pipeline naming that pool fails
    at its first stage with the fix, before anything is queued."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    from qosflow.cli.main import main
    from qosflow.errors import SpecError
    from qosflow.prefect.tasks import ensure_stage_deployment

    pool = "plain-process"

    async def go():
        async with get_client() as c:
            await c.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
            flow_id = await c.create_flow_from_name("someone-elses-flow")
            dep = await c.create_deployment(flow_id=flow_id, name="plain", work_pool_name=pool, entrypoint="x.py:f")
            fr = await c.create_flow_run_from_deployment(dep)
        return await _worker_takes_and_fails_setup(
            fr.id, SpecError, r"work pool 'plain-process' has type 'process', not 'qosflow'.*qosflow init --pool", work_pool_name=pool
        )

    taken, state = asyncio.run(go())
    assert taken == [] and state.is_scheduled(), state
    assert main(["worker", "start", "--pool", pool]) == 2
    assert "has type 'process'" in capsys.readouterr().err
    assert main(["worker", "start", "--pool", "no-such-pool"]) == 2
    assert "qosflow init --pool no-such-pool" in capsys.readouterr().err
    with pytest.raises(SpecError, match="has type 'process'; stages need a pool of type 'qosflow'"):
        ensure_stage_deployment(pool)


@pytest.mark.parametrize("cmd", [["init", "--pool", "gpu"], ["worker", "start", "--pool", "gpu"]])
def test_init_and_worker_without_a_server_say_how_to_start_one(tmp_path, cmd):
    """Without PREFECT_API_URL, `qosflow init` wrote into a temporary server that vanished on exit and the
    worker died with a ValueError traceback."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), QOSFLOW_HOME=str(tmp_path / "q"))
    out = subprocess.run([sys.executable, "-m", "qosflow", *cmd], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "PREFECT_API_URL is not set" in out.stderr and "prefect server start" in out.stderr
    assert "Traceback" not in out.stderr


def test_init_names_a_server_it_cannot_reach(tmp_path):
    """Prefect reports a refused connection as RuntimeError("Failed to reach API ...") raised from the
    httpx error; init says which server it could not reach and how to start one, without a traceback."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), QOSFLOW_HOME=str(tmp_path / "q"), PREFECT_API_URL="http://127.0.0.1:9/api")
    out = subprocess.run([sys.executable, "-m", "qosflow", "init", "--pool", "gpu"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cannot reach the Prefect server at http://127.0.0.1:9/api" in out.stderr and "prefect server start" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_invalid_saved_block_is_named_with_its_bad_fields(prefect_server):
    """A block document that no longer validates (edited in the UI or through the API) was reported as
    'no cluster block named ...' with Prefect's 'try validate=False'; now its bad fields are named."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import BlockDocumentCreate

    from qosflow.errors import SpecError
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import register_blocks
    from qosflow.prefect.worker import aload_block, load_cluster_block

    async def save_raw(slug: str, name: str, data: dict) -> None:
        async with get_client() as c:
            bt = await c.read_block_type_by_slug(slug)
            bs = await c.get_most_recent_block_schema_for_block_type(bt.id)
            await c.create_block_document(BlockDocumentCreate(name=name, data=data, block_type_id=bt.id, block_schema_id=bs.id))

    async def go():
        await register_blocks()
        await save_raw("qosflow-bare-metal-cluster", "no-hosts", {"hosts": [], "gpus_per_host": 4})
        await save_raw("qosflow-bare-metal-cluster", "agents-no-url", {"hosts": ["a"], "backend": "agents"})
        await save_raw("qosflow-qos-policy", "vip-policy", {"policy": "qosflow", "priority": "vip"})
        out = []
        for call in (lambda: load_cluster_block("no-hosts"), lambda: load_cluster_block("qosflow-bare-metal-cluster/agents-no-url"),
                     lambda: aload_block(QoSPolicy, "vip-policy", "policy_block")):
            with pytest.raises(SpecError) as ei:
                await call()
            out.append(str(ei.value))
        with pytest.raises(SpecError, match="no cluster block named 'absent'"):
            await load_cluster_block("absent")
        return out

    hosts, agents, policy = asyncio.run(go())
    assert "block qosflow-bare-metal-cluster/no-hosts is invalid: hosts:" in hosts and "at least one host" in hosts
    assert "agents-no-url is invalid" in agents and "needs agent_url" in agents
    assert "invalid policy_block: block qosflow-qos-policy/vip-policy is invalid: priority:" in policy and "'vip'" in policy
    for msg in (hosts, agents, policy):
        assert "validate=False" not in msg and "fix it in the Prefect UI" in msg


def test_block_register_module_registers_the_three_blocks_only(prefect_server):
    """`prefect block register -m qosflow.prefect.blocks` (docs/prefect.md) also put a '_ClusterBase' block
    type in the UI's catalog."""
    from prefect.cli.block import _register_blocks_in_module

    import qosflow.prefect.blocks as blocks

    registered = asyncio.run(_register_blocks_in_module(blocks))
    assert sorted(c.get_block_type_slug() for c in registered) == [
        "qosflow-bare-metal-cluster", "qosflow-kubernetes-cluster", "qosflow-qos-policy"]


def test_setup_pool_again_keeps_the_users_pool_defaults_and_leaves_other_pools_alone(prefect_server):
    """Re-running `qosflow init` (setup_pool) reset every pool variable the user had set (env, working_dir...)
    and overwrote the template of a same-named pool of another type."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.workers.process import ProcessWorker

    from qosflow.errors import SpecError
    from qosflow.prefect.local import setup_pool

    async def go():
        await setup_pool("keep-defaults", cluster=BareMetalGPUCluster.virtual(1, 2))
        async with get_client() as c:
            t = (await c.read_work_pool("keep-defaults")).base_job_template
            t["variables"]["properties"]["env"]["default"] = {"PYTHONPATH": "/srv/flows"}
            t["variables"]["properties"]["working_dir"]["default"] = "/srv/flows"
            await c.update_work_pool("keep-defaults", WorkPoolUpdate(base_job_template=t))
        await setup_pool("keep-defaults", cluster=BareMetalGPUCluster.virtual(1, 8), cluster_block="other-cluster")
        proc_template = ProcessWorker.get_default_base_job_template()
        async with get_client() as c:
            props = (await c.read_work_pool("keep-defaults")).base_job_template["variables"]["properties"]
            await c.create_work_pool(WorkPoolCreate(name="their-process-pool", type="process", base_job_template=proc_template))
        with pytest.raises(SpecError, match="exists with type 'process'; it is left as it is"):
            await setup_pool("their-process-pool", cluster=BareMetalGPUCluster.virtual(1, 1))
        async with get_client() as c:
            after = (await c.read_work_pool("their-process-pool")).base_job_template
        return props, after, proc_template

    props, after, proc_template = asyncio.run(go())
    assert props["env"]["default"] == {"PYTHONPATH": "/srv/flows"} and props["working_dir"]["default"] == "/srv/flows"
    assert props["cluster_block"]["default"] == "other-cluster"  # what this call sets does change
    assert after == proc_template


def test_the_server_creates_the_runs_of_a_scheduled_deployment(tmp_path):
    """Scheduled retraining is an ordinary deployment with a schedule (deployments/prefect.yaml). With
    SQLAlchemy 2.1 the Prefect 3.8 server's scheduler failed on every pass ('Can't evaluate bulk DML
    statement') and never created a run: pyproject.toml pins sqlalchemy<2.1. A real `prefect server
    start` (the session's test server runs no scheduler service)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from qosflow.prefect.local import LocalServer

    server = LocalServer(tmp_path / "server", ui=False).start()

    async def go():
        async with get_client() as c:
            fid = await c.create_flow_from_name("nightly-schedule-check")
            dep = await c.create_deployment(flow_id=fid, name="nightly", entrypoint="flows/retrain.py:retrain",
                                            schedules=[DeploymentScheduleCreate(schedule=CronSchedule(cron="0 2 * * *", timezone="UTC"), active=True)])
            deadline = time.monotonic() + 90  # the scheduler service looks at new deployments every few seconds
            while time.monotonic() < deadline:
                runs = await c.read_flow_runs(flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[dep])))
                if runs:
                    return runs
                await asyncio.sleep(1.0)
            return []

    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            runs = asyncio.run(go())
        log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    assert runs, "no scheduled run; server log:\n" + log[-3000:]
    assert all(r.state.is_scheduled() and r.expected_start_time.hour == 2 for r in runs)


def test_label_write_retries_a_busy_database_at_once_instead_of_backing_off_for_a_minute(monkeypatch):
    """Prefect's server answers a label merge that lost a SQLite write race with 503; its client's own
    back-off (2..32 s) made one label write take up to a minute and then drop the labels. The worker
    retries those itself, with Prefect's retries off, after pauses under a second."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

    from qosflow.prefect import worker as W

    def status(code):
        req = httpx.Request("PATCH", "http://x/api/flow_runs/1/labels")
        return PrefectHTTPStatusError.from_httpx_error(
            httpx.HTTPStatusError("busy", request=req, response=httpx.Response(code, request=req)))

    class Client:
        def __init__(self, codes):
            self.codes, self.retries_seen, self.written = list(codes), [], None

        async def update_flow_run_labels(self, fid, labels):
            self.retries_seen.append(PREFECT_CLIENT_MAX_RETRIES.value())
            if self.codes:
                raise status(self.codes.pop(0))
            self.written = labels

    pauses = []
    real_sleep = asyncio.sleep

    async def sleep(s):
        pauses.append(s)
        await real_sleep(0)

    monkeypatch.setattr(W.asyncio, "sleep", sleep)
    c = Client([503, 503, 503])
    assert asyncio.run(W.patch_labels(c, "fr", {"qosflow.host": "h"})) == 4
    assert c.written == {"qosflow.host": "h"} and c.retries_seen == [0, 0, 0, 0]
    assert len(pauses) == 3 and all(p < 1.0 for p in pauses)
    assert PREFECT_CLIENT_MAX_RETRIES.value() > 0  # only the label write ran without Prefect's retries
    with pytest.raises(PrefectHTTPStatusError):  # not a busy database: raised at once
        asyncio.run(W.patch_labels(Client([404]), "fr", {}))
    with pytest.raises(PrefectHTTPStatusError):  # busy for longer than the budget: given up
        asyncio.run(W.patch_labels(Client([503] * 1000), "fr", {}, budget_s=0.0))


def test_server_database_url_takes_postgresql_and_names_a_bad_one_without_its_password():
    from qosflow.prefect.local import prefect_database_url, server_env

    assert prefect_database_url(None, "/h") == "sqlite+aiosqlite:////h/prefect.db"
    for given in ("postgresql://u:p@db:5432/prefect", "postgres://u:p@db:5432/prefect", "postgresql+psycopg://u:p@db:5432/prefect"):
        assert prefect_database_url(given, "/h") == "postgresql+asyncpg://u:p@db:5432/prefect"
    assert server_env("/h", 1234, database_url="postgresql://u:p@db/x")["PREFECT_API_DATABASE_CONNECTION_URL"] == "postgresql+asyncpg://u:p@db/x"
    for bad, says in (("mysql://u:secret@db/x", "PostgreSQL or SQLite only"), ("u:secret@db/x", "no scheme")):
        with pytest.raises(ValueError, match=says) as e:
            prefect_database_url(bad, "/h")
        assert "secret" not in str(e.value) and "postgresql://USER:PASSWORD@HOST:PORT/DB" in str(e.value)


def test_demo_refuses_a_bad_database_url_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from qosflow.cli.main import app

    r = CliRunner().invoke(app, ["demo", "--no-ui", "--home", str(tmp_path / "demo"), "--database-url", "mysql://u:secret@db/x"])
    assert r.exit_code == 2 and "--database-url" in r.output and "PostgreSQL or SQLite only" in r.output
    assert "secret" not in r.output and not (tmp_path / "demo").exists()


@pytest.mark.postgres
def test_local_server_keeps_its_data_in_postgresql(tmp_path):
    """`qosflow demo --database-url` / LocalServer(database_url=...): Prefect's server on PostgreSQL,
    the remedy for SQLite's write-lock stalls on a busy machine (docs/prefect.md)."""
    import os
    import uuid

    pg = os.environ.get("QOSFLOW_TEST_POSTGRES_URL")
    if not pg:
        pytest.skip("QOSFLOW_TEST_POSTGRES_URL is not set (e.g. postgresql+psycopg://qosflow:qosflow@localhost/qosflow_test)")
    import psycopg
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from qosflow.prefect.local import LocalServer

    admin = "postgresql://" + pg.split("://", 1)[1]
    db = f"qosflow_prefect_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {db}")
    server = None
    try:
        server = LocalServer(tmp_path / "server", ui=False, database_url=admin.rsplit("/", 1)[0] + "/" + db).start(timeout=180)

        async def go():
            async with get_client() as c:
                fid = await c.create_flow_from_name("on-postgres")
                run = await c.create_flow_run_from_deployment(
                    await c.create_deployment(flow_id=fid, name="d", entrypoint="flows/retrain.py:retrain"))
                await c.update_flow_run_labels(run.id, {"qosflow.host": "host0"})
                return (await c.read_flow_run(run.id)).labels

        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            labels = asyncio.run(go())
        assert labels["qosflow.host"] == "host0"
        assert not (tmp_path / "server" / "prefect.db").exists()
        with psycopg.connect(admin.rsplit("/", 1)[0] + "/" + db) as c:
            assert c.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 1
    finally:
        if server is not None:
            server.stop()
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def test_worker_says_once_that_the_hosts_health_cannot_be_read(caplog):
    """An unreachable cluster API at every heartbeat: the reason was logged at debug level only (what showed
    was urllib3's retry warnings, every 2 s); now one warning per outage naming it, and a note when it ends."""
    import logging
    from types import SimpleNamespace

    from qosflow.errors import QosflowError
    from qosflow.prefect.worker import QosflowWorker

    class Flaky:
        error: Exception | None = QosflowError("Kubernetes cluster 'k8s': cannot reach the API server at http://x")

        async def healthy_nodes(self):
            if self.error is not None:
                raise self.error
            return set()

    w = QosflowWorker(work_pool_name="health-test", backend=Flaky())
    w.scheduler = SimpleNamespace(cluster=SimpleNamespace(nodes=[]))

    async def beats(n):
        for _ in range(n):
            await w._sync_health()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(beats(3))
        w._backend.error = QosflowError("the API server answered 403 Forbidden")
        asyncio.run(beats(2))
        w._backend.error = None
        asyncio.run(beats(2))
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "health" in r.getMessage()]
    warned = [m for lvl, m in said if lvl == "WARNING"]
    assert len(warned) == 2 and "cannot reach the API server at http://x" in warned[0] and "403" in warned[1]
    assert [m for lvl, m in said if lvl == "INFO"] == ["the hosts' health can be read again"]


def test_sqlite_server_collects_garbage_off_its_event_loop(tmp_path, monkeypatch):
    """A garbage collection in the server's event loop could finalize an aiosqlite cursor and wait, in
    the loop, for a SQLite connection that waited 60 s on a write lock: every request stalled
    (docs/prefect.md). The SQLite server LocalServer starts runs automatic collection off, and a thread
    collects instead: a reference cycle still goes away."""
    import subprocess
    import sys

    code = (
        "import gc, time, weakref\n"
        "from qosflow.prefect.server_process import collect_off_the_event_loop\n"
        "t = collect_off_the_event_loop()\n"
        "class Node: pass\n"
        "a = Node(); a.me = a; r = weakref.ref(a); del a\n"
        "deadline = time.monotonic() + 60\n"
        "while r() is not None and time.monotonic() < deadline: time.sleep(0.05)\n"
        "print(gc.isenabled(), t.is_alive(), r() is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True", "True"], out.stderr

    from qosflow.prefect.local import LocalServer

    assert "qosflow.prefect.server_process" in _server_cmd(LocalServer(tmp_path / "a", ui=False), monkeypatch)
    assert "qosflow.prefect.server_process" not in _server_cmd(LocalServer(tmp_path / "b", ui=False, database_url="postgresql://u:p@h/d"), monkeypatch)


def test_sqlite_server_retries_a_request_that_lost_the_write_race_itself(tmp_path, monkeypatch):
    """A write that lost SQLite's write race got a 503 that Prefect's client retried after 2, 4, 8, 16
    and 32 s (stage pickups of up to 52 s in the demo). The server qosflow starts runs such a request
    again itself, body and all, within its budget; other answers and errors pass at once."""
    import asyncio
    import sqlite3

    import httpx
    import sqlalchemy as sa
    from prefect.server.api.server import custom_internal_exception_handler
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Mount, Route

    from qosflow.prefect.local import LocalServer
    from qosflow.prefect.server_process import RetryLostWriteRaces

    calls = {"write": 0, "bug": 0, "health": 0}
    locked = sa.exc.OperationalError("UPDATE flow_run ...", {}, sqlite3.OperationalError("database is locked"))

    async def write(request: Request):
        calls["write"] += 1
        body = await request.json()
        if calls["write"] <= body["lose"]:
            raise locked
        return JSONResponse({"got": body, "try": calls["write"]})

    async def bug(request: Request):
        calls["bug"] += 1
        raise RuntimeError("a bug")

    async def health(request: Request):
        calls["health"] += 1
        return Response(status_code=503)

    api = Starlette(routes=[Route("/write", write, methods=["POST"]), Route("/bug", bug, methods=["POST"]), Route("/health", health)],
                    exception_handlers={Exception: custom_internal_exception_handler})  # Prefect's own 503/500 answers
    app = Starlette(routes=[Mount("/api", app=api)])  # as Prefect mounts its API (routing rewrites the scope's path)

    async def main(budget, lose):
        mw = RetryLostWriteRaces(app, budget_s=budget)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw, raise_app_exceptions=False), base_url="http://s") as c:
            return mw, [await c.post("/api/write", json={"lose": lose, "x": "y" * 100_000}), await c.post("/api/bug", json={}), await c.get("/api/health")]

    mw, (won, bugged, sick) = asyncio.run(main(15.0, 2))
    assert won.status_code == 200 and won.json()["got"]["x"] == "y" * 100_000 and won.json()["try"] == 3 and mw.retries == 2
    assert bugged.status_code == 500 and calls["bug"] == 1  # not a lost race: not run again
    assert sick.status_code == 503 and calls["health"] == 1  # a 503 without a database error: answered at once
    calls["write"] = 0
    mw, (lost, _, _) = asyncio.run(main(0.3, 100))  # the race outlasts the budget: the client gets the 503
    assert lost.status_code == 503 and 2 <= calls["write"] <= 6

    monkeypatch.setenv("QOSFLOW_SERVER_GC_THREAD", "0")
    assert "qosflow.prefect.server_process" in _server_cmd(LocalServer(tmp_path / "c", ui=False), monkeypatch)
    monkeypatch.setenv("QOSFLOW_SERVER_RETRY_S", "0")
    monkeypatch.setenv("QOSFLOW_SERVER_SQLITE_IMMEDIATE", "0")  # all off: Prefect's own server
    assert "qosflow.prefect.server_process" not in _server_cmd(LocalServer(tmp_path / "d", ui=False), monkeypatch)


def test_sqlite_server_begins_its_write_transactions_immediate(tmp_path, monkeypatch):
    """Prefect begins a write transaction DEFERRED unless it asks `with_for_update`; in WAL mode such a
    transaction that read, then writes after another writer committed, fails at once ('database is
    locked', SQLITE_BUSY_SNAPSHOT) and the request has to be replayed: in the demo creating a stage's
    flow run took up to 12 s (docs/prefect.md). The SQLite server qosflow starts begins them
    IMMEDIATE: the second writer waits for the lock instead of failing half-way."""
    import asyncio
    import contextlib

    import sqlalchemy as sa
    from prefect.server.database import configurations

    from qosflow.prefect.local import LocalServer
    from qosflow.prefect import server_process

    cls = configurations.AioSqliteConfiguration
    url = f"sqlite+aiosqlite:///{tmp_path / 'race.db'}"

    async def race() -> list[str]:
        conf = cls(connection_url=url)
        engine = await conf.engine()
        async with engine.begin() as c:
            await c.execute(sa.text("CREATE TABLE t (k INTEGER PRIMARY KEY, v INTEGER)"))
            await c.execute(sa.text("INSERT INTO t VALUES (1, 0)"))
        read = asyncio.Event()
        other_done = asyncio.Event()
        out: list[str] = []

        async def slow_writer():  # reads, lets the other writer commit, then writes
            try:
                session = await conf.session(engine)
                async with session:
                    async with conf.begin_transaction(session):
                        v = (await session.execute(sa.text("SELECT v FROM t WHERE k = 1"))).scalar()
                        read.set()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(other_done.wait(), 1.0)
                        await session.execute(sa.text("UPDATE t SET v = :v WHERE k = 1"), {"v": v + 1})
                out.append("slow ok")
            except sa.exc.OperationalError as exc:
                out.append(f"slow failed: {exc.orig}")

        async def quick_writer():
            await read.wait()
            session = await conf.session(engine)
            async with session:
                async with conf.begin_transaction(session):
                    await session.execute(sa.text("UPDATE t SET v = v + 10 WHERE k = 1"))
            other_done.set()
            out.append("quick ok")

        await asyncio.gather(slow_writer(), quick_writer())
        async with engine.connect() as c:
            out.append(f"v={(await c.execute(sa.text('SELECT v FROM t WHERE k = 1'))).scalar()}")
        await engine.dispose()
        return out

    plain = asyncio.run(race())
    # Prefect's own: the deferred reader loses the race and must be run again by someone
    assert plain[:2] == ["quick ok", "slow failed: database is locked"] and plain[2] == "v=10", plain
    monkeypatch.setattr(cls, "begin_transaction", cls.begin_transaction)  # restored after the test
    (tmp_path / "race.db").unlink()
    server_process.immediate_write_transactions()
    server_process.immediate_write_transactions()  # twice: patched once
    immediate = asyncio.run(race())
    # the second writer waits until the first commits: both writes land, none fails
    assert sorted(immediate[:2]) == ["quick ok", "slow ok"] and immediate[2] == "v=11", immediate

    for flag in ("QOSFLOW_SERVER_GC_THREAD", "QOSFLOW_SERVER_RETRY_S"):
        monkeypatch.setenv(flag, "0")
    assert "qosflow.prefect.server_process" in _server_cmd(LocalServer(tmp_path / "e", ui=False), monkeypatch)
    monkeypatch.setenv("QOSFLOW_SERVER_SQLITE_IMMEDIATE", "0")  # all three off: Prefect's own server
    assert "qosflow.prefect.server_process" not in _server_cmd(LocalServer(tmp_path / "f", ui=False), monkeypatch)


def _server_cmd(server, monkeypatch) -> list[str]:
    """The command LocalServer.start would run (captured without starting it)."""
    import subprocess

    seen: list[str] = []

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        seen.extend(cmd)
        raise Stop

    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", popen)
        with pytest.raises(Stop):
            server.start(timeout=1)
    return seen


def test_demo_refuses_an_unwritable_json_before_starting_anything(tmp_path, capsys):
    """`qosflow demo --json DIR` failed with a traceback after the whole demo had run."""
    from qosflow.cli.main import main

    (tmp_path / "out").mkdir()
    assert main(["demo", "--no-ui", "--home", str(tmp_path / "demo"), "--json", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "is a directory" in err and "Traceback" not in err
    assert not (tmp_path / "demo").exists()


def test_the_uvicorn_factory_builds_prefects_app_with_the_same_changes():
    """`qosflow.prefect.server_process:create_app` (the test suite's SQLite server, started by uvicorn
    directly) applies what `python -m qosflow.prefect.server_process server start` does; with the
    switches off it is Prefect's plain app."""
    import os
    import subprocess
    import sys

    code = (
        "import gc\n"
        "from prefect.server.database import configurations as c\n"
        "from qosflow.prefect import server_process as sp\n"
        "app = sp.create_app()\n"
        "print(type(app).__name__, gc.isenabled(), getattr(c.AioSqliteConfiguration.begin_transaction, '_qosflow_immediate', False))\n"
    )
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.stdout.split()[-3:] == ["RetryLostWriteRaces", "False", "True"], out.stderr[-2000:]
    off = {**env, "QOSFLOW_SERVER_GC_THREAD": "0", "QOSFLOW_SERVER_SQLITE_IMMEDIATE": "0", "QOSFLOW_SERVER_RETRY_S": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=off)
    assert out.stdout.split()[-3:] == ["FastAPI", "True", "False"], out.stderr[-2000:]


@pytest.mark.parametrize("state, expect", [("RUNNING", "CRASHED"), ("PENDING", "CRASHED"), ("PAUSED", None), ("CANCELLING", None),
                                           ("COMPLETED", "COMPLETED"), (None, None)])
def test_a_run_left_unended_after_its_process_exited_0(state, expect, monkeypatch):
    """After the grace, a stage run still Running or Pending is marked Crashed (nobody else would end it);
    a paused (suspended) or cancelling run is not ours to end; a reported end is taken as it is; a run the
    server cannot read is left alone."""
    from types import SimpleNamespace

    from prefect.client.schemas.objects import StateType

    from qosflow.prefect.worker import QosflowWorker

    monkeypatch.setenv("QOSFLOW_UNREPORTED_END_GRACE_S", "0.2")
    set_to = []
    fr = None if state is None else SimpleNamespace(end_time=None, state=SimpleNamespace(
        type=StateType[state], is_final=lambda: state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")))

    async def read_flow_run(_id):
        if fr is None:
            raise RuntimeError("server down")
        return fr

    async def set_flow_run_state(_id, st, force=False):
        set_to.append(st)

    w = QosflowWorker(work_pool_name="settle-test")
    w._client = SimpleNamespace(read_flow_run=read_flow_run, set_flow_run_state=set_flow_run_state)
    logs = []
    got = asyncio.run(w._settle_unreported("fr", "train", SimpleNamespace(error=logs.append)))
    assert got[1] == expect
    if expect == "CRASHED":
        assert len(set_to) == 1 and set_to[0].is_crashed() and "never reported ended" in set_to[0].message and logs
    else:
        assert set_to == [] and logs == []


def test_stage_runs_left_pending_by_a_stopped_worker_go_back_to_the_queue():
    """Pending runs labelled by a worker that is offline, or by this worker's name but not held by this
    process, are rescheduled; those of an online worker, held here, or never labelled are left."""
    from types import SimpleNamespace

    from qosflow.prefect.worker import QUEUED_BY_LABEL, QosflowWorker

    def run(i, who):
        return SimpleNamespace(id=f"00000000-0000-0000-0000-00000000000{i}", name=f"p.s{i}", labels={QUEUED_BY_LABEL: who} if who else {})

    runs = [run(1, "dead"), run(2, "live"), run(3, "me"), run(4, "me"), run(5, None)]
    queries, states = [], {}

    async def read_flow_runs(**kw):
        queries.append(kw)
        return runs

    async def read_workers_for_work_pool(pool):
        return [SimpleNamespace(name="live", status=SimpleNamespace(value="ONLINE")), SimpleNamespace(name="dead", status=SimpleNamespace(value="OFFLINE"))]

    async def read_flow_run(fid):
        return SimpleNamespace(state=SimpleNamespace(is_final=lambda: False))

    async def set_flow_run_state(fid, st, force=False):
        states[str(fid)] = st

    w = QosflowWorker(work_pool_name="orphans-test", name="me")
    w._client = SimpleNamespace(read_flow_runs=read_flow_runs, read_workers_for_work_pool=read_workers_for_work_pool,
                                read_flow_run=read_flow_run, set_flow_run_state=set_flow_run_state)
    w._in_flight.add(runs[3].id)  # this process holds s4
    asyncio.run(w._recover_orphans())
    assert sorted(states) == [runs[0].id, runs[2].id]
    assert all(st.is_scheduled() for st in states.values())
    assert "worker dead is offline" in states[runs[0].id].message and "earlier process of worker me" in states[runs[2].id].message
    assert [r["orphan_of"] for r in w.recovered] == ["dead", "me"]
    [q] = queries
    assert q["work_pool_filter"].name.any_ == ["orphans-test"] and q["limit"] <= 200


@pytest.mark.parametrize("state, holder, labelled, dropped", [
    ("SCHEDULED", None, False, True),     # put back in the pool's queue (e.g. by a worker that took this one for dead)
    ("COMPLETED", None, False, True),
    ("PENDING", "other", True, True),     # another worker has taken it since this one labelled it
    ("PENDING", "other", False, False),   # this worker's label is not written yet: an old holder's is still there
    ("PENDING", "me", True, False),
])
def test_a_queued_stage_taken_elsewhere_leaves_this_workers_queue(state, holder, labelled, dropped):
    from types import SimpleNamespace

    from prefect.client.schemas.objects import StateType

    from qosflow.prefect.scheduler import QoSScheduler, StageCancelled, StageEntry
    from qosflow.prefect.worker import QUEUED_BY_LABEL, QosflowWorker

    fid = "00000000-0000-0000-0000-0000000000aa"
    fr = SimpleNamespace(id=fid, labels={QUEUED_BY_LABEL: holder} if holder else {},
                         state=SimpleNamespace(type=StateType[state], name=state.title(), is_final=lambda: state == "COMPLETED"))

    async def read_flow_runs(**kw):
        return [fr]

    async def go():
        w = QosflowWorker(work_pool_name="drop-test", name="me")
        w._client = SimpleNamespace(read_flow_runs=read_flow_runs)
        cl = ClusterSpec.uniform(1, 1, virtual=True, cpu_cores=2)
        w.scheduler = sched = QoSScheduler(cl, get_policy("fifo"), coda=False)
        sched.state.allocate(Placement("busy", ((0, 0),), cpu=((0, 1.0),)), QoSSpec(gpus=1, cpu_cores=1.0))  # the GPU is taken: it waits
        e = StageEntry(JobState(Job(fid, 0.0, QoSSpec(gpus=1, cpu_cores=1.0), duration=5.0)), "s", fid)
        if labelled:
            w._queued_labelled.add(fid)
        sched.start()
        req = asyncio.ensure_future(sched.request(e))
        watch = asyncio.ensure_future(w._watch_cancellations())
        try:
            await asyncio.sleep(1.6)
            if dropped:
                with pytest.raises(StageCancelled):
                    await asyncio.wait_for(req, 1)
            else:
                assert not req.done() and fid in sched.entries
        finally:
            watch.cancel()
            req.cancel()
            await sched.stop()

    asyncio.run(go())


def test_a_bad_unreported_end_grace_is_an_error_naming_it(monkeypatch):
    """Read when the worker sets up (so a bad value fails the set-up, not the end of the first stage)."""
    from qosflow.errors import QosflowError
    from qosflow.prefect.worker import unreported_grace_s

    monkeypatch.delenv("QOSFLOW_UNREPORTED_END_GRACE_S", raising=False)
    assert unreported_grace_s() == 120.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("QOSFLOW_UNREPORTED_END_GRACE_S", bad)
        with pytest.raises(QosflowError, match=f"QOSFLOW_UNREPORTED_END_GRACE_S='{bad}': expected a number >= 0"):
            unreported_grace_s()


def test_a_stage_gives_back_its_lease_before_the_policy_may_place_another_stage_on_its_slot():
    """CI failure: the worker freed the policy's slot first and released the lease after (in a thread); a
    stage placed on the slot in between found the old lease and was refused (its early check was skipped).
    The lease goes first, and the policy's slot is freed even if the release fails."""
    from types import SimpleNamespace

    from qosflow.prefect.worker import QosflowWorker

    order: list[str] = []

    class Leases:
        def release(self, lid):
            order.append(f"lease {lid}")
            if lid == "L2":
                raise RuntimeError("database is away")

    w = QosflowWorker(work_pool_name="free-test")
    w.leases = Leases()
    w.scheduler = SimpleNamespace(release=lambda fid, ok: order.append(f"slot {fid} {ok}"))
    w._lease_ids.update(a="L1", b="L2", c="L3")
    asyncio.run(w._free("a", ok=True))
    asyncio.run(w._free("b", ok=False))  # the release fails: the lease expires; the slot is still freed
    asyncio.run(w._free("c", ok=True, lease=False))  # left running at a stop: the next worker adopts its lease
    assert order == ["lease L1", "slot a True", "lease L2", "slot b False", "slot c True"]
    assert w._lease_ids == {"c": "L3"}


def test_an_adopted_stage_gives_back_its_lease_before_the_policy_may_place_another_stage_on_its_slot():
    """The same race as `_free`'s, in the stages a restarted worker adopted: their watcher freed the
    policy's slot first and released the lease after (in a thread), so a waiting stage placed on the slot
    in between was refused its lease and planned again. The lease goes first there too; a stage the
    policy could not take in (not allocated) only gives back its lease, and a stop keeps it."""
    from types import SimpleNamespace

    from qosflow.backends.base import ExitKind, ExitStatus, StageHandle
    from qosflow.prefect.worker import QosflowWorker

    order: list[str] = []

    class Leases:
        def release(self, lid):
            order.append(f"lease {lid}")

    class Backend:
        async def wait(self, handle):
            return ExitStatus(ExitKind.CANCELLED, None, "ended")

    w = QosflowWorker(work_pool_name="adopted-free-test")
    w.leases, w._backend = Leases(), Backend()
    w.scheduler = SimpleNamespace(release=lambda fid, ok: order.append(f"slot {fid} {ok}"))
    for fid, lid in (("a", "L1"), ("b", "L2")):
        w._lease_ids[fid] = lid
        w._register(fid, StageHandle(fid, "agent", "h", ref={}))
    asyncio.run(w._watch_adopted("a", w._handles["a"], allocated=True))
    asyncio.run(w._watch_adopted("b", w._handles["b"], allocated=False))
    assert order == ["lease L1", "slot a True", "lease L2"]
    assert w._handles == {} and w._lease_ids == {}


def test_a_kill_that_fails_does_not_end_the_workers_watch_for_cancelled_runs(caplog):
    """A cancelled stage whose kill raised (its agent or the API server away) ended the worker's
    cancellation watch: no later cancel was acted on, silently. The run stays Cancelling, the kill is
    tried again at the next round (said once), and other runs' cancels go on being acted on."""
    import logging
    import uuid
    from types import SimpleNamespace

    from prefect.client.schemas.objects import StateType

    from qosflow.backends.base import StageHandle
    from qosflow.prefect.worker import QosflowWorker

    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    killed: list[str] = []
    tries = {"n": 0}

    class Backend:
        async def kill(self, handle, reason="", grace=None):
            if handle.stage_id == a:
                tries["n"] += 1
                if tries["n"] < 3:
                    raise ConnectionError("agent host0 does not answer")
            killed.append(handle.stage_id)

    cancelling = SimpleNamespace(type=StateType.CANCELLING, name="Cancelling", is_final=lambda: False)
    marked: list[str] = []

    class Client:
        async def read_flow_runs(self, flow_run_filter=None, **kw):
            ids = [i for i in (a, b) if i not in marked]
            return [SimpleNamespace(id=uuid.UUID(i), state=cancelling, labels={}) for i in ids]

        async def set_flow_run_state(self, fid, state, force=False):
            marked.append(str(fid))

    w = QosflowWorker(work_pool_name="cancel-watch-test")
    w._backend, w._client = Backend(), Client()
    w.scheduler = SimpleNamespace(entries={}, drop=lambda fid, why: None)
    for fid in (a, b):
        w._register(fid, StageHandle(fid, "agent", "host0", ref={}))

    async def watch():
        task = asyncio.ensure_future(w._watch_cancellations())
        for _ in range(100):
            await asyncio.sleep(0.1)
            if a in marked:
                break
        assert not task.done(), task.exception() if task.done() else None
        task.cancel()

    with caplog.at_level(logging.WARNING):
        asyncio.run(watch())
    assert killed[0] == b and killed[1:] == [a] and tries["n"] == 3  # b at once, a at its third try
    assert sorted(marked) == sorted([a, b])
    said = [r.getMessage() for r in caplog.records if "could not stop it yet" in r.getMessage()]
    assert len(said) == 1 and a in said[0] and "agent host0 does not answer" in said[0]


def test_a_stage_cancelled_while_it_is_being_launched_is_killed_once_launched_not_dropped():
    """A stage run set Cancelling after the policy placed it but before its process was registered (its
    lease and launch under way): the watch dropped it from the scheduler, which freed its slot while the
    process was still started, and marked the run Cancelled, so that process was never killed. It is
    left alone until its handle is registered, then killed and marked Cancelled."""
    import uuid
    from types import SimpleNamespace

    from prefect.client.schemas.objects import StateType

    from qosflow.backends.base import StageHandle
    from qosflow.core.job import JobStatus
    from qosflow.prefect.worker import QosflowWorker

    fid = str(uuid.uuid4())
    killed: list[str] = []
    dropped: list[str] = []
    marked: list[str] = []

    class Backend:
        async def kill(self, handle, reason="", grace=None):
            killed.append(handle.stage_id)

    cancelling = SimpleNamespace(type=StateType.CANCELLING, name="Cancelling", is_final=lambda: False)

    class Client:
        async def read_flow_runs(self, flow_run_filter=None, **kw):
            return [] if fid in marked else [SimpleNamespace(id=uuid.UUID(fid), state=cancelling, labels={})]

        async def set_flow_run_state(self, flow_run_id, state, force=False):
            marked.append(str(flow_run_id))

    w = QosflowWorker(work_pool_name="cancel-launching-test")
    w._backend, w._client = Backend(), Client()
    placed = SimpleNamespace(state=SimpleNamespace(status=JobStatus.RUNNING))  # granted: its lease and launch under way
    w.scheduler = SimpleNamespace(entries={fid: placed}, drop=lambda f, why: dropped.append(f))

    async def watch():
        task = asyncio.ensure_future(w._watch_cancellations())
        await asyncio.sleep(2.3)  # two rounds while it is being launched
        assert (dropped, marked, killed) == ([], [], [])
        w._register(fid, StageHandle(fid, "local", "host0", ref={"pid": 12345}))  # launched
        for _ in range(30):
            await asyncio.sleep(0.1)
            if marked:
                break
        task.cancel()

    asyncio.run(watch())
    assert (killed, marked, dropped) == ([fid], [fid], [])


def test_processes_a_local_stage_leaves_behind_end_with_it(tmp_path):
    """`sh -c 'sleep 600 &'` on the local backend: the stage ended, the worker freed its slot, and the
    sleep ran on (kill() and aclose() only look for registered processes), on a GPU given to others."""
    import asyncio
    import os
    import signal
    import time

    out = tmp_path / "left"

    async def go():
        be = LocalBackend(stream_output=False, workdir=str(tmp_path))
        handle = await be.launch_unplaced("s1", ["sh", "-c", f"sleep 600 & echo $! > {out}"], {})
        status = await be.wait(handle)
        await be.aclose()
        return status

    from procs import alive

    assert asyncio.run(go()).ok
    left = int(out.read_text())
    try:
        deadline = time.monotonic() + 5
        while alive(left) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(left)
    finally:
        if alive(left):
            os.kill(left, signal.SIGKILL)


def test_a_worker_of_a_pool_that_does_not_exist_names_the_pool_it_likely_meant(prefect_server):
    from types import SimpleNamespace

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from qosflow.prefect.worker import QosflowWorker

    said: list[str] = []

    async def go():
        async with get_client() as c:
            await c.create_work_pool(WorkPoolCreate(name="explain-gpu", type="qosflow"))
        w = QosflowWorker(work_pool_name="explain-gpus")
        w._logger = SimpleNamespace(error=lambda m, *a: said.append(m % a))
        await w._explain_missing_pool()

    asyncio.run(go())
    [msg] = said
    assert "work pool 'explain-gpus' does not exist" in msg and "did you mean 'explain-gpu'?" in msg
    assert msg.endswith("this worker takes the pool's runs as soon as it exists")


def test_runs_told_to_cancel_are_not_remembered_for_ever():
    """A stage run cancelled from outside that crashed without the worker's Cancelled was put in a
    module-level set (so that the pipeline says 'cancelled', not 'crashed'), one entry per such run for
    the life of the process: a flow server running pipelines nightly only ever added to it. The entry
    now goes when the pipeline reads it; what it is for stays (StageCancelled)."""
    import time
    import uuid
    from types import SimpleNamespace

    from prefect.states import Cancelling, Crashed

    from qosflow.prefect import tasks
    from qosflow.prefect.tasks import StageCancelled, StageRecord, _settled_after_cancel, _stage_error

    class Client:
        def read_flow_run_states(self, _id):
            return [Cancelling(), Crashed(message="Execution was aborted by a termination signal.")]

        def read_flow_run(self, _id):
            return fr

    before = set(tasks._TOLD_TO_CANCEL)
    for _ in range(50):
        fr = SimpleNamespace(id=uuid.uuid4(), state=Crashed(message="Execution was aborted by a termination signal."))
        got = _settled_after_cancel(Client(), fr, wait_s=0)
        assert str(fr.id) in tasks._TOLD_TO_CANCEL
        rec = StageRecord("train", "tr", (), 1.0, 0.5, time.time(), None)
        rec.flow_run_id = str(fr.id)
        assert isinstance(_stage_error(got.state, "train", rec), StageCancelled)
    assert tasks._TOLD_TO_CANCEL == before


def test_a_worker_thread_whose_worker_fails_at_start_says_so_in_wait_ready(monkeypatch):
    """WorkerThread set `ready` before it raised its worker's start error: wait_ready(), woken by it,
    could read no error yet and return a thread whose worker had failed (widened here by an Event
    whose set() lingers after setting)."""
    import threading
    import time

    from qosflow.prefect import local
    from qosflow.prefect.worker import QosflowWorker

    async def fails(self, **kw):
        raise RuntimeError("the pool went away")

    monkeypatch.setattr(QosflowWorker, "start", fails)

    class LingeringEvent(threading.Event):
        def set(self):
            super().set()
            time.sleep(0.5)

    t = local.WorkerThread("no-such-pool")
    t.ready = LingeringEvent()
    with pytest.raises(RuntimeError, match="the pool went away"):
        t.wait_ready(30)
    t.join(10)


def test_the_in_process_history_of_pipeline_runs_is_bounded():
    """PipelineRun.finished kept every pipeline run a process ever ran (its stages' records with it): a
    flow server running pipelines nightly only ever added to it. It keeps the last FINISHED_KEPT."""
    from qosflow.prefect.tasks import PipelineRun

    kept = PipelineRun.FINISHED_KEPT
    before = list(PipelineRun.finished)
    try:
        for i in range(kept + 5):
            run = PipelineRun(f"p{i}", f"fid{i}", deadline=None, priority=None, pool=None, plan=None, expected={})
            run.register()
            run.unregister()
        assert len(PipelineRun.finished) == kept and PipelineRun.finished[-1].name == f"p{kept + 4}"
        assert PipelineRun.current() is None and not any(k.startswith("fid") for k in PipelineRun._by_flow_run)
    finally:
        PipelineRun.finished.clear()
        PipelineRun.finished.extend(before)


def test_a_damaged_plans_file_is_written_anew(tmp_path, monkeypatch):
    """A pipeline remembers its stage DAG in plans.json for the next run's deadline split. A file that did
    not parse (a disk that filled up mid-write, two pipelines of one process writing the same temporary
    file) made every later run give up on it silently: no plan was ever recorded again."""
    import json
    import time

    from qosflow.prefect.tasks import PipelineRun, StageRecord, _recorded_plan

    monkeypatch.setenv("QOSFLOW_HOME", str(tmp_path))
    plans = tmp_path / "prefect" / "plans.json"
    plans.parent.mkdir(parents=True)
    plans.write_text('{"other": {"plan": {"a": []}, "exp')
    run = PipelineRun("nightly", "fid", deadline=None, priority=None, pool=None, plan=None, expected={})
    run.stages["load"] = StageRecord("load", None, (), 5.0, 0.5, time.time())
    run.stages["train"] = StageRecord("train", None, ("load",), 20.0, 0.5, time.time())
    run.state = "completed"
    run._remember_plan()
    assert json.loads(plans.read_text())["nightly"]["plan"] == {"load": [], "train": ["load"]}
    assert _recorded_plan("nightly")[0] == {"load": [], "train": ["load"]}


def test_the_local_servers_database_and_log_are_private_to_its_user(tmp_path):
    """`qosflow demo` (LocalServer) kept the Prefect server's SQLite database 0644 in a 0755 home: it
    holds the blocks (a cluster file's agent token among them) and the key Prefect encrypts them with,
    so any user of the machine could read the token and launch commands through the agents. A home
    LocalServer makes is 0700, its new database 0600 (SQLite's -wal and -shm follow) and its log 0600."""
    import os
    import stat

    from qosflow.prefect.local import LocalServer

    old = os.umask(0o022)
    try:
        server = LocalServer(tmp_path / "demo" / "prefect", ui=False)
    finally:
        os.umask(old)
    home = tmp_path / "demo" / "prefect"
    try:
        server.start()
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in home.iterdir() if p.name.startswith(("prefect.db", "server.log"))}
    finally:
        server.stop()
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert "prefect.db" in modes and "server.log" in modes
    assert modes == {name: 0o600 for name in modes}, modes


def test_a_local_stage_killed_after_it_ended_signals_no_other_process(monkeypatch):
    """LocalBackend.kill() of a stage wait() had already reaped (the cancel watch kills a run's handle until
    the run is marked Cancelled, after its process ended) signalled the handle's pid and its process
    group: a pid free again, and maybe another process's by then. It now leaves an ended stage alone."""
    import signal
    import sys

    from qosflow.backends import local as local_mod
    from qosflow.backends.base import LaunchSpec

    async def go():
        be = LocalBackend(ClusterSpec.uniform(1, 1, virtual=True), stream_output=False)
        cluster = await be.inventory()
        p = Placement("s1", ((0, 0),), ((0, 1.0),))
        h = await be.launch(LaunchSpec("s1", [sys.executable, "-c", "pass"], p, cluster))
        st = await be.wait(h)
        sent = []
        monkeypatch.setattr(local_mod, "kill_tree", lambda pid, sig: sent.append((pid, sig)))
        await be.kill(h, "flow run cancelled", grace=0)
        await be.aclose()
        return st, sent, be._killed

    st, sent, killed = asyncio.run(go())
    assert st.ok and sent == [] and killed == {}, (st, sent, signal.SIGKILL)


def test_a_pipeline_whose_end_cannot_be_recorded_keeps_its_result_and_leaves_no_run_behind(prefect_server, monkeypatch):
    """qos_flow called run.finish() then run.unregister() in its finally: a finish() that raised (the server
    away while its artifacts and events were written) replaced the pipeline's own result with that error,
    and left the run registered, so PipelineRun.current() answered it ever after in the process."""
    from qosflow.prefect.tasks import PipelineRun, qos_flow

    def broken_finish(self, ok):
        raise RuntimeError("the server went away")

    monkeypatch.setattr(PipelineRun, "finish", broken_finish)

    @qos_flow(name="end-not-recorded")
    def pipeline():
        return 42

    assert pipeline() == 42
    assert PipelineRun.current() is None
    assert not any(r.flow_name == "end-not-recorded" for r in PipelineRun._by_flow_run.values())
    assert PipelineRun.finished[-1].flow_name == "end-not-recorded"


def test_the_group_of_a_reaped_local_stage_with_nothing_left_is_not_signalled(tmp_path, monkeypatch):
    """The local backend SIGKILLed a stage's process group after its leader was reaped, also when nothing
    was left in it: the group's id was then free, and may have been another process's group already (pid
    reuse; qosflow.procgroup). A group with members left is still killed (the test above)."""
    import asyncio

    import qosflow.backends.local as local_mod

    sent = []
    real = local_mod.kill_group
    monkeypatch.setattr(local_mod, "kill_group", lambda pg, *a: sent.append(pg) or real(pg, *a))

    async def go():
        be = LocalBackend(stream_output=False, workdir=str(tmp_path))
        handle = await be.launch_unplaced("s1", ["true"], {})
        status = await be.wait(handle)
        await be.aclose()
        return status

    assert asyncio.run(go()).ok and sent == []

"""Deployed pipeline runs on a host-agent pool with `pipelines_on: agents` run through an agent, and survive their worker.

Real processes: two `qosflow agent`s (virtual GPUs, `qosflow.agent.testing.AgentProcess`), `qosflow worker start`
subprocesses on a `qosflow` pool that reads them from a cluster file, the session's Prefect server, and a deployment
of `restart_pipelines.deployed` (role pipeline) whose stages take a GPU each. Until 2026-11-27 such a pipeline run
was always a process on the worker's host, adopted only by a worker of the same name on the same host: a worker
whose host was lost, or that was moved to another machine, left it `Running` for ever. With `pipelines_on: agents`
it is a process with no GPU that an agent runs (on the up host with the most free CPU cores), under a lease that
books no slot, adopted by any worker of the pool through the stages' recovery path. Without the setting (or with
`pipelines_on: worker`) nothing changes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from procs import alive, stop_groups
from test_k8s_pipelines import final_state, run_pipeline, wait_for
from test_worker_restart import flow_run_state, marks, pipeline_started_and_stage_running, stop_worker, wait_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
TOKEN = "agent-pipelines-token-5c1e"


@contextmanager
def agents_lab(prefect_server: str, tmp_path: Path, pool: str, pipelines_on: str | None):
    """Agents `small` (2 cores) and `big` (6 cores), 2 virtual GPUs each; a FIFO `qosflow` pool `pool` that reaches
    them through a cluster file (with `pipelines_on:` if given); this test's own lease store. `lab.start(name)` starts
    a worker process named `name`; `lab.agent_stage(host, id)` is what that host's agent says of stage `id` (or None)."""
    from qosflow.agent.testing import AgentProcess
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import setup_pool

    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = pypath
    db = f"sqlite:///{tmp_path / 'leases.db'}"
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": pypath, "QOSFLOW_LEASE_TTL_SECONDS": "6",
           "QOSFLOW_DATABASE_URL": db}
    lab = SimpleNamespace(marker=tmp_path / "marks.jsonl", wlog=tmp_path / "worker.log", procs=[], db=db)
    with ExitStack() as stack:
        agents = {name: stack.enter_context(AgentProcess(name, TOKEN, virtual_gpus=2, args=["--cpu-cores", cores],
                                                         log=tmp_path / f"agent-{name}.log"))
                  for name, cores in (("small", "2"), ("big", "6"))}
        (tmp_path / "token").write_text(TOKEN + "\n")
        cluster = tmp_path / "agents.yaml"
        # (heartbeat_s 2, the default: a heartbeat times out after half of it, and 0.25 s on 2 loaded cores took a
        # host for down now and then, its stage then ran twice)
        cluster.write_text("name: pipes\ntoken_file: token\nheartbeat_s: 2\ngpus_per_host: 2\n"
                           + (f"pipelines_on: {pipelines_on}\n" if pipelines_on else "")
                           + "hosts:\n" + "".join(f"  - {{name: {n}, agent_url: '{a.url}'}}\n" for n, a in agents.items()))
        asyncio.run(setup_pool(pool, policy=QoSPolicy(policy="fifo"), stream_output=False, cluster_file=str(cluster),
                               env={"PYTHONPATH": pypath}))

        def start(name: str) -> subprocess.Popen:
            w = subprocess.Popen([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool, "--name", name], env=env,
                                 stdout=open(lab.wlog, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
            lab.procs.append(w)
            return w

        def agent_stage(host: str, sid: str) -> dict | None:
            r = httpx.get(f"{agents[host].url}/v1/stages/{sid}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
            return r.json() if r.status_code == 200 else None

        lab.start, lab.agents, lab.agent_stage = start, agents, agent_stage
        try:
            yield lab
        finally:
            stop_groups(lab.procs)


def ran_once(lab) -> None:
    ev = sorted((e["event"], e["stage"]) for e in marks(lab.marker))
    assert ev == sorted([("start", "pipeline"), ("start", "a"), ("done", "a"), ("start", "b"), ("done", "b"), ("done", "pipeline")]), \
        f"{ev}\n{lab.wlog.read_text(errors='replace')[-4000:]}"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_deployed_pipeline_runs_through_an_agent_and_completes(prefect_server, tmp_path):
    """With `pipelines_on: agents` the pipeline run is a process of the agent of the host with the most free cores
    (big: 6 against 2), labelled role pipeline, with no GPU; it completes, and its lease (no slot) is released."""
    pool = "agent-pipe-run"
    with agents_lab(prefect_server, tmp_path, pool, "agents") as lab:
        w = lab.start("agent-pipe-w")
        wait_log(lab.wlog, "qosflow worker:", w)
        fid = run_pipeline(pool, lab.marker, 3.0)
        pid = pipeline_started_and_stage_running(lab, w, fid)
        st = lab.agent_stage("big", str(fid))
        assert st is not None and st["labels"].get("qosflow.dev/role") == "pipeline" and st["pid"] == pid, st
        assert lab.agent_stage("small", str(fid)) is None
        assert parent_of(pid) == lab.agents["big"].proc.pid  # (the agent's child, not the worker's)
        assert b"CUDA_VISIBLE_DEVICES=\0" in Path(f"/proc/{pid}/environ").read_bytes()  # no GPU
        from qosflow.store.leases import LeaseStore, pool_key

        [le] = LeaseStore(url=lab.db).pipeline_leases(pool_key(pool, prefect_server))
        assert (le.stage_key, le.backend, le.nodes) == (str(fid), "agent", ["big"]), le
        done = final_state(fid, lab)
        assert done.is_completed(), f"{done.name}: {done.message}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
        ran_once(lab)
        store = LeaseStore(url=lab.db)
        left: list = []

        def released() -> bool:
            left[:] = [(le.stage_key, le.holder, le.is_pipeline) for le in store.leases(pool_key(pool, prefect_server))]
            return not left

        try:
            wait_for("the pipeline's and its stages' leases stayed", released, lab, 60)
        except AssertionError as exc:
            raise AssertionError(f"leases left: {left}\n{exc}") from None
        assert lab.agent_stage("big", str(fid))["state"] == "exited"


def test_pipeline_runs_book_their_cores_and_spread_over_the_hosts(prefect_server, tmp_path):
    """A pipeline run on an agent books the cores its job variables ask for (4 here) in the worker's view, recorded in
    its lease: the first goes to big (6 free cores against small's 2), the second to small (2 free on each now, and
    no pipeline run there yet). Before, a pipeline run booked nothing and every one went to the host with the most
    free cores. Both complete, and their leases (and so their cores) are released."""
    pool = "agent-pipe-spread"
    with agents_lab(prefect_server, tmp_path, pool, "agents") as lab:
        w = lab.start("agent-pipe-s")
        wait_log(lab.wlog, "qosflow worker:", w)
        first = run_pipeline(pool, lab.marker, 3.0, cpu_cores=4)
        wait_for("the first pipeline run never started on big", lambda: lab.agent_stage("big", str(first)), lab, 90)
        second = run_pipeline(pool, tmp_path / "marks-second.jsonl", 3.0, cpu_cores=4)
        wait_for("the second pipeline run never started", lambda: lab.agent_stage("small", str(second)) or lab.agent_stage("big", str(second)), lab, 90)
        assert lab.agent_stage("big", str(second)) is None, "the second pipeline run went to big too: the first's cores were not booked"
        from qosflow.store.leases import LeaseStore, pool_key

        store = LeaseStore(url=lab.db)
        booked = {le.stage_key: (le.placement or {}).get("cpu") for le in store.pipeline_leases(pool_key(pool, prefect_server))}
        assert booked.get(str(first)) == [["big", 4.0]] and booked.get(str(second)) == [["small", 4.0]], booked
        for fid in (first, second):
            done = final_state(fid, lab)
            assert done.is_completed(), f"{done.name}: {done.message}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
        wait_for("pipeline leases stayed", lambda: not store.pipeline_leases(pool_key(pool, prefect_server)), lab, 60)


def test_a_pipeline_on_an_agent_survives_its_worker_to_a_worker_of_another_name(prefect_server, tmp_path):
    """SIGTERM the worker while the pipeline's first stage runs (its host is lost, or it moves to another machine),
    start one with ANOTHER --name: it adopts the pipeline's process on the agent once the old lease expired, watches
    it to its end, and the pipeline and each stage ran once and completed. The old code ran the pipeline on the old
    worker's host, where no worker of another name ever looked at it."""
    pool = "agent-pipe-move"
    with agents_lab(prefect_server, tmp_path, pool, "agents") as lab:
        w1 = lab.start("agent-pipe-old")
        wait_log(lab.wlog, "qosflow worker:", w1)
        fid = run_pipeline(pool, lab.marker, 12.0)
        pid = pipeline_started_and_stage_running(lab, w1, fid)
        assert lab.agent_stage("big", str(fid)) is not None, "the pipeline does not run through the agent"
        stop_worker(w1)
        text = lab.wlog.read_text(errors="replace")
        assert "pipeline run(s) keep running through host agents" in text and str(fid) in text, text[-3000:]
        assert alive(pid) and flow_run_state(fid).is_running()
        from qosflow.prefect.status import pipeline_processes
        from qosflow.store.leases import LeaseStore

        [p], note = pipeline_processes(pool, prefect_server, LeaseStore(url=lab.db))
        assert not note and (p.flow_run_id, p.worker, p.watched, p.host, p.pid) == (str(fid), "agent-pipe-old", "no", "big (agent)", pid), p
        w2 = lab.start("agent-pipe-new")
        wait_log(lab.wlog, f"recovery: adopted pipeline run {fid}", w2, timeout=90)
        [p], _ = pipeline_processes(pool, prefect_server, LeaseStore(url=lab.db))
        assert (p.worker, p.watched) == ("agent-pipe-new", "adopted"), p
        st = final_state(fid, lab)
        assert st.is_completed(), f"{st.name}: {st.message}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
        ran_once(lab)
        assert all(e["pid"] == pid for e in marks(lab.marker) if e["stage"] == "pipeline")
        assert "is marked Crashed" not in lab.wlog.read_text(errors="replace")


@pytest.mark.parametrize("adopted", [False, True], ids=["its-worker", "adopted-by-another"])
def test_cancelling_a_pipeline_on_an_agent_stops_its_process(prefect_server, tmp_path, adopted):
    """`prefect flow-run cancel` (Cancelling) on a pipeline run that an agent runs: the worker kills it through the agent
    (SIGTERM first), the process is gone, the stage it waited for is stopped, and the run ends Cancelled; also when a
    worker of another name adopted it."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    pool = "agent-pipe-cancel-adopted" if adopted else "agent-pipe-cancel"
    with agents_lab(prefect_server, tmp_path, pool, "agents") as lab:
        w = lab.start("agent-cancel-w")
        wait_log(lab.wlog, "qosflow worker:", w)
        fid = run_pipeline(pool, lab.marker, 120.0)
        pid = pipeline_started_and_stage_running(lab, w, fid)
        assert lab.agent_stage("big", str(fid)) is not None
        if adopted:
            stop_worker(w)
            w = lab.start("agent-cancel-w2")
            wait_log(lab.wlog, f"recovery: adopted pipeline run {fid}", w, timeout=90)
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(fid, Cancelling(message="cancelled by the test"))
        wait_for("the pipeline's process was not stopped", lambda: not alive(pid), lab, 60)
        st = lab.agent_stage("big", str(fid))
        assert st["state"] == "exited" and st["killed_reason"], st
        st = wait_for("the run never ended Cancelled", lambda: (s := flow_run_state(fid)).type.value == "CANCELLED" and s, lab, 60)
        assert "the qosflow worker stopped the pipeline run" in (st.message or ""), st.message
        stage_pids = [e["pid"] for e in marks(lab.marker) if e["stage"] == "a"]
        wait_for("stage a's process ran on after its pipeline was cancelled", lambda: not any(alive(p) for p in stage_pids), lab, 60)
        assert w.poll() is None


def test_a_pipeline_process_killed_while_no_worker_ran_ends_crashed(prefect_server, tmp_path):
    """The pipeline's process on the agent is killed (the OOM killer, an operator) while no worker runs: its run could
    not report its end. The next worker (another name) adopts what the agent says of it and marks the run Crashed,
    naming the process and its host."""
    pool = "agent-pipe-killed"
    with agents_lab(prefect_server, tmp_path, pool, "agents") as lab:
        w1 = lab.start("agent-killed-old")
        wait_log(lab.wlog, "qosflow worker:", w1)
        fid = run_pipeline(pool, lab.marker, 60.0)
        pid = pipeline_started_and_stage_running(lab, w1, fid)
        stop_worker(w1)
        os.killpg(pid, signal.SIGKILL)  # (the agent starts it in a session of its own)
        wait_for("the pipeline's process outlived its SIGKILL", lambda: not alive(pid), lab, 30)
        assert flow_run_state(fid).is_running()
        w2 = lab.start("agent-killed-new")
        st = final_state(fid, lab, 90)
        assert st.is_crashed(), f"{st.name}: {st.message}"
        assert f"process {pid} on host big" in st.message and "SIGKILL" in st.message, st.message
        assert w2.poll() is None


def test_without_the_setting_a_pipeline_is_a_process_on_the_workers_host(prefect_server, tmp_path):
    """`pipelines_on: worker` (the default, said explicitly; the old code refused the key): the pipeline run is a
    process on the worker's host, as before: no agent runs it, no pipeline lease, the worker's stop leaves it to a
    worker of the same name."""
    pool = "agent-pipe-worker"
    with agents_lab(prefect_server, tmp_path, pool, "worker") as lab:
        w = lab.start("agent-pipe-here")
        wait_log(lab.wlog, "qosflow worker:", w)
        fid = run_pipeline(pool, lab.marker, 3.0)
        pid = pipeline_started_and_stage_running(lab, w, fid)
        assert lab.agent_stage("big", str(fid)) is None and lab.agent_stage("small", str(fid)) is None
        assert parent_of(pid) not in {a.proc.pid for a in lab.agents.values()}
        from qosflow.store.leases import LeaseStore, pool_key

        store = LeaseStore(url=lab.db)
        assert not store.pipeline_leases(pool_key(pool, prefect_server))
        assert [r.flow_run_id for r in store.pipeline_processes(pool_key(pool, prefect_server))] == [str(fid)]
        st = final_state(fid, lab)
        assert st.is_completed(), f"{st.name}: {st.message}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
        ran_once(lab)


def test_the_setting_in_the_cluster_file_and_block(tmp_path):
    """`pipelines_on:` defaults to worker (as before: the backend does not run pipeline runs), takes agents or a host's
    name, and anything else is an error naming the key; the block's field says the same and reaches the backend. The
    old code refused the key (unknown) and had no such field."""
    import pytest as _pytest

    from qosflow.backends.agent import load_cluster_file
    from qosflow.errors import SpecError
    from qosflow.prefect.blocks import BareMetalGPUCluster

    def cf(extra: str):
        p = tmp_path / "c.yaml"
        p.write_text(f"name: c\ntoken: t\n{extra}hosts:\n  - {{name: gpu-a, agent_url: 'http://127.0.0.1:1'}}\n"
                     "  - {name: gpu-b, agent_url: 'http://127.0.0.1:2'}\n")
        return load_cluster_file(p)

    assert cf("").pipelines_on == "worker" and not cf("").backend().runs_pipelines
    assert cf("pipelines_on: agents\n").backend().runs_pipelines
    be = cf("pipelines_on: gpu-b\n").backend()
    assert be.runs_pipelines and be.pipeline_host({"gpu-a": 8.0, "gpu-b": 1.0}) == "gpu-b"
    with _pytest.raises(SpecError) as e:
        cf("pipelines_on: gpu-z\n")
    assert "pipelines_on" in str(e.value) and "gpu-z" in str(e.value)
    cf("pipelines_on: gpu-a\n")
    assert BareMetalGPUCluster.from_cluster_file(str(tmp_path / "c.yaml")).pipelines_on == "gpu-a"
    b = BareMetalGPUCluster(hosts=["gpu-a", "gpu-b"], backend="agents", agent_url="http://{host}:8701", agent_token="t",
                            pipelines_on="agents")
    assert b.make_backend().runs_pipelines
    with _pytest.raises(ValueError, match="pipelines_on"):
        BareMetalGPUCluster(hosts=["gpu-a"], backend="agents", agent_url="http://{host}:8701", agent_token="t", pipelines_on="nope")
    with _pytest.raises(ValueError, match="needs backend 'agents'"):
        BareMetalGPUCluster(hosts=["gpu-a"], pipelines_on="agents")


@pytest.mark.parametrize("silence_s", [60.0, 0.0], ids=["waits-for-the-host", "no-grace"])
def test_a_pipeline_on_a_host_silent_for_a_moment_is_not_reported_lost(tmp_path, silence_s):
    """A pipeline run's agent that stops answering for a moment (frozen here with SIGSTOP: not a refused connection)
    still runs it: its wait goes on once the host answers again, where a stage's reports the host lost (and is rerun
    elsewhere). Reported lost, the worker marked the run Crashed while its process ran on. With no grace
    (`pipeline_silence_s` 0) it is reported lost as a stage is, which shows that the host was seen down."""
    from qosflow.agent.testing import AgentProcess
    from qosflow.backends.agent import AgentBackend, AgentHost
    from qosflow.backends.base import ExitKind

    async def go(agent) -> tuple:
        be = AgentBackend([AgentHost("solo", agent.url)], TOKEN, heartbeat_s=0.3, request_timeout_s=1.0, poll_s=1.0,
                          pipelines_on="agents")
        be.pipeline_silence_s = silence_s
        try:
            await be.inventory()
            h = await be.launch_unplaced("pipe-1", [sys.executable, "-c", "import time; time.sleep(5)"], {})
            assert not h.ref["launch_error"], h.ref
            waiting = asyncio.ensure_future(be.wait(h))
            await asyncio.sleep(1.0)
            os.kill(agent.proc.pid, signal.SIGSTOP)
            seen_down = False
            try:
                for _ in range(30):
                    await asyncio.sleep(0.1)
                    seen_down = seen_down or not be.state["solo"].up
            finally:
                os.kill(agent.proc.pid, signal.SIGCONT)
            return await asyncio.wait_for(waiting, 30), seen_down
        finally:
            await be.aclose()

    with AgentProcess("solo", TOKEN, virtual_gpus=1, log=tmp_path / "agent.log") as agent:
        status, seen_down = asyncio.run(go(agent))
    assert seen_down
    if silence_s:
        assert status.ok, status
    else:
        assert status.kind is ExitKind.INFRA and "lost" in status.reason, status

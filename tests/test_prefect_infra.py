"""The qosflow worker on real infrastructure: two real agents on 127.0.0.1 as two hosts.

`qosflow agent start --virtual-gpus 4` twice (separate processes), a cluster file naming them, a
`qosflow` pool whose worker reads that file (`cluster_file` job variable), and pipelines sent through
the session's Prefect server (conftest.prefect_server). The worker picks the agents backend, keeps a
lease per placement in the qosflow store, and reruns a stage elsewhere when its host's agent dies.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from procs import marks, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
TOKEN = "infra-test-token-2c9e"
POOL = "infra-agents"






@pytest.fixture(scope="module")
def lab(prefect_server, tmp_path_factory):
    from qosflow.agent.testing import AgentProcess
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    d = tmp_path_factory.mktemp("lab")
    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = pypath  # the agents (and so their stages) inherit it
    agents = {}
    try:
        for name in ("host-a", "host-b"):
            agents[name] = AgentProcess(name, TOKEN, virtual_gpus=4, args=["--cpu-cores", "4"], log=d / f"{name}.log").start()
        (d / "token").write_text(TOKEN + "\n")
        cluster = d / "lab.yaml"
        hosts = "".join(f"  - {{name: {n}, agent_url: '{a.url}'}}\n" for n, a in agents.items())
        cluster.write_text(f"name: lab\ntoken_file: token\nheartbeat_s: 0.5\ngpus_per_host: 4\nhosts:\n{hosts}")
        asyncio.run(setup_pool(POOL, policy=QoSPolicy(policy="fifo", options={"backfill": True}), stream_output=False,
                               cluster_file=str(cluster), env={"PYTHONPATH": pypath}))
        w = WorkerThread(POOL).wait_ready(120)
        os.environ["QOSFLOW_POOL"] = POOL
        yield {"worker": w, "agents": agents, "cluster": cluster, "dir": d}
        os.environ.pop("QOSFLOW_POOL", None)
        w.stop()
    finally:
        for a in agents.values():
            a.stop()


def test_worker_picks_the_agents_backend_from_the_cluster_file(lab):
    w = lab["worker"].worker
    assert w._backend.name == "agent"
    cl = w.scheduler.cluster
    assert [n.name for n in cl.nodes] == ["host-a", "host-b"]
    assert all(n.virtual and n.gpus == 4 and n.address == lab["agents"][n.name].url for n in cl.nodes)
    assert not w.scheduler.state.down.any()
    assert w.leases is not None and w.leases.leases(w._pool_key) == []


def test_pipeline_runs_across_both_hosts(lab, tmp_path):
    import infra_pipelines as ip

    from qosflow.prefect.tasks import PipelineRun

    marker = tmp_path / "marks.jsonl"
    nodes = ip.two_hosts(str(marker), 1.0)
    ev = marks(marker)
    assert nodes == ["host-a", "host-b"], ev  # one 4-GPU shard on each host
    starts = {e["stage"]: e for e in ev if e["event"] == "start"}
    assert {starts["a"]["node"], starts["b"]["node"]} == {"host-a", "host-b"}
    assert len([e for e in ev if e["event"] == "done"]) == 3  # each stage once
    run = PipelineRun.finished[-1]
    assert run.state == "completed"
    assert {r.host for r in run.stages.values()} == {"host-a", "host-b"}
    assert all(r.virtual_gpus for r in run.stages.values())
    # every placement was a lease, released when its stage ended (the worker hears of the exit just
    # after the stage's engine reported Completed)
    w = lab["worker"].worker
    wait_for(lambda: w.leases.leases(w._pool_key) == [])
    assert w.leases.booked(POOL) == []
    ids = {s.flow_run_id for s in run.stages.values()}
    wait_for(lambda: len([r for r in w.records if r["flow_run_id"] in ids]) == 3)
    recs = [r for r in w.records if r["flow_run_id"] in ids]
    assert len(recs) == 3 and all(len(r["attempts"]) == 1 and r["exit"] == "ok" for r in recs)
    # merge reported 3 steps on its host: the worker copied them and learned its step time from them
    est = w.scheduler.estimator
    assert est.flush(30)
    merge = [h for h in est.store.stage_history() if h.stage_run_id in ids and h.stage.endswith("merge")]
    assert len(merge) == 1 and merge[0].steps == 3 and merge[0].step_time_s > 0, merge
    # and where it ran: its host, one node, its one core, when
    m = merge[0]
    assert m.host in ("host-a", "host-b") and m.placement == "consolidated" and m.cpu_cores == 1, m
    assert m.started_at is not None and m.finished_at is not None and m.started_at < m.finished_at
    [sample] = [x for x in est.store.samples_for(m.signature) if x.stage_run_id == m.stage_run_id]
    assert (sample.cpu_cores, sample.placement, sample.steps) == (1, "consolidated", 3)
    # the worker read the copies of their progress for the last time: none is left behind
    assert not any(os.path.exists(w._backend.progress_file(a["attempt_id"])) for r in recs for a in r["attempts"])


def test_user_error_is_not_retried_elsewhere(lab):
    import infra_pipelines as ip

    from prefect.client.orchestration import get_client
    from qosflow.prefect.tasks import PipelineRun

    with pytest.raises(Exception, match="bad input 7"):
        ip.user_error()
    run = PipelineRun.finished[-1]
    rec = next(iter(run.stages.values()))
    assert rec.state == "failed" and rec.attempts == 1  # retries=0: once
    w = lab["worker"].worker
    wait_for(lambda: any(r["flow_run_id"] == rec.flow_run_id for r in w.records))
    wr = next(r for r in w.records if r["flow_run_id"] == rec.flow_run_id)
    # the stage's engine reported the exception itself (the process then exits normally): no
    # infrastructure failure, so the worker did not rerun it on another slot
    assert wr["exit"] != "infra" and len(wr["attempts"]) == 1
    with get_client(sync_client=True) as c:
        st = c.read_flow_run(rec.flow_run_id).state
        assert st.is_failed() and "bad input 7" in st.message


def _stage_run_of_last_pipeline():
    from prefect.client.orchestration import get_client

    from qosflow.prefect.tasks import PipelineRun

    [rec] = PipelineRun.finished[-1].stages.values()
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(rec.flow_run_id)
        return fr, c.read_flow_run_states(fr.id)


def _run_logs(fid) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as c:
        return [x.message for x in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fid])))]


def _both_hosts_up(lab) -> None:
    """The gang tests need both hosts: an agent a test killed (the agent-killing test below) is started again, on its port,
    and the worker has seen it up, so that they do not depend on running before that test."""
    for a in lab["agents"].values():
        if a.proc is None or a.proc.poll() is not None:
            a.start()
    w = lab["worker"].worker
    wait_for(lambda: not w.scheduler.state.down.any(), 60)


def test_a_gang_across_two_hosts_reports_its_run_once(lab, tmp_path):
    """(Both hosts up: `_both_hosts_up`.) An 8-GPU gang on two 4-GPU hosts runs one process per host. Each ran Prefect's engine for the one flow run: it
    went Running twice and Completed twice (run_count 2), every engine line was logged twice, two results and two
    progress artifacts were written and the pipeline got whichever rank's return value came last. Now every rank runs
    the stage's function, and rank 0 alone reports."""
    import prefect_pipelines as pp

    _both_hosts_up(lab)
    marker = tmp_path / "marks.jsonl"
    assert pp.wide_gang_pipeline(str(marker)) == "rank 0"
    ranks = sorted((e["rank"], e["node"]) for e in marks(marker))
    assert ranks == [("0", "host-a"), ("1", "host-b")] or ranks == [("0", "host-b"), ("1", "host-a")], ranks
    fr, states = _stage_run_of_last_pipeline()
    kinds = [s.type.value for s in states]
    assert fr.state.is_completed() and fr.run_count == 1, (fr.state, fr.run_count)
    assert kinds.count("RUNNING") == 1 and kinds.count("COMPLETED") == 1, kinds
    # (the run's log as its ranks left it: read once the gang's processes have exited, each having sent its lines; the
    # pipeline returns when rank 0's engine reports Completed, before its last line reaches the server)
    w = lab["worker"].worker
    wait_for(lambda: any(r["flow_run_id"] == str(fr.id) for r in w.records))
    logs = _run_logs(fr.id)
    assert sum(m.startswith("Beginning subflow run") for m in logs) == 1, logs
    assert sum(m.startswith("Finished in state") for m in logs) == 1, logs
    assert sum("rank 1 of 2 on host-" in m and "runs the stage's function" in m for m in logs) == 1, logs


def test_a_gang_rank_that_fails_fails_the_run_with_its_exception(lab, tmp_path):
    """A rank other than 0 that raises reports the run Failed with its exception (the pipeline raises it) and its
    traceback on the run's log; its gang's rank 0, stopped then, does not report Crashed over it."""
    import prefect_pipelines as pp

    _both_hosts_up(lab)
    marker = tmp_path / "marks.jsonl"
    with pytest.raises(ValueError, match="rank 1 found bad data"):
        pp.wide_gang_pipeline(str(marker), fail_rank="1")
    fr, states = _stage_run_of_last_pipeline()
    w = lab["worker"].worker
    wait_for(lambda: any(r["flow_run_id"] == str(fr.id) for r in w.records))  # (the gang has ended: rank 0 was stopped)
    fr, states = _stage_run_of_last_pipeline()
    assert fr.state.is_failed(), (fr.state, [s.name for s in states])
    assert fr.state.message.startswith("qosflow gang: rank 1 of 2 on host-") and "ValueError: rank 1 found bad data" in fr.state.message
    logs = _run_logs(fr.id)
    failed = [m for m in logs if "rank 1 of 2 on host-" in m and "failed: ValueError: rank 1 found bad data" in m]
    assert len(failed) == 1 and "Traceback" in failed[0], logs
    assert [s.type.value for s in states].count("RUNNING") == 1
    assert "CRASHED" not in [s.type.value for s in states], [s.name for s in states]

def test_agent_killed_midstage_stage_completes_elsewhere_once(lab, tmp_path):
    """SIGKILL the agent whose host runs the stage: the worker marks the host down, the policy places the
    stage on the other host, it completes there; the killed copy died with its agent; nothing runs twice."""
    import threading

    import infra_pipelines as ip

    from prefect.client.orchestration import get_client
    from qosflow.prefect.tasks import PipelineRun

    marker = tmp_path / "lost.jsonl"
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("r", ip.agent_lost(str(marker), 6.0)), daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while not [e for e in marks(marker) if e["event"] == "start"]:
        assert time.monotonic() < deadline and th.is_alive(), "the stage never started"
        time.sleep(0.1)
    first = marks(marker)[0]
    victim = first["node"]
    other = "host-b" if victim == "host-a" else "host-a"
    w = lab["worker"].worker
    [lease] = w.leases.leases(w._pool_key)
    assert lease.nodes == [victim] and lease.handle is not None  # the running attempt holds a lease
    lab["agents"][victim].kill(signal.SIGKILL)
    killed_at = time.time()
    th.join(180)
    assert not th.is_alive()
    assert out.get("r") == other
    ev = marks(marker)
    starts = [e for e in ev if e["event"] == "start"]
    dones = [e for e in ev if e["event"] == "done"]
    assert [s["node"] for s in starts] == [victim, other]
    assert [d["node"] for d in dones] == [other]  # finished exactly once
    assert starts[1]["attempt"] == starts[0]["attempt"] + "-r1"
    with pytest.raises(ProcessLookupError):
        os.kill(first["pid"], 0)  # the first copy died with its agent
    idx = w.scheduler.cluster.index_of(victim)
    assert w.scheduler.state.down[idx]  # heartbeats marked the host down
    assert any(h == victim and what == "down" for _, h, what in w.node_events)
    run = PipelineRun.finished[-1]
    rec = next(iter(run.stages.values()))
    wait_for(lambda: any(r["flow_run_id"] == rec.flow_run_id for r in w.records))
    wr = next(r for r in w.records if r["flow_run_id"] == rec.flow_run_id)
    assert [a["host"] for a in wr["attempts"]] == [victim, other]
    assert wr["attempts"][0]["exit"] == "infra" and victim in wr["attempts"][0]["exit_reason"]
    assert wr["attempts"][1]["launched"] > killed_at
    wait_for(lambda: w.leases.leases(w._pool_key) == [])
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(rec.flow_run_id)
        assert fr.state.is_completed() and fr.labels["qosflow.host"] == other


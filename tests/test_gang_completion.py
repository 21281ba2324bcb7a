"""A gang placed on several hosts: its flow run is Completed only when every rank has ended well, and what its other
ranks print reaches the run's log (qosflow/prefect/gang_rank.py).

Two real agents on 127.0.0.1 as two 4-GPU hosts (as tests/test_prefect_infra.py), a `qosflow` pool whose worker reads
their cluster file, and pipelines sent through the session's Prefect server (conftest.prefect_server); an 8-GPU gang
runs one rank per host. Until 2026-11-28 rank 0's engine reported the run Completed as soon as its own function
returned: the pipeline went on while rank 1 still ran, and a rank that failed after that left the run Completed."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from procs import marks, wait_for

HERE = Path(__file__).resolve().parent
TOKEN = "gang-completion-token-5d1e"
POOL = "gang-completion"






# ------------------------------------------------------------------------------------------------ without a server
class _Client:
    def __init__(self) -> None:
        self.logs: list = []

    def create_logs(self, logs) -> None:
        self.logs.extend(logs)


def test_a_ranks_output_reaches_the_runs_log_bounded():
    """The forwarder's bound: at most `max_lines` lines sent as they come; past that only the last `tail`, when the rank
    ends, after a line saying how many were left out; a long line cut; a progress bar's line as last drawn."""
    from qosflow.prefect.gang_rank import _OutputForwarder

    f = _OutputForwarder(uuid.uuid4(), "rank 1 of 2 on gpu-b", max_lines=3, tail=2, line_chars=20)
    c = _Client()
    f._add([b"one", b"", b"two\r", b" 10%\r 50%\r100%"], "stdout")
    f._send(c)
    assert [x.message for x in c.logs] == ["rank 1 of 2 on gpu-b: one", "rank 1 of 2 on gpu-b: two",
                                          "rank 1 of 2 on gpu-b: 100%"]
    f._add([b"x" * 25] + [f"line {i}".encode() for i in range(5)], "stderr")
    f._send(c, last=True)
    said = [x.message for x in c.logs[3:]]
    assert said == ["rank 1 of 2 on gpu-b: printed 6 line(s) more than the 3 sent to this log; its last 2 follow; all are in "
                    "its agent's or pod's log", "rank 1 of 2 on gpu-b (stderr): line 3", "rank 1 of 2 on gpu-b (stderr): line 4"], said
    assert all(x.level == 20 and x.name == "qosflow.gang" for x in c.logs)
    g = _OutputForwarder(uuid.uuid4(), "r", line_chars=20)
    g._add([b"y" * 25], "stdout")
    assert g._pending[0][2] == "y" * 20 + " [... 5 characters cut]"


def test_only_rank_0_of_a_gang_waits_for_its_other_ranks(monkeypatch):
    """Rank 0 of a gang of two wraps its engine's success (the wait); rank 0 of a gang of one, or a process with no
    rank (a stage on one host, were it run through this module), runs Prefect's engine untouched."""
    import runpy

    from prefect.flow_engine import FlowRunEngine

    import qosflow.prefect.gang_rank as gr

    before = FlowRunEngine.handle_success, FlowRunEngine.handle_crash
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: None)
    try:
        for env, waits in (({}, False), ({"QOSFLOW_GANG_RANK": "0", "QOSFLOW_GANG_SIZE": "1"}, False),
                           ({"QOSFLOW_GANG_SIZE": "2"}, False), ({"QOSFLOW_GANG_RANK": "0", "QOSFLOW_GANG_SIZE": "2"}, True)):
            FlowRunEngine.handle_success = before[0]
            for k in ("QOSFLOW_GANG_RANK", "QOSFLOW_GANG_SIZE"):
                monkeypatch.delenv(k, raising=False)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            assert gr.main(["gang_rank"]) == 0
            assert getattr(FlowRunEngine.handle_success, "_qosflow_gang", False) is waits, env
    finally:
        FlowRunEngine.handle_success, FlowRunEngine.handle_crash = before


def test_a_flow_called_by_rank_0s_function_does_not_wait_for_the_other_ranks(monkeypatch):
    """The stage's function calls a Prefect flow on rank 0: that flow's engine (a subflow run, whose end no rank writes)
    reports its own success at once; only the gang's run waits (the subflow waited for ever, and rank 0 with it)."""
    import logging
    from types import SimpleNamespace

    from prefect.flow_engine import FlowRunEngine

    import qosflow.prefect.gang_rank as gr

    class Stop(BaseException):
        pass

    def read_flow_run(fid):
        raise Stop(f"waits for the ranks of {fid}")

    reported: list = []
    before = FlowRunEngine.handle_success
    monkeypatch.setattr(FlowRunEngine, "handle_success", lambda self, result: reported.append(self.flow_run.id) or result)
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "gang-run")
    try:
        gr._wait_before_reporting(2)
        client = SimpleNamespace(read_flow_run=read_flow_run, read_flow_run_states=lambda fid: [])

        def engine(fid):
            return SimpleNamespace(flow_run=SimpleNamespace(id=fid), client=client, logger=logging.getLogger("t"))

        assert FlowRunEngine.handle_success(engine("subflow-run"), 7) == 7 and reported == ["subflow-run"]
        with pytest.raises(Stop, match="gang-run"):
            FlowRunEngine.handle_success(engine("gang-run"), 7)
    finally:
        FlowRunEngine.handle_success = before


def test_an_end_label_of_another_attempt_does_not_count():
    from qosflow.prefect.gang_rank import _ended_ranks

    labels = {"qosflow.gang.rank1.ended": "ok@fid-r1", "qosflow.gang.rank2.ended": "exit 3@fid", "other": 1}
    assert _ended_ranks(labels, 3, "fid") == {2: "exit 3"}
    assert _ended_ranks(labels, 3, "fid-r1") == {1: "ok"}
    assert _ended_ranks(None, 3, "fid") == {}


class _Labels:
    """A run's labels as Prefect's server merges them (read the row, then write it), with another rank's merge that
    read the row before this rank's write committing just after this rank's first reading (PostgreSQL: no conflict)."""

    def __init__(self) -> None:
        self.labels: dict = {"qosflow.host": "host-a"}
        self.before: dict = {}
        self.raced = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update_flow_run_labels(self, fid, labels) -> None:
        self.before, self.labels = dict(self.labels), {**self.labels, **labels}

    def read_flow_run_states(self, fid) -> list:
        return []

    def read_flow_run(self, fid):
        from types import SimpleNamespace

        out = SimpleNamespace(id=fid, labels=dict(self.labels))
        if not self.raced:
            self.raced = True
            self.labels = {**self.before, "qosflow.gang.rank2.ended": "ok@fid"}
        return out


def test_an_end_label_dropped_by_a_concurrent_merge_is_written_again(monkeypatch):
    """Ranks 1 and 2 end at the same moment: rank 2's label merge, which read the run before rank 1's label was
    written, commits after rank 1 read its label back. Rank 1 wrote it again (it returned True with its label gone,
    exited 0, and rank 0 waited for it for ever)."""
    import logging

    import prefect.client.orchestration as orch

    from qosflow.prefect.gang_rank import _mark_end

    server = _Labels()
    monkeypatch.setattr(orch, "get_client", lambda **kw: server)
    monkeypatch.setenv("QOSFLOW_STAGE_ID", "fid")
    assert _mark_end("fid", 1, "ok", logging.getLogger("t"), budget_s=20)
    assert server.labels.get("qosflow.gang.rank1.ended") == "ok@fid", server.labels
    assert server.labels.get("qosflow.gang.rank2.ended") == "ok@fid", server.labels


def test_rank_0_counts_an_end_it_has_read_once(monkeypatch):
    """Rank 0 read rank 1's end, then (a concurrent merge dropped it) only rank 2's: every rank has ended (it waited
    for rank 1 again, for ever: rank 1 had exited 0)."""
    import logging
    from types import SimpleNamespace

    import qosflow.prefect.gang_rank as gr

    class Stop(BaseException):
        pass

    readings = [{"qosflow.gang.rank1.ended": "ok@fid"}, {"qosflow.gang.rank2.ended": "ok@fid"}]

    def read_flow_run(fid):
        if not readings:
            raise Stop("rank 0 still waits")
        return SimpleNamespace(state=None, labels=readings.pop(0))

    monkeypatch.setattr(gr, "GANG_WAIT_POLL_S", 0.0)
    monkeypatch.setenv("QOSFLOW_STAGE_ID", "fid")
    engine = SimpleNamespace(flow_run=SimpleNamespace(id="fid"), logger=logging.getLogger("t"),
                             client=SimpleNamespace(read_flow_run=read_flow_run, read_flow_run_states=lambda fid: []))
    assert gr._wait_for_ranks(engine, 3) is True


def test_an_end_label_of_an_earlier_launch_of_the_run_does_not_count(monkeypatch):
    """The run was taken from the queue again (a worker stopped; recovery): its gang runs again with the same
    QOSFLOW_STAGE_ID, and rank 1's label of the earlier launch is still on the run. Rank 0 waits for the label of
    this launch (it reported Completed at once, rank 1 still running)."""
    import logging
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from prefect.client.schemas.objects import StateType

    import qosflow.prefect.gang_rank as gr

    class Stop(BaseException):
        pass

    t0 = datetime(2026, 11, 28, tzinfo=timezone.utc)
    kinds = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.SCHEDULED, StateType.PENDING,
             StateType.RUNNING]
    states = [SimpleNamespace(id=uuid.uuid4(), type=k, timestamp=t0 + timedelta(seconds=i)) for i, k in enumerate(kinds)]
    monkeypatch.setenv("QOSFLOW_STAGE_ID", "fid")
    server = SimpleNamespace(read_flow_run_states=lambda fid: list(reversed(states)))
    assert gr._attempt(server, "fid") == f"fid#{states[4].id}"
    assert gr._ended_ranks({"qosflow.gang.rank1.ended": f"ok@fid#{states[1].id}"}, 2, gr._attempt(server, "fid")) == {}

    readings = [{"qosflow.gang.rank1.ended": f"ok@fid#{states[1].id}"}] * 3 + [{"qosflow.gang.rank1.ended": f"ok@fid#{states[4].id}"}]

    def read_flow_run(fid):
        if not readings:
            raise Stop("rank 0 still waits")
        return SimpleNamespace(state=None, labels=readings.pop(0))

    monkeypatch.setattr(gr, "GANG_WAIT_POLL_S", 0.0)
    engine = SimpleNamespace(flow_run=SimpleNamespace(id="fid"), logger=logging.getLogger("t"),
                             client=SimpleNamespace(read_flow_run=read_flow_run, read_flow_run_states=server.read_flow_run_states))
    assert gr._wait_for_ranks(engine, 2) is True
    assert readings == []  # (it returned at the first reading: the earlier launch's `ok`)


_OS_EXIT_RANK = r"""
import json, logging, os, sys
from types import SimpleNamespace
import prefect.client.orchestration as orch
import prefect.logging.loggers as loggers
import qosflow.prefect.stage as stage
import qosflow.prefect.gang_rank as gr

out = sys.argv[1]
labels = {}

class Client:
    def __enter__(self): return self
    def __exit__(self, *exc): pass
    def read_flow_run(self, fid):
        return SimpleNamespace(id=fid, name="run", parameters={"payload": "k", "stage": "s"}, labels=dict(labels))
    def read_flow_run_states(self, fid): return []
    def update_flow_run_labels(self, fid, new):
        labels.update(new)
        with open(out, "a") as f: f.write(json.dumps({"labels": new}) + "\n")
    def create_logs(self, logs):
        with open(out, "a") as f: f.write(json.dumps({"logs": [x.message for x in logs]}) + "\n")

def fn():
    print("last words", flush=True)
    os._exit(int(sys.argv[2]))

orch.get_client = lambda **kw: Client()
loggers.flow_run_logger = lambda **kw: logging.getLogger("rank")
stage._call = lambda *a: b""
stage._unpack = lambda raw: ((fn, (), {}), True)
os.environ.update(QOSFLOW_STAGE_ID="fid", QOSFLOW_GANG_SIZE="2", QOSFLOW_GANG_HOSTS="host-a,host-b")
sys.exit(gr.run_rank("5d26a12e-0000-4000-8000-000000000001", 1))
"""


@pytest.mark.parametrize("status", [0, 3])
def test_a_rank_that_leaves_by_os_exit_writes_its_end(tmp_path, status):
    """The stage's function on rank 1 calls os._exit (as some training scripts do to skip a hanging teardown): the
    rank still writes its end label and sends its last output (it wrote nothing: exited 0, rank 0 waited for ever)."""
    import subprocess
    import sys

    out = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", _OS_EXIT_RANK, str(out), str(status)], env=env, timeout=120,
                       capture_output=True, text=True)
    assert p.returncode == status, p.stderr
    calls = marks(out)
    want = "ok@fid" if status == 0 else f"exit {status}@fid"
    assert {"labels": {"qosflow.gang.rank1.ended": want}} in calls, (calls, p.stderr)
    assert any("rank 1 of 2 on host-b: last words" in m for c in calls for m in c.get("logs", [])), calls
    assert "last words" in p.stdout


# ------------------------------------------------------------------------------------------------ two agents, a worker
@pytest.fixture(scope="module")
def lab(prefect_server, tmp_path_factory):
    from qosflow.agent.testing import AgentProcess
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    d = tmp_path_factory.mktemp("gang-lab")
    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    old_pypath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pypath  # the agents (and so their stages) inherit it
    agents = {}
    try:
        for name in ("host-a", "host-b"):
            # (a free port each: the fixed 47210/47211 lie in Linux's ephemeral range, and in the full suite (CI,
            # 2026-11-28) a connection of an earlier test held 47210: "127.0.0.1:47210 is already in use")
            agents[name] = AgentProcess(name, TOKEN, virtual_gpus=4, args=["--cpu-cores", "4"], log=d / f"{name}.log").start()
        (d / "token").write_text(TOKEN + "\n")
        cluster = d / "lab.yaml"
        hosts = "".join(f"  - {{name: {n}, agent_url: '{a.url}'}}\n" for n, a in agents.items())
        cluster.write_text(f"name: gang-lab\ntoken_file: token\nheartbeat_s: 0.5\ngpus_per_host: 4\nhosts:\n{hosts}")
        asyncio.run(setup_pool(POOL, policy=QoSPolicy(policy="fifo", options={"backfill": True}), stream_output=False,
                               cluster_file=str(cluster), env={"PYTHONPATH": pypath}))
        w = WorkerThread(POOL).wait_ready(120)
        old_pool = os.environ.get("QOSFLOW_POOL")
        os.environ["QOSFLOW_POOL"] = POOL
        try:
            yield {"worker": w, "agents": agents, "dir": d}
        finally:
            if old_pool is None:
                os.environ.pop("QOSFLOW_POOL", None)
            else:
                os.environ["QOSFLOW_POOL"] = old_pool
            w.stop()
    finally:
        for a in agents.values():
            a.stop()
        if old_pypath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pypath


def _stage_run():
    """The flow run of the last pipeline's one stage, its states (oldest first) and its log."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from qosflow.prefect.tasks import PipelineRun

    [rec] = PipelineRun.finished[-1].stages.values()
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(rec.flow_run_id)
        states = sorted(c.read_flow_run_states(fr.id), key=lambda s: s.timestamp)
        logs = [x.message for x in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))]
        return fr, states, logs


def _gang_ended(lab, fid) -> None:
    w = lab["worker"].worker
    wait_for(lambda: any(r["flow_run_id"] == str(fid) for r in w.records), 60)


def _ranks(ev: list[dict]) -> None:
    ranks = sorted({(e["rank"], e["node"]) for e in ev if e["event"] == "start"})
    assert ranks in ([("0", "host-a"), ("1", "host-b")], [("0", "host-b"), ("1", "host-a")]), ranks


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sigterm_path", [False, True], ids=["rank-0-reads-the-failure", "rank-0-stopped-with-its-gang"])
def test_a_rank_that_fails_after_rank_0_returned_fails_the_run(lab, tmp_path, sigterm_path):
    """Rank 0 returns at once, rank 1 raises 3 s later: the run ends Failed with rank 1's exception and the pipeline
    raises it (it was Completed with rank 0's value, the pipeline went on, and rank 1's failure was lost). Rank 0,
    waiting, either reads the run Failed and takes that state, or (its readings 30 s apart) is stopped with its gang
    by the worker and does not report Crashed over it."""
    import gang_completion_pipelines as gp

    marker = tmp_path / "marks.jsonl"
    with pytest.raises(ValueError, match="rank 1 failed late"):
        gp.ranks_end_apart_pipeline(str(marker), 3.0, late_fails=True, sigterm_path=sigterm_path)
    fr, states, logs = _stage_run()
    _gang_ended(lab, fr.id)
    fr, states, logs = _stage_run()
    ev = marks(marker)
    _ranks(ev)
    kinds = [s.type.value for s in states]
    assert fr.state.is_failed(), (fr.state, kinds)
    assert fr.state.message.startswith("qosflow gang: rank 1 of 2 on host-") and "ValueError: rank 1 failed late" in fr.state.message
    assert "COMPLETED" not in kinds and "CRASHED" not in kinds and kinds.count("RUNNING") == 1, [s.name for s in states]
    assert any("rank 0's function returned" in m and "rank 1 of 2" in m for m in logs), logs
    if not sigterm_path:
        assert any("the run ended while rank 0 waited" in m for m in logs), logs
    else:
        assert any("stopped with its gang" in m for m in logs), "\n".join(m[:200] for m in logs)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_is_completed_only_once_a_slower_rank_has_ended(lab, tmp_path):
    """Rank 1 ends 6 s after it started, rank 0 at once: the run goes Completed after rank 1's end, with rank 0's
    value (it went Completed at rank 0's end: the pipeline had its value while rank 1 still ran)."""
    import gang_completion_pipelines as gp

    marker = tmp_path / "marks.jsonl"
    assert gp.ranks_end_apart_pipeline(str(marker), 6.0) == "rank 0"
    fr, states, logs = _stage_run()
    ev = marks(marker)
    _ranks(ev)
    end = {e["rank"]: e["t"] for e in ev if e["event"] == "end"}
    assert set(end) == {"0", "1"} and end["1"] - end["0"] > 2.0, ev  # (rank 1 sleeps once rank 0 returned)
    [done] = [s for s in states if s.type.value == "COMPLETED"]
    assert fr.state.is_completed() and fr.run_count == 1
    assert done.timestamp.timestamp() >= end["1"], (done.timestamp, end)
    assert [s.type.value for s in states].count("RUNNING") == 1
    assert fr.labels.get("qosflow.gang.rank1.ended", "").startswith("ok@"), fr.labels
    assert any("every rank has ended (rank 0 waited" in m for m in logs), logs


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_killed_after_rank_0_returned_does_not_leave_the_run_completed(lab, tmp_path):
    """Rank 1 is SIGKILLed (it writes nothing) after rank 0 returned: rank 0's wait ends with its gang, which the worker
    stops, and the run is not Completed (Crashed: a termination signal) nor left Running."""
    import gang_completion_pipelines as gp

    marker = tmp_path / "marks.jsonl"
    with pytest.raises(Exception):
        gp.ranks_end_apart_pipeline(str(marker), 2.0, late_killed=True)
    fr, states, logs = _stage_run()
    _gang_ended(lab, fr.id)
    fr, states, logs = _stage_run()
    killed = [e["rank"] for e in marks(marker) if e["event"] == "killed"]
    assert killed and set(killed) == {"1"}, killed  # (a rank killed by a signal: the worker may run the gang again)
    kinds = [s.type.value for s in states]
    assert fr.state.is_final() and not fr.state.is_completed(), (fr.state, kinds)
    assert "COMPLETED" not in kinds, kinds


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stage_on_one_host_is_not_touched(lab, tmp_path):
    """A stage placed on one host runs Prefect's engine as before: not through gang_rank, no end label, no wait."""
    import gang_completion_pipelines as gp

    marker = tmp_path / "marks.jsonl"
    assert gp.one_host_pipeline(str(marker)) == "one host"
    fr, states, logs = _stage_run()
    [e] = marks(marker)
    assert e["gang_rank_loaded"] is False and e["size"] == "1", e
    assert fr.state.is_completed()
    assert not any(k.startswith("qosflow.gang") for k in fr.labels), fr.labels
    assert not any("qosflow gang" in m for m in logs), logs


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_what_rank_1_prints_reaches_the_runs_log(lab, tmp_path):
    """Rank 1's stdout, stderr and its child process's output reach the run's log, prefixed with its rank and host,
    before the run is reported Completed; rank 0's prints are logged by its engine (log_prints) as before."""
    import gang_completion_pipelines as gp

    marker = tmp_path / "marks.jsonl"
    token = uuid.uuid4().hex[:8]
    assert gp.ranks_print_pipeline(str(marker), token) == "rank 0"
    fr, states, logs = _stage_run()
    host1 = next(e["node"] for e in marks(marker) if e["rank"] == "1")
    assert f"rank 1 of 2 on {host1}: hello from rank 1 {token}" in logs, logs
    assert f"rank 1 of 2 on {host1} (stderr): warning from rank 1 {token}" in logs, logs
    assert f"rank 1 of 2 on {host1}: child of rank 1 {token}" in logs, logs
    # (rank 0's prints are logged by its engine, log_prints, as before; its child's output is its own)
    assert sorted(m for m in logs if token in m) == sorted([
        f"rank 1 of 2 on {host1}: hello from rank 1 {token}", f"rank 1 of 2 on {host1} (stderr): warning from rank 1 {token}",
        f"rank 1 of 2 on {host1}: child of rank 1 {token}", f"hello from rank 0 {token}", f"warning from rank 0 {token}"]), logs

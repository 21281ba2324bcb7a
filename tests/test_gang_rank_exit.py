"""A gang's rank > 0 whose process ends without writing its end label (qosflow/prefect/gang_rank.py): the worker writes
it for the rank (`QosflowWorker._write_rank_end`), so that rank 0 ends the run instead of waiting for it for ever.

Until 2026-11-28 a rank that left by `exit(0)` from C code (a C extension's `_exit`, which the rank's `os._exit`
wrapper does not see) wrote nothing: a rank that exits 0 does not stop its gang, and rank 0, its function returned,
waited for the label until the run was cancelled.

The live tests use tests/test_gang_completion.py's lab (two real agents as two 4-GPU hosts, a `qosflow` worker, the
session's Prefect server); the stage functions are in this module (importable by the stage processes: the agents'
PYTHONPATH has tests/)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from types import SimpleNamespace

import pytest

from qosflow.prefect.tasks import qos_flow, qos_task
from gang_completion_pipelines import _after_rank_0_returned
from test_gang_completion import _gang_ended, _ranks, _stage_run, lab, marks  # noqa: F401


def _mark(marker: str, event: str, **more) -> None:
    import json

    import qosflow

    with open(marker, "a") as f:
        f.write(json.dumps({"event": event, "rank": os.environ.get("QOSFLOW_GANG_RANK", ""), "node": qosflow.placement().node,
                            "t": time.time(), **more}) + "\n")


@qos_task(gpus=8, gang=True, cpu_cores=1, expected_duration=3)
def rank_1_exits_from_c(marker: str, code: int = 0) -> str:
    """Rank 0 returns at once; rank 1, once rank 0 returned, ends its process by libc's `_exit(code)`, as C code does:
    no Python code of the rank runs after it (its end label is not written)."""
    import ctypes

    rank = os.environ.get("QOSFLOW_GANG_RANK", "")
    _mark(marker, "start")
    if rank == "0":
        _mark(marker, "end")
        return "rank 0"
    _after_rank_0_returned(marker)
    _mark(marker, "c-exit", code=code)
    ctypes.CDLL(None)._exit(code)
    return "not reached"


@qos_flow(name="gang-rank-1-exits-from-c")
def rank_1_exits_from_c_pipeline(marker: str, code: int = 0) -> str:
    return rank_1_exits_from_c(marker, code)


# ------------------------------------------------------------------------------------------------ without a server
def test_the_outcome_the_worker_writes_is_never_ok():
    from qosflow.prefect.gang_rank import _by_worker, unlabelled_outcome

    assert unlabelled_outcome(0) == "exit 0 without its end label"
    assert unlabelled_outcome(3) == "exit 3 without its end label"
    assert unlabelled_outcome(-9) == "killed by SIGKILL without its end label"
    assert unlabelled_outcome(None) == "ended without its end label"
    assert all(_by_worker(unlabelled_outcome(c)) for c in (0, 3, -9, None)) and not _by_worker("ok")


def test_rank_0_keeps_a_ranks_own_end_over_one_the_worker_wrote_later(monkeypatch):
    """Rank 0 read rank 1's own `ok`; a later reading shows the worker's label for rank 1 (rank 1's was dropped by a
    concurrent merge, and the worker, finding none, wrote one): rank 1's own end stands, the run is reported."""
    import logging

    import qosflow.prefect.gang_rank as gr

    class Stop(BaseException):
        pass

    readings = [{"qosflow.gang.rank1.ended": "ok@fid"},
                {"qosflow.gang.rank1.ended": "exit 0 without its end label@fid"},
                {"qosflow.gang.rank1.ended": "exit 0 without its end label@fid", "qosflow.gang.rank2.ended": "ok@fid"}]

    def read_flow_run(fid):
        if not readings:
            raise Stop("rank 0 still waits")
        return SimpleNamespace(state=None, labels=readings.pop(0))

    monkeypatch.setattr(gr, "GANG_WAIT_POLL_S", 0.0)
    monkeypatch.setenv("QOSFLOW_STAGE_ID", "fid")
    engine = SimpleNamespace(flow_run=SimpleNamespace(id="fid"), logger=logging.getLogger("t"),
                             client=SimpleNamespace(read_flow_run=read_flow_run, read_flow_run_states=lambda fid: []))
    assert gr._wait_for_ranks(engine, 3) is True

    # the worker's label first (the rank's own never came): rank 0 fails the run with it
    readings[:] = [{"qosflow.gang.rank1.ended": "exit 0 without its end label@fid"}]
    with pytest.raises(gr.GangRankFailed, match=r"rank 1 of \? on .* ended badly \(exit 0 without its end label\)"):
        gr._wait_for_ranks(engine, 2)


def test_which_gangs_have_their_ranks_watched():
    from qosflow.backends.base import StageHandle
    from qosflow.backends.kubernetes import pod_rank as _pod_rank
    from qosflow.prefect.worker import _gang_ranks_watched, _rank_parts

    parts = [{"host": "a", "rank": 0}, {"host": "b", "rank": 1}]
    assert _gang_ranks_watched(StageHandle("s", "agent", "a", {"parts": parts}))
    assert not _gang_ranks_watched(StageHandle("s", "agent", "a", {"parts": parts[:1]}))  # (one host: no rank > 0)
    # (parts that do not know their rank: AgentBackend.adopt's, before `_take_back` ranks them by the lease's hosts)
    assert not _gang_ranks_watched(StageHandle("s", "agent", "a", {"parts": [{"host": "a"}, {"host": "b"}]}))
    assert not _gang_ranks_watched(StageHandle("s", "agent", "a", {"parts": parts, "role": "pipeline"}))
    # adopted by a restarted worker: ranked by its lease's hosts (placement order), also with a host that did not answer
    adopted = StageHandle("s", "agent", "c", {"parts": [{"host": "c"}, {"host": "a"}]})
    _rank_parts(adopted, ["a", "b", "c"])
    assert [p["rank"] for p in adopted.ref["parts"]] == [2, 0] and _gang_ranks_watched(adopted)
    assert _gang_ranks_watched(StageHandle("s", "kubernetes", "n", {"expected_pods": 2, "selector": "x"}))
    assert not _gang_ranks_watched(StageHandle("s", "kubernetes", "n", {"expected_pods": 1, "selector": "x"}))
    assert not _gang_ranks_watched(StageHandle("s", "local", "n", {"pid": 1}))
    # a gang whose command was not run through gang_rank (a job template's own command): no rank writes a label
    assert not _gang_ranks_watched(StageHandle("s", "agent", "a", {"parts": parts, "gang_labels": False}))
    assert not _gang_ranks_watched(StageHandle("s", "kubernetes", "n", {"expected_pods": 2, "selector": "x", "gang_labels": False}))

    def pod(env=None, index=None):
        return SimpleNamespace(spec=SimpleNamespace(containers=[SimpleNamespace(env=[SimpleNamespace(name=k, value=v) for k, v in (env or {}).items()])]),
                               metadata=SimpleNamespace(annotations={} if index is None else {"batch.kubernetes.io/job-completion-index": index}))

    assert _pod_rank(pod({"QOSFLOW_GANG_RANK": "2"})) == 2
    assert _pod_rank(pod({"QOSFLOW_GANG_RANK": None}, "1")) == 1  # (a fieldRef: the Indexed Job's completion index)
    assert _pod_rank(pod()) is None


def test_the_ranks_of_a_kubernetes_gang_that_ended_on_their_own():
    """Kubernetes: a pod of rank > 0 that Succeeded (exit 0) or Failed with its container's exit code (no pod reason:
    not evicted, not its node lost) has ended on its own; rank 0, a pod still running, one being deleted (the gang
    stopped by qosflow), and ranks already dealt with are not."""
    from qosflow.backends.base import StageHandle
    from qosflow.prefect.worker import QosflowWorker

    def pod(rank, phase, code=None, reason=None, deleting=False):
        term = SimpleNamespace(exit_code=code) if code is not None else None
        return SimpleNamespace(
            spec=SimpleNamespace(containers=[SimpleNamespace(env=[SimpleNamespace(name="QOSFLOW_GANG_RANK", value=str(rank))])]),
            metadata=SimpleNamespace(annotations={}, deletion_timestamp="now" if deleting else None),
            status=SimpleNamespace(phase=phase, reason=reason, container_statuses=[SimpleNamespace(state=SimpleNamespace(terminated=term))]))

    pods = [pod(0, "Succeeded"), pod(1, "Succeeded"), pod(2, "Failed", 3), pod(3, "Failed", 137, reason="Evicted"),
            pod(4, "Running"), pod(5, "Succeeded", deleting=True), pod(6, "Succeeded")]
    asked = []

    async def acall(fn, ns, label_selector=None, **kw):
        asked.append((ns, label_selector, kw))
        return SimpleNamespace(items=pods)

    from qosflow.backends.kubernetes import KubernetesBackend

    be = SimpleNamespace(_acall=acall, core=SimpleNamespace(list_namespaced_pod=None))
    be.ranks_exited_ok = lambda handle, skip: KubernetesBackend.ranks_exited_ok(be, handle, skip)
    worker = SimpleNamespace(_backend=be)
    handle = StageHandle("sid", "kubernetes", "n0", {"namespace": "ns", "selector": "qosflow.dev/stage=sid", "expected_pods": 7})
    got = asyncio.run(QosflowWorker._ranks_ended(worker, handle, {6}))
    assert got == {1: 0}, got  # (rank 2's Failed pod ends the gang's wait: the backend stops it, no label is written)
    # (from the API server's watch cache: a LIST every 2 s per gang was a quorum read of etcd each time)
    assert asked == [("ns", "qosflow.dev/stage=sid", {"resource_version": "0"})]


def test_the_worker_writes_no_label_for_a_rank_that_ended_badly_while_its_gang_is_being_stopped():
    """Host agents: rank 1 is SIGKILLed from outside (the OOM killer: an infrastructure failure, after which the worker
    runs the gang again elsewhere) or exits 3; the backend's wait stops the other ranks, and until the agents answered
    that DELETE (a slow or unreachable host: up to its timeout) the gang's wait was still on. The watcher wrote
    `killed by SIGKILL without its end label` for rank 1 meanwhile: rank 0, its function returned and waiting, reported
    the run Failed with it, and the worker, finding the run final, did not run the gang again. Only a rank that exited 0
    (which does not end the gang's wait) has its label written for it; the others are the backend's."""
    from qosflow.backends.base import StageHandle
    from qosflow.prefect.worker import QosflowWorker

    stages = {"h1": {"state": "exited", "returncode": -9, "killed_reason": None, "error": None},
              "h2": {"state": "exited", "returncode": 3, "killed_reason": None, "error": None},
              "h3": {"state": "exited", "returncode": 0, "killed_reason": None, "error": None},
              "h4": {"state": "exited", "returncode": 0, "killed_reason": "gang member failed", "error": None},
              "h5": {"state": "running", "returncode": None, "killed_reason": None, "error": None}}

    class Client:
        def __init__(self, host):
            self.host = host

        async def get(self, url):
            return SimpleNamespace(status_code=200, json=lambda: stages[self.host])

    hosts = ["h0", *stages]
    from qosflow.backends.agent import AgentBackend

    backend = SimpleNamespace(state={h: SimpleNamespace(name=h, url=f"http://{h}", up=True) for h in hosts},
                              _client=lambda h: Client(h.name))
    backend.ranks_exited_ok = lambda handle, skip: AgentBackend.ranks_exited_ok(backend, handle, skip)
    worker = QosflowWorker(work_pool_name="rank-watch", name="me", leases=False, create_pool_if_not_found=False)
    worker._backend = backend
    worker.RANK_WATCH_S = 0.01
    written = []

    async def write(fid, handle, rank, code):
        written.append((rank, code))
        return True

    worker._write_rank_end = write
    handle = StageHandle("sid", "agent", "h0", {"parts": [{"host": h, "stage_id": "sid", "rank": r} for r, h in enumerate(hosts)]})

    async def go():
        watch = asyncio.ensure_future(worker._watch_gang_ranks("fid", handle))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if written:
                break
        await asyncio.sleep(0.2)  # (a few more rounds)
        watch.cancel()

    asyncio.run(go())
    assert written == [(3, 0)], written


def test_a_rank_that_ends_before_rank_0_reported_the_run_running_still_gets_its_label():
    """Rank 1 ends by `exit(0)` from C code while rank 0's engine has not reported the run Running yet (its pod still
    pulling its image on its node, its host slower to start): the run is Pending. The worker gave up on the rank at
    once ('no rank 0 waits on this launch') and never looked at it again, so rank 0, once it ran and its function
    returned, waited for rank 1's label for ever. It now looks again until the run is Running, then writes it."""
    import logging

    from qosflow.backends.base import StageHandle
    from qosflow.prefect.worker import QosflowWorker

    def state(kind, sid="s"):
        return SimpleNamespace(type=SimpleNamespace(value=kind), id=sid, timestamp=1.0)

    reads = {"n": 0}
    labels: dict = {}

    class Client:
        async def read_flow_run(self, fid):
            reads["n"] += 1
            return SimpleNamespace(id=fid, state=state("PENDING" if reads["n"] <= 5 else "RUNNING"), labels=dict(labels))

        async def read_flow_run_states(self, fid):
            return [state("PENDING", "p1")]

        async def update_flow_run_labels(self, fid, new):
            labels.update(new)

    worker = QosflowWorker(work_pool_name="rank-watch", name="me", leases=False, create_pool_if_not_found=False)
    worker._client = Client()
    worker.get_flow_run_logger = lambda fr: logging.getLogger("test")
    worker.RANK_END_SETTLE_S = worker.RANK_WATCH_S = 0.01
    handle = StageHandle("sid", "agent", "h0", {"parts": []})
    worker._handles["fid"] = handle

    async def go():
        return await asyncio.wait_for(worker._write_rank_end("fid", handle, 1, 0), 60)

    assert asyncio.run(go()) is True
    assert labels == {"qosflow.gang.rank1.ended": "exit 0 without its end label@sid#p1"}, labels
    assert reads["n"] > 5


# ------------------------------------------------------------------------------------------------ the real server
def _running_run(labels: dict | None = None):
    """A flow run of the session's server taken through Pending to Running (as a stage's is), with `labels`."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Pending, Running

    @flow(name="gang-rank-exit-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(probe, name=f"probe-{uuid.uuid4().hex[:6]}")
        c.set_flow_run_state(fr.id, Pending(), force=True)
        c.set_flow_run_state(fr.id, Running(), force=True)
        if labels:
            c.update_flow_run_labels(fr.id, labels)
        pending = [s for s in c.read_flow_run_states(fr.id) if s.type.value == "PENDING"]
        return str(fr.id), str(pending[-1].id)


def _labels(fid: str) -> dict:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return dict(c.read_flow_run(fid).labels or {})


def _write(w, fid: str, handle, rank: int, code: int, register: bool = True) -> bool:
    worker = w.worker
    if register:
        worker._handles[fid] = handle
    try:
        return asyncio.run_coroutine_threadsafe(worker._write_rank_end(fid, handle, rank, code), w._loop).result(120)
    finally:
        if register:
            worker._handles.pop(fid, None)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_worker_writes_a_ranks_end_only_when_the_rank_did_not(lab, monkeypatch):  # noqa: F811 - the fixture imported above
    """`_write_rank_end` on the real server: absent, the label is written for the rank (never `ok`), with the attempt
    the rank would have used (stage id # the run's latest Pending state); a label of this attempt already there (the
    rank's own, written just before its process exited) is left as it is, whatever it says; one of an earlier launch
    does not count; nothing is written for a launch that is no longer this run's (the gang stopped or launched again)
    nor for a run that is not Running."""
    from prefect.client.orchestration import get_client
    from prefect.states import Failed

    from qosflow.backends.base import StageHandle

    w = lab["worker"]
    monkeypatch.setattr(w.worker, "RANK_END_SETTLE_S", 0.1)
    key = "qosflow.gang.rank1.ended"

    fid, pending = _running_run()
    h = StageHandle("sid-a", "agent", "host-a", {"parts": []})
    assert _write(w, fid, h, 1, 0) is True
    assert _labels(fid)[key] == f"exit 0 without its end label@sid-a#{pending}"
    assert _write(w, fid, h, 1, 0) is False  # (already there: not written twice)

    for own in ("ok", "failed", "exit 3"):  # the rank's own end wins, a good one as a bad one
        fid, pending = _running_run()
        with get_client(sync_client=True) as c:
            c.update_flow_run_labels(fid, {key: f"{own}@sid-a#{pending}"})
        assert _write(w, fid, StageHandle("sid-a", "agent", "host-a", {"parts": []}), 1, 0) is False
        assert _labels(fid)[key] == f"{own}@sid-a#{pending}"

    fid, pending = _running_run({key: "ok@sid-a#an-earlier-pending"})  # (an earlier launch's: does not count)
    assert _write(w, fid, StageHandle("sid-a", "agent", "host-a", {"parts": []}), 1, -9) is True
    assert _labels(fid)[key] == f"killed by SIGKILL without its end label@sid-a#{pending}"

    fid, _ = _running_run()
    assert _write(w, fid, StageHandle("sid-a", "agent", "host-a", {"parts": []}), 1, 0, register=False) is False
    assert key not in _labels(fid)

    fid, _ = _running_run()
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(fid, Failed(message="a rank failed"), force=True)
    assert _write(w, fid, StageHandle("sid-a", "agent", "host-a", {"parts": []}), 1, 0) is False
    assert key not in _labels(fid)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_that_exits_0_from_c_code_fails_the_run_instead_of_hanging(lab, tmp_path):  # noqa: F811 - the fixture imported above
    """Rank 1 ends by libc `_exit(0)` after rank 0's function returned: no end label of its own, and its gang is not
    stopped (it exited 0). The worker writes `exit 0 without its end label@<attempt>` for it, rank 0 reads it and
    reports the run Failed (GangRankFailed), and the pipeline raises; before, rank 0 waited until the run was cancelled."""
    marker = tmp_path / "marks.jsonl"
    t0 = time.monotonic()
    with pytest.raises(Exception, match="ended badly"):
        rank_1_exits_from_c_pipeline(str(marker), 0)
    fr, states, logs = _stage_run()
    _gang_ended(lab, fr.id)
    fr, states, logs = _stage_run()
    ev = marks(marker)
    _ranks(ev)
    assert [e["rank"] for e in ev if e["event"] == "c-exit"] == ["1"], ev
    kinds = [s.type.value for s in states]
    assert fr.state.is_failed(), (fr.state, kinds)
    assert "rank 1 of 2 on host-" in fr.state.message and "ended badly (exit 0 without its end label)" in fr.state.message, fr.state.message
    assert "COMPLETED" not in kinds and kinds.count("RUNNING") == 1, kinds
    label = fr.labels.get("qosflow.gang.rank1.ended", "")
    pending = max((s for s in states if s.type.value == "PENDING"), key=lambda s: s.timestamp)
    assert label.startswith("exit 0 without its end label@") and label.endswith(f"#{pending.id}"), label
    assert any("the worker wrote it for it" in m for m in logs), logs
    assert time.monotonic() - t0 < 150


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_that_exits_3_from_c_code_stops_its_gang_as_before(lab, tmp_path):  # noqa: F811 - the fixture imported above
    """Rank 1 ends by libc `_exit(3)`: its gang is stopped by the backend (a rank that ended badly), as before; the run
    is not Completed, and a label the worker may have written for rank 1 while rank 0 was being stopped (the agent's
    grace) says how it ended, never `ok`."""
    marker = tmp_path / "marks.jsonl"
    with pytest.raises(Exception):
        rank_1_exits_from_c_pipeline(str(marker), 3)
    fr, states, logs = _stage_run()
    _gang_ended(lab, fr.id)
    fr, states, logs = _stage_run()
    kinds = [s.type.value for s in states]
    assert fr.state.is_final() and not fr.state.is_completed(), (fr.state, kinds)
    assert "COMPLETED" not in kinds, kinds
    time.sleep(lab["worker"].worker.RANK_END_SETTLE_S + 2)
    fr, states, logs = _stage_run()
    assert fr.labels.get("qosflow.gang.rank1.ended", "exit 3 without its end label@").startswith("exit 3 without its end label@"), fr.labels


def test_a_rank_names_its_own_node_and_others_only_where_the_host_list_follows_the_ranks(monkeypatch):
    """`_where` names a rank's host in the gang's messages. Its own: QOSFLOW_NODE (on Kubernetes the Indexed Job's pods
    take the nodes in any order, so QOSFLOW_GANG_HOSTS[rank] was a guess: rank 1 on gpu-0 read 'rank 1 of 2 on gpu-1').
    Another rank's: its place in the list where this rank's own node is its place (host agents), else the host left."""
    from qosflow.prefect.gang_rank import _where

    monkeypatch.setenv("QOSFLOW_GANG_SIZE", "2")
    monkeypatch.setenv("QOSFLOW_GANG_HOSTS", "gpu-0,gpu-1")
    # host agents: rank i on the i-th host
    monkeypatch.setenv("QOSFLOW_GANG_RANK", "0")
    monkeypatch.setenv("QOSFLOW_NODE", "gpu-0")
    assert (_where(0), _where(1)) == ("rank 0 of 2 on gpu-0", "rank 1 of 2 on gpu-1")
    # Kubernetes, the pods the other way round
    monkeypatch.setenv("QOSFLOW_NODE", "gpu-1")
    assert (_where(0), _where(1)) == ("rank 0 of 2 on gpu-1", "rank 1 of 2 on gpu-0")
    monkeypatch.setenv("QOSFLOW_GANG_RANK", "1")
    monkeypatch.setenv("QOSFLOW_NODE", "gpu-0")
    assert _where(1) == "rank 1 of 2 on gpu-0"
    monkeypatch.setenv("QOSFLOW_GANG_SIZE", "3")
    monkeypatch.setenv("QOSFLOW_GANG_HOSTS", "a,b,c")
    monkeypatch.setenv("QOSFLOW_GANG_RANK", "0")
    monkeypatch.setenv("QOSFLOW_NODE", "b")
    assert _where(2) == "rank 2 of 3 on one of a, c"


def test_on_kubernetes_a_rank_at_its_own_place_in_the_host_list_does_not_name_the_others_by_theirs(monkeypatch):
    """An Indexed Job's pods (JOB_COMPLETION_INDEX set) take the nodes in any order: rank 0 on the list's first node is
    chance, and with 3 ranks rank 1 may be on the third node. It read 'rank 1 of 3 on b', whichever of b and c it was on."""
    from qosflow.prefect.gang_rank import _where

    monkeypatch.setenv("QOSFLOW_GANG_SIZE", "3")
    monkeypatch.setenv("QOSFLOW_GANG_HOSTS", "a,b,c")
    monkeypatch.setenv("QOSFLOW_GANG_RANK", "0")
    monkeypatch.setenv("QOSFLOW_NODE", "a")
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    assert _where(1) == "rank 1 of 3 on b"  # host agents: rank i on the i-th host
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    assert (_where(0), _where(1), _where(2)) == ("rank 0 of 3 on a", "rank 1 of 3 on one of b, c", "rank 2 of 3 on one of b, c")

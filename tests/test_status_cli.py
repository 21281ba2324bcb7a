"""`qosflow status` against the session's Prefect server: a 1-GPU pool running one stage while the
other waits in the QoS queue, each shown with where it runs or why it waits."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_status_shows_the_running_stage_and_why_the_other_waits(prefect_server, tmp_path, monkeypatch, capsys):
    import prefect_pipelines as pp

    from qosflow.cli.main import main
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    pool = "status-one-gpu"
    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1, cpu_cores=2), policy=QoSPolicy(policy="fifo"), stream_output=False))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("QOSFLOW_POOL", pool)
    out = tmp_path / "status.json"
    assert main(["status", "--pool", pool, "--json", str(out)]) == 0  # nothing yet: no worker, no stage
    data = json.loads(out.read_text())
    assert data["workers"] == [] and data["stages"] == []
    assert "no stage run is running or waiting" in " ".join(capsys.readouterr().out.split())

    w = WorkerThread(pool).wait_ready(120)
    result: dict = {}
    th = threading.Thread(target=lambda: result.setdefault("r", pp.two_nappers(12.0)), daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 90
        while True:
            assert main(["status", "--pool", pool, "--json", str(out)]) == 0
            data = json.loads(out.read_text())
            phases = sorted(s["phase"] for s in data["stages"])
            waiting = [s for s in data["stages"] if s["phase"] == "queued"]
            running = [s for s in data["stages"] if s["phase"] == "running"]
            if phases == ["queued", "running"] and waiting[0]["why_waiting"] and running[0]["done_pct"] is not None:
                break
            assert time.monotonic() < deadline, data
            time.sleep(1.0)
        text = " ".join(capsys.readouterr().out.split())
        [running] = [s for s in data["stages"] if s["phase"] == "running"]
        assert running["name"].startswith("napper") and running["host"] and running["gpus"] and running["predicted_s"] > 0
        assert 0 < running["deadline_in_s"] <= 600 and running["priority"]
        assert 0 < running["done_pct"] <= 100 and waiting[0]["done_pct"] is None  # its progress artifact; none while queued
        assert [x["name"] for x in data["workers"]] == [w.worker.name] and data["workers"][0]["status"] == "ONLINE"
        assert data["pipelines_running"] == 0  # (this pipeline runs here, not as a deployment's run in the pool)
        assert "QoS queue" in text and "stage runs" in text and "workers" in text
        th.join(120)
        assert result.get("r") == [12.0, 12.0]
        # what `_placed` relies on for a Pending run: the worker places a stage (`qosflow.placed_at`) after
        # the server stamped the run Pending, so the placement of an attempt is never older than its Pending
        from prefect.client.orchestration import get_client

        from qosflow.prefect.labels import label_float
        from qosflow.prefect.status import PLACED_CLOCK_SLACK_S

        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with get_client(sync_client=True) as c:
            # by id: the session's server holds every test's runs and read_flow_runs() returns one page of them
            # (the second stage run fell outside it in a full CI run of 2026-11-28)
            ids = [uuid.UUID(s["flow_run_id"]) for s in data["stages"]]
            stage_runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            assert len(stage_runs) == 2
            for fr in stage_runs:
                pending = [h.timestamp.timestamp() for h in c.read_flow_run_states(fr.id) if h.is_pending()]
                placed_at = label_float((fr.labels or {}).get("qosflow.placed_at"))
                assert pending and placed_at is not None and placed_at >= pending[-1] - PLACED_CLOCK_SLACK_S, (pending, placed_at)
    finally:
        w.stop(drain=0)


def test_status_names_a_server_it_cannot_reach_or_a_url_that_is_none(capsys, monkeypatch):
    """`qosflow status` with no server at PREFECT_API_URL ended in an httpx.ConnectError traceback (and a URL
    without http:// in httpx.UnsupportedProtocol); `qosflow init` already said which server and what to do."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from qosflow.cli.main import main

    url = "http://127.0.0.1:9/api"
    monkeypatch.setenv("PREFECT_API_URL", url)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        assert main(["status", "--pool", "gpu"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the Prefect server at {url} (" in err and "is a Prefect server running there" in err and "qosflow.prefect.server_process server start" in err, err
    assert "Traceback" not in err, err
    # a URL without http(s)://: status, init and the worker (which retried it for ever) say so before any call
    for argv, what in ((["status", "--pool", "gpu"], "qosflow status"), (["init", "--pool", "gpu"], "qosflow init"),
                       (["worker", "start", "--pool", "gpu"], "the qosflow worker")):
        for bad in ("127.0.0.1:4200/api", "http:///api"):
            monkeypatch.setenv("PREFECT_API_URL", bad)
            with temporary_settings(updates={PREFECT_API_URL: bad}):
                assert main(argv) == 2, argv
            err = " ".join(capsys.readouterr().err.split())
            assert f"PREFECT_API_URL={bad!r} is not an http(s) URL, so {what} can never reach a server there" in err, err


def test_labels_that_do_not_parse_read_as_unknown():
    """A `qosflow.*` label is a string another process wrote: garbage, infinities and NaN read as None
    (a NaN deadline used to pass as a number and print as 'nan' in the status table)."""
    from qosflow.prefect.labels import label_float, label_int

    assert label_int("4") == 4 and label_float("12.5") == 12.5
    assert [label_int(x) for x in (None, "", "x", "2.5")] == [None] * 4
    assert [label_float(x) for x in (None, "", "x", "nan", "inf", "-inf")] == [None] * 6


def _stage_run(state, labels: dict, *, stage: str = "train"):
    import uuid

    from prefect.client.schemas.objects import FlowRun

    return FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4(), state=state, labels=labels,
                   parameters={"payload": "x", "stage": stage, "pipeline": "retrain"})


def _placement(placed_at: float) -> dict:
    return {"qosflow.host": "host-a", "qosflow.gpus": "host-a:0", "qosflow.placed_at": f"{placed_at:.3f}",
            "qosflow.predicted_s": "30.000", "qosflow.queued_by": "agents-worker"}


def test_a_placed_stage_whose_process_still_starts_shows_placed_with_its_host():
    """A stage the worker has placed, whose run is still Pending while its process starts (some seconds on
    host agents), showed as 'queued / QoS queue', without its host; it is placed, on its host and GPUs.
    A Pending run whose placement labels are older than its Pending state (those of the attempt before a
    reschedule: labels are only merged, never dropped) still waits in the QoS queue."""
    import pendulum
    from prefect.states import Pending, Running

    from qosflow.prefect.status import _stage_status

    now = time.time()
    pending_since = now - 4.0
    starting = _stage_run(Pending(timestamp=pendulum.from_timestamp(pending_since)), _placement(pending_since + 0.3))
    st = _stage_status(starting, now)
    assert (st.phase, st.state, st.host, st.gpus, st.predicted_s) == ("running", "Pending", "host-a", "host-a:0", 30.0)
    assert 3.0 < st.since_s < 4.0  # placed for (not waiting since the run was created)

    # placed by a worker whose clock is a little behind the server's: still this attempt's placement
    assert _stage_status(_stage_run(Pending(timestamp=pendulum.from_timestamp(pending_since)), _placement(pending_since - 0.5)), now).phase == "running"

    # rescheduled after its first attempt was lost; taken again and waiting: the labels are the old attempt's
    stale = _stage_run(Pending(timestamp=pendulum.from_timestamp(pending_since)), _placement(now - 120.0))
    st = _stage_status(stale, now)
    assert (st.phase, st.host, st.gpus, st.predicted_s) == ("queued", "", "", None)

    assert _stage_status(_stage_run(Pending(), {"qosflow.queued_by": "agents-worker"}), now).phase == "queued"
    running = _stage_status(_stage_run(Running(), _placement(now - 60.0)), now)
    assert (running.phase, running.host) == ("running", "host-a")


def test_the_table_says_starting_for_a_placed_stage_whose_process_still_starts(monkeypatch, capsys):
    """A placed stage whose run is still Pending read 'running' in the table (its phase), with its host,
    while its process had not started yet; the table says 'starting' (the JSON keeps phase and state)."""
    import qosflow.prefect.local as local
    import qosflow.prefect.status as status
    from qosflow.cli.main import main
    from qosflow.prefect.status import PoolStatus, StageStatus, WorkerStatus

    async def no_check(pool, **kw):
        return None

    async def fake_status(pool, limit=200):
        return PoolStatus(pool, workers=[WorkerStatus("w", "ONLINE", True, 1.0)], stages=[
            StageStatus("1", "train", "p", "Pending", "running", host="host-a", gpus="host-a:0"),
            StageStatus("2", "evaluate", "p", "Running", "running", host="host-b", gpus="host-b:1")])

    monkeypatch.setattr(local, "check_pool", no_check)
    monkeypatch.setattr(local, "require_api_url", lambda what: "http://127.0.0.1:1/api")
    monkeypatch.setattr(status, "pool_status", fake_status)
    assert main(["status", "--pool", "gpu"]) in (0, None)
    rows = {ln.split("│")[1].strip(): ln for ln in capsys.readouterr().out.splitlines() if ln.count("│") > 3}
    assert "starting" in rows["train"] and "host-a" in rows["train"], rows
    assert "running" in rows["evaluate"] and "starting" not in rows["evaluate"], rows


def test_status_says_whom_each_stage_runs_for(monkeypatch, capsys):
    """Fairness between users orders the queue by whom stages run for; the status did not say it. A stage
    run's user is read from its tags (qosflow's own `qos:user=NAME`, else a `user:NAME` tag), and the table
    has a user column when some stage names one (none: no column, as before)."""
    from prefect.states import Running

    import qosflow.prefect.local as local
    import qosflow.prefect.status as status
    from qosflow.cli.main import main
    from qosflow.prefect.status import PoolStatus, StageStatus, WorkerStatus, _stage_status

    now = time.time()
    fr = _stage_run(Running(), _placement(now - 60.0))
    fr.tags = ["qos:class=batch", "qos:user=alice", "user:bob"]
    assert _stage_status(fr, now).user == "alice"  # (the stage's own, written at dispatch, wins)
    fr.tags = ["user:bob"]
    assert _stage_status(fr, now).user == "bob"
    fr.tags = []
    assert _stage_status(fr, now).user == ""

    stages = [StageStatus("1", "train", "p", "Running", "running", host="host-a", gpus="host-a:0", user="alice"),
              StageStatus("2", "evaluate", "p", "Pending", "queued")]

    async def no_check(pool, **kw):
        return None

    async def fake_status(pool, limit=200):
        return PoolStatus(pool, workers=[WorkerStatus("w", "ONLINE", True, 1.0)], stages=stages)

    monkeypatch.setattr(local, "check_pool", no_check)
    monkeypatch.setattr(local, "require_api_url", lambda what: "http://127.0.0.1:1/api")
    monkeypatch.setattr(status, "pool_status", fake_status)
    assert main(["status", "--pool", "gpu"]) in (0, None)
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if "stage" in ln and "phase" in ln)
    assert "user" in header, out
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")] for ln in out.splitlines() if ln.count("│") > 3}
    assert rows["train"][3] == "alice" and rows["evaluate"][3] == "-", rows
    stages[0].user = ""
    assert main(["status", "--pool", "gpu"]) in (0, None)
    out = capsys.readouterr().out
    assert "user" not in next(ln for ln in out.splitlines() if "stage" in ln and "phase" in ln), out

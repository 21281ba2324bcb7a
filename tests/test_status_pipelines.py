"""`qosflow status` shows the pipeline runs' processes recorded in the lease store (pools whose stages run on
host agents or Kubernetes: they outlive a worker restart): which worker watches each (the one that started
it, a restarted one that adopted it, or none), whether it still runs (told on its own host and boot only),
and its output file. Real processes and a real SQLite lease store; the last test reads names and states
from the session's Prefect server."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa

from qosflow.backends.local import process_start

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
URL = "http://127.0.0.1:1/api"


def _ended_process() -> tuple[int, str]:
    """The pid and start time of a process that has ended (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    start = process_start(p.pid)
    p.wait()
    assert start and process_start(p.pid) is None
    return p.pid, start


@pytest.fixture
def store(tmp_path):
    from qosflow.store.leases import LeaseStore

    s = LeaseStore(url=f"sqlite:///{tmp_path / 'leases.db'}")
    yield s
    s.engine.dispose()


def _record_four(store, pool: str, running: subprocess.Popen) -> dict[str, str]:
    """A running pipeline watched by the worker that started it, one whose process is gone and whose worker
    stopped, one on another host, and one a restarted worker adopted. Flow run id -> what it is."""
    from qosflow.store.leases import holder_id

    host = socket.gethostname()
    ids = {"11111111-1111-4111-8111-111111111111": "running", "22222222-2222-4222-8222-222222222222": "gone",
           "33333333-3333-4333-8333-333333333333": "elsewhere", "44444444-4444-4444-8444-444444444444": "adopted"}
    fid = {v: k for k, v in ids.items()}
    w1 = holder_id("w1")
    store.claim_name(pool, w1, 30.0)  # (a live worker process)
    store.record_pipeline(pool, fid["running"], w1, running.pid, process_start(running.pid), f"/out/{fid['running']}.log")
    pid, start = _ended_process()
    store.record_pipeline(pool, fid["gone"], f"w0#{host}:1:dead00", pid, start, f"/out/{fid['gone']}.log")
    store.record_pipeline(pool, fid["elsewhere"], "w2#gpu-head-7:4242:aa", 4242, "another-boot:1234", "/out/x.log")
    with store.engine.begin() as conn:  # (recorded by a worker on another host: its own name there)
        conn.execute(sa.text("UPDATE qosflow_pipeline_process SET host = 'gpu-head-7' WHERE flow_run_id = :f"), {"f": fid["elsewhere"]})
    store.record_pipeline(pool, fid["adopted"], f"w3#{host}:2:old000", running.pid, process_start(running.pid), None)
    time.sleep(0.05)
    w3 = holder_id("w3")  # restarted after it recorded its pipeline, and took it over
    store.claim_name(pool, w3, 30.0)
    assert store.take_pipeline(fid["adopted"], f"w3#{host}:2:old000", w3)
    return ids


def test_pipeline_processes_says_which_run_which_are_gone_and_who_watches_them(store):
    """The lease store's pipeline processes of a pool, each alive or not (only on its own host: another host's
    is 'unknown (other host)', never guessed) and watched by its worker, by one that adopted it, or by none."""
    from qosflow.prefect.status import pipeline_processes
    from qosflow.store.leases import pool_key

    key = pool_key("gpu", URL)
    running = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        ids = _record_four(store, key, running)
        store.record_pipeline(pool_key("gpu", "http://other-server/api"), "55555555-5555-4555-8555-555555555555", "w9#h:1:aa", 1, "b:1")
        procs, note = pipeline_processes("gpu", URL, store)
        assert note == ""
        got = {ids[p.flow_run_id]: p for p in procs}
        assert sorted(got) == ["adopted", "elsewhere", "gone", "running"]  # (not another server's pool of that name)
        assert [p.flow_run_id for p in procs] == list(ids)  # oldest first
        r = got["running"]
        assert (r.alive, r.alive_text, r.watched, r.worker, r.pid, r.host) == (True, "yes", "yes", "w1", running.pid, socket.gethostname())
        assert r.output.endswith(f"{r.flow_run_id}.log") and abs(r.started_at - time.time()) < 60
        g = got["gone"]
        assert (g.alive, g.alive_text, g.watched, g.worker) == (False, "no", "no", "w0")
        e = got["elsewhere"]
        assert (e.alive, e.alive_text, e.host) == (None, "unknown (other host)", "gpu-head-7")
        a = got["adopted"]
        assert (a.alive, a.watched, a.worker, a.output) == (True, "adopted", "w3", "")
    finally:
        running.kill()
        running.wait()
    # the same host in another boot: a pid and a start time mean nothing there
    from qosflow.backends.local import recorded_process_alive

    assert recorded_process_alive(socket.gethostname(), 1, "not-this-boot:5") == (None, "other boot")


def test_status_lists_the_pipeline_processes(store, tmp_path, monkeypatch, capsys):
    """`qosflow status` prints them in a table of their own, and writes them to its --json file."""
    import qosflow.prefect.local as local
    import qosflow.prefect.status as status
    from qosflow.cli.main import main
    from qosflow.prefect.status import PoolStatus, WorkerStatus, pipeline_processes
    from qosflow.store.leases import pool_key

    running = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        ids = _record_four(store, pool_key("gpu", URL), running)

        async def no_check(pool, **kw):
            return None

        async def fake_status(pool, limit=200):  # (the server's part faked; the store's is the real one)
            st = PoolStatus(pool, workers=[WorkerStatus("w1", "ONLINE", True, 1.0)])
            st.pipeline_processes, st.pipeline_processes_note = pipeline_processes(pool, URL, store)
            st.pipeline_processes[0].name, st.pipeline_processes[0].state = "nightly-retrain", "Running"
            return st

        monkeypatch.setenv("COLUMNS", "250")  # (one line a row)
        monkeypatch.setattr(local, "check_pool", no_check)
        monkeypatch.setattr(local, "require_api_url", lambda what: URL)
        monkeypatch.setattr(status, "pool_status", fake_status)
        out = tmp_path / "status.json"
        assert main(["status", "--pool", "gpu", "--json", str(out)]) in (0, None)
        text = capsys.readouterr().out
        assert "pipeline processes" in text, text
        rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in text.splitlines() if ln.count("│") > 5]
        by_id, row = {}, None
        for cells in rows:  # (a run's name, then its id on the next line of the same row)
            row = cells if any(cells[1:]) else row
            for fid in ids:
                if fid in cells[0]:
                    by_id[ids[fid]] = row
        assert sorted(by_id) == ["adopted", "elsewhere", "gone", "running"], text
        assert by_id["running"][1:4] == ["Running", "w1", "yes"] and by_id["running"][5] == str(running.pid)
        assert by_id["running"][7] == "yes" and by_id["running"][8].startswith("/out/"), by_id["running"]
        assert "nightly-retrain" in text
        assert by_id["gone"][3] == "no worker" and by_id["gone"][7] == "no", by_id["gone"]
        assert by_id["adopted"][3].startswith("adopted") and by_id["adopted"][7] == "yes", by_id["adopted"]
        assert "unknown (other" in " ".join(by_id["elsewhere"]) and "gpu-head-7" in by_id["elsewhere"][4], by_id["elsewhere"]
        data = json.loads(out.read_text())
        got = {ids[p["flow_run_id"]]: p for p in data["pipeline_processes"]}
        assert got["running"]["alive"] is True and got["gone"]["alive"] is False and got["elsewhere"]["alive"] is None
        assert got["elsewhere"]["alive_unknown"] == "other host" and got["adopted"]["watched"] == "adopted"
        assert got["running"]["name"] == "nightly-retrain" and got["running"]["pid"] == running.pid
    finally:
        running.kill()
        running.wait()


def test_status_creates_no_lease_store_where_there_is_none(tmp_path, monkeypatch):
    """On a machine where no worker ran (no lease store), status says where they are recorded, and leaves no
    empty database behind."""
    from qosflow.prefect.status import pipeline_processes

    db = tmp_path / "none" / "qosflow.db"
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", f"sqlite:///{db}")
    procs, note = pipeline_processes("gpu", URL)
    assert procs == [] and "no lease store on this host" in note and str(db) in note
    assert not db.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pool_status_reads_the_store_and_names_the_runs(prefect_server, tmp_path, monkeypatch):
    """pool_status (what `qosflow status` prints) reads the pipeline processes of this machine's lease store
    for the pool of this server, with each one's flow run name and state from the server."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Running

    from qosflow.prefect.status import pool_status
    from qosflow.store.leases import LeaseStore, holder_id, pool_key

    @flow(name="status-pipeline")
    def pipeline() -> None:
        pass

    async def create():
        from prefect.client.schemas.actions import WorkPoolCreate

        async with get_client() as c:
            await c.create_work_pool(WorkPoolCreate(name="status-pipelines", type="qosflow"))
            fr = await c.create_flow_run(pipeline, name="nightly-retrain-42", state=Running())
            return str(fr.id)

    fid = asyncio.run(create())
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", f"sqlite:///{tmp_path / 'leases.db'}")
    store = LeaseStore()
    running = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        store.record_pipeline(pool_key("status-pipelines", PREFECT_API_URL.value()), fid, holder_id("w1"), running.pid,
                              process_start(running.pid), f"/out/{fid}.log")
        st = asyncio.run(pool_status("status-pipelines"))
        [p] = st.pipeline_processes
        assert (p.flow_run_id, p.name, p.state, p.alive, p.watched) == (fid, "nightly-retrain-42", "Running", True, "no")
        assert st.to_json()["pipeline_processes"][0]["name"] == "nightly-retrain-42"
    finally:
        running.kill()
        running.wait()
        store.engine.dispose()

"""`qosflow status` against the session's Prefect server: a 1-GPU pool running one stage while the
other waits in the QoS queue, each shown with where it runs or why it waits."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
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
    assert f"cannot reach the Prefect server at {url} (" in err and "is `prefect server start` running there?" in err, err
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

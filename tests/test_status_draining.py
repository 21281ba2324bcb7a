"""`qosflow status` shows the hosts a worker drains after a cluster edit (a host removed from the cluster's
description keeps its running stages to their end), as the worker's cluster table artifact
(`qosflow-cluster-<pool>`) and its metrics do: a line counting the hosts by state, a table of the hosts not
up, the running stages there marked, and `hosts` in the JSON. It showed none of them."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from qosflow.core import QoSSpec
from qosflow.core.cluster import ClusterSpec, ClusterState, NodeSpec
from qosflow.core.placement import Placement
from qosflow.prefect.cluster_table import cluster_rows


def _table() -> list[dict]:
    """The rows a worker writes with host-b draining one 2-GPU stage and host-c down."""
    spec = ClusterSpec(tuple(NodeSpec(h, gpus=2, cpu_cores=8.0) for h in ("host-a", "host-b", "host-c")), name="lab")
    st = ClusterState(spec)
    st.allocate(Placement("s1", ((1, 0), (1, 1)), cpu=((1, 2.0),)), QoSSpec(gpus=2, cpu_cores=2.0))
    st.down[1] = st.down[2] = True
    return cluster_rows(st, draining={"host-b"})


def test_the_hosts_are_read_from_the_cluster_table_artifact():
    from qosflow.prefect.status import HostStatus, cluster_hosts

    asked = {}

    class Client:
        async def read_artifacts(self, **kw):
            asked.update(kw)
            return [SimpleNamespace(data=json.dumps(_table()), updated=None, created=SimpleNamespace(timestamp=lambda: 1000.0))]

    hosts, when = asyncio.run(cluster_hosts(Client(), "GPU pool"))
    assert asked["artifact_filter"].key.any_ == ["qosflow-cluster-gpu-pool"] and asked["limit"] == 1
    assert when == 1000.0
    assert hosts == [HostStatus("host-a", "up", "generic", 2, 0, 0, "8 of 8", 0),
                     HostStatus("host-b", "draining", "generic", 2, 2, 0, "6 of 8", 1),
                     HostStatus("host-c", "down", "generic", 2, 0, 0, "8 of 8", 0)]  # (the total row left out)

    class NoTable:
        async def read_artifacts(self, **kw):
            return []

    assert asyncio.run(cluster_hosts(NoTable(), "gpu")) == ([], None)


def test_status_shows_the_draining_host_and_its_stage(monkeypatch, capsys, tmp_path):
    import qosflow.prefect.local as local
    import qosflow.prefect.status as status
    from qosflow.cli.main import main
    from qosflow.prefect.status import HostStatus, PoolStatus, StageStatus, WorkerStatus

    hosts = [HostStatus("host-a", "up", gpus=2), HostStatus("host-b", "draining", gpus=2, gpus_in_use=2, stages=1),
             HostStatus("host-c", "down", gpus=2)]

    async def no_check(pool, **kw):
        return None

    async def fake_status(pool, limit=200):
        return PoolStatus(pool, workers=[WorkerStatus("w", "ONLINE", True, 1.0)], stages=[
            StageStatus("1", "train", "p", "Running", "running", host="host-b", gpus="host-b:0,1"),
            StageStatus("2", "evaluate", "p", "Running", "running", host="host-a", gpus="host-a:0")],
            hosts=hosts, hosts_changed_at=time.time() - 30)

    monkeypatch.setattr(local, "check_pool", no_check)
    monkeypatch.setattr(local, "require_api_url", lambda what: "http://127.0.0.1:1/api")
    monkeypatch.setattr(status, "pool_status", fake_status)
    out = tmp_path / "status.json"
    assert main(["status", "--pool", "gpu", "--json", str(out)]) in (0, None)
    text = capsys.readouterr().out
    assert "hosts: 1 of 3 up, 1 draining, 1 down" in text, text
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[1:-1]] for ln in text.splitlines() if ln.count("│") > 3}
    assert rows["host-b"][1:] == ["draining", "2", "2", "1"] and rows["host-c"][1:3] == ["down", "2"] and "host-a" not in rows, rows
    assert text.count("(host draining)") == 1 and "draining" not in " ".join(rows["evaluate"]), text
    assert "its running stages run to their end" in " ".join(text.split())
    data = json.loads(out.read_text())
    assert [(h["host"], h["state"]) for h in data["hosts"]] == [("host-a", "up"), ("host-b", "draining"), ("host-c", "down")]

    hosts[1:] = []  # every host up: the count only, no table
    assert main(["status", "--pool", "gpu"]) in (0, None)
    text = capsys.readouterr().out
    assert "hosts: 1 of 1 up" in text and "not up" not in text and "(host draining)" not in text, text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pool_status_reads_the_latest_cluster_table(prefect_server):
    """Against the session's Prefect server: the worker's cluster table is an artifact of key
    qosflow-cluster-<pool> with a version per change; pool_status reads the latest."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate, WorkPoolCreate

    from qosflow.prefect.status import pool_status

    pool = "status-draining"

    async def write(rows):
        async with get_client() as c:
            await c.create_artifact(ArtifactCreate(key=f"qosflow-cluster-{pool}", type="table", data=json.dumps(rows)))

    async def create_pool():
        async with get_client() as c:
            await c.create_work_pool(WorkPoolCreate(name=pool, type="qosflow"))

    asyncio.run(create_pool())
    assert asyncio.run(pool_status(pool)).hosts == []  # (no worker has written one)
    up = [dict(r, state="up") if r["state"] else r for r in _table()]
    asyncio.run(write(up))
    time.sleep(0.05)
    asyncio.run(write(_table()))
    st = asyncio.run(pool_status(pool))
    assert [(h.host, h.state) for h in st.hosts] == [("host-a", "up"), ("host-b", "draining"), ("host-c", "down")]
    assert st.draining == ["host-b"] and st.hosts_changed_at is not None and abs(time.time() - st.hosts_changed_at) < 120

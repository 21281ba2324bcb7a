"""The worker's Prometheus series (qosflow.prefect.metrics), read from a live QoS queue."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qosflow.core.cluster import ClusterSpec
from qosflow.prefect.metrics import WorkerMetrics
from qosflow.prefect.scheduler import QoSScheduler
from test_prefect_scheduler import PriorityFirstFit, ShareEverything, enqueue, entry


def samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_series_follow_the_queue_and_the_cluster():
    """Queued and running stages per QoS class, the oldest wait, GPUs allocated and shared per node, a
    node down, rounds: each read from the scheduler at scrape time; finished stages, deadlines and
    waits counted as they happen."""

    async def go():
        cl = ClusterSpec.uniform(2, 2, cpu_cores=4, virtual=True)
        s = QoSScheduler(cl, PriorityFirstFit())
        m = WorkerMetrics("gpus", "w1", lambda: s, policy="test-priority")
        before = samples(m)
        running = [entry(f"r{i}", gpus=1) for i in range(3)]
        tasks = [await enqueue(s, e) for e in running]
        s.round()
        grants = [await t for t in tasks]
        late = entry("late", gpus=2, deadline_at=time.time() + 60)
        late.ready_at = time.time() - 30
        waiting = await enqueue(s, late)  # 1 GPU free: it waits
        s.round()
        s.state.down[1] = True
        m.placed(running[0], grants[0].waited_s)
        m.stage_finished("ok", True)
        m.stage_finished("ok", False)
        m.stage_finished("cancelled", False)  # a cancelled stage missed nothing
        m.stage_finished("user", None)
        m.event("qosflow.stage.rescheduled")
        after = samples(m)
        waiting.cancel()
        return before, after

    before, after = asyncio.run(go())
    assert before[("qosflow_worker_info", (("policy", "test-priority"), ("pool", "gpus"), ("worker", "w1")))] == 1
    assert after[("qosflow_stages", (("qos_class", "normal"), ("state", "running")))] == 3
    assert after[("qosflow_stages", (("qos_class", "deadline"), ("state", "queued")))] == 1
    assert 29 <= after[("qosflow_queued_oldest_wait_seconds", (("qos_class", "deadline"),))] < 120
    allocated = {k[1][0][1]: v for k, v in after.items() if k[0] == "qosflow_node_gpus_allocated"}
    assert sum(allocated.values()) == 3 and set(allocated) == {"node0", "node1"}
    assert after[("qosflow_node_up", (("node", "node1"),))] == 0 and after[("qosflow_node_up", (("node", "node0"),))] == 1
    assert after[("qosflow_scheduler_rounds_total", ())] == 2
    assert after[("qosflow_stages_finished_total", (("exit", "ok"),))] == 2
    assert after[("qosflow_stages_finished_total", (("exit", "cancelled"),))] == 1
    assert after[("qosflow_stage_deadlines_total", (("outcome", "met"),))] == 1
    assert after[("qosflow_stage_deadlines_total", (("outcome", "missed"),))] == 1
    assert after[("qosflow_stage_wait_seconds_count", (("qos_class", "normal"),))] == 1
    assert after[("qosflow_events_total", (("event", "qosflow.stage.rescheduled"),))] == 1


def test_shared_gpus_are_counted():
    async def go():
        s = QoSScheduler(ClusterSpec.uniform(1, 2, cpu_cores=4, virtual=True), ShareEverything())
        m = WorkerMetrics("gpus", "w1", lambda: s)
        tasks = [await enqueue(s, entry(f"s{i}", shareable=True, mem=1000.0)) for i in range(2)]
        s.round()
        for t in tasks:
            await t
        return samples(m)

    got = asyncio.run(go())
    assert got[("qosflow_node_gpus_shared", (("node", "node0"),))] == 1
    assert got[("qosflow_node_gpus_allocated", (("node", "node0"),))] == 1


def test_before_its_first_stage_the_worker_says_it_is_not_ready():
    m = WorkerMetrics("gpus", "w1", lambda: None)
    got = samples(m)
    assert got[("qosflow_scheduler_ready", ())] == 0
    assert not any(k[0] == "qosflow_stages" for k in got)


def test_endpoint_serves_metrics_over_http_and_refuses_a_port_in_use():
    from qosflow.errors import SpecError

    async def go():
        m = WorkerMetrics("gpus", "w1", lambda: None)
        port = await m.serve(0, "127.0.0.1")
        try:
            async with httpx.AsyncClient() as c:
                r = await c.get(f"http://127.0.0.1:{port}/metrics")
                other = await c.get(f"http://127.0.0.1:{port}/")
            with pytest.raises(SpecError, match="already in use"):
                await WorkerMetrics("gpus", "w2", lambda: None).serve(port, "127.0.0.1")
        finally:
            await m.aclose()
        return r, other

    r, other = asyncio.run(go())
    assert r.status_code == 200 and "qosflow_scheduler_ready 0.0" in r.text
    assert r.headers["content-type"].startswith("text/plain")
    assert other.status_code == 404 and "/metrics" in other.text


def test_cluster_table_rows():
    """The UI's cluster table (qosflow.prefect.cluster_table): per host its state (up, down, draining), GPUs
    in use and shared, free cores and stages; then a total row."""
    from qosflow.prefect.cluster_table import cluster_rows

    async def go():
        s = QoSScheduler(ClusterSpec.uniform(3, 2, cpu_cores=4, virtual=True), ShareEverything())
        tasks = [await enqueue(s, entry(f"s{i}", shareable=True, mem=1000.0)) for i in range(2)]
        s.round()
        for t in tasks:
            await t
        s.state.down[1] = s.state.down[2] = True
        return cluster_rows(s.state, draining={"node2"})

    rows = asyncio.run(go())
    assert [(r["host"], r["state"], r["GPUs"], r["GPUs in use"], r["GPUs shared"], r["stages"]) for r in rows] == [
        ("node0", "up", 2, 1, 1, 2), ("node1", "down", 2, 0, 0, 0), ("node2", "draining", 2, 0, 0, 0), ("all (1 of 3 up)", "", 6, 1, 1, 2)]
    assert rows[0]["cores free"] == "2 of 4"

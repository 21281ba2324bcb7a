"""What a worker that runs for weeks must not accumulate (found by benchmarks/soak.py): unit tests of the
pruning, not timed or memory-threshold checks."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from qosflow.backends.base import LaunchSpec
from qosflow.backends.local import LocalBackend
from qosflow.core.cluster import ClusterSpec


def _local_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("qosflow-local-*")}


def test_local_backend_built_and_dropped_leaves_no_temp_dir():
    # `qosflow init` and `qosflow worker start` build the backend of a local cluster block to check it:
    # each left an empty /tmp/qosflow-local-* directory behind
    before = _local_dirs()
    for _ in range(3):
        LocalBackend(ClusterSpec.uniform(1, 2, virtual=True, name="t", prefix="t"))
    assert _local_dirs() - before == set()


def test_local_backend_removes_its_progress_dir_at_close():
    async def go():
        b = LocalBackend(ClusterSpec.uniform(1, 2, virtual=True, name="t", prefix="t"), stream_output=False)
        cluster = await b.inventory()
        before = _local_dirs()
        from qosflow.core.placement import Placement

        p = Placement("s1", gpus=((0, 0),), cpu=((0, 1.0),))
        spec = LaunchSpec(stage_id="s1", command=[sys.executable, "-c", "pass"], placement=p, cluster=cluster, cpusets={0: [0]})
        h = await b.launch(spec)
        await b.wait(h)
        made = _local_dirs() - before
        await b.aclose()
        return before, made, _local_dirs() - before

    before, made, left = asyncio.run(go())
    assert len(made) == 1  # (the stage's progress file is there while it runs)
    assert not left


def test_scheduler_keeps_only_the_newest_coda_decisions(tmp_path, monkeypatch):
    # every CODA core move was appended to QoSScheduler.decisions for the worker's life
    import json

    from test_prefect_scheduler import PriorityFirstFit, entry, grant_each

    from qosflow.prefect.scheduler import QoSScheduler

    monkeypatch.setattr(QoSScheduler, "DECISIONS_KEPT", 3)

    async def main():
        clock = [1000.0]

        async def set_cpus(e, node, cpuset):
            pass

        s = QoSScheduler(ClusterSpec.uniform(1, 2, cpu_cores=6, virtual=True), PriorityFirstFit(), coda=True, coda_min_elapsed=1.0,
                         set_cpus=set_cpus, clock=lambda: clock[0])
        for i in range(6):
            cpu = entry(f"cpu-{i}", gpus=0, cpu=3.0, expected=100)
            gpu = entry(f"gpu-{i}", gpus=1, cpu=1.0, expected=10)
            await grant_each(s, cpu, gpu)
            prog = tmp_path / f"gpu-{i}.progress"
            prog.write_text(json.dumps({"t": 0, "step": 1, "total": 10}) + "\n")
            s.attach(f"gpu-{i}", None, str(prog))
            clock[0] += 5.0
            assert len(await s.coda_round()) == 1
            s.release(f"cpu-{i}")
            s.release(f"gpu-{i}")
            clock[0] += 30.0
        return s

    s = asyncio.run(main())
    assert [d["to_stage"] for d in s.decisions] == ["gpu-3", "gpu-4", "gpu-5"]


def test_the_workers_histories_keep_the_newest_entries(monkeypatch):
    """QosflowWorker.records (one per finished stage, ~1 KB each), early_checks, node_events, outages and
    recovered only grew, for the worker's whole life (soak run: +2.9 records a pipeline, most of the
    worker's memory growth). Each keeps the newest HISTORY_KEPT; every append to them goes through _keep."""
    import inspect

    import qosflow.prefect.worker as worker

    monkeypatch.setattr(worker, "HISTORY_KEPT", 3)
    h: list[int] = []
    for i in range(10):
        worker._keep(h, i)
    assert h == [7, 8, 9]
    src = inspect.getsource(worker.QosflowWorker)
    for name in ("records", "early_checks", "node_events", "outages", "recovered"):
        assert f"self.{name}.append(" not in src and f"_keep(self.{name}, " in src, name

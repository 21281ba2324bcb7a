"""A stage whose pipeline run ended without it is not run (admin review, 2026-11-27: a worker stopped
while its pipeline ran killed the pipeline's process; the stage it had dispatched was placed and run
36 s after the restart, holding a GPU for a result no one waited for)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from qosflow import qos_task

HERE = Path(__file__).resolve().parent
POOL = "ended-pipelines"


@qos_task(gpus=1, cpu_cores=1, expected_duration=2)
def mark_and_sleep(path: str, seconds: float = 0.0) -> str:
    Path(path).write_text("ran")
    time.sleep(seconds)
    return path


@pytest.fixture(scope="module")
def worker(prefect_server):
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    cluster = BareMetalGPUCluster.virtual(1, 1, cpu_cores=4)  # one GPU: a second stage waits in the QoS queue
    asyncio.run(setup_pool(POOL, cluster=cluster, policy=QoSPolicy(policy="fifo"), stream_output=False))
    w = WorkerThread(POOL).wait_ready(120)
    yield w
    w.stop()


def _pipeline_run(state):
    """A flow run standing for a pipeline run, in `state`."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="stands-for-a-pipeline")
    def pipe():
        pass

    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(pipe)
        c.set_flow_run_state(fr.id, state, force=True)
        return c.read_flow_run(fr.id)


def _dispatch(pipeline_fr, path: Path, seconds: float = 0.0):
    from qosflow.prefect import tasks

    run = tasks.PipelineRun("ended-pipe", str(pipeline_fr.id), deadline=None, priority=None, pool=POOL, plan=None, expected={})
    return tasks._dispatch(mark_and_sleep, run, POOL, (str(path), seconds), {})


def _eventually(fn, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while not (out := fn()):
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.1)
    return out


def test_a_stage_whose_pipeline_crashed_before_it_started_is_cancelled_not_run(worker, tmp_path):
    from prefect.states import Crashed

    from qosflow.prefect.tasks import StageCancelled

    crashed = _pipeline_run(Crashed(message="the worker that ran it stopped"))
    marker = tmp_path / "ran"
    with pytest.raises(StageCancelled, match=rf"pipeline run {crashed.id} was Crashed before the stage started"):
        _dispatch(crashed, marker)
    assert not marker.exists()


def test_a_queued_stage_leaves_the_queue_when_its_pipeline_ends(worker, tmp_path):
    """The only GPU is busy with another pipeline's stage; a stage of pipeline P waits in the QoS queue.
    P is cancelled meanwhile (its process killed): the waiting stage is dropped and marked Cancelled at
    the next heartbeat, and never runs; the other pipeline's stage is not touched."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Running

    from qosflow.prefect.tasks import StageCancelled

    busy_marker, waiting_marker = tmp_path / "busy", tmp_path / "waiting"
    other, pipeline = _pipeline_run(Running()), _pipeline_run(Running())
    outcome: dict[str, object] = {}

    def go(key, fr, path, seconds):
        try:
            outcome[key] = _dispatch(fr, path, seconds)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome[key] = exc

    busy = threading.Thread(target=go, args=("busy", other, busy_marker, 8.0))
    busy.start()
    _eventually(busy_marker.exists)
    waiting = threading.Thread(target=go, args=("waiting", pipeline, waiting_marker, 0.0))
    waiting.start()
    sched = worker.worker.scheduler
    _eventually(lambda: any(e.state.job.pipeline == str(pipeline.id) for e in sched.queued()))
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(pipeline.id, Cancelled(message="cancelled while its stage waited"), force=True)
    waiting.join(120)
    assert isinstance(outcome.get("waiting"), StageCancelled), outcome
    assert "while the stage waited in the QoS queue" in str(outcome["waiting"])
    busy.join(120)
    assert outcome.get("busy") == str(busy_marker), outcome  # (the other pipeline's stage ran to its end)
    assert not waiting_marker.exists()


def test_a_running_stage_of_a_cancelled_pipeline_is_cancelled(worker, tmp_path):
    """Cancelling a pipeline run (its process killed by the worker that ran it) left its running stage
    training for no one; it is now cancelled as by `prefect flow-run cancel`. (A stage of a pipeline that
    crashed or failed is left to end: see the test above, whose other pipeline's stage runs on.)"""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Running

    from qosflow.prefect.tasks import StageCancelled

    marker = tmp_path / "long"
    pipeline = _pipeline_run(Running())
    outcome: dict[str, object] = {}

    def go():
        try:
            outcome["long"] = _dispatch(pipeline, marker, 90.0)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome["long"] = exc

    t = threading.Thread(target=go)
    t.start()
    _eventually(marker.exists)
    t0 = time.monotonic()
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(pipeline.id, Cancelled(message="the user cancelled the pipeline"), force=True)
    t.join(120)
    assert isinstance(outcome.get("long"), StageCancelled), outcome
    assert time.monotonic() - t0 < 60  # (cancelled, not run to its 90 s end)

"""A scheduled retraining run's deadline counts from the time it was due, not from whenever it started (journey of
2026-11-28 on a real server: a run of a `flow.deploy(interval=...)` deployment held back by a paused pool, by no
worker, or by the deployment's `concurrency_limit=1` while the previous run ran, had its whole deadline again from
its late start and was reported met)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from qosflow import qos_flow


def _flow_run(auto_scheduled: bool, due_ago_s: float):
    from prefect.client.schemas.objects import FlowRun

    return FlowRun(flow_id="00000000-0000-0000-0000-000000000001", auto_scheduled=auto_scheduled,
                   expected_start_time=datetime.now(timezone.utc) - timedelta(seconds=due_ago_s))


def test_a_scheduled_run_counts_its_deadline_from_when_it_was_due():
    from qosflow.prefect.tasks import PipelineRun, deadline_from

    fr = _flow_run(True, 100.0)
    due = deadline_from(fr)
    assert due == pytest.approx(fr.expected_start_time.timestamp(), abs=0.01)
    run = PipelineRun("nightly", "fr-1", deadline=60.0, priority=None, pool=None,
                      plan={"prep": [], "train": ["prep"]}, expected={"prep": 10.0, "train": 50.0}, due=due)
    assert run.deadline_at == pytest.approx(due + 60.0, abs=0.01)
    assert run.deadline_at < time.time()  # 100 s late with a 60 s deadline: already past it
    # the deadline split along the critical path counts from the same time
    assert run.stage_deadline("train", ["prep"], 50.0) == pytest.approx(due + 60.0, abs=0.01)
    assert run.stage_deadline("prep", [], 10.0) < due + 60.0


def test_a_run_not_made_by_a_schedule_counts_from_its_start():
    from qosflow.prefect.tasks import PipelineRun, deadline_from

    assert deadline_from(_flow_run(False, 100.0)) is None  # `prefect deployment run`, a direct call
    assert deadline_from(None) is None
    before = time.time()
    run = PipelineRun("adhoc", "fr-2", deadline=60.0, priority=None, pool=None, plan=None, expected={},
                      due=deadline_from(_flow_run(False, 100.0)))
    assert run.deadline_at >= before + 60.0
    # a scheduled run that starts early (a worker's prefetch) still counts from its start, never later
    early = PipelineRun("early", "fr-3", deadline=60.0, priority=None, pool=None, plan=None, expected={},
                        due=deadline_from(_flow_run(True, -30.0)))
    assert early.deadline_at <= time.time() + 60.0


@qos_flow(name="late-nightly", deadline=60)
def late_nightly() -> int:
    return 1


def test_a_late_scheduled_pipeline_run_is_reported_past_its_deadline(prefect_server, monkeypatch):
    """The pipeline itself, run by Prefect's engine as the run of a schedule that was due 100 s before it started:
    its record says it missed its 60 s deadline although it took a moment."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from qosflow.prefect.tasks import PipelineRun

    monkeypatch.delenv("QOSFLOW_POOL", raising=False)
    from prefect.client.orchestration import SyncPrefectClient

    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(late_nightly)
    due = datetime.now(timezone.utc) - timedelta(seconds=100)
    read = SyncPrefectClient.read_flow_run

    def as_the_scheduler_made_it(self, flow_run_id):
        # what the server's scheduler service writes on the runs it makes (a client cannot create one so); the
        # engine reads the run back from the server before it runs the flow
        got = read(self, flow_run_id)
        if str(flow_run_id) == str(fr.id):
            got.auto_scheduled, got.expected_start_time = True, due
        return got

    monkeypatch.setattr(SyncPrefectClient, "read_flow_run", as_the_scheduler_made_it)
    state = run_flow(late_nightly, flow_run=fr, return_type="state")
    assert state.is_completed(), state
    rec = next(r for r in reversed(PipelineRun.finished) if r.flow_run_id == str(fr.id))
    assert rec.deadline_at == pytest.approx(due.timestamp() + 60.0, abs=0.01)
    assert rec.met is False


def test_a_late_scheduled_run_says_where_its_deadline_counts_from():
    """The QoS report of a scheduled run that started 100 s late and took 5 s of its 60 s deadline said only
    'Deadline 60s: MISSED -- finished in 5.0s', and its forecast 'Deadline 60s after start': nothing said why."""
    from qosflow.prefect.tasks import PipelineRun, deadline_from

    fr = _flow_run(True, 100.0)
    run = PipelineRun("nightly", "fr-4", deadline=60.0, priority=None, pool=None, plan=None, expected={}, due=deadline_from(fr))
    run.ended, run.state = run.started + 5.0, "completed"
    when = f"{fr.expected_start_time.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
    report = run.report_markdown()
    assert "**MISSED**" in report and f"counts from its scheduled time {when}" in report, report
    assert "finished 105.0s after it" in report, report
    assert run.deadline_counted_from().startswith(f"its scheduled time {when}, 100s before it started")
    # a run that started when it was due (or not made by a schedule) says nothing more
    on_time = PipelineRun("adhoc", "fr-5", deadline=60.0, priority=None, pool=None, plan=None, expected={}, due=None)
    on_time.ended, on_time.state = on_time.started + 5.0, "completed"
    assert on_time.deadline_counted_from() == "its start"
    assert "counts from" not in on_time.report_markdown()

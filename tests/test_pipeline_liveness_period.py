"""`prefect_pipeline_liveness` for a run whose heartbeat period the worker does not know (a run it adopted): the
period is read off the spacing of the run's last two heartbeats, else Prefect's default (180 s), so a run with a long
period is not reported lost between two of its heartbeats. The client is a stand-in answering the two calls the
function makes (the real server's answers are covered by tests/test_agent_pipeline_liveness.py)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from qosflow.prefect.worker import PIPELINE_HEARTBEATS_MISSED, prefect_pipeline_liveness


class _Client:
    def __init__(self, beats_ago: list[float], state_age_s: float = 3600.0):
        now = datetime.now(timezone.utc)
        self.events = [SimpleNamespace(occurred=now - timedelta(seconds=a), received=now - timedelta(seconds=a)) for a in beats_ago]
        state = SimpleNamespace(is_final=lambda: False, type=SimpleNamespace(value="RUNNING"), name="Running",
                                timestamp=now - timedelta(seconds=state_age_s))
        self.run = SimpleNamespace(state=state)
        self.limits: list[int] = []

    async def read_flow_run(self, fid):
        return self.run

    async def read_events(self, filter, limit):
        self.limits.append(limit)
        return SimpleNamespace(events=self.events[:limit])


def _ask(client: _Client, heartbeat_s: float | None):
    return asyncio.run(prefect_pipeline_liveness(client, "fid", heartbeat_s))


def test_a_known_period_decides_with_one_heartbeat():
    assert _ask(_Client([100.0]), 30.0) is None  # 100 s > 2.5 x 30 s: silent
    assert "heartbeat" in _ask(_Client([60.0]), 30.0)


def test_an_unknown_period_is_read_off_the_last_two_heartbeats():
    # beats every 120 s (a user's setting), the last 200 s ago: alive under 2.5 x 120 s, lost under 30 s
    c = _Client([200.0, 320.0])
    said = _ask(c, None)
    assert isinstance(said, str) and "heartbeat" in said, said
    assert c.limits == [2]
    assert 200.0 < PIPELINE_HEARTBEATS_MISSED * 120.0
    # beats every 30 s, the last 100 s ago: silent
    assert _ask(_Client([100.0, 130.0]), None) is None


def test_an_unknown_period_with_one_heartbeat_assumes_prefects_default():
    assert isinstance(_ask(_Client([400.0]), None), str)  # 400 s < 2.5 x 180 s
    assert _ask(_Client([500.0]), None) is None
    assert _ask(_Client([]), None) is None  # no heartbeat, state old: silent

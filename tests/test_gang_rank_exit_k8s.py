"""A gang on Kubernetes whose rank 1 ends by `exit(0)` from C code, without writing its end label: the worker, seeing its
pod Succeeded while rank 0's pod waits, writes the label for it, and rank 0 fails the run instead of waiting for ever
(QosflowWorker._watch_gang_ranks; the same on host agents: tests/test_gang_rank_exit.py).

tests/test_k8s_gang.py's lab: the session's Prefect server, the worker with the Kubernetes backend against qosflow's API
emulator whose process kubelet runs each pod's command as a local process (EMULATED: no cluster)."""

from __future__ import annotations

import os
import time

import pytest

from qosflow.prefect.tasks import qos_flow, qos_task
from test_k8s_gang import _after_rank_0_returned, _mark, _stage_run, _worker_recorded, k8s, marks  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@qos_task(gpus=8, gang=True, cpu_cores=1, expected_duration=3)
def k8s_rank_1_exits_from_c(marker: str) -> str:
    """Rank 0 returns at once; rank 1, once rank 0 returned, ends its process by libc's `_exit(0)`."""
    import ctypes

    rank = os.environ.get("QOSFLOW_GANG_RANK", "")
    _mark(marker, "start")
    if rank == "0":
        _mark(marker, "end")
        return "rank 0"
    _after_rank_0_returned(marker)
    _mark(marker, "c-exit")
    ctypes.CDLL(None)._exit(0)
    return "not reached"


@qos_flow(name="k8s-gang-rank-1-exits-from-c")
def k8s_rank_1_exits_from_c_pipeline(marker: str) -> str:
    return k8s_rank_1_exits_from_c(marker)


def test_a_pod_of_rank_1_that_exits_0_without_its_label_fails_the_run_instead_of_hanging(k8s, tmp_path):  # noqa: F811 - the fixture imported above
    marker = tmp_path / "marks.jsonl"
    t0 = time.monotonic()
    with pytest.raises(Exception, match="ended badly"):
        k8s_rank_1_exits_from_c_pipeline(str(marker))
    fr, states, logs = _stage_run()
    _worker_recorded(k8s, fr.id)
    fr, states, logs = _stage_run()
    ev = marks(marker)
    assert sorted(e["rank"] for e in ev if e["event"] == "start") == ["0", "1"], ev
    assert [e["rank"] for e in ev if e["event"] == "c-exit"] == ["1"], ev
    assert fr.state.is_failed(), fr.state
    assert "ended badly (exit 0 without its end label)" in (fr.state.message or ""), fr.state.message
    label = fr.labels.get("qosflow.gang.rank1.ended", "")
    pending = max((s for s in states if s.type.value == "PENDING"), key=lambda s: s.timestamp)
    assert label.startswith("exit 0 without its end label@") and label.endswith(f"#{pending.id}"), label
    assert any("the worker wrote it for it" in m for m in logs), logs
    assert time.monotonic() - t0 < 200

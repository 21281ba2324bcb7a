"""qosflow.report_progress / qosflow.track write step timestamps to QOSFLOW_PROGRESS_FILE."""

from __future__ import annotations

import qosflow
from qosflow.progress import ENV_VAR, read_progress, step_times


def test_no_env_var_is_a_no_op(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    qosflow.report_progress(1, 10)
    assert list(qosflow.track(range(3))) == [0, 1, 2]
    assert list(tmp_path.iterdir()) == []


def test_report_progress_writes_json_lines(monkeypatch, tmp_path):
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    for s in range(1, 4):
        qosflow.report_progress(s, 3)
    ev = read_progress(path)
    assert [e.step for e in ev] == [1, 2, 3] and all(e.total == 3 for e in ev)
    assert all(b.t >= a.t for a, b in zip(ev, ev[1:]))


def test_track_reports_each_step_and_total(monkeypatch, tmp_path):
    path = tmp_path / "p.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    assert list(qosflow.track(["a", "b", "c"])) == ["a", "b", "c"]
    ev = read_progress(path)
    assert [e.step for e in ev] == [0, 1, 2, 3] and ev[0].total == 3
    assert len(step_times(ev)) == 3
    # a generator has no len: total stays unknown
    other = tmp_path / "q.jsonl"
    monkeypatch.setenv(ENV_VAR, str(other))
    list(qosflow.track(x for x in range(2)))
    assert [e.total for e in read_progress(other)] == [None, None, None]


def test_half_written_line_is_ignored(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"t": 1.0, "step": 1}\nnot json\n{"t": 2.0, "step": 3}\n{"t": 3.0, "st')
    ev = read_progress(p)
    assert [e.step for e in ev] == [1, 3]
    assert step_times(ev) == [0.5, 0.5]
    assert read_progress(tmp_path / "missing") == []

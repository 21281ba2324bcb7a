"""qosflow.report_progress / qosflow.track write step timestamps to QOSFLOW_PROGRESS_FILE."""

from __future__ import annotations

import re

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


def test_a_resumed_run_says_where_it_starts(monkeypatch, tmp_path):
    """`report_resumed` / `track(start=k)`: the worker reads the steps an earlier run did from the file's head."""
    import pytest

    from qosflow.placement_api import read_resumed

    path = tmp_path / "p.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    assert list(qosflow.track(range(60, 100), start=60)) == list(range(60, 100))  # the steps left of 100
    ev = read_progress(path)
    assert ev[0].resumed and (ev[0].step, ev[0].total) == (60, 100)
    assert [e.step for e in ev[1:]] == list(range(61, 101)) and not any(e.resumed for e in ev[1:])
    assert len(step_times(ev)) == 40  # the steps this run did, timed from its start
    assert read_resumed(str(path)) == 60
    fresh = tmp_path / "fresh.jsonl"
    monkeypatch.setenv(ENV_VAR, str(fresh))
    list(qosflow.track(range(3)))
    qosflow.report_progress(4, 10)
    assert read_resumed(str(fresh)) == 0 and read_resumed(str(tmp_path / "missing")) == 0
    by_hand = tmp_path / "hand.jsonl"
    monkeypatch.setenv(ENV_VAR, str(by_hand))
    qosflow.report_resumed(7, 20)
    qosflow.report_progress(8, 20)
    assert read_resumed(str(by_hand)) == 7
    with pytest.raises(ValueError, match="start must be >= 0"):
        qosflow.track(range(3), start=-1)  # at the call, not at the first step
    with pytest.raises(ValueError, match="step must be >= 0"):
        qosflow.report_resumed(-2, 10)
    with pytest.raises(ValueError, match=r"step=12 is more than the run's total of 10 steps"):
        qosflow.report_resumed(12, 10)
    with pytest.raises(ValueError, match=r"start=5 is more than the run's total of 4 steps"):
        qosflow.track(range(3), total=4, start=5)
    # a negative total is named as such (was "start=0 is more than the run's total of -1 steps")
    with pytest.raises(ValueError, match=r"track: invalid total: must be >= 0 .* got -1"):
        qosflow.track(range(3), total=-1)
    with pytest.raises(ValueError, match=r"report_resumed: invalid total: must be >= 0 .* got -2"):
        qosflow.report_resumed(0, -2)
    monkeypatch.delenv(ENV_VAR)  # checked whether or not a worker reads the progress
    with pytest.raises(ValueError, match="start must be >= 0"):
        qosflow.track(range(3), start=-1)


def test_echo_to_stderr_is_throttled_and_loses_no_last_line(monkeypatch, tmp_path, capfd):
    """QOSFLOW_PROGRESS_ECHO=stderr (a Kubernetes pod, whose worker reads its log): each line also goes to
    standard error after the prefix, at most one per ECHO_INTERVAL_S; a resumed run's first line and the
    line that reaches the total always; a line held back goes out when its interval ends."""
    import json
    import time

    from qosflow import progress

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "p.jsonl"))
    monkeypatch.setenv(progress.ECHO_ENV, "stderr")
    qosflow.report_resumed(10, 50)
    for s in range(11, 51):
        qosflow.report_progress(s, 50)
    qosflow.report_progress(51)  # no total: held back, then sent by the timer
    time.sleep(progress.ECHO_INTERVAL_S + 0.3)
    err = capfd.readouterr().err.splitlines()
    assert all(x.startswith(progress.ECHO_PREFIX) for x in err)
    recs = [json.loads(x[len(progress.ECHO_PREFIX):]) for x in err]
    steps = [r["step"] for r in recs]
    assert recs[0]["resumed"] and steps[0] == 10 and 50 in steps and steps[-1] == 51
    assert len(steps) < 10  # 42 reports in well under a second
    assert [e.step for e in read_progress(tmp_path / "p.jsonl")] == list(range(10, 52))  # the file has them all
    monkeypatch.delenv(progress.ECHO_ENV)
    qosflow.report_progress(52)
    assert capfd.readouterr().err == ""


def test_a_forked_child_echoes_its_held_line(monkeypatch, tmp_path):
    """A line held back in a child forked while the parent's timer was pending still goes out: the child
    starts its own timer (the parent's thread does not exist there)."""
    import os
    import time

    from qosflow import progress

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "p.jsonl"))
    monkeypatch.setenv(progress.ECHO_ENV, "stderr")
    err = tmp_path / "child.err"
    qosflow.report_progress(1)
    qosflow.report_progress(2)  # held: the parent's timer is pending
    pid = os.fork()
    if pid == 0:  # the child: its stderr to a file; a held line must go out within the interval
        try:
            fd = os.open(str(err), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            qosflow.report_progress(3)
            qosflow.report_progress(4)
            time.sleep(progress.ECHO_INTERVAL_S + 0.4)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    steps = [int(x.split('"step":')[1].split(",")[0]) for x in err.read_text().splitlines()]
    assert steps and steps[-1] == 4


def test_bad_step_values_fail_alike_with_and_without_a_worker(monkeypatch, tmp_path):
    """A step that is not a whole number >= 0 was ignored where no worker reads the progress (a notebook, a
    test), and under the worker failed the stage with "%d format: a real number is required, not str" or
    "cannot convert float NaN to integer" (2.5 was cut to 2). Now it is a SpecError naming the call and the
    argument, in both places; numpy integers and floats such as 3.0 still count."""
    import numpy as np
    import pytest

    from qosflow.errors import SpecError

    path = tmp_path / "p.jsonl"
    for env in (None, str(path)):
        if env is None:
            monkeypatch.delenv(ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(ENV_VAR, env)
        for args, says in (
            (("3", 10), "report_progress: invalid step: must be a whole number of steps, got '3'"),
            ((float("nan"), 10), "invalid step: must be a whole number of steps, got nan"),
            ((2.5, 10), "invalid step: must be a whole number of steps, got 2.5"),
            ((True, 10), "invalid step: must be a whole number of steps, got True"),
            ((-1, 10), "invalid step: must be >= 0"),
            ((1, "10"), "invalid total: must be a whole number of steps, got '10'"),
            ((1, -3), "invalid total: must be >= 0"),
        ):
            with pytest.raises(SpecError, match=re.escape(says)):
                qosflow.report_progress(*args)
        with pytest.raises(SpecError, match="track: invalid total: must be a whole number of steps, got 'all'"):
            qosflow.track(range(3), total="all")  # at the call, not at the first step
        with pytest.raises(SpecError, match="report_resumed: invalid step: must be a whole number of steps, got 'x'"):
            qosflow.report_resumed("x", 10)
    qosflow.report_progress(np.int64(2), np.int64(4))
    qosflow.report_progress(np.float32(3.0), 4.0)  # numpy's float32 too (not a Python float), as '%d' took it
    qosflow.report_progress(0, 0)  # a stage with nothing to do: track(range(0)) reports this
    assert [(e.step, e.total) for e in read_progress(path)] == [(2, 4), (3, 4), (0, 0)]
    assert '"step":3,"total":4' in path.read_text()  # written as integers, as the reader expects

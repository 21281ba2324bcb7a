"""Result tables fit the terminal they print to: on a terminal of 80 columns each table of `simulate`, `status`,
`pack` and `predict eval` is split into parts that fit it, every part naming every row, with the same figures as
the whole table. Printed elsewhere (a pipe, a file, a log: what these tests' captured output is unless they say
it is a terminal) the tables keep their full width, as before."""

from __future__ import annotations

import os
import re
import select
import sys
import time
from pathlib import Path

import pytest

from qosflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _as_terminal(monkeypatch, columns: int) -> None:
    """Rich takes the output for a terminal of `columns` columns (TTY_COMPATIBLE), without drawing progress bars."""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TTY_INTERACTIVE", "0")
    monkeypatch.setenv("NO_COLOR", "1")


def _plain(text: str) -> list[str]:
    return ANSI.sub("", text).splitlines()


def _tables(lines: list[str]) -> list[dict]:
    """The tables (rich's heavy-head box) in `lines`: {"title", "headers", "rows": [cells]} each, a cell's
    lines joined by spaces, a header's too; a row begins where its first cell is not empty."""
    out: list[dict] = []
    cur = None
    for i, ln in enumerate(lines):
        if ln.startswith("┏"):
            cur = {"title": lines[i - 1].strip() if i else "", "head": [], "rows": []}
            out.append(cur)
        elif cur is not None and ln.startswith("┃"):
            cur["head"].append([c.strip() for c in ln.strip("┃").split("┃")])
        elif cur is not None and ln.startswith("│"):
            cells = [c.strip() for c in ln.strip("│").split("│")]
            if cells[0] or not cur["rows"]:
                cur["rows"].append(cells)
            else:
                cur["rows"][-1] = [f"{a} {b}".strip() for a, b in zip(cur["rows"][-1], cells)]
        elif cur is not None and ln.startswith("└"):
            cur["headers"] = [" ".join(p for p in parts if p) for parts in zip(*cur.pop("head"))]
            cur = None
    return out


def _by_row(tables: list[dict], keep: int = 1) -> dict:
    """Row name (its first `keep` cells) -> header -> cell, over all `tables` (the parts of one table)."""
    merged: dict = {}
    for t in tables:
        for row in t["rows"]:
            merged.setdefault(tuple(row[:keep]), {}).update(zip(t["headers"], row))
    return merged


SIM = ["simulate", "--jobs", "60", "--cluster", "2x4", "--no-plots", "--seed", "3",
       "--policies", "fifo,sjf,srtf,tiresias,sjf-ffs,sjf-bsbf,genie,qosflow"]


def test_simulate_tables_fit_an_80_column_terminal_with_every_policy_and_figure(monkeypatch, capsys):
    """simulate printed its tables 120 columns wide (116 for the default policies' class table) into an 80-column
    terminal, where every line wrapped into the next. Each table is now in parts of 80 columns at most, every part
    naming every policy (and the bound), and the figures are those of the whole table printed elsewhere."""
    assert main(SIM) in (0, None)
    wide = _plain(capsys.readouterr().out)
    assert max(map(len, wide)) > 100  # (elsewhere: the whole table, as before)
    whole = _tables(wide)
    _as_terminal(monkeypatch, 80)
    assert main(SIM) in (0, None)
    narrow = _plain(capsys.readouterr().out)
    assert max(map(len, narrow)) <= 80, "\n".join(ln for ln in narrow if len(ln) > 80)
    parts = _tables(narrow)
    main_parts = [t for t in parts if t["title"].startswith("synthetic-60-seed3 on 2x4")]
    class_parts = [t for t in parts if t["title"].startswith("Deadlines met by job class")]
    assert len(main_parts) >= 2 and len(class_parts) >= 2, [t["title"] for t in parts]
    policies = SIM[-1].split(",")
    for t in main_parts:
        assert [r[0] for r in t["rows"]] == policies + ["bound"], t
    # the figures a GPU cluster's user reads first in the first part
    assert {"policy", "DSR", "avg JCT", "p99 JCT", "avg queue", "GPU alloc"} <= set(main_parts[0]["headers"])
    assert _by_row(main_parts) == _by_row([whole[0]])
    classes = [r[0] for r in whole[1]["rows"]]
    for t in class_parts:
        assert [r[0] for r in t["rows"]] == classes
    assert _by_row(class_parts) == _by_row([whole[1]])
    assert sorted(h for t in class_parts for h in t["headers"][2:]) == sorted(policies)
    # the caption once, below the parts, at the terminal's width
    text = " ".join(" ".join(narrow).split())
    assert text.count("bound: each job alone on an idle cluster") == 1


@pytest.mark.parametrize("columns", [100, 120])
def test_simulate_tables_fit_wider_terminals_too(columns, monkeypatch, capsys):
    _as_terminal(monkeypatch, columns)
    assert main(SIM[:-1] + ["fifo,srtf,sjf-bsbf,qosflow", "--estimator", "oracle,noisy", "--users", "3"]) in (0, None)
    lines = _plain(capsys.readouterr().out)
    tables = _tables(lines)
    assert max(len(ln) for ln in lines if ln[:1] in "┏┃│└┡") <= columns
    titles = [t["title"] for t in tables]
    assert any(t.startswith("QoS lost to prediction error") for t in titles)
    assert any(t.startswith("Per user (oracle)") for t in titles), titles


def test_simulate_output_elsewhere_keeps_its_full_width(monkeypatch, capsys):
    """Not a terminal (a pipe, a log): the tables whole, at 120 columns or more, whatever COLUMNS says."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(SIM) in (0, None)
    lines = _plain(capsys.readouterr().out)
    tables = _tables(lines)
    assert [t["title"] for t in tables] == ["synthetic-60-seed3 on 2x4", "Deadlines met by job class"]
    assert "preempt" in tables[0]["headers"] and "avg JCT" in tables[0]["headers"]
    assert not any("(continued)" in ln for ln in lines)


def test_force_color_in_a_log_is_not_a_terminal(monkeypatch, capsys):
    """FORCE_COLOR (set by CI jobs for coloured logs) makes rich take any output for a terminal: the tables were
    split at rich's default 80 columns in such a log. It colours them; their width stays that of a log."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    assert main(SIM) in (0, None)
    lines = _plain(capsys.readouterr().out)
    assert [t["title"] for t in _tables(lines)] == ["synthetic-60-seed3 on 2x4", "Deadlines met by job class"]
    assert not any("(continued)" in ln for ln in lines) and max(map(len, lines)) > 100


def test_force_color_in_a_log_gets_progress_lines_not_a_bar(monkeypatch):
    """Under FORCE_COLOR a log got rich's live progress bar (its redraws, cursor movements and all) instead of
    the progress lines a log gets."""
    import io

    from rich.console import Console

    from qosflow.cli.output import LogProgress, progress_bar

    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("TTY_INTERACTIVE", raising=False)
    assert isinstance(progress_bar(console=Console(file=io.StringIO())), LogProgress)


def _fake_pool(monkeypatch, stages):
    import qosflow.prefect.local as local
    import qosflow.prefect.status as status
    from qosflow.prefect.status import PoolStatus, WorkerStatus

    async def no_check(pool, **kw):
        return None

    async def fake_status(pool, limit=200):
        return PoolStatus(pool, workers=[WorkerStatus("qosflow-worker-gpu-node-01", "ONLINE", True, 3.0)], stages=stages)

    monkeypatch.setattr(local, "check_pool", no_check)
    monkeypatch.setattr(local, "require_api_url", lambda what: "http://127.0.0.1:1/api")
    monkeypatch.setattr(status, "pool_status", fake_status)


def _stages():
    from qosflow.prefect.status import StageStatus

    return [
        StageStatus("1", "train_softmax_candidates", "retrain-nightly-digits", "Running", "running", host="gpu-node-03",
                    gpus="gpu-node-03:0,gpu-node-03:1", priority="guaranteed", since_s=3600, predicted_s=7200,
                    deadline_in_s=9000, done_pct=48, user="alice"),
        StageStatus("2", "evaluate", "retrain-nightly-digits", "Pending", "queued", priority="best-effort", since_s=120,
                    predicted_s=300, user="bob",
                    why_waiting="no node has 2 GPUs free with 6000 MiB each; next free in about 25 min (gpu-node-03)"),
        StageStatus("3", "featurize", "ingest", "Scheduled", "unclaimed", since_s=30, user="carol"),
    ]


def test_status_stage_table_fits_an_80_column_terminal(monkeypatch, capsys):
    """status printed its stage table 120 columns wide on any terminal; at 80 columns it is in parts that fit,
    each naming every stage, the first with each stage's phase, progress and where it runs or why it waits."""
    _fake_pool(monkeypatch, _stages())
    _as_terminal(monkeypatch, 80)
    assert main(["status", "--pool", "gpu"]) in (0, None)
    lines = _plain(capsys.readouterr().out)
    assert max(map(len, lines)) <= 80, "\n".join(ln for ln in lines if len(ln) > 80)
    parts = [t for t in _tables(lines) if t["title"].startswith("stage runs")]
    assert len(parts) >= 2
    for t in parts:
        assert [r[0].replace(" ", "") for r in t["rows"]] == ["train_softmax_candidates", "evaluate", "featurize"]
    assert {"phase", "done", "where, or why it waits"} <= set(parts[0]["headers"])
    rows = _by_row(parts)
    assert rows[("evaluate",)]["where, or why it waits"] == ("QoS queue: no node has 2 GPUs free with 6000 MiB each; "
                                                             "next free in about 25 min (gpu-node-03)")
    assert rows[("train_softmax_candidates",)]["user"] == "alice"
    assert rows[("train_softmax_candidates",)]["deadline in"] == "2.5 h"
    assert sorted(h for t in parts for h in t["headers"][1:]) == sorted(
        ["pipeline", "user", "class", "phase", "for", "done", "predicted", "deadline in", "where, or why it waits"])


def test_status_elsewhere_keeps_one_stage_table_of_120_columns(monkeypatch, capsys):
    _fake_pool(monkeypatch, _stages())
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["status", "--pool", "gpu"]) in (0, None)
    lines = _plain(capsys.readouterr().out)
    assert [t["title"] for t in _tables(lines)] == ["workers", "stage runs"]
    assert max(map(len, lines)) == 120


def test_split_table_keeps_every_column_once_and_the_row_names_in_each_part():
    from rich.console import Console
    from rich.table import Table

    from qosflow.cli.output import split_table, table_width

    t = Table(title="T", caption="c")
    for name in ("policy", "a", "b", "c", "d", "e"):
        t.add_column(name, justify="right")
    t.add_row("fifo", *(f"{k}" * 14 for k in "abcde"), style="bold")
    t.add_row("bound", "1", "", "", "", "5", style="dim", end_section=True)
    console = Console(width=200)
    assert split_table(t, console, 200) == [t]
    parts = split_table(t, console, 60, first=("e", "c"))
    assert all(table_width(p, console) <= 60 for p in parts) and len(parts) == 3
    assert [[c.header for c in p.columns] for p in parts] == [["policy", "c", "e"], ["policy", "a", "b"], ["policy", "d"]]
    assert all(list(p.columns[0].cells) == ["fifo", "bound"] for p in parts)
    assert all([(r.style, r.end_section) for r in p.rows] == [("bold", False), ("dim", True)] for p in parts)
    assert [p.title for p in parts] == ["T", "T (continued)", "T (continued)"]
    assert [p.caption for p in parts] == [None, None, "c"]
    assert [c.header for c in t.columns] == ["policy", "a", "b", "c", "d", "e"]  # (the table itself untouched)


def test_simulate_in_a_real_80_column_terminal_fits_it():
    """Through a pseudo-terminal of 80 columns, COLUMNS unset: the terminal's own size is what the tables fit."""
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of 80 columns
        try:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
            env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR")}
            env.update(PYTHONPATH=str(ROOT), TERM="xterm", NO_COLOR="1")
            os.chdir(ROOT)
            os.execve(sys.executable, [sys.executable, "-m", "qosflow", *SIM[:-1], "fifo,sjf,srtf,tiresias,qosflow"], env)
        finally:
            os._exit(127)
    out = b""
    give_up = time.monotonic() + 240
    while time.monotonic() < give_up:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child has ended
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")
    # the progress bar redraws its lines in place: the last text of each line is what stays on the screen
    lines = [ln.split("\r")[-1] for ln in ANSI.sub("", out.decode(errors="replace")).replace("\r\n", "\n").split("\n")]
    assert max(map(len, lines)) <= 80, "\n".join(ln for ln in lines if len(ln) > 80)
    parts = [t for t in _tables(lines) if t["title"].startswith("synthetic-60-seed3")]
    assert len(parts) >= 2 and all([r[0] for r in t["rows"]][-1] == "bound" for t in parts)

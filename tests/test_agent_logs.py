"""Stages that write a lot of output, on a real agent process over real HTTP.

A stage's stdout and stderr go to a file in the agent's work directory (no pipe: a chatty stage never blocks on
it). Those files were kept until the agent had 10,000 stage records: a training loop that prints every step wrote
13 MB a run in `qosflow demo`-sized pipelines, so an agent's /tmp grew by tens of GB before anything went. And each
start of an agent without --workdir made a new temp directory that nothing removed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from qosflow.agent.testing import AgentProcess

pytestmark = pytest.mark.timeout(90)

TOKEN = "test-token-logs-e21f"
H = {"Authorization": f"Bearer {TOKEN}"}
#: ~600 KB of output in 3000 lines
CHATTY = [sys.executable, "-c", "import sys\nfor i in range(3000): print(i, 'x' * 200)\nsys.stdout.flush()"]


def _run(c: httpx.Client, sid: str) -> dict:
    r = c.post("/v1/stages", json={"stage_id": sid, "command": CHATTY})
    assert r.status_code == 201, r.text
    st = c.get(f"/v1/stages/{sid}/wait", params={"timeout": 30}).json()
    assert st["state"] == "exited" and st["returncode"] == 0, st
    return st


def test_the_logs_of_ended_stages_stay_within_the_agents_budget(tmp_path: Path):
    work = tmp_path / "work"
    with AgentProcess("host-l", TOKEN, args=["--workdir", str(work), "--max-logs-mb", "1"], log=tmp_path / "agent.log") as a, \
            httpx.Client(base_url=a.url, headers=H, timeout=40) as c:
        for i in range(4):
            _run(c, f"chatty-{i}")
            time.sleep(0.05)
        logs = {p.name: p.stat().st_size for p in work.glob("*.log")}
        assert sum(logs.values()) <= 2**20, logs
        last = c.get("/v1/stages/chatty-3/logs", params={"follow": False}).text
        assert last.splitlines()[-1].startswith("2999 "), "the newest stage's log must be whole"
        first = c.get("/v1/stages/chatty-0")
        assert first.status_code == 200 and first.json()["log_removed"] is True  # (its record stays: the worker may ask)
        assert c.get("/v1/stages/chatty-3").json()["log_removed"] is False


def test_an_agent_without_workdir_removes_its_temp_directory_when_it_stops(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # (where the agent makes its temp directory)
    a = AgentProcess("host-tmp", TOKEN, log=tmp_path / "agent.log").start()
    try:
        with httpx.Client(base_url=a.url, headers=H, timeout=40) as c:
            _run(c, "chatty-tmp")
        [made] = list(tmp_path.glob("qosflow-agent-host-tmp-*"))
        assert list(made.glob("*.log"))
    finally:
        a.stop()
    assert not made.exists(), f"the stopped agent left {made} behind"


def test_a_log_removed_while_it_is_being_read_is_read_to_its_end(tmp_path: Path):
    """The budget removes a stage's log at its end (with --max-logs-mb 0 at once): a reader still behind (the worker
    following rank 0's output) reopened the file for each chunk, found it gone and ended the stream there, without
    the stage's last lines (a failed stage's traceback)."""
    work = tmp_path / "work"
    trigger = tmp_path / "go"
    code = ("import os, sys, time\n"
            "for i in range(100000): sys.stdout.write('%06d %s\\n' % (i, 'y' * 150))\n"
            "sys.stdout.flush()\n"
            f"while not os.path.exists({str(trigger)!r}): time.sleep(0.05)\n"
            "print('THE-END', flush=True)\n")
    with AgentProcess("host-lr", TOKEN, port=4832, args=["--workdir", str(work), "--max-logs-mb", "0"],
                      log=tmp_path / "agent.log") as a, httpx.Client(base_url=a.url, headers=H, timeout=40) as c:
        r = c.post("/v1/stages", json={"stage_id": "big-1", "command": [sys.executable, "-c", code]})
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (work / "big-1.log").stat().st_size < 100000 * 158:
            time.sleep(0.05)
        with c.stream("GET", "/v1/stages/big-1/logs", params={"follow": True}) as s:
            chunks = s.iter_bytes()
            got = [next(chunks)]  # (the reader is behind: the rest of the 15 MB waits in the agent)
            trigger.touch()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not c.get("/v1/stages/big-1").json()["log_removed"]:
                time.sleep(0.05)
            assert c.get("/v1/stages/big-1").json()["log_removed"], "the test needs the log removed while it is read"
            got.extend(chunks)
        text = b"".join(got).decode()
        assert text.rstrip().endswith("THE-END"), f"the stream ended at {text[-80:]!r}"
        assert c.get("/v1/stages/big-1/logs", params={"follow": False}).text.startswith("qosflow agent: this stage's log was removed")


def _progress_stage(kb: int) -> list[str]:
    """A stage that writes `kb` KiB of progress lines (as `qosflow.report_progress` at every step) and one line of output."""
    return [sys.executable, "-c", "import os\nline = '{\"step\": 1, \"total\": 100, \"pad\": \"' + 'p' * 90 + '\"}\\n'\n"
            f"open(os.environ['QOSFLOW_PROGRESS_FILE'], 'w').write(line * ({kb} * 1024 // len(line)))\nprint('done')"]


def test_progress_files_count_towards_the_budget_and_go_with_their_log(tmp_path: Path):
    """The `.progress` files beside the logs were neither counted by --max-logs-mb nor removed with their log: a stage
    reporting progress at every step filled the agent's directory past the budget."""
    work = tmp_path / "work"
    with AgentProcess("host-lp", TOKEN, args=["--workdir", str(work), "--max-logs-mb", "1"], log=tmp_path / "agent.log") as a, \
            httpx.Client(base_url=a.url, headers=H, timeout=40) as c:
        for i in range(4):
            r = c.post("/v1/stages", json={"stage_id": f"prog-{i}", "command": _progress_stage(400)})
            assert r.status_code == 201, r.text
            st = c.get(f"/v1/stages/prog-{i}/wait", params={"timeout": 30}).json()
            assert st["state"] == "exited" and st["returncode"] == 0, st
            got = c.post("/v1/progress", json={"offsets": {f"prog-{i}": 0}}).json()["stages"][f"prog-{i}"]
            assert len(got) > 390 * 1024  # (the worker's copy of it: whole)
        files = {p.name: p.stat().st_size for p in work.iterdir()}
        assert sum(files.values()) <= 2**20, files
        assert "prog-0.progress" not in files and "prog-0.log" not in files, files
        assert "prog-3.progress" in files and "prog-3.log" in files, files


def test_an_ended_stages_progress_stays_until_the_worker_has_read_it(tmp_path: Path):
    """With --max-logs-mb 0 a stage's log goes as it ends; its progress file goes too, but only once read to its end:
    the worker copies a stage's last progress lines after it ended."""
    work = tmp_path / "work"
    with AgentProcess("host-l0", TOKEN, args=["--workdir", str(work), "--max-logs-mb", "0"], log=tmp_path / "agent.log") as a, \
            httpx.Client(base_url=a.url, headers=H, timeout=40) as c:
        assert c.post("/v1/stages", json={"stage_id": "p0", "command": _progress_stage(8)}).status_code == 201
        st = c.get("/v1/stages/p0/wait", params={"timeout": 30}).json()
        assert st["state"] == "exited" and st["log_removed"] is True, st
        assert (work / "p0.progress").exists()
        first = c.get("/v1/stages/p0/progress", params={"offset": 0}).content
        assert len(first) > 7 * 1024 and first.endswith(b"}\n")
        assert not (work / "p0.progress").exists(), "the progress file of a removed log stayed after it was read to its end"
        assert c.get("/v1/stages/p0/progress", params={"offset": len(first)}).content == b""

"""A lab admin's cluster-file mistakes (docs/infrastructure.md, "Cluster files"), read by `load_cluster_file` and
`qosflow agent status` against a real agent: each says what is wrong, where, and what to do."""

from __future__ import annotations

import functools
import http.server
import logging
import os
import threading
from pathlib import Path

import pytest

from qosflow.agent.testing import AgentProcess
from qosflow.backends.agent import load_cluster_file
from qosflow.errors import SpecError

pytestmark = pytest.mark.timeout(60)

TOKEN = "journey-token-9e2b"


def _file(tmp_path: Path, hosts: str, head: str = "token: x\n") -> Path:
    f = tmp_path / "lab.yaml"
    f.write_text(f"name: lab\n{head}hosts:\n{hosts}")
    return f


def test_a_missing_token_file_names_where_it_was_looked_for_and_what_to_put_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = _file(tmp_path, "  - {name: gpu-a, agent_url: 'http://10.0.0.11:8701'}\n", head="token_file: agent-token\n")
    with pytest.raises(SpecError) as err:
        load_cluster_file(Path("lab.yaml"))
    msg = str(err.value)
    assert f"cannot read {tmp_path / 'agent-token'}" in msg and "beside the cluster file" in msg, msg
    assert "the same file the agents' --token-file reads" in msg, msg
    (tmp_path / "agent-token").write_text("\n")
    with pytest.raises(SpecError, match="is empty; put the cluster's secret token in it"):
        load_cluster_file(f)


def test_a_token_file_others_can_read_is_warned_about_once(tmp_path, caplog):
    """The agent warned about its --token-file readable by other users; the worker's own copy, beside its cluster file,
    was taken without a word (and the worker reads the file again every minute: once is enough)."""
    caplog.set_level(logging.WARNING, logger="qosflow.backends.agent")
    tok = tmp_path / "agent-token"
    tok.write_text("s3cret\n")
    os.chmod(tok, 0o644)
    f = _file(tmp_path, "  - {name: gpu-a, agent_url: 'http://10.0.0.11:8701'}\n", head="token_file: agent-token\n")
    assert load_cluster_file(f).token == "s3cret"
    load_cluster_file(f)
    said = [r.getMessage() for r in caplog.records if "token file" in r.getMessage()]
    assert len(said) == 1 and "mode 0644" in said[0] and f"chmod 600 {tok}" in said[0] and "s3cret" not in said[0], said
    os.chmod(tok, 0o600)
    caplog.clear()
    load_cluster_file(f)
    assert not [r for r in caplog.records if "token file" in r.getMessage()]


def test_agent_status_names_a_declared_size_the_agent_does_not_have_and_urls_that_are_no_host_s_agent(tmp_path, capsys, monkeypatch,
                                                                                                   caplog):
    """The cluster file declares 4 GPUs for an agent of 2, a host whose URL is some other web server (404), and a host
    at the first host's URL: the worker warned about the first, `qosflow agent status` said nothing; the second read
    only "inventory answered HTTP 404"; the third asked to rename a host, while the fix is another URL."""
    from qosflow.cli.main import main

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with AgentProcess("gpu-a", TOKEN, virtual_gpus=2, log=tmp_path / "a.log") as a:
            f = _file(tmp_path, f"  - {{name: gpu-a, agent_url: '{a.url}', gpus: 4}}\n"
                                f"  - {{name: web, agent_url: 'http://127.0.0.1:{web.server_address[1]}'}}\n"
                                f"  - {{name: gpu-b, agent_url: '{a.url}/'}}\n", head=f"token: {TOKEN}\n")
            # two hosts at one agent's URL: refused as the file is read (before: gpu-b down at the first contact)
            monkeypatch.setenv("COLUMNS", "1000")  # (one line per host)
            assert main(["agent", "status", "--cluster", str(f)]) == 2
            said = " ".join(capsys.readouterr().err.split())
            assert f"hosts gpu-a and gpu-b have the same agent_url {a.url}/: each host runs its own agent; give gpu-b its " \
                   "agent's URL" in said and "hosts[2]" in said and "--name" not in said, said
            f = _file(tmp_path, f"  - {{name: gpu-a, agent_url: '{a.url}', gpus: 4}}\n"
                                f"  - {{name: web, agent_url: 'http://127.0.0.1:{web.server_address[1]}'}}\n",
                      head=f"token: {TOKEN}\n")
            with caplog.at_level("WARNING", logger="qosflow.backends.agent"):
                assert main(["agent", "status", "--cluster", str(f)]) == 1
    finally:
        web.shutdown()
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if "gpu-a" in line)
    assert "the cluster file declares 4 GPUs, its agent reports 2; using the agent's" in row, row
    # why a host is down: one whole line each below the table (in its 'up' column it wrapped a word a line),
    # and not also as the backend's log lines above it
    row = next(line for line in err.splitlines() if line.startswith("web is down: "))
    assert "answered HTTP 404, which a qosflow agent does not" in row and "check the agent URL" in row, row
    assert not [r for r in caplog.records if " is down" in r.getMessage()], caplog.text

"""`qosflow agent ... --help` and docs/infrastructure.md say what the agent does (b989972: --max-logs-mb, the temp
work directory removed on stop, the fence hold a stopping worker asks for, GET /v1/stages, POST /v1/fence/hold)."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from qosflow.cli.main import app

DOC = Path(__file__).resolve().parents[1] / "docs" / "infrastructure.md"


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def _option_helps() -> dict[str, str]:
    start = typer.main.get_command(app).commands["agent"].commands["start"]
    return {p.opts[0]: p.help or "" for p in start.params}


def test_agent_status_help_has_an_example():
    text = _help("agent", "status")
    assert "Examples:" in text and "qosflow agent status --cluster lab.yaml" in text, text
    # it says that asking the agents ends a stopping worker's fence hold
    assert "fence hold" in text, text


def test_agent_start_help_says_the_log_limit_and_where_logs_go():
    from qosflow.agent.app import AgentConfig

    helps = _option_helps()
    assert "(default 10240, i.e. 10 GiB" in helps["--max-logs-mb"], helps["--max-logs-mb"]
    assert "log_removed" in helps["--max-logs-mb"]
    # the help's default is the agent's
    assert AgentConfig(token="t", name="h").max_logs_mb == 10_240.0
    assert "removed when the agent stops" in helps["--workdir"] and "a --workdir is kept" in helps["--workdir"]
    assert "QOSFLOW_AGENT_FENCE_HOLD_SECONDS" in helps["--fence-after"]
    text = _help("agent", "start")
    assert "--max-logs-mb 2048" in text, text  # (an example with it)


def test_the_fence_hold_variable_of_the_help_and_docs_is_the_workers():
    src = (Path(__file__).resolve().parents[1] / "qosflow" / "backends" / "agent.py").read_text()
    assert 'env_number("QOSFLOW_AGENT_FENCE_HOLD_SECONDS", env_number("QOSFLOW_LEASE_TTL_SECONDS", 30.0))' in src
    doc = DOC.read_text()
    assert "QOSFLOW_AGENT_FENCE_HOLD_SECONDS" in doc and "--max-logs-mb" in doc


def test_every_agent_route_is_in_the_docs_api_table(tmp_path):
    from qosflow.agent.app import AgentConfig, create_app

    api = create_app(AgentConfig(token="t", name="h", virtual_gpus=1, workdir=tmp_path / "w"))
    # (the docs write a stage's id as {id})
    routes = {(m, r.path.replace("{stage_id}", "{id}")) for r in api.routes if r.path.startswith("/v1/")
              for m in getattr(r, "methods", ())}
    doc = DOC.read_text()
    table = doc[doc.index("HTTP API (all JSON"):]
    table = table[: table.index("\n\n", table.index("| method"))]
    rows = [(m, set(re.findall(r"`(/v1/[^`?]*)", paths))) for m, paths in re.findall(r"^\| (\w+) \| ([^|]+) \|", table, re.M)]
    missing = [f"{m} {p}" for m, p in sorted(routes) if not any(m == rm and p in ps for rm, ps in rows)]
    assert not missing, missing
    # the fields the worker sends and the agent reports, under their names in the code
    from qosflow.agent.app import LaunchRequest
    from qosflow.agent.runner import StageProc

    assert "python_fallback" in LaunchRequest.model_fields and "`python_fallback`" in table
    st = StageProc(stage_id="s", command=["x"], log_path=tmp_path / "s.log")
    for key in st.status():
        assert f"`{key}`" in table, key

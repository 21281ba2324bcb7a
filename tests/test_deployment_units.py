"""The systemd units shipped in deployments/systemd: every option their ExecStart gives is one the command
takes today (a renamed option would leave a unit that fails at boot), and their KillMode is the one the
docs require."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
import pytest
import typer

UNITS = Path(__file__).resolve().parent.parent / "deployments" / "systemd"


def unit(path: Path) -> dict[str, list[str]]:
    """A unit's `[Service]` keys (a key may repeat), with backslash continuations joined."""
    text = path.read_text().replace("\\\n", " ")
    section, out = "", {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service":
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def command(*path: str) -> click.Command:
    from qosflow.cli.main import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


@pytest.mark.parametrize("name, sub, kill_mode", [
    ("qosflow-agent.service", ("agent", "start"), "mixed"),
    ("qosflow-worker.service", ("worker", "start"), "process"),
])
def test_units_call_options_that_exist(name, sub, kill_mode):
    svc = unit(UNITS / name)
    argv = shlex.split(svc["ExecStart"][0])
    assert argv[0].endswith("/qosflow") and tuple(argv[1:3]) == sub, argv
    cmd = command(*sub)
    known = {opt for p in cmd.params for opt in p.opts}
    given = [a for a in argv[3:] if a.startswith("--")]
    assert given and not [a for a in given if a not in known], f"{name}: options the command does not take: {set(given) - known}"
    ctx = cmd.make_context(" ".join(sub), argv[3:], resilient_parsing=False)  # values of the right types too
    assert ctx.params
    assert svc["KillMode"] == [kill_mode]

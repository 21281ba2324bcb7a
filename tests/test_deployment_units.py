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


def test_alert_rules_use_series_the_worker_exports():
    """deployments/prometheus/qosflow-alerts.yaml: every qosflow_* series and label value its rules select is
    one a worker's metrics have (a renamed series or label would leave an alert that never fires)."""
    import asyncio
    import re
    import time

    import yaml
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from qosflow.core.cluster import ClusterSpec
    from qosflow.prefect.metrics import WorkerMetrics
    from qosflow.prefect.scheduler import QoSScheduler
    from test_prefect_scheduler import PriorityFirstFit, enqueue, entry

    rules = yaml.safe_load((UNITS.parent / "prometheus" / "qosflow-alerts.yaml").read_text())
    found = [r for g in rules["groups"] for r in g["rules"]]
    assert len(found) >= 4 and all(r.get("alert") and r.get("annotations", {}).get("summary") for r in found)

    async def series():
        s = QoSScheduler(ClusterSpec.uniform(1, 1, cpu_cores=2, virtual=True), PriorityFirstFit())
        m = WorkerMetrics("p", "w", lambda: s)
        running = await enqueue(s, entry("r"))
        s.round()
        await running
        waiting = await enqueue(s, entry("d", deadline_at=time.time() + 60))  # (the one GPU is taken: it waits)
        s.round()
        for kind, met in (("ok", True), ("ok", False), ("infra", None)):
            m.stage_finished(kind, met)
        text = generate_latest(m.registry).decode()
        waiting.cancel()
        return [(smp.name, smp.labels) for fam in text_string_to_metric_families(text) for smp in fam.samples]

    samples = asyncio.run(series())
    for rule in found:
        for name, selector in re.findall(r"\b(qosflow_[a-z_]+)(?:\{([^}]*)\})?", rule["expr"]):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', selector or ""))
            assert any(n == name and all(lab.get(k) == v for k, v in labels.items()) for n, lab in samples), \
                f"alert {rule['alert']}: no series {name} with {labels} among the worker's"

"""`qosflow status`: a pool's workers and stage runs (running where, queued and why), from the server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

HELP = """Show what a `qosflow` work pool is doing: its workers, the stage runs running (host, GPUs,
how long, per cent done from their progress reports, predicted duration, time to the deadline, and
whom each runs for when stages name their user), and
those waiting in the QoS queue with the
policy's latest reason (or not taken by any worker yet).

Read from the Prefect server at PREFECT_API_URL, as the UI shows it.

Examples:

  qosflow status --pool gpu

  qosflow status --pool gpu --json status.json
"""


def _dur(x: float | None) -> str:
    from qosflow.sim.report import fmt_seconds

    return "-" if x is None else ("-" if x < 0 else "") + fmt_seconds(abs(x))


def register(app: typer.Typer) -> None:
    @app.command("status", help=HELP)
    def status_cmd(
        pool: str = typer.Option("gpu", "--pool", "-p", help="work pool name"),
        limit: int = typer.Option(200, "--limit", min=1, help="most stage runs to read"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="also write the status as JSON here"),
    ) -> None:
        import asyncio

        from rich.console import Console
        from rich.table import Table

        from qosflow.cli.output import check_output_file, write_json_file
        import httpx

        from qosflow.prefect.local import check_pool, check_pool_name, require_api_url, unreachable_server
        from qosflow.prefect.status import pool_status

        if json_out is not None:
            check_output_file(json_out)
        check_pool_name(pool)
        url = require_api_url("qosflow status")
        try:
            asyncio.run(check_pool(pool))
            st = asyncio.run(pool_status(pool, limit=limit))
        except (httpx.TransportError, RuntimeError) as exc:  # no server there: was an httpx.ConnectError traceback
            away = unreachable_server(exc, url)
            if away is None:
                raise
            raise away from None
        console = Console(width=max(120, Console().width))
        online = [w for w in st.workers if w.online]
        console.print(f"[bold]pool {pool}[/] on {url}: {len(online)} of {len(st.workers)} worker(s) online, "
                      f"{st.pipelines_running} pipeline run(s) of its deployments running or due"
                      + (f", {st.pipelines_scheduled} scheduled later (the next at "
                         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(st.next_pipeline_at))})"
                         if st.pipelines_scheduled and st.next_pipeline_at is not None else ""))
        if st.workers:
            wt = Table(title="workers")
            for col in ("worker", "status", "last heartbeat"):
                wt.add_column(col)
            for w in st.workers:
                wt.add_row(w.name, w.status, f"{_dur(w.heartbeat_ago_s)} ago")
            console.print(wt)
        elif any(s.phase == "unclaimed" for s in st.stages):
            console.print(f"[yellow]no worker polls pool {pool!r}:[/] start one with `qosflow worker start --pool {pool}`")
        if not st.stages:
            console.print("no stage run is running or waiting")
        else:
            t = Table(title="stage runs")
            users = any(s.user for s in st.stages)  # (a column only when some stage says whom it runs for)
            for col in ("stage", "pipeline", *(("user",) if users else ()), "class", "phase", "where", "for", "done", "predicted", "deadline in", "why it waits"):
                t.add_column(col, overflow="fold")
            for s in st.stages:
                where = f"{s.host} {s.gpus}".strip() if s.phase == "running" else "QoS queue" if s.phase == "queued" else "no worker yet"
                if s.elastic_note:
                    where += f" ({s.elastic_note})"
                done = "-" if s.done_pct is None else f"{s.done_pct:.0f} %"
                # placed, its process still starting (Pending): 'starting', not 'running'
                phase = "starting" if s.phase == "running" and s.state.upper() == "PENDING" else s.phase
                t.add_row(s.name, s.pipeline or "-", *((s.user or "-",) if users else ()), s.priority or "-", phase, where, _dur(s.since_s), done, _dur(s.predicted_s),
                          _dur(s.deadline_in_s), s.why_waiting or "")
            console.print(t)
        if json_out is not None:
            console.print(f"JSON: {write_json_file(json_out, st.to_json())}")

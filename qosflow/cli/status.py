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

Read from the Prefect server at PREFECT_API_URL, as the UI shows it. The pipeline runs' processes that
workers of pools on host agents or Kubernetes started on their own host (they outlive a worker restart)
are read from the lease store of this machine (QOSFLOW_DATABASE_URL): which worker watches each, adopted
after a restart or none, and whether it still runs (told on its own host only).

Examples:

  qosflow status --pool gpu

  qosflow status --pool gpu --json status.json
"""


def _dur(x: float | None) -> str:
    from qosflow.sim.report import fmt_seconds

    return "-" if x is None else ("-" if x < 0 else "") + fmt_seconds(abs(x))


def _pipeline_table(procs: list) -> "Table":
    """The pipeline processes of the lease store (`PipelineProcessStatus`), a row each. Their output files are
    `<dir>/<flow run id>.log`: with one such directory for all, it is said once below the table (a column of
    80-character paths beside the run ids did not fit a terminal)."""
    import os

    from rich.table import Table

    given = [p for p in procs if p.output]
    dirs = {os.path.dirname(p.output) for p in given}
    one_dir = dirs.pop() if len(dirs) == 1 and all(os.path.basename(p.output) == f"{p.flow_run_id}.log" for p in given) else None
    now = time.time()
    t = Table(title="pipeline processes (lease store)",
              caption=f"output: {os.path.join(one_dir, '<flow run id>.log')}" if one_dir is not None else None)
    t.add_column("pipeline run", no_wrap=True)
    for col in ("state", "worker", "watched", "host", "pid", "started", "alive", *(() if one_dir is not None else ("output",))):
        t.add_column(col, overflow="fold")
    for p in procs:
        watched = {"yes": "yes", "adopted": "adopted (restart)"}.get(p.watched, "[yellow]no worker[/]")
        alive = "[yellow]no[/]" if p.alive is False else p.alive_text
        t.add_row(f"{p.name}\n{p.flow_run_id}" if p.name else p.flow_run_id, p.state or "?", p.worker, watched, p.host,
                  str(p.pid), f"{_dur(now - p.started_at)} ago", alive, *(() if one_dir is not None else (p.output or "-",)))
    return t


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
        if st.pipeline_processes:
            console.print(_pipeline_table(st.pipeline_processes))
        elif st.pipeline_processes_note:
            console.print(st.pipeline_processes_note, style="dim", markup=False)
        if json_out is not None:
            console.print(f"JSON: {write_json_file(json_out, st.to_json())}")

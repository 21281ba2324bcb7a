"""`qosflow status`: a pool's workers and stage runs (running where, queued and why), from the server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:
    from rich.table import Table

HELP = """Show what a `qosflow` work pool is doing: its workers, the stage runs running (host, GPUs,
how long, per cent done from their progress reports, predicted duration, time to the deadline, and
whom each runs for when stages name their user), and
those waiting in the QoS queue with the
policy's latest reason (or not taken by any worker yet). Hosts that are not up (down, or draining: removed
from the cluster's description, their running stages kept to their end) are listed, as the worker's cluster
table in the UI (qosflow-cluster-<pool>) shows them, and a stage on a draining host says so.

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
                  str(p.pid) if p.pid else "-", f"{_dur(now - p.started_at)} ago", alive, *(() if one_dir is not None else (p.output or "-",)))
    return t


#: the columns of the stage table that go into its first part on a terminal too narrow for the whole table
STAGE_FIRST = ("phase", "done", "where, or\nwhy it waits", "deadline in")
#: its columns of names and prose, which wrap well: counted at no more than these widths when the parts are made
STAGE_FLEXIBLE = {"stage": 24, "pipeline": 20, "user": 12, "where, or\nwhy it waits": 28}


def _heartbeat_s() -> float:
    """How often workers send their heartbeat (Prefect's setting, 30 s by default)."""
    try:
        from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS

        return float(PREFECT_WORKER_HEARTBEAT_SECONDS.value())
    except Exception:  # noqa: BLE001 - an older or newer Prefect: its default
        return 30.0


def _where(host: str | None, gpus: str | None) -> str:
    """Where a stage runs: 'host0 GPU 0,1' for the placement label 'host0:0,host0:1' (was 'host0 host0:0,host0:1');
    GPUs of other hosts (a gang across hosts) keep their host."""
    host = (host or "").strip()
    ids = [g.strip() for g in (gpus or "").split(",") if g.strip() not in ("", "-")]  # '-': a stage without a GPU
    if not ids:
        return host or "-"
    mine = [g.rsplit(":", 1)[1] for g in ids if ":" in g and g.rsplit(":", 1)[0] == host]
    if host and len(mine) == len(ids):
        return f"{host} GPU{'s' if len(mine) > 1 else ''} {','.join(mine)}"
    return f"{host} {', '.join(ids)}".strip()


def _count(xs) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


#: what each state of a host that is not up means, below the hosts table
HOST_STATES = {
    "draining": "draining: removed from the cluster's description; its running stages run to their end, no new one starts there",
    "down": "down: missed its heartbeats, or not Ready; no stage is placed there",
    "down (outage)": "down (outage): the cluster's API (Kubernetes) does not answer; no stage is launched until it does",
}


def _hosts_table(st, *, online: bool) -> "Table":
    """The hosts that are not up (down, draining), from the worker's cluster table artifact."""
    from rich.table import Table

    ago = "" if st.hosts_changed_at is None else f", changed {_dur(time.time() - st.hosts_changed_at)} ago"
    states = [HOST_STATES[s] for s in dict.fromkeys(h.state for h in st.hosts if h.state != "up") if s in HOST_STATES]
    if not online:
        states.append("no worker online: as the last one saw them")
    t = Table(title=f"hosts not up (the worker's cluster table{ago})", caption="; ".join(states) or None)
    t.add_column("host", no_wrap=True)
    for col in ("state", "GPUs", "GPUs in use", "stages"):
        t.add_column(col)
    for h in st.hosts:
        if h.state != "up":
            t.add_row(h.host, h.state, str(h.gpus), str(h.gpus_in_use), str(h.stages))
    return t


def register(app: typer.Typer) -> None:
    @app.command("status", help=HELP,
                 short_help="Show what a `qosflow` work pool is doing: its workers, the stages running and waiting, and why.")
    def status_cmd(
        pool: str = typer.Option("gpu", "--pool", "-p", help="work pool name"),
        limit: int = typer.Option(200, "--limit", min=1, help="most stage runs to read"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="also write the status as JSON here"),
    ) -> None:
        import asyncio

        from rich.table import Table

        from qosflow.cli.output import check_not_an_input, check_output_file, print_table, result_console, write_json_file
        import httpx

        from qosflow.prefect.local import check_pool, check_pool_name, require_api_url, unreachable_server
        from qosflow.prefect.status import pool_status

        if json_out is not None:
            check_output_file(json_out)
            check_not_an_input(json_out, {})  # (no input file; not a file of another's either)
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
        # a terminal's own width, each table split to fit it; elsewhere 120 columns or more, as always
        console = result_console(min_width=120)
        online = [w for w in st.workers if w.online]
        console.print(f"[bold]pool {pool}[/] on {url}: {len(online)} of {len(st.workers)} worker(s) online, "
                      f"{st.pipelines_running} pipeline run(s) of its deployments running or due"
                      + (f", {st.pipelines_scheduled} scheduled later (the next at "
                         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(st.next_pipeline_at))})"
                         if st.pipelines_scheduled and st.next_pipeline_at is not None else ""))
        if st.hosts:
            up = sum(h.state == "up" for h in st.hosts)
            console.print(f"hosts: {up} of {len(st.hosts)} up" + "".join(
                f", {n} {state}" for state, n in _count(h.state for h in st.hosts if h.state != "up").items()))
        if st.workers:
            silent_after = 2 * _heartbeat_s()
            silent = [w for w in st.workers if w.online and w.heartbeat_ago_s is not None and w.heartbeat_ago_s > silent_after]
            # (a worker stopped a minute ago was listed ONLINE like the others, until Prefect's own timeout)
            wt = Table(title="workers", caption=(f"ONLINE, silent: no heartbeat for over {silent_after:g} s (twice "
                                                 "PREFECT_WORKER_HEARTBEAT_SECONDS): stopped or stalled; Prefect still "
                                                 "counts it online until it marks it OFFLINE") if silent else None)
            for col in ("worker", "status", "last heartbeat"):
                wt.add_column(col)
            for w in st.workers:
                wt.add_row(w.name, f"{w.status}, silent" if w in silent else w.status, f"{_dur(w.heartbeat_ago_s)} ago",
                           style="yellow" if w in silent else None)
            print_table(console, wt, flexible={"worker": 24})
        elif any(s.phase == "unclaimed" for s in st.stages):
            console.print(f"[yellow]no worker polls pool {pool!r}:[/] start one with `qosflow worker start --pool {pool}`")
        if any(h.state != "up" for h in st.hosts):
            print_table(console, _hosts_table(st, online=bool(online)))
        draining = set(st.draining)
        if not st.stages:
            console.print("no stage run is running or waiting")
        else:
            t = Table(title="stage runs")
            users = any(s.user for s in st.stages)  # (a column only when some stage says whom it runs for)
            # where a stage runs, or why it waits, in one column: the "why it waits" column of its own, empty for every
            # running stage, took its share of 120 columns, and the names broke ('train_softma' / 'x')
            for col in ("stage", "pipeline", *(("user",) if users else ()), "class", "phase", "for", "done", "predicted",
                        "deadline in", "where, or\nwhy it waits"):
                # the short figures whole; the names and the last column wrap when the table must narrow
                t.add_column(col, overflow="fold", no_wrap=col not in ("stage", "pipeline", "user", "where, or\nwhy it waits"))
            for s in st.stages:
                where = (_where(s.host, s.gpus) if s.phase == "running" else
                         f"QoS queue: {s.why_waiting}" if s.phase == "queued" and s.why_waiting else
                         "QoS queue" if s.phase == "queued" else "no worker yet" + (f": {s.why_waiting}" if s.why_waiting else ""))
                if s.elastic_note:
                    where += f" ({s.elastic_note})"
                if s.phase == "running" and s.host in draining:
                    where += " (host draining)"
                done = "-" if s.done_pct is None else f"{s.done_pct:.0f} %"
                # placed, its process still starting (Pending): 'starting', not 'running'
                phase = "starting" if s.phase == "running" and s.state.upper() == "PENDING" else s.phase
                t.add_row(s.name, s.pipeline or "-", *((s.user or "-",) if users else ()), s.priority or "-", phase, _dur(s.since_s), done,
                          _dur(s.predicted_s), _dur(s.deadline_in_s), where)
            # on a terminal too narrow for it: each stage's phase, progress and where it runs or why it waits first,
            # its pipeline, user, class and times in a second part
            print_table(console, t, first=STAGE_FIRST, flexible=STAGE_FLEXIBLE)
        if st.pipeline_processes:
            print_table(console, _pipeline_table(st.pipeline_processes), first=("state", "watched", "alive", "host", "started"),
                        flexible={"pipeline run": 36, "worker": 20, "output": 30})
        elif st.pipeline_processes_note:
            console.print(st.pipeline_processes_note, style="dim", markup=False)
        if json_out is not None:
            console.print(f"JSON: {write_json_file(json_out, st.to_json())}")

"""`qosflow demo`: a local Prefect server, the blocks and the `qosflow` pool, a worker on a virtual
2-host x 4-GPU cluster, and three retraining pipelines with different QoS running at once."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

#: (pipeline name, priority class, deadline seconds or None, MLP width)
PIPELINES = [
    ("fraud-critical", "critical", 150.0, 32),
    ("ranking-guaranteed", "guaranteed", 300.0, 64),
    ("reports-best-effort", "best-effort", None, 128),
]
POOL = "qosflow-demo"


def choose_policy(preferred: str | None) -> str:
    from qosflow.policies import available, get_policy

    names = [preferred] if preferred else ["qosflow", "genie", "fifo"]
    for n in names:
        if n in available():
            get_policy(n)
            return n
    if preferred:
        get_policy(preferred)  # raises UnknownNameError with the list
    return "fifo"


def run_demo(
    *,
    ui: bool = True,
    json_out: str | None = None,
    port: int | None = None,
    home: str | None = None,
    policy: str | None = None,
    hosts: int = 2,
    gpus_per_host: int = 4,
    cores_per_host: float = 16.0,
    keep_open: bool = True,
    console: Console | None = None,
    cluster_file: str | None = None,
    database_url: str | None = None,
) -> dict[str, Any]:
    """Run the demo. With `cluster_file` (hosts and agent URLs, see docs/infrastructure.md) the stages run
    on those hosts through their `qosflow agent`s instead of on virtual hosts of this machine."""
    console = console or Console()
    from qosflow.paths import data_dir
    from qosflow.prefect.local import LocalServer, WorkerThread, free_port, setup_pool

    home_p = Path(home) if home else data_dir() / "demo"
    home_p.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("QOSFLOW_HOME", str(home_p / "qosflow"))
    os.environ.setdefault("QOSFLOW_REGISTRY", str(home_p / "registry"))
    if port is None:
        port = 4200 if ui and _port_free(4200) else free_port()
    policy_name = choose_policy(policy)
    previous = _exit_on_sigterm()
    try:
        server = LocalServer(home_p / "prefect", port, ui=ui, database_url=database_url)
        where = "PostgreSQL" if database_url else f"SQLite in {server.home}"
        with console.status(f"starting a local Prefect server ({where}, UI {'on' if ui else 'off'})..."):
            server.start()
        worker = None
        try:
            server.apply_env()
            quiet_console_logs()
            from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy

            from qosflow.paths import repo_root

            if cluster_file:
                cluster = BareMetalGPUCluster.from_cluster_file(cluster_file)
            else:
                cluster = BareMetalGPUCluster.virtual(hosts, gpus_per_host, cpu_cores=cores_per_host)
            # stage processes import flows.retrain: on agents they run with the agent's environment plus this
            stage_env = {"PYTHONPATH": os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH", "")) if p)}
            with console.status("registering blocks, the qosflow pool and its stage deployment..."):
                info = asyncio.run(setup_pool(POOL, cluster=cluster, cluster_block="demo-cluster", policy=QoSPolicy(policy=policy_name), policy_block="demo-policy",
                                              stream_output=False, env=stage_env))
            console.print(f"[bold]Prefect UI[/]: {server.ui_url}" if ui else f"Prefect API: {server.api_url} (no UI)")
            if not cluster_file:
                console.print(
                    f"pool [cyan]{POOL}[/] (type qosflow), cluster block [cyan]{info['cluster_block']}[/]: {hosts} hosts x {gpus_per_host} "
                    f"[yellow]virtual GPUs[/] (no GPU: NVML not used), {cores_per_host:g} cores each; policy [cyan]{policy_name}[/]"
                )
            worker = WorkerThread(POOL).wait_ready(120)
            note = worker.worker.inventory_note if worker.worker else ""
            inv = worker.worker.scheduler.cluster if worker.worker and worker.worker.scheduler else None
            virtual = True if inv is None else any(n.virtual for n in inv.nodes)
            if cluster_file and inv is not None:
                hosts, gpus_per_host = len(inv.nodes), max(n.gpus for n in inv.nodes)
                cores_per_host = max(n.cpu_cores for n in inv.nodes)
                gpu_word = "[yellow]virtual GPUs[/]" if virtual else "GPUs (NVML)"
                console.print(
                    f"pool [cyan]{POOL}[/] (type qosflow), cluster file [cyan]{cluster_file}[/] through the agents: "
                    + ", ".join(f"{n.name} ({n.gpus} {gpu_word}, {n.cpu_cores:g} cores, {n.address})" for n in inv.nodes)
                    + f"; policy [cyan]{policy_name}[/]"
                )
            if note:
                console.print(f"[dim]{note}[/]")

            os.environ["QOSFLOW_POOL"] = POOL
            from flows.retrain import retrain
            from qosflow.prefect.tasks import PipelineRun

            results: dict[str, Any] = {}
            errors: dict[str, BaseException] = {}

            def one(name: str, prio: str, deadline: float | None, hidden: int) -> None:
                try:
                    f = retrain.with_options(flow_run_name=name)
                    results[name] = f(name=name, hidden=hidden, qos_deadline=deadline, qos_priority=prio)
                except BaseException as exc:  # reported below
                    errors[name] = exc

            t0 = time.time()
            threads = [threading.Thread(target=one, args=p, name=f"pipeline-{p[0]}") for p in PIPELINES]
            for p in PIPELINES:
                console.print(f"  pipeline [bold]{p[0]}[/]: class {p[1]}, deadline {('%gs' % p[2]) if p[2] else 'none'}")
            for t in threads:
                t.start()
            with console.status("running three pipelines through the qosflow worker...") as st:
                while any(t.is_alive() for t in threads):
                    sched = worker.worker.scheduler if worker.worker else None
                    if sched is not None:
                        st.update(
                            f"running three pipelines: {len(sched.running())} stages placed, {len(sched.queued())} in the QoS queue, "
                            f"{len(worker.worker.records)} done ({time.time() - t0:.0f}s)"
                        )
                    time.sleep(0.5)
            runs = {r.name: r for r in PipelineRun.finished}
            report = {"pipelines": [], "policy": policy_name, "cluster": {"hosts": hosts, "gpus_per_host": gpus_per_host, "cores_per_host": cores_per_host, "virtual_gpus": virtual, "file": cluster_file,
                                   "backend": worker.worker._backend.name if worker.worker and worker.worker._backend else None}, "ui": server.ui_url if ui else None, "elapsed_s": round(time.time() - t0, 2),
                      "server_database": "postgresql" if database_url else "sqlite"}
            for name, prio, deadline, _ in PIPELINES:
                r = runs.get(name)
                s = r.summary() if r else {"name": name, "deadline": deadline, "finished_at": None, "met": False, "stages": [], "state": "failed"}
                s["priority"] = prio
                s["result"] = _jsonable(results.get(name))
                if name in errors:
                    s["error"] = f"{type(errors[name]).__name__}: {errors[name]}"
                report["pipelines"].append(s)
            report["coda_decisions"] = list(worker.worker.scheduler.decisions) if worker.worker and worker.worker.scheduler else []
            report["max_stages_per_gpu"] = _max_per_gpu(report)
            print_report(report, console)
            if json_out:
                Path(json_out).parent.mkdir(parents=True, exist_ok=True)
                Path(json_out).write_text(json.dumps(report, indent=2, default=str))
                console.print(f"wrote {json_out}")
            console.print(f"what the predictor learned from these stages (it plans the next runs with it): "
                          f"QOSFLOW_HOME={os.environ['QOSFLOW_HOME']} qosflow predict stages")
            if ui and keep_open:
                console.print(f"\n[bold green]Prefect UI: {server.ui_url}[/]  (flow runs, placements as labels, artifacts, events). Ctrl-C to stop.")
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    console.print("stopping")
            return report
        finally:
            if worker is not None:
                worker.stop()
            drain_prefect()
            server.stop()
    finally:
        _restore_sigterm(previous)  # (a caller in this process keeps its own handler)


def _exit_on_sigterm() -> Any:
    """SIGTERM (a process manager, `timeout`, `kill`) ends the demo as Ctrl-C does: through its
    `finally`, which stops the worker and the Prefect server. Python's default ends the process at
    once, and the server (its own session) ran on with nothing to stop it. Returns the handler it
    replaced (None off the main thread, where it installs none), for `_restore_sigterm`."""
    import signal
    import sys

    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return None


def _restore_sigterm(previous: Any) -> None:
    """Put back the SIGTERM handler `_exit_on_sigterm` replaced. Left installed, it outlived the demo in
    the calling process (a test run, a notebook): processes forked later inherited it."""
    import signal

    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return None if x is None else str(x)


def _max_per_gpu(report: dict[str, Any]) -> int:
    """Largest number of stages that overlapped in time on one GPU (from the recorded intervals)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for p in report["pipelines"]:
        for s in p["stages"]:
            if s.get("placed") is None or s.get("ended") is None:
                continue
            for g in s.get("gpus") or []:
                spans.setdefault(g, []).append((s["placed"], s["ended"]))
    best = 0
    for iv in spans.values():
        pts = sorted([(a, 1) for a, _ in iv] + [(b, -1) for _, b in iv], key=lambda x: (x[0], x[1]))
        cur = 0
        for _, d in pts:
            cur += d
            best = max(best, cur)
    return best


def print_report(report: dict[str, Any], console: Console) -> None:
    console.print("[bold]qosflow placements[/] (GPUs are [yellow]virtual[/]: declared by the cluster block, no NVML; "
                  "times in seconds since the first pipeline started)")
    t0 = min((p.get("started_at") or 0 for p in report["pipelines"] if p.get("started_at")), default=0)
    for p in report["pipelines"]:
        dl = "no deadline" if p.get("deadline") is None else f"deadline {p['deadline']:g}s"
        rows = []
        for s in p["stages"]:
            met = s.get("deadline_met")
            rows.append((
                s["name"],
                s.get("host") or "-",
                ",".join(g.split(":", 1)[-1] for g in s.get("gpus") or []) or "-",
                "-" if s.get("cpu_cores") is None else f"{s['cpu_cores']:g}",
                "-" if s.get("started") is None else f"{s['started'] - t0:.1f}",
                "-" if s.get("ended") is None else f"{s['ended'] - t0:.1f}",
                "-" if s.get("predicted_s") is None else f"{s['predicted_s']:.1f}",
                "-" if s.get("actual_s") is None else f"{s['actual_s']:.1f}",
                {True: "[green]met[/]", False: "[red]missed[/]", None: "-"}[met],
            ))
        t = _table(f"{p['name']}: {p.get('priority')}, {dl}",
                   ("stage", "host", "GPU", "cores", "start", "end", "pred", "act", "QoS"),
                   rows, right=("cores", "start", "end", "pred", "act"), fold=("stage", "host", "GPU"))
        console.print(t)
    rows = []
    for p in report["pipelines"]:
        el = p.get("elapsed_s")
        met = p.get("met")
        rows.append((
            p["name"],
            str(p.get("priority")),
            "-" if p.get("deadline") is None else f"{p['deadline']:g}",
            "-" if el is None else f"{el:.1f}",
            {True: "[green]yes[/]", False: "[red]NO[/]", None: "no deadline" if p.get("state") == "completed" else "[red]failed[/]"}[met],
        ))
    q = _table(f"QoS outcome (policy {report.get('policy')})", ("pipeline", "class", "deadline s", "took s", "met"),
               rows, fold=("pipeline", "class"))
    console.print(q)
    if report.get("coda_decisions"):
        console.print(f"CODA core moves: {len(report['coda_decisions'])}")
        for d in report["coda_decisions"]:
            console.print(f"  {d['node']}: core {d['core']} from {d['from_stage']} to {d['to_stage']} ({d['reason']})")
    console.print(f"at most {report.get('max_stages_per_gpu')} stage(s) on one GPU at a time")


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], *, right: tuple[str, ...] = (),
           fold: tuple[str, ...] = ()) -> Table:
    """A report table whose names (`fold`: stage, host, pipeline) wrap onto more lines in a narrow console and whose
    figures never shrink: the demo printed `23…` for a time and `m…` for met in an 80-column terminal (and in a pipe,
    whose console is 80 wide), every column being no-wrap."""
    from rich import box
    from rich.text import Text

    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for i, col in enumerate(columns):
        if col in fold:  # at least a short word's width: in a very narrow console rich squeezed it to nothing
            t.add_column(col, overflow="fold", min_width=min(8, max([len(col), *(len(r[i]) for r in rows)])))
        else:  # a figure or a short word: as wide as its widest cell, never cut
            widest = max([len(col), *(Text.from_markup(r[i]).cell_len for r in rows)])
            t.add_column(col, justify="right" if col in right else "left", no_wrap=True, min_width=widest)
    for r in rows:
        t.add_row(*r)
    return t


def quiet_console_logs() -> None:
    """Keep Prefect's INFO lines off the terminal (they still go to the server and the UI)."""
    import logging

    for name in [None, *logging.root.manager.loggerDict]:
        lg = logging.getLogger(name)
        for h in getattr(lg, "handlers", []):
            if type(h).__name__ in ("PrefectConsoleHandler", "StreamHandler"):
                h.setLevel(logging.WARNING)


def drain_prefect() -> None:
    """Flush logs and events to the server before it stops."""
    try:
        from prefect.logging.handlers import APILogHandler

        APILogHandler.flush()
    except Exception:
        pass
    try:
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=10)
    except Exception:
        pass

"""`qosflow demo`: the README's main command."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Run three retraining pipelines with different QoS through a local qosflow worker.

Starts a local Prefect server (SQLite, UI on), registers the qosflow blocks and the `qosflow-demo`
work pool, starts the predictive worker on a virtual 2-host x 4-GPU cluster (no GPU needed: the GPUs
are declared and shown as virtual; stages run for real on the CPU, each in its own process), runs
three pipelines at once (critical, guaranteed, best-effort), prints the placement table and the QoS
outcome, and keeps the UI address on screen until Ctrl-C.

Examples:

  qosflow demo

  qosflow demo --no-ui --json out/demo.json

  qosflow demo --cluster lab.yaml   # on real hosts, through their agents

A cluster file lists the hosts and their agent URLs, with the agents' token (the same fields as the
bare-metal cluster block; see docs/infrastructure.md). Stage processes on the agents must be able to
import qosflow and flows/ (PYTHONPATH is passed on) and reach the Prefect server and its result storage.
"""


def register(app: typer.Typer) -> None:
    @app.command("demo", help=HELP)
    def demo_cmd(
        ui: bool = typer.Option(True, "--ui/--no-ui", help="serve the Prefect UI and keep it open at the end"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write the outcome as JSON here"),
        port: Optional[int] = typer.Option(None, "--port", min=1, max=65535, help="server port (default 4200 with the UI if free, else any free port)"),
        home: Optional[Path] = typer.Option(None, "--home", help="where the demo keeps its Prefect database and results (default: qosflow's data dir/demo)"),
        policy: Optional[str] = typer.Option(None, "--policy", help="scheduling policy (default: qosflow, else genie, else fifo)"),
        hosts: int = typer.Option(2, "--hosts", min=1, help="virtual hosts"),
        gpus: int = typer.Option(4, "--gpus-per-host", min=1, help="virtual GPUs per host"),
        cores: float = typer.Option(16.0, "--cores-per-host", min=1, help="CPU cores each virtual host offers stages (folded onto the real CPUs)"),
        cluster: Optional[Path] = typer.Option(None, "--cluster", help="cluster file (YAML/JSON: hosts, agent URLs, token): run the stages through those agents"),
        database_url: Optional[str] = typer.Option(
            None, "--database-url", envvar="QOSFLOW_DEMO_DATABASE_URL",
            help="the demo's Prefect server keeps its data in this PostgreSQL database "
                 "(postgresql://USER:PASSWORD@HOST:PORT/DB) instead of SQLite under --home: "
                 "steadier on a busy machine (see docs/prefect.md)"),
    ) -> None:
        import sys

        from qosflow.paths import repo_root

        root = str(repo_root())
        if root not in sys.path:
            sys.path.insert(0, root)
        import os

        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        from qosflow.cli.output import check_file_and_dir, check_not_an_input, check_output_dir, check_output_file

        from qosflow.cli.init import check_cores_per_host

        check_cores_per_host(cores)  # (before the server starts)
        check_not_an_input(json_out, {"--cluster": cluster})
        check_file_and_dir(json_out, home, "--json", "--home")  # the demo ran, then its JSON hit its home directory
        if json_out is not None:
            check_output_file(json_out)  # before the server starts, not after the pipelines ran
        if home is not None:
            check_output_dir(home, "--home")  # a file there was a FileExistsError traceback
        if port is not None:
            from qosflow.errors import SpecError
            from qosflow.prefect.demo import _port_free

            if not _port_free(port):  # the server exited at once: a RuntimeError traceback pointing at its log
                raise SpecError("--port", f"127.0.0.1:{port} is already in use (another Prefect server, or an earlier "
                                "demo still running?); choose another port, or leave --port out for a free one")
        if database_url is not None:
            from qosflow.prefect.local import prefect_database_url

            try:
                prefect_database_url(database_url, ".")
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--database-url") from None
        if cluster is not None:
            from qosflow.backends.agent import load_cluster_file

            cf = load_cluster_file(cluster)  # a bad file fails here, naming the file and the field
            _some_host_up(cf, cluster)
        from qosflow.prefect.demo import run_demo

        try:
            report = run_demo(ui=ui, json_out=str(json_out) if json_out else None, port=port, home=str(home) if home else None,
                              policy=policy, hosts=hosts, gpus_per_host=gpus, cores_per_host=cores, keep_open=ui,
                              cluster_file=str(cluster.resolve()) if cluster is not None else None, database_url=database_url)
        except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C or SIGTERM: the worker and server are stopped by now
            _exit_now(130 if isinstance(exc, KeyboardInterrupt) else exc.code)
        failed = [p["name"] for p in report["pipelines"] if p.get("state") != "completed"]
        if failed:
            typer.secho(f"pipelines that did not complete: {', '.join(failed)}", err=True, fg="red")
            raise typer.Exit(1)


def _some_host_up(cf, path: Path) -> None:
    """Fail now when no host of the cluster file answers (its agents not started, a wrong URL or token): the
    demo then started its server and waited for ever, with one 'host ... is down' warning. Hosts that are
    down while others are up are named in a warning; the worker marks them down as it would."""
    import logging

    from qosflow.errors import QosflowError

    log = logging.getLogger("qosflow.backends.agent")
    level = log.level
    log.setLevel(logging.ERROR)  # its 'host ... is down' warnings: said below, once
    try:
        hosts = cf.ask_agents().hosts
    finally:
        log.setLevel(level)
    down = [h for h in hosts if not h.up]
    why = "; ".join(f"{h.name} ({h.url}): {h.error}" for h in down)
    if down and len(down) == len(hosts):
        raise QosflowError(f"--cluster {path}: no host answers ({why}); start the agents (qosflow agent start ... on each "
                           f"host) and check them with `qosflow agent status --cluster {path}`")
    if down:
        typer.secho(f"warning: {len(down)} of {len(hosts)} hosts down, the demo runs on the others: {why}", err=True, fg="yellow")


def _exit_now(code) -> None:
    """End the process at once. Interrupted pipelines leave threads (Prefect's task runners) waiting
    for stages that will never end now that the worker and the server are stopped; Python's exit
    would join them, and the demo hung after Ctrl-C or SIGTERM."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)

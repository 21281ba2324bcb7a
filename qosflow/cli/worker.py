"""`qosflow worker start`: the predictive qosflow worker (for a qosflow pool, the same as `prefect worker start --pool POOL`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Start the qosflow worker on a `qosflow` work pool.

Its cluster and policy come from the pool's `cluster_block`/`policy_block` defaults (see `qosflow init`),
or from --cluster-block/--policy; --cluster-file lab.yaml (or QOSFLOW_CLUSTER_FILE) runs the stages through
the host agents listed in that file. Equivalent to `prefect worker start --pool POOL` for a qosflow pool.

Examples:

  qosflow worker start --pool gpu

  qosflow worker start --pool gpu --cluster-file lab.yaml

  qosflow worker start --pool gpu --cluster-block k8s-a100
"""


def register(app: typer.Typer) -> None:
    worker_app = typer.Typer(help="The qosflow worker: queues, places and launches the stages of a `qosflow` work pool.", no_args_is_help=True)

    @worker_app.command("start", help=HELP)
    def start_cmd(
        pool: str = typer.Option(..., "--pool", "-p", help="work pool name"),
        name: Optional[str] = typer.Option(None, "--name", help="worker name (default: a new random one; the same name after a restart takes over this worker's leases at once instead of when they expire)"),
        cluster_block: Optional[str] = typer.Option(None, "--cluster-block", help="cluster block name: a qosflow-bare-metal-cluster, else a qosflow-kubernetes-cluster block (or SLUG/NAME); default: the pool's cluster_block"),
        cluster_file: Optional[Path] = typer.Option(None, "--cluster-file", help="cluster file (YAML/JSON: hosts, agent URLs, token): run the stages through those agents (default: $QOSFLOW_CLUSTER_FILE, else the pool's cluster)"),
        policy: Optional[str] = typer.Option(None, "--policy", help="policy name (overrides the pool's policy block)"),
        estimator: Optional[str] = typer.Option(None, "--estimator", help="where estimates come from: learned | history | declared | module:attr (overrides the pool's policy block, whose default is learned)"),
        limit: Optional[int] = typer.Option(None, "--limit", min=1, help="most stage runs at once (default: no limit)"),
        metrics_port: Optional[int] = typer.Option(
            None, "--metrics-port", min=0, max=65535, envvar="QOSFLOW_WORKER_METRICS_PORT",
            help="serve Prometheus metrics at http://HOST:PORT/metrics: stages queued/running per QoS class, waits, deadlines met and missed, GPUs allocated and shared per node (address: $QOSFLOW_WORKER_METRICS_HOST, default 0.0.0.0; default: no metrics)",
        ),
    ) -> None:
        import asyncio
        import os
        import signal

        from qosflow.prefect.local import check_pool, check_pool_name, require_api_url
        from qosflow.prefect.worker import QosflowWorker

        check_pool_name(pool)
        if cluster_file is not None and cluster_block:
            from qosflow.errors import SpecError

            raise SpecError("--cluster-file", "give either --cluster-file or --cluster-block, not both")
        if cluster_file is not None:
            from qosflow.backends.agent import load_cluster_file

            load_cluster_file(cluster_file)  # a bad file fails here, naming the file and the field
        if policy:
            from qosflow.policies import get_policy

            get_policy(policy)  # unknown names fail here with the list of known ones
        if estimator:
            from qosflow.prefect.scheduler import check_estimator_import, check_estimator_name

            check_estimator_name(estimator)
            check_estimator_import(estimator)  # module:attr: imported here, where the worker will import it
        require_api_url("the qosflow worker")
        # the pool, and the cluster block the worker will use (--cluster-block, else the pool's own): a
        # missing or invalid one fails here, as a bad --cluster-file does, not in the worker every 5 s
        own_block = cluster_file is None and not os.environ.get("QOSFLOW_CLUSTER_BLOCK") and not os.environ.get("QOSFLOW_CLUSTER_FILE")
        asyncio.run(check_pool(pool, cluster_block=cluster_block or own_block))
        if cluster_block:
            os.environ["QOSFLOW_CLUSTER_BLOCK"] = cluster_block

        async def main() -> None:
            w = QosflowWorker(work_pool_name=pool, name=name, policy=policy, estimator=estimator, limit=limit, create_pool_if_not_found=False,
                              metrics_port=metrics_port,
                              cluster_file=str(cluster_file.resolve()) if cluster_file is not None else None)
            # a service manager's stop (systemd, a Kubernetes rollout) sends SIGTERM: stop as on Ctrl-C, which
            # cancels this task (the stages in flight are requeued or left to the next worker to adopt)
            # instead of dying without a word
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
            await w.start()

        try:
            asyncio.run(main())
        except (KeyboardInterrupt, asyncio.CancelledError):
            pass
        # (it ended without a word: a log that stopped could have been a hang)
        typer.echo(f"qosflow worker on pool {pool!r} stopped", err=True)

    app.add_typer(worker_app, name="worker")

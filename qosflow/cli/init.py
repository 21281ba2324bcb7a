"""`qosflow init`: register the blocks, save a cluster and a policy block, create the qosflow pool."""

from __future__ import annotations

from typing import Optional

import typer

HELP = """Register qosflow's blocks with the Prefect server and create a `qosflow` work pool.

Uses the Prefect server of the current profile (PREFECT_API_URL). Saves a bare-metal cluster block
(virtual GPUs unless --real-gpus) and a QoS policy block, creates or updates the pool with them as
its defaults (an existing pool keeps its other settings, e.g. env or working_dir set in the UI; a
pool of another type is left alone), and creates the pool's `qosflow-stage` deployment. Then start a worker:

  qosflow worker start --pool gpu        (or: prefect worker start --pool gpu)

Examples:

  qosflow init --pool gpu --hosts 2 --gpus-per-host 4 --policy qosflow
"""


def register(app: typer.Typer) -> None:
    @app.command("init", help=HELP)
    def init_cmd(
        pool: str = typer.Option("gpu", "--pool", help="work pool name"),
        hosts: int = typer.Option(1, "--hosts", min=1, help="hosts (all this machine with the local backend)"),
        gpus: int = typer.Option(4, "--gpus-per-host", min=0, help="GPUs per host"),
        cores: float = typer.Option(16.0, "--cores-per-host", min=1, help="CPU cores per host"),
        real_gpus: bool = typer.Option(False, "--real-gpus", help="the worker uses the GPUs NVML finds on its host instead of declaring virtual ones (one host: --hosts, --gpus-per-host and --cores-per-host are then not used)"),
        policy: str = typer.Option("qosflow", "--policy", help="scheduling policy"),
        estimator: str = typer.Option("learned", "--estimator", help="where duration, slowdown and CPU estimates come from: learned (the predictor and its store: profiles and every finished stage) | history (declared, then the median of past runs) | declared | module:attr"),
        deadline: Optional[str] = typer.Option(None, "--deadline", help="default pipeline deadline: seconds or a duration such as 90s, 15min, 2h, 1h30m"),
    ) -> None:
        import asyncio

        from rich.console import Console

        from qosflow.policies import get_policy
        from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
        import httpx

        from qosflow.prefect.local import check_pool_name, require_api_url, setup_pool, unreachable_server

        from qosflow.errors import SpecError
        from qosflow.prefect.scheduler import check_estimator_name

        # the options are checked before the server, so a typo is not found only once a server runs
        check_pool_name(pool, blocks=True)
        get_policy(policy)  # unknown names fail here with the list of known ones
        check_estimator_name(estimator)
        if deadline is not None:  # a duration string as @qos_flow(deadline=...) takes ("1h" was rejected)
            from qosflow.core.qos import to_seconds

            raw, secs = deadline, to_seconds(deadline)
            try:
                deadline = float(secs)
            except ValueError:
                raise SpecError("--deadline", f"expected seconds or a duration such as 90s, 15min, 2h or 1h30m, got {raw!r}") from None
            if not 0 < deadline < float("inf"):  # was a pydantic traceback from QoSPolicy
                raise SpecError("--deadline", f"must be a positive duration, got {raw!r}")
        here = None
        if real_gpus:
            ignored = [f"{opt} {val:g}" for opt, val, default in (("--hosts", hosts, 1), ("--gpus-per-host", gpus, 4),
                                                                  ("--cores-per-host", cores, 16.0)) if val != default]
            if ignored:  # were dropped without a word
                typer.secho(f"warning: {', '.join(ignored)} not used with --real-gpus: the worker's own host is the one host, "
                            "with the GPUs NVML finds and the cores it may use", err=True, fg="yellow")
            from qosflow.backends.local import nvml_gpus
            from qosflow.core.gpu_names import short_gpu_model

            found, why = nvml_gpus()
            if found is None:  # the worker would refuse this pool's cluster block on this machine
                why = why.removeprefix("no GPU: ").removesuffix("; using virtual GPUs")
                typer.secho(
                    f"warning: --real-gpus, but this machine has no GPU ({why}): a qosflow worker started here takes no run "
                    "from this pool. Start the worker on a GPU host, or leave --real-gpus out to declare virtual GPUs.",
                    err=True,
                    fg="yellow",
                )
                here = "none"
            else:
                here = f"{len(found)} x {short_gpu_model(found[0].name)}"
        api = require_api_url("qosflow init")
        cluster = BareMetalGPUCluster(hosts=[f"host{i}" for i in range(hosts)], gpus_per_host=gpus, cpu_cores=cores, virtual_gpus=not real_gpus)
        pol = QoSPolicy(policy=policy, estimator=estimator, deadline_s=deadline)
        try:
            info = asyncio.run(setup_pool(pool, cluster=cluster, cluster_block=f"{pool}-cluster", policy=pol, policy_block=f"{pool}-policy"))
        except (httpx.TransportError, RuntimeError) as exc:
            # Prefect wraps a failed connection in RuntimeError("Failed to reach API ...") raised from
            # the httpx error: any other RuntimeError is not about the server being away
            away = unreachable_server(exc, api)
            if away is None:
                raise
            raise away from None
        c = Console()
        c.print("blocks registered: qosflow-qos-policy, qosflow-bare-metal-cluster, qosflow-kubernetes-cluster")
        if real_gpus:
            c.print(f"cluster block [cyan]{info['cluster_block']}[/]: the GPUs NVML finds on the worker's host (this machine: {here})")
        else:
            c.print(f"cluster block [cyan]{info['cluster_block']}[/]: {hosts} x {gpus} virtual GPUs, {cores:g} cores per host")
        c.print(f"policy block [cyan]{info['policy_block']}[/]: {policy}, estimator {estimator}")
        c.print(f"work pool [cyan]{pool}[/] ({'created' if info['created'] else 'updated'}), stage deployment {info['stage_deployment']}")
        running = [] if info["created"] else asyncio.run(_online_workers(pool))
        if running:  # they set up their cluster and policy when they started: this init does not reach them
            c.print(f"worker(s) {', '.join(running)} of pool [cyan]{pool}[/] keep the cluster and policy they started with: "
                    "restart them to use these (Ctrl-C; the stages they hold go back to the pool's queue)")
        else:
            c.print(f"next: [bold]qosflow worker start --pool {pool}[/]")


async def _online_workers(pool: str) -> list[str]:
    """The names of the workers Prefect sees online on `pool` (empty when it cannot say)."""
    from prefect.client.orchestration import get_client

    from qosflow.prefect.local import worker_online

    try:
        async with get_client() as client:
            workers = await client.read_workers_for_work_pool(pool)
    except Exception:  # only a hint
        return []
    return sorted(w.name for w in workers if worker_online(w))

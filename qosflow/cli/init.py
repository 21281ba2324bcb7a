"""`qosflow init`: register the blocks, save a cluster and a policy block, create the qosflow pool."""

from __future__ import annotations

from typing import Optional

import typer


def check_cores_per_host(cores: float) -> None:
    """Refuse a --cores-per-host that is NaN or infinite (init, demo): NaN passes typer's min=1, and ended in
    pydantic's ValidationError traceback (init) or after the demo's server had started; inf was saved as is."""
    import math

    if not math.isfinite(cores):
        from qosflow.errors import SpecError

        raise SpecError("--cores-per-host", f"must be a finite number of CPU cores >= 1 (e.g. 16), got {cores!r}")


HELP = """Register qosflow's blocks with the Prefect server and create a `qosflow` work pool.

Uses the Prefect server of the current profile (PREFECT_API_URL). Saves a bare-metal cluster block
POOL-cluster (virtual GPUs unless --real-gpus) and a QoS policy block POOL-policy, creates or updates
the pool with them as its defaults, and creates the pool's `qosflow-stage` deployment. An existing pool
keeps its other settings (e.g. env or working_dir set in the UI), and keeps a cluster_block that names
another block than POOL-cluster (e.g. a block of host agents): init then leaves that block and the
pool's cluster as they are and says so. --cluster-block NAME points the pool at an existing bare-metal
or Kubernetes cluster block instead (--cluster-block POOL-cluster: back to the one init saves). A pool
of another type is left alone. Then start a worker:

  qosflow worker start --pool gpu        (or: prefect worker start --pool gpu)

Examples:

  qosflow init --pool gpu --hosts 2 --gpus-per-host 4 --policy qosflow

  qosflow init --pool gpu --cluster-block lab --policy qosflow
"""


def _warn_estimator_import(estimator: str) -> None:
    """--estimator module:attr that this machine cannot import: a warning, not an error (the pool's workers may run
    where the module is). Saved without a word, it made every worker of the pool log 'qosflow worker setup failed: No
    module named ...' every 5 s and take no run."""
    from qosflow.errors import SpecError
    from qosflow.prefect.scheduler import check_estimator_import

    try:
        check_estimator_import(estimator)
    except SpecError as exc:
        said = str(exc).replace("this worker's Python path", "this machine's Python path")
        typer.secho(f"warning: {said}. The policy block is saved with it all the same, and every worker of the pool "
                    "imports it when it starts and takes no run until it can: put it on the workers' Python path "
                    "before starting them", err=True, fg="yellow")


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
        cluster_block: Optional[str] = typer.Option(None, "--cluster-block", help="point the pool at this existing cluster block (a qosflow-bare-metal-cluster or qosflow-kubernetes-cluster block, e.g. one of host agents; or SLUG/NAME) instead of the POOL-cluster block init saves; default: an existing pool keeps the cluster block it names"),
    ) -> None:
        import asyncio

        from rich.console import Console

        from qosflow.policies import get_policy
        from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
        import httpx

        from qosflow.prefect.local import check_pool_name, require_api_url, unreachable_server

        from qosflow.errors import SpecError
        from qosflow.prefect.scheduler import check_estimator_name

        # the options are checked before the server, so a typo is not found only once a server runs
        check_pool_name(pool, blocks=True)
        get_policy(policy)  # unknown names fail here with the list of known ones
        check_estimator_name(estimator)
        _warn_estimator_import(estimator)
        deadline = None if deadline is None else deadline_seconds(deadline)
        check_cores_per_host(cores)
        managed = f"{pool}-cluster"
        if cluster_block is not None:
            cluster_block = cluster_block.strip()
            if not cluster_block:
                raise SpecError("--cluster-block", "give a cluster block name, e.g. --cluster-block lab")
            if cluster_block == managed or cluster_block == f"qosflow-bare-metal-cluster/{managed}":
                cluster_block = None  # the block init saves: from the options, as without --cluster-block
                force_managed = True
            else:
                force_managed = False
                given = [f"{opt} {val}" for opt, val, default in (("--hosts", hosts, 1), ("--gpus-per-host", gpus, 4),
                                                                  ("--cores-per-host", cores, 16.0), ("--real-gpus", real_gpus, False))
                         if val != default]
                if given:  # they describe the block init saves, which the pool would not use
                    raise SpecError("--cluster-block", f"{', '.join(given)} describe the {managed} block init saves; with "
                                                       f"--cluster-block {cluster_block} the pool uses that block as it is: give one or the other")
        else:
            force_managed = False
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
            info = asyncio.run(_setup(pool, cluster, cluster_block, force_managed, pol))
        except (httpx.TransportError, RuntimeError) as exc:
            # Prefect wraps a failed connection in RuntimeError("Failed to reach API ...") raised from
            # the httpx error: any other RuntimeError is not about the server being away
            away = unreachable_server(exc, api)
            if away is None:
                raise
            raise away from None
        c = Console()
        c.print("blocks registered: qosflow-qos-policy, qosflow-bare-metal-cluster, qosflow-kubernetes-cluster")
        previous = info["previous_cluster_block"]
        if info["cluster_kept"]:  # was set back to POOL-cluster without a word (a pool of agents ran stages on virtual GPUs)
            c.print(f"cluster block [cyan]{previous}[/]: kept (the pool's cluster_block; {managed}, the block init saves, "
                    f"is not used by this pool and was not changed; --cluster-block {managed} switches the pool to it)")
            ignored = [f"{opt} {val}" for opt, val, default in (("--hosts", hosts, 1), ("--gpus-per-host", gpus, 4),
                                                                ("--cores-per-host", cores, 16.0), ("--real-gpus", real_gpus, False))
                       if val != default]
            if ignored:
                typer.secho(f"warning: {', '.join(ignored)} not used: pool {pool} keeps its cluster block {previous}; "
                            f"give --cluster-block {managed} to use the block these options describe", err=True, fg="yellow")
        else:
            what = (f"the existing {info['cluster_kind']} cluster block" if cluster_block is not None
                    else "the GPUs NVML finds on the worker's host (this machine: " + str(here) + ")" if real_gpus
                    else describe_cluster(cluster))
            change = ("" if info["created"] else
                      f" (changed from {previous})" if previous and previous != info["cluster_block"] else
                      f" (saved again; it was {info['cluster_was']})" if info.get("cluster_was") else
                      " (unchanged)" if previous else " (set)")
            c.print(f"cluster block [cyan]{info['cluster_block']}[/]: {what}{change}")
        c.print(f"policy block [cyan]{info['policy_block']}[/]: {policy}, estimator {estimator}")
        c.print(f"work pool [cyan]{pool}[/] ({'created' if info['created'] else 'updated'}), stage deployment {info['stage_deployment']}")
        running = [] if info["created"] else asyncio.run(_online_workers(pool))
        if running:  # they set up their cluster and policy when they started: this init does not reach them
            kind = info["previous_kind"]  # what the running workers hold stages on
            if kind in ("agents", "kubernetes"):
                where = "on their hosts' agents" if kind == "agents" else "as Kubernetes Jobs"
                fate = f"the stages they run keep running {where} and the restarted worker adopts them"
            elif kind == "local":
                # (the pool's cluster is local, but the documented bare-metal worker is `qosflow worker start --pool
                # gpu --cluster-file lab.yaml` on it: only the local backend's stages stop)
                fate = ("stages run by the local backend stop and go back to the pool's queue; a worker started with "
                        "--cluster-file or --cluster-block on host agents or Kubernetes leaves its stages running, and "
                        "the restarted worker adopts them")
            else:
                fate = ("with host agents or Kubernetes their stages keep running and the restarted worker adopts them; "
                        "with the local backend they go back to the pool's queue")
            c.print(f"worker(s) {', '.join(running)} of pool [cyan]{pool}[/] keep the cluster and policy they started with: "
                    f"restart them to use these (Ctrl-C; {fate})")
        else:
            c.print(f"next: [bold]qosflow worker start --pool {pool}[/]")


async def _setup(pool: str, cluster, cluster_block: Optional[str], force_managed: bool, policy) -> dict:
    """Decide the pool's cluster block, then `setup_pool`. The pool keeps a cluster_block naming another block
    than POOL-cluster unless `cluster_block` (an existing cluster block, checked here) or `force_managed` says
    otherwise. Adds previous_cluster_block, cluster_kept, cluster_kind (of the block the pool now names) and
    previous_kind (of the one it named: what workers started before this call run stages on)."""
    from qosflow.prefect.local import pool_variable_defaults, register_blocks, setup_pool

    managed = f"{pool}-cluster"
    old = await pool_variable_defaults(pool)  # {} for a pool that does not exist yet
    previous = old.get("cluster_block") or None
    previous_kind = await _cluster_kind(previous, old.get("cluster_file")) if old else None
    kept = False
    kind = None
    if cluster_block is not None:
        await register_blocks()  # (a new server: the block types must exist to be looked up)
        kind = await _cluster_kind(cluster_block, None, check=True)
        cluster = None
    elif previous and previous not in (managed, f"qosflow-bare-metal-cluster/{managed}") and not force_managed:
        kept, cluster, cluster_block, kind = True, None, None, previous_kind
    else:
        cluster_block = managed
    before = await _saved_cluster(managed) if cluster is not None and old else None
    info = await setup_pool(pool, cluster=cluster, cluster_block=cluster_block, policy=policy, policy_block=f"{pool}-policy")
    # what the block init saved again held before: the pool's cluster_block still naming POOL-cluster said
    # "(unchanged)" when --hosts 2 had just made a 1-host cluster a 2-host one (admin review)
    info["cluster_was"] = (None if before is None or _cluster_fields(before) == _cluster_fields(cluster)
                           else describe_cluster(before))
    if kind is None and cluster is not None:
        kind = "local" if getattr(cluster, "backend", "local") == "local" else "agents"
    info.update(previous_cluster_block=previous, cluster_kept=kept, cluster_kind=kind,
                previous_kind=previous_kind if previous else kind, cluster_block=info["cluster_block"] or previous)
    return info


def describe_cluster(block) -> str:
    """'2 x 4 virtual GPUs, 16 cores per host' for a bare-metal cluster block (as init prints the one it saves)."""
    return f"{len(block.hosts)} x {block.gpus_per_host} {'virtual ' if block.virtual_gpus else ''}GPUs, {block.cpu_cores:g} cores per host"


def _cluster_fields(block) -> dict:
    return block.model_dump(mode="json")


async def _saved_cluster(name: str):
    """The bare-metal cluster block `name` as saved on the server, or None (missing, unreadable)."""
    from qosflow.prefect.blocks import BareMetalGPUCluster

    try:
        return await BareMetalGPUCluster.aload(name)
    except Exception:  # only to say what changed
        return None


async def _cluster_kind(name: Optional[str], cluster_file: Optional[str], *, check: bool = False) -> Optional[str]:
    """'local', 'agents' or 'kubernetes': how the cluster block `name` (or a cluster file: agents) runs stages;
    None when it cannot say. With `check`, a missing or invalid block, or one that is not a qosflow cluster
    block, is a SpecError naming --cluster-block."""
    from qosflow.errors import SpecError
    from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster

    if cluster_file:
        return "agents"
    if not name:
        return None
    from qosflow.prefect.worker import load_cluster_block

    try:
        block = await load_cluster_block(name)
    except SpecError as exc:
        if not check:
            return None
        raise SpecError("--cluster-block", str(exc).removeprefix("invalid cluster_block: ")) from None
    except Exception as exc:  # e.g. SLUG/NAME of a block type that is not a cluster's
        if not check:
            return None
        raise SpecError("--cluster-block", f"cannot load cluster block {name!r}: {exc}") from None
    if isinstance(block, KubernetesGPUCluster):
        return "kubernetes"
    if isinstance(block, BareMetalGPUCluster):
        return block.backend
    if check:
        raise SpecError("--cluster-block", f"block {name!r} is a {type(block).__name__}, not a qosflow cluster block "
                                           "(qosflow-bare-metal-cluster or qosflow-kubernetes-cluster)")
    return None


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


def deadline_seconds(raw: str) -> float:
    """`--deadline`: seconds, or a duration string as @qos_flow(deadline=...) takes ("1h" was rejected)."""
    from qosflow.core.qos import to_seconds
    from qosflow.errors import SpecError

    try:
        secs = float(to_seconds(raw))
    except ValueError:
        raise SpecError("--deadline", f"expected seconds or a duration such as 90s, 15min, 2h or 1h30m, got {raw!r}") from None
    if not 0 < secs < float("inf"):  # was a pydantic traceback from QoSPolicy
        raise SpecError("--deadline", f"must be a positive duration, got {raw!r}")
    return secs

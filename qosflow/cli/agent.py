"""`qosflow agent ...`: the bare-metal host agent and a look at a cluster file's hosts."""

from __future__ import annotations

import contextlib

from pathlib import Path
from typing import Optional

import typer


def _read_token(token: str | None, token_file: Path | None) -> str:
    import os

    from qosflow.errors import SpecError

    if token and token_file:
        raise SpecError("token", "give --token or --token-file, not both")
    if token_file:
        try:
            token = token_file.expanduser().read_text().strip()
        except OSError as exc:
            raise SpecError("--token-file", f"cannot read {token_file}: {exc.strerror}") from None
        if not token:
            raise SpecError("--token-file", f"{token_file} is empty; put the cluster's secret token in it (make one with: "
                                            f"python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > {token_file}; "
                                            "the same token on every host and for the worker)")
        from qosflow.backends.agent import token_file_warning

        # a token file others can read gives every user of the host the run of every agent
        warned = token_file_warning(token_file.expanduser())
        if warned:
            typer.echo(f"warning: --token-file: {warned}", err=True)
    token = token or os.environ.get("QOSFLOW_AGENT_TOKEN", "")
    if not token:
        raise SpecError(
            "token",
            "the agent needs the cluster's secret token: --token-file FILE (preferred), --token T or QOSFLOW_AGENT_TOKEN",
        )
    return token


@contextlib.contextmanager
def _quiet_down_hosts():
    """Leave out the backend's 'host X is down: ...' log lines (its other warnings pass)."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("host %s is down", "host %s is still down"))

    logger = logging.getLogger("qosflow.backends.agent")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def register(app: typer.Typer) -> None:
    agent = typer.Typer(help="The bare-metal host agent (one per GPU host) that the qosflow worker launches stages through.", no_args_is_help=True)
    app.add_typer(agent, name="agent")

    @agent.command("start")
    def start(
        port: int = typer.Option(8701, "--port", "-p", min=1, max=65535, help="TCP port to listen on"),
        host: str = typer.Option("127.0.0.1", "--host", help="address to bind (127.0.0.1 unless the workers are remote)"),
        virtual_gpus: Optional[int] = typer.Option(None, "--virtual-gpus", min=0, help="declare N virtual GPUs when the host has no NVML GPU (default: none; without NVML the host is then CPU-only)"),
        gpu_mem_mb: float = typer.Option(16_384.0, "--gpu-mem-mb", help="memory of each virtual GPU (MiB)"),
        cpu_cores: Optional[float] = typer.Option(None, "--cpu-cores", help="cores to offer (default: the cores this process may use)"),
        name: Optional[str] = typer.Option(None, "--name", help="host name the worker sees (default: hostname)"),
        token: Optional[str] = typer.Option(None, "--token", help="secret token (visible in `ps`; prefer --token-file; default: $QOSFLOW_AGENT_TOKEN)"),
        token_file: Optional[Path] = typer.Option(None, "--token-file", help="file holding the secret token"),
        fence_after: Optional[float] = typer.Option(
            None, "--fence-after", help="kill a running stage when the worker that launched (or adopted) it sent no heartbeat for this many seconds, whatever other workers still ask, or the agent was frozen that long (avoids running a stage twice after a network split); pipeline runs (pipelines_on: agents) are left running: the next worker adopts them; a worker that stops asks its agents to hold the fence of its stages until the next worker adopts them or it heartbeats again, for at most QOSFLOW_AGENT_FENCE_HOLD_SECONDS (the worker's environment; default the lease TTL, 30 s); 1.5 x the worker's heartbeat_s is a good choice (default: never)"
        ),
        label: list[str] = typer.Option([], "--label", help="node label KEY=VALUE (repeatable)"),
        workdir: Optional[Path] = typer.Option(None, "--workdir", help="where stage logs go (default: a new temp dir under $TMPDIR or /tmp, removed when the agent stops; a --workdir is kept)"),
        max_logs_mb: float = typer.Option(
            10_240.0, "--max-logs-mb", help="keep the stages' logs (with their progress files) within this many MiB: beyond it the logs of the stages that ended longest ago are removed, their records kept (log_removed) (default 10240, i.e. 10 GiB; 0: keep only running stages' logs)",
        ),
        tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="serve HTTPS with this certificate chain (PEM); the worker then reaches the agent at https://... and checks it against its CA (the cluster file's tls_ca_file, the block's agent_ca_cert)"),
        tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="the private key (PEM) of --tls-cert; keep it root's, mode 600"),
        stage_user: Optional[str] = typer.Option(
            None, "--stage-user", envvar="QOSFLOW_AGENT_STAGE_USER",
            help="run every stage as this unprivileged account (the agent must run as root): stages then cannot read the token file or other stages' logs (default: the agent's own user)",
        ),
        log_level: str = typer.Option("warning", "--log-level", help="critical | error | warning | info | debug | trace (the agent's HTTP server log)"),
    ) -> None:
        """Run the agent: report GPUs, launch stages with their placement, stream logs, kill on request.

        One agent per GPU host; the qosflow worker reaches it over HTTP (a cluster file or a bare-metal
        cluster block lists the hosts' URLs). Every request must carry the cluster's secret token
        (--token-file, --token or QOSFLOW_AGENT_TOKEN). GPUs come from NVML; a host without one offers
        --virtual-gpus, reported as virtual. Details: docs/infrastructure.md.

        Examples:

          qosflow agent start --host 0.0.0.0 --fence-after 3 \\
              --token-file /etc/qosflow/agent-token

          qosflow agent start --virtual-gpus 4 --token-file token --name lab-1

          sudo qosflow agent start --host 0.0.0.0 --stage-user qosflow-stage \\
              --token-file /etc/qosflow/agent-token \\
              --workdir /var/lib/qosflow-agent --max-logs-mb 2048
        """
        import socket

        from qosflow.agent.app import AgentConfig
        from qosflow.agent.gpus import GpuSource
        from qosflow.agent.server import bind, serve
        from qosflow.errors import SpecError

        for opt, value, floor in (("--gpu-mem-mb", gpu_mem_mb, 0), ("--cpu-cores", cpu_cores, 0), ("--fence-after", fence_after, 0)):
            if value is not None and not value > floor:
                raise SpecError(opt, f"must be > 0, got {value:g}")
        if not max_logs_mb >= 0:
            raise SpecError("--max-logs-mb", f"must be >= 0, got {max_logs_mb:g}")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if log_level.lower() not in levels:  # uvicorn raised a KeyError traceback once the port was bound
            raise SpecError("--log-level", f"{log_level!r} is not one of {' | '.join(levels)}")
        if workdir is not None:  # a file there was a FileExistsError traceback, after the port was bound
            from qosflow.cli.output import check_output_dir

            check_output_dir(workdir, "--workdir")
        labels = {}
        for item in label:
            if "=" not in item:
                raise SpecError("--label", f"{item!r} is not KEY=VALUE")
            k, v = item.split("=", 1)
            if not k.strip():  # '=gpu' started an agent with a label without a name
                raise SpecError("--label", f"{item!r} has no KEY; write KEY=VALUE, e.g. --label rack=r1")
            labels[k.strip()] = v
        token_value = _read_token(token, token_file)
        if stage_user is not None:
            from qosflow.agent.runner import StageUser

            account = StageUser.resolve(stage_user)
            if token_file is not None and account.can_read(token_file.expanduser()):
                # the point of --stage-user is that a stage cannot take the token and drive every agent
                raise SpecError("--stage-user", f"{account.name!r} can read the token file {token_file}: every stage "
                                                f"could take the token; make the file root's alone: "
                                                f"chown root: {token_file} && chmod 600 {token_file}")
            if token is not None:
                typer.echo("warning: --token shows in `ps` to every user of the host, the stages' account included; "
                           "with --stage-user use --token-file (root's, mode 600)", err=True)
        cfg = AgentConfig(
            token=token_value,
            name=name or socket.gethostname(),
            virtual_gpus=virtual_gpus,
            gpu_mem_mb=gpu_mem_mb,
            cpu_cores=cpu_cores,
            labels=labels,
            workdir=workdir,
            fence_after_s=fence_after,
            stage_user=stage_user,
            max_logs_mb=max_logs_mb,
        )
        from qosflow.agent.server import check_tls

        cert, key = (str(p.expanduser()) if p else None for p in (tls_cert, tls_key))
        check_tls(cert, key)
        socks = bind(host, port)
        src = GpuSource.detect(virtual_gpus, virtual_mem_mb=gpu_mem_mb)
        typer.echo(f"qosflow agent {cfg.name} on {'https' if cert else 'http'}://{host}:{port}: {src.count} GPU(s), {src.note}", err=True)
        serve(cfg, port, host, log_level, sockets=socks, tls_cert=cert, tls_key=key)

    @agent.command("status")
    def status(cluster: Path = typer.Option(..., "--cluster", help="cluster file (YAML or JSON) listing hosts and agent URLs")) -> None:
        """Ask every agent of a cluster file for its GPUs and health.

        Exits 0 when every host is up, 1 when any is down (for scripts and health checks), 2 on a bad
        cluster file. Asking an agent keeps none of a worker's stages from its fence, and ends no fence hold a stopping
        worker asked of it (docs/infrastructure.md).

        Examples:

          qosflow agent status --cluster lab.yaml

          qosflow agent status --cluster /etc/qosflow/lab.yaml || echo "a host is down"
        """
        from rich.console import Console
        from rich.table import Table

        from qosflow.backends.agent import load_cluster_file, size_notes

        cf = load_cluster_file(cluster)
        with _quiet_down_hosts():  # (the table says why each host is down: not again as log lines above it)
            snap = cf.ask_agents()
        declared = {d.name: d for d in cf.hosts}
        t = Table(title=f"{cf.name}: {len(snap.hosts)} host{'' if len(snap.hosts) == 1 else 's'}, refreshed in {snap.elapsed_s * 1000:.0f} ms")
        for col in ("host", "url", "up", "GPUs", "GPU util", "cores", "running", "stages run as", "note"):
            # on a narrow terminal long cells (a URL, a connection error) wrap instead of ending in '…'
            t.add_column(col, overflow="fold")
        for h in snap.hosts:
            util = "-" if h.virtual or not h.gpus else ",".join(str(g.get("utilization_gpu")) for g in h.gpus)
            runs_as = "-" if not h.reported else (h.stage_user or "the agent's user")
            # (a declared size the agent does not have was said by the worker only, not here)
            note = "; ".join(n for n in (h.note, *size_notes(declared[h.name], h, "the cluster file")) if n)
            t.add_row(h.name, h.url, "yes" if h.up else "no", str(len(h.gpus)), util, f"{h.cpu_cores:g}", str(len(h.running)),
                      runs_as, note)
        Console().print(t)
        down = [h.name for h in snap.hosts if not h.up]
        for h in snap.hosts:  # (below the table, whole: in its narrow 'up' column the reason took a line a word)
            if not h.up:
                typer.echo(f"{h.name} is down: {h.error}", err=True)
        if down:
            typer.secho(f"{len(down)} of {len(snap.hosts)} hosts down: {', '.join(down)}", err=True, fg="red")
            raise typer.Exit(1)

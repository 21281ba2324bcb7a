"""`qosflow simulate`: compare scheduling policies on a trace, with the live worker's policy code."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Replay a GPU-cluster trace under several scheduling policies and compare them.

Policies run exactly as in the live worker; the simulator advances jobs with their true durations
and slowdowns while policies see only estimates (--estimator). Prints a table, writes JSON
(--json) and PNG plots (--out: JCT CDF, DSR, GPU allocation).

Examples:

  qosflow simulate --trace synthetic --cluster 8x8

  qosflow simulate --trace ../shared/data/traces/muri_philly_trace1.csv --format muri \\
      --cluster ../shared/data/traces/muri_cluster_n8g8.csv --policies tiresias,srtf,qosflow \\
      --json out/muri.json --out out/
"""


def register(app: typer.Typer) -> None:
    @app.command("simulate", help=HELP)
    def simulate_cmd(
        trace: str = typer.Option("synthetic", "--trace", help="trace file, or 'synthetic' for the embedded Philly-like generator"),
        fmt: Optional[str] = typer.Option(None, "--format", help="muri | gavel | alibaba | synthetic (default: guessed from --trace)"),
        cluster: Optional[str] = typer.Option(None, "--cluster", help="NxG (e.g. 8x8), a Muri cluster CSV, an Alibaba node list, or a Gavel spec V:P:K (default: the trace's own, else 8x8)"),
        policies: str = typer.Option("fifo,sjf,srtf,tiresias,sjf-ffs,sjf-bsbf,genie", "--policies", help="comma-separated policy names"),
        seed: int = typer.Option(0, "--seed", help="seed for deadlines, failures, noise and synthetic traces"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write the results as JSON here"),
        out: Optional[Path] = typer.Option(None, "--out", help="directory for PNG plots (default: next to --json)"),
        estimator: str = typer.Option("oracle", "--estimator", help="what policies know: oracle | noisy | learned | declared"),
        error: float = typer.Option(0.3, "--error", help="relative error of the noisy estimator (0.3 = +-30 %)"),
        failures: float = typer.Option(0.0, "--failures", help="share of jobs that fail part-way and are retried (Philly: ~0.3)"),
        deadline_share: float = typer.Option(0.5, "--deadline-share", help="share of jobs given a deadline (traces carry none)"),
        jobs: Optional[int] = typer.Option(None, "--jobs", help="synthetic: number of jobs"),
        no_plots: bool = typer.Option(False, "--no-plots", help="skip the PNG plots"),
    ) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from qosflow.core.estimate import make_estimator
        from qosflow.policies import get_policy, parse_policies
        from qosflow.sim.engine import SimConfig, Simulator
        from qosflow.sim.interference import default_speed_model
        from qosflow.sim.metrics import compute_bounds, compute_metrics
        from qosflow.sim.report import plot_results, render_table, results_json, write_json
        from qosflow.sim.runner import resolve_workload

        console = Console(width=max(120, Console().width))
        names = parse_policies(policies)
        wl, spec = resolve_workload(trace, fmt, cluster, seed=seed, deadline_share=deadline_share, jobs=jobs)
        speed = default_speed_model()
        console.print(
            f"[bold]{wl.name}[/]: {len(wl.jobs)} jobs on {spec.name} ({len(spec.nodes)} nodes, {spec.num_gpus} GPUs); "
            f"estimates: {estimator}" + (f" (±{error:.0%})" if estimator == "noisy" else "")
        )
        for jid, why in wl.rejected[:10]:
            console.print(f"[yellow]rejected[/] {jid}: {why}")
        if len(wl.rejected) > 10:
            console.print(f"[yellow]… {len(wl.rejected) - 10} more rejected jobs[/]")
        results, metrics = {}, {}
        cfg = SimConfig(seed=seed, failure_share=failures)
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True
        ) as prog:
            for name in names:
                task = prog.add_task(f"{name:>9}", total=len(wl.jobs))
                est = make_estimator(estimator, speed, seed=seed, error=error)
                sim = Simulator(wl.jobs, spec, get_policy(name), estimator=est, speed=speed, config=cfg)
                res = sim.run(on_progress=lambda done, total, t=task: prog.update(t, completed=done))
                results[name] = res
                metrics[name] = compute_metrics(res)
        bounds = compute_bounds(wl.jobs, spec)
        console.print(render_table(metrics, bounds, title=f"{wl.name} on {spec.name}"))
        extra = {
            "workload": {"name": wl.name, "jobs": len(wl.jobs), "rejected": [{"job": j, "reason": r} for j, r in wl.rejected]},
            "cluster": {"name": spec.name, "nodes": len(spec.nodes), "gpus": spec.num_gpus},
            "estimator": estimator,
            "seed": seed,
            "failures": failures,
        }
        data = results_json(metrics, bounds, extra)
        if json_out:
            console.print(f"JSON: {write_json(json_out, data)}")
        plot_dir = out or (json_out.parent if json_out else None)
        if plot_dir and not no_plots:
            files = plot_results(results, metrics, bounds, plot_dir)
            console.print("plots: " + ", ".join(str(f) for f in files))

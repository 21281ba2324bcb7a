"""`qosflow simulate`: compare scheduling policies on a trace, with the live worker's policy code."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Replay a GPU-cluster trace under several scheduling policies and compare them.

A trace of your own: a Muri CSV (job_id, num_gpu, submit_time, iterations, model_name, batch_size,
duration, iteration_time; times in milliseconds), an Alibaba pod list (seconds) or a Gavel .trace
(tab-separated); a cluster: NxG, a Muri cluster CSV or an Alibaba node list. Columns, units and what
each becomes: docs/workloads.md.

Policies run exactly as in the live worker; the simulator advances jobs with their true durations
and slowdowns while policies see only estimates (--estimator). Prints a table (and, when jobs have
deadlines, the deadlines each policy met per class of job: GPUs x duration alone; with --users, each
user's jobs, JCT, slowdown, deadlines and GPU-hours, and Jain's index over the users), writes JSON
(--json) and PNG plots (--out: JCT CDF, average JCT, DSR, DSR by job class,
GPU allocation, GPU timeline).

Examples:

  qosflow simulate --trace synthetic --cluster 8x8

  qosflow simulate --trace ../shared/data/traces/muri_philly_trace1.csv \\
      --cluster ../shared/data/traces/muri_cluster_n8g8.csv \\
      --policies tiresias,srtf,qosflow --json out/muri.json --out out/
"""


def register(app: typer.Typer) -> None:
    @app.command("simulate", help=HELP)
    def simulate_cmd(
        trace: str = typer.Option("synthetic", "--trace", help="trace file, or 'synthetic' for the embedded Philly-like generator"),
        fmt: Optional[str] = typer.Option(None, "--format", help="muri | gavel | alibaba | synthetic (default: guessed from --trace)"),
        cluster: Optional[str] = typer.Option(None, "--cluster", help="NxG (e.g. 8x8), a Muri cluster CSV, an Alibaba node list, or a Gavel spec V:P:K (V100s:P100s:K80s, e.g. 36:36:36; jobs run at their measured speed on each model) (default: the trace's own, else 8x8)"),
        policies: str = typer.Option("fifo,sjf,srtf,tiresias,sjf-ffs,sjf-bsbf,genie,qosflow", "--policies",
                                     # spaced, so that an 80-column terminal wraps the list instead of cutting it ("sjf-ffs,…")
                                     show_default="fifo, sjf, srtf, tiresias, sjf-ffs, sjf-bsbf, genie, qosflow", help="comma-separated policy names, of: fifo, sjf, srtf, tiresias, sjf-ffs, sjf-bsbf, genie, gavel (for mixed GPU models, e.g. --cluster 36:36:36; preempts every 6 min) and qosflow (ours; the others are the baselines); docs/policies.md"),
        seed: int = typer.Option(0, "--seed", min=0, help="seed for deadlines, failures, noise and synthetic traces"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write the results as JSON here"),
        out: Optional[Path] = typer.Option(None, "--out", help="directory for the PNG plots and one CSV per run with every job's times, deadline outcome and the policy's note on it, jobs-<policy>.csv (default: next to --json)"),
        estimator: str = typer.Option("oracle", "--estimator", help="what policies know: oracle (the true durations) | noisy (those +- --error) | learned (the predictor, from finished jobs) | declared (what jobs declare: trace jobs declare nothing, so a flat 600 s each); comma-separated (oracle,noisy,learned) runs every policy under each and shows the QoS lost against oracle"),
        error: float = typer.Option(0.3, "--error", help="relative error of the noisy estimator (0.3 = +-30 %)"),
        failures: float = typer.Option(0.0, "--failures", help="share of jobs that fail part-way and are retried (Philly: ~0.3)"),
        deadline_share: float = typer.Option(0.5, "--deadline-share", help="share of jobs given a deadline (traces carry none)"),
        users: Optional[str] = typer.Option(None, "--users", metavar="N|SHARES", help="give the synthetic workload's jobs users, to see fairness between them (the qosflow policy's fair_share): N users user1..userN, user k submitting a share proportional to 1/k (3: 55 %, 27 %, 18 %), or the users' shares, e.g. 0.6,0.2,0.2. The jobs themselves stay the same. With two users or more the report adds a table per user and policy (jobs, average JCT and slowdown, deadlines met, GPU-hours with a shared GPU split between its jobs, Jain's index over the users' slowdowns; JSON 'per_user'). The traces name no user (default: none)"),
        jobs: Optional[int] = typer.Option(None, "--jobs", help="number of jobs of the synthetic workload (default: 400); traces are simulated whole. The synthetic load is 1.0 in the steady-state sense: with far fewer than ~6 jobs per GPU most of the work (the long jobs') runs after the last arrival and jobs hardly queue (a note says so)"),
        min_gpus_share: Optional[float] = typer.Option(None, "--min-gpus-share", help="let every job of 2+ GPUs start on as few as this share of them (0.5: an 8-GPU job on 4, with 2 steps of gradient accumulation, at half speed), as a stage declaring @qos_task(min_gpus=...) may; the qosflow policy does so for a deadline job when its full width is not free. Traces record no such thing: this is an assumption about the jobs (default: every job rigid)"),
        cores_per_gpu: Optional[float] = typer.Option(None, "--cores-per-gpu", help="CPU cores a job takes per GPU, for traces that give none (muri, gavel, synthetic; an Alibaba pod list gives each pod's). Jobs need them free on their nodes besides the GPUs (default: 4, the saturation point of CV input pipelines; docs/workloads.md)"),
        no_plots: bool = typer.Option(False, "--no-plots", help="skip the PNG plots"),
        settings: Optional[list[str]] = typer.Option(None, "--set", help="a policy option, POLICY.OPTION=VALUE (repeatable), e.g. --set qosflow.express_share=0.125"),
        throughputs: Optional[Path] = typer.Option(None, "--throughputs", help="a throughput table in Gavel's format, like Gavel's own in the shared data (throughputs/ in QOSFLOW_SHARED_DATA): solo and co-located steps/s per job type: turns a Gavel trace's steps into seconds, and gives the measured slowdowns of jobs sharing GPUs (default: the shared data's copy; also QOSFLOW_THROUGHPUTS)"),
        parallel: Optional[int] = typer.Option(None, "--parallel", help="simulations run at once, each in a process of its own (default: one per CPU core, at most one per run, except for small batches: under 2,000 jobs x runs they run in this process; 1: one after another in this process). Results are the same either way; policies registered from your own code run in this process"),
    ) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        from qosflow import __version__
        from qosflow.policies import parse_policies, parse_policy_options
        from qosflow.sim.batch import Batch, RunSpec, default_workers
        from qosflow.sim.engine import SimConfig, SimulationError
        from qosflow.sim.interference import default_speed_model, default_throughputs_path
        from qosflow.sim.metrics import compute_bounds, compute_metrics
        from qosflow.errors import SpecError, UnknownNameError
        from qosflow.sim.report import (earlier_outputs, estimator_deltas, other_results, plot_results, render_class_table,
                                        render_estimator_table, render_table, render_user_table, results_json,
                                        write_job_tables)
        from qosflow.sim.runner import check_trace_format, fewest_cores_per_gpu, resolve_workload
        from qosflow.sim.traces._common import CORES_PER_GPU

        from qosflow.cli.output import (check_file_and_dir, check_not_an_input, check_output_dir, check_output_file, interrupted,
                                        on_terminal, print_table, progress_bar, result_console, table_width,
                                        unwritable_result, write_json_file)

        # a terminal's own width, each table split to fit it; elsewhere 120 columns or more, as always
        console = result_console(min_width=120)

        check_file_and_dir(json_out, out)
        check_not_an_input(json_out, {"--trace": trace, "--cluster": cluster})
        if json_out is not None:
            check_output_file(json_out)
        if out is not None:  # the per-job CSVs go there with --no-plots too
            check_output_dir(out)
        names = parse_policies(policies)
        popts = parse_policy_options(settings, names)
        kinds = list(dict.fromkeys(k.strip() for k in estimator.split(",") if k.strip()))
        if not kinds:  # (an empty value ran the oracle without a word)
            raise SpecError("--estimator", f"give at least one estimator, e.g. --estimator oracle or --estimator oracle,noisy,learned; got {estimator!r}")
        for k in kinds:
            if k not in ("oracle", "noisy", "learned", "declared"):
                raise UnknownNameError("estimator", k, ["declared", "learned", "noisy", "oracle"])
        if not 0 <= error < 1:  # checked before the trace loads, whatever the estimator
            raise SpecError("--error", f"must be in [0, 1) (0.3 = +-30 %), got {error!r}")
        if error != 0.3 and "noisy" not in kinds:  # was dropped without a word
            typer.secho(f"warning: --error {error:g} is the noisy estimator's error, and --estimator {estimator} has no "
                        "noisy: add it, e.g. --estimator oracle,noisy", err=True, fg="yellow")
        if not 0 <= failures <= 1:
            raise SpecError("--failures", f"must be a share of jobs in [0, 1] (Philly: ~0.3), got {failures!r}")
        if not 0 <= deadline_share <= 1:  # was "invalid deadline_share", once the trace had loaded
            raise SpecError("--deadline-share", f"must be a share of jobs in [0, 1] (0.5: half get a deadline), got {deadline_share!r}")
        if min_gpus_share is not None and not 0 < min_gpus_share <= 1:
            raise SpecError("--min-gpus-share", f"must be a share of a job's GPUs in (0, 1] (0.5: an 8-GPU job may start on 4), got {min_gpus_share!r}")
        check_trace_format(trace, fmt)  # (before --users, which is for the synthetic workload)
        user_shares = _parse_users(users, trace, fmt) if users is not None else None
        if parallel is not None and parallel < 1:
            raise SpecError("--parallel", f"must be at least 1 (1: one run after another), got {parallel}")
        if throughputs is not None:
            if not throughputs.is_file():
                raise SpecError("--throughputs", f"{throughputs}: no such file; give the path of a throughput table in "
                                                 "Gavel's format (gavel_simulation_throughputs.json)")
        cfg = SimConfig(seed=seed, failure_share=failures)
        out_dir = out or (json_out.parent if json_out else None)
        planned = [str(p) for p in (json_out, out_dir) if p is not None]  # what a Ctrl-C leaves untouched
        try:  # (a large trace, or --jobs 200000, takes a while to load)
            wl, spec = resolve_workload(trace, fmt, cluster, seed=seed, deadline_share=deadline_share, jobs=jobs,
                                        min_gpus_share=min_gpus_share, throughputs=throughputs, cores_per_gpu=cores_per_gpu,
                                        users=user_shares)
        except KeyboardInterrupt:
            raise interrupted([], planned) from None
        speed = default_speed_model(throughputs)
        console.print(
            f"[bold]{wl.name}[/]: {_n(len(wl.jobs), 'job')} on {spec.name} ({_n(len(spec.nodes), 'node')}, {_n(spec.num_gpus, 'GPU')}); "
            "estimates: " + ", ".join(f"noisy (±{error:.0%})" if k == "noisy" else k for k in kinds)
        )
        console.print(speed.describe(), style="dim", highlight=False)
        if cluster is None and wl.info.get("format") != "synthetic" and not getattr(wl, "cluster_hint", None):
            console.print(
                f"[yellow]note:[/] no --cluster given and no cluster file found beside the trace, so the default "
                f"{spec.name} is used. Name the cluster the trace ran on with --cluster (NxG, a Muri cluster CSV, an "
                "Alibaba node list or a Gavel spec V:P:K).", highlight=False
            )
        if speed.interference is None:
            console.print(
                f"[yellow]note:[/] Gavel's measured throughput table was not found at {default_throughputs_path()}, so jobs "
                "that share GPUs slow down by the fallback above, not by measured pairs. Point QOSFLOW_SHARED_DATA at the "
                "directory holding throughputs/gavel_simulation_throughputs.json to use it.", highlight=False
            )
        assumed = cores_per_gpu if cores_per_gpu is not None else CORES_PER_GPU
        fewest = fewest_cores_per_gpu(spec)
        if wl.info.get("format") != "alibaba" and fewest is not None and fewest < assumed:
            short = sum(1 for _, why in wl.rejected if " cores" in why)
            console.print(
                f"[yellow]note:[/] the trace gives no CPU cores per job, so each job takes {assumed:g} per GPU"
                + (" (the default)" if cores_per_gpu is None else " (--cores-per-gpu)")
                + f", and {spec.name} has {fewest:g} per GPU on {'its' if len(spec.nodes) == 1 else 'some'} GPU nodes: cores, "
                "not GPUs, limit how many jobs run there"
                + (f", and {short} job{'s are' if short > 1 else ' is'} rejected for cores" if short else "")
                + ". Give the cores your jobs take per GPU with --cores-per-gpu (e.g. --cores-per-gpu "
                f"{max(0.5, fewest):g}).", highlight=False)
        if wl.info.get("format") == "muri" and wl.jobs:
            import statistics

            median = statistics.median(j.duration for j in wl.jobs)
            if median < 60:  # the shared Muri trace: 4 h; a trace written in seconds reads as 1000x shorter jobs
                console.print(
                    f"[yellow]note:[/] the jobs' median duration is {median:.3g} s. A Muri trace gives times in "
                    "milliseconds (submit_time, duration, iteration_time): if yours are in seconds, multiply them by "
                    "1000.", highlight=False)
        if "declared" in kinds and not any(j.expected_duration for j in wl.jobs):
            from qosflow.core.estimate import DeclaredEstimator

            flat = DeclaredEstimator().default_duration
            console.print(
                f"[yellow]note:[/] --estimator declared: no job of {wl.name} declares a duration (traces carry none), so "
                f"the policies take every job for {flat:g} s: this compares them knowing nothing of durations.",
                highlight=False)
        # (an Alibaba pod names no model: its jobs are all 'alibaba-pod', and that is no user's mistake)
        unknown = _unknown_models(wl.jobs, speed) if wl.info.get("format") != "alibaba" else {}
        if unknown:
            n = sum(unknown.values())
            shown = ", ".join(f"{m} ({k} job{'s' if k > 1 else ''})" for m, k in list(unknown.items())[:8])
            more = f", and {len(unknown) - 8} more" if len(unknown) > 8 else ""
            console.print(
                f"[yellow]note:[/] {n} job{'s' if n > 1 else ''} of a model qosflow has no measurements of: {shown}{more}. "
                f"{'Their' if n > 1 else 'Its'} slowdown next to other jobs comes from the fallback above"
                + (f", and {'their' if n > 1 else 'its'} GPU memory is assumed to be the largest profiled (10532 MiB), so "
                   f"{'they share' if n > 1 else 'it shares'} GPUs only where that fits" if any(j.meta.get("gpu_mem_assumed") for j in wl.jobs if j.model in unknown) else "")
                + ". Name the closest known model to use measured figures (docs/workloads.md, 'Trace models -> Gavel job "
                "types').", highlight=False)
        offered = None
        if wl.info.get("format") == "synthetic":
            from qosflow.sim.traces.synthetic import JOBS_PER_GPU, offered_load

            offered = offered_load(wl.jobs, spec.num_gpus)
            if offered.thin:
                n, g = len(wl.jobs), spec.num_gpus
                why = (
                    f"Their load {offered.load:.2f} counts all their work over the {offered.window / 3600:.0f} h from first to last "
                    f"arrival, but most of it (the long jobs') runs after the last arrival: while jobs arrive they ask for "
                    f"{offered.during_arrivals:.0%} of the GPUs on average, at most {offered.peak_gpus} at once"
                    if offered.window > 0 else f"Started on arrival they would ask for at most {offered.peak_gpus} GPUs at once"
                )
                console.print(
                    f"[yellow]note:[/] {n} job{'s are' if n > 1 else ' is'} few for {g} GPUs. {why}, so jobs hardly wait and the "
                    f"policies will look alike. For a loaded cluster give about {JOBS_PER_GPU} jobs per GPU: --jobs "
                    f"{JOBS_PER_GPU * g}, or {n} jobs on about {max(1, round(n / JOBS_PER_GPU))} GPUs (see docs/workloads.md)."
                )
        shown, kinds_left = _rejected_to_show(wl.rejected)
        for jid, why in shown:
            console.print(f"[yellow]rejected[/] {jid}: {why}", highlight=False)
        if len(wl.rejected) > len(shown):
            # (was "… 6 more rejected jobs": the one job of a GPU model no node has hid behind ten Pending pods)
            more = len(wl.rejected) - len(shown)
            console.print(f"[yellow]… {more} more rejected job{'s' if more > 1 else ''}[/]"
                          + (f", for {kinds_left} other reason{'s' if kinds_left > 1 else ''}" if kinds_left else
                             ", for the reasons above")
                          + ("; --json lists them all (workload.rejected)" if json_out is None else
                             f"; {json_out} lists them all (workload.rejected)"), highlight=False)
        results, metrics = {}, {}
        by_est: dict = {}  # estimator name -> policy -> Metrics
        failed: dict[str, str] = {}  # policy label -> why its run stopped (SimulationError)
        specs = [
            RunSpec(name if len(kinds) == 1 else f"{name} ({kind})", name, kind, popts.get(name, {}))
            for kind in kinds for name in names
        ]
        workers = parallel if parallel is not None else default_workers(len(specs), len(wl.jobs))
        # the batch's worker processes start before the bar's redraw thread (see `Batch`)
        try:
            with Batch(specs, wl.jobs, spec, speed, cfg, seed=seed, error=error, workers=workers) as batch, \
                    progress_bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as prog:
                tasks = {s.label: prog.add_task(f"{s.label:>9}", total=len(wl.jobs)) for s in specs}
                outcomes = batch.run(on_progress=lambda label, done, total: prog.update(tasks[label], completed=done))
        except KeyboardInterrupt:
            raise interrupted([], planned) from None
        for o in outcomes:
            label = o.spec.label
            if o.result is None:  # one policy stalling must not hide the others' results
                failed[label] = o.error or "stopped"
                console.print(f"[red]{label} failed:[/] {o.error}")
                continue
            results[label] = o.result
            metrics[label] = compute_metrics(o.result)
            by_est.setdefault(o.estimator, {})[o.spec.policy] = metrics[label]
        if not metrics:
            raise SimulationError("every policy failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
        bounds = compute_bounds(wl.jobs, spec, speed)
        # what a GPU cluster's user reads first (deadlines met, waits, JCT, allocation) in the first part when the
        # terminal is too narrow for the whole table; makespan, preemptions and the job counts after it
        print_table(console, render_table(metrics, bounds, title=f"{wl.name} on {spec.name}"), first=MAIN_FIRST)
        if any(m.elastic_starts for m in metrics.values()):
            console.print("elastic starts (jobs started on fewer GPUs than they asked for, with gradient accumulation): "
                          + ", ".join(f"{k} {m.elastic_starts}" for k, m in metrics.items()), highlight=False)
        # one line per class, however many policies: as wide as it needs; with several estimators, a
        # table per estimator (one of every policy x estimator was ~330 columns wide)
        class_tables = ([render_class_table(metrics)] if len(kinds) == 1 else
                        [render_class_table(ms, title=f"Deadlines met by job class ({est})") for est, ms in by_est.items()])
        for by_class in class_tables:
            if by_class is None:
                continue
            if on_terminal(console):  # the policies split over parts, each with the classes and their jobs
                print_table(console, by_class, keep=2, first=("qosflow",))
                continue
            need = table_width(by_class, console)
            (console if need <= console.width else Console(width=need)).print(by_class)
        # per user (when the jobs carry two users or more), as the class tables: one per estimator
        user_tables = ([render_user_table(metrics)] if len(kinds) == 1 else
                       [render_user_table(ms, title=f"Per user ({est})") for est, ms in by_est.items()])
        for by_user in user_tables:
            if by_user is not None:
                print_table(console, by_user, keep=2, first=("deadlines met", "avg slowdown"))
        baseline = "oracle" if "oracle" in by_est else next(iter(by_est))
        if len(kinds) > 1:
            print_table(console, render_estimator_table(by_est, baseline, title=f"QoS lost to prediction error (vs {baseline})"),
                        keep=2, first=("DSR", f"ΔDSR vs {baseline}", "avg JCT", "ΔJCT"))
        extra = {
            # what the run was given, so that two result files say how their runs differed (--deadline-share,
            # --error, the trace itself were nowhere in it)
            "workload": {"name": wl.name, "trace": trace, "format": wl.info.get("format", fmt), "jobs": len(wl.jobs),
                         "rejected": [{"job": j, "reason": r} for j, r in wl.rejected],
                         "deadline_share": deadline_share, "min_gpus_share": min_gpus_share, "users": user_shares,
                         "cores_per_gpu": None if wl.info.get("format") == "alibaba" else assumed,
                         **({"offered_load": offered.to_json()} if offered is not None else {})},
            "cluster": {"name": spec.name, "given": cluster, "nodes": len(spec.nodes), "gpus": spec.num_gpus},
            "estimator": estimator,
            "error": error if "noisy" in kinds else None,
            "throughputs": str(throughputs) if throughputs is not None else None,
            "qosflow_version": __version__,
            "speed_model": speed.describe(),
            "seed": seed,
            "failures": failures,
            "policy_options": popts,
            "failed_policies": failed,
            "workers": {"processes": batch.workers if batch.remote else 0, "start_method": batch.start_method},
        }
        data = results_json(metrics if len(kinds) == 1 else by_est[baseline], bounds, extra)
        if len(kinds) > 1:
            data["by_estimator"] = {e: results_json(ms, bounds)["policies"] for e, ms in by_est.items()}
            data["estimator_baseline"] = baseline
            data["estimator_deltas"] = estimator_deltas(by_est, baseline)
        written: list[Path] = []
        # --json r0.json, then --json r1.json in the same directory: the second run's plots and per-job CSVs
        # (next to its JSON) replaced the first's without a word, and r0.json no longer matched them
        replaced_runs = other_results(out_dir, json_out) if out is None and json_out and earlier_outputs(out_dir, []) else []
        try:
            if json_out:
                written.append(write_json_file(json_out, data))
                console.print(f"JSON: {json_out}")
            if out_dir and not no_plots:
                files = plot_results(results, metrics, bounds, out_dir, on_file=written.append)
                console.print("plots: " + ", ".join(str(f) for f in files))
            if out_dir:
                files = write_job_tables(results, out_dir)
                written += files
                console.print("per-job CSV: " + ", ".join(str(f) for f in files))
        except OSError as exc:  # (was a traceback: a plot's name taken by a directory, a full disk)
            raise unwritable_result(exc, written) from None
        except KeyboardInterrupt:
            left = [f"the {what}" for what, todo in (("JSON", json_out and json_out not in written),
                                                     ("plots", out_dir and not no_plots), ("per-job CSVs", out_dir)) if todo]
            raise interrupted(written, left[-2:] if written else left) from None
        if out_dir:
            # files of an earlier run's output set that this run did not write (jobs-sjf.csv when sjf is no longer
            # compared, dsr_by_class.png when no job has a deadline now) sat beside these results without a word.
            # Named, not removed: a user may gather one policy per run in one directory
            left = earlier_outputs(out_dir, written, plots=True)
            if left:
                console.print(f"[yellow]note:[/] {out_dir} also holds {len(left)} file(s) of an earlier run that this run did not "
                              f"write: {', '.join(f.name for f in left)}; they are not this run's results"
                              + (" (--no-plots made no plots)" if no_plots and any(f.suffix == ".png" for f in left) else ""),
                              highlight=False)
        if replaced_runs:
            console.print(f"[yellow]note:[/] {out_dir} also holds {', '.join(p.name for p in replaced_runs)}, the results of another "
                          f"run whose plots and per-job CSVs went to {out_dir} too: those there now are this run's ({json_out.name}). "
                          "Give each run its own --out (e.g. --out " + str(json_out.with_suffix("")) + ") to keep them apart.",
                          highlight=False)
        if out_dir is None:  # the README's first example wrote nothing, and said nothing of the files it can write
            console.print("nothing written: --json FILE keeps these results, --out DIR the PNG plots and the per-job CSVs",
                          style="dim", highlight=False)
        if failed:
            raise SimulationError(
                f"{len(failed)} run(s) failed: {', '.join(failed)}; the others' results are above"
                + (" and in the JSON ('failed_policies')" if json_out else "")
            )


#: the columns of the results table that go into its first part on a terminal too narrow for the whole table
MAIN_FIRST = ("DSR", "avg JCT", "p99 JCT", "avg queue", "GPU alloc")


def _n(count: int, noun: str) -> str:
    """'1 node', '8 nodes' (was '1 nodes, 1 GPUs' on --cluster 1x1)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


#: rejected jobs listed one by one before the rest are counted
REJECTED_SHOWN = 10


def _rejection_kind(why: str) -> str:
    """A rejection's reason without its particulars (numbers, quoted names, the line): the reasons of one kind,
    e.g. 'asks for 16 GPUs; the cluster has 12' and '... 8 GPUs; ... 12', read alike."""
    import re

    return re.sub(r"'[^']*'|\d+(?:[.:]\d+)*", "#", why)


def _rejected_to_show(rejected: list[tuple[str, str]], most: int = REJECTED_SHOWN) -> tuple[list[tuple[str, str]], int]:
    """The rejected jobs to list: the first of each kind of reason first (in trace order), then the next ones,
    up to `most`; and how many kinds of reason none of those shown has. In trace order the ten lines were all
    one reason (Pending pods) while the job rejected for a GPU model no node has came eleventh, unsaid."""
    firsts: dict[str, int] = {}
    for i, (_, why) in enumerate(rejected):
        firsts.setdefault(_rejection_kind(why), i)
    picked = sorted(list(firsts.values())[:most])
    rest = [i for i in range(len(rejected)) if i not in set(picked)][: most - len(picked)]
    order = sorted(picked + rest)
    return [rejected[i] for i in order], max(0, len(firsts) - most)


def _parse_users(given: str, trace: str, fmt: str | None) -> int | list[float]:
    """--users: a number of users (Zipf-like shares) or their comma-separated shares, for the synthetic
    workload only (checked before it is generated, as --jobs)."""
    import math

    from qosflow.errors import SpecError
    from qosflow.sim.runner import guess_format

    text = given.strip()
    if str(fmt or guess_format(trace)).strip().lower() != "synthetic":
        raise SpecError("--users", f"only the synthetic workload is given users; the Muri, Gavel and Alibaba traces name "
                                   f"none, so the jobs of {trace} are all one user: leave --users out, or use --trace synthetic")
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise SpecError("--users", f"must be at least 1 user, got {given!r}")
        return n
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        shares = []
    if not shares or any(not math.isfinite(x) or x <= 0 for x in shares):
        raise SpecError("--users", f"give a number of users (3) or their shares of the jobs, positive and comma-separated "
                                   f"(0.6,0.2,0.2), got {given!r}")
    return shares


def _unknown_models(jobs, speed) -> dict[str, int]:
    """Model name -> jobs, for the jobs whose model neither Gavel's table (when loaded) nor SJF-BSBF's memory
    profile knows: such a job ran on assumed figures without a word (a user's own 'llama-7b')."""
    from qosflow.sim.interference import gpu_mem_mb

    table = speed.interference
    resolve = getattr(table, "resolve", None)
    out: dict[str, int] = {}
    for j in jobs:
        m = j.model
        if not m:
            continue
        known = (resolve(m) is not None) if resolve is not None else gpu_mem_mb(m) is not None
        if not known:
            out[m] = out.get(m, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))

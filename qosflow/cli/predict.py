"""`qosflow predict eval` (cross-validation on reference tables), `qosflow predict stages` (what the predictor
learned from finished stages), `qosflow predict prune` (retention) and `qosflow profile` (lightweight profiling)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qosflow.cli.output import check_not_an_input
from qosflow.cli.output import check_output_file as _check_output_file
from qosflow.cli.output import progress_bar as _progress_bar
from qosflow.cli.output import write_json_file as _write_json
from qosflow.errors import QosflowError

predict_app = typer.Typer(help="The predictor: evaluate it on reference tables, see what it learned from finished stages, delete old rows.", no_args_is_help=True)


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f} %"


def _print_blocks(result: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("target", "method", "MAPE", "p90 APE", "n"):
        table.add_column(col, justify="right" if col in ("MAPE", "p90 APE", "n") else "left")
    for target in ("solo_scaling", "interference"):
        block = result.get(target)
        if not block:
            continue
        table.add_row(target, "qosflow", _pct(block["mape"]), _pct(block["p90_ape"]), str(block["n"]))
        for g, b in block.get("by_gpus", {}).items():
            table.add_row("", f"  at {g} GPUs", _pct(b["mape"]), _pct(b["p90_ape"]), str(b["n"]))
        for name, b in block.get("baselines", {}).items():
            table.add_row("", f"baseline: {name}", _pct(b["mape"]), _pct(b["p90_ape"]), str(b["n"]))
    from qosflow.cli.output import print_table, result_console

    print_table(result_console(), table, keep=2)  # (split on a terminal too narrow for it)
    block = result.get("interference") or {}
    left_out = [f"{block[k]} {what}" for k, what in (("n_zero_excluded", "zero speeds (could not run together)"),
                                                     ("n_missing_excluded", "empty speed cells (not measured)"))
                if block.get(k)]
    if left_out:
        Console().print("left out of the MAPE: " + ", ".join(left_out))
    if result.get("reference_jobs"):
        Console().print("reference jobs of the profile: " + ", ".join(result["reference_jobs"]))


@predict_app.command("eval")
def eval_cmd(
    throughputs: Optional[Path] = typer.Option(None, "--throughputs", help="Gavel-style throughput JSON: leave-one-job-type-out"),
    pairs: Optional[Path] = typer.Option(None, "--pairs", help="co-location CSV, columns model1, batchsize1, gpu_num1, speed1, model2, batchsize2, gpu_num2, speed2: k-fold"),
    folds: int = typer.Option(5, "--folds", min=2, help="folds for --pairs"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
    seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="seed of the fold split (--pairs) and of the models' randomness"),
) -> None:
    """Cross-validate the predictor on a throughput table or a co-location pair table.

    Give exactly one of --throughputs or --pairs. Prints MAPE and 90th-percentile error next to simple
    baselines (a constant, a random forest); details: docs/predictor.md.

    Examples:

      qosflow predict eval --json out/pred.json \\
          --throughputs ../shared/data/throughputs/gavel_simulation_throughputs.json

      qosflow predict eval --pairs pairs.csv --folds 5 --json out/pairs.json
    """
    from qosflow.predict import evaluate
    from qosflow.predict.reference import ThroughputTable, read_pairs_csv

    if (throughputs is None) == (pairs is None):
        raise QosflowError("give exactly one of --throughputs FILE or --pairs CSV")
    if throughputs is not None and folds != 5:  # was dropped without a word
        typer.secho(f"warning: --folds {folds} is for --pairs; a throughput table is cross-validated leaving one job "
                    "type out at a time", err=True, fg="yellow")
    if json_out is not None:
        _check_output_file(json_out)
        check_not_an_input(json_out, {"--throughputs": throughputs, "--pairs": pairs})
    with _progress_bar() as bar:
        if throughputs is not None:
            table = ThroughputTable.load(throughputs)
            nothing = QosflowError(
                f"{throughputs}: nothing to cross-validate in its {len(table.jobs)} job type(s): leave-one-job-type-out "
                "predicts a held-out job type's multi-GPU throughputs and co-located speeds from the other types', "
                "so the table needs at least two job types with such measurements (2/4/8-GPU entries or co-runner "
                "pairs on the same worker type)")
            if len(table.jobs) < 2:
                raise nothing
            folds_total = len(table.jobs) * (1 + len(table.pair_speed))
            task = bar.add_task("leave-one-job-type-out", total=folds_total)
            result = evaluate.eval_throughputs(table, seed=seed, progress=lambda: bar.advance(task))
            if not result["n"]:  # was a table of dashes and exit 0
                if result["interference"].get("untrained_folds"):  # pairs there, but only among reference jobs
                    raise QosflowError(
                        f"{throughputs}: nothing to cross-validate: its co-runner pairs are all among the profile's "
                        f"reference jobs ({', '.join(result['reference_jobs'])}), and a held-out job type's co-located "
                        "speeds are learned from the other, non-reference types; give pairs of at least "
                        f"{len(result['reference_jobs']) + 2} job types (or 2/4/8-GPU entries of at least two)")
                raise nothing
            title = f"leave-one-job-type-out on {throughputs.name}"
        else:
            rows = read_pairs_csv(pairs)
            _warn_slowdowns(pairs, rows)
            task = bar.add_task(f"{folds}-fold cross-validation", total=folds)
            result = evaluate.eval_pairs(rows, folds=folds, seed=seed, progress=lambda: bar.advance(task), source=str(pairs))
            title = f"{folds}-fold cross-validation on {pairs.name} ({len(rows)} pairs)"
    _print_blocks(result, title)
    if json_out is not None:
        _write_json(json_out, result)
        typer.echo(f"wrote {json_out}")


#: a speed (co-located over solo throughput) above this is no measurement noise: a slowdown (solo over
#: co-located, 1.8 for 0.56) written in its place, which the evaluation would take as a speed-up
SLOWDOWN_LIKE = 1.2


def _warn_slowdowns(path: Path, rows) -> None:
    """Warn when a pair table's speeds look like slowdowns (> 1.2: faster next to a partner than alone)."""
    high = [(r.line, col, v) for r in rows for col, v in (("speed1", r.speed1), ("speed2", r.speed2))
            if v is not None and v > SLOWDOWN_LIKE]
    if high:
        where = ", ".join(f"line {ln} {col} {v:g}" for ln, col, v in high[:3]) + (", ..." if len(high) > 3 else "")
        typer.secho(f"warning: {path}: {len(high)} speed(s) above {SLOWDOWN_LIKE:g} ({where}): a speed is the throughput "
                    "next to the partner over the throughput alone (0.85: 15 % slower), so above 1 the job ran faster "
                    "shared. If these are slowdowns (alone / shared), give 1/x instead", err=True, fg="yellow")


@predict_app.command("stages")
def stages_cmd(
    signature: Optional[str] = typer.Option(None, "--signature", help="one stage signature only (as the table shows it)"),
    db: Optional[str] = typer.Option(None, "--db", help="database URL, sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (default: $QOSFLOW_DATABASE_URL or the SQLite file in $QOSFLOW_HOME)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the rows here"),
) -> None:
    """What the predictor has learned from finished stages, per stage signature.

    Reads the qosflow store a worker writes to (its default estimator, `learned`): runs and durations,
    the duration it would predict now from them and on what basis (a stage that declares an
    expected_duration has it blended in as a prior), how far the predictions the stages were scheduled
    on were off (MAPE), and how many step-time samples it has: solo, shared with another stage, and from
    `qosflow profile` (a signature only profiled so far is listed too).

    Examples:

      qosflow predict stages

      qosflow predict stages --db postgresql+psycopg://qosflow:secret@db/qosflow --json stages.json
    """
    from rich.console import Console
    from rich.table import Table

    from qosflow.predict.stage_report import stage_report
    from qosflow.store import Store

    if json_out is not None:
        _check_output_file(json_out)
        check_not_an_input(json_out, {"--db": _sqlite_file(db)})  # the store a worker writes to
    _refuse_in_memory(db)
    if _no_default_store(db, json_out):  # `qosflow predict stages` on a machine where no worker has run yet
        return
    store = Store.open(db, must_exist=True)
    try:
        rows = stage_report(store, signature=signature)
        where = store.safe_url
        # a signature not in the store: the ones it has (the table's), to say which was meant
        # (with those only `qosflow profile` measured, which the table lists too: were left out, so a profiled
        # stage's signature without its /bsN got "no completed run ... yet" and no hint)
        known = sorted({h.signature for h in store.history_rows("signature", state="COMPLETED") if h.signature}
                       | {s.signature for s in store.sample_rows("signature", "source") if s.source == "profile"}) \
            if signature and not rows else []
    finally:
        store.close()
    console = Console()
    if not rows:
        what = f"signature {signature!r}" if signature else "any stage"
        if known:
            from qosflow.errors import closest_name

            # those it begins (the batch size a @qos_task's signature carries is easy to leave out:
            # MODULE.FUNCTION/bsN), else the closest
            # MODULE:FUNCTION (what `qosflow profile` takes) is stored as MODULE.FUNCTION
            dotted = signature.replace(":", ".")
            near = [dotted] if dotted in known else \
                [k for k in known if k.startswith(signature) or k.startswith(dotted)] \
                or [k for k in [closest_name(dotted, known)] if k]
            meant = (f"did you mean {' or '.join(repr(k) for k in near[:3])}?" if near
                     else f"it has {len(known)} other signature(s): `qosflow predict stages` without --signature lists them")
            console.print(f"no completed run of {what} in {where}; {meant}", style="yellow", highlight=False)
        else:
            console.print(f"no completed run of {what} in {where} yet: stages are recorded by a qosflow worker with the "
                          "learned estimator (the QoSPolicy block's default); `qosflow profile` adds step-time samples",
                          style="yellow")
    else:
        from rich import box

        table = Table(title=f"what the predictor learned from finished stages\n({where})", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("stage signature", "runs", "predicts", "basis", "MAPE", "samples"):
            table.add_column(col, justify="left" if col in ("stage signature", "basis") else "right",
                             no_wrap=col == "stage signature",
                             overflow="fold" if col == "basis" else "ellipsis")  # not 'declared+his…' at 80 columns
        for r in rows:
            mape = "-" if r["mape"] is None else f"{100 * r['mape']:.0f} %"
            table.add_row(r["signature"], str(r["runs"]), "-" if r["predicts_s"] is None else f"{r['predicts_s']:.1f} s",
                          # 'declared + history(n=2)': wrapped at a space, not as 'declared+his' / 'tory(n=2)'
                          r["basis"].replace("+", " + "), mape, f"{r['solo_samples']}+{r['shared_samples']}+{r['profiled_samples']}")
        console.print(table)
        console.print("predicts: the duration planned with now (its 80 % band and the runs' last and median durations "
                      "are in --json); MAPE: error of the predictions the runs were scheduled on (how many: in --json); samples: step-time "
                      "samples solo + shared with another stage + from `qosflow profile`")
    if json_out is not None:
        _write_json(json_out, rows)
        console.print(f"wrote {json_out}")


@predict_app.command("prune")
def prune_cmd(
    older_than: str = typer.Option(..., "--older-than", metavar="AGE", help="delete what is older than this: a number and a unit, s, m or min (minutes), h, d, w or y (365 days), e.g. 90d, 12w, 1d12h, '90 days'; at least 1h"),
    keep_samples: int = typer.Option(50, "--keep-samples", min=3, help="of older step-time samples, keep each configuration's (signature, GPU model, GPUs, placement, CPU cores, co-runner, source) this many most recent (at least 3: the predictor answers from a configuration's own samples from 3 on)"),
    keep_runs: int = typer.Option(50, "--keep-runs", min=3, help="of older stage-history rows, keep each (signature, GPU model, GPUs, state) this many most recent runs, with their predictions and outcomes"),
    dry_run: bool = typer.Option(False, "--dry-run", help="count what would be deleted, delete nothing"),
    vacuum: bool = typer.Option(False, "--vacuum", help="SQLite: rewrite the file afterwards so that it shrinks (locks the database meanwhile, needs free disk space of the file's size); PostgreSQL: VACUUM ANALYZE (space reused, files keep their size)"),
    db: Optional[str] = typer.Option(None, "--db", help="database URL, sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (default: $QOSFLOW_DATABASE_URL or the SQLite file in $QOSFLOW_HOME)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the counts here"),
) -> None:
    """Delete the store's old rows, keeping what the predictor learns from.

    Every finished stage adds a step-time sample, a stage-history row, the duration prediction it was
    planned on and its outcome; nothing else deletes them. Of the rows older than --older-than:

    \b
    - samples: each configuration keeps its --keep-samples most recent, however old (no configuration or signature loses its last samples: the predictor answers for all it answered for before);
    - stage history: each signature, GPU model and GPU count keeps its --keep-runs most recent runs (the durations the worker plans with);
    - predictions and outcomes: deleted, except those of the runs kept;
    - profiles (`qosflow profile`): kept.

    Safe while a worker writes: deletes go in short transactions. A running worker keeps what it loaded;
    the next start loads the thinned store. Prints a table per table: rows before, deleted, old rows kept.

    Examples:

      qosflow predict prune --older-than 90d --dry-run

      qosflow predict prune --older-than 1y --keep-samples 20 --vacuum
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from qosflow.store import Store
    from qosflow.store.store import parse_age

    age = parse_age(older_than, "--older-than")
    if json_out is not None:
        _check_output_file(json_out)
        check_not_an_input(json_out, {"--db": _sqlite_file(db)})
    _refuse_in_memory(db)
    store = Store.open(db, must_exist=True)
    try:
        rep = store.prune(age, keep_samples=keep_samples, keep_runs=keep_runs, dry_run=dry_run,
                          vacuum=vacuum and not dry_run)
        where = store.safe_url
    finally:
        store.close()
    console = Console()
    verb = "would delete" if dry_run else "deleted"
    table = Table(title=f"{'dry run: ' if dry_run else ''}rows older than {older_than.strip()} "
                        f"(before {rep.cutoff:%Y-%m-%d %H:%M} UTC)\n({where})", box=box.SIMPLE_HEAD)
    for c in ("table", "rows", verb, "old rows kept", "left"):
        table.add_column(c, justify="left" if c == "table" else "right")
    for name in ("sample", "stage_history", "prediction", "outcome"):
        n, d = rep.before.get(name, 0), rep.deleted.get(name, 0)
        table.add_row(name, str(n), str(d), str(rep.kept_old.get(name, 0)), str(n - d))
    console.print(table)
    console.print(f"old rows kept: samples, each configuration's {keep_samples} most recent; stage history, each "
                  f"signature's, GPU model's and GPU count's {keep_runs} most recent runs; predictions and outcomes "
                  "of those runs", highlight=False)
    if dry_run:
        console.print("dry run: nothing was deleted", style="yellow")
        if vacuum:
            console.print("--vacuum is ignored with --dry-run", style="yellow")
    if rep.file_bytes:
        a, b = rep.file_bytes
        console.print(f"VACUUM: the file went from {a / 2**20:.1f} MiB to {b / 2**20:.1f} MiB", highlight=False)
    elif not dry_run and not vacuum and store.dialect == "sqlite" and sum(rep.deleted.values()):
        console.print("the freed pages are reused by new rows; the file shrinks only with --vacuum", highlight=False)
    if rep.note:
        console.print(rep.note, highlight=False)
    if json_out is not None:
        _write_json(json_out, rep.to_dict())
        console.print(f"wrote {json_out}")


def profile_cmd(
    target: str = typer.Argument(..., help="MODULE:FUNCTION of the stage to profile"),
    steps: int = typer.Option(20, "--steps", min=1, help="steps to measure per configuration (after one warm-up step)"),
    cores: Optional[str] = typer.Option(None, "--cores", help="comma-separated CPU core counts (default: half and all)"),
    budget: float = typer.Option(60.0, "--budget", help="seconds per configuration at most (> 0); the function is stopped then"),
    signature: Optional[str] = typer.Option(None, "--signature", help="job signature to store the samples under (default: the one the worker gives the stage, MODULE.FUNCTION, plus /bsN for a @qos_task with a batch_size)"),
    db: Optional[str] = typer.Option(None, "--db", help="database URL, sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (default: $QOSFLOW_DATABASE_URL or the SQLite file in $QOSFLOW_HOME)"),
    no_store: bool = typer.Option(False, "--no-store", help="measure only, store nothing"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the measurements here"),
) -> None:
    """Run a stage function briefly at one or two configurations and store its step times.

    TARGET is MODULE:FUNCTION, imported with the current directory on the path and called with no arguments (or steps=N+1, the warm-up step and the N measured, if it takes `steps`, `max_steps` or `num_steps`). It must report its steps with qosflow.track(iterable) or qosflow.report_progress(step, total); step 1 is a warm-up, the next N are measured. The function and anything it started are stopped after N steps or --budget seconds. Without a GPU this says so and measures CPU time only. Exits 1 when no step could be measured.

    Examples:

      qosflow profile mytrain:train --steps 10

      qosflow profile mytrain:train --cores 1,4 --budget 120 --json out/profile.json

    A stage that takes arguments without defaults: profile a small function that builds them and calls the stage's
    function, with --signature as `qosflow predict stages` names the stage (docs/predictor.md).
    """
    from rich.console import Console
    from rich.table import Table

    from qosflow.errors import SpecError
    from qosflow.predict.profiler import check_core_counts, profile

    core_list = None
    if cores:
        try:
            core_list = [int(c) for c in cores.split(",") if c.strip()]
        except ValueError:
            raise SpecError("--cores", f"{cores!r} is not a comma-separated list of integers") from None
        check_core_counts(core_list, "--cores")
    if not 0 < budget < float("inf"):
        raise SpecError("--budget", f"must be a finite number of seconds > 0, got {budget:g}")
    if signature is not None and not signature.strip():  # '  ' failed after the measurements ('sample 0: ...')
        raise SpecError("--signature", f"{signature!r} is empty; give the stage's signature (as `qosflow predict stages` "
                                       "shows it), or leave --signature out for the one the worker gives the stage")
    if signature is not None and not no_store:  # what the store refuses, refused before the measurements
        from qosflow.store.store import validate_sample

        validate_sample({"signature": signature, "step_time_s": 1.0}, where="--signature")
    if json_out is not None:
        _check_output_file(json_out)
        check_not_an_input(json_out, {"TARGET module": _module_file(target), "--db": None if no_store else _sqlite_file(db)})
    store = None
    if not no_store:
        from qosflow.store import Store

        _refuse_in_memory(db)
        _refuse_misread_absolute_path(db)
        store = Store.open(db)
    console = Console()
    from qosflow.predict.profiler import default_core_counts

    plan = core_list or default_core_counts()
    # (it printed nothing for up to --budget seconds per configuration, two minutes by default)
    console.print(f"profiling {target} at {' and '.join(map(str, plan))} CPU core{'s' if plan != [1] else ''}: {steps} "
                  f"step{'s' if steps > 1 else ''} after a warm-up step, at most {budget:g} s"
                  + (f" each ({_dur_text(budget * len(plan))} in all)" if len(plan) > 1 else ""), highlight=False)
    try:
        with console.status(f"running {target}..."):  # (a spinner in a terminal only)
            res = profile(target, steps, cores=core_list, budget_s=budget, signature=signature, store=store)
    finally:
        if store is not None:
            store.close()
    console.print(res.gpu.message, style="yellow" if not res.gpu.present else None)
    table = Table(title=f"profile of {res.signature}")
    # without a GPU (said on the line above) the GPU columns are left out: two columns of "n/a (no GPU)"
    # made the table wrap its headers and cut "finished" to "finish…" at 100 columns
    # (and the GPUs column, all 0: at 80 columns the stopped reason was cut to "10 steps reac…")
    gpu_cols = ("GPU util", "GPU mem") if res.gpu.present else ()
    gpus_col = ("GPUs",) if res.gpu.present else ()
    for col in ("CPU cores", *gpus_col, "steps", "step time", "sd", "CPU time", "wall", *gpu_cols, "stopped"):
        table.add_column(col, no_wrap=col != "stopped")
    for c in res.configs:
        gpu_cells = (
            "-" if c.gpu_util_pct is None else f"{c.gpu_util_pct:.0f} %",
            "-" if c.gpu_mem_mb is None else f"{c.gpu_mem_mb:.0f} MiB",
        ) if res.gpu.present else ()
        table.add_row(
            str(c.cpu_cores), *((str(c.gpus),) if res.gpu.present else ()), str(c.steps),
            "-" if c.step_time_s is None else f"{c.step_time_s * 1e3:.2f} ms",
            "-" if c.step_time_sd_s is None else f"{c.step_time_sd_s * 1e3:.2f} ms",
            f"{c.cpu_time_s:.2f} s", f"{c.wall_s:.2f} s",
            *gpu_cells,
            c.stopped,
        )
    console.print(table)
    # "CPU time 1.72 s" next to 5 steps of 12 ms read as the steps' cost; it is mostly Python starting up
    console.print("CPU time and wall: the whole run of the function's process, with Python's start-up, the imports "
                  "and the warm-up step, and the processes it started; step time and sd: the measured steps only")
    for c in res.configs:  # a busy machine: on 2 shared cores a CNN's 2-core steps took 4-30 times its 1-core ones
        if c.steps and c.others_busy_pct is not None and c.others_busy_pct >= BUSY_WARN_PCT:
            cores = "its core" if c.cpu_cores == 1 else f"its {c.cpu_cores} cores"
            console.print(f"during the {c.cpu_cores}-core run other processes kept {cores} {c.others_busy_pct:.0f} % "
                          "busy: its step times include waiting for them (they are stored as measured); profile "
                          "again when the machine is idle for the stage's own speed",
                          style="yellow", highlight=False)
    if any(c.steps == 0 for c in res.configs):
        # step 1 is the warm-up: a step time needs the end of step 2 (and step 1's start or end)
        budget_hit = any(c.steps == 0 and c.stopped.startswith("budget") for c in res.configs)
        console.print(
            "no steps were reported" + (f" within the budget ({budget:g} s per configuration)" if budget_hit else "")
            + ": call qosflow.track(...) or qosflow.report_progress(step, total) in the function; a step time needs "
            "the warm-up step and at least one more" + ("; or raise --budget" if budget_hit else ""),
            style="red")
    if store is not None and res.store_error is None:
        console.print(f"stored {res.stored_samples} samples in {res.database}")
    if json_out is not None:
        _write_json(json_out, res.to_dict())
        console.print(f"wrote {json_out}")
    if res.store_error is not None:
        raise QosflowError(f"{res.store_error}; the measurements are above{' and in ' + str(json_out) if json_out else ''}: "
                           "make the database reachable and writable, then run the profile again")
    if not any(c.steps for c in res.configs):
        raise typer.Exit(1)


#: `qosflow profile` warns when other processes kept the pinned cores at least this busy (per cent)
BUSY_WARN_PCT = 25


def register(app: typer.Typer) -> None:
    app.add_typer(predict_app, name="predict")
    app.command("profile")(profile_cmd)


def _sqlite_file(db: str | None) -> str | None:
    """The file of the store `Store.open(db)` opens, when it is SQLite (None for PostgreSQL or a bad URL,
    which Store.open reports). Only the URL is read: nothing is opened."""
    import os

    if not db:
        db = os.environ.get("QOSFLOW_DATABASE_URL")
        if not db:
            home = os.environ.get("QOSFLOW_HOME")
            return os.path.join(home, "qosflow.db") if home else None  # the user's data directory: not a --json typo
    from qosflow.store.store import sqlite_file

    return sqlite_file(db)


def _no_default_store(db: str | None, json_out: Path | None) -> bool:
    """No --db, no $QOSFLOW_DATABASE_URL and no store at the default place: nothing has been learned on this
    machine yet. Said as such (exit 0, an empty --json), as the README's `qosflow predict stages` is met on a new
    install: it was 'error: no qosflow database at ..., so nothing to read' (exit 2), as for a mistyped --db."""
    import os

    if db or os.environ.get("QOSFLOW_DATABASE_URL"):
        return False
    from qosflow.store.store import default_url, sqlite_file

    path = sqlite_file(default_url())
    if not path or os.path.exists(path):
        return False
    typer.secho(f"nothing learned yet: no qosflow worker has recorded a stage on this machine (no store at {path}, "
                "the default: QOSFLOW_HOME's qosflow.db). Stages run on a qosflow pool (`qosflow worker start`, or "
                "`qosflow demo`, which names its own store at its end) are recorded there, and `qosflow profile` adds "
                "step-time samples; --db URL (or QOSFLOW_DATABASE_URL) reads the store of a worker elsewhere", fg="yellow")
    if json_out is not None:
        _write_json(json_out, [])
        typer.echo(f"wrote {json_out}")
    return True


def _dur_text(seconds: float) -> str:
    return f"{seconds:g} s" if seconds < 120 else f"{seconds / 60:.3g} min"


def _refuse_misread_absolute_path(db: str | None) -> None:
    """`--db sqlite:///tmp/q/x.db` (three slashes) is the relative path tmp/q/x.db: `qosflow profile` created
    ./tmp/q/ and stored its samples there, where no worker reads them, while the user meant /tmp/q/x.db. A relative
    path whose first directory is not here but is at the root (/tmp, /home, /srv) is refused, with the four-slash
    spelling; a relative path that is really meant can be written ./tmp/... or its directory made first."""
    from pathlib import Path

    from qosflow.errors import SpecError

    if not db:
        return
    f = _sqlite_file(db)
    if not f:
        return
    p = Path(f)
    if p.is_absolute() or str(f).startswith(".") or p.exists() or len(p.parts) < 2:
        return
    first = p.parts[0]
    if not Path(first).exists() and (Path("/") / first).is_dir():
        raise SpecError("--db", f"{db!r} is the relative path {p} under {Path.cwd()} (sqlite:/// with three slashes, then the "
                                f"path), and {first}/ is not there: for /{p} write sqlite:////{p} (four slashes); for a new "
                                f"directory here write sqlite:///./{p}")


def _refuse_in_memory(db: str | None) -> None:
    """A SQLite URL without a file (sqlite://, sqlite:///:memory:) is a database that ends with this command:
    `qosflow profile` said "stored 2 samples in sqlite://" and they were gone, `predict stages` showed an
    empty store. Nothing else reads such a database, so it is refused, naming where the URL came from."""
    import os

    from qosflow.errors import SpecError

    url, option = db, "--db"
    if not url:
        url, option = os.environ.get("QOSFLOW_DATABASE_URL"), "$QOSFLOW_DATABASE_URL"
    if not url or not url.strip().lower().startswith("sqlite"):
        return
    url = url.strip()
    path = url.split("///", 1)[1] if "///" in url else url.split("://", 1)[-1]
    if path in ("", ":memory:") or path.startswith(":memory:?"):
        raise SpecError(option, f"{url!r} is an in-memory SQLite database: it holds nothing a worker or `qosflow "
                                "profile` stored, and what this command stores there is gone when it ends; give a "
                                "file, sqlite:////ABSOLUTE/PATH/qosflow.db, or leave the URL out for the qosflow.db in "
                                "$QOSFLOW_HOME")


def _module_file(target: str) -> str | None:
    """The source file of TARGET's module in the current directory (MODULE:FUNCTION, imported from there),
    if there is one; found by its path, nothing is imported."""
    import os

    mod = target.split(":", 1)[0].strip()
    if not mod:
        return None
    base = os.path.join(os.getcwd(), *mod.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None

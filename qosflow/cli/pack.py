"""`qosflow pack`: the GPU-sharing packing experiment of FGD (USENIX ATC'23) on a pod/node list."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Pack GPU-sharing pods onto a node list and compare placement policies (FGD, ATC'23).

Pods arrive in a seeded random order (the list shuffled, then drawn with replacement) until the
GPU requested reaches --ratio (130 %) of the cluster's GPUs; a pod that fits nowhere fails. The
headline is the share of GPUs allocated when the arrived requests equal 100 % of capacity,
averaged over seeds --seed .. --seed+--seeds-1. Prints a table; writes --json, plus the curve
(allocation vs arrived demand) as pack_curve.csv and pack_curve.png into --out (default: next to
the JSON). Defaults read the Alibaba v2023 lists in ../shared/data/traces/.

Lists of your own: pods (--pods) with columns name, cpu_milli, memory_mib, num_gpu, gpu_milli (per GPU:
1000 is a whole GPU, less a share of one) and optionally gpu_spec (accepted GPU models, A|B); nodes
(--nodes) with sn, cpu_milli, memory_mib, gpu, model. Details: docs/packing.md.

Examples:

  qosflow pack --seeds 1

  qosflow pack --policies best-fit,fgd,qosflow --json out/pack.json
"""


def register(app: typer.Typer) -> None:
    @app.command("pack", help=HELP)
    def pack_cmd(
        pods: Optional[Path] = typer.Option(None, "--pods", help="pod list CSV (default: the shared Alibaba openb default list)"),
        nodes: Optional[Path] = typer.Option(None, "--nodes", help="node list CSV (default: the shared Alibaba GPU node list)"),
        policies: str = typer.Option("first-fit,best-fit,fgd,qosflow", "--policies", help="comma-separated: first-fit, best-fit, fgd, qosflow, random"),
        seed: int = typer.Option(42, "--seed", min=0, help="first seed (the FGD paper uses 42..51)"),
        seeds: int = typer.Option(10, "--seeds", help="number of seeds to average over"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write the results as JSON here"),
        out: Optional[Path] = typer.Option(None, "--out", help="directory for pack_curve.csv/.png (default: next to --json)"),
        ratio: float = typer.Option(1.3, "--ratio", help="stop arrivals when the GPU requested reaches this share of capacity (1 to 10)"),
        popularity: float = typer.Option(0.95, "--popularity", help="FGD target workload: the most frequent pod types covering this share of pods"),
        no_plots: bool = typer.Option(False, "--no-plots", help="skip the PNG plot"),
        parallel: Optional[int] = typer.Option(None, "--parallel", help="runs (policy x seed) at once, each in a process of its own (default: one per CPU core, at most one per run, except for small experiments: under 20,000 pods x runs they run in this process; 1: one after another in this process). Results are the same either way"),
    ) -> None:
        import math

        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from qosflow.errors import SpecError
        from qosflow.packing.experiment import SMALL_EXPERIMENT, run_experiment
        from qosflow.workers import default_workers
        from qosflow.packing.model import PackState, never_fitting, nodes_from_records, pods_from_records, spell_models_as_nodes
        from qosflow.packing.policies import make_policy
        from qosflow.packing.report import summaries_to_json, write_curve_csv, write_curve_png
        from qosflow.sim.traces.alibaba import default_node_list, default_pod_list, load_nodes, load_pods

        from qosflow.cli.output import (check_file_and_dir, check_not_an_input, check_output_dir, check_output_file, interrupted,
                                        print_table, progress_bar, result_console, unwritable_result, write_json_file)

        console = result_console()
        check_file_and_dir(json_out, out)
        if json_out is not None:
            check_output_file(json_out)
        if out is not None:
            check_output_dir(out)
        # one run per policy: "fgd,FGD" ran FGD twice, as two rows of the table
        names = list(dict.fromkeys(p.strip().lower() for p in policies.split(",") if p.strip()))
        if not names:
            raise SpecError("--policies", "give at least one policy, e.g. first-fit,best-fit,fgd")
        for name in names:
            make_policy(name)  # UnknownNameError lists the known names
        if seeds < 1:
            raise SpecError("--seeds", f"must be >= 1, got {seeds}")
        if parallel is not None and parallel < 1:
            raise SpecError("--parallel", f"must be at least 1 (1: one run after another), got {parallel}")
        if not 1 <= ratio <= 10:
            # the headline is read at 100 % arrived demand: arrivals stopped below it never reach it
            raise SpecError("--ratio", f"must be in [1, 10] (the headline is read at 100 % arrived demand), got {ratio}")
        if not 0 < popularity <= 1:
            raise SpecError("--popularity", f"must be in (0, 1], got {popularity}")
        pods_path = pods or default_pod_list()
        nodes_path = nodes or default_node_list()
        check_not_an_input(json_out, {"--pods": pods_path, "--nodes": nodes_path})
        for given, path, opt, what in ((pods, pods_path, "--pods", "pod list"), (nodes, nodes_path, "--nodes", "node list")):
            if given is None and not path.exists():  # was "...: pod list file not found", with no hint where it is read from
                from qosflow.errors import QosflowError

                raise QosflowError(
                    f"{path}: the default {what} (Alibaba v2023, shared data) is not there: give {opt} FILE, or point "
                    f"QOSFLOW_SHARED_DATA at the directory that holds traces/{path.name}")
        node_list = nodes_from_records(load_nodes(nodes_path))
        # 't4' in the pod list for the nodes' 'T4': the same model, as simulate takes it
        pod_list = spell_models_as_nodes(pods_from_records(load_pods(pods_path)), node_list)
        empty = PackState(node_list)
        total_gpus = empty.total_gpus
        if total_gpus == 0:
            raise SpecError("--nodes", f"{nodes_path} has no GPUs; the packing experiment needs GPU nodes")
        never = never_fitting(pod_list, empty)
        for name, why in never[:5]:
            console.print(f"[yellow]never fits[/] {name}: {why}")
        if never:
            console.print(
                f"[yellow]{len(never)} of {len(pod_list)} pods fit no node of {nodes_path.name} even when it is empty; "
                "they still arrive and fail (their GPU request counts as arrived demand). Drop them from the pod "
                "list, or add nodes that hold them, to measure packing alone"
                + (" (the first 5 are above; " if len(never) > 5 else " (")
                + ("--json lists them all, config.never_fit_pods)" if json_out is None else
                   f"{json_out} lists them all, config.never_fit_pods)") + ".[/]"
            )
        seed_list = list(range(seed, seed + seeds))
        console.print(
            f"[bold]{len(pod_list)} pods[/] ({pods_path.name}) on [bold]{len(node_list)} nodes, {total_gpus} GPUs[/] "
            f"({nodes_path.name}); arrivals up to {ratio:.0%} of capacity; "
            + (f"seed {seed}" if seeds == 1 else f"seeds {seed_list[0]}..{seed_list[-1]}")
        )
        runs = len(seed_list) * len(names)
        # about 1.3 x the pods arrive per run (the list, then draws, up to --ratio of capacity)
        workers = parallel if parallel is not None else default_workers(runs, len(pod_list), SMALL_EXPERIMENT)
        progress = progress_bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        task = progress.add_task("packing", total=runs)

        def on_run(run) -> None:
            progress.update(task, advance=1, description=f"{run.policy} seed {run.seed}")

        out_dir = out if out is not None else (json_out.parent if json_out is not None else None)
        try:
            # the bar (and its redraw thread) starts once the workers have started: see qosflow.workers
            summaries = run_experiment(pod_list, node_list, names, seed_list, ratio=ratio, popularity=popularity,
                                       on_start=progress.start, on_run=on_run, workers=workers)
        except KeyboardInterrupt:  # was the end of the command without a word (exit 130)
            raise interrupted([], [str(p) for p in (json_out, out_dir) if p is not None]) from None
        finally:
            progress.stop()

        data = summaries_to_json(
            summaries,
            {
                "pods": str(pods_path),
                "nodes": str(nodes_path),
                "num_pods": len(pod_list),
                "num_nodes": len(node_list),
                "total_gpus": total_gpus,
                "seeds": seed_list,
                "ratio": ratio,
                "popularity": popularity,
                "never_fit_pods": [{"pod": n, "reason": why} for n, why in never],
                "headline": "share of GPU capacity allocated when the arrived GPU requests equal 100 % of capacity",
                "parallel": workers,
            },
        )
        table = Table(title=f"GPU allocation at 100 % arrived demand (mean of {len(seed_list)} seed{'s' if len(seed_list) > 1 else ''})")
        # "idle GPUs" = unallocated GPUs (idle milli over all GPUs / 1000); "failed" = pods failed up to 100 %
        for col in ("policy", "alloc %", "±std", "alloc GPUs", "idle GPUs", "failed", "s/run"):
            table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
        # GPUs and failures are means over seeds: whole numbers on a large cluster; on a small one, where a
        # fraction of a GPU is a large share, one decimal (7.2 and 6.8 idle GPUs both read "7")
        gpu_fmt = "{:.0f}" if total_gpus >= 100 else "{:.1f}"

        def shown(value, fmt: str, scale: float = 1.0) -> str:
            # a figure no seed has (every seed short of 100 %) is "–", not "nan"
            return fmt.format(value * scale) if value is not None and math.isfinite(value) else "–"

        for name, d in data["policies"].items():
            failed = d["failed_pods"]
            table.add_row(
                name,
                shown(d["alloc_ratio"], "{:.2f}", 100),
                shown(d["alloc_ratio_std"], "{:.2f}", 100) if len(seed_list) - len(d["seeds_short_of_demand"]) > 1 else "–",  # no spread over one seed
                shown(d["allocated_gpus"], gpu_fmt),
                shown(d["unallocated_gpus"], gpu_fmt),
                shown(failed, "{:.0f}" if failed is None or not math.isfinite(failed) or float(failed).is_integer() else "{:.1f}"),
                f"{d['seconds_per_run']:.2f}",
            )
        print_table(console, table, first=("alloc %", "±std", "idle GPUs", "failed"))  # (split on a narrow terminal)
        for name, d in data["policies"].items():
            if len(d["seeds_short_of_demand"]) == len(seed_list):
                console.print(
                    f"[yellow]{name}: the arrived GPU requests never reached 100 % of capacity with seed(s) "
                    f"{', '.join(map(str, d['seeds_short_of_demand']))}, all of them, so there is no figure at 100 % "
                    "('–'; null in the JSON): arrivals stop before the first pod that would take "
                    f"them past --ratio ({ratio:.0%}), and this list's pods are too large a share of this cluster. Give "
                    "more or smaller pods, or a larger --ratio; pack_curve.csv has the allocation up to where arrivals "
                    "stopped.[/]"
                )
            elif d["seeds_short_of_demand"]:
                console.print(
                    f"[yellow]{name}: the arrived GPU requests never reached 100 % of capacity with seed(s) "
                    f"{', '.join(map(str, d['seeds_short_of_demand']))} (pods too large a share of this cluster); "
                    "those seeds are left out of the mean.[/]"
                )

        written: list[Path] = []
        # --json out/a.json, then --json out/b.json: b's curve replaced a's (both next to their JSON) unsaid
        replaced_runs = (_other_pack_results(out_dir, json_out) if out is None and json_out is not None
                         and (out_dir / "pack_curve.csv").is_file() else [])
        try:
            if json_out is not None:
                written.append(write_json_file(json_out, data))
                console.print(f"wrote {json_out}")
            if out_dir is not None:
                written.append(write_curve_csv(out_dir / 'pack_curve.csv', summaries))
                console.print(f"wrote {written[-1]}")
                if not no_plots:
                    written.append(write_curve_png(out_dir / 'pack_curve.png', summaries))
                    console.print(f"wrote {written[-1]}")
        except OSError as exc:
            raise unwritable_result(exc, written) from None
        except KeyboardInterrupt:
            names_left = [str(p) for p in (json_out, out_dir and out_dir / "pack_curve.csv",
                                           out_dir and not no_plots and out_dir / "pack_curve.png") if p and p not in written]
            raise interrupted(written, names_left) from None
        if out_dir is None:
            console.print("nothing written: --json FILE keeps these results, --out DIR the allocation curve "
                          "(pack_curve.csv, pack_curve.png)", style="dim", highlight=False)
        if replaced_runs:
            console.print(f"[yellow]note:[/] {out_dir} also holds {', '.join(p.name for p in replaced_runs)}, the results of "
                          f"another run whose pack_curve.csv/.png went to {out_dir} too: those there now are this run's "
                          f"({json_out.name}). Give each run its own --out (e.g. --out {json_out.with_suffix('')}) to keep "
                          "them apart.", highlight=False)
        if out_dir is not None and no_plots and (out_dir / "pack_curve.png").is_file():
            console.print(f"[yellow]note:[/] {out_dir / 'pack_curve.png'} is an earlier run's plot, not this run's "
                          "(--no-plots made none)", highlight=False)


def _other_pack_results(out_dir: Path, mine: Path) -> list[Path]:
    """The result JSONs of other `qosflow pack` runs in `out_dir` (not `mine`)."""
    import json

    found = []
    for p in sorted(out_dir.glob("*.json")) if out_dir.is_dir() else []:
        if p.resolve() == mine.resolve():
            continue
        try:
            d = json.loads(p.read_text(encoding="utf-8")) if p.stat().st_size < 200_000_000 else None
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and "policies" in d and isinstance(d.get("config"), dict) and "ratio" in d["config"]:
            found.append(p)
    return found

"""Wall time of `qosflow simulate` and `qosflow pack` with their runs in worker processes
(`--parallel`, the default: one per core) against one run after another (`--parallel 1`).

Each command runs as a real CLI process, alternately with and without workers (`--reps` pairs), and
the ratio is taken pair by pair (median): this machine is shared, so only side-by-side ratios mean
anything. The results are checked to be identical (the JSON without the runs' own timings).
Usage: python benchmarks/bench_parallel.py [--reps 3] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, md_table, write_section  # noqa: E402

from qosflow.paths import shared_data  # noqa: E402
from qosflow.workers import cpu_cores  # noqa: E402

TIMING_KEYS = {"sched_seconds", "seconds_per_run", "seconds", "workers", "parallel"}


def _strip(d):
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k not in TIMING_KEYS}
    if isinstance(d, list):
        return [_strip(x) for x in d]
    return d


def _run(args: list[str], out: Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "qosflow", *args, "--no-plots", "--json", str(out)], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    return time.perf_counter() - t0, json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="pairs of runs per command")
    ap.add_argument("--write", action="store_true", help="write docs/bench/parallel.md")
    a = ap.parse_args()
    data = shared_data() / "traces"
    commands = {
        "simulate: Muri trace1, 8 policies": ["simulate", "--trace", str(data / "muri_philly_trace1.csv"),
                                              "--cluster", str(data / "muri_cluster_n8g8.csv")],
        "simulate: synthetic 400 jobs on 8x8, 8 policies": ["simulate", "--trace", "synthetic", "--cluster", "8x8"],
        "pack: Alibaba default lists, 4 policies x 2 seeds": ["pack", "--seeds", "2"],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, args in commands.items():
            walls: dict[str, list[float]] = {"1": [], "auto": []}
            same = True
            for rep in range(a.reps):
                results = {}
                for mode in (("1", "auto") if rep % 2 == 0 else ("auto", "1")):
                    extra = ["--parallel", "1"] if mode == "1" else []
                    wall, res = _run(args + extra, Path(tmp) / f"{mode}.json")
                    walls[mode].append(wall)
                    results[mode] = _strip(res)
                same &= results["1"] == results["auto"]
                print(f"{label}: rep {rep}: one after another {walls['1'][-1]:.1f} s, workers {walls['auto'][-1]:.1f} s", flush=True)
            ratios = [x / y for x, y in zip(walls["1"], walls["auto"])]
            rows.append([label, a.reps, f"{statistics.median(walls['1']):.1f} s", f"{statistics.median(walls['auto']):.1f} s",
                         f"{statistics.median(ratios):.2f} x", "yes" if same else "**NO**"])
    table = md_table(["command", "pairs", "one after another (median)", "worker processes (median)",
                      "speed-up (median of pairwise ratios)", "results identical"], rows)
    text = "\n".join([
        "## Runs in worker processes (`--parallel`)",
        "",
        f"Machine: {machine()}; {cpu_cores()} cores usable, so at most {cpu_cores()} workers.",
        "",
        "Each command as a CLI process, alternately with its default workers (one per core) and with `--parallel 1`;"
        " wall time includes start-up, loading and the report.",
        "",
        table,
    ])
    print(text)
    if a.write:
        print(f"wrote {write_section('parallel', text)}")


if __name__ == "__main__":
    main()

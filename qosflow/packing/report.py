"""Results of the packing experiment as JSON, a curve CSV and a PNG plot.

* JSON: ``{"policies": {"<name>": {"allocated_gpus", "unallocated_gpus", "alloc_ratio",
  "failed_pods", ...}}, "config": {...}}`` at 100 % arrived demand (see
  `PolicySummary.to_dict` for the extra fields: std over seeds, per-seed values, timings);
* CSV: one row per arrived-demand percentage 0..130, columns ``<policy>`` (mean allocation
  ratio in %) and ``<policy>_std``;
* PNG: allocation ratio vs arrived demand, one line per policy (matplotlib, Agg backend).
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from qosflow.packing.experiment import PERCENTS, PolicySummary
from qosflow.sim.files import replacing


def summaries_to_json(summaries: Mapping[str, PolicySummary], config: Mapping[str, Any] | None = None) -> dict:
    return {
        "policies": {name: s.to_dict(100) for name, s in summaries.items()},
        "config": dict(config or {}),
    }


def curve_table(summaries: Mapping[str, PolicySummary]) -> tuple[list[str], list[list[float | int | str]]]:
    """Header and rows: arrived %, then mean and std allocation % per policy."""
    header = ["arrived_pct"]
    cols = []
    for name, s in summaries.items():
        curves = s.curves() * 100.0
        with warnings.catch_warnings():  # all-NaN columns (percentages never reached) stay NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(curves, axis=0)
            std = np.nanstd(curves, axis=0)
        header += [name, f"{name}_std"]
        cols += [mean, std]
    rows = []
    for i, pct in enumerate(PERCENTS):
        row: list[float | int | str] = [int(pct)]
        for c in cols:
            v = float(c[i])
            row.append("" if math.isnan(v) else round(v, 3))
        rows.append(row)
    return header, rows


def write_curve_csv(path: str | Path, summaries: Mapping[str, PolicySummary]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    header, rows = curve_table(summaries)
    with replacing(p) as tmp, open(tmp, "w", newline="") as f:  # whole or not at all (Ctrl-C)
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return p


def write_curve_png(path: str | Path, summaries: Mapping[str, PolicySummary], title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    header, rows = curve_table(summaries)
    x = np.array([r[0] for r in rows], dtype=float)
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for a in (ax, zoom):
        a.plot(x, np.minimum(x, 100), color="0.75", lw=1, ls="--", label="ideal" if a is ax else None)
    marks: list[tuple[float, str]] = []  # (value at 100 %, colour) of each policy
    for name in summaries:
        j = header.index(name)
        y = np.array([np.nan if r[j] == "" else r[j] for r in rows], dtype=float)
        for a in (ax, zoom):
            (line,) = a.plot(x, y, lw=1.6, label=name if a is ax else None)
        at = y[100] if len(y) > 100 else np.nan
        if not np.isnan(at):
            marks.append((float(at), line.get_color()))
    # the values at 100 % arrived, their labels pushed apart where the lines end close together
    # (94.4 and 95.0 were written over each other)
    placed: list[float] = []
    for at, color in sorted(marks):
        y_text = max(at, placed[-1] + 0.9) if placed else at
        placed.append(y_text)
        # in the right margin, joined to the line's value at 100 % by a thin leader
        zoom.annotate(f"{at:.1f}", (100, at), xytext=(131.5, y_text), textcoords="data", fontsize=8, color=color,
                      va="center", annotation_clip=False,
                      arrowprops={"arrowstyle": "-", "color": color, "lw": 0.5, "alpha": 0.6})
    ax.set_xlabel("arrived GPU demand (% of capacity)")
    ax.set_ylabel("GPUs allocated (% of capacity)")
    ax.set_xlim(0, 130)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    zoom.set_xlim(80, 130)
    zoom.set_ylim(80, 100)
    zoom.axvline(100, color="0.6", lw=0.8)
    zoom.grid(alpha=0.3)
    zoom.set_xlabel("arrived GPU demand (%), zoom")
    zoom.set_title("right margin: GPUs allocated at 100 % arrived", fontsize=8)
    n = len(next(iter(summaries.values())).runs) if summaries else 0
    fig.suptitle(title or f"GPU allocation vs arrived demand (mean of {n} seed{'s' if n != 1 else ''})", fontsize=10)
    fig.tight_layout()
    with replacing(p) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)
    return p

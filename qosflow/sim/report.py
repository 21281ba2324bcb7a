"""Reports of simulation runs: a table on the terminal, JSON, PNG plots, and a per-job CSV per run.

JSON schema (what `qosflow simulate --json` writes):
    {"policies": {"<name>": {"avg_jct": s, "p99_jct": s, "makespan": s, "dsr": 0..1 (null without deadline jobs),
                             "gpu_util": 0..1, "avg_queue": s, "jobs": n, ...more}},
     "bounds": {"avg_jct": s, "dsr": 0..1, "makespan": s}, "workload": {...}}

With several estimators (`--estimator oracle,noisy,learned`), "policies" holds the baseline estimator's
runs (oracle when present), "by_estimator" every run ({"<estimator>": {"<policy>": {...}}}), and
"estimator_deltas" what each estimator loses against the baseline ({"<estimator>": {"<policy>":
{"dsr_delta_points": x, "avg_jct_delta_pct": x, ...}}}, see `estimator_deltas`).

Each policy's "dsr_by_class" counts its deadline jobs per class of GPU count and isolated duration
({"3-4 GPUs, < 1 h": {"jobs": n, "met": m}, ...}; `qosflow.sim.metrics.job_class`); the terminal
table "Deadlines met by job class" and the plot dsr_by_class.png show the same.

When the jobs carry two users or more (`Job.user`; `qosflow simulate --users`), each policy's "per_user"
holds {"users": {"<user>": {"jobs": n, "finished": n, "avg_jct": s, "avg_slowdown": x, "deadline_jobs": n,
"met": m, "gpu_hours": h}}, "jain_slowdown": Jain's index over the users' average slowdowns}
(`qosflow.sim.metrics.user_metrics`); "gpu_hours" is the GPU-time the user's jobs held with a GPU shared by
k jobs counting 1/k to each, so that the users' GPU-hours add up to the run's allocated GPU-hours (gpu_util x
GPUs x makespan). The terminal table "Per user" shows the same. Without users (every
trace) there is no "per_user" key.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from qosflow.core.job import JobStatus
from qosflow.sim.engine import SimResult
from qosflow.sim.files import replacing
from qosflow.sim.metrics import Bounds, Metrics


def results_json(metrics: Mapping[str, Metrics], bounds: Bounds, extra: dict[str, Any] | None = None) -> dict:
    out: dict[str, Any] = {"policies": {}, "bounds": bounds.to_json()}
    if not any(m.deadline_jobs for m in metrics.values()):
        out["bounds"]["dsr"] = None  # no deadline job in the workload, as the policies' "dsr"
    for name, m in metrics.items():
        d = m.to_json()
        out["policies"][name] = {
            "avg_jct": d["avg_jct"],
            "p99_jct": d["p99_jct"],
            "makespan": d["makespan"],
            "dsr": d["dsr"],
            "gpu_util": d["gpu_util"],
            "avg_queue": d["avg_queue"],
            "jobs": d["finished"],
            **{k: v for k, v in d.items() if k not in {"avg_jct", "p99_jct", "makespan", "dsr", "gpu_util", "avg_queue", "policy"}},
        }
    if extra:
        out.update(extra)
    return out


def fmt_seconds(x: float) -> str:
    if x >= 86400 * 2:
        return f"{x / 86400:,.1f} d"
    if x >= 7200:
        return f"{x / 3600:,.1f} h"
    if x >= 120:
        return f"{x / 60:,.1f} min"
    return f"{x:,.1f} s"


def render_table(metrics: Mapping[str, Metrics], bounds: Bounds, title: str = "Simulation results"):
    from rich.table import Table

    t = Table(
        title=title,
        header_style="bold",
        caption="bound: each job alone on an idle cluster (JCT, DSR); makespan: the later of the last "
        "arrival's end and all work at one job per GPU (GPU sharing can beat the latter)",
    )
    # (on a cluster of mixed GPU models: how much of each model's GPU-time each policy used)
    models = sorted({g for m in metrics.values() for g in m.gpu_util_by_model})
    cols = ["policy", "avg JCT", "median JCT", "p99 JCT", "makespan", "avg queue", "DSR", "GPU alloc"]
    cols += ["GPU alloc\nper model"] * bool(models) + ["preempt", "jobs"]
    for col in cols:
        # the per-model cell is one "MODEL NN%" a line: wrapped at the column's width it broke between a model
        # and its share ("P100 19% T4" / "0% V100M16 0%" on the Alibaba node list)
        t.add_column(col, justify="right" if col != "policy" else "left", no_wrap=col == "GPU alloc\nper model")
    best = min(metrics.values(), key=lambda m: m.avg_jct).policy if metrics else None
    for name, m in metrics.items():
        style = "bold green" if name == best else None
        t.add_row(
            name,
            fmt_seconds(m.avg_jct),
            fmt_seconds(m.median_jct),
            fmt_seconds(m.p99_jct),
            fmt_seconds(m.makespan),
            fmt_seconds(m.avg_queue),
            f"{m.dsr:.1%}" if m.deadline_jobs else "-",
            f"{m.gpu_util:.1%}",
            *(["\n".join(f"{g} {m.gpu_util_by_model.get(g, 0.0):.0%}" for g in models)] if models else []),
            str(m.preemptions),
            f"{m.finished}" + (f" (+{m.rejected} rejected)" if m.rejected else ""),
            style=style,
        )
    # no deadline anywhere (--deadline-share 0): the policies show "-", and so does the bound (was 100.0%)
    bound_dsr = f"{bounds.dsr:.1%}" if any(m.deadline_jobs for m in metrics.values()) else "-"
    t.add_row("bound", fmt_seconds(bounds.avg_jct), "", "", fmt_seconds(bounds.makespan), "", bound_dsr, "",
              *([""] if models else []), "", "", style="dim")
    return t


def render_class_table(metrics: Mapping[str, Metrics], title: str = "Deadlines met by job class"):
    """Per class of deadline job (GPU count x isolated duration), how many each policy met; None
    when no policy had a deadline job."""
    from rich.table import Table

    classes = _classes(metrics)
    if not classes:
        return None
    t = Table(title=title, header_style="bold",
              caption="class: GPUs asked for, and the job's duration alone; met / deadline jobs of the class (share)")
    t.add_column("job class", no_wrap=True)
    t.add_column("jobs", justify="right", no_wrap=True)
    for name in metrics:
        t.add_column(name, justify="right", no_wrap=True)
    for c in classes:
        n = _class_jobs(metrics, c)
        cells = []
        for m in metrics.values():
            d = m.dsr_by_class.get(c)
            cells.append(f"{d['met']} ({d['met'] / d['jobs']:.0%})" if d else "-")
        t.add_row(c, str(n), *cells)
    return t


def render_user_table(metrics: Mapping[str, Metrics], title: str = "Per user"):
    """Per policy, a row per user (jobs, average JCT and slowdown, deadlines met, GPU-hours held, a shared
    GPU split between its jobs, and their share), then Jain's index over the users' slowdowns; None when no policy's jobs carry two users."""
    from rich.table import Table

    if not any(m.per_user for m in metrics.values()):
        return None
    t = Table(title=title, header_style="bold",
              caption="slowdown: JCT / the job's duration alone; GPU-hours: GPU-time the user's jobs held, a GPU shared by two "
              "jobs counting half to each (share of all GPU-hours allocated); "
              "Jain: Jain's index over the users' average slowdowns (1: all slowed alike, 1/n: one user bears it all)")
    t.add_column("policy", no_wrap=True)
    t.add_column("user", no_wrap=True)
    for col in ("jobs", "avg JCT", "avg slowdown", "deadlines met", "GPU-hours"):
        t.add_column(col, justify="right", no_wrap=True)
    shown = [(name, m) for name, m in metrics.items() if m.per_user]
    for i, (name, m) in enumerate(shown):
        total = sum(u["gpu_hours"] for u in m.per_user.values())
        for k, (user, u) in enumerate(m.per_user.items()):
            n, dl = u["finished"], u["deadline_jobs"]
            t.add_row(
                name if k == 0 else "",
                user,
                f"{n}" + (f" of {u['jobs']}" if n < u["jobs"] else ""),
                fmt_seconds(u["avg_jct"]) if u["avg_jct"] is not None else "-",
                f"{u['avg_slowdown']:.2f}" if u["avg_slowdown"] is not None else "-",
                f"{u['met']}/{dl} ({u['met'] / dl:.0%})" if dl else "-",
                f"{u['gpu_hours']:,.1f}" + (f" ({u['gpu_hours'] / total:.0%})" if total > 0 else ""),
            )
        t.add_row("", "Jain", "", "", f"{m.jain_slowdown:.3f}" if m.jain_slowdown is not None else "-", "", "",
                  style="dim", end_section=i < len(shown) - 1)
    return t


def _classes(metrics: Mapping[str, Metrics]) -> list[str]:
    """The job classes any policy has deadline jobs in, in class order."""
    from qosflow.sim.metrics import CLASS_ORDER

    return sorted({c for m in metrics.values() for c in m.dsr_by_class}, key=lambda c: CLASS_ORDER.get(c, (99, 99)))


def _class_jobs(metrics: Mapping[str, Metrics], c: str) -> int:
    """How many deadline jobs class `c` holds (the most any policy counted: they run the same workload)."""
    return max(m.dsr_by_class.get(c, {}).get("jobs", 0) for m in metrics.values())


#: columns of the per-job CSV (`write_job_tables`); times in seconds of simulated time
JOB_COLUMNS = (
    "job_id", "status", "gpus", "gpus_started", "model", "submit_s", "first_start_s", "finish_s", "queue_s", "jct_s",
    "deadline_s", "deadline_met", "preemptions", "restarts", "failures", "note",
)


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def job_rows(res: SimResult) -> list[dict[str, Any]]:
    """One row per job of a run (`JOB_COLUMNS`): when it arrived, started and ended, whether it met its
    deadline, and the policy's last word on it (why it waited, shared, or took an express node)."""
    rows = []
    for js in res.jobs:
        j = js.job
        done = js.status is JobStatus.DONE and js.finish_time is not None
        if j.deadline is None or js.status is JobStatus.REJECTED:
            met = ""
        else:
            met = "yes" if done and js.finish_time <= j.deadline + 1e-6 else "no"
        rows.append({
            "job_id": js.job_id,
            "status": js.status.value,
            "gpus": f"{j.qos.gpu_demand:g}",  # a fractional share (0.46) as such, not as 1 GPU
            "gpus_started": "" if js.started_gpus is None else js.started_gpus,
            "model": j.model or "",
            "submit_s": _num(j.submit_time),
            "first_start_s": _num(js.first_start),
            "finish_s": _num(js.finish_time if done else None),
            "queue_s": _num(js.first_start - j.submit_time if js.first_start is not None else None),
            "jct_s": _num(js.finish_time - j.submit_time if done else None),
            "deadline_s": _num(j.deadline),
            "deadline_met": met,
            "preemptions": js.preemptions,
            "restarts": js.restarts,
            "failures": js.failures,
            "note": js.note,
        })
    return rows


#: the plots `plot_results` may write (dsr_by_class.png only when jobs have deadlines)
PLOT_FILES = ("jct_cdf.png", "dsr.png", "gpu_util.png", "avg_jct.png", "dsr_by_class.png", "gpu_timeline.png")


def job_table_name(label: str) -> str:
    """jobs-<run>.csv: the run's label with anything but letters, digits, '_', '.', '-' made '-'."""
    return f"jobs-{re.sub(r'[^A-Za-z0-9_.-]+', '-', label).strip('-')}.csv"


def write_job_tables(results: Mapping[str, SimResult], out_dir: str | Path) -> list[Path]:
    """`jobs-<run>.csv` in `out_dir` for every run (`job_rows`), e.g. jobs-qosflow.csv."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for label, res in results.items():
        path = out / job_table_name(label)
        with replacing(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=JOB_COLUMNS)
            w.writeheader()
            w.writerows(job_rows(res))
        files.append(path)
    return files


def earlier_outputs(out_dir: str | Path, written: list[Path], *, plots: bool = True) -> list[Path]:
    """Files of simulate's output set in `out_dir` that this run did not write: left there by an earlier run
    (jobs-sjf.csv of a run that compared sjf, dsr_by_class.png of a run with deadlines), they sat beside this
    run's results as if they were part of them (`qosflow simulate` names them). The plots (`PLOT_FILES`) only with `plots`; per-job tables
    only those whose header is `JOB_COLUMNS` (a CSV of the user's own named jobs-*.csv is not ours)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    mine = {p.resolve() for p in written}
    found = [out / n for n in PLOT_FILES if plots] + sorted(out.glob("jobs-*.csv"))
    header = ",".join(JOB_COLUMNS)
    left = []
    for p in found:
        if not p.is_file() or p.resolve() in mine:
            continue
        if p.suffix == ".csv":
            try:
                with p.open(encoding="utf-8", errors="replace") as f:
                    if f.readline().strip() != header:
                        continue
            except OSError:
                continue
        left.append(p)
    return left


def other_results(out_dir: str | Path, mine: str | Path | None) -> list[Path]:
    """The result JSONs of other `qosflow simulate` runs in `out_dir` (not `mine`): their plots and per-job
    CSVs went to that directory too, so a run there replaces them."""
    import json

    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = []
    for p in sorted(out.glob("*.json")):
        if mine is not None and p.resolve() == Path(mine).resolve():
            continue
        try:
            if p.stat().st_size > 200_000_000:
                continue
            d = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and {"policies", "bounds", "workload"} <= d.keys():
            found.append(p)
    return found


def _series_styles(n: int) -> list[dict[str, str]]:
    """A colour and line style per run, no two alike: matplotlib's 10 colours, then the same
    colours dashed, then dotted (more than 10 runs: several policies x estimators)."""
    palette = [f"C{i}" for i in range(10)]
    return [{"color": palette[i % 10], "ls": ("-", "--", ":", "-.")[(i // 10) % 4]} for i in range(n)]


def _save(fig, path: Path, on_file=None) -> None:
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    if on_file is not None:
        on_file(path)


def time_unit(seconds: float) -> tuple[float, str]:
    """The unit the table would show `seconds` in (`fmt_seconds`): (seconds per unit, its name). The plots were
    always in hours: the Muri trace's average JCT read '802.80' hours under a table that said 33.4 d."""
    if seconds >= 86400 * 2:
        return 86400.0, "days"
    if seconds >= 7200:
        return 3600.0, "hours"
    return 60.0, "minutes"


def plot_results(results: Mapping[str, SimResult], metrics: Mapping[str, Metrics], bounds: Bounds, out_dir: str | Path,
                 on_file=None) -> list[Path]:
    """JCT CDF, DSR bars and utilisation bars (plus a GPU-allocation timeline), as PNG; `on_file(path)` is
    called as each is written (what a run stopped half-way had written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []

    styles = _series_styles(max(len(results), len(metrics)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, res), st in zip(results.items(), styles):
        jct = np.sort([j.finish_time - j.job.submit_time for j in res.jobs if j.status is JobStatus.DONE])
        if jct.size:
            ax.plot(jct / 3600.0, np.arange(1, jct.size + 1) / jct.size, label=name, **st)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("JCT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    files.append(out / "jct_cdf.png")
    _save(fig, files[-1], on_file)
    plt.close(fig)

    names = list(metrics)
    jct_scale, jct_unit = time_unit(max([metrics[n].avg_jct for n in names], default=0.0))
    for key, label, fname, bound in (
        ("dsr", "deadline satisfaction ratio", "dsr.png", bounds.dsr),
        ("gpu_util", "GPU allocation (share of GPU-time)", "gpu_util.png", None),
        ("avg_jct", f"average JCT ({jct_unit})", "avg_jct.png", bounds.avg_jct),
    ):
        vals = [getattr(metrics[n], key) for n in names]
        scale = jct_scale if key == "avg_jct" else 1.0
        fig, ax = plt.subplots(figsize=(7, 4))
        if key == "dsr" and not any(metrics[n].deadline_jobs for n in names):
            names_shown, vals, bound = [], [], None  # no deadline to meet: no ratio, not bars at 100 %
            ax.text(0.5, 0.5, "no job has a deadline", ha="center", va="center", transform=ax.transAxes)
        else:
            names_shown = names
        bars = ax.bar(names_shown, [v / scale for v in vals], color="#4c72b0")
        for b, v in zip(bars, vals):
            ax.annotate(f"{v / scale:,.1f}" if key == "avg_jct" else f"{v:.1%}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
        if bound is not None:
            ax.axhline(bound / scale, color="gray", ls="--", label="bound")
            ax.legend()
        ax.set_ylabel(label)
        ax.set_title(label)
        plt.setp(ax.get_xticklabels(), rotation=20)
        fig.tight_layout()
        files.append(out / fname)
        _save(fig, files[-1], on_file)
        plt.close(fig)

    classes = _classes(metrics)
    if classes:  # DSR per job class: a group of horizontal bars per class, the first class on top
        fig, ax = plt.subplots(figsize=(9, min(14.0, 1.5 + 0.1 * len(classes) * max(2, len(names)))))
        height = 0.8 / max(1, len(names))
        y = np.arange(len(classes))
        for i, n in enumerate(names):
            by = metrics[n].dsr_by_class
            vals = [by[c]["met"] / by[c]["jobs"] if c in by else 0.0 for c in classes]
            ax.barh(y + (i - (len(names) - 1) / 2) * height, vals, height, label=n, color=styles[i]["color"],
                    hatch=None if styles[i]["ls"] == "-" else "//")
        counts = [_class_jobs(metrics, c) for c in classes]
        ax.set_yticks(y, [f"{c} ({k} job{'' if k == 1 else 's'})" for c, k in zip(classes, counts)], fontsize=8)
        ax.set_ylim(len(classes) - 0.5, -0.5)  # the first class on top, no margin
        ax.set_xlim(0, 1.0)
        ax.set_xlabel("deadlines met (share of the class)")
        ax.set_title("Deadlines met by job class (GPUs asked for, duration alone)")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        files.append(out / "dsr_by_class.png")
        _save(fig, files[-1], on_file)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    span = max([r.timeline[-1][0] - r.start_time for r in results.values() if r.timeline], default=0.0)
    t_scale, t_unit = time_unit(span)
    for (name, res), st in zip(results.items(), styles):
        if res.timeline:
            t = np.array([x for x, _ in res.timeline])
            g = np.array([y for _, y in res.timeline])
            ax.step((t - res.start_time) / t_scale, g, where="post", label=name, lw=0.8, **st)
    ax.set_xlabel(f"time ({t_unit})")
    ax.set_ylabel("GPUs allocated")
    ax.set_title(f"GPU allocation over time ({next(iter(results.values())).cluster.num_gpus} GPUs)" if results else "")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(out / "gpu_timeline.png")
    _save(fig, files[-1], on_file)
    plt.close(fig)
    return files


def estimator_deltas(by_estimator: Mapping[str, Mapping[str, Metrics]], baseline: str) -> dict[str, dict[str, dict[str, float]]]:
    """Per estimator and policy: DSR and JCT, and their change against the `baseline` estimator's run of
    the same policy (DSR in percentage points, JCTs in per cent; negative DSR delta = QoS lost)."""
    base = by_estimator[baseline]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for est, ms in by_estimator.items():
        out[est] = {}
        for pol, m in ms.items():
            b = base.get(pol)
            if b is None:
                continue
            out[est][pol] = {
                "dsr": m.dsr,
                "dsr_delta_points": 100.0 * (m.dsr - b.dsr),
                "avg_jct": m.avg_jct,
                "avg_jct_delta_pct": 100.0 * (m.avg_jct / b.avg_jct - 1.0) if b.avg_jct else 0.0,
                "p99_jct_delta_pct": 100.0 * (m.p99_jct / b.p99_jct - 1.0) if b.p99_jct else 0.0,
                "makespan_delta_pct": 100.0 * (m.makespan / b.makespan - 1.0) if b.makespan else 0.0,
            }
    return out


def render_estimator_table(by_estimator: Mapping[str, Mapping[str, Metrics]], baseline: str, title: str = "QoS lost to prediction error"):
    """One row per (policy, estimator): DSR and JCT with their deltas against the baseline estimator."""
    from rich.table import Table

    d = estimator_deltas(by_estimator, baseline)
    t = Table(title=title, header_style="bold")
    for col in ("policy", "estimates", "DSR", f"ΔDSR vs {baseline}", "avg JCT", "ΔJCT", "p99 JCT", "makespan"):
        t.add_column(col, justify="left" if col in ("policy", "estimates") else "right")
    policies = list(dict.fromkeys(p for ms in by_estimator.values() for p in ms))
    for pol in policies:
        for est, ms in by_estimator.items():
            m = ms.get(pol)
            if m is None:
                continue
            dd = d[est].get(pol, {})
            is_base = est == baseline
            t.add_row(
                pol,
                est,
                f"{m.dsr:.1%}" if m.deadline_jobs else "-",
                "" if is_base else f"{dd.get('dsr_delta_points', 0.0):+.1f} pt",
                fmt_seconds(m.avg_jct),
                "" if is_base else f"{dd.get('avg_jct_delta_pct', 0.0):+.1f} %",
                fmt_seconds(m.p99_jct),
                fmt_seconds(m.makespan),
                style="dim" if is_base else None,
                end_section=est == list(by_estimator)[-1],
            )
    return t

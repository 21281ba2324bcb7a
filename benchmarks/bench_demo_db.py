"""The demo on SQLite and on PostgreSQL, side by side, written to docs/bench/demo_db.md.

`qosflow demo --no-ui --json` is run in rounds, alternating the Prefect server's set-up ("arms"):
`sqlite` (the default: SQLite under the demo's home, the server's garbage collection in a thread of
its own, write transactions begun IMMEDIATE, and a request that lost SQLite's write race retried by
the server itself, qosflow/prefect/server_process.py), `sqlite-deferred` (the same with Prefect's
BEGIN DEFERRED; QOSFLOW_SERVER_SQLITE_IMMEDIATE=0), `sqlite-backoff` (the same without the server's retries: the
client gets the 503 and backs off 2, 4, 8, 16, 32 s; QOSFLOW_SERVER_RETRY_S=0), `sqlite-loop-gc` (plain
`python -m prefect server start`: Python's usual garbage collection in the event loop, BEGIN DEFERRED and
the client's back-off; QOSFLOW_SERVER_GC_THREAD=0 and QOSFLOW_SERVER_SQLITE_IMMEDIATE=0 as well) and
`postgresql` (a fresh PostgreSQL database, `--database-url`). Each run reports,
per pipeline, the time it took and whether it met its deadline, and per stage the time from its
dispatch by the pipeline ("ready") to the worker queueing it: the Prefect part of a stage's start
(creating its flow run, the worker picking it up), where a busy SQLite server stalls (docs/prefect.md).
The machine is shared and its load changes between runs: alternating keeps both arms under the same
mix, and the load average is recorded with each run.

    python benchmarks/bench_demo_db.py --rounds 3 --arms sqlite,sqlite-backoff,postgresql \\
        --postgres postgresql://qosflow:qosflow@127.0.0.1:5432/qosflow_test

`--postgres` names any database of a role that may create databases: each PostgreSQL run creates its
own database next to it and drops it afterwards.
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
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import machine, md_table, write_section  # noqa: E402


def _pg(admin: str):
    import psycopg

    return psycopg.connect("postgresql://" + admin.split("://", 1)[1], autocommit=True)


#: arm -> (environment it sets, what it is)
ARMS = {
    "sqlite": ({}, "SQLite under the demo's home, the server's garbage collection in a thread of its own, write "
                   "transactions that take SQLite's write lock at their start (BEGIN IMMEDIATE), and requests that "
                   "lost SQLite's write race retried by the server itself (the default)"),
    "sqlite-deferred": ({"QOSFLOW_SERVER_SQLITE_IMMEDIATE": "0"},
                        "the same with Prefect's own BEGIN DEFERRED write transactions, which may lose the write "
                        "race half-way (QOSFLOW_SERVER_SQLITE_IMMEDIATE=0)"),
    "sqlite-backoff": ({"QOSFLOW_SERVER_RETRY_S": "0"}, "the same without the server's retries: the client gets the 503 "
                                                         "and backs off 2, 4, 8, 16, 32 s (QOSFLOW_SERVER_RETRY_S=0)"),
    "sqlite-loop-gc": ({"QOSFLOW_SERVER_RETRY_S": "0", "QOSFLOW_SERVER_GC_THREAD": "0", "QOSFLOW_SERVER_SQLITE_IMMEDIATE": "0"},
                       "plain `prefect server start`: Python's usual garbage collection in the event loop and "
                       "Prefect's back-off (QOSFLOW_SERVER_GC_THREAD=0 and QOSFLOW_SERVER_SQLITE_IMMEDIATE=0 as well)"),
    "postgresql": ({}, "a fresh PostgreSQL database (`--database-url`)"),
}


def one_run(db: str, admin: str | None, work: Path, i: int) -> dict:
    home = work / f"{db}-{i}"
    out = work / f"{db}-{i}.json"
    cmd = [sys.executable, "-m", "qosflow", "demo", "--no-ui", "--json", str(out), "--home", str(home)]
    name = None
    env = dict(os.environ)
    env.update(ARMS[db][0])
    if db == "postgresql":
        name = f"qosflow_bench_{uuid.uuid4().hex[:8]}"
        with _pg(admin) as c:
            c.execute(f"CREATE DATABASE {name}")
        cmd += ["--database-url", admin.rsplit("/", 1)[0] + "/" + name]
    load = os.getloadavg()[0]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    finally:
        if name:
            with _pg(admin) as c:
                c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    wall = time.time() - t0
    if p.returncode != 0 or not out.exists():
        return {"db": db, "ok": False, "wall_s": wall, "load": load, "error": (p.stderr or p.stdout)[-2000:]}
    rep = json.loads(out.read_text())
    pick = []
    pipes = {}
    for pl in rep["pipelines"]:
        pipes[pl["name"]] = {"elapsed_s": pl.get("elapsed_s"), "met": pl.get("met"), "state": pl.get("state")}
        for s in pl["stages"]:
            if s.get("ready") is not None and s.get("queued") is not None:
                pick.append(s["queued"] - s["ready"])
    return {"db": db, "ok": True, "wall_s": wall, "load": load, "pipelines": pipes, "pickup_s": pick}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="runs per arm")
    ap.add_argument("--arms", default="sqlite,sqlite-backoff,postgresql", help=f"comma-separated: {', '.join(ARMS)}")
    ap.add_argument("--postgres", default=os.environ.get("QOSFLOW_TEST_POSTGRES_URL"),
                    help="a PostgreSQL URL whose role may create databases (default: $QOSFLOW_TEST_POSTGRES_URL)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write docs/bench/demo_db.md")
    a = ap.parse_args()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        sys.exit(f"--arms: unknown {bad}; use {', '.join(ARMS)}")
    if "postgresql" in arms and not a.postgres:
        sys.exit("--postgres (or QOSFLOW_TEST_POSTGRES_URL) is needed: a PostgreSQL URL whose role may create databases")
    from rich.progress import Progress

    work = Path(tempfile.mkdtemp(prefix="qosflow-demo-db-"))
    runs: list[dict] = []
    t0 = time.time()
    with Progress() as prog:
        task = prog.add_task("demo runs", total=len(arms) * a.rounds)
        for i in range(a.rounds):
            for db in arms:
                prog.update(task, description=f"demo on {db} ({i + 1}/{a.rounds})")
                runs.append(one_run(db, a.postgres, work, i))
                prog.advance(task)
    took = time.time() - t0

    def q(xs, f):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")

    rows = []
    for r in runs:
        if not r["ok"]:
            rows.append([r["db"], f"{r['load']:.1f}", "failed", "-", "-", "-", "-", "-"])
            continue
        pl = r["pipelines"]
        crit, guar, be = pl.get("fraud-critical", {}), pl.get("ranking-guaranteed", {}), pl.get("reports-best-effort", {})
        pk = r["pickup_s"]
        rows.append([r["db"], f"{r['load']:.1f}",
                     f"{crit.get('elapsed_s', float('nan')):.0f} s ({'met' if crit.get('met') else 'MISSED'})",
                     f"{guar.get('elapsed_s', float('nan')):.0f} s ({'met' if guar.get('met') else 'MISSED'})",
                     f"{be.get('elapsed_s', float('nan')):.0f} s",
                     f"{statistics.median(pk):.1f}", f"{q(pk, 0.9):.1f}", f"{max(pk):.1f}"])
    summary = []
    for db in arms:
        ok = [r for r in runs if r["db"] == db and r["ok"]]
        pk = [x for r in ok for x in r["pickup_s"]]
        slow = [max(p["elapsed_s"] for p in r["pipelines"].values()) for r in ok]
        met = sum(1 for r in ok for p in r["pipelines"].values() if p["met"])
        dl = sum(1 for r in ok for p in r["pipelines"].values() if p["met"] is not None)
        summary.append([db, f"{len(ok)}/{sum(1 for r in runs if r['db'] == db)}",
                        f"{statistics.median(slow):.0f} s" if slow else "-", f"{max(slow):.0f} s" if slow else "-",
                        f"{met}/{dl}", f"{statistics.median(pk):.1f} s" if pk else "-", f"{q(pk, 0.9):.1f} s" if pk else "-",
                        f"{max(pk):.1f} s" if pk else "-"])
    md = [
        "# The demo on SQLite and on PostgreSQL",
        "",
        f"- machine: {machine()}",
        f"- command: `python benchmarks/bench_demo_db.py --rounds {a.rounds} --arms {','.join(arms)}` ({took / 60:.1f} min)",
        "- each run: `qosflow demo --no-ui --json` (3 pipelines, 18 stage processes, 2 hosts x 4 **virtual** GPUs: "
        "no GPU here); arms: " + "; ".join(f"`{x}` = {ARMS[x][1]}" for x in arms) + "; the arms alternate, the "
        "machine's other work goes on",
        "- pickup: a stage's dispatch by its pipeline -> the worker queueing it (creating the stage's flow run, "
        "the worker's poll); the worker's own placement and the stage's process start come after",
        "",
        "## Per database",
        "",
        md_table(["server", "runs completed", "slowest pipeline, median run", "slowest pipeline, worst run",
                  "deadlines met", "pickup median", "pickup p90", "pickup max"], summary),
        "",
        "## Per run (in the order run)",
        "",
        md_table(["server", "load (1 min)", "fraud-critical (150 s)", "ranking-guaranteed (300 s)",
                  "reports-best-effort", "pickup median (s)", "p90", "max"], rows),
    ]
    text = "\n".join(md)
    print(text)
    if not a.no_write:
        print(f"wrote {write_section('demo_db', text)}")


if __name__ == "__main__":
    main()

"""Soak test: a real Prefect server, a qosflow pool and its worker (`qosflow worker start`, a process of its
own), and small pipelines submitted continuously for a while, as a lab runs the worker for weeks.

    python benchmarks/soak.py --minutes 25 --interval 20 --backend local --json soak.json
    python benchmarks/soak.py --minutes 20 --interval 20 --backend agents   # two virtual-GPU host agents

Every `--interval` seconds (while fewer than `--max-inflight` pipelines run) a pipeline process starts:
2-4 stages of `--stage-s` seconds of sleep; one in `--fail-every` has a stage that raises, one in
`--cancel-every` is sent SIGTERM `--cancel-after` seconds after its start (its stage runs are cancelled),
one in `--deadline-every` runs with a deadline. Every `--sample` seconds the worker process (and the
agents) are sampled: RSS (VmRSS), open file descriptors, threads, child processes; and the files left
behind: the qosflow-* directories in the worker's TMPDIR (its own, in the run's temporary directory), the
agents' work directories, QOSFLOW_HOME (files, bytes, plans.json, stage-history.json, qosflow.db and its
WAL), the Prefect database. `--in-process` runs the worker in this process (a WorkerThread) and also
samples the sizes of the dicts, lists and sets its worker, scheduler, estimator and backends hold.
The table shows each sample with the pipelines completed by then; the summary, the growth per
completed pipeline after the warm-up (least-squares slope). The JSON has every sample.

The stages and pipelines below are imported by the pipeline and stage processes as the module `soak`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qosflow.procgroup import stop_group
from qosflow.prefect.tasks import qos_flow, qos_task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# ----------------------------------------------------------------------------------- the pipelines
@qos_task(gpus=1, cpu_cores=1, expected_duration=4)
def soak_stage(i: int, secs: float, fail: bool = False) -> int:
    time.sleep(secs)
    if fail:
        raise RuntimeError(f"soak stage {i} fails on purpose")
    return i


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def soak_cpu_stage(i: int, secs: float) -> int:
    time.sleep(secs)
    return i


@qos_flow(name="soak-pipeline")
def soak_pipeline(n: int = 3, secs: float = 3.0, fail_at: int = -1, qos_deadline: float | None = None) -> list:
    first = soak_cpu_stage.submit(0, secs / 2)
    first.result()
    futs = [soak_stage.submit(i, secs, i == fail_at) for i in range(1, n)]
    return [f.result() for f in futs]


def _pipeline_main(argv: list[str]) -> None:
    n, secs, fail_at = int(argv[0]), float(argv[1]), int(argv[2])
    deadline = float(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
    soak_pipeline(n=n, secs=secs, fail_at=fail_at, qos_deadline=deadline)


# ----------------------------------------------------------------------------------- sampling
def _status(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_kb"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        out["gone"] = True
    return out


def _children(pid: int) -> list[int]:
    """All descendants of `pid`."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = Path(f"/proc/{d}/stat").read_text()
                parent[int(d)] = int(st.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _tree(path: Path) -> tuple[int, int]:
    n = size = 0
    for dp, _dn, fn in os.walk(path):
        for f in fn:
            try:
                size += os.lstat(os.path.join(dp, f)).st_size
                n += 1
            except OSError:
                pass
    return n, size


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _local_dirs(tmpdir: Path) -> tuple[int, int]:
    """The worker's (and its children's) temporary directories: qosflow-*-* under their TMPDIR."""
    dirs = [d for d in tmpdir.glob("qosflow-*") if d.is_dir()]
    files = sum(_tree(d)[0] for d in dirs)
    return len(dirs), files


def sample(t0: float, worker_pid: int, agent_pids: dict[str, int], qhome: Path, phome: Path, done: dict, tmpdir: Path) -> dict:
    s: dict = {"t_s": round(time.time() - t0, 1), **done}
    w = _status(worker_pid)
    s.update({f"worker_{k}": v for k, v in w.items()})
    s["worker_children"] = len(_children(worker_pid))
    for name, pid in agent_pids.items():
        a = _status(pid)
        s.update({f"{name}_{k}": v for k, v in a.items()})
        s[f"{name}_children"] = len(_children(pid))
    s["tmp_dirs"], s["tmp_files"] = _local_dirs(tmpdir)
    for name in agent_pids:  # the agents' --workdir: stage logs and progress files
        s[f"{name}_workdir_files"], s[f"{name}_workdir_bytes"] = _tree(tmpdir.parent / f"agent-{name}")
    s["qhome_files"], s["qhome_bytes"] = _tree(qhome)
    for f in ("plans.json", "stage-history.json", "qosflow.db"):
        s[f.replace(".", "_").replace("-", "_") + "_bytes"] = sum(_size(p) for p in qhome.rglob(f))
    s["qosflow_db_wal_bytes"] = sum(_size(p) for p in qhome.rglob("qosflow.db-wal"))
    s["prefect_db_bytes"] = _size(phome / "prefect.db") + _size(phome / "prefect.db-wal")
    return s


def containers(worker) -> dict[str, int]:
    """Sizes of the dicts, lists, sets and deques the in-process worker, its scheduler, estimator and
    backends hold (`n:scheduler.entries`, ...): one that grows with every pipeline is a leak."""
    import collections
    import gc

    out: dict[str, int] = {}
    sched = getattr(worker, "scheduler", None)
    objs = {"worker": worker, "scheduler": sched, "estimator": getattr(sched, "estimator", None),
            "cluster_state": getattr(sched, "state", None), "backend": getattr(worker, "_backend", None),
            "pipelines_backend": getattr(worker, "_pipelines_here", None), "policy": getattr(sched, "policy", None)}
    for name, obj in objs.items():
        for attr, v in list(getattr(obj, "__dict__", {}).items()):
            if isinstance(v, (dict, list, set, frozenset, collections.deque)):
                out[f"n:{name}.{attr}"] = len(v)
    recs = list(getattr(worker, "records", []))
    if recs:  # (what one record of a finished stage costs)
        out["worker_record_json_bytes"] = len(json.dumps(recs[-1], default=str))
    out["gc_objects"] = len(gc.get_objects())
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


# ----------------------------------------------------------------------------------- the run
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=25.0, help="how long pipelines are submitted")
    ap.add_argument("--interval", type=float, default=20.0, help="seconds between pipeline starts")
    ap.add_argument("--max-inflight", type=int, default=3, help="most pipelines running at once")
    ap.add_argument("--stage-s", type=float, default=3.0, help="seconds each stage sleeps")
    ap.add_argument("--fail-every", type=int, default=5)
    ap.add_argument("--cancel-every", type=int, default=7)
    ap.add_argument("--cancel-after", type=float, default=12.0)
    ap.add_argument("--deadline-every", type=int, default=3)
    ap.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--warmup", type=int, default=5, help="completed pipelines before the growth is measured")
    ap.add_argument("--backend", choices=["local", "agents"], default="local")
    ap.add_argument("--in-process", action="store_true",
                    help="run the worker in this process (a WorkerThread) and sample the sizes of its containers too")
    ap.add_argument("--json", type=Path, default=None, help="write every sample and the summary here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    a = ap.parse_args()

    from qosflow.prefect.local import LocalServer, free_port

    tmp = Path(tempfile.mkdtemp(prefix="qosflow-soak-"))
    qhome, phome = tmp / "qosflow", tmp / "prefect"
    qhome.mkdir()
    tmpdir = tmp / "tmp"  # the worker's, agents' and pipelines' TMPDIR: what they leave there is theirs
    tmpdir.mkdir()
    env = dict(os.environ)
    env.update(QOSFLOW_HOME=str(qhome), PREFECT_HOME=str(phome), PREFECT_SERVER_ANALYTICS_ENABLED="false", TMPDIR=str(tmpdir),
               PYTHONPATH=os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    os.environ.update({k: env[k] for k in ("QOSFLOW_HOME", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED")})
    server = LocalServer(phome, ui=False).start()
    env.update(server.env)
    pool = "soak"
    procs: list[subprocess.Popen] = []
    agents: dict[str, subprocess.Popen] = {}
    logs = tmp / "logs"
    logs.mkdir()
    try:
        worker_cmd = [sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool]
        if a.backend == "agents":
            token = "soak-token-" + os.urandom(8).hex()
            (tmp / "token").write_text(token)
            os.chmod(tmp / "token", 0o600)
            hosts = []
            for i in range(2):
                port = free_port()
                name = f"n{i}"
                agents[name] = subprocess.Popen(
                    [sys.executable, "-m", "qosflow", "agent", "start", "--host", "127.0.0.1", "--port", str(port), "--name", name,
                     "--token-file", str(tmp / "token"), "--virtual-gpus", "2", "--cpu-cores", "4", "--fence-after", "3", "--workdir", str(tmp / f"agent-{name}")],
                    env=env, stdout=open(logs / f"agent-{name}.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
                hosts.append(f"  - {{name: {name}, agent_url: 'http://127.0.0.1:{port}'}}\n")
            (tmp / "lab.yaml").write_text(f"name: soak\ntoken_file: token\ngpus_per_host: 2\nhosts:\n{''.join(hosts)}")
            time.sleep(3)
            worker_cmd += ["--cluster-file", str(tmp / "lab.yaml")]
        subprocess.run([sys.executable, "-m", "qosflow", "init", "--pool", pool, "--hosts", "1", "--gpus-per-host", "4"],
                       env=env, check=True, stdout=open(logs / "init.log", "ab"), stderr=subprocess.STDOUT)
        wt = None
        if a.in_process:
            import logging

            from qosflow.prefect.local import WorkerThread

            os.environ.update({k: env[k] for k in ("TMPDIR", "PYTHONPATH")})
            tempfile.tempdir = str(tmpdir)
            server.apply_env()
            handler = logging.FileHandler(logs / "worker.log")
            logging.getLogger("prefect").addHandler(handler)
            kw = {"cluster_file": str(tmp / "lab.yaml")} if a.backend == "agents" else {}
            wt = WorkerThread(pool, **kw).wait_ready(180)

            class _Self:  # (the worker is this process)
                pid = os.getpid()
                returncode = None

                def poll(self):
                    return None if wt.is_alive() else 0

                def send_signal(self, sig):
                    wt.stop(60)

                def wait(self, timeout=None):
                    wt.join(timeout)

            worker = _Self()
        else:
            worker = subprocess.Popen(worker_cmd, env=env, stdout=open(logs / "worker.log", "ab"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
        time.sleep(10)
        t0 = time.time()
        end = t0 + 60 * a.minutes
        rng = random.Random(7)
        done = {"started": 0, "completed": 0, "ok": 0, "failed": 0, "cancelled": 0, "stages": 0}
        running: list[tuple[subprocess.Popen, float, bool, int]] = []
        samples: list[dict] = []
        next_start = next_sample = time.time()
        print(f"soak: {a.backend} backend, server {server.api_url}, home {tmp}", flush=True)
        cols = ["t_s", "completed", "stages", "worker_rss_kb", "worker_fds", "worker_threads", "worker_children",
                "tmp_dirs", "tmp_files", "qhome_files", "plans_json_bytes", "qosflow_db_bytes", "prefect_db_bytes"]
        print(" ".join(f"{c.replace('worker_', 'w_').replace('_bytes', '_B')[:12]:>12}" for c in cols), flush=True)
        while True:
            now = time.time()
            for item in list(running):
                p, started, cancel, n = item
                if cancel and p.poll() is None and now - started > a.cancel_after and not getattr(p, "_sent", False):
                    p.send_signal(signal.SIGTERM)
                    p._sent = True  # type: ignore[attr-defined]
                if p.poll() is not None:
                    running.remove(item)
                    done["completed"] += 1
                    done["stages"] += n
                    kind = "cancelled" if cancel else ("ok" if p.returncode == 0 else "failed")
                    done[kind] += 1
            if now >= end and not running:
                break
            if now < end and now >= next_start and len(running) < a.max_inflight:
                k = done["started"] = done["started"] + 1
                n = rng.randint(2, 4)
                fail_at = n - 1 if k % a.fail_every == 0 else -1
                cancel = k % a.cancel_every == 0
                deadline = str(60 + 10 * n) if k % a.deadline_every == 0 else "-"
                p = subprocess.Popen([sys.executable, "-c", "import sys, soak; soak._pipeline_main(sys.argv[1:])",
                                      str(n), str(a.stage_s), str(fail_at), deadline],
                                     cwd=str(HERE), env={**env, "QOSFLOW_POOL": pool},
                                     stdout=open(logs / f"pipeline-{k}.log", "ab"), stderr=subprocess.STDOUT)
                procs.append(p)
                running.append((p, now, cancel, n))
                next_start = now + a.interval
            if now >= next_sample:
                s = sample(t0, worker.pid, {k: v.pid for k, v in agents.items()}, qhome, phome, dict(done), tmpdir)
                if wt is not None:
                    s.update(containers(wt.worker))
                samples.append(s)
                print(" ".join(f"{str(s.get(c, '')):>12}" for c in cols), flush=True)
                next_sample = now + a.sample
            if worker.poll() is not None:
                print(f"the worker exited with {worker.returncode}: see {logs / 'worker.log'}", flush=True)
                break
            time.sleep(0.5)
        time.sleep(5)
        s = sample(t0, worker.pid, {k: v.pid for k, v in agents.items()}, qhome, phome, dict(done), tmpdir)
        if wt is not None:
            s.update(containers(wt.worker))
        samples.append(s)
        print(" ".join(f"{str(s.get(c, '')):>12}" for c in cols), flush=True)
        # growth per completed pipeline, after the warm-up
        use = [x for x in samples if x["completed"] >= a.warmup]
        growth = {}
        if len(use) >= 2:
            for key in use[-1]:
                if key in ("t_s", "started", "completed", "ok", "failed", "cancelled", "stages") or not isinstance(use[-1][key], (int, float)):
                    continue
                xs = [x["completed"] for x in use if key in x]
                ys = [x[key] for x in use if key in x]
                growth[key] = {"first": ys[0], "last": ys[-1], "per_pipeline": round(slope(xs, ys), 2)}
        print("\ngrowth per completed pipeline (least squares, after the warm-up):")
        for key, g in growth.items():
            if key.startswith("n:") and not g["per_pipeline"]:
                continue  # (containers that did not grow)
            print(f"  {key:28} {g['first']:>12} -> {g['last']:>12}  {g['per_pipeline']:>10} /pipeline")
        print(f"pipelines: {done}")
        if a.json:
            a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "done": done, "samples": samples,
                                          "growth": growth}, indent=1))
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        time.sleep(2)
        left = sorted(d.name for d in tmpdir.iterdir())
        print(f"after the worker's stop, left in its TMPDIR: {left or 'nothing'}")
        if a.json:
            data = json.loads(a.json.read_text())
            data["left_after_stop"] = left
            a.json.write_text(json.dumps(data, indent=1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in agents.values():
            stop_group(p, 10.0)
        try:
            if "worker" in locals() and isinstance(worker, subprocess.Popen) and worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
        except OSError:
            pass
        server.stop()
        if not a.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


if __name__ == "__main__":
    main()

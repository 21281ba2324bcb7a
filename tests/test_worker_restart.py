"""A worker that dies mid-stage and restarts: the stage is neither lost nor run twice.

Real processes throughout: a `qosflow agent` (one host, virtual GPUs), a `qosflow worker start`
*subprocess* on a `qosflow` pool that reads the agent from a cluster file, and a pipeline sent
through the session's Prefect server. The worker is SIGKILLed while its stage runs on the agent
(no clean-up, its lease stays in the qosflow store); a new worker process with the same name
starts, finds the lease, sees through the agent that the attempt still runs, adopts it instead of
launching it again, and releases the lease when it ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from procs import alive, marks, stop_groups

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
TOKEN = "restart-test-token-77aa"
POOL = "restart-agents"
WORKER = "restart-worker"




def start_worker(env: dict, log: Path, pool: str = POOL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool, "--name", WORKER],
                            env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def queued_here(pool: str) -> list:
    """The stage runs of `pool` that a worker holds in its QoS queue: Pending, labelled qosflow.queued_by."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING]))),
                                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
    return [fr for fr in runs if (fr.labels or {}).get("qosflow.queued_by") == WORKER]


def wait_log(log: Path, text: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < end, f"{text!r} not in the worker's log:\n{log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.2)


@contextmanager
def restart_lab(prefect_server: str, tmp_path: Path, pool: str, host: str):
    """One `qosflow agent` (2 virtual GPUs) named `host`, a FIFO `qosflow` pool `pool` that reaches it
    through a cluster file, and this test's own lease store. Yields a namespace: `env` for worker
    processes, `db`, `marker`, `wlog`, `procs` (worker processes, stopped at the end) and `start()`,
    which starts a worker process named WORKER and waits until it is set up."""
    from types import SimpleNamespace

    from qosflow.agent.testing import AgentProcess
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import setup_pool

    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = pypath
    db = f"sqlite:///{tmp_path / 'leases.db'}"  # this test's own store: its workers' and its reads
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": pypath, "QOSFLOW_LEASE_TTL_SECONDS": "6",
           "QOSFLOW_DATABASE_URL": db}
    lab = SimpleNamespace(env=env, db=db, marker=tmp_path / "marks.jsonl", wlog=tmp_path / "worker.log", procs=[])

    def start() -> subprocess.Popen:
        w = start_worker(env, lab.wlog, pool)
        lab.procs.append(w)
        return w

    lab.start = start
    with AgentProcess(host, TOKEN, virtual_gpus=2, args=["--cpu-cores", "2"], log=tmp_path / "agent.log") as agent:
        (tmp_path / "token").write_text(TOKEN + "\n")
        cluster = tmp_path / "restart.yaml"
        cluster.write_text(f"name: restart\ntoken_file: token\nheartbeat_s: 0.5\ngpus_per_host: 2\n"
                           f"hosts:\n  - {{name: {host}, agent_url: '{agent.url}'}}\n")
        asyncio.run(setup_pool(pool, policy=QoSPolicy(policy="fifo"), stream_output=False, cluster_file=str(cluster), env={"PYTHONPATH": pypath}))
        old_pool = os.environ.get("QOSFLOW_POOL")
        os.environ["QOSFLOW_POOL"] = pool
        try:
            yield lab
        finally:
            if old_pool is None:
                os.environ.pop("QOSFLOW_POOL", None)
            else:
                os.environ["QOSFLOW_POOL"] = old_pool
            stop_groups(lab.procs)


def not_finished(lab, tmp_path: Path) -> str:
    return (f"the pipeline did not finish after the restart; marks {marks(lab.marker)}\n"
            f"worker log:\n{lab.wlog.read_text(errors='replace')[-4000:]}\n"
            f"agent log:\n{(tmp_path / 'agent.log').read_text(errors='replace')[-2000:]}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_worker_killed_midstage_restarts_and_adopts_the_running_stage(prefect_server, tmp_path, sig):
    """SIGKILL: nothing is cleaned up. SIGTERM (or Ctrl-C): the worker stops cleanly, and a stage on a
    host agent keeps running with its lease for the next worker to adopt (it used to release the lease,
    and the stage's run stayed Running for ever with nobody watching it)."""
    import infra_pipelines as ip

    from qosflow.store.leases import LeaseStore, pool_key

    with restart_lab(prefect_server, tmp_path, POOL, "host-r") as lab:
        marker, wlog = lab.marker, lab.wlog
        w1 = lab.start()
        wait_log(wlog, "qosflow worker:", w1)
        out: dict = {}
        th = threading.Thread(target=lambda: out.setdefault("r", ip.agent_lost(str(marker), 12.0)), daemon=True)
        th.start()
        end = time.monotonic() + 150
        while not marks(marker):
            assert time.monotonic() < end and th.is_alive(), "the stage never started"
            time.sleep(0.1)
        store = LeaseStore(url=lab.db)
        KEY = pool_key(POOL, prefect_server)  # (the store keys a pool by its name and its Prefect server)
        end = time.monotonic() + 15  # (a CI run once read none just as the stage started: poll, and show the log if not)
        while not store.leases(KEY):
            assert time.monotonic() < end, f"no lease in the store: {wlog.read_text(errors='replace')[-3000:]}"
            time.sleep(0.2)
        [lease] = store.leases(KEY)
        from qosflow.store.leases import holder_name

        # held by this worker process: its name and its process instance (two processes never share one)
        assert holder_name(lease.holder) == WORKER and lease.holder != WORKER and lease.nodes == ["host-r"]
        os.killpg(w1.pid, sig)  # SIGKILL: the worker dies, nothing is cleaned up; SIGTERM: it stops
        w1.wait(60)
        assert [le.lease_id for le in store.leases(KEY)] == [lease.lease_id]  # its lease outlives it
        if sig == signal.SIGTERM:
            assert "keep running on their hosts with their leases" in wlog.read_text(errors="replace")
            # not killed by the stop: still running, or (a stop slower than the stage's 12 s on a loaded
            # machine) ended on its own, which it marks "done"; killed, it is neither
            ev = marks(marker)
            assert [e["event"] for e in ev][:1] == ["start"]
            assert "done" in [e["event"] for e in ev] or alive(ev[0]["pid"]), ev

        w2 = lab.start()
        wait_log(wlog, "recovery: adopted stage", w2)
        # the adopted stage takes its slot in the new worker's view: the old process's lease, synced in as
        # another holder's, is not in the way ('slot does not fit the current view (GPU 0/0 is busy ...)')
        assert "does not fit the current view" not in wlog.read_text(errors="replace")
        th.join(150)
        assert not th.is_alive(), not_finished(lab, tmp_path)
        assert out.get("r") == "host-r"
        ev = marks(marker)
        assert [e["event"] for e in ev] == ["start", "done"]  # ran once, was not relaunched
        assert ev[0]["attempt"] == lease.attempt_id
        end = time.monotonic() + 30
        while store.leases(KEY):  # the new worker released the adopted lease when the stage ended
            assert time.monotonic() < end, f"lease not released: {store.leases(KEY)}"
            time.sleep(0.2)


def test_a_stage_waiting_in_the_queue_of_a_killed_worker_runs_after_the_restart(prefect_server, tmp_path):
    """SIGKILL while one gang runs on the host and a second waits in the worker's QoS queue: the waiting
    stage's run was Pending with no lease, and no worker ever took it again (its pipeline waited for
    ever). The restarted worker adopts the running gang and puts the waiting one back in the pool's
    queue; it runs once, after the first, and the pipeline ends.

    The adopted gang's GPUs are busy in the new worker's view until it ends: they were not (the old
    process's lease, synced in as another worker's, made the adoption fail with 'slot does not fit the
    current view'; the next sync dropped that hold, and the second gang, placed on the GPUs that looked
    free, was refused its lease 'slot already leased ... held by restart-worker#...' and re-planned every
    ~70 ms, 54 times in one run, until the first ended)."""
    import infra_pipelines as ip

    pool = "restart-orphans"
    with restart_lab(prefect_server, tmp_path, pool, "host-o") as lab:
        marker = lab.marker
        w1 = lab.start()
        wait_log(lab.wlog, "qosflow worker:", w1)
        out: dict = {}
        th = threading.Thread(target=lambda: out.setdefault("r", ip.two_gangs(str(marker), 16.0)), daemon=True)
        th.start()
        end = time.monotonic() + 150
        # one gang runs; the other has reached the worker's QoS queue (Pending, labelled by the worker)
        while not (marks(marker) and queued_here(pool)):
            assert time.monotonic() < end and th.is_alive(), f"the stages never got going: {lab.wlog.read_text(errors='replace')[-3000:]}"
            time.sleep(0.1)
        first = marks(marker)[0]["stage"]
        os.killpg(w1.pid, signal.SIGKILL)
        w1.wait(60)
        w2 = lab.start()
        wait_log(lab.wlog, "was left Pending", w2)
        th.join(150)
        assert not th.is_alive(), not_finished(lab, tmp_path)
        assert sorted(out.get("r") or []) == ["a", "b"]
        ev = [(e["event"], e["stage"]) for e in marks(marker)]
        second = "b" if first == "a" else "a"
        assert ev == [("start", first), ("done", first), ("start", second), ("done", second)], ev  # each once, in turn
        text = lab.wlog.read_text(errors="replace")
        assert "does not fit the current view" not in text
        # the second gang waited in the QoS queue for the adopted one's GPUs; it was not placed on them
        assert "slot already leased" not in text, text[-3000:]


def test_worker_with_unreachable_kubernetes_api_stops_promptly_on_ctrl_c(prefect_server, tmp_path):
    """A worker whose Kubernetes API is unreachable (nothing listens at the block's api_url) keeps
    retrying its setup; Ctrl-C (SIGINT) must stop it promptly. It hung in 2 of 4 tries (minutes in
    asyncio's _cancel_all_tasks / anyio's cancellation delivery, or in Prefect's queue drain at exit)."""
    import socket

    from qosflow.prefect.blocks import KubernetesGPUCluster, QoSPolicy
    from qosflow.prefect.local import setup_pool

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    KubernetesGPUCluster(api_url=f"http://127.0.0.1:{port}").save("k-down-test", overwrite=True)
    pool = "k8s-down"
    asyncio.run(setup_pool(pool, policy=QoSPolicy(policy="fifo"), stream_output=False))
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "QOSFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'leases.db'}"}
    for i in range(3):
        log = tmp_path / f"worker{i}.log"
        p = subprocess.Popen([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool, "--cluster-block", "k-down-test",
                              "--name", f"k-down-{i}"], env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_log(log, "setup failed", p, timeout=90)
            time.sleep(1.0 + 2.5 * i)  # at several points of its retry cycle
            os.killpg(p.pid, signal.SIGINT)
            t0 = time.monotonic()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the worker did not stop within 20 s of SIGINT (try {i}):\n{log.read_text(errors='replace')[-3000:]}")
            assert time.monotonic() - t0 < 20
            assert f"qosflow worker on pool '{pool}' stopped" in log.read_text(errors="replace")  # (it ended without a word)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_a_second_worker_with_the_same_name_is_refused(prefect_server, tmp_path):
    """`qosflow worker start --name W` while a worker W is running on the pool: refused with an error
    naming the live worker and the fix (it used to adopt the live worker's leases, and the two re-planned
    'slot already leased ... held by W' every 60 ms)."""
    with restart_lab(prefect_server, tmp_path, "restart-dup", "host-d") as lab:
        w1 = lab.start()
        wait_log(lab.wlog, "qosflow worker:", w1)
        log2 = tmp_path / "second.log"
        w2 = start_worker(lab.env, log2, "restart-dup")
        lab.procs.append(w2)
        rc = w2.wait(90)
        text = log2.read_text(errors="replace")
        assert rc == 2, text[-3000:]
        assert f"a worker named '{WORKER}' is already running on pool" in text and "another --name, or stop that one first" in text
        assert "Traceback" not in text
        assert w1.poll() is None  # the first goes on


# ---------------------------------------------------------------------------------------- pipeline runs
def deployed_pipeline_run(pool: str, marker: Path, secs: float):
    """A run of the deployment `restart_pipelines.deployed` on `pool` (role pipeline: the worker starts it as a
    process on its own host; its stages go to the agent)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        flow_id = c.create_flow_from_name("restart-deployed")
        dep = c.create_deployment(flow_id=flow_id, name=f"on-{pool}", work_pool_name=pool, entrypoint="restart_pipelines.deployed",
                                  job_variables={"role": "pipeline", "env": {"QOSFLOW_POOL": pool}})
        return c.create_flow_run_from_deployment(dep, parameters={"marker": str(marker), "secs": secs}).id


def flow_run_state(fid):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return c.read_flow_run(fid).state


def wait_final(fid, lab, tmp_path: Path, timeout: float = 150.0):
    end = time.monotonic() + timeout
    while True:
        st = flow_run_state(fid)
        if st is not None and st.is_final():
            return st
        assert time.monotonic() < end, f"the pipeline run is still {st and st.name}: " + not_finished(lab, tmp_path)
        time.sleep(0.5)


def pipeline_started_and_stage_running(lab, w1, fid, timeout: float = 150.0) -> int:
    """Wait until the pipeline process runs stage a (on the agent); its pid."""
    end = time.monotonic() + timeout
    while True:
        ev = marks(lab.marker)
        if [e for e in ev if e["stage"] == "a" and e["event"] == "start"]:
            return next(e["pid"] for e in ev if e["stage"] == "pipeline")
        st = flow_run_state(fid)
        assert not (st and st.is_final()), f"the pipeline run ended {st.name}: {st.message}\n{lab.wlog.read_text(errors='replace')[-3000:]}"
        assert w1.poll() is None and time.monotonic() < end, f"stage a never started: {lab.wlog.read_text(errors='replace')[-3000:]}"
        time.sleep(0.2)


def stop_worker(w: subprocess.Popen, sig=signal.SIGTERM) -> None:
    os.killpg(w.pid, sig)
    w.wait(60)


def test_a_deployed_pipeline_run_outlives_a_worker_restart_and_completes(prefect_server, tmp_path):
    """A pipeline run deployed on an agents pool is a process on the worker's host. The worker stopped
    (systemd restart, an upgrade) killed it, and the run ended Crashed while its stage ran on ('Flow run
    infrastructure exited with non-zero status code -9'). It now keeps running, the restarted worker adopts
    it, and it completes with its stages, each run once."""
    pool = "restart-pipeline"
    with restart_lab(prefect_server, tmp_path, pool, "host-p") as lab:
        w1 = lab.start()
        wait_log(lab.wlog, "qosflow worker:", w1)
        fid = deployed_pipeline_run(pool, lab.marker, 12.0)
        pid = pipeline_started_and_stage_running(lab, w1, fid)
        stop_worker(w1)
        text = lab.wlog.read_text(errors="replace")
        assert "pipeline run(s) keep running on this host" in text and str(fid) in text, text[-3000:]
        assert alive(pid), f"the pipeline's process died with its worker:\n{text[-3000:]}"
        assert flow_run_state(fid).is_running()
        w2 = lab.start()
        wait_log(lab.wlog, f"recovery: adopted pipeline run {fid}", w2)
        st = wait_final(fid, lab, tmp_path)
        assert st.is_completed(), f"{st.name}: {st.message}\n" + not_finished(lab, tmp_path)
        ev = [(e["event"], e["stage"]) for e in marks(lab.marker)]
        assert sorted(ev) == sorted([("start", "pipeline"), ("start", "a"), ("done", "a"), ("start", "b"), ("done", "b"),
                                     ("done", "pipeline")]), ev  # the pipeline and each stage ran once
        assert all(e["pid"] == pid for e in marks(lab.marker) if e["stage"] == "pipeline")
        from qosflow.store.leases import LeaseStore, pool_key

        end = time.monotonic() + 20  # (its process exits after it reported its end; its record goes once the worker saw that)
        while alive(pid) or LeaseStore(url=lab.db).pipeline_processes(pool_key(pool, prefect_server)):
            assert time.monotonic() < end, f"the pipeline's process or its record stayed: alive {alive(pid)}"
            time.sleep(0.2)
        assert "is marked Crashed" not in lab.wlog.read_text(errors="replace")


def test_an_adopted_pipeline_run_can_be_cancelled(prefect_server, tmp_path):
    """Cancelling (the UI, `prefect flow-run cancel`) a pipeline run that the restarted worker adopted stops
    its process, which is not that worker's child, and the run ends Cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    pool = "restart-pipeline-cancel"
    with restart_lab(prefect_server, tmp_path, pool, "host-c") as lab:
        w1 = lab.start()
        wait_log(lab.wlog, "qosflow worker:", w1)
        fid = deployed_pipeline_run(pool, lab.marker, 120.0)
        pid = pipeline_started_and_stage_running(lab, w1, fid)
        os.killpg(w1.pid, signal.SIGINT)  # Ctrl-C twice, as an impatient admin does: the second one cuts its stop short
        time.sleep(0.5)
        if w1.poll() is None:
            os.killpg(w1.pid, signal.SIGINT)
        w1.wait(60)
        assert alive(pid), lab.wlog.read_text(errors="replace")[-3000:]
        w2 = lab.start()
        wait_log(lab.wlog, f"recovery: adopted pipeline run {fid}", w2)
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(fid, Cancelling(message="cancelled by the test"))
        end = time.monotonic() + 60
        while alive(pid):
            assert time.monotonic() < end, f"the adopted pipeline's process was not stopped:\n{lab.wlog.read_text(errors='replace')[-3000:]}"
            time.sleep(0.2)
        # (its engine, stopped by SIGTERM, reports Crashed 'aborted by a termination signal' before the worker marks
        # the run Cancelled, as for a cancelled stage: wait for the Cancelled)
        end = time.monotonic() + 60
        while (st := flow_run_state(fid)).type.value != "CANCELLED":
            assert time.monotonic() < end, f"{st.name}: {st.message}\n{lab.wlog.read_text(errors='replace')[-3000:]}"
            time.sleep(0.3)
        assert "the qosflow worker stopped the pipeline run" in (st.message or ""), st.message
        assert w2.poll() is None


def test_a_pipeline_whose_process_died_while_no_worker_ran_is_marked_crashed(prefect_server, tmp_path):
    """A pipeline process that dies (SIGKILL, the OOM killer) while its worker is stopped cannot report its
    end: its run stayed Running for ever. The restarted worker finds its process gone and marks it Crashed,
    saying why."""
    pool = "restart-pipeline-died"
    with restart_lab(prefect_server, tmp_path, pool, "host-k") as lab:
        w1 = lab.start()
        wait_log(lab.wlog, "qosflow worker:", w1)
        fid = deployed_pipeline_run(pool, lab.marker, 30.0)
        pid = pipeline_started_and_stage_running(lab, w1, fid)
        stop_worker(w1)
        os.killpg(pid, signal.SIGKILL)  # (its own session: its group is its pid)
        end = time.monotonic() + 10
        while alive(pid):
            assert time.monotonic() < end
            time.sleep(0.1)
        assert flow_run_state(fid).is_running()  # (nothing reported its end)
        w2 = lab.start()
        wait_log(lab.wlog, f"recovery: pipeline run {fid}", w2)
        st = wait_final(fid, lab, tmp_path, 60)
        assert st.is_crashed(), f"{st.name}: {st.message}"
        assert f"pid {pid}" in st.message and "ended while no qosflow worker watched it" in st.message, st.message
        assert "adopted pipeline run" not in lab.wlog.read_text(errors="replace")


@pytest.mark.parametrize("as_jobs", [True, False], ids=["job", "process"])
def test_a_deployed_pipeline_run_outlives_a_worker_restart_on_kubernetes(prefect_server, tmp_path, as_jobs):
    """The same on a Kubernetes pool (qosflow's API emulator running the pods' processes): the pipeline run keeps
    running across the worker's restart while its stage's pod runs on; the restarted worker adopts both and the
    pipeline completes. Since 2026-11-27 the pipeline run is a Kubernetes Job of its own ("job"; any worker of the pool
    adopts it: tests/test_k8s_pipelines.py); with QOSFLOW_K8S_PIPELINE_JOBS=0 it is a process on the worker's host,
    as before ("process")."""
    from qosflow.k8s_emulator import EmulatorServer, gpu_node
    from qosflow.prefect.blocks import KubernetesGPUCluster, QoSPolicy
    from qosflow.prefect.local import setup_pool

    pool = "restart-pipeline-k8s" if as_jobs else "restart-pipeline-k8s-proc"
    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": pypath, "QOSFLOW_LEASE_TTL_SECONDS": "6",
           "QOSFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'leases.db'}", "QOSFLOW_K8S_PIPELINE_JOBS": "1" if as_jobs else "0"}
    from types import SimpleNamespace

    lab = SimpleNamespace(marker=tmp_path / "marks.jsonl", wlog=tmp_path / "worker.log", procs=[])
    with EmulatorServer([gpu_node("gpu-0", 2)], run_processes=True) as emu:
        KubernetesGPUCluster(api_url=emu.url, namespace="default", image="python:3.11-slim").save("restart-k8s", overwrite=True)
        asyncio.run(setup_pool(pool, policy=QoSPolicy(policy="fifo"), stream_output=False, env={"PYTHONPATH": pypath}))

        def start() -> subprocess.Popen:
            w = subprocess.Popen([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool, "--name", WORKER,
                                  "--cluster-block", "restart-k8s"], env=env, stdout=open(lab.wlog, "ab"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
            lab.procs.append(w)
            return w

        try:
            w1 = start()
            wait_log(lab.wlog, "qosflow worker:", w1)
            assert "through the kubernetes backend" in lab.wlog.read_text(errors="replace")
            fid = deployed_pipeline_run(pool, lab.marker, 12.0)
            pid = pipeline_started_and_stage_running(lab, w1, fid)
            from kubernetes import client

            jobs = client.BatchV1Api(emu.api_client()).list_namespaced_job("default", label_selector=f"prefect.io/flow-run-id={fid}").items
            assert len(jobs) == (1 if as_jobs else 0), [j.metadata.name for j in jobs]  # (the pipeline's own Job, or none)
            stop_worker(w1)
            assert alive(pid), lab.wlog.read_text(errors="replace")[-3000:]
            w2 = start()
            wait_log(lab.wlog, f"recovery: adopted pipeline run {fid}", w2)
            end = time.monotonic() + 150
            while not (st := flow_run_state(fid)).is_final():
                assert time.monotonic() < end, f"still {st.name}: marks {marks(lab.marker)}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
                time.sleep(0.5)
            assert st.is_completed(), f"{st.name}: {st.message}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
            ev = sorted((e["event"], e["stage"]) for e in marks(lab.marker))
            assert ev == sorted([("start", "pipeline"), ("start", "a"), ("done", "a"), ("start", "b"), ("done", "b"), ("done", "pipeline")]), ev
        finally:
            stop_groups(lab.procs)

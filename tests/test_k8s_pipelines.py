"""Deployed pipeline runs on a Kubernetes pool run as Kubernetes Jobs, and survive a worker rollout.

Real processes: `qosflow worker start` subprocesses on a `qosflow` pool whose cluster is qosflow's Kubernetes
API emulator (EMULATED, no real cluster: its process kubelet runs each pod's command as a local process), the
session's Prefect server, and a deployment of `restart_pipelines.deployed` (role pipeline) whose stages take a
GPU each. Until 2026-11-27 such a pipeline run was a process on the worker's host, adopted only by a worker of
the same name on the same host: a rollout (a new pod, another host name) left it `Running` for ever. It is now
a Job of its own (no GPU, a small CPU/memory request) with a lease that books no slot, adopted by any worker of
the pool through the stages' recovery path.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from procs import alive, stop_groups
from test_worker_restart import flow_run_state, marks, pipeline_started_and_stage_running, stop_worker, wait_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
NS = "default"


@contextmanager
def k8s_lab(prefect_server: str, tmp_path: Path, pool: str):
    """An emulated cluster (one node, 2 GPUs, pods run as processes), a FIFO `qosflow` pool `pool` on it through a
    Kubernetes cluster block, this test's own lease store; `lab.start(name)` starts a worker process."""
    from qosflow.k8s_emulator import EmulatorServer, gpu_node
    from qosflow.prefect.blocks import KubernetesGPUCluster, QoSPolicy
    from qosflow.prefect.local import setup_pool

    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = pypath
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": pypath, "QOSFLOW_LEASE_TTL_SECONDS": "6",
           "QOSFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'leases.db'}"}
    env.pop("QOSFLOW_K8S_PIPELINE_JOBS", None)
    lab = SimpleNamespace(marker=tmp_path / "marks.jsonl", wlog=tmp_path / "worker.log", procs=[], db=env["QOSFLOW_DATABASE_URL"])
    block = f"{pool}-cluster"
    with EmulatorServer([gpu_node("gpu-0", 2)], run_processes=True) as emu:
        KubernetesGPUCluster(api_url=emu.url, namespace=NS, image="python:3.11-slim").save(block, overwrite=True)
        asyncio.run(setup_pool(pool, policy=QoSPolicy(policy="fifo"), stream_output=False, env={"PYTHONPATH": pypath}))

        def start(name: str) -> subprocess.Popen:
            w = subprocess.Popen([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool, "--name", name,
                                  "--cluster-block", block], env=env, stdout=open(lab.wlog, "ab"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
            lab.procs.append(w)
            return w

        from kubernetes import client

        lab.start, lab.emu = start, emu
        lab.batch, lab.core = client.BatchV1Api(emu.api_client()), client.CoreV1Api(emu.api_client())
        try:
            yield lab
        finally:
            stop_groups(lab.procs)


def run_pipeline(pool: str, marker: Path, secs: float, **job_variables):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        flow_id = c.create_flow_from_name("restart-deployed")
        dep = c.create_deployment(flow_id=flow_id, name=f"on-{pool}", work_pool_name=pool, entrypoint="restart_pipelines.deployed",
                                  job_variables={"role": "pipeline", "env": {"QOSFLOW_POOL": pool}, **job_variables})
        return c.create_flow_run_from_deployment(dep, parameters={"marker": str(marker), "secs": secs}).id


def pipeline_jobs(lab, fid) -> list:
    return [j for j in lab.batch.list_namespaced_job(NS, label_selector=f"prefect.io/flow-run-id={fid}").items
            if (j.metadata.labels or {}).get("qosflow.dev/role") == "pipeline"]


def wait_for(what: str, cond, lab, timeout: float = 150.0):
    end = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < end, f"{what}: marks {marks(lab.marker)}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
        time.sleep(0.3)
    return got


def final_state(fid, lab, timeout: float = 150.0):
    return wait_for("the pipeline run never ended", lambda: (st := flow_run_state(fid)) is not None and st.is_final() and st, lab, timeout)


def ran_once(lab) -> None:
    ev = sorted((e["event"], e["stage"]) for e in marks(lab.marker))
    assert ev == sorted([("start", "pipeline"), ("start", "a"), ("done", "a"), ("start", "b"), ("done", "b"), ("done", "pipeline")]), ev


def test_a_deployed_pipeline_runs_as_a_kubernetes_job_and_completes(prefect_server, tmp_path):
    """The pipeline run is a Job of the pool's namespace (labelled as stage Jobs are, role pipeline), with no GPU and the
    CPU/memory its job variables ask for; it completes, and its lease is released (it held no slot)."""
    pool = "k8s-pipe-job"
    with k8s_lab(prefect_server, tmp_path, pool) as lab:
        w = lab.start("k8s-pipe-w")
        wait_log(lab.wlog, "qosflow worker:", w)
        fid = run_pipeline(pool, lab.marker, 1.0, cpu_cores=0.5, mem_mb=300)
        [job] = wait_for("no Job for the pipeline run", lambda: pipeline_jobs(lab, fid), lab, 90)
        ctr = job.spec.template.spec.containers[0]
        assert ctr.command == ["python", "-m", "prefect.engine"] and ctr.image == "python:3.11-slim"
        assert ctr.resources.requests == {"cpu": "500m", "memory": "300Mi"}, ctr.resources
        assert not (ctr.resources.limits or {}) and job.spec.template.spec.affinity is None
        labels = job.metadata.labels
        assert labels["app.kubernetes.io/managed-by"] == "qosflow" and labels["prefect.io/flow-run-id"] == str(fid)
        st = final_state(fid, lab)
        assert st.is_completed(), f"{st.name}: {st.message}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
        ran_once(lab)
        pids = {e["pid"] for e in marks(lab.marker) if e["stage"] == "pipeline"}
        pods = lab.core.list_namespaced_pod(NS, label_selector=f"job-name={job.metadata.name}").items
        assert len(pods) == 1 and len(pids) == 1  # the pipeline ran in the Job's one pod (the emulator's process kubelet)
        assert f"pipeline run started as Kubernetes Job {job.metadata.name}" in lab.wlog.read_text(errors="replace")
        from qosflow.store.leases import LeaseStore, pool_key

        wait_for("the pipeline's lease stayed", lambda: not LeaseStore(url=lab.db).leases(pool_key(pool, prefect_server)), lab, 30)


def test_a_pipeline_job_survives_a_rollout_to_a_worker_of_another_name(prefect_server, tmp_path):
    """SIGTERM the worker while the pipeline's first stage runs (a Deployment's rollout stops the old pod), start one
    with ANOTHER --name (the new pod): it adopts the pipeline's Job once the old worker's lease expired, watches it to its
    end, and the pipeline and each stage ran once and completed. The old code ran the pipeline on the old worker's host,
    where no other worker ever looked at it."""
    pool = "k8s-pipe-rollout"
    with k8s_lab(prefect_server, tmp_path, pool) as lab:
        w1 = lab.start("k8s-old-pod")
        wait_log(lab.wlog, "qosflow worker:", w1)
        fid = run_pipeline(pool, lab.marker, 12.0)
        pid = pipeline_started_and_stage_running(lab, w1, fid)
        [job] = pipeline_jobs(lab, fid)
        stop_worker(w1)
        text = lab.wlog.read_text(errors="replace")
        assert "pipeline run(s) keep running as Kubernetes Jobs" in text and str(fid) in text, text[-3000:]
        assert alive(pid) and pipeline_jobs(lab, fid) and flow_run_state(fid).is_running()
        # `qosflow status` lists it with the pipeline processes: its Job, the worker that started it, no worker watching
        from qosflow.prefect.status import pipeline_processes
        from qosflow.store.leases import LeaseStore

        [p], note = pipeline_processes(pool, prefect_server, LeaseStore(url=lab.db))
        assert not note and (p.flow_run_id, p.worker, p.watched, p.job) == (str(fid), "k8s-old-pod", "no", f"{NS}/{job.metadata.name}"), p
        assert p.host == f"Kubernetes Job {NS}/{job.metadata.name}"
        w2 = lab.start("k8s-new-pod")
        wait_log(lab.wlog, f"recovery: adopted pipeline run {fid}", w2, timeout=90)
        # (taken over by the new pod's worker; read until its lease and its Prefect heartbeat both show it: on a loaded
        # machine the first read after the log line can find the adopted lease not yet renewed, watched 'no')
        wait_for("the new pod's worker never showed as watching the pipeline",
                 lambda: [(p.worker, p.watched) for p in pipeline_processes(pool, prefect_server, LeaseStore(url=lab.db))[0]]
                 == [("k8s-new-pod", "adopted")], lab, 60)
        st = final_state(fid, lab)
        assert st.is_completed(), f"{st.name}: {st.message}\n{lab.wlog.read_text(errors='replace')[-4000:]}"
        ran_once(lab)
        assert all(e["pid"] == pid for e in marks(lab.marker) if e["stage"] == "pipeline")
        assert [j.metadata.uid for j in pipeline_jobs(lab, fid)] == [job.metadata.uid]  # the same Job, never launched again
        assert "is marked Crashed" not in lab.wlog.read_text(errors="replace")


@pytest.mark.parametrize("adopted", [False, True], ids=["its-worker", "adopted-by-another"])
def test_cancelling_a_pipeline_run_deletes_its_job(prefect_server, tmp_path, adopted):
    """`prefect flow-run cancel` (Cancelling) on a pipeline run: its Job is deleted, its pod's process gets SIGTERM (the
    pipeline cancels the stage run it waited for) and the run ends Cancelled; also when a worker of another name adopted
    it after the one that started it stopped."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    pool = "k8s-pipe-cancel-adopted" if adopted else "k8s-pipe-cancel"
    with k8s_lab(prefect_server, tmp_path, pool) as lab:
        w = lab.start("k8s-cancel-w")
        wait_log(lab.wlog, "qosflow worker:", w)
        fid = run_pipeline(pool, lab.marker, 120.0)
        pid = pipeline_started_and_stage_running(lab, w, fid)
        assert pipeline_jobs(lab, fid)
        if adopted:
            stop_worker(w)
            w = lab.start("k8s-cancel-w2")
            wait_log(lab.wlog, f"recovery: adopted pipeline run {fid}", w, timeout=90)
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(fid, Cancelling(message="cancelled by the test"))
        wait_for("the pipeline's Job was not deleted", lambda: not pipeline_jobs(lab, fid), lab, 60)
        wait_for("the pipeline's process was not stopped", lambda: not alive(pid), lab, 60)
        st = wait_for("the run never ended Cancelled", lambda: (s := flow_run_state(fid)).type.value == "CANCELLED" and s, lab, 60)
        assert "the qosflow worker stopped the pipeline run" in (st.message or ""), st.message
        stage_pids = [e["pid"] for e in marks(lab.marker) if e["stage"] == "a"]
        wait_for("stage a's process ran on after its pipeline was cancelled", lambda: not any(alive(p) for p in stage_pids), lab, 60)
        assert w.poll() is None


def test_a_pipeline_whose_job_was_deleted_while_no_worker_ran_ends_crashed(prefect_server, tmp_path):
    """The pipeline's Job is deleted (kubectl delete job, a namespace clean-up) while no worker runs: its run cannot
    report its end and stayed Running. The next worker (another name) finds the Job gone and marks the run Crashed,
    naming the Job."""
    pool = "k8s-pipe-gone"
    with k8s_lab(prefect_server, tmp_path, pool) as lab:
        w1 = lab.start("k8s-gone-old")
        wait_log(lab.wlog, "qosflow worker:", w1)
        fid = run_pipeline(pool, lab.marker, 60.0)
        pid = pipeline_started_and_stage_running(lab, w1, fid)
        [job] = pipeline_jobs(lab, fid)
        stop_worker(w1)
        lab.batch.delete_namespaced_job(job.metadata.name, NS, propagation_policy="Background", grace_period_seconds=0)
        wait_for("the pipeline's process outlived its Job", lambda: not alive(pid), lab, 30)
        assert flow_run_state(fid).is_running()  # (nothing reported its end)
        w2 = lab.start("k8s-gone-new")
        st = final_state(fid, lab, 90)
        assert st.is_crashed(), f"{st.name}: {st.message}"
        assert f"Kubernetes Job {job.metadata.name}" in st.message and "while no qosflow worker watched it" in st.message, st.message
        assert w2.poll() is None

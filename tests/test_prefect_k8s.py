"""The qosflow worker on Kubernetes, end to end: real Prefect server, real flow runs, the official
`kubernetes` client against qosflow's API emulator (EMULATED: no real cluster exists here).

The emulator runs with `run_processes=True`: its kubelet runs each pod's container command (the
stage's `python -m prefect.engine`) as a local process with the pod's environment, so a stage's own
code really runs "in" a pod and its flow run completes; pod phases, exit codes and injected
failures (OOMKilled) come back through the same watch/list JSON a cluster serves. The same worker
code runs against a real cluster through a kubeconfig (docs/infrastructure.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from procs import marks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
POOL = "k8s-e2e"
#: the pool passes an API key to its stages, as a worker for Prefect Cloud does (the local server ignores it)
API_KEY = "pnu_qosflow-k8s-e2e-not-a-real-key"




@pytest.fixture(scope="module")
def k8s(prefect_server):
    from qosflow.k8s_emulator import EmulatorServer, gpu_node
    from qosflow.prefect.blocks import KubernetesGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = pypath
    with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)], run_processes=True) as emu:
        cluster = KubernetesGPUCluster(api_url=emu.url, namespace="default", image="python:3.11-slim", sharing="time-slicing")
        asyncio.run(setup_pool(POOL, cluster=cluster, policy=QoSPolicy(policy="fifo"), stream_output=False,
                              env={"PYTHONPATH": pypath, "PREFECT_API_KEY": API_KEY}))
        w = WorkerThread(POOL, max_infra_retries=1).wait_ready(120)
        old = os.environ.get("QOSFLOW_POOL")
        os.environ["QOSFLOW_POOL"] = POOL
        try:
            yield {"emu": emu, "worker": w}
        finally:
            if old is None:
                os.environ.pop("QOSFLOW_POOL", None)
            else:
                os.environ["QOSFLOW_POOL"] = old
            w.stop()


def test_stage_runs_in_a_pod_and_its_flow_run_completes(k8s, tmp_path):
    import infra_pipelines as ip

    from prefect.client.orchestration import get_client
    from qosflow.prefect.tasks import PipelineRun

    marker = tmp_path / "k8s.jsonl"
    node = ip.agent_lost(str(marker), 0.5)
    assert node in ("gpu-0", "gpu-1")  # QOSFLOW_NODE comes from the downward API (spec.nodeName)
    ev = marks(marker)
    assert [e["event"] for e in ev] == ["start", "done"] and ev[0]["node"] == node
    rec = next(iter(PipelineRun.finished[-1].stages.values()))
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(rec.flow_run_id)
    assert fr.state.is_completed() and fr.labels["qosflow.host"] == node
    # one batch/v1 Job for the stage, linked to its flow run, pinned to the node the policy chose
    from kubernetes import client

    batch = client.BatchV1Api(k8s["emu"].api_client())
    end = time.monotonic() + 60
    while True:  # the engine process exits a moment after it reported the flow run's end
        jobs = batch.list_namespaced_job("default", label_selector=f"prefect.io/flow-run-id={rec.flow_run_id}").items
        if len(jobs) != 1 or jobs[0].status.succeeded or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert len(jobs) == 1 and jobs[0].status.succeeded == 1
    pods = client.CoreV1Api(k8s["emu"].api_client()).list_namespaced_pod("default", label_selector=f"job-name={jobs[0].metadata.name}").items
    assert [p.spec.node_name for p in pods] == [node] and pods[0].status.phase == "Succeeded"
    # the stage reported 10 steps in its pod: they reached the worker through the pod's log (echoed, at
    # most two lines a second, the last always), and it learned the stage's step time from them
    w = k8s["worker"].worker
    # the worker told its backend its pool before the first launch: the Job and its pod carry it (two pools whose
    # blocks have one name, in one namespace, tell their stages apart by it: tests/test_k8s_two_pools.py)
    from qosflow.backends.kubernetes import LABEL_POOL, label_value

    assert jobs[0].metadata.labels[LABEL_POOL] == label_value(w._pool_key) == pods[0].metadata.labels[LABEL_POOL]
    end = time.monotonic() + 60
    while not any(r["flow_run_id"] == rec.flow_run_id for r in w.records):  # its bookkeeping follows the pod's exit
        assert time.monotonic() < end, "the worker never recorded the stage"
        time.sleep(0.1)
    est = w.scheduler.estimator
    assert est.flush(30)
    [row] = [h for h in est.store.stage_history() if h.stage_run_id == rec.flow_run_id]
    assert row.steps == 10 and row.step_time_s > 0, row
    # the API key reached the stage through a Secret: not in the Job (kubectl get job -o yaml), and the
    # stage's Secret is gone once the stage ended
    assert API_KEY not in json.dumps(client.ApiClient().sanitize_for_serialization(jobs[0]))
    [key_env] = [e for e in jobs[0].spec.template.spec.containers[0].env if e.name == "PREFECT_API_KEY"]
    assert key_env.value is None and key_env.value_from.secret_key_ref.key == "PREFECT_API_KEY"
    core = client.CoreV1Api(k8s["emu"].api_client())
    assert core.list_namespaced_secret("default", label_selector=f"prefect.io/flow-run-id={rec.flow_run_id}").items == []


def test_oomkilled_pod_becomes_a_clear_prefect_state(k8s, tmp_path):
    """Every pod of the stage is OOMKilled (an infrastructure failure): it is retried on another node,
    and when the retries run out its flow run ends with a message that says OOMKilled."""
    import infra_pipelines as ip

    from prefect.client.orchestration import get_client
    from qosflow.prefect.tasks import PipelineRun

    emu = k8s["emu"]
    emu.add_rule(fail="OOMKilled", selector="app.kubernetes.io/managed-by=qosflow", times=10, after_s=0.2)
    marker = tmp_path / "oom.jsonl"
    try:
        with pytest.raises(Exception):
            ip.agent_lost(str(marker), 30.0)
    finally:  # the rule's pods not used up here would be OOMKilled in the next test
        emu.clear_rules()
    rec = next(iter(PipelineRun.finished[-1].stages.values()))
    with get_client(sync_client=True) as c:
        end = time.monotonic() + 60
        while True:
            fr = c.read_flow_run(rec.flow_run_id)
            if fr.state.is_final() or time.monotonic() > end:
                break
            time.sleep(0.5)
    assert fr.state.is_final() and not fr.state.is_completed()
    assert "OOMKilled" in (fr.state.message or ""), fr.state.message


def test_api_unreachable_at_launch_waits_for_the_api_instead_of_crashing(k8s, tmp_path):
    """The Kubernetes API goes away while a stage is being placed: its launch fails with urllib3's
    MaxRetryError. That is an outage, not the stage's failure: the worker marks the cluster's nodes down
    (nothing is launched into the outage), the stage waits in the QoS queue, and it is launched and
    completes once the API answers again -- its flow run never Crashed, no retry of it used (the old
    worker let the exception reach Prefect: 'Failed to submit flow run', Crashed, pipeline failed)."""
    import threading

    import infra_pipelines as ip

    from prefect.client.orchestration import get_client
    from qosflow.prefect.tasks import PipelineRun

    w = k8s["worker"].worker
    conf = w._backend.api_client.configuration
    good = conf.host
    conf.host = "http://127.0.0.1:9"  # nothing listens there: connection refused, as with the emulator killed
    n_before = len(PipelineRun.finished)
    out: dict = {}
    marker = tmp_path / "outage.jsonl"

    def go():
        try:
            out["node"] = ip.agent_lost(str(marker), 0.5)
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc

    beats = [0]
    health = w._sync_health

    async def counted() -> None:  # (the worker's heartbeat, counted)
        await health()
        beats[0] += 1

    w._sync_health = counted
    t = threading.Thread(target=go, daemon=True)
    t.start()
    try:
        # the stage reached the worker and waits in its QoS queue during the outage; then two more heartbeats
        # of it (no fixed sleep: as long as that takes on a loaded machine, and no longer)
        end = time.monotonic() + 120
        while not (getattr(w, "outage", None) and w.scheduler.queued()):
            assert time.monotonic() < end and t.is_alive(), ("the stage never waited in the QoS queue during the outage", out)
            time.sleep(0.1)
        seen = beats[0]
        while beats[0] < seen + 2:
            assert time.monotonic() < end, "the worker's heartbeat stopped"
            time.sleep(0.1)
        assert t.is_alive() and not marks(marker), out  # the stage waits: it did not run, nor fail
        assert w.outage and w.scheduler.state.down.all() and w.scheduler.queued()
    finally:
        conf.host = good
        del w._sync_health
    t.join(120)
    assert not t.is_alive() and "error" not in out, out
    assert w.outage is None and not w.scheduler.state.down.any()
    rec = next(iter(PipelineRun.finished[n_before].stages.values()))
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(rec.flow_run_id)
        states = c.read_flow_run_states(rec.flow_run_id)
    assert fr.state.is_completed()
    assert not [s for s in states if s.type.value in ("CRASHED", "FAILED", "AWAITING_RETRY") or s.name == "AwaitingRetry"], [s.name for s in states]
    assert [e["event"] for e in marks(marker)] == ["start", "done"]

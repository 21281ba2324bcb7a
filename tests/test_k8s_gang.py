"""A gang spread over several Kubernetes pods, end to end: a real Prefect server (the session's), the qosflow worker
with the Kubernetes backend against qosflow's API emulator (EMULATED: no cluster; its process kubelet runs each pod's
command as a local process with the pod's environment, the downward API's values included), and pipelines whose one
stage is an 8-GPU gang on two 4-GPU nodes: one pod per node, each rank running `python -m qosflow.prefect.gang_rank`
(qosflow/prefect/gang_rank.py: ranks > 0 write their end label on the flow run, rank 0 waits for them before it
reports Completed).

Checked: the stage is one Indexed Job with two pods on the two nodes, each with its rank (the completion index, through
the downward API), the gang's size and hosts, and the gang command; both ranks ran, each in its own pod on its pod's
node; the run goes Completed only after the slower rank ended; a rank 1 that raises fails the run with its exception.
The same gang on host agents: tests/test_gang_completion.py."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from qosflow.prefect.tasks import qos_flow, qos_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
POOL = "k8s-gang-e2e"
NS = "default"
#: what each rank writes down of its environment
ENV_KEYS = ("QOSFLOW_GANG_RANK", "QOSFLOW_GANG_SIZE", "QOSFLOW_GANG_HOSTS", "QOSFLOW_NODE", "QOSFLOW_STAGE_ID", "JOB_COMPLETION_INDEX",
            "QOSFLOW_GPUS", "PREFECT__FLOW_RUN_ID")


# ------------------------------------------------------------------------------------------------ the stage (in its pods)
def _mark(marker: str, event: str, **more) -> None:
    import qosflow

    env = {k: os.environ.get(k) for k in ENV_KEYS}
    with open(marker, "a") as f:
        f.write(json.dumps({"event": event, "rank": env["QOSFLOW_GANG_RANK"], "pid": os.getpid(), "t": time.time(), "env": env,
                            "placement_node": qosflow.placement().node, **more}) + "\n")


def _after_rank_0_returned(marker: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(marker) as f:
                if any((e := json.loads(x)).get("event") == "end" and e.get("rank") == "0" for x in f if x.strip()):
                    return
        except OSError:
            pass
        time.sleep(0.1)


@qos_task(gpus=8, gang=True, cpu_cores=1, expected_duration=3)
def k8s_gang_stage(marker: str, late: float = 3.0, late_fails: bool = False) -> str:
    """Rank 0 returns at once; rank 1 `late` seconds after rank 0 returned, raising if `late_fails`."""
    rank = os.environ.get("QOSFLOW_GANG_RANK", "")
    _mark(marker, "start")
    if rank == "0":
        _mark(marker, "end")
        return "rank 0"
    _after_rank_0_returned(marker)
    time.sleep(late)
    if late_fails:
        _mark(marker, "raise")
        raise ValueError(f"rank {rank} failed late on Kubernetes")
    _mark(marker, "end")
    return f"rank {rank}"


@qos_flow(name="k8s-gang-e2e")
def k8s_gang_pipeline(marker: str, late: float = 3.0, late_fails: bool = False) -> str:
    return k8s_gang_stage(marker, late, late_fails)


# ------------------------------------------------------------------------------------------------ the lab
def marks(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def wait_for(cond, what: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < end, f"timed out after {timeout:g}s: {what}"
        time.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def k8s(prefect_server):
    from kubernetes import client

    from qosflow.k8s_emulator import EmulatorServer, gpu_node
    from qosflow.prefect.blocks import KubernetesGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    old_pypath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pypath  # (the emulator's pod processes inherit it, and find this module)
    try:
        with EmulatorServer([gpu_node("gpu-0", 4), gpu_node("gpu-1", 4)], run_processes=True) as emu:
            cluster = KubernetesGPUCluster(api_url=emu.url, namespace=NS, image="python:3.11-slim", sharing="time-slicing")
            asyncio.run(setup_pool(POOL, cluster=cluster, policy=QoSPolicy(policy="fifo"), stream_output=False,
                                   env={"PYTHONPATH": pypath}))
            w = WorkerThread(POOL, max_infra_retries=0).wait_ready(120)
            old_pool = os.environ.get("QOSFLOW_POOL")
            os.environ["QOSFLOW_POOL"] = POOL
            try:
                yield {"emu": emu, "worker": w, "batch": client.BatchV1Api(emu.api_client()), "core": client.CoreV1Api(emu.api_client())}
            finally:
                if old_pool is None:
                    os.environ.pop("QOSFLOW_POOL", None)
                else:
                    os.environ["QOSFLOW_POOL"] = old_pool
                w.stop()
    finally:
        if old_pypath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pypath


def _stage_run():
    """The flow run of the last pipeline's one stage, its states (oldest first) and its log."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from qosflow.prefect.tasks import PipelineRun

    [rec] = PipelineRun.finished[-1].stages.values()
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(rec.flow_run_id)
        states = sorted(c.read_flow_run_states(fr.id), key=lambda s: s.timestamp)
        logs = [x.message for x in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))]
        return fr, states, logs


def _stage_pods(k8s, fid) -> tuple[list, list]:
    """The stage's Job(s) and their pods, by the flow run's label (as `kubectl get jobs,pods -l ...`)."""
    sel = f"prefect.io/flow-run-id={fid}"
    jobs = k8s["batch"].list_namespaced_job(NS, label_selector=sel).items
    pods = k8s["core"].list_namespaced_pod(NS, label_selector=sel).items
    return jobs, pods


def _watching(k8s, pipeline, *args, **kw):
    """Run `pipeline` in this thread while another keeps the last view of every stage Job and pod (a failed attempt's
    Job is deleted with its pods: they are read as they were while they ran). (result or exception, {uid: job},
    {uid: pod})."""
    import threading

    jobs: dict = {}
    pods: dict = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                for j in k8s["batch"].list_namespaced_job(NS, label_selector="app.kubernetes.io/name=qosflow-stage").items:
                    jobs[j.metadata.uid] = j
                for p in k8s["core"].list_namespaced_pod(NS, label_selector="app.kubernetes.io/name=qosflow-stage").items:
                    pods[p.metadata.uid] = p
            except Exception:  # noqa: BLE001 - read again
                pass
            stop.wait(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        try:
            out = pipeline(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out = exc
        fr, _, _ = _stage_run()
        _worker_recorded(k8s, fr.id)  # (the pods' ends seen by the worker: and by this watch, before the Job's deletion)
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(10)
    fid = str(fr.id)
    return (out, {u: j for u, j in jobs.items() if (j.metadata.labels or {}).get("prefect.io/flow-run-id") == fid},
            {u: p for u, p in pods.items() if (p.metadata.labels or {}).get("prefect.io/flow-run-id") == fid})


def _check_pods(fid, jobs: dict, pods_seen: dict, ev: list[dict]) -> None:
    """One Indexed Job, two pods on the two nodes, each with its rank from the downward API, the gang's size and hosts,
    the gang command; each rank ran in its own pod, on that pod's node."""
    [job] = jobs.values()
    pods = list(pods_seen.values())
    assert len(pods) == 2, [(p.metadata.name, p.status.phase) for p in pods]
    assert job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism == 2 and job.spec.backoff_limit == 0
    nodes = sorted(p.spec.node_name for p in pods)
    assert nodes == ["gpu-0", "gpu-1"], nodes  # one pod per node (hostname anti-affinity)
    for pod in pods:
        [ctr] = pod.spec.containers
        assert ctr.command[:3] == ["python", "-m", "qosflow.prefect.gang_rank"], ctr.command
        assert ctr.resources.limits == {"nvidia.com/gpu": "4"}, ctr.resources  # (exclusive: whole GPUs, 4 per node)
        env = {e.name: e for e in ctr.env}
        assert env["QOSFLOW_GANG_SIZE"].value == "2" and env["QOSFLOW_GANG_HOSTS"].value in ("gpu-0,gpu-1", "gpu-1,gpu-0")
        assert env["QOSFLOW_GANG_RANK"].value_from.field_ref.field_path == \
            "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        assert env["QOSFLOW_NODE"].value_from.field_ref.field_path == "spec.nodeName"
        assert env["PREFECT__FLOW_RUN_ID"].value == str(fid)
    by_index = {p.metadata.annotations["batch.kubernetes.io/job-completion-index"]: p for p in pods}
    assert sorted(by_index) == ["0", "1"]
    starts = {e["rank"]: e for e in ev if e["event"] == "start"}
    assert sorted(starts) == ["0", "1"], ev  # both ranks ran, once each
    assert len({e["pid"] for e in starts.values()}) == 2
    for rank, e in starts.items():
        pod = by_index[rank]
        env = e["env"]
        # the rank's environment, as the kubelet made it from the pod's spec: its index, its node, the gang's size and hosts
        assert env["QOSFLOW_GANG_RANK"] == env["JOB_COMPLETION_INDEX"] == rank, env
        assert env["QOSFLOW_NODE"] == pod.spec.node_name, (env, pod.spec.node_name)
        assert env["QOSFLOW_GANG_SIZE"] == "2" and set(env["QOSFLOW_GANG_HOSTS"].split(",")) == {"gpu-0", "gpu-1"}, env
        assert env["QOSFLOW_GPUS"] == "8" and env["PREFECT__FLOW_RUN_ID"] == str(fid), env
        assert env["QOSFLOW_STAGE_ID"] == pod.metadata.annotations["qosflow.dev/stage-id"], env
        # its placement (QOSFLOW_PLACEMENT, `qosflow.placement()`) names its own node: the pods share one template, and
        # it named the first node on every rank
        assert e["placement_node"] == pod.spec.node_name, (rank, e["placement_node"], pod.spec.node_name)


def _worker_recorded(k8s, fid) -> None:
    w = k8s["worker"].worker
    wait_for(lambda: any(r["flow_run_id"] == str(fid) for r in w.records), "the worker's record of the gang's end", 60)


def test_a_gang_over_two_pods_completes_only_once_its_slower_rank_ended(k8s, tmp_path):
    """Rank 1 ends 6 s after rank 0 returned: the run goes Completed after rank 1's end, with rank 0's value, ran once
    (one RUNNING); rank 1's end label is on the run; both pods Succeeded, the Job complete."""
    marker = tmp_path / "marks.jsonl"
    out, jobs, pods = _watching(k8s, k8s_gang_pipeline, str(marker), 6.0)
    assert out == "rank 0", out
    fr, states, logs = _stage_run()
    ev = marks(marker)
    _check_pods(fr.id, jobs, pods, ev)
    end = {e["rank"]: e["t"] for e in ev if e["event"] == "end"}
    assert set(end) == {"0", "1"} and end["1"] - end["0"] > 3.0, ev
    [done] = [s for s in states if s.type.value == "COMPLETED"]
    assert fr.state.is_completed() and fr.run_count == 1
    assert done.timestamp.timestamp() >= end["1"], (done.timestamp, end)
    assert [s.type.value for s in states].count("RUNNING") == 1, [s.name for s in states]
    assert fr.labels.get("qosflow.gang.rank1.ended", "").startswith("ok@"), fr.labels
    assert any("every rank has ended (rank 0 waited" in m for m in logs), logs
    _worker_recorded(k8s, fr.id)
    jobs, pods = wait_for(lambda: (got := _stage_pods(k8s, fr.id)) and got[0] and got[0][0].status.succeeded == 2 and got,
                          "the gang's Job complete", 60)
    assert sorted(p.status.phase for p in pods) == ["Succeeded", "Succeeded"]


def test_a_failing_rank_1_pod_fails_the_run(k8s, tmp_path):
    """Rank 1 raises 2 s after rank 0 returned: the run ends Failed with rank 1's exception (never Completed, never
    Crashed over it), and the pipeline raises it; the gang's pods are stopped."""
    marker = tmp_path / "marks.jsonl"
    out, jobs, pods_seen = _watching(k8s, k8s_gang_pipeline, str(marker), 2.0, late_fails=True)
    assert isinstance(out, ValueError) and "rank 1 failed late on Kubernetes" in str(out), repr(out)
    fr, states, logs = _stage_run()
    _worker_recorded(k8s, fr.id)
    fr, states, logs = _stage_run()
    ev = marks(marker)
    _check_pods(fr.id, jobs, pods_seen, ev)
    kinds = [s.type.value for s in states]
    assert fr.state.is_failed(), (fr.state, kinds)
    assert fr.state.message.startswith("qosflow gang: rank 1 of 2 on gpu-"), fr.state.message
    assert "ValueError: rank 1 failed late on Kubernetes" in fr.state.message, fr.state.message
    assert "COMPLETED" not in kinds and "CRASHED" not in kinds and kinds.count("RUNNING") == 1, [s.name for s in states]
    assert any(e["event"] == "raise" and e["rank"] == "1" for e in ev), ev
    # the gang is stopped: no pod of it is left running (rank 1's ended Failed, or the worker deleted the Job first:
    # the run was Failed by rank 1 before its process exited)
    wait_for(lambda: all(p.status.phase not in ("Pending", "Running") for p in _stage_pods(k8s, fr.id)[1]),
             "the gang's pods stopped", 30)
    assert not any(p.status.phase == "Succeeded" for p in pods_seen.values()
                   if p.metadata.annotations["batch.kubernetes.io/job-completion-index"] == "1")


def test_each_pod_of_an_indexed_gang_job_reads_its_own_node_in_its_placement():
    """The manifest: QOSFLOW_NODE (downward API) comes first, and QOSFLOW_PLACEMENT's node is `$(QOSFLOW_NODE)`, which
    the kubelet expands per pod (the emulator's kubelet as a real one: `expand_env`); the rest of the placement is kept,
    its `$` escaped. A stage on one node keeps its plain placement."""
    from kubernetes import client

    from qosflow.backends.base import LaunchSpec
    from qosflow.backends.kubernetes import KubernetesBackend
    from qosflow.core.cluster import ClusterSpec, NodeSpec
    from qosflow.core.placement import Placement
    from qosflow.k8s_emulator.state import expand_env

    cluster = ClusterSpec((NodeSpec("n0", 4, virtual=True), NodeSpec("n1", 4, virtual=True)))
    be = KubernetesBackend(api_client=client.ApiClient(), image="img:1")
    gang = Placement("g$(x)", ((0, 0), (0, 1), (1, 0), (1, 1)), ((0, 1.0), (1, 1.0)))
    [job], _ = be.manifests(LaunchSpec("st-gang", ["true"], gang, cluster))
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert names[0] == "QOSFLOW_NODE" and names.index("QOSFLOW_PLACEMENT") > 0
    raw = next(e["value"] for e in env if e["name"] == "QOSFLOW_PLACEMENT")
    for node in ("n0", "n1"):
        plan = json.loads(expand_env(raw, {"QOSFLOW_NODE": node}))
        assert plan["node"] == node and plan["job_id"] == "g$(x)" and plan["nodes"] == ["n0", "n1"], plan
    ann = json.loads(job["spec"]["template"]["metadata"]["annotations"]["qosflow.dev/placement"])
    assert ann["node"] == "n0" and ann["job_id"] == "g$(x)"  # (the annotation: the plan as it was, valid JSON)
    [one], _ = be.manifests(LaunchSpec("st-one", ["true"], Placement("one", ((1, 0),), ((1, 1.0),)), cluster))
    env = one["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e["name"] for e in env][-2:] == ["QOSFLOW_NODE", "QOSFLOW_GANG_RANK"]  # (as before)
    assert json.loads(next(e["value"] for e in env if e["name"] == "QOSFLOW_PLACEMENT"))["node"] == "n1"

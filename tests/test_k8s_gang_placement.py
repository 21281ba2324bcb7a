"""Each rank of a gang over several Kubernetes pods reads its own node's placement (`qosflow.placement()`: its GPUs,
cpuset, cores, virtual GPUs), not the first node's.

A gang with the same share on each node was one Indexed Job: one pod template, whose QOSFLOW_PLACEMENT named the node
through `$(QOSFLOW_NODE)` (expanded per pod by the kubelet) but carried the first node's `gpus` and `cpuset` for every
rank: a rank on the second node read GPU indices and cores of the first node's part of the plan. Now a gang is one
Indexed Job only when its placement is the same on every node but for the node; otherwise one Job per node, each pod
with its own node's placement. Checked on the manifests (whatever node a pod may land on, among those its affinity
allows) and end to end on qosflow's API emulator (EMULATED: no cluster; with `run_processes` its kubelet runs each pod's
command as a local process with the pod's environment, the downward API's values included), where each rank's process
writes what `qosflow.placement()` tells it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client

from qosflow.backends.base import ExitKind, LaunchSpec, placement_env
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.placement import Placement
from qosflow.k8s_emulator.state import expand_env

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def _pods_env(job: dict) -> list[tuple[str, dict[str, str]]]:
    """(node, the environment the kubelet gives the container) for every node a pod of `job` may land on (its node
    affinity), the downward API's QOSFLOW_NODE being that node's name."""
    spec = job["spec"]["template"]["spec"]
    [term] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    out = []
    for node in term["matchExpressions"][0]["values"]:
        env: dict[str, str] = {}
        for e in spec["containers"][0]["env"]:
            if "value" in e:
                env[e["name"]] = expand_env(e["value"], env)
            elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                env[e["name"]] = node
        out.append((node, env))
    return out


def _check_each_rank_reads_its_node(be: KubernetesBackend, spec: LaunchSpec) -> list[dict]:
    """Every pod of the stage, wherever it lands, reads its own node's placement as `placement_env` makes it for that node
    (but CUDA_VISIBLE_DEVICES: the device plugin's on Kubernetes). The Jobs."""
    jobs, _ = be.manifests(spec)
    idx = {n.name: i for i, n in enumerate(spec.cluster.nodes)}
    seen = set()
    for job in jobs:
        for node, env in _pods_env(job):
            want = placement_env(spec.placement, spec.cluster, idx[node], spec.cpusets.get(idx[node]), requested_gpus=spec.requested_gpus)
            assert json.loads(env["QOSFLOW_PLACEMENT"]) == json.loads(want["QOSFLOW_PLACEMENT"]), (node, env["QOSFLOW_PLACEMENT"])
            for k in ("OMP_NUM_THREADS", "QOSFLOW_VIRTUAL_GPUS", "QOSFLOW_GPUS", "QOSFLOW_NODE"):
                assert env.get(k) == want.get(k), (node, k, env.get(k), want.get(k))
            seen.add(node)
    assert seen == {spec.cluster.nodes[i].name for i in spec.placement.nodes}
    return jobs


def test_each_rank_of_a_gang_reads_its_own_nodes_gpus_and_cpuset_in_its_placement():
    """Two GPUs on each of two nodes, GPUs 0,1 of n0 and 2,3 of n1, cores 0-3 of n0 and 8-11 of n1: one Job per node, each
    pod's placement its node's GPUs and cpuset (before: one Indexed Job, rank 1 read [0, 1] and cores 0-3). The same
    GPUs and cores on both nodes: still one Indexed Job (created in one step), each rank's placement right too. Nodes
    of which one has virtual GPUs: one Job per node (QOSFLOW_VIRTUAL_GPUS and the placement's virtual_gpus differ)."""
    cluster = ClusterSpec((NodeSpec("n0", 4, virtual=True), NodeSpec("n1", 4, virtual=True), NodeSpec("n2", 4)))
    be = KubernetesBackend(api_client=client.ApiClient(), image="img:1")
    diff = Placement("g", ((0, 0), (0, 1), (1, 2), (1, 3)), ((0, 4.0), (1, 4.0)))
    jobs = _check_each_rank_reads_its_node(be, LaunchSpec("st-diff", ["x"], diff, cluster, cpusets={0: [0, 1, 2, 3], 1: [8, 9, 10, 11]}))
    assert len(jobs) == 2 and all("completionMode" not in j["spec"] for j in jobs)
    ranks = sorted(next(e["value"] for e in j["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "QOSFLOW_GANG_RANK")
                   for j in jobs)
    assert ranks == ["0", "1"]
    # the same GPUs, but the cores differ: one Job per node too
    same_gpus = Placement("g", ((0, 0), (0, 1), (1, 0), (1, 1)), ((0, 4.0), (1, 4.0)))
    jobs = _check_each_rank_reads_its_node(be, LaunchSpec("st-cpus", ["x"], same_gpus, cluster, cpusets={0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}))
    assert len(jobs) == 2
    # everything alike but the node: one Indexed Job, as before
    jobs = _check_each_rank_reads_its_node(be, LaunchSpec("st-same", ["x"], same_gpus, cluster, cpusets={0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}))
    [job] = jobs
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    # a node of virtual GPUs and one of real ones
    mixed = Placement("g", ((1, 0), (1, 1), (2, 0), (2, 1)), ((1, 2.0), (2, 2.0)))
    assert len(_check_each_rank_reads_its_node(be, LaunchSpec("st-mixed", ["x"], mixed, cluster))) == 2


RANK_SCRIPT = """
import json, os, sys
import qosflow
p = qosflow.placement()
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"rank": os.environ.get("QOSFLOW_GANG_RANK"), "pod_node": os.environ.get("QOSFLOW_NODE"),
                        "node": p.node, "gpus": list(p.gpus), "cpuset": list(p.cpuset), "cpu_cores": p.cpu_cores}) + "\\n")
"""


def test_on_the_emulator_each_ranks_process_reads_its_own_nodes_placement(tmp_path):
    """The gang launched through the backend on the emulator, whose kubelet runs each pod's command with the pod's
    environment: each rank's `qosflow.placement()` gives its own pod's node, that node's GPUs and its cpuset."""
    import asyncio

    from qosflow.k8s_emulator import EmulatorServer, gpu_node

    out = tmp_path / "ranks.jsonl"
    pypath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pypath  # (the emulator's pod processes inherit it, and import qosflow)
    try:
        with EmulatorServer([gpu_node("gpu-0", 4), gpu_node("gpu-1", 4)], run_processes=True) as emu:
            be = KubernetesBackend(api_client=emu.api_client(), namespace="default", image="python:3.11-slim", watch_nodes=False,
                                   watch_pods=False)

            async def go():
                cluster = await be.inventory()
                i0, i1 = cluster.index_of("gpu-0"), cluster.index_of("gpu-1")
                p = Placement("g", ((i0, 0), (i0, 1), (i1, 2), (i1, 3)), ((i0, 2.0), (i1, 2.0)))
                spec = LaunchSpec("st-ranks", [sys.executable, "-c", RANK_SCRIPT, str(out)], p, cluster,
                                  cpusets={i0: [0, 1], i1: [6, 7]})
                try:
                    st = await asyncio.wait_for(be.wait(await be.launch(spec)), 90)
                finally:
                    await be.aclose()
                return st

            st = asyncio.run(go())
        assert st.kind is ExitKind.OK, st
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    end = time.monotonic() + 10
    while len(lines := [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []) < 2:
        assert time.monotonic() < end, lines
        time.sleep(0.1)
    by_node = {r["pod_node"]: r for r in lines}
    assert sorted(by_node) == ["gpu-0", "gpu-1"] and sorted(r["rank"] for r in lines) == ["0", "1"], lines
    assert by_node["gpu-0"]["node"] == "gpu-0" and by_node["gpu-0"]["gpus"] == [0, 1] and by_node["gpu-0"]["cpuset"] == [0, 1], lines
    assert by_node["gpu-1"]["node"] == "gpu-1" and by_node["gpu-1"]["gpus"] == [2, 3] and by_node["gpu-1"]["cpuset"] == [6, 7], lines
    assert all(r["cpu_cores"] == 2.0 for r in lines), lines

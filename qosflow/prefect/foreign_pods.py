"""Book in the worker's plan what the pods that are not qosflow's stages take on each Kubernetes node
(`qosflow.backends.k8s_usage`): one hold per node (`PODS_HOLD` + node name), as another worker's lease or an agent
pipeline run's cores are held, so that no stage is placed into room kube-scheduler gives to those pods (the stage's pod
stayed Unschedulable, then failed as INFRA). Updated at every reading: a pod that ends takes its part of the hold with
it. GPUs are booked as a count on the node (Kubernetes does not say which devices a pod got): free ones are picked.
What does not fit the plan now (the node's room is the plan's stages', or a node down) is booked as far as it fits and
the rest at a later reading."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from qosflow.prefect.cluster_table import PODS_HOLD

log = logging.getLogger("qosflow.prefect.worker")


def book_foreign_pods(sched: Any, usage: Mapping[str, Any], booked: dict[str, tuple]) -> bool:
    """Make the scheduler's holds `PODS_HOLD` + node match `usage` (node name -> `NodePodUsage`). `booked`: node name ->
    (amounts wanted, amounts booked) as of the last call, kept by the caller. True if some room was given back (wake
    the scheduler)."""
    from qosflow.core.cluster import PlacementError
    from qosflow.core.placement import Placement
    from qosflow.core.qos import QoSSpec

    st = sched.state
    idx = {n.name: i for i, n in enumerate(sched.cluster.nodes)}
    freed = False
    for name in list(booked):
        if name not in usage or name not in idx:
            if PODS_HOLD + name in st.allocs:
                sched.unhold(PODS_HOLD + name)
            booked.pop(name, None)
            freed = True
    for name, u in usage.items():
        i = idx.get(name)
        if i is None:
            continue  # (a node outside the plan: not of the node selector)
        key = PODS_HOLD + name
        want = u.amounts()
        prev = booked.get(name)
        held = st.allocs.get(key)
        if prev is not None and prev[0] == want and prev[1] == want and held is not None and set(held.nodes) == {i}:
            continue
        if held is not None:
            sched.unhold(key)
            freed = True
        gpus_w, cpu_w, mem_w = want
        down = bool(st.down[i])
        if down:  # (booked on a node down too: it is there when the node is back)
            st.set_node_down(i, False)
        try:
            free_gpus = [int(g) for g in st.empty_gpus_on(i)]
            gpus = tuple((i, g) for g in free_gpus[:gpus_w])
            cpu = max(0.0, min(cpu_w, float(st.cpu_free[i])))
            mem = max(0.0, min(mem_w, float(st.mem_free[i])))
            got = (len(gpus), round(cpu, 6), round(mem, 3))
            if got == (0, 0.0, 0.0):
                booked[name] = (want, got)
                continue
            p = Placement(key, gpus, ((i, cpu),), mem_mb=mem, extra={"pods": u.pods, "names": u.names})
            try:
                if not sched.hold(key, p, QoSSpec(gpus=len(gpus), cpu_cores=max(cpu, 0.001))):
                    got = (0, 0.0, 0.0)
            except (PlacementError, ValueError) as exc:
                log.debug("pods on %s: not booked (%s)", name, exc)
                got = (0, 0.0, 0.0)
        finally:
            if down:
                st.set_node_down(i, True)
        if got != want and (prev is None or prev[1] != got):
            log.debug("node %s: the pods that are not qosflow's stages (%d: %s) request %d GPU(s), %g cores, %g MiB; %d, %g, %g "
                      "booked (the rest is the plan's stages' now)", name, u.pods, ", ".join(u.names), *want, *got)
        booked[name] = (want, got)
    return freed

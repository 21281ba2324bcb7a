"""Book in the worker's plan what the pods that are not qosflow's stages take on each Kubernetes node
(`qosflow.backends.k8s_usage`): one hold per node (`PODS_HOLD` + node name), as another worker's lease or an agent
pipeline run's cores are held, so that no stage is placed into room kube-scheduler gives to those pods (the stage's pod
stayed Unschedulable, then failed as INFRA). Updated at every reading: a pod that ends takes its part of the hold with
it. Whole GPUs are booked as a count on the node (Kubernetes does not say which devices a pod got): free ones are
picked. A pod's share of a GPU (`k8s_usage.gpu_use`: a slice of the NVIDIA shared resource, another qosflow pool's
fractional stage, Alibaba gpushare's GPU memory) is booked as that fraction of one GPU, in a hold of its own
(`PODS_HOLD` + node + "/share<n>"), on the device its convention names, else on one the plan picks.
What does not fit the plan now (the node's room is the plan's stages', or a node down) is booked as far as it fits and
the rest at a later reading."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from qosflow.prefect.cluster_table import PODS_HOLD

log = logging.getLogger("qosflow.prefect.worker")


#: (node, its replicas label) said already: slices booked as whole GPUs are logged once per node and label value, not
#: again when the number of slices there changes (it was at each new count: a line per notebook started or stopped)
_SAID: dict[tuple[str, Any], None] = {}


def _say(name: str, label: Any, why: str) -> None:
    if (name, label) in _SAID:
        return
    if len(_SAID) > 4096:
        _SAID.clear()
    _SAID[(name, label)] = None
    # (a warning: under Prefect's logging configuration the root logger's level is WARNING, and this logger's INFO was
    # never shown by a worker)
    log.warning("node %s: %s", name, why)


def _share_gpus(st: Any, i: int, dev: int) -> list[int]:
    """The GPUs of node `i` to try for a share of the pods there, in order: the device its convention names (if the
    node has it), then GPUs holding shares already (the fullest first: whole GPUs stay free for whole-GPU stages), then
    empty ones."""
    exists = [int(g) for g in st.exists[i].nonzero()[0]]
    shared = sorted((g for g in exists if st.njobs[i, g] > 0 and st.whole[i, g] == 0), key=lambda g: int(st.milli_free[i, g]))
    empty = [g for g in exists if st.njobs[i, g] == 0]
    first = [dev] if dev in exists else []
    return first + [g for g in shared + empty if g != dev]


def book_foreign_pods(sched: Any, usage: Mapping[str, Any], booked: dict[str, tuple]) -> bool:
    """Make the scheduler's holds `PODS_HOLD` + node match `usage` (node name -> `NodePodUsage`): the whole GPUs, cores
    and memory in that hold, and each GPU share in a hold of its own (`PODS_HOLD` + node + "/share<n>": a fraction of
    one GPU, `k8s_usage.node_shares`: on the device the pod's convention names, else on one the plan picks, packed
    with other shares). `booked`: node name -> (amounts wanted, amounts booked, hold keys) as of the last call, kept by
    the caller. True if some room was given back (wake the scheduler)."""
    from qosflow.backends.k8s_usage import ANY_GPU, REPLICAS_LABEL, node_shares
    from qosflow.core.cluster import PlacementError
    from qosflow.core.placement import Placement
    from qosflow.core.qos import QoSSpec

    st = sched.state
    idx = {n.name: i for i, n in enumerate(sched.cluster.nodes)}
    freed = False

    def unhold_all(name: str) -> bool:
        prev = booked.get(name)
        keys = (PODS_HOLD + name,) + (tuple(prev[2]) if prev is not None and len(prev) > 2 else ())
        gone = False
        for k in keys:
            if k in st.allocs:
                sched.unhold(k)
                gone = True
        return gone

    for name in list(booked):
        if name not in usage or name not in idx:
            unhold_all(name)
            booked.pop(name, None)
            freed = True
    for name, u in usage.items():
        i = idx.get(name)
        if i is None:
            continue  # (a node outside the plan: not of the node selector)
        key = PODS_HOLD + name
        labels = getattr(sched.cluster.nodes[i], "labels", None) or {}
        whole_w, shares_w, why = node_shares(u, labels)
        want = (whole_w, round(u.cpu, 6), round(u.mem_mb, 3), shares_w)
        prev = booked.get(name)
        if (prev is not None and prev[0] == want and prev[1] == want and prev[2]
                and all(k in st.allocs and set(st.allocs[k].nodes) == {i} for k in prev[2])):
            continue
        if unhold_all(name):
            freed = True
        if why and sched.cluster.nodes[i].gpus > 0:
            _say(name, labels.get(REPLICAS_LABEL), why)
        elif why:  # (a node of no GPU in the plan, a CPU-only one: no GPU is booked there, whole or shared; nothing to warn of)
            log.debug("node %s has no GPU in the plan: the %d slice(s) of the shared GPU resource its pods ask for book nothing",
                      name, u.slices)
        gpus_w, cpu_w, mem_w = whole_w, want[1], want[2]
        down = bool(st.down[i])
        if down:  # (booked on a node down too: it is there when the node is back)
            st.set_node_down(i, False)
        keys: list[str] = []
        got_shares: list[tuple[int, int]] = []
        try:
            # shares on a device their pods name first (no whole-GPU pod is booked there), then the whole GPUs, then
            # the shares whose device is not said (packed on the GPUs holding shares)
            known = [sh for sh in shares_w if sh[0] != ANY_GPU]
            anyg = [sh for sh in shares_w if sh[0] == ANY_GPU]
            n_share = 0

            def book_share(dev: int, milli: int) -> None:
                nonlocal n_share
                for g in _share_gpus(st, i, dev):
                    skey = f"{key}/share{n_share}"
                    p = Placement(skey, ((i, g),), (), gpu_milli=milli, extra={"pods": u.pods, "names": u.names, "share_of": dev})
                    try:
                        ok = sched.hold(skey, p, QoSSpec(gpus=1, gpu_milli=milli, cpu_cores=0.001))
                    except (PlacementError, ValueError) as exc:
                        log.debug("pods on %s: a share of %d/1000 not booked on GPU %d (%s)", name, milli, g, exc)
                        ok = False
                    if ok:
                        keys.append(skey)
                        got_shares.append((dev, milli))
                        n_share += 1
                        return

            for dev, milli in known:
                book_share(dev, milli)
            free_gpus = [int(g) for g in st.empty_gpus_on(i)]
            gpus = tuple((i, g) for g in free_gpus[:gpus_w])
            cpu = max(0.0, min(cpu_w, float(st.cpu_free[i])))
            mem = max(0.0, min(mem_w, float(st.mem_free[i])))
            got_main = (len(gpus), round(cpu, 6), round(mem, 3))
            if got_main != (0, 0.0, 0.0):
                p = Placement(key, gpus, ((i, cpu),), mem_mb=mem, extra={"pods": u.pods, "names": u.names})
                try:
                    if sched.hold(key, p, QoSSpec(gpus=len(gpus), cpu_cores=max(cpu, 0.001))):
                        keys.insert(0, key)
                    else:
                        got_main = (0, 0.0, 0.0)
                except (PlacementError, ValueError) as exc:
                    log.debug("pods on %s: not booked (%s)", name, exc)
                    got_main = (0, 0.0, 0.0)
            for dev, milli in anyg:
                book_share(dev, milli)
        finally:
            if down:
                st.set_node_down(i, True)
        got = (*got_main, tuple(sorted(got_shares)))
        if got != want and (prev is None or prev[1] != got):
            log.debug("node %s: the pods that are not qosflow's stages (%d: %s) request %d GPU(s), %g cores, %g MiB, GPU shares %s; "
                      "%d, %g, %g, %s booked (the rest is the plan's stages' now)", name, u.pods, ", ".join(u.names), *want, *got)
        booked[name] = (want, got, tuple(keys))
    return freed

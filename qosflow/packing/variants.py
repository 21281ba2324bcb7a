"""Derived pod lists, to check that a packing policy's gain is not specific to one list.

The FGD paper (ATC'23, section 6) evaluates on variants of the Alibaba default list: more
GPU-sharing pods, more multi-GPU pods, pods constrained to GPU models, more or fewer CPU-only
pods. Those files are not in our shared data, so we derive variants of the same kinds ourselves,
by resampling the pods of a list (every pod is a copy of one in the list, or the same with a GPU
model constraint added):

* ``gpushare``: GPU-sharing pods are ``level`` of the GPU pods (by count);
* ``multigpu``: multi-GPU pods carry ``level`` of the GPU demand;
* ``gpuspec``: ``level`` of the GPU pods accept only one GPU model, drawn in proportion to the
  GPUs of that model in the cluster;
* ``cpu``: the CPU-only pods scaled by ``level`` (0.5: half as many).

The total GPU demand stays that of the original list (so the arrival procedure inflates them the
same way). Deterministic for a seed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.model import MILLI, Node, Pod

KINDS = ("gpushare", "multigpu", "gpuspec", "cpu")


def derive_pod_list(
    pods: Sequence[Pod], kind: str, level: float, seed: int = 0, nodes: Sequence[Node] | None = None
) -> list[Pod]:
    """A variant of ``pods`` (see the module docstring); ``nodes`` is needed for ``gpuspec``."""
    if kind not in KINDS:
        raise SpecError("kind", f"unknown variant {kind!r}; use one of {', '.join(KINDS)}")
    if level < 0 or (kind != "cpu" and level > 1):
        raise SpecError("level", f"{level} is out of range for {kind}")
    rng = np.random.default_rng(seed)
    cpu = [p for p in pods if p.num_gpu == 0]
    share = [p for p in pods if p.is_fractional]
    single = [p for p in pods if p.num_gpu == 1 and p.gpu_milli == MILLI]
    multi = [p for p in pods if p.num_gpu > 1]
    demand = sum(p.total_gpu_milli for p in pods)

    def draw(pool: list[Pod], target: float) -> list[Pod]:
        if not pool:
            raise SpecError("pods", f"the list has no pods of the kind the {kind} variant needs")
        out: list[Pod] = []
        total = 0
        while total < target:
            p = pool[int(rng.integers(len(pool)))]
            out.append(p)
            total += p.total_gpu_milli
        return out

    if kind == "gpushare":
        whole = single + multi
        if not share or not whole:
            raise SpecError("pods", "the gpushare variant needs both shared and whole-GPU pods")
        m_share = np.mean([p.total_gpu_milli for p in share])
        m_whole = np.mean([p.total_gpu_milli for p in whole])
        n = demand / (level * m_share + (1 - level) * m_whole)
        out = [share[i] for i in rng.integers(len(share), size=int(round(n * level)))]
        out += [whole[i] for i in rng.integers(len(whole), size=int(round(n * (1 - level))))]
        out += cpu
    elif kind == "multigpu":
        out = draw(multi, level * demand) + draw(share + single, (1 - level) * demand) + cpu
    elif kind == "gpuspec":
        if not nodes:
            raise SpecError("nodes", "the gpuspec variant needs the node list (GPU models and counts)")
        models = sorted({n.model for n in nodes if n.num_gpu})
        weight = np.array([sum(n.num_gpu for n in nodes if n.model == m) for m in models], dtype=float)
        out = list(pods)
        for i, p in enumerate(out):
            if p.num_gpu and rng.random() < level:
                out[i] = replace(p, gpu_spec=(models[int(rng.choice(len(models), p=weight / weight.sum()))],))
    else:  # cpu
        out = share + single + multi + [cpu[i] for i in rng.integers(len(cpu), size=int(round(len(cpu) * level)))]
    return [replace(p, name=f"{kind}{level:g}-{j}") for j, p in enumerate(out)]

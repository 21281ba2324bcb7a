"""A synthetic cluster and pod list for the packing tests (imported by the test modules)."""

from __future__ import annotations

import numpy as np

from qosflow.packing import MILLI, Node, Pod


def synthetic_cluster(seed: int = 0, n_nodes: int = 30, n_pods: int = 400) -> tuple[list[Pod], list[Node]]:
    """Mixed GPU models, CPU-only pods, shares, whole and multi-GPU pods, some model-constrained."""
    rng = np.random.default_rng(seed)
    kinds = [("A", 8, 96000, 393216), ("B", 2, 104000, 524288), ("C", 4, 32000, 131072)]
    nodes = []
    for i in range(n_nodes):
        model, g, cpu, mem = kinds[i % len(kinds)]
        nodes.append(Node(f"n{i:03d}", cpu, mem, g, model))
    pods = []
    for i in range(n_pods):
        r = rng.random()
        cpu = int(rng.choice([2000, 4000, 8000, 12000]))
        mem = int(rng.choice([4096, 16384, 32768]))
        spec: tuple[str, ...] = ()
        if rng.random() < 0.15:
            spec = ("B",) if rng.random() < 0.5 else ("A", "C")
        if r < 0.1:
            pods.append(Pod(f"p{i}", cpu, mem))
        elif r < 0.55:
            pods.append(Pod(f"p{i}", cpu, mem, 1, int(rng.choice([100, 250, 460, 500, 810])), spec))
        elif r < 0.85:
            pods.append(Pod(f"p{i}", cpu, mem, 1, MILLI, spec))
        else:
            pods.append(Pod(f"p{i}", cpu, mem, int(rng.choice([2, 4, 8])), MILLI, spec))
    return pods, nodes

"""Which job types should share GPUs: the fluid-optimal pairing plan.

Given the work queued per job type and the predicted slowdown of every pair of types, a small
linear program finds how to split GPU-time between running types alone and in pairs so that all
work is done in the least GPU-time (the fluid relaxation of the makespan problem). Its pairs
(those carrying flow) form the *pairing plan*: the types that complement each other given the
whole mix, not just the best partner for one job at one moment. For example, with many
VGG-like jobs that only ResNet-like partners tolerate, the plan keeps the ResNet jobs for them
instead of letting a greedy rule pair ResNets among themselves.
"""

from __future__ import annotations

import itertools
from typing import Callable, Mapping

import numpy as np


def pairing_plan(
    work: Mapping[str, float],
    slowdown: Callable[[str, str], tuple[float, float]],
    *,
    min_share: float = 0.01,
) -> tuple[dict[tuple[str, str], float], dict[str, float], float]:
    """Solve the fluid LP.

    `work`: GPU-seconds of (solo) work queued per type; `slowdown(a, b)` -> (xi_a, xi_b) when a and b
    share. Returns (pair -> share of GPU-time, type -> share of GPU-time alone, speed-up over running
    everything alone). Pairs are keyed with sorted names.
    """
    from scipy.optimize import linprog

    types = sorted(t for t, w in work.items() if w > 0)
    if not types:
        return {}, {}, 1.0
    pairs = list(itertools.combinations_with_replacement(types, 2))
    n_single, n = len(types), len(types) + len(pairs)
    a_ub = np.zeros((len(types), n))
    for i in range(n_single):
        a_ub[i, i] = -1.0
    for k, (a, b) in enumerate(pairs):
        xa, xb = slowdown(a, b)
        xa, xb = max(1.0, xa), max(1.0, xb)
        ia, ib = types.index(a), types.index(b)
        a_ub[ia, n_single + k] -= 1.0 / xa
        a_ub[ib, n_single + k] -= 1.0 / xb
    b_ub = -np.array([work[t] for t in types], dtype=float)
    res = linprog(np.ones(n), A_ub=a_ub, b_ub=b_ub, bounds=[(0, None)] * n, method="highs")
    if not res.success:
        return {}, {t: 1.0 / len(types) for t in types}, 1.0
    total = float(res.x.sum())
    if total <= 0:  # (work too small for the solver's tolerance: nothing to plan; was 0/0, NaN shares and a warning)
        return {}, {}, 1.0
    plan = {p: float(res.x[n_single + k]) / total for k, p in enumerate(pairs) if res.x[n_single + k] / total >= min_share}
    alone = {t: float(res.x[i]) / total for i, t in enumerate(types) if res.x[i] / total >= min_share}
    speedup = float(sum(work.values()) / total) if total > 0 else 1.0
    return plan, alone, speedup

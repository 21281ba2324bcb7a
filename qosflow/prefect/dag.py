"""A pipeline's stage DAG: split a pipeline deadline into stage deadlines along the critical path,
and forecast the pipeline's completion time (with its uncertainty) as stages finish."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass
class StageNode:
    name: str
    expected: float
    deps: tuple[str, ...] = ()
    spread: float = 0.0  # one standard deviation of `expected` (seconds)


def _topo(nodes: Mapping[str, StageNode]) -> list[str]:
    seen: dict[str, int] = {}
    order: list[str] = []

    def visit(n: str, path: tuple[str, ...]) -> None:
        state = seen.get(n)
        if state == 2:
            return
        if state == 1:
            raise ValueError(f"stage DAG has a cycle: {' -> '.join(path + (n,))}")
        seen[n] = 1
        for d in nodes[n].deps:
            if d in nodes:
                visit(d, path + (n,))
        seen[n] = 2
        order.append(n)

    for n in nodes:
        visit(n, ())
    return order


def earliest_finish(nodes: Mapping[str, StageNode]) -> dict[str, float]:
    ef: dict[str, float] = {}
    for n in _topo(nodes):
        node = nodes[n]
        start = max((ef[d] for d in node.deps if d in ef), default=0.0)
        ef[n] = start + max(node.expected, 0.0)
    return ef


def split_deadline(nodes: Mapping[str, StageNode], deadline: float) -> dict[str, float]:
    """Each stage's deadline, in seconds after the pipeline starts.

    Stages on the critical path (the longest chain of expected durations, length CP) get deadlines in
    proportion to where they end on it: `deadline * EF(s) / CP`, so the last critical stage gets the
    whole pipeline deadline and every stage keeps the same relative slack. Stages off the critical path
    get the latest finish that still lets their successors meet theirs.
    """
    if not nodes:
        return {}
    ef = earliest_finish(nodes)
    cp = max(ef.values())
    if cp <= 0:
        return {n: deadline for n in nodes}
    scale = deadline / cp
    # latest finish (scaled): LF(s) = min over successors (LF(succ) - scaled duration(succ)); sinks: deadline
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for n, node in nodes.items():
        for d in node.deps:
            if d in succ:
                succ[d].append(n)
    lf: dict[str, float] = {}
    for n in reversed(_topo(nodes)):
        if not succ[n]:
            lf[n] = deadline
        else:
            lf[n] = min(lf[s] - scale * nodes[s].expected for s in succ[n])
    return {n: min(lf[n], deadline) for n in nodes}


@dataclass
class Forecast:
    finish: float  # absolute
    spread: float  # one standard deviation, seconds
    deadline: float | None
    remaining_path: list[str] = field(default_factory=list)
    overhead: float = 0.0  # counted before each stage still to start (seconds)

    @property
    def at_risk(self) -> bool:
        return self.deadline is not None and self.finish > self.deadline

    @property
    def p_meet(self) -> float | None:
        """Probability of meeting the deadline under a normal error model."""
        if self.deadline is None:
            return None
        if self.spread <= 0:
            return 1.0 if self.finish <= self.deadline else 0.0
        z = (self.deadline - self.finish) / self.spread
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def forecast(
    nodes: Mapping[str, StageNode],
    *,
    now: float,
    done: Mapping[str, float],
    running: Mapping[str, float],
    deadline: float | None,
    overhead: float = 0.0,
) -> Forecast:
    """Completion forecast: finished stages at their end times, running ones at start + expected
    (never before now), waiting ones `overhead` seconds after their dependencies (the time from a
    stage's dependencies ending to it starting: its dispatch, the worker's pickup, its QoS queue).
    Spreads add along the critical path."""
    fin: dict[str, float] = {}
    var: dict[str, float] = {}
    prev: dict[str, str | None] = {}
    for n in _topo(nodes):
        node = nodes[n]
        if n in done:
            fin[n], var[n], prev[n] = done[n], 0.0, None
            continue
        dep_best = None
        for d in node.deps:
            if d in fin and (dep_best is None or fin[d] > fin[dep_best]):
                dep_best = d
        if n in running:
            start = running[n]
        else:
            start = max(now, fin[dep_best] if dep_best else now) + max(0.0, overhead)
        fin[n] = max(now, start + node.expected)
        var[n] = (var[dep_best] if dep_best else 0.0) + node.spread**2
        prev[n] = dep_best
    if not fin:
        return Forecast(now, 0.0, deadline, overhead=overhead)
    last = max(fin, key=lambda k: fin[k])
    path = []
    cur: str | None = last
    while cur is not None and cur not in done:
        path.append(cur)
        cur = prev.get(cur)
    return Forecast(fin[last], math.sqrt(var[last]), deadline, list(reversed(path)), overhead=overhead)


def nodes_from_plan(plan: Mapping[str, Sequence[str]], expected: Mapping[str, float], default: float = 60.0) -> dict[str, StageNode]:
    return {n: StageNode(n, float(expected.get(n, default)), tuple(deps)) for n, deps in plan.items()}

"""The policy interface shared by the simulator and the live worker.

A scheduling round is a pure function of a snapshot (Blox's admission -> ordering -> placement,
KAI's session): the caller builds a `SchedulerView` around a *copy* of the cluster state; the policy
plans on that copy (releasing jobs it preempts, allocating jobs it starts) and returns a `Decision`;
the caller commits the decision to the real state as one statement with `commit()`, which checks
every placement again. The simulator and the worker call the very same `Policy.schedule`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

from qosflow.core.cluster import ClusterState
from qosflow.core.estimate import Estimator
from qosflow.core.job import JobState
from qosflow.core.placement import Placement


@dataclass
class SchedulerView:
    """What a policy sees in one round. `cluster` is a snapshot the policy may change freely."""

    now: float
    cluster: ClusterState
    pending: list[JobState]
    running: list[JobState]
    estimator: Estimator

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.cluster.spec.max_gpus_per_node)


@dataclass
class Decision:
    """The outcome of one round: jobs to stop (preempt), jobs to start, cores to move."""

    starts: list[Placement] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)
    #: (job id, node index, new core count) -- CODA's adaptive CPU allocation
    resize: list[tuple[str, int, float]] = field(default_factory=list)
    #: job id -> why it waits, shares or was preempted (shown to users)
    notes: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.starts or self.preempt or self.resize)


class Policy(ABC):
    """A scheduling policy. Subclasses set `name` and implement `schedule`."""

    name: ClassVar[str] = ""
    #: may stop running jobs (checkpoint and restart later)
    preemptive: ClassVar[bool] = False
    description: ClassVar[str] = ""
    #: rough cost of a simulation under this policy against a simple one (1): only the order in
    #: which parallel runs start (`qosflow.sim.batch`: the costliest first), never a result
    relative_cost: ClassVar[float] = 1.0
    #: may start a job that declared `min_gpus` on fewer GPUs than it asks for (`QoSSpec.widths`): such a
    #: job whose full width never fits the cluster is then admitted if a narrower width does
    #: (`ClusterSpec.why_never_fits(..., elastic=...)`). Baselines start every job on all its GPUs.
    elastic_starts: ClassVar[bool] = False
    #: option -> the names it takes, for a text option with a fixed set that its annotation does not
    #: spell as a `Literal`: `--set` (`qosflow.policies.option_problem`) lists them when given another
    #: value. The constructor still checks the value itself.
    option_choices: ClassVar[dict[str, tuple[str, ...]]] = {}

    @abstractmethod
    def schedule(self, view: SchedulerView) -> Decision:
        """Plan one round on `view.cluster` (a snapshot) and return the decision."""

    def next_wakeup(self, view: SchedulerView) -> float | None:
        """Absolute time the policy wants another round even if nothing happens (e.g. a queue demotion)."""
        return None

    def options(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def check_number(policy: str, name: str, value: Any, ok: Callable[[float], bool], want: str) -> None:
    """Refuse a constructor option that is not a number (a bool is not one) or fails `ok`: a ValueError
    naming the policy, the option and what to give. NaN fails
    every comparison, so an `ok` written as comparisons refuses it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{policy} policy: {name} must be {want}, got {value!r}")


def check_flag(policy: str, name: str, value: Any) -> None:
    """Refuse a true/false option given anything but a bool (a text "false" would turn it on)."""
    if not isinstance(value, bool):
        raise ValueError(f"{policy} policy: {name} must be true or false, got {value!r}")


def check_choice(policy: str, name: str, value: Any, choices: Iterable[str]) -> None:
    """Refuse an option that is not one of its fixed names, listing them."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{policy} policy: {name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def commit(state: ClusterState, decision: Decision, jobs: dict[str, JobState]) -> None:
    """Apply a decision to the real cluster state: preemptions first, then starts, then core moves.

    Every placement is checked again (`ClusterState.allocate` raises on any conflict), so a buggy
    policy cannot over-allocate the real cluster.
    """
    for jid in decision.preempt:
        state.release(jid)
    for p in decision.starts:
        state.allocate(p, jobs[p.job_id].job.qos)
    for jid, node, cores in decision.resize:
        state.resize_cpu(jid, node, cores)

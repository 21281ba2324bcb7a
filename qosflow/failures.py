"""Failure handling the Philly way: was it the infrastructure or the stage's own code?

Jeon et al. (Philly, ATC'19) found that most failed GPU jobs fail for user reasons (bugs, bad input,
bad configuration) and fail again when retried as they are, while infrastructure failures (a node or
agent lost, OOM kills, evictions) are cured by running elsewhere. So:

* `ExitKind.INFRA`  -> retry at once on another slot (the failed nodes are excluded), up to a cap;
* `ExitKind.USER`   -> follow the stage's own retry setting (Prefect `retries`), never blindly;
* `ExitKind.CANCELLED` -> stop.

`classify_process_exit` (agents, local processes) and `classify_pod` (Kubernetes) make the call;
`decide` turns it into an action; `run_with_failover` is a small driver a worker can use for one
stage: lease a slot, launch, wait, classify, retry elsewhere, with nothing running twice.
`prefect_state` gives the Prefect state (with a clear message) for an `ExitStatus`.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from qosflow.backends.base import AGENT_STOPPING, Backend, ExitKind, ExitStatus, LaunchSpec

if TYPE_CHECKING:
    from qosflow.store.leases import LeaseStore


# ---------------------------------------------------------------------- classification
def classify_process_exit(returncode: int | None, *, killed_reason: str | None = None, error: str | None = None) -> ExitStatus:
    """A process's end (agent or local backend) as an ExitStatus."""
    if error:
        return ExitStatus(ExitKind.USER, returncode, f"the stage could not start: {error} (check the command and its working directory)")
    if killed_reason:
        if killed_reason.startswith(("fenced", AGENT_STOPPING)):
            return ExitStatus(ExitKind.INFRA, returncode, f"stopped by its agent: {killed_reason}")
        if returncode == 0:
            return ExitStatus(ExitKind.OK, 0, "")
        return ExitStatus(ExitKind.CANCELLED, returncode, f"killed on request: {killed_reason}")
    if returncode == 0:
        return ExitStatus(ExitKind.OK, 0, "")
    if returncode is None:
        return ExitStatus(ExitKind.INFRA, None, "ended without an exit status")
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return ExitStatus(ExitKind.INFRA, returncode, "killed by SIGKILL from outside qosflow (most likely the kernel OOM killer)")
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else str(-returncode)
        return ExitStatus(ExitKind.USER, returncode, f"died of signal {name}")
    return ExitStatus(ExitKind.USER, returncode, f"exited with code {returncode}")


#: Kubernetes pod/container reasons -> (kind, advice). Unknown reasons of a failed pod are USER.
POD_REASONS: dict[str, tuple[ExitKind, str]] = {
    "OOMKilled": (ExitKind.INFRA, "the container ran out of memory (OOMKilled); retrying on another node"),
    "Evicted": (ExitKind.INFRA, "the pod was evicted from its node"),
    "NodeLost": (ExitKind.INFRA, "the node was lost"),
    "NodeShutdown": (ExitKind.INFRA, "the node shut down"),
    "Preempting": (ExitKind.INFRA, "the pod was preempted"),
    "DeletionByTaintManager": (ExitKind.INFRA, "the node became unreachable and its pods were evicted"),
    "DeletionByPodGC": (ExitKind.INFRA, "the node was lost and the pod garbage-collected"),
    "TerminationByKubelet": (ExitKind.INFRA, "the kubelet terminated the pod"),
    "Unschedulable": (ExitKind.INFRA, "the pod cannot be scheduled on the chosen node"),
    "ContainerCannotRun": (ExitKind.USER, "the container cannot run (bad command or entrypoint)"),
    "ImagePullBackOff": (ExitKind.USER, "the image cannot be pulled: check the image name, tag and pull secret"),
    "ErrImagePull": (ExitKind.USER, "the image cannot be pulled: check the image name, tag and pull secret"),
    "InvalidImageName": (ExitKind.USER, "the image name is invalid"),
    "CreateContainerConfigError": (ExitKind.USER, "the container configuration is invalid (missing Secret or ConfigMap?)"),
    "CreateContainerError": (ExitKind.USER, "the container could not be created"),
    "DeadlineExceeded": (ExitKind.USER, "the stage ran past its activeDeadlineSeconds"),
    "Error": (ExitKind.USER, "the stage's command failed"),
}


def classify_reason(reason: str, message: str = "", code: int | None = None) -> ExitStatus:
    kind, advice = POD_REASONS.get(reason, (ExitKind.USER, f"failed ({reason})"))
    text = f"{reason}: {advice}" + (f" -- {message}" if message else "")
    if reason == "Error" and code is not None:
        text = f"the stage exited with code {code}" + (f" -- {message}" if message else "")
    return ExitStatus(kind, code, text)


# ---------------------------------------------------------------------- decisions
class Action(str, Enum):
    DONE = "done"
    RETRY_ELSEWHERE = "retry-elsewhere"  # infrastructure: another slot, now
    RETRY = "retry"  # user error with retries left (the stage's own setting)
    FAIL = "fail"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Decision:
    action: Action
    message: str
    delay_s: float = 0.0


def decide(
    status: ExitStatus,
    *,
    infra_failures: int,
    user_failures: int,
    user_retries: int = 0,
    user_retry_delay_s: float = 0.0,
    max_infra_retries: int = 3,
) -> Decision:
    """What to do after an attempt ended. Counts include the attempt that just ended."""
    if status.kind is ExitKind.OK:
        return Decision(Action.DONE, "completed")
    if status.kind is ExitKind.CANCELLED:
        return Decision(Action.CANCELLED, status.reason or "cancelled")
    if status.kind is ExitKind.INFRA:
        if infra_failures <= max_infra_retries:
            return Decision(Action.RETRY_ELSEWHERE, f"infrastructure failure ({status.reason}); retry {infra_failures}/{max_infra_retries} on another slot")
        return Decision(Action.FAIL, f"infrastructure failed {infra_failures} times, last: {status.reason}")
    if user_failures <= user_retries:
        return Decision(Action.RETRY, f"{status.reason}; retry {user_failures}/{user_retries} (the stage's retries setting)", user_retry_delay_s)
    hint = "" if user_retries else " (no retries set: a user error is not retried blindly)"
    return Decision(Action.FAIL, f"{status.reason}{hint}")


def prefect_state(status: ExitStatus, *, attempt: int | None = None):
    """A Prefect state for how a stage attempt ended, with a clear message."""
    from prefect.states import Cancelled, Completed, Crashed, Failed

    suffix = f" (attempt {attempt})" if attempt else ""
    if status.kind is ExitKind.OK:
        return Completed(message=f"completed{suffix}")
    if status.kind is ExitKind.CANCELLED:
        return Cancelled(message=status.reason or "cancelled")
    if status.kind is ExitKind.INFRA:
        return Crashed(message=f"infrastructure: {status.reason}{suffix}")
    return Failed(message=f"stage error: {status.reason}{suffix}")


# ---------------------------------------------------------------------- a small driver
@dataclass
class Attempt:
    attempt_id: str
    nodes: list[str]
    started: float
    ended: float | None = None
    status: ExitStatus | None = None
    decision: Decision | None = None


@dataclass
class StageOutcome:
    stage_key: str
    status: ExitStatus
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status.ok


#: (attempt number, node names to avoid) -> a LaunchSpec on a new placement, or None if none fits now
PlaceFn = Callable[[int, set[str]], Awaitable[LaunchSpec | None]]


async def run_with_failover(
    backend: Backend,
    stage_key: str,
    place: PlaceFn,
    *,
    leases: "LeaseStore | None" = None,
    pool: str = "default",
    holder: str | None = None,
    lease_ttl_s: float = 30.0,
    user_retries: int = 0,
    max_infra_retries: int = 3,
    release: Callable[[LaunchSpec], None] | None = None,
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
    place_timeout_s: float = 60.0,
) -> StageOutcome:
    """Run one stage to the end: place, lease, launch, wait, classify, and retry on another slot
    after an infrastructure failure (at most `max_infra_retries` times) or per `user_retries`
    after a user failure. With `leases`, every attempt holds a lease on its GPU slots (two workers
    can never book the same GPU) and on the stage itself (never two live attempts of one stage).
    """
    holder = holder or f"worker-{uuid.uuid4().hex[:8]}"
    emit = on_event or (lambda kind, data: None)
    attempts: list[Attempt] = []
    avoid: set[str] = set()
    infra = user = 0
    n = 0
    while True:
        n += 1
        deadline = time.monotonic() + place_timeout_s
        while True:
            spec = await place(n, set(avoid))
            if spec is not None:
                break
            if time.monotonic() > deadline:
                st = ExitStatus(ExitKind.INFRA, None, f"no slot for stage {stage_key} within {place_timeout_s:g}s")
                return StageOutcome(stage_key, st, attempts)
            await asyncio.sleep(0.05)
        lease = None
        if leases is not None:
            lease = leases.acquire(pool, stage_key, spec, holder=holder, ttl_s=lease_ttl_s, backend=backend.name)
        nodes = [spec.cluster.nodes[i].name for i in spec.placement.nodes]
        att = Attempt(spec.stage_id, nodes, time.time())
        attempts.append(att)
        try:
            handle = await backend.launch(spec)
            emit("launched", {"stage": stage_key, "attempt": spec.stage_id, "nodes": nodes, "at": time.time()})
            if lease is not None:
                leases.set_handle(lease.lease_id, handle)  # type: ignore[union-attr]
            waiter = asyncio.ensure_future(backend.wait(handle))
            renew = asyncio.ensure_future(_renew_loop(leases, lease.lease_id, lease_ttl_s)) if lease is not None else None
            try:
                status = await waiter
            finally:
                if renew:
                    renew.cancel()
        finally:
            if lease is not None:
                leases.release(lease.lease_id)  # type: ignore[union-attr]
            if release is not None:
                release(spec)
        att.ended, att.status = time.time(), status
        if status.kind is ExitKind.INFRA:
            infra += 1
            avoid.update(nodes)
        elif status.kind is ExitKind.USER:
            user += 1
        d = decide(status, infra_failures=infra, user_failures=user, user_retries=user_retries, max_infra_retries=max_infra_retries)
        att.decision = d
        emit("ended", {"stage": stage_key, "attempt": spec.stage_id, "nodes": nodes, "kind": status.kind.value, "reason": status.reason, "action": d.action.value, "at": att.ended})
        if d.action in (Action.DONE, Action.FAIL, Action.CANCELLED):
            return StageOutcome(stage_key, status, attempts)
        if d.delay_s:
            await asyncio.sleep(d.delay_s)


async def _renew_loop(leases: "LeaseStore", lease_id: str, ttl_s: float) -> None:
    while True:
        await asyncio.sleep(ttl_s / 3)
        await asyncio.to_thread(leases.renew_lease, lease_id, ttl_s)

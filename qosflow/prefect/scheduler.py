"""The worker's QoS queue: stage runs wait here for a placement instead of starting first-come-first-served.

`QoSScheduler` owns the live `ClusterState`. Every round it builds a `SchedulerView` over a snapshot
(the same view the simulator builds), asks the policy for a `Decision` and commits the starts to the
real state (each placement checked again). A waiting `request()` returns when its stage is granted.

Between rounds it runs CODA's feedback allocator: a GPU stage whose reported progress lags its
prediction takes a core from a CPU-only stage on the same host (through CPU affinity); every move
is recorded in `decisions`.

Nothing here imports Prefect: the worker turns the callbacks into Prefect events and artifacts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from qosflow.backends.base import grad_accumulation
from qosflow.core.cluster import ClusterSpec, ClusterState, PlacementError, gang_spreads
from qosflow.core.estimate import Z_HIGH, DeclaredEstimator, Estimator, gpu_speed
from qosflow.core.job import Job, JobState, JobStatus
from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec
from qosflow.core.speed import width_fraction
from qosflow.placement_api import elastic_note, read_progress, read_resumed
from qosflow.policies.base import Decision, Policy, SchedulerView

log = logging.getLogger("qosflow.scheduler")


def elastic_info(qos: QoSSpec, p: Placement) -> dict[str, Any]:
    """How wide an elastic stage (`QoSSpec.min_gpus`) started, for its placement record, event and labels:
    `requested_gpus`, `grad_accumulation` and `elastic`, a line for the UI ("started on 4 of 8 GPUs,
    gradient accumulation x2"); nothing for a stage that cannot start narrower."""
    if qos.min_gpus is None or not p.gpus:
        return {}
    width = len(p.gpus)
    acc = grad_accumulation(width, qos.gpus)
    text = f"started on {elastic_note(qos.gpus, acc)}" if acc > 1 else f"started on all {qos.gpus} GPUs"
    return {"requested_gpus": qos.gpus, "grad_accumulation": acc, "elastic": text}


class StageCancelled(Exception):
    """A queued stage was taken out of the QoS queue (its flow run was cancelled)."""

EventSink = Callable[[str, "StageEntry", dict[str, Any]], None]


@dataclass(frozen=True)
class Grant:
    placement: Placement
    cpusets: dict[int, list[int]]
    predicted_s: float
    granted_at: float
    waited_s: float
    note: str = ""


@dataclass(eq=False)
class StageEntry:
    """One stage run known to the scheduler (queued or running)."""

    state: JobState
    name: str
    flow_run_id: str | None = None
    pipeline: str | None = None
    deadline_at: float | None = None  # absolute (epoch seconds)
    ready_at: float = 0.0
    future: asyncio.Future | None = None
    grant: Grant | None = None
    progress_file: str | None = None
    handle: Any = None
    last_coda: float = 0.0
    at_risk_sent: bool = False
    #: steps an earlier run had done when this one started (`qosflow.report_resumed`); None: not read yet
    resumed: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def job(self) -> Job:
        return self.state.job

    def resumed_steps(self) -> int:
        """`resumed`, read from the head of its progress file the first time (a run says it before its
        first step); 0 without a progress file."""
        if self.resumed is None:
            self.resumed = read_resumed(self.progress_file) if self.progress_file else 0
        return self.resumed

    @property
    def job_id(self) -> str:
        return self.state.job.job_id


class QoSScheduler:
    #: how many recorded decisions (`decisions`) are kept
    DECISIONS_KEPT = 1000

    def __init__(
        self,
        cluster: ClusterSpec,
        policy: Policy,
        estimator: Estimator | None = None,
        *,
        round_interval: float = 1.0,
        coda: bool = True,
        coda_interval: float = 2.0,
        coda_lag: float = 0.15,
        coda_min_elapsed: float = 3.0,
        at_risk_margin: float = 0.0,
        on_event: EventSink | None = None,
        set_cpus: Callable[[StageEntry, int, list[int]], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.cluster = cluster
        #: the cluster the pool may become (a node group's autoscaler: `Backend.may_become`), or None: a stage that no
        #: node listed now can ever hold, but that one would, waits for it instead of being refused
        self.may_become: Callable[[], ClusterSpec | None] | None = None
        self.state = ClusterState(cluster)
        self.policy = policy
        self.estimator = estimator or DeclaredEstimator()
        self.round_interval = round_interval
        self.coda = coda
        self.coda_interval = coda_interval
        self.coda_lag = coda_lag
        self.coda_min_elapsed = coda_min_elapsed
        if not 0.0 <= at_risk_margin < 1.0:
            raise ValueError(f"at_risk_margin must be a fraction in [0, 1), got {at_risk_margin!r}")
        self.at_risk_margin = at_risk_margin
        self.on_event = on_event
        self.set_cpus = set_cpus
        self.clock = clock
        self.entries: dict[str, StageEntry] = {}
        #: node index -> the least thousandths of a GPU a shared stage takes there (Kubernetes time-slicing / MPS:
        #: one slice of that node's shared GPU resource, as kube-scheduler counts it); None: no floor per node
        self.share_floor: Callable[[int], int] | None = None
        # CODA moves and other recorded decisions, the newest DECISIONS_KEPT: a stage that lags its
        # prediction gets a core every CODA round, so the list grew with every such stage for the
        # worker's life
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.DECISIONS_KEPT)
        self.rounds = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_coda = 0.0
        # node -> owner job id per core id ("" = free)
        self._cores: dict[int, list[str]] = {
            i: [""] * max(1, int(math.ceil(n.cpu_cores))) for i, n in enumerate(cluster.nodes)
        }

    # ------------------------------------------------------------------ public API
    async def request(self, entry: StageEntry) -> Grant:
        """Queue a stage and wait for its placement. Raises on rejection or cancellation."""
        # (an elastic stage, `min_gpus`, fits if a width the policy may start it on does: `elastic_starts`)
        elastic = getattr(self.policy, "elastic_starts", False)
        reason = self.cluster.why_never_fits(entry.job.qos, elastic=elastic)
        if reason and self.may_become is not None:
            # (a pool its autoscaler grows: refused only if the nodes it may have would not hold it either; it waits,
            # asks for capacity (`waiting_for_capacity`) and is placed once they are listed)
            grown = self.may_become()
            if grown is not None and grown.why_never_fits(entry.job.qos, elastic=elastic) is None:
                reason = None
        if reason:
            entry.state.status = JobStatus.REJECTED
            raise PlacementError(
                f"stage {entry.name!r} can never be placed on cluster {self.cluster.name}: {reason}; ask for less in its "
                "@qos_task (gpus, min_gpus, gpu_mem_mb, cpu_cores, mem_mb, gpu_model) or describe more capacity in the pool's "
                "cluster block or file"
            )
        loop = asyncio.get_running_loop()
        entry.future = loop.create_future()
        entry.ready_at = entry.ready_at or self.clock()
        entry.state.status = JobStatus.PENDING
        entry.state.queued_since = entry.ready_at
        self.entries[entry.job_id] = entry
        self.wake()
        try:
            return await entry.future
        except asyncio.CancelledError:
            self.drop(entry.job_id, "the worker stopped waiting")
            raise

    def wake(self) -> None:
        self._wake.set()

    def attach(self, job_id: str, handle: Any, progress_file: str | None = None) -> None:
        e = self.entries.get(job_id)
        if e is not None:
            e.handle = handle
            e.progress_file = progress_file

    def release(self, job_id: str, *, ok: bool = True) -> StageEntry | None:
        """A stage ended: free its GPUs and cores, and schedule again at once."""
        e = self.entries.pop(job_id, None)
        if e is None:
            return None
        if job_id in self.state.allocs:
            self.state.release(job_id)
        for owners in self._cores.values():
            for i, o in enumerate(owners):
                if o == job_id:
                    owners[i] = ""
        e.state.status = JobStatus.DONE if ok else JobStatus.FAILED
        e.state.finish_time = self.clock()
        self.note_sharing()  # the stages it shared GPUs with may run alone from now on
        self.wake()
        return e

    def adopt(self, entry: StageEntry, placement: Placement, cpusets: dict[int, list[int]], predicted_s: float | None = None) -> Grant:
        """Take in a stage that is already running (found through its lease after a worker restart):
        its slot is allocated and it counts as running, without going through the queue."""
        self.state.allocate(placement, entry.job.qos)
        for node, cores in cpusets.items():
            owners = self._cores.get(node, [])
            for c in cores:
                if 0 <= c < len(owners) and not owners[c]:
                    owners[c] = entry.job_id
        now = self.clock()
        entry.ready_at = entry.ready_at or now
        entry.state.status = JobStatus.RUNNING
        entry.state.placement = placement
        entry.state.first_start = entry.state.first_start or now
        entry.state.last_start = now
        pred = float(predicted_s if predicted_s is not None else self.estimator.duration(entry.job))
        entry.grant = Grant(placement, dict(cpusets), pred, now, 0.0, "adopted after a worker restart")
        self.entries[entry.job_id] = entry
        entry.meta["ran_alone"] = True  # (what it shared before the restart is unknown: no shared-run sample)
        self.note_sharing()
        return entry.grant

    def hold(self, key: str, placement: Placement, qos: Any, cores: dict[int, list[int]] | None = None) -> bool:
        """Mark capacity booked by someone else (another worker's lease) as taken. False if it does not fit
        this view (then the database constraint still guards it)."""
        if key in self.state.allocs:
            return True
        try:
            self.state.allocate(placement, qos)
        except PlacementError:
            return False
        for node, ids in (cores or {}).items():
            owners = self._cores.get(node, [])
            for c in ids:
                if 0 <= c < len(owners) and not owners[c]:
                    owners[c] = key
        self.note_sharing()
        return True

    def unhold(self, key: str) -> None:
        if key in self.state.allocs:
            self.state.release(key)
        for owners in self._cores.values():
            for i, o in enumerate(owners):
                if o == key:
                    owners[i] = ""
        self.note_sharing()

    def drop(self, job_id: str, reason: str = "cancelled") -> None:
        """Forget a queued (or running) stage, e.g. when its flow run was cancelled."""
        e = self.entries.get(job_id)
        if e is None:
            return
        if e.future is not None and not e.future.done():
            e.future.set_exception(StageCancelled(reason))
        self.release(job_id, ok=False)

    def queued(self) -> list[StageEntry]:
        return [e for e in self.entries.values() if e.state.status is JobStatus.PENDING]

    def running(self) -> list[StageEntry]:
        return [e for e in self.entries.values() if e.state.status is JobStatus.RUNNING]

    def waiting_for_capacity(self, after_s: float = 0.0, now: float | None = None) -> list[StageEntry]:
        """Queued stages that have waited at least `after_s` and that no node of the plan has room for now: no node
        that is up (and of the GPU model and memory asked for) has the GPUs, cores and memory free that the stage
        asks for on one node (a gang wider than a node: no k such nodes have its GPUs free together with the cores
        and memory of their part, `_gang_has_room`, not their free GPUs alone). A stage the policy
        holds back although a node has room (its turn has not come, fair share) is not one of them: more nodes are
        not what it waits for. Longest wait first."""
        now = self.clock() if now is None else now
        st = self.state
        out: list[tuple[float, StageEntry]] = []
        for e in self.entries.values():
            if e.state.status is not JobStatus.PENDING or e.future is None or e.future.done():
                continue
            waited = now - e.ready_at
            if waited < after_s:
                continue
            q = e.job.qos
            ok = st.usable_nodes(q)
            if q.gpus > 0:
                if q.gpu_milli < 1000 and q.shareable:
                    free = (st.exists & (st.milli_free >= q.gpu_milli)).sum(axis=1)
                else:
                    free = (st.exists & (st.njobs == 0)).sum(axis=1)
            else:
                free = np.zeros(st.num_nodes, dtype=np.int64)
            fits = ok & (free >= q.gpus) & (st.cpu_free >= q.cpu_cores - 1e-9) & (st.mem_free >= q.mem_mb - 1e-9)
            if fits.any():
                continue
            if q.gpus > self.cluster.max_gpus_per_node and self._gang_has_room(q, free, ok):
                continue
            out.append((waited, e))
        return [e for _, e in sorted(out, key=lambda x: -x[0])]

    def _gang_has_room(self, q: Any, free: np.ndarray, ok: np.ndarray) -> bool:
        """Whether a gang wider than a node has room over several up nodes now: `gang_spreads` (as a placement splits
        it: its cores in proportion to its GPUs on each node, its memory evenly over its k nodes) on what the `ok`
        nodes have free: `free` GPUs, cores, memory."""
        st = self.state
        return gang_spreads(((float(st.mem_free[i]), int(free[i]), float(st.cpu_free[i])) for i in np.flatnonzero(ok)),
                            int(math.ceil(q.gpus)), q.cpu_cores, q.mem_mb or 0.0)

    # ------------------------------------------------------------------ loop
    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run_forever(), name="qosflow-scheduler")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        while task is not None and not task.done():
            # (a cancellation its loop could still lose is sent again; run_forever's wait cannot lose one)
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.debug("the scheduler's loop had ended with %r", task.exception())

    async def run_forever(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returned the inner wait's result when a
            # cancellation arrived just as the event was set (a stage ending as the worker stops), swallowing
            # the cancellation, and stop() waited for this loop for ever
            try:
                async with asyncio.timeout(self.round_interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.round()
                if self.coda and self.clock() - self._last_coda >= self.coda_interval:
                    self._last_coda = self.clock()
                    await self.coda_round()
                self.check_at_risk()
            except Exception:  # never let one bad round kill the queue
                log.exception("qosflow scheduling round failed")

    # ------------------------------------------------------------------ one round
    def round(self) -> list[StageEntry]:
        """Run the policy once over all waiting stages; grant what it starts. Returns the granted entries."""
        pending = [e for e in self.entries.values() if e.state.status is JobStatus.PENDING and e.future and not e.future.done()]
        if not pending:
            return []
        self.rounds += 1
        now = self.clock()
        granted: list[StageEntry] = []
        # stages rerun after an infrastructure failure first (they were running already), each on a
        # view where the nodes it failed on are down, so that the policy places it elsewhere
        rest = []
        for e in sorted(pending, key=lambda x: x.ready_at):
            avoid, strict = self._avoid(e)
            got = self._round_avoiding(e, avoid, now) if avoid else []
            granted.extend(got)
            if not got and not strict:
                rest.append(e)
        pending = rest
        if not pending:
            return granted
        self.observe_running(now)
        running = [e.state for e in self.running()]
        view = SchedulerView(now=now, cluster=self.state.snapshot(), pending=[e.state for e in pending], running=running, estimator=self.estimator)
        decision: Decision = self.policy.schedule(view)
        for jid, note in decision.notes.items():
            e = self.entries.get(jid)
            if e is not None:
                e.state.note = note
        if decision.preempt:
            # live stages are not checkpointed: a preemptive policy's stops are not applied here
            for jid in decision.preempt:
                e = self.entries.get(jid)
                if e is not None:
                    e.state.note = "policy asked to preempt; live stages run to completion"
        for p in decision.starts:
            e = self.entries.get(p.job_id)
            if e is None or e.state.status is not JobStatus.PENDING or e.future is None or e.future.done():
                continue
            if p.job_id not in decision.notes:
                e.state.note = ""  # the reason it waited is over; a start without a note needs no explaining
            if self._grant(e, p, now):
                granted.append(e)
        for jid, node, cores in decision.resize:
            try:
                self.state.resize_cpu(jid, node, cores)
            except (PlacementError, KeyError):
                pass
        return granted

    def _grant(self, e: StageEntry, p: Placement, now: float) -> bool:
        qos = e.job.qos
        if self.share_floor is not None and qos.fractional:
            # booked at the slice of the node it lands on, from what it asked (the worker floored it at the largest
            # slice of the nodes when it was queued: a node of larger slices that joined since was over-committed, one
            # of smaller slices over-booked). More than the policy planned is refused below if it does not fit: the
            # stage waits, never over-commits
            want = max(int(qos.extra.get("asked_gpu_milli", qos.gpu_milli)), int(self.share_floor(p.nodes[0]) or 0))
            if want < 1000 and want != p.gpu_milli:
                p, qos = dataclasses.replace(p, gpu_milli=want), qos.with_(gpu_milli=want)
        try:
            self.state.allocate(p, qos)
        except PlacementError as exc:
            e.state.note = f"placement rejected: {exc}"
            return False
        cpusets = self._assign_cores(p)
        # (an elastic start on fewer GPUs than the stage asked for runs at that share of its speed: the
        # forecast, the CODA feedback and the prediction shown in the UI count on that)
        predicted = float(self.estimator.duration(e.job)) / width_fraction(e.job, p)
        e.state.status = JobStatus.RUNNING
        e.state.placement = p
        e.state.first_start = e.state.first_start or now
        e.state.last_start = now
        e.grant = Grant(p, cpusets, predicted, now, now - e.ready_at, e.state.note)
        self.note_sharing()
        assert e.future is not None
        e.future.set_result(e.grant)
        self._emit("qosflow.stage.placed", e, self.describe_grant(e))
        return True

    def _avoid(self, e: StageEntry) -> tuple[set[int], bool]:
        """Nodes this stage should not be placed on (it failed there for infrastructure reasons), and
        whether that is strict. Strict when the other nodes together could hold the stage at its full
        width: it waits for them. When they could hold it only on fewer GPUs (an elastic stage,
        `min_gpus`), it is placed there if the policy starts it narrower now, and anywhere otherwise (a
        policy narrows only a stage whose deadline the slower run still meets: waiting for that could
        be for ever). When the others could never hold it, it may go anywhere again: (set(), False)."""
        avoid = {int(n) for n in e.meta.get("avoid_nodes", ()) if 0 <= int(n) < len(self.cluster.nodes)}
        if not avoid:
            return set(), False
        others = [n for i, n in enumerate(self.cluster.nodes) if i not in avoid]
        room = sum(n.gpus for n in others)
        if others and room >= e.job.qos.gpus:
            return avoid, True
        if others and room >= min(e.job.qos.widths):
            return avoid, False
        return set(), False

    def _round_avoiding(self, e: StageEntry, avoid: set[int], now: float) -> list[StageEntry]:
        snap = self.state.snapshot()
        for n in avoid:
            snap.set_node_down(n, True)
        running = [x.state for x in self.running()]
        view = SchedulerView(now=now, cluster=snap, pending=[e.state], running=running, estimator=self.estimator)
        d: Decision = self.policy.schedule(view)
        for p in d.starts:
            if p.job_id != e.job_id:
                continue
            if set(p.nodes) & avoid:
                e.state.note = "placement on a node it failed on refused"
                continue
            if self._grant(e, p, now):
                return [e]
        return []

    # ------------------------------------------------------------------ cores
    def _assign_cores(self, p: Placement) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for node, cores in p.cpu:
            owners = self._cores[node]
            want = max(1, int(math.ceil(cores - 1e-9)))
            free = [i for i, o in enumerate(owners) if not o]
            take = free[:want]
            if len(take) < want:  # fractional cores were packed: share the least used ids
                rest = [i for i in range(len(owners)) if i not in take]
                take += rest[: want - len(take)]
            for i in take:
                if not owners[i]:
                    owners[i] = p.job_id
            out[node] = sorted(take)
        return out

    def cpuset(self, job_id: str, node: int) -> list[int]:
        return [i for i, o in enumerate(self._cores.get(node, [])) if o == job_id]

    # ------------------------------------------------------------------ progress / CODA
    def observe_running(self, now: float | None = None) -> None:
        """Bring the running stages' states up to date, as the simulator keeps them: the progress they
        reported and the wall seconds they have run (`attained`; GPU-seconds in `gpu_attained`). The
        policy's round and the deadline forecasts read them: an estimator that learns from progress
        (`learned`) turns them into the remaining time. A rerun after an infrastructure failure starts
        its work again, so its time counts from its own start."""
        now = self.clock() if now is None else now
        for e in self.running():
            if e.grant is None:
                continue
            e.state.attained = max(0.0, now - e.grant.granted_at)
            e.state.gpu_attained = e.state.attained * len(e.grant.placement.gpus)
            self.progress_of(e)

    def note_sharing(self) -> None:
        """Record, for every running stage, who shares its GPUs now: `meta["partners"]` collects every
        stage seen on them (job id -> Job; a slot held for another worker counts with no Job), and
        `meta["ran_alone"]` is set once it ran with nobody. Sharing changes only when a stage is
        granted, adopted or released, which is when this runs; the learned estimator then tells a
        solo run from a shared one (`LearnedEstimator.observe_stage`)."""
        for e in self.running():
            if e.grant is None or not e.grant.placement.gpus:
                continue
            here = {j for g in e.grant.placement.gpus for j in self.state.jobs_on_gpu(*g) if j != e.job_id}
            partners = e.meta.setdefault("partners", {})
            for j in here:
                other = self.entries.get(j)
                partners.setdefault(j, other.job if other is not None else None)
            if not here:
                e.meta["ran_alone"] = True

    def progress_of(self, e: StageEntry) -> float | None:
        """The fraction of its work a running stage reported done (None without a report with a total);
        kept in its state with the fraction an earlier run had done when this one started (`resumed`)."""
        if not e.progress_file:
            return None
        rec = read_progress(e.progress_file)
        if not rec or not rec.get("total"):
            return None
        total = float(rec["total"])
        frac = max(0.0, min(1.0, float(rec["step"]) / total))
        e.state.progress = frac
        e.state.progress_start = max(0.0, min(frac, e.resumed_steps() / total))
        return frac

    async def coda_round(self) -> list[dict[str, Any]]:
        """CODA's feedback allocator: give a lagging GPU stage a core from a co-located CPU stage."""
        moves = []
        now = self.clock()
        for e in self.running():
            if e.job.qos.gpus == 0 or e.grant is None:
                continue
            frac = self.progress_of(e)
            if frac is None:
                continue
            elapsed = now - e.grant.granted_at
            if elapsed < self.coda_min_elapsed or now - e.last_coda < self.coda_interval * 2:
                continue
            expected = min(1.0, elapsed / max(e.grant.predicted_s, 1e-6))
            if frac - e.state.progress_start >= expected * (1.0 - self.coda_lag):  # (this run's share of the work)
                continue
            p = self.state.allocs.get(e.job_id)
            if p is None:
                continue
            for node in p.nodes:
                donor = self._cpu_donor(node, exclude=e.job_id)
                if donor is None:
                    continue
                move = await self._move_core(donor, e, node, now, frac, expected)
                if move:
                    moves.append(move)
                    break
        return moves

    def _cpu_donor(self, node: int, exclude: str) -> StageEntry | None:
        best = None
        for o in self.running():
            if o.job_id == exclude or o.job.qos.gpus != 0:
                continue
            p = self.state.allocs.get(o.job_id)
            if p is None or p.cores_on(node) < 2 - 1e-9 or len(self.cpuset(o.job_id, node)) < 2:
                continue
            if best is None or p.cores_on(node) > self.state.allocs[best.job_id].cores_on(node):
                best = o
        return best

    async def _move_core(self, donor: StageEntry, taker: StageEntry, node: int, now: float, frac: float, expected: float):
        dp = self.state.allocs[donor.job_id]
        tp = self.state.allocs[taker.job_id]
        d_cores, t_cores = dp.cores_on(node), tp.cores_on(node)
        try:
            self.state.resize_cpu(donor.job_id, node, d_cores - 1)
            self.state.resize_cpu(taker.job_id, node, t_cores + 1)
            donor.meta["cores_moved"] = taker.meta["cores_moved"] = True
        except PlacementError as exc:
            log.info("CODA move refused: %s", exc)
            return None
        ids = self.cpuset(donor.job_id, node)
        core = ids[-1]
        self._cores[node][core] = taker.job_id
        if self.set_cpus is not None:
            try:
                await self.set_cpus(donor, node, self.cpuset(donor.job_id, node))
                await self.set_cpus(taker, node, self.cpuset(taker.job_id, node))
            except Exception as exc:  # a stage that just ended
                log.info("CODA affinity change failed: %s", exc)
        taker.last_coda = now
        rec = {
            "time": now,
            "kind": "coda-core-move",
            "node": self.cluster.nodes[node].name,
            "core": core,
            "from_stage": donor.name,
            "from_job": donor.job_id,
            "from_cores": [d_cores, d_cores - 1],
            "to_stage": taker.name,
            "to_job": taker.job_id,
            "to_cores": [t_cores, t_cores + 1],
            "reason": f"{taker.name} at {frac:.0%} of its work, {expected:.0%} predicted by now",
        }
        self.decisions.append(rec)
        self._emit("qosflow.cpu.rebalanced", taker, rec)
        return rec

    # ------------------------------------------------------------------ QoS risk
    def forecast_finish(self, e: StageEntry, now: float | None = None) -> float:
        """When the stage should end: a waiting one, now plus its predicted duration; a running one
        without progress reports, its start plus the duration predicted at its grant; once it reports
        progress, now plus the estimator's remaining time (`learned` blends the observed rate in, so a
        stage running slower than predicted is forecast late; others scale the prediction by the work
        left)."""
        now = self.clock() if now is None else now
        if e.grant is not None:
            frac = e.state.progress
            if frac <= 0:
                return max(now, e.grant.granted_at + e.grant.predicted_s)
            remaining = float(self.estimator.remaining(e.state))
            if not math.isfinite(remaining) or remaining < 0:
                remaining = e.grant.predicted_s * (1.0 - frac)
            return now + remaining
        return now + float(self.estimator.duration(e.job))

    def check_at_risk(self) -> None:
        now = self.clock()
        self.observe_running(now)
        for e in list(self.entries.values()):
            if e.deadline_at is None or e.at_risk_sent:
                continue
            f = self.forecast_finish(e, now)
            # flag when the forecast eats into the margin: the last `at_risk_margin` of the time between
            # the stage becoming ready and its deadline
            limit = e.deadline_at - self.at_risk_margin * max(0.0, e.deadline_at - e.ready_at)
            if f > limit:
                e.at_risk_sent = True
                self._emit(
                    "qosflow.qos.at-risk",
                    e,
                    {
                        "stage": e.name,
                        "forecast_finish": f,
                        "deadline": e.deadline_at,
                        "late_by_s": round(f - e.deadline_at, 3),
                        "margin_s": round(e.deadline_at - limit, 3),
                    },
                )

    # ------------------------------------------------------------------ helpers
    def where_ran(self, e: StageEntry) -> dict[str, Any]:
        """Where a granted stage ran, as its stage-history row and step-time sample record it: hosts, GPU
        model (of a gang over several models, the slowest for it), consolidated (one node) or spread, and its
        CPU cores (None once CODA moved some, or for a share of one core)."""
        p = e.grant.placement if e.grant is not None else None
        if p is None:
            return {}
        names = self.cluster.node_names
        cores = p.cpu_cores
        # (a gang over GPUs of several models runs at its slowest GPU's pace: that model, as the estimator sees it)
        models = [m or "unknown" for m in self._gpu_models(p)]
        slowest = min(models, key=lambda m: gpu_speed(self.estimator, e.job, m)) if models else "cpu"
        return {
            "host": ",".join(names[n] for n in p.nodes) or None,
            "gpu_type": slowest,
            "placement": "spread" if len(p.nodes) > 1 else "consolidated",
            "cpu_cores": None if e.meta.get("cores_moved") or cores < 1 else int(round(cores)),
        }

    def _gpu_models(self, p: Placement) -> list[str]:
        """The GPU models of placement `p`'s GPUs, sorted, each once (none for a CPU-only stage)."""
        return sorted({self.cluster.nodes[n].gpu_model for n, _ in p.gpus})

    def describe_grant(self, e: StageEntry) -> dict[str, Any]:
        g = e.grant
        assert g is not None
        p = g.placement
        names = self.cluster.node_names
        return {
            "stage": e.name,
            "pipeline": e.pipeline,
            "job_id": e.job_id,
            "host": names[p.nodes[0]] if p.nodes else None,
            "hosts": [names[n] for n in p.nodes],
            "gpus": [f"{names[n]}:{gi}" for n, gi in p.gpus],
            # (the GPU model(s) it got: on a cluster of mixed models the policy chose it by the stage's speed there)
            "gpu_model": "+".join(self._gpu_models(p)) or "cpu",
            "gpu_milli": p.gpu_milli if p.gpus else 0,  # a CPU-only stage holds no GPU share (as its label says)
            "cpu_cores": p.cpu_cores,
            "cpuset": {names[n]: c for n, c in g.cpusets.items()},
            "colocated_with": list(p.colocated_with),
            "sub_batch": p.sub_batch.to_dict() if p.sub_batch else None,
            **elastic_info(e.job.qos, p),
            "virtual_gpus": any(self.cluster.nodes[n].virtual for n in p.nodes),
            "predicted_s": round(g.predicted_s, 3),
            "waited_s": round(g.waited_s, 3),
            "priority": e.job.qos.priority.value,
            "user": e.job.user,  # (who it runs for: fairness between users, `QosflowPolicy(fair_share=...)`)
            "deadline_at": e.deadline_at,
            "estimator": getattr(self.estimator, "name", type(self.estimator).__name__),
            "policy": self.policy.name,
            "note": g.note,
        }

    def _emit(self, name: str, e: StageEntry, payload: dict[str, Any]) -> None:
        if self.on_event is not None:
            try:
                self.on_event(name, e, payload)
            except Exception:
                log.exception("event sink failed for %s", name)

    def gpu_load(self) -> dict[tuple[int, int], int]:
        """(node, gpu) -> number of stages on it (the worker's own check: never more than two)."""
        out: dict[tuple[int, int], int] = {}
        for p in self.state.allocs.values():
            for ng in p.gpus:
                out[ng] = out.get(ng, 0) + 1
        return out


# ---------------------------------------------------------------------------------------- estimates
#: what a stage that declares no expected_duration and has never run is assumed to take (seconds)
STAGE_DEFAULT_DURATION = 60.0


class HistoryEstimator(DeclaredEstimator):
    """Declared duration until a stage has run before; then the median of its last runs.

    A stage's signature is `Job.model` (the worker sets it to the stage's qualified name). The
    history is a small JSON file. The worker's default is the learned estimator (`learned`), which keeps
    the history in the qosflow store and learns from profiles too; this one stays as the `history` option.
    """

    name = "history"

    def __init__(self, path: str | None = None, *, keep: int = 20, default_duration: float = STAGE_DEFAULT_DURATION):
        super().__init__(default_duration=default_duration)
        self.path = path
        self.keep = keep
        self.runs: dict[str, list[float]] = {}
        if path and os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as fh:
                    self.runs = {k: [float(x) for x in v] for k, v in json.load(fh).items()}
            except (OSError, ValueError):
                self.runs = {}

    def samples(self, job: Job) -> int:
        return len(self.runs.get(job.model, ()))

    def basis(self, job: Job) -> str:
        n = self.samples(job)
        if n:
            return f"median of {n} past run(s)"
        return "declared expected_duration" if job.expected_duration else f"default {self.default_duration:g}s"

    def duration(self, job: Job) -> float:
        xs = self.runs.get(job.model)
        if xs:
            return float(statistics.median(xs[-5:]))
        return super().duration(job)

    def spread(self, job: Job) -> float:
        """Uncertainty (one standard deviation, seconds) of `duration(job)`."""
        xs = self.runs.get(job.model, [])[-10:]
        d = self.duration(job)
        if len(xs) >= 2:
            return max(float(statistics.pstdev(xs)), 0.05 * d)
        return 0.5 * d if not xs else 0.25 * d

    def remaining_high(self, js: JobState) -> float:
        """About the 90th percentile of the remaining time, for the policy's deadline promises: the
        point estimate stretched by the stage's own run-to-run spread once it has run at least twice
        (normal approximation); before that, DeclaredEstimator's band on a declared duration (sd DECLARED_LOG_SD,
        as the learned estimator states it: x1.9) -- a single run or the default duration states none."""
        n = len(self.runs.get(js.job.model, ()))
        if n == 0:
            return super().remaining_high(js)
        r = self.remaining(js)
        d = self.duration(js.job)
        if n < 2 or d <= 0:
            return r
        return r * (1.0 + Z_HIGH * self.spread(js.job) / d)

    def observe(self, job: Job, actual_s: float) -> None:
        if actual_s <= 0 or not math.isfinite(actual_s):
            return
        xs = self.runs.setdefault(job.model, [])
        xs.append(float(actual_s))
        del xs[: -self.keep]
        if self.path:
            from qosflow.sim.files import replacing

            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with replacing(self.path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
                    json.dump(self.runs, fh)
            except OSError:
                pass


#: the estimators the worker builds by name (`make_live_estimator`), the default first
LIVE_ESTIMATORS = ("learned", "history", "declared")


def check_estimator_name(kind: str) -> str:
    """`kind` if the worker can build it (learned, history, declared... or module:attr), else UnknownNameError.
    Only the name is checked: nothing is built (a learned estimator would open the store)."""
    from qosflow.errors import UnknownNameError

    k = (kind or "learned").strip()
    if k in LIVE_ESTIMATORS or ":" in k:
        return k
    raise UnknownNameError("estimator", k, [*LIVE_ESTIMATORS, "module:attr"])


def check_estimator_import(kind: str, option: str = "--estimator") -> None:
    """For a `module:attr` estimator, fail now (a SpecError naming `option`) if this process cannot import it as
    `make_live_estimator` would, or it is neither an estimator nor a class or factory that makes one. Given to
    `qosflow worker start`, a typo made the worker log 'setup failed: No module named ...' every 5 s for ever.
    Nothing is built (the class is not instantiated); other names are left to `check_estimator_name`."""
    import importlib

    from qosflow.errors import SpecError

    k = (kind or "").strip()
    if ":" not in k:
        return
    mod, attr = k.split(":", 1)
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except ModuleNotFoundError as exc:
        raise SpecError(option, f"{k!r}: no module named {exc.name!r} on this worker's Python path (the current directory, "
                                "PYTHONPATH, installed packages); give learned | history | declared or an importable module:attr") from None
    except AttributeError:
        raise SpecError(option, f"{k!r}: module {mod!r} has no attribute {attr!r}") from None
    except Exception as exc:  # the module itself fails to import
        raise SpecError(option, f"{k!r}: importing {mod!r} failed: {type(exc).__name__}: {exc}") from None
    if not (callable(obj) or hasattr(obj, "duration")):
        raise SpecError(option, f"{k!r} is of type {type(obj).__name__}, neither an estimator (with a duration method) nor a class "
                                "or function that makes one")


def make_live_estimator(kind: str, *, history_path: str | None = None) -> Estimator:
    """The worker's estimator: `learned` (default: the predictor, from the qosflow store), `history`, `declared`
    or `module:attr`."""
    kind = (kind or "learned").strip()
    if kind == "history":
        return HistoryEstimator(history_path)
    if ":" in kind:
        import importlib

        mod, attr = kind.split(":", 1)
        obj = getattr(importlib.import_module(mod), attr)
        return obj() if isinstance(obj, type) or callable(obj) and not hasattr(obj, "duration") else obj
    if kind == "learned":
        from qosflow.errors import QosflowError
        from qosflow.predict.estimator import LearnedEstimator

        try:
            return LearnedEstimator.from_store(default_duration=STAGE_DEFAULT_DURATION, background_writes=True)
        except QosflowError as exc:
            raise QosflowError(
                f"{str(exc).rstrip()}\nThe worker's estimator `learned` keeps what it learns in that database: make it reachable "
                "(or point $QOSFLOW_DATABASE_URL at one that is), or set the QoS policy block's estimator to `history`"
            ) from exc
    from qosflow.core.estimate import make_estimator

    return make_estimator(kind)

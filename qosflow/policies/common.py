"""Building blocks the policies share: greedy placement in a given order, why a job waits,
and the preemptive "which jobs should run" pass."""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies.base import Decision, SchedulerView
from qosflow.policies.placement import Fit, Locality, find_for


def sjf_order(view: SchedulerView) -> list[JobState]:
    """Pending jobs, shortest estimated remaining time first (ties: earliest submission)."""
    est = view.estimator
    return sorted(view.pending, key=lambda js: (est.remaining(js), js.job.submit_time))


def states_of(view: SchedulerView) -> dict[str, JobState]:
    """Every job the view knows, running and pending, by id."""
    states = {js.job_id: js for js in view.running}
    states.update({js.job_id: js for js in view.pending})
    return states


def why_waiting(state: ClusterState, js: JobState, largest: int | None = None) -> str:
    """Why `js` did not start this round. When hosts that could hold it are down, that is said: all of
    them down is the whole reason ("waiting: all 2 hosts are down (gpu-a, gpu-b)"; a wrong agent
    token read "no node has 1 free cores"), some of them down follows the note ("; host gpu-b down")."""
    q = js.job.qos
    if not state.down.any():
        return _why_waiting_up(state, q, largest)
    down, all_down = _down_for(state, q)
    if all_down:
        return f"waiting: {_all_down(state, down)}"
    note = _why_waiting_up(state, q, largest)
    if down.any():
        names = _names(state, down)
        note += f"; host{'s' if int(down.sum()) > 1 else ''} {names} down"
    return note


def hosts_down_note(state: ClusterState, js: JobState) -> str | None:
    """The `why_waiting` note when every host that could hold `js` is down ("waiting: all 2 hosts are
    down (gpu-a, gpu-b)"), else None: for a policy whose own waiting note (a Gavel round, a priority)
    would hide that the job cannot start anywhere. Cheap when no host is down."""
    if not state.down.any():
        return None
    down, all_down = _down_for(state, js.job.qos)
    return f"waiting: {_all_down(state, down)}" if all_down else None


def _down_for(state: ClusterState, q) -> tuple["np.ndarray", bool]:
    """(the down nodes among those that could hold `q`, whether all of those are down)."""
    cand = _could_hold(state, q)
    down = cand & state.down
    return down, bool(down.any() and not (cand & ~state.down).any())


def with_down_causes(note: str, reasons: Mapping[str, str], most: int = 3) -> str:
    """`note` (a `why_waiting` note) followed by why the down hosts it names are down, as the backend
    knows it (`Backend.down_reasons`): "waiting: all 2 hosts are down (gpu-a, gpu-b); why: the agent
    rejected our token (401) ...". The policy sees only that a node is down; its cause (a wrong token,
    a name that does not resolve) was only in the worker's start-up lines."""
    if not reasons or " down" not in note:
        return note
    named = [h for h in reasons if re.search(rf"(?<![\w.-]){re.escape(h)}(?![\w.-])", note)]
    if not named:
        return note
    by: dict[str, list[str]] = {}
    for h in named:
        by.setdefault(reasons[h], []).append(h)
    if len(by) == 1:
        return f"{note}; why: {next(iter(by))}"
    parts = [f"{', '.join(hs)}: {why}" for why, hs in list(by.items())[:most]]
    more = f"; and {len(by) - most} other reason{'s' if len(by) - most > 1 else ''}" if len(by) > most else ""
    return f"{note}; why: " + "; ".join(parts) + more


def _why_waiting_up(state: ClusterState, q, largest: int | None) -> str:
    if q.gpus == 0:
        n = q.cpu_cores
        return f"waiting: no node has {n:g} free core{'' if n == 1 else 's'}"
    if q.fractional:
        return f"waiting: no GPU has {q.gpu_milli}/1000 free"
    free = state.total_empty_gpus()
    if free < q.gpus:
        return f"waiting: needs {q.gpus} GPU{'' if q.gpus == 1 else 's'}, {free} free"
    if largest is None:
        up = state.empty[~state.down]
        largest = int(up.max()) if up.size else 0
    if q.gpus <= state.spec.max_gpus_per_node:
        short = _short_of(state, q) if largest >= q.gpus else None
        return f"waiting: needs {_n_gpus(q.gpus)} on one node; {short or f'largest free block is {largest}'}"
    return f"waiting: needs {q.gpus} GPUs on whole free nodes; {free} GPUs free but scattered"


def _n_gpus(n: int) -> str:
    """'1 GPU', '4 GPUs'."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _could_hold(state: ClusterState, q) -> "np.ndarray":
    """The nodes that could hold (part of) request `q` when empty and up: its GPU model and memory, and
    GPUs for a GPU request or the cores for a CPU-only one."""
    ok = np.ones(state.num_nodes, dtype=bool)
    if q.gpu_model is not None:
        ok = ok & state.spec.model_mask(q.gpu_model)
    if q.gpu_mem_mb is not None and q.gpus > 0:
        ok = ok & (state.gmem_cap >= q.gpu_mem_mb)
    if q.gpus > 0:
        return ok & (state.gpu_count > 0)
    cores = np.array([n.cpu_cores for n in state.spec.nodes], dtype=np.float64)
    return ok & (cores >= q.cpu_cores - 1e-9)


def _names(state: ClusterState, mask, most: int = 5) -> str:
    names = [state.spec.nodes[i].name for i in np.flatnonzero(mask)]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _all_down(state: ClusterState, down) -> str:
    n, total = int(down.sum()), state.num_nodes
    if n == total:
        if n == 1:
            return f"host {state.spec.nodes[0].name}, the cluster's only host, is down"
        return f"all {n} hosts are down ({_names(state, down)})"
    if n == 1:
        return f"the host that could hold it is down ({_names(state, down)})"
    return f"the {n} hosts that could hold it are down ({_names(state, down)})"


class WholeFailures:
    """Whole-GPU requests that found nothing this round. What decides, besides the GPU count, whether
    such a request fits is its GPU model and memory and its cores and host memory per GPU.
    Allocations only shrink free capacity within a round, so once k GPUs with those needs find
    nothing, k or more GPUs with the same needs find nothing either. Make one per round; it must not
    outlive it (a job that ends or is preempted frees capacity)."""

    def __init__(self) -> None:
        self.failed_k: dict[tuple, int] = {}

    @staticmethod
    def _key(q) -> tuple:
        return (q.gpu_model, q.gpu_mem_mb, q.cpu_cores / q.gpus, q.mem_mb / q.gpus)

    def hopeless(self, st: ClusterState, q) -> bool:
        """Can whole-GPU request `q` not fit, judging by the free GPUs and the failures so far?"""
        return st.total_empty_gpus() < q.gpus or self.failed_k.get(self._key(q), 1 << 30) <= q.gpus

    def failed(self, q) -> None:
        """Whole-GPU request `q` found nothing."""
        key = self._key(q)
        self.failed_k[key] = min(self.failed_k.get(key, 1 << 30), q.gpus)


def _short_of(state: ClusterState, q) -> str | None:
    """What the nodes with enough free GPUs for whole-GPU request `q` lack (they have the GPUs), or
    None if some node has all it needs (something else held it back)."""
    nodes = (~state.down) & (state.empty >= q.gpus)
    n = int(nodes.sum())
    # ("the node with 1 free GPU has ...", "the 2 nodes with 4 free GPUs have ...": read "the 1 node with 1
    # free GPUs have")
    where = (f"the {n} nodes" if n > 1 else "the node") + f" with {q.gpus} free GPU{'s' if q.gpus > 1 else ''}"
    have = "have" if n > 1 else "has"
    fits = nodes & state.usable_nodes(q)
    if not fits.any():
        return f"{where} {have} another GPU model or less GPU memory than it asks for"
    if q.cpu_cores > 0 and not (state.cpu_free[fits] >= q.cpu_cores - 1e-9).any():
        return f"{where} {have} at most {state.cpu_free[fits].max():g} free cores of the {q.cpu_cores:g} it needs"
    if q.mem_mb > 0 and not (state.mem_free[fits] >= q.mem_mb - 1e-6).any():
        return f"{where} {have} at most {state.mem_free[fits].max():.0f} MB free host memory of the {q.mem_mb:.0f} MB it needs"
    if not (fits & (state.cpu_free >= q.cpu_cores - 1e-9) & (state.mem_free >= q.mem_mb - 1e-6)).any():
        return f"{where} {'lack' if n > 1 else 'lacks'} free cores or host memory for it"
    return None


class ExclusiveSearch:
    """`find_for` for one round, skipping whole-GPU searches that cannot succeed (`WholeFailures`).
    Make one per round; it must not outlive it."""

    def __init__(self, *, locality: Locality = "consolidated", fit: Fit = "best-fit"):
        self.locality: Locality = locality
        self.fit: Fit = fit
        self.failures = WholeFailures()

    def __call__(self, st: ClusterState, job) -> Placement | None:
        q = job.qos
        whole = q.gpus > 0 and not q.fractional
        if whole and self.failures.hopeless(st, q):
            return None
        p = find_for(st, job, locality=self.locality, fit=self.fit)
        if p is None and whole:
            self.failures.failed(q)
        return p


def place_in_order(
    view: SchedulerView,
    order: Iterable[JobState],
    *,
    locality: Locality = "consolidated",
    fit: Fit = "best-fit",
    blocking: bool = False,
    finder: Callable[[ClusterState, JobState], Placement | None] | None = None,
    decision: Decision | None = None,
) -> Decision:
    """Start jobs in `order` wherever they fit (backfilling), or stop at the first that does not
    (`blocking`, strict FIFO). Allocates on the view's snapshot so later jobs see earlier ones."""
    st = view.cluster
    d = decision if decision is not None else Decision()
    search = ExclusiveSearch(locality=locality, fit=fit)
    largest: int | None = None  # largest free block, recomputed after each start
    for js in order:
        q = js.job.qos
        p = finder(st, js) if finder is not None else search(st, js.job)
        if p is None:
            if largest is None:
                up = st.empty[~st.down]
                largest = int(up.max()) if up.size else 0
            d.notes[js.job_id] = why_waiting(st, js, largest)
            if blocking:
                for rest in order:
                    d.notes.setdefault(rest.job_id, "waiting: behind the head of the queue (strict FIFO)")
                break
            continue
        st.allocate(p, q)
        d.starts.append(p)
        largest = None
    return d


def select_to_run(view: SchedulerView, ordered: Sequence[JobState]) -> set[str]:
    """Preemptive policies: the jobs that should run, taking `ordered` greedily while GPUs last.

    GPUs are counted per job (fractional shares by their fraction); placement comes afterwards.
    """
    st = view.cluster
    free = float(st.gpu_count[~st.down].sum())
    keep: set[str] = set()
    for js in ordered:
        g = js.job.qos.gpu_demand
        if g <= free + 1e-9:
            keep.add(js.job_id)
            free -= g
    return keep


def preempt_and_place(
    view: SchedulerView,
    ordered: Sequence[JobState],
    *,
    locality: Locality = "consolidated",
    fit: Fit = "best-fit",
    finder: Callable[[ClusterState, JobState], Placement | None] | None = None,
) -> Decision:
    """Preempt running jobs that fall outside the greedy run set, then place pending ones in order.

    Running jobs keep their GPUs (no migration); a pending job that made the set but finds no
    placement (fragmentation) waits for the next round.
    """
    keep = select_to_run(view, ordered)
    d = Decision()
    st = view.cluster
    for js in view.running:
        if js.job_id not in keep:
            st.release(js.job_id)
            d.preempt.append(js.job_id)
            d.notes[js.job_id] = "preempted: higher-priority jobs need its GPUs"
    todo = [js for js in ordered if js.job_id in keep and not js.running]
    place_in_order(view, todo, locality=locality, fit=fit, decision=d, finder=finder)
    # jobs outside the run set simply wait
    for js in ordered:
        if js.job_id not in keep and not js.running:
            d.notes.setdefault(js.job_id, "waiting: lower priority than the jobs running")
    return d

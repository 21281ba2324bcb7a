"""Bare-metal hosts through qosflow agents (`qosflow agent start` on each host), over HTTP with httpx.

The worker side of `qosflow.agent`: it polls every agent's inventory (NVML or virtual GPUs), keeps a
heartbeat per host, launches each stage (every host of a gang at once) with the placement's
environment and CPU cores, follows it with a long-poll, and turns how it ended into an `ExitStatus`
(`qosflow.failures.classify_process_exit`). A host that stops answering heartbeats is marked down,
and every stage on it ends with `ExitKind.INFRA` so that the worker reschedules it elsewhere; the
agent's stages die with it (PR_SET_PDEATHSIG), and `--fence-after` on the agent covers a network
split, so a stage is never running in two places. (The fence spares pipeline runs, `pipelines_on`: they
hold no GPU and are never rerun elsewhere; the next worker adopts them.)

A cluster file (`load_cluster_file`) lists the hosts: the same fields as the bare-metal cluster
block (hosts, GPUs per host, GPU memory, cores, agent URL, secret token).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence

import httpx

from qosflow.backends.base import (Backend, ClusterUpdate, ExitKind, ExitStatus, LaunchSpec, ProgressCopies, StageHandle,
                                   placement_env)
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.gpu_names import short_gpu_model
from qosflow.env import env_number
from qosflow.errors import QosflowError, SpecError

log = logging.getLogger("qosflow.backends.agent")
#: the header a worker names itself by in every request to an agent (`AgentBackend.worker_id`; `qosflow.agent.app`): the
#: agent fences a stage when the worker that launched or adopted it has been silent, whatever other workers still ask
WORKER_HEADER = "X-Qosflow-Worker"
#: the label of a pipeline run's process on its agent (`AgentBackend.launch_unplaced`), read back by `adopt`
PIPELINE_ROLE_LABEL = "qosflow.dev/role"


def new_worker_id() -> str:
    """A worker id no other process shares (`AgentBackend.worker_id`): `qosflow-worker#host:pid:random`, as a lease
    holder id reads."""
    import socket
    import uuid

    return f"qosflow-worker#{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def check_pipelines_on(value: Any, hosts: Collection[str], where: str) -> str:
    """A cluster's `pipelines_on` setting: "worker" (the default: a pipeline run is a process on the worker's host),
    "agents" (through an agent, on the up host with the most free cores) or the name of one of its `hosts`."""
    v = str(value if value is not None else "worker").strip() or "worker"
    if v in ("worker", "agents") or v in hosts:
        return v
    raise SpecError("pipelines_on", f"{v!r} is neither 'worker', 'agents' nor one of the hosts ({', '.join(sorted(hosts))})",
                    where=where)


def _is_own_python(command: Sequence[str]) -> bool:
    """Whether a stage's command starts with this worker's own interpreter (the default, `<sys.executable> -m
    prefect.engine`): an agent whose host has no file at that path then runs it with its own interpreter."""
    import sys

    return bool(command) and bool(sys.executable) and command[0] == sys.executable


def _detail(r: httpx.Response) -> str:
    """An agent's error answer in words: its JSON `detail`, else the start of its body."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return detail if isinstance(detail, str) else r.text[:200]


class AgentAuthError(QosflowError):
    """An agent answered 401: the worker's token is not the one the agent was started with."""


@dataclass
class AgentHost:
    """One host of a bare-metal cluster: its agent URL and (optionally) declared resources."""

    name: str
    url: str
    gpus: int | None = None
    gpu_mem_mb: float | None = None
    cpu_cores: float | None = None
    mem_mb: float | None = None
    gpu_model: str | None = None
    switch: int = 0
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class HostState:
    """What the worker knows about a host right now."""

    name: str
    url: str
    up: bool = False
    error: str = "not contacted yet"
    boot_id: str | None = None
    virtual: bool = True
    note: str = ""
    gpus: list[dict[str, Any]] = field(default_factory=list)
    cpu_cores: float = 0.0
    mem_mb: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    last_ok: float | None = None
    #: last_ok on this process's monotonic clock: what a silence is measured on (a step of the worker's wall clock,
    #: NTP or `date -s`, counted a silent host's stages lost before its agent's fence fired, and ran them twice)
    last_ok_mono: float | None = None
    down_since: float | None = None
    reported: bool = False  # has answered /v1/inventory at least once
    #: the last failure was a refused connection (the agent process is gone, and its stages with it)
    refused: bool = False
    #: the agent's --fence-after as it reports it (None: it never fences; older agents do not say)
    fence_after_s: float | None = None
    warned_no_fence: bool = False
    #: the boot id whose /v1/inventory `gpus`/`cpu_cores` were read (a restarted agent may have another size)
    inventory_boot: str | None = None
    #: the account the agent runs stages as (its --stage-user); None: the agent's own user
    stage_user: str | None = None
    #: why the host stays down although it answers: its agent came back smaller than the worker schedules it
    size_error: str = ""
    #: set (and replaced) whenever the host goes down or its agent restarts
    changed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ClusterSnapshot:
    hosts: list[HostState]
    at: float
    elapsed_s: float

    @property
    def up(self) -> list[HostState]:
        return [h for h in self.hosts if h.up]


class AgentBackend(Backend):
    """Stages on bare-metal hosts, one qosflow agent per host."""

    name = "agent"
    EVENTS_KEPT = 1000
    #: how long a pipeline run's host may stay silent (not refusing: a network blip, a busy host) before its wait
    #: asks Prefect about the run (`pipeline_liveness`). A stage is rerun elsewhere after the fence; a pipeline run is
    #: not rerun, and reported lost its run is marked Crashed. So while the run still reports to Prefect (a heartbeat,
    #: or a move to its current state, within 2.5 heartbeats) its wait goes on however long the host stays silent (the
    #: worker's link to the host broke, not the run); one that reached a final state is reported as it ended
    #: (Completed: ok); only a run silent to Prefect too (or with no `pipeline_liveness`) is reported lost, after this
    #: and the host's fence. A refused connection (the agent is gone, and the pipeline with it) or a restarted agent is
    #: reported at once. QOSFLOW_PIPELINE_SILENCE_SECONDS in the worker's environment sets it
    pipeline_silence_s: float = 60.0
    #: how often a silent host's pipeline-run wait asks `pipeline_liveness` again while the run still reports to Prefect
    pipeline_liveness_every_s: float = 5.0
    #: CPU cores a pipeline run books on its host in the worker's view when its job variables ask for none (it mostly
    #: waits for its stages; as the Kubernetes backend's request). Booked, pipeline runs spread over the hosts
    #: (`pipeline_host`) and stages are not placed on the cores they use
    pipeline_cpu_cores: float = 0.25

    def __init__(
        self,
        hosts: Iterable[AgentHost],
        token: str,
        *,
        heartbeat_s: float = 2.0,
        request_timeout_s: float = 5.0,
        poll_s: float = 20.0,
        kill_grace_s: float = 5.0,
        fence_after_s: float | None = None,
        cluster_name: str = "agents",
        declared_by: str | None = None,
        ca_cert: str | None = None,
        pipelines_on: str = "worker",
        worker_id: str | None = None,
    ):
        self.hosts = {h.name: h for h in hosts}
        if not self.hosts:
            raise SpecError("hosts", "an agent cluster needs at least one host")
        if not token:
            raise SpecError("token", "the agents' secret token is empty")
        self.heartbeat_s = float(heartbeat_s)
        self.poll_s = poll_s
        self.kill_grace_s = kill_grace_s
        #: the agents' --fence-after: a silent (not refused) host's stages count as stopped only then
        self.fence_after_s = fence_after_s
        self.cluster_name = cluster_name
        #: where the hosts' declared sizes come from, for messages ("cluster file lab.yaml")
        self.declared_by = declared_by or (f"cluster block {cluster_name!r}" if cluster_name != "agents" else "the cluster's declaration")
        self.inventory_note = ""  # for the worker's start-up line (set by inventory())
        self.state = {h.name: HostState(h.name, h.url.rstrip("/")) for h in self.hosts.values()}
        self._headers = {"Authorization": f"Bearer {token}"}
        self._worker_id = worker_id or new_worker_id()
        #: the CA (PEM) that signed the agents' certificates (https:// agents started with --tls-cert); None:
        #: the system's CAs
        self.ca_cert = ca_cert or None
        self._verify: Any = tls_context(ca_cert, "ca_cert") if ca_cert else True
        self._request_timeout_s = request_timeout_s
        # one small connection pool per host and use: httpcore scans its whole pool on every request,
        # so one shared pool of ~100 hosts' keep-alive and long-poll connections costs O(hosts^2) CPU
        # per refresh (0.46 s of client CPU at 100 hosts; see docs/bench/infra.md)
        self._clients: dict[tuple[str, str], httpx.AsyncClient] = {}
        self._beat_task: asyncio.Task | None = None
        #: (time, host, "down: why" | "up" | "restarted"), the last EVENTS_KEPT: a host whose heartbeat
        #: flapped added two a beat, for the life of the worker
        self.events: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=self.EVENTS_KEPT)
        #: the size (GPUs, cores) `inventory()` gave each host, which the worker schedules on for its whole
        #: life (ClusterState's arrays are sized once): a restarted agent is checked against it
        self._sized: dict[str, tuple[int, float]] = {}
        #: hosts whose agent did not answer at `inventory()`: sized from the declaration, not from their agent
        self._sized_declared: set[str] = set()
        self._progress = ProgressCopies("qosflow-agent-progress-")
        #: hosts taken out of the cluster's description (`update_cluster`) while stages ran there: still
        #: heartbeaten and followed (their declarations here), never healthy, forgotten by `drop_host`
        self.retired: dict[str, AgentHost] = {}
        #: host -> waits on a stage part there in progress (`_wait_part`): what `drop_host` must not cut off
        self._following: collections.Counter[str] = collections.Counter()
        self._closing: set[asyncio.Task] = set()  # connections of forgotten hosts being closed
        #: where the pool's pipeline runs (role pipeline) run (`pipelines_on:`): "worker" (a process on the worker's
        #: host, the default), "agents" (through an agent, on the up host with the most free cores) or a host's name
        self.pipelines_on = check_pipelines_on(pipelines_on, self.hosts, self.declared_by)
        #: pipeline run (stage id) -> the host this backend launched or adopted it on (`pipeline_host`'s tie-break)
        self._pipelines: dict[str, str] = {}
        #: what Prefect says of a pipeline run whose host went silent (set by the worker, which has the Prefect client):
        #: called with the run's stage id (its flow run id), it returns an ExitStatus when the run reached a final state,
        #: True or a text saying why while it still reports to Prefect (alive: its wait goes on), False, None or "" when
        #: Prefect heard nothing recent either (lost). Its errors count as None. Unset: a silent host's pipeline run is
        #: lost after the silence, as a stage's host is
        self.pipeline_liveness: Callable[[str], Awaitable[ExitStatus | bool | str | None]] | None = None
        self.pipeline_silence_s = env_number("QOSFLOW_PIPELINE_SILENCE_SECONDS", type(self).pipeline_silence_s)
        #: host -> the stages (and pipeline runs) this backend launched or adopted there and has not seen end: at
        #: `aclose` (the worker stops) their agents are asked to hold their silence fence (`fence_hold_s`)
        self._live: dict[str, set[str]] = {}
        #: `aclose` was called: no request goes out any more (a wait still running then asked for a heartbeat when its
        #: long-poll broke on the closed connection, and that heartbeat ended the fence hold the closing had just asked for)
        self._closed = False
        #: how long a stopping worker asks the agents of its running stages not to fence them for silence, so that the
        #: next worker adopts them (QOSFLOW_AGENT_FENCE_HOLD_SECONDS; default the lease TTL, after which another worker of
        #: the pool may take them over; 0: no hold, the agents' --fence-after kills them)
        self.fence_hold_s = env_number("QOSFLOW_AGENT_FENCE_HOLD_SECONDS", env_number("QOSFLOW_LEASE_TTL_SECONDS", 30.0))

    @classmethod
    def from_cluster(cls, cluster: ClusterSpec, token: str, **kw: Any) -> "AgentBackend":
        """Hosts from a ClusterSpec whose nodes carry their agent URL in `address`."""
        missing = [n.name for n in cluster.nodes if not n.address]
        if missing:
            raise SpecError("address", f"nodes {', '.join(missing)} have no agent URL", where=f"cluster {cluster.name}")
        hosts = [
            AgentHost(n.name, n.address or "", n.gpus, n.gpu_mem_mb, n.cpu_cores, n.mem_mb, n.gpu_model, n.switch, dict(n.labels))
            for n in cluster.nodes
        ]
        kw.setdefault("declared_by", f"cluster {cluster.name!r}")
        return cls(hosts, token, cluster_name=cluster.name, **kw)

    @property
    def worker_id(self) -> str:
        """Who this backend is to the agents (header `X-Qosflow-Worker`): the owner of the stages it launches or adopts,
        which an agent fences when this worker has been silent for its --fence-after, and whose fence hold is this
        worker's alone. One per backend (a worker process has one for its life), so two workers of a pool, or a worker
        and its restart, are told apart; the worker may set its lease holder id here, before it launches or adopts a stage
        (after, their agents keep those stages as the old id's, which no longer heartbeats: they would be fenced)."""
        return self._worker_id

    @worker_id.setter
    def worker_id(self, value: str) -> None:
        value = str(value)
        live = sorted({sid for sids in self._live.values() for sid in sids})
        if value != self._worker_id and live:
            raise QosflowError(f"cannot rename this worker to the agents ({self._worker_id!r} -> {value!r}) while it follows "
                               f"stage(s) {', '.join(live[:5])}{' ...' if len(live) > 5 else ''} launched or adopted under its "
                               "id: their agents would fence them once the old id goes silent; set worker_id before the "
                               "first launch (AgentBackend(worker_id=...))")
        self._worker_id = value
        for c in self._clients.values():
            c.headers[WORKER_HEADER] = self._worker_id

    def _request_headers(self) -> dict[str, str]:
        return {**self._headers, WORKER_HEADER: self._worker_id}

    @property
    def runs_pipelines(self) -> bool:
        """With `pipelines_on` agents (or a host): pipeline runs are launched through an agent (`launch_unplaced`),
        each under a lease that books no slot, and any worker of the pool adopts them (`adopt`)."""
        return self.pipelines_on != "worker"

    def _client(self, h: HostState, use: str = "api") -> httpx.AsyncClient:
        """The HTTP client for one host: "api" (inventory, launches, waits, kills) or "hb" (heartbeats,
        on their own connections so a slow long-poll never delays a heartbeat)."""
        if self._closed:
            raise httpx.ConnectError(f"the worker's connections to the agents are closed (it stops); not asking {h.url}")
        c = self._clients.get((h.url, use))
        if c is None:
            timeout = self._request_timeout_s if use == "api" else max(0.2, self.heartbeat_s / 2)
            c = self._clients[(h.url, use)] = httpx.AsyncClient(
                headers=self._request_headers(), timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                verify=self._verify)
        return c

    # ------------------------------------------------------------------ heartbeats
    async def start(self) -> None:
        """Start the heartbeat loop (also started by the first launch/wait/inventory)."""
        if self._beat_task is None or self._beat_task.done():
            self._beat_task = asyncio.get_running_loop().create_task(self._beat_loop())

    async def _beat_loop(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.gather(*(self._probe(h) for h in self.state.values()), return_exceptions=True)
            await asyncio.sleep(max(0.0, self.heartbeat_s - (time.monotonic() - t0)))

    def _changed(self, h: HostState) -> None:
        h.changed.set()
        h.changed = asyncio.Event()

    def _mark_down(self, h: HostState, why: str) -> None:
        was, h.error = h.error, why
        if h.up or h.down_since is None:
            h.up = False
            h.down_since = time.time()
            self.events.append((h.down_since, h.name, f"down: {why}"))
            log.warning("host %s is down: %s", h.name, why)
            self._changed(h)
        elif why != was and not (why.startswith("no heartbeat") and was.startswith("no heartbeat")):
            # (a down host whose cause changed: its agent restarted with another token, or smaller, which was
            # said nowhere but in `qosflow status` while the log still read "connection refused")
            self.events.append((time.time(), h.name, f"down: {why}"))
            log.warning("host %s is still down, now because %s", h.name, why)

    def _note_boot(self, h: HostState, boot_id: str, before: list[str]) -> bool:
        """Record the agent's boot id; True (and logged, and waiters woken) if it restarted. `before`: the
        stages its previous boot last reported running (lost with it)."""
        restarted = h.boot_id is not None and boot_id != h.boot_id
        h.boot_id = boot_id
        if restarted:
            self.events.append((time.time(), h.name, "restarted"))
            if before:
                log.warning("agent on host %s restarted: the %d stage(s) it last reported running are lost (%s)",
                            h.name, len(before), ", ".join(before))
            else:  # (it said 'its stages are lost' of an agent that ran none)
                log.warning("agent on host %s restarted (it last reported no stage running)", h.name)
            self._changed(h)
        return restarted

    def _mark_up(self, h: HostState, boot_id: str, before: list[str]) -> None:
        self._note_boot(h, boot_id, before)
        h.last_ok, h.last_ok_mono = time.time(), time.monotonic()
        if h.size_error:  # answers, but smaller than the worker schedules it: stays down
            self._mark_down(h, h.size_error)
            return
        h.error = ""
        if not h.up:
            h.up = True
            h.down_since = None
            self.events.append((time.time(), h.name, "up"))

    async def _probe(self, h: HostState, timeout: float | None = None) -> bool:
        if self._closed:
            return False  # (the worker stops: nothing to learn, and a heartbeat would end the agents' fence holds)
        try:
            # (worker=1 once this backend heartbeats, as a worker's does: that ends a fence hold a stopped worker asked,
            # a one-off look, `qosflow agent status`, does not)
            r = await self._client(h, "hb").get(f"{h.url}/v1/health", params={"worker": "1"} if self._beat_task is not None else None,
                                                timeout=timeout or max(0.2, self.heartbeat_s / 2))
        except httpx.HTTPError as exc:
            h.refused = _refused(exc)
            self._mark_down(h, f"no heartbeat ({_http_error(exc, h.url)})")
            return False
        if r.status_code == 401:
            self._mark_down(h, TOKEN_REJECTED)
            return False
        if r.status_code != 200:
            self._mark_down(h, _not_an_agent(r, h.url))
            return False
        data = r.json()
        if not self._accept_agent(h, data):
            return False
        if self._sized and data["boot_id"] != h.inventory_boot:
            # first contact with this boot of the agent (it restarted, or was down when the worker
            # started): its GPUs and cores may differ from the size the worker schedules it on
            await self._inventory_one(h, timeout or self._request_timeout_s)
            return h.up
        before, h.running = h.running, list(data.get("running", []))
        self._mark_up(h, data["boot_id"], before)
        return h.up

    def _accept_agent(self, h: HostState, data: dict[str, Any]) -> bool:
        """The agent at h.url calls itself h.name (its --name, default its hostname), and its fence
        leaves room for our heartbeats; else it is down."""
        if data.get("host") and data["host"] != h.name:
            if any(o.name == data["host"] and o.url.rstrip("/") == h.url.rstrip("/") for o in self.state.values()):
                # (one agent per host: the fix is another URL, not another name, which the message below asked for)
                self._mark_down(h, f"{h.url} is agent {data['host']!r}, and {self.declared_by} gives hosts {data['host']} and {h.name} "
                                   f"that same agent_url: each host runs its own agent; give {h.name} its agent's URL (its "
                                   "address, or the --port of its agent)")
                return False
            self._mark_down(h, f"{h.url} is agent {data['host']!r}, not {h.name!r}: name the host {data['host']!r} in the cluster file "
                               f"(or start that agent with --name {h.name})")
            return False
        if "fence_after_s" not in data:
            return True
        fence = data["fence_after_s"]
        if fence is not None and float(fence) < self.heartbeat_s:
            # it would kill every stage between two of our heartbeats, and each rerun would die the same way
            self._mark_down(h, f"agent {h.name} fences (kills its stages) after {float(fence):g} s without a heartbeat, but this worker "
                               f"sends one every {self.heartbeat_s:g} s: restart the agent with --fence-after "
                               f"{1.5 * self.heartbeat_s:g} (1-2 x heartbeat_s) or lower the cluster's heartbeat_s")
            return False
        if fence is None and not h.warned_no_fence:
            h.warned_no_fence = True
            log.warning("the agent on host %s runs without --fence-after: after a network split its stages keep running there while "
                        "they run again elsewhere; start it with --fence-after %g (1.5 x heartbeat_s)", h.name, 1.5 * self.heartbeat_s)
        h.fence_after_s = None if fence is None else float(fence)
        return True

    def _fence_of(self, h: HostState) -> float | None:
        """How long a silent host's stages may still run: the agent's own --fence-after (what it really
        does) or, for an agent that does not report it, the cluster's fence_after_s."""
        known = [f for f in (h.fence_after_s, self.fence_after_s) if f]
        return max(known) if known else None

    async def healthy_nodes(self) -> set[str]:
        await self.start()
        return {h.name for h in self.state.values() if h.up and h.name not in self.retired}

    def down_reasons(self) -> dict[str, str]:
        out = {h.name: h.error for h in self.state.values() if not h.up and h.error}
        for name in self.retired:
            out[name] = f"removed from {self.declared_by}: the stages running there end there, no new one goes there"
        return out

    # ------------------------------------------------------------------ inventory
    async def _inventory_one(self, h: HostState, timeout: float) -> None:
        try:
            r = await self._client(h).get(f"{h.url}/v1/inventory", timeout=timeout)
        except httpx.HTTPError as exc:
            self._mark_down(h, _http_error(exc, h.url))
            return
        if r.status_code == 401:
            self._mark_down(h, TOKEN_REJECTED)
            return
        if r.status_code != 200:
            self._mark_down(h, _not_an_agent(r, h.url))
            return
        d = r.json()
        if not self._accept_agent(h, d):
            return
        h.virtual, h.note, h.gpus = bool(d["virtual"]), d.get("note", ""), list(d["gpus"])
        h.cpu_cores, h.mem_mb, h.labels = float(d["cpu_cores"]), float(d.get("mem_mb") or 0), dict(d.get("labels") or {})
        before, h.running = h.running, list(d.get("running", []))
        h.stage_user = d.get("stage_user")
        h.reported = True
        h.inventory_boot = d["boot_id"]
        h.size_error = self._size_error(h)
        self._mark_up(h, d["boot_id"], before)

    def _size_error(self, h: HostState) -> str:
        """Why host `h`, as its agent now reports it, cannot take the stages the worker would place on
        it ("" if it can): fewer GPUs or cores than `inventory()` gave the worker, which keeps that
        size (a stage placed on GPU 3 of a host that now has 1 gets CUDA_VISIBLE_DEVICES=3 there).
        A bigger host is used at its old size, with a warning."""
        if h.name not in self._sized:
            return ""
        gpus, cores = self._sized[h.name]
        now_gpus, now_cores = len(h.gpus), h.cpu_cores
        decl = self.hosts.get(h.name) or self.retired[h.name]
        # declared cores (a block's or file's cpu_cores) are what the worker schedules; only a host that
        # now has fewer than the agent-reported cores it was sized on is refused
        core_short = decl.cpu_cores is None and now_cores + 1e-9 < cores
        if now_gpus < gpus or core_short:
            have = f"{_count(now_gpus, 'GPU')}, {_count(now_cores, 'core')}"
            was = f"{_count(gpus, 'GPU')}, {_count(cores, 'core')}"
            if h.name in self._sized_declared:
                # (it did not shrink: its agent did not answer at the worker's start, so the worker planned it at the
                # declared size, and a restart while its agent is down again would do the same)
                return (f"its agent reports {have}, but this worker schedules the host as {was}, planned from {self.declared_by} "
                        f"(its agent did not answer when the worker started): no stage goes there until the worker is restarted "
                        f"while this agent answers, or with a declaration of {_count(now_gpus, 'GPU')}")
            return (f"its agent now reports {have}, but this worker schedules the host as {was} (its size when the worker "
                    f"started): no stage goes there until the worker is restarted, which picks up the new size")
        if now_gpus > gpus or now_cores > cores + 1e-9 and decl.cpu_cores is None:
            log.warning("host %s: its agent now reports %s and %s; this worker keeps using it as %s and %s until it is restarted",
                        h.name, _count(now_gpus, "GPU"), _count(now_cores, "core"), _count(gpus, "GPU"), _count(cores, "core"))
        return ""

    async def refresh(self, timeout: float = 1.0) -> ClusterSnapshot:
        """Ask every agent for its GPUs, cores and running stages, all at once."""
        t0 = time.perf_counter()
        await asyncio.gather(*(self._inventory_one(h, timeout) for h in self.state.values()))
        return ClusterSnapshot(list(self.state.values()), time.time(), time.perf_counter() - t0)

    async def inventory(self) -> ClusterSpec:
        if not any(h.reported for h in self.state.values()):
            await self.refresh(timeout=5.0)
        await self.start()
        unseen = [name for name in self.hosts if not self.state[name].reported]
        # (said in the worker's start-up line: it read "no GPU: virtual GPUs (declared, not detected)" for a cluster
        # of real GPUs whose agents were not reachable yet, whatever the block declared)
        self.inventory_note = "" if not unseen else (
            f"host{'s' if len(unseen) > 1 else ''} {', '.join(unseen)} did not answer: planned at the size "
            f"{self.declared_by} declares, shown as virtual and down until {'their agents answer' if len(unseen) > 1 else 'its agent answers'}")
        spec = ClusterSpec(tuple(self._node_spec(name) for name in self.hosts), name=self.cluster_name)
        self.planned(spec)
        return spec

    def _node_spec(self, name: str, *, warn: bool = True) -> NodeSpec:
        """Declared host `name` as the worker plans it: the size its agent reported (declared cores win), or
        the declared size if it never answered (virtual, down until it does)."""
        decl, h = self.hosts[name], self.state[name]
        if h.reported:
            gpus = len(h.gpus)
            mem = float(h.gpus[0]["memory_total_mb"]) if h.gpus else (decl.gpu_mem_mb or 16_384.0)
            # (a declared, virtual GPU has no model: "generic", not the agent's placeholder name "virtual",
            # which read "GPUs gpu-a:0 virtual virtual" in the placement lines)
            model = decl.gpu_model or (short_gpu_model(h.gpus[0]["name"]) if h.gpus and not h.virtual else "generic")
            for note in size_notes(decl, h, self.declared_by) if warn else ():
                log.warning("host %s: %s", name, note)
            cores = decl.cpu_cores or h.cpu_cores or 1.0
            virtual = h.virtual
        else:  # never answered: the declared size, marked down by the heartbeats
            gpus, mem, model = decl.gpus or 0, decl.gpu_mem_mb or 16_384.0, decl.gpu_model or "generic"
            cores, virtual = decl.cpu_cores or 1.0, True
        return NodeSpec(
            name=name, gpus=gpus, gpu_mem_mb=mem, cpu_cores=cores, mem_mb=decl.mem_mb or h.mem_mb or 262_144.0,
            switch=decl.switch, gpu_model=model, virtual=virtual, address=h.url, labels={**h.labels, **decl.labels},
        )

    def planned(self, cluster: ClusterSpec) -> None:
        """The worker plans on `cluster` from now on: the size of each host there is the one a restarted agent
        is checked against (`_size_error`)."""
        for n in cluster.nodes:
            h = self.state.get(n.name)
            if h is None:
                continue
            changed = self._sized.get(n.name) != (n.gpus, n.cpu_cores)
            self._sized[n.name] = (n.gpus, n.cpu_cores)
            (self._sized_declared.discard if h.reported else self._sized_declared.add)(n.name)
            if changed and h.reported and h.inventory_boot is not None:
                h.size_error = self._size_error(h)  # (the next heartbeat brings a host that now fits up)

    # ------------------------------------------------------------------ the cluster's description changes
    async def update_cluster(self, new: Backend, busy: Collection[str] = ()) -> ClusterUpdate:
        """Take the hosts of `new`, an AgentBackend built from the edited cluster block or file (`Backend.update_cluster`).

        An added host is asked for its inventory at once (sized by its agent, or at its declared size and down
        until it answers). A removed host is retired: heartbeaten and its stages followed as before, never
        healthy, until `drop_host`. A host whose agent URL changed moves to the new URL if no stage runs there
        (none of `busy`, none its agent reports), else keeps the old one (said in `not_applied`, tried again at
        the next update). Declared sizes, models and labels are taken as they are (`_node_spec`). The token and
        the heartbeat timing are the agents' and every open connection's: a change of them needs a restart."""
        if not isinstance(new, AgentBackend):
            raise NotImplementedError(f"the cluster is now of another kind ({new.name} backend), and this worker runs its stages "
                                      f"through the {self.name} backend")
        not_applied = []
        if new._headers != self._headers:
            not_applied.append("its agent token changed, and the stages running now were started (and are followed) with the old one; "
                               "the worker keeps the old token until it is restarted")
        if new.ca_cert != self.ca_cert:
            not_applied.append("its CA certificate for the agents changed; the worker's connections keep the old one until it is restarted")
        if new.pipelines_on != self.pipelines_on:
            # (read when a pipeline run starts: the runs already started stay where they are, and are watched as before)
            self.pipelines_on = new.pipelines_on
        for what, mine, theirs in (("heartbeat_s", self.heartbeat_s, new.heartbeat_s), ("fence_after_s", self.fence_after_s, new.fence_after_s)):
            if mine != theirs:
                not_applied.append(f"its {what} changed from {mine} to {theirs}; the worker keeps {mine} until it is restarted")
        # the hosts new or moved to another URL are asked first: the only wait, before anything changes here (the
        # worker's heartbeat in between sees the hosts as they were)
        fresh: dict[str, HostState] = {}
        decls: dict[str, AgentHost] = {}
        for name, decl in new.hosts.items():
            url = decl.url.rstrip("/")
            h = self.state.get(name)
            if h is not None and h.url != url:
                if name in busy or name in self._following or (h.up and h.running):
                    not_applied.append(f"host {name}'s agent URL changed from {h.url} to {url}, but stages run there through the "
                                       "old one: it keeps the old URL until they end (or until the worker is restarted)")
                    decl = dataclasses.replace(decl, url=h.url)
                else:
                    fresh[name] = HostState(name, url)
            elif h is None:
                fresh[name] = HostState(name, url)
            decls[name] = decl
        if fresh:
            await asyncio.gather(*(self._inventory_one(h, self._request_timeout_s) for h in fresh.values()))
        for name, h in fresh.items():
            if name in self.state:
                self._forget(name)
            self.state[name] = h
        for name in [n for n in self.hosts if n not in decls]:
            self.retired[name] = self.hosts.pop(name)
        for name, decl in decls.items():
            self.retired.pop(name, None)
            self.hosts[name] = decl
        added = set(fresh)
        return ClusterUpdate([self._node_spec(name, warn=name in added) for name in self.hosts], not_applied)

    def drop_host(self, name: str) -> bool:
        """Forget retired host `name` (its heartbeats, connections and size); False while a wait still follows a stage there."""
        if name in self.hosts:
            return False
        if self._following.get(name):
            return False
        self.retired.pop(name, None)
        self._forget(name)
        return True

    def _forget(self, name: str) -> None:
        h = self.state.pop(name, None)
        self._sized.pop(name, None)
        self._sized_declared.discard(name)
        if h is not None and not any(o.url == h.url for o in self.state.values()):  # (its connections, unless shared)
            for use in ("api", "hb"):
                c = self._clients.pop((h.url, use), None)
                if c is not None:
                    task = asyncio.get_running_loop().create_task(c.aclose())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)

    def renumber(self, handle: StageHandle, where: dict[int, int]) -> None:
        for part in handle.ref.get("parts") or []:
            if isinstance(part.get("node"), int) and part["node"] in where:
                part["node"] = where[part["node"]]

    # ------------------------------------------------------------------ launch
    def _host_for(self, node: NodeSpec) -> HostState:
        if node.name in self.state:
            return self.state[node.name]
        for h in self.state.values():
            if node.address and h.url == node.address.rstrip("/"):
                return h
        raise SpecError("node", f"node {node.name!r} is not a host of agent cluster {self.cluster_name!r}")

    async def launch(self, spec: LaunchSpec) -> StageHandle:
        await self.start()
        p = spec.placement
        nodes = list(p.nodes)
        names = [spec.cluster.nodes[i].name for i in nodes]
        parts: list[dict[str, Any]] = []
        bodies = []
        for rank, idx in enumerate(nodes):
            node = spec.cluster.nodes[idx]
            h = self._host_for(node)
            cpuset = spec.cpusets.get(idx)
            env = placement_env(p, spec.cluster, idx, cpuset, requested_gpus=spec.requested_gpus)
            env.update(spec.env)
            env.update({"QOSFLOW_GANG_RANK": str(rank), "QOSFLOW_GANG_SIZE": str(len(nodes)), "QOSFLOW_GANG_HOSTS": ",".join(names)})
            parts.append({"host": h.name, "url": h.url, "node": idx, "stage_id": spec.stage_id, "boot_id": None, "pid": None})
            bodies.append({"stage_id": spec.stage_id, "command": spec.command, "env": env, "cwd": spec.cwd, "cpuset": cpuset,
                           "labels": spec.labels, "gpus": list(p.gpus_on(idx)), "python_fallback": _is_own_python(spec.command)})
        handle = StageHandle(spec.stage_id, self.name, names[0], {"parts": parts, "launched_at": time.time(), "launch_error": None})
        # (every host's answer, also when one raises: a rank another host started must not be left running)
        results = await asyncio.gather(*(self._post(part, body) for part, body in zip(parts, bodies)), return_exceptions=True)
        raised = [e for e in results if isinstance(e, BaseException)]
        errors = [e for e in results if isinstance(e, str)]
        if raised or errors:
            # a gang starts whole or not at all. SIGKILL at once (grace 0), as for the ranks of a gang that lost a host: a
            # rank's Prefect engine given a SIGTERM reports the flow run Crashed, while the worker runs that same flow run
            # again as its next attempt (the launch failure is an infrastructure failure)
            try:
                await self.kill(handle, reason="gang launch failed", grace=0)
            finally:
                # (killed: nothing of them for a stopping worker's fence hold to keep, nor for this backend to report)
                for part in parts:
                    self._forget_live(part["host"], part["stage_id"])
            if raised:
                raise raised[0]
            handle.ref["launch_error"] = "; ".join(errors)
        return handle

    def _forget_live(self, host: str, stage_id: str) -> None:
        sids = self._live.get(host)
        if sids is not None:
            sids.discard(stage_id)
            if not sids:
                del self._live[host]

    async def _post(self, part: dict[str, Any], body: dict[str, Any]) -> str | None:
        h = self.state[part["host"]]
        if h.reported and not h.up:
            return f"host {h.name} is down ({h.error})"
        try:
            r = await self._client(h).post(f"{h.url}/v1/stages", json=body)
        except httpx.HTTPError as exc:
            why = _http_error(exc, h.url)
            self._mark_down(h, f"on launch: {why}")
            return f"cannot reach the agent of host {h.name} at {h.url} ({why})"
        if r.status_code == 401:
            raise AgentAuthError(f"agent {h.name} at {h.url} rejected the token (401): give the worker the cluster's token")
        if r.status_code in (201, 409):  # 409: this very attempt is already there; adopt it, never start it twice
            st = r.json() if r.status_code == 201 else r.json()["status"]
            part["pid"] = st.get("pid")
            if h.boot_id is None:
                await self._probe(h)
            part["boot_id"] = h.boot_id
            self._live.setdefault(h.name, set()).add(part["stage_id"])
            return None
        return f"agent {h.name} refused the launch: HTTP {r.status_code} {_detail(r)}"

    # ------------------------------------------------------------------ pipeline runs
    def pipeline_host(self, free_cores: dict[str, float] | None = None) -> str | None:
        """The host a pipeline run goes to (`pipelines_on`): the host it names, else the up host with the most free
        CPU cores (`free_cores`: the worker's view, cores no stage holds; else the host's cores), fewest pipeline runs
        this backend started there breaking ties. None when no host is up."""
        if self.pipelines_on not in ("worker", "agents"):
            return self.pipelines_on
        up = [h for h in self.state.values() if h.up and h.name not in self.retired and h.name in self.hosts]
        if not up:
            return None
        free = free_cores or {}
        if free:  # (the worker's view: a host it has marked down is not offered)
            up = [h for h in up if h.name in free] or up

        def pipelines(h: HostState) -> int:  # (this backend's pipeline runs the host's agent still runs)
            return sum(1 for sid, where in self._pipelines.items() if where == h.name and sid in h.running)

        return max(up, key=lambda h: (free.get(h.name, h.cpu_cores), -pipelines(h))).name

    async def launch_unplaced(self, stage_id: str, command: list[str], env: dict[str, str], cwd: str | None = None, *,
                              labels: dict[str, str] | None = None, cpu_cores: float | None = None, mem_mb: float | None = None,
                              host: str | None = None) -> StageHandle:
        """Start a pipeline run (role pipeline: it holds no GPU and dispatches its stages) through the agent of `host`
        (else `pipeline_host()`): a process with no GPU (CUDA_VISIBLE_DEVICES empty, no cpuset), labelled
        `qosflow.dev/role=pipeline`. Its handle is a stage's: `wait`, `kill` (SIGTERM, then SIGKILL after the grace)
        and `adopt` (by any worker, from the lease's host) work on it alike. A host that is down or refuses the launch
        is the handle's `launch_error` (its wait reports it). `cpu_cores`/`mem_mb` are not enforced (no cpuset)."""
        await self.start()
        name = host or self.pipeline_host()
        ref: dict[str, Any] = {"parts": [], "launched_at": time.time(), "launch_error": None, "role": "pipeline"}
        handle = StageHandle(stage_id, self.name, name or "", ref)
        if name is None or name not in self.state:
            ref["launch_error"] = (f"no host of {self.declared_by} is up to run the pipeline run" if name is None else
                                   f"host {name!r} (pipelines_on) is not a host of {self.declared_by}")
            return handle
        h = self.state[name]
        part = {"host": h.name, "url": h.url, "node": None, "stage_id": stage_id, "boot_id": None, "pid": None, "role": "pipeline"}
        ref["parts"].append(part)
        body = {"stage_id": stage_id, "command": list(command),
                "env": {**{k: str(v) for k, v in env.items() if v is not None}, "CUDA_VISIBLE_DEVICES": "", "QOSFLOW_NODE": h.name},
                "cwd": cwd, "cpuset": None, "labels": {**(labels or {}), PIPELINE_ROLE_LABEL: "pipeline"}, "gpus": [],
                "python_fallback": _is_own_python(command)}
        err = await self._post(part, body)
        if err:
            ref["launch_error"] = err
        else:
            self._pipelines[stage_id] = h.name
            if stage_id not in h.running:
                h.running.append(stage_id)
        return handle

    async def ranks_exited_ok(self, handle: StageHandle, skip: Collection[int] = ()) -> set[int]:
        """A gang's parts (`ref["parts"]`, each with its `rank`, set at the launch or from the lease's host order at an
        adoption) whose agent reports the process exited 0 on its own (no kill, no start error); hosts down or parts
        their agent does not know (404) are looked at again later."""
        out: set[int] = set()
        for part in handle.ref.get("parts") or []:
            rank = part.get("rank")
            h = self.state.get(part.get("host"))
            if not isinstance(rank, int) or rank <= 0 or rank in skip or h is None or not h.up:
                continue
            r = await self._client(h).get(f"{h.url}/v1/stages/{part['stage_id']}")
            if r.status_code != 200:
                continue
            st = r.json()
            if st.get("state") == "exited" and not st.get("killed_reason") and not st.get("error") and st.get("returncode") == 0:
                out.add(rank)
        return out

    async def adopt(self, stage_id: str, hosts: list[str]) -> StageHandle | None:
        """Find an attempt a previous worker started (from its lease) and return a handle to it."""
        parts = []
        pipeline = False
        for name in hosts:
            h = self.state.get(name)
            if h is None:
                # removed from the cluster block (or file) since the stage was started: as a host that does not
                # answer, its part is not found. (A KeyError here ended the worker's whole lease recovery: the
                # stages of the hosts still in the cluster were not adopted, and this lease was never released)
                log.warning("stage %s ran on host %s, which is no longer in %s: it is not adopted from there (if that host's agent "
                            "still runs it, its --fence-after ends it once no worker heartbeats it, unless it is a pipeline run: "
                            "stop that through the agent, DELETE /v1/stages/%s)", stage_id, name, self.declared_by, stage_id)
                continue
            try:
                # (adopt=1: this worker takes the stage over on its agent: its fence is now this worker's silence, and a
                # hold this worker asks covers it; the worker that launched it no longer keeps it running)
                r = await self._client(h).get(f"{h.url}/v1/stages/{stage_id}", params={"adopt": "1"})
            except httpx.HTTPError as exc:
                if not _refused(exc):
                    # silent, not gone (a network split between this worker and the host, an agent too busy to answer):
                    # its agent may still run the stage, and the worker that stopped asked it to hold its fence
                    # (`hold_fences`). Not adopting it here released its lease and the stage ran again elsewhere at once,
                    # while it ran on there for up to that hold. Followed as a silent host's part: counted lost only
                    # once its fence and the hold are over (`_follow_part`), unless the host answers first
                    # (`claim`: its first request the agent answers takes it over, as the GET above would have)
                    parts.append({"host": name, "url": h.url, "node": None, "stage_id": stage_id, "boot_id": None, "pid": None,
                                  "unseen_since": time.monotonic(), "claim": True})
                continue
            if r.status_code == 200:
                await self._probe(h)
                st = r.json()
                parts.append({"host": name, "url": h.url, "node": None, "stage_id": stage_id, "boot_id": h.boot_id, "pid": st.get("pid")})
                if st.get("state") != "exited":
                    self._live.setdefault(name, set()).add(stage_id)
                pipeline = (st.get("labels") or {}).get(PIPELINE_ROLE_LABEL) == "pipeline"
        if not parts:
            return None
        ref: dict[str, Any] = {"parts": parts, "launched_at": None, "launch_error": None}
        if pipeline:  # (a pipeline run `launch_unplaced` started, adopted from its lease by this or another worker)
            ref["role"] = parts[0]["role"] = "pipeline"
            self._pipelines[stage_id] = parts[0]["host"]
        return StageHandle(stage_id, self.name, parts[0]["host"], ref)

    # ------------------------------------------------------------------ wait
    async def wait(self, handle: StageHandle) -> ExitStatus:
        await self.start()
        if handle.ref.get("launch_error"):
            return ExitStatus(ExitKind.INFRA, None, f"launch failed: {handle.ref['launch_error']}")
        parts = handle.ref["parts"]
        tasks = {asyncio.ensure_future(self._wait_part(part)): part for part in parts}
        try:
            pending = set(tasks)
            said = ""  # (an ended part's reason, kept: "the pipeline run ended Completed while its host was silent")
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    st = t.result()
                    if not st.ok:
                        if pending:
                            await self._kill_rest(handle, [tasks[p] for p in pending], st)
                        return st
                    said = said or st.reason
            return ExitStatus(ExitKind.OK, 0, said)
        finally:
            for t in tasks:
                t.cancel()

    async def _kill_rest(self, handle: StageHandle, rest: list[dict[str, Any]], st: ExitStatus) -> None:
        """A gang member ended badly: stop the ranks still running (`rest`), not the one that ended (its host may be
        frozen, and a request to it would hang until the host answers again). After an infrastructure failure they
        get SIGKILL at once (grace 0): a rank's Prefect engine given a SIGTERM reports the flow run `Crashed` ("aborted
        by a termination signal"), and the worker then would not run the gang again once its hosts are back."""
        grace = 0.0 if st.kind is ExitKind.INFRA else None
        await self.kill(StageHandle(handle.stage_id, handle.backend, handle.node, {**handle.ref, "parts": rest}),
                        reason=f"gang member failed: {st.reason}", grace=grace)

    async def _wait_part(self, part: dict[str, Any]) -> ExitStatus:
        self._following[part["host"]] += 1
        try:
            st = await self._follow_part(part)
            self._forget_live(part["host"], part["stage_id"])  # (ended, or lost: nothing to hold for)
            return st
        finally:
            self._following[part["host"]] -= 1
            if self._following[part["host"]] <= 0:
                del self._following[part["host"]]

    async def _follow_part(self, part: dict[str, Any]) -> ExitStatus:
        from qosflow.failures import classify_process_exit

        h = self.state[part["host"]]
        if h.boot_id is None:
            await self._probe(h)
        if part.get("boot_id") is None:
            part["boot_id"] = h.boot_id
        while True:
            if self._closed:
                # the worker stops and leaves its stages running for the next worker (their agents hold their fences): this
                # wait says nothing of them; it ends when the worker cancels it
                await asyncio.Event().wait()
            if not h.up and part.get("role") == "pipeline" and not h.refused and h.last_ok_mono and h.name in self.state:
                left = h.last_ok_mono + max(self.pipeline_silence_s, self._fence_of(h) or 0.0) - time.monotonic()
                if left > 0:
                    await asyncio.sleep(min(left, max(0.2, self.heartbeat_s)))
                    continue
                said = await self._pipeline_reports(part, h)
                if isinstance(said, ExitStatus):
                    return said
                if said:  # (the host is silent, the run is not: wait for the host, asking Prefect again now and then)
                    await asyncio.sleep(max(0.2, min(self.heartbeat_s, self.pipeline_liveness_every_s)))
                    continue
            if not h.up:
                fence = self._fence_of(h)
                if not h.refused and fence and part.get("unseen_since") and part.get("boot_id") is None:
                    # adopted from a worker that stopped, on a host that has not answered this worker: its agent may run
                    # the stage until the hold that worker asked (at most `fence_hold_s`, from before this adoption) and
                    # its fence are over. Asked again meanwhile: a host that answers is followed as any other
                    end = part["unseen_since"] + max(fence, self.fence_hold_s) + fence
                    if time.monotonic() < end:
                        await asyncio.sleep(max(0.05, min(end - time.monotonic(), max(0.2, self.heartbeat_s))))
                        if await self._probe(h):
                            part["boot_id"] = h.boot_id
                            self._live.setdefault(h.name, set()).add(part["stage_id"])  # (until its wait ends)
                        continue
                if not h.refused and fence and h.last_ok_mono:
                    # silent, not gone: its agent may still run the stage until its fence fires (it looks every
                    # min(0.5, fence / 4) s: that much later at worst). On the monotonic clock: a step of this host's wall
                    # clock forward ended this wait at once, and the stage ran again elsewhere while it still ran there
                    await asyncio.sleep(max(0.0, h.last_ok_mono + fence + min(0.5, fence / 4) - time.monotonic()))
                also = " (and the pipeline run no longer reports to Prefect)" if part.get("_liveness") is False else ""
                return ExitStatus(ExitKind.INFRA, None, f"host {h.name} lost: {h.error}{also}")
            if h.boot_id != part["boot_id"]:
                return ExitStatus(ExitKind.INFRA, None, f"the agent on host {h.name} restarted; stage {part['stage_id']} was lost with it")
            changed = h.changed
            params: dict[str, Any] = {"timeout": self.poll_s}
            if part.get("claim"):
                params["adopt"] = "1"  # (adopted while its host was silent: take it over on its agent now)
            poll = asyncio.ensure_future(
                self._client(h).get(f"{h.url}/v1/stages/{part['stage_id']}/wait", params=params, timeout=self.poll_s + 5)
            )
            flag = asyncio.ensure_future(changed.wait())
            try:
                done, _ = await asyncio.wait({poll, flag}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the caller stopped waiting (worker shutdown): leave no orphan request
                poll.cancel()
                flag.cancel()
                raise
            flag.cancel()
            if poll not in done:
                poll.cancel()
                continue  # host state changed: re-check at the top
            try:
                r = poll.result()
            except httpx.HTTPError:
                # the connection broke: an agent that died closes it at once; confirm with a probe
                if not await self._probe(h, timeout=max(0.2, self.heartbeat_s / 2)):
                    continue
                await asyncio.sleep(0.05)
                continue
            if r.status_code == 404:
                return ExitStatus(ExitKind.INFRA, None, f"host {h.name} no longer knows stage {part['stage_id']} (agent restarted)")
            if r.status_code == 401:
                raise AgentAuthError(f"agent {h.name} rejected the token (401)")
            if r.status_code != 200:
                await asyncio.sleep(0.2)
                continue
            part.pop("claim", None)
            s = r.json()
            if s["state"] == "exited":
                st = classify_process_exit(s.get("returncode"), killed_reason=s.get("killed_reason"), error=s.get("error"))
                where = f"on host {h.name}"
                return ExitStatus(st.kind, st.code, f"{st.reason} {where}" if st.reason else "")

    async def _pipeline_reports(self, part: dict[str, Any], h: HostState) -> ExitStatus | bool:
        """A pipeline run whose host has been silent past `pipeline_silence_s` (and its fence): what Prefect says of it
        (`pipeline_liveness`), asked at most every `pipeline_liveness_every_s`. An ExitStatus: the run ended while its host
        was silent; True: it still reports to Prefect (logged once per silence); False: Prefect heard nothing recent of it
        either, or there is no one to ask (it is lost)."""
        ask = self.pipeline_liveness
        if ask is None:
            return False
        now = time.monotonic()
        if part.get("_liveness_at") is not None and now - part["_liveness_at"] < self.pipeline_liveness_every_s:
            return bool(part.get("_liveness"))
        sid = part["stage_id"]
        try:
            said = await ask(sid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (Prefect unreachable too: nothing says the run is alive)
            log.warning("pipeline run %s: host %s is silent and Prefect could not be asked about the run: %s", sid, h.name, exc)
            said = None
        silent_s = time.monotonic() - (h.last_ok_mono or time.monotonic())
        if isinstance(said, ExitStatus):
            part.pop("_liveness_at", None)
            log.info("pipeline run %s ended (%s) while its host %s was silent (%.0fs)", sid, said.reason or said.kind.value, h.name,
                     silent_s)
            return said
        part["_liveness_at"], part["_liveness"] = now, bool(said)
        if said and part.get("_silence_said") != h.down_since:
            part["_silence_said"] = h.down_since
            log.warning("host %s has been silent for %.0fs (%s), but pipeline run %s still reports to Prefect%s: it is not "
                        "reported lost, its wait goes on", h.name, silent_s, h.error or "no answer", sid,
                        f" ({said})" if isinstance(said, str) else "")
        elif not said:
            log.warning("host %s has been silent for %.0fs (%s) and pipeline run %s no longer reports to Prefect either: "
                        "it is reported lost", h.name, silent_s, h.error or "no answer", sid)
        return bool(said)

    # ------------------------------------------------------------------ progress
    syncs_progress = True

    def progress_file(self, stage_id: str) -> str:
        return self._progress.path(stage_id)

    async def sync_progress(self, handles: Sequence[StageHandle]) -> None:
        """Copy what each stage's rank 0 wrote to its progress file since the last copy: one request per
        host for all its stages (POST /v1/progress, from each copy's size), again for a stage whose answer
        filled its 1 MiB."""
        by_host: dict[str, list[str]] = {}
        for handle in handles:
            parts = handle.ref.get("parts") or []
            if handle.backend == self.name and parts and parts[0]["host"] in self.state:
                by_host.setdefault(parts[0]["host"], []).append(parts[0]["stage_id"])

        async def one(host: str, sids: list[str]) -> None:
            h = self.state[host]
            while sids and not (h.reported and not h.up):
                try:
                    r = await self._client(h).post(f"{h.url}/v1/progress", json={"offsets": {s: self._progress.size(s) for s in sids}})
                except httpx.HTTPError:
                    return
                if r.status_code != 200:
                    return
                more = []
                for sid, text in (r.json().get("stages") or {}).items():
                    data = text.encode("utf-8", "surrogateescape")
                    self._progress.append(sid, data)
                    if len(data) >= 1 << 20:
                        more.append(sid)
                sids = more

        await asyncio.gather(*(one(host, sids) for host, sids in by_host.items()))

    # ------------------------------------------------------------------ control
    async def kill(self, handle: StageHandle, reason: str = "cancelled", grace: float | None = None) -> None:
        grace = self.kill_grace_s if grace is None else max(0.0, float(grace))

        async def one(part: dict[str, Any]) -> None:
            h = self.state.get(part["host"])
            if h is None:
                return  # a host taken out of the cluster and forgotten (`drop_host`) once nothing ran there
            try:
                r = await self._client(h).delete(
                    f"{h.url}/v1/stages/{part['stage_id']}",
                    params={"reason": reason, "grace": grace},
                    timeout=grace + 10,
                )
            except httpx.HTTPError:
                return  # host gone: its stages died with its agent (or its fence)
            # the answer was not read: an agent that refused (401: another token since its restart) or could not
            # signal the stage (500) left it running while the worker took it for killed and gave its GPU away
            if r.status_code == 401:
                raise AgentAuthError(f"agent {h.name} at {h.url} rejected the token (401) when asked to kill stage "
                                     f"{part['stage_id']}: it still runs there; give the worker the cluster's token")
            if r.status_code >= 400 and r.status_code != 404:  # 404: the agent no longer knows it (restarted)
                raise QosflowError(f"agent {h.name} at {h.url} could not kill stage {part['stage_id']} "
                                   f"(HTTP {r.status_code}: {_detail(r)})")

        results = await asyncio.gather(*(one(p) for p in handle.ref.get("parts", [])), return_exceptions=True)
        for res in results:  # every rank asked before the first failure is raised
            if isinstance(res, BaseException):
                raise res

    async def logs(self, handle: StageHandle) -> AsyncIterator[str]:
        """Follow rank 0's output (stdout and stderr) line by line until the stage ends."""
        part = handle.ref["parts"][0]
        h = self.state[part["host"]]
        async with self._client(h).stream("GET", f"{h.url}/v1/stages/{part['stage_id']}/logs", params={"follow": True}, timeout=None) as r:
            if r.status_code != 200:
                return
            async for line in r.aiter_lines():
                yield line

    async def set_cpus(self, handle: StageHandle, node: int, cpuset: list[int]) -> None:
        for part in handle.ref["parts"]:
            if part.get("node") == node or len(handle.ref["parts"]) == 1:
                h = self.state[part["host"]]
                r = await self._client(h).put(f"{h.url}/v1/stages/{part['stage_id']}/cpuset", json={"cpuset": cpuset})
                r.raise_for_status()
                return
        raise SpecError("node", f"stage {handle.stage_id} does not run on node index {node}")

    async def status(self, handle: StageHandle) -> list[dict[str, Any]]:
        out = []
        for part in handle.ref["parts"]:
            h = self.state[part["host"]]
            r = await self._client(h).get(f"{h.url}/v1/stages/{part['stage_id']}")
            out.append(r.json() if r.status_code == 200 else {"host": h.name, "http": r.status_code})
        return out

    async def hold_fences(self, seconds: float | None = None) -> None:
        """Ask the agents that run this backend's stages not to fence them for a silence of `seconds` (default
        `fence_hold_s`): the worker stops, and the next one adopts them. An agent that does not answer (or an older one,
        without the route) is left as it is: its fence fires as before."""
        hold = self.fence_hold_s if seconds is None else seconds
        hosts = [self.state[n] for n, sids in self._live.items() if sids and n in self.state]
        if not hold or not hosts:
            return

        async def one(h: HostState) -> None:
            try:
                async with httpx.AsyncClient(headers=self._request_headers(), verify=self._verify) as c:  # (this backend's are closed)
                    r = await c.post(f"{h.url}/v1/fence/hold", json={"seconds": hold}, timeout=max(1.0, self.heartbeat_s))
            except httpx.HTTPError as exc:
                log.warning("host %s: could not ask its agent to hold its fence while no worker runs (%s): its --fence-after "
                            "kills its stages", h.name, _http_error(exc, h.url))
                return
            if r.status_code != 200:
                log.warning("host %s: its agent did not hold its fence (HTTP %d%s): its --fence-after kills its stages while no "
                            "worker runs (an agent older than this worker: upgrade it)", h.name, r.status_code,
                            f": {_detail(r)}" if r.status_code != 404 else "")

        await asyncio.gather(*(one(h) for h in hosts))

    async def aclose(self) -> None:
        self._closed = True
        if self._beat_task:
            self._beat_task.cancel()
            try:
                await self._beat_task
            except (asyncio.CancelledError, Exception):
                pass
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
        try:  # (after the heartbeats stopped: a heartbeat ends an agent's hold)
            await self.hold_fences()
        except Exception:  # noqa: BLE001 - closing goes on
            log.exception("holding the agents' fences failed")
        self._progress.close()


# ---------------------------------------------------------------------- cluster files
@dataclass
class ClusterFile:
    """A bare-metal cluster described in a file (YAML or JSON).

    ```yaml
    name: lab
    token_file: agent-token          # or token: ..., or token_env: VAR (relative paths: beside this file)
    heartbeat_s: 2
    fence_after_s: 3                 # the agents' --fence-after (optional)
    tls_ca_file: ca.pem              # agents at https:// with a certificate of this CA (optional)
    pipelines_on: worker             # deployed pipeline runs: worker (its host), agents, or a host's name
    gpus_per_host: 4                 # defaults for every host; a host may override them
    gpu_mem_mb: 16384
    cpu_cores: 16
    hosts:
      - {name: gpu-a, agent_url: "http://127.0.0.1:8701"}
      - {name: gpu-b, agent_url: "http://127.0.0.1:8702", gpus: 2}
    ```
    """

    name: str
    token: str
    hosts: list[AgentHost]
    heartbeat_s: float = 2.0
    fence_after_s: float | None = None
    path: str | None = None
    #: PEM of the CA that signed the agents' certificates (`tls_ca_file:`), for https:// agents
    ca_cert: str | None = None
    #: where deployed pipeline runs run (`pipelines_on:`): worker (default), agents, or a host's name
    pipelines_on: str = "worker"

    def spec(self) -> ClusterSpec:
        """The declared cluster (virtual GPUs unless the agents report NVML; see `AgentBackend.inventory`)."""
        return ClusterSpec(
            tuple(
                NodeSpec(h.name, h.gpus or 0, h.gpu_mem_mb or 16_384.0, h.cpu_cores or 1.0, h.mem_mb or 262_144.0, h.switch,
                         h.gpu_model or "generic", True, h.url, dict(h.labels))
                for h in self.hosts
            ),
            name=self.name,
        )

    def backend(self, **kw: Any) -> AgentBackend:
        kw.setdefault("heartbeat_s", self.heartbeat_s)
        kw.setdefault("fence_after_s", self.fence_after_s)
        kw.setdefault("declared_by", f"cluster file {self.path}" if self.path else f"cluster file {self.name!r}")
        kw.setdefault("ca_cert", self.ca_cert)
        kw.setdefault("pipelines_on", self.pipelines_on)
        return AgentBackend(self.hosts, self.token, cluster_name=self.name, **kw)

    def ask_agents(self):
        """Ask every agent once, from code that runs no event loop (`qosflow agent status`, the demo's
        check before it starts): the backend's `refresh()` snapshot, its connections closed."""
        import asyncio

        async def go():
            be = self.backend()
            try:
                return await be.refresh()
            finally:
                await be.aclose()

        return asyncio.run(go())


def load_cluster_file(path: str | Path) -> ClusterFile:
    """Read a cluster file; every mistake names the file and the field."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # was a UnicodeDecodeError traceback
        raise SpecError("cluster", "not a text file; a cluster file is YAML or JSON listing the hosts (name, agent_url) "
                        "and the agents' token (see docs/infrastructure.md)", where=where) from None
    except OSError as exc:
        raise SpecError("cluster", f"cannot read {path}: {exc.strerror}") from None
    import yaml

    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise SpecError("cluster", f"not valid JSON: {exc.msg} (column {exc.colno})", where=f"{path}:{exc.lineno}") from None
    except yaml.YAMLError as exc:
        # one line at the file's line, not PyYAML's several lines about '<unicode string>'
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).replace("\n", " ")
        loc, col = (f"{path}:{mark.line + 1}", f" (column {mark.column + 1})") if mark is not None else (where, "")
        raise SpecError("cluster", f"not valid YAML: {problem}{col}", where=loc) from None
    if not isinstance(data, dict):
        raise SpecError("cluster", "expected a mapping with `hosts:`", where=where)
    token = data.get("token")
    if data.get("token_file"):
        tf = Path(str(data["token_file"])).expanduser()
        tf = tf if tf.is_absolute() else path.parent / tf
        try:
            token = tf.read_text().strip()
        except OSError as exc:
            raise SpecError("token_file", f"cannot read {tf.absolute()}: {exc.strerror} (relative paths are beside the cluster file); "
                                          "copy the cluster's token file there, the same file the agents' --token-file reads",
                            where=where) from None
        if not token:
            raise SpecError("token_file", f"{tf} is empty; put the cluster's secret token in it, the same as the agents' "
                                          "--token-file", where=where)
        warned = token_file_warning(tf)
        if warned and (warned := f"{where}: {warned}") not in _WARNED:  # (once: the worker reads its file again every minute)
            _WARNED.add(warned)
            log.warning("%s", warned)
    elif data.get("token_env"):
        token = os.environ.get(str(data["token_env"]), "")
        if not token:
            raise SpecError("token_env", f"environment variable {data['token_env']} is not set", where=where)
    token = token or os.environ.get("QOSFLOW_AGENT_TOKEN", "")
    if not token:
        raise SpecError("token", "give the agents' secret token: token_file:, token_env: or token:", where=where)
    _no_unknown_keys(data, _FILE_KEYS, where)
    ca_cert = None
    if data.get("tls_ca_file"):
        cf = Path(str(data["tls_ca_file"])).expanduser()
        cf = cf if cf.is_absolute() else path.parent / cf
        try:
            ca_cert = cf.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError("tls_ca_file", f"cannot read {cf}: {getattr(exc, 'strerror', None) or exc}", where=where) from None
        tls_context(ca_cert, "tls_ca_file", where=f"{where}: {cf}")
    raw = data.get("hosts")
    if not isinstance(raw, list) or not raw:
        raise SpecError("hosts", "list at least one host with name and agent_url", where=where)
    hosts = []
    for i, h in enumerate(raw):
        w = f"{where}: hosts[{i}]"
        if not isinstance(h, dict):
            raise SpecError("hosts", "each host is a mapping with name and agent_url", where=w)
        _no_unknown_keys(h, _HOST_KEYS, w)
        url = h.get("agent_url") or h.get("url")
        if not h.get("name") or not url:
            raise SpecError("agent_url" if h.get("name") else "name", "each host needs name and agent_url", where=w)
        if not str(url).startswith(("http://", "https://")):
            raise SpecError("agent_url", f"{url!r} is not an http(s) URL; write e.g. http://{url}", where=w)

        def num(key: str, kind: type = float, *, file_key: str | None = None, strict: bool = True) -> Any:
            """A host's number, else the file-level default; the error names the key that holds it."""
            name, v, src = (key, h[key], w) if key in h else (file_key or key, data.get(file_key or key), where)
            if v is None:
                return None
            f = _as_number(v)
            ok = math.isfinite(f) and (kind is float or f.is_integer())
            if not ok or not (f > 0 if strict else f >= 0):
                what = "a whole number" if kind is int else "a number"
                raise SpecError(name, f"must be {what} {'>' if strict else '>='} 0, got {v!r}", where=src)
            return kind(f)

        hosts.append(
            AgentHost(
                name=str(h["name"]),
                url=str(url),
                gpus=num("gpus", int, file_key="gpus_per_host", strict=False),
                gpu_mem_mb=num("gpu_mem_mb"),
                cpu_cores=num("cpu_cores"),
                mem_mb=num("mem_mb"),
                gpu_model=h.get("gpu_model", data.get("gpu_model")),
                switch=num("switch", int, file_key="-", strict=False) or 0,
                labels={str(k): str(v) for k, v in (h.get("labels") or {}).items()},
            )
        )
    names = [h.name for h in hosts]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise SpecError("hosts", f"host name(s) {', '.join(sorted(dup))} appear twice", where=where)
    at: dict[str, str] = {}
    for i, h in enumerate(hosts):  # (one agent per host: the second would be down, "is agent 'a', not 'b'")
        other = at.setdefault(h.url.rstrip("/").lower(), h.name)
        if other != h.name:
            raise SpecError("agent_url", f"hosts {other} and {h.name} have the same agent_url {h.url}: each host runs its "
                                         f"own agent; give {h.name} its agent's URL (its address, or the --port of its agent)",
                            where=f"{where}: hosts[{i}]")
    timing = {}
    for key in ("heartbeat_s", "fence_after_s"):
        v = data.get(key)
        f = None if v is None else _as_number(v)
        if f is not None and not (math.isfinite(f) and f > 0):
            raise SpecError(key, f"must be a number of seconds > 0, got {v!r}", where=where)
        timing[key] = f
    pipelines_on = check_pipelines_on(data.get("pipelines_on"), names, where)
    return ClusterFile(str(data.get("name") or path.stem), token, hosts, timing["heartbeat_s"] or 2.0,
                       timing["fence_after_s"], str(path), ca_cert, pipelines_on)


_FILE_KEYS = ("name", "token", "token_file", "token_env", "heartbeat_s", "fence_after_s", "gpus_per_host", "gpu_mem_mb",
              "cpu_cores", "mem_mb", "gpu_model", "hosts", "tls_ca_file", "pipelines_on")


def tls_context(ca_pem: str, field: str, *, where: str | None = None) -> Any:
    """An SSL context that trusts the CA certificate(s) in `ca_pem` (PEM text), for agents served over HTTPS
    with a certificate of the cluster's own CA; a text that holds none is an error naming `field`."""
    import ssl

    try:
        return ssl.create_default_context(cadata=ca_pem)
    except (ssl.SSLError, ValueError, TypeError) as exc:
        raise SpecError(field, f"not a PEM CA certificate (-----BEGIN CERTIFICATE----- ...): {getattr(exc, 'reason', None) or exc}",
                        where=where) from None
_HOST_KEYS = ("name", "agent_url", "url", "gpus", "gpu_mem_mb", "cpu_cores", "mem_mb", "gpu_model", "switch", "labels")


def _http_error(exc: httpx.HTTPError, url: str) -> str:
    """What went wrong reaching `url`, in words: a host name that does not resolve, a refused
    connection or a timeout, else the exception's type (a name that does not resolve read only
    "ConnectError from http://gpu-nosuch:8721")."""
    text = str(exc)
    low = text.lower()
    host = httpx.URL(url).host
    if isinstance(exc, httpx.ConnectError):
        if any(k in low for k in ("name or service not known", "nodename nor servname", "name resolution",
                                  "no address associated", "getaddrinfo failed", "errno -2", "errno -3", "errno -5")):
            return f"cannot resolve the host name {host!r} of {url} (name lookup failed: {text}); check the agent URL"
        if _refused(exc):
            return f"connection refused at {url} (is the agent running there?)"
        if "certificate_verify_failed" in low or "certificate verify failed" in low:
            return (f"the TLS certificate of the agent at {url} is not trusted ({text}); give the CA that signed it: tls_ca_file in the "
                    "cluster file, agent_ca_cert in the cluster block")
        if "wrong_version_number" in low or "record layer failure" in low or "packet length too long" in low:
            return f"TLS handshake with {url} failed ({text}): is that agent serving plain HTTP (started without --tls-cert)? then write http://"
    if isinstance(exc, httpx.RemoteProtocolError) and url.startswith("http://") and "disconnected without sending a response" in low:
        return (f"the agent at {url} closed the connection without an answer: an agent started with --tls-cert speaks HTTPS only, "
                f"write https:// ({text})")
    if isinstance(exc, httpx.TimeoutException):
        return f"{type(exc).__name__} from {url} (no answer in time)"
    return f"{type(exc).__name__} from {url}" + (f" ({text})" if text else "")


#: why a host whose agent answers 401 is down, and what to do
TOKEN_REJECTED = ("the agent rejected our token (401): the worker and agent tokens differ; give the agent (--token-file) and "
                  "the worker (the cluster file's token_file, the block's agent_token) the same token")


def size_notes(decl: AgentHost, h: HostState, declared_by: str) -> list[str]:
    """Where the size `declared_by` gives host `decl` differs from what its agent reported (`h`), and which the
    worker uses: the agent's GPUs, the declared cores. Empty for a host that never answered."""
    if not h.reported:
        return []
    out = []
    if decl.gpus is not None and decl.gpus != len(h.gpus):
        out.append(f"{declared_by} declares {_count(decl.gpus, 'GPU')}, its agent reports {len(h.gpus)}; using the agent's")
    if decl.cpu_cores is not None and h.cpu_cores and abs(decl.cpu_cores - h.cpu_cores) > 1e-9:
        out.append(f"{declared_by} declares {_count(decl.cpu_cores, 'CPU core')}, its agent reports {h.cpu_cores:g}; using the "
                   f"declared {decl.cpu_cores:g} (the agent runs the cores it is given on the {h.cpu_cores:g} it has)")
    return out


def _not_an_agent(r: httpx.Response, url: str) -> str:
    """An answer other than 200 or 401 from an agent's URL: most often another web server at that address."""
    return (f"{r.request.method} {r.request.url.path} answered HTTP {r.status_code}, which a qosflow agent does not: is {url} the "
            "agent's address and port (`qosflow agent start --port`)? check the agent URL")


#: the cluster files' warnings already logged by this process
_WARNED: set[str] = set()


def token_file_warning(path: Path) -> str | None:
    """What to say about a token file other users of the host may read (None: only its owner may): with the
    token anyone can launch commands through every agent of the cluster."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (f"the token file {path} can be read by other users of this host (mode {mode:04o}): with it anyone can run "
            f"commands through every agent of the cluster; chmod 600 {path}")


def _refused(exc: BaseException) -> bool:
    """The connection was refused (no agent listens there: its process is gone, and its stages with it). The
    async client says only "All connection attempts failed"; the ConnectionRefusedError is in its causes."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ConnectionRefusedError) or "refused" in str(exc).lower():
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _count(n: float, what: str) -> str:
    """`1 GPU`, `2 GPUs`, `1.5 cores`."""
    return f"{n:g} {what}{'' if n == 1 else 's'}"


def _no_unknown_keys(d: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """A misspelt key (gpus_per_hosts, gpu_mem) would silently be ignored: name it instead."""
    from qosflow.errors import closest_name

    for k in d:
        if k not in known:
            close = closest_name(k, known)
            hint = f"did you mean {close!r}? " if close else ""
            raise SpecError(str(k), f"unknown key; {hint}known keys: {', '.join(known)}", where=where)


def _as_number(v: Any) -> float:
    """A cluster file's number (numbers quoted as strings too); NaN for anything else, bools included."""
    if isinstance(v, bool):
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan

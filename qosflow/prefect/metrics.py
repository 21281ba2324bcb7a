"""Prometheus metrics of a qosflow worker: what its QoS queue and its cluster look like now, and how
its stages ended (`qosflow worker start --metrics-port 9464`, or `QOSFLOW_WORKER_METRICS_PORT`).

Two kinds of series:

- read from the scheduler's live state when Prometheus scrapes (nothing to keep in step): stages
  queued and running, per QoS class; the oldest queued stage's wait; GPUs per node (allocated, shared,
  up); free CPU cores; scheduling rounds;
- counted as things happen: stages finished (by exit kind), deadlines met and missed, the wait from
  ready to placed (a histogram), and the worker's events (rescheduled, CPU rebalanced, node down...).

The endpoint runs on the worker's event loop (prometheus_client's ASGI app under uvicorn), so a
scrape reads the scheduler between two of its steps, never in the middle of one. GPU utilisation is
not here: it comes from NVML on each host (NVIDIA's DCGM exporter), and qosflow never invents it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from qosflow.prefect.cluster_table import node_usage

#: seconds from a stage's ready time to its placement
WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400, float("inf"))


def qos_class(entry: Any) -> str:
    """"deadline" (a stage with a deadline or latency SLO), else its priority class ("critical",
    "guaranteed", "normal", "best-effort"): few values, a label a dashboard can group by."""
    if getattr(entry, "deadline_at", None) is not None:
        return "deadline"
    prio = entry.job.qos.priority
    return str(getattr(prio, "value", prio))


class _Snapshot:
    """The collector of the series read from the scheduler at scrape time."""

    def __init__(self, metrics: "WorkerMetrics") -> None:
        self.m = metrics

    def describe(self) -> Iterable[Any]:
        return []  # the families depend on the scheduler there is at scrape time

    def collect(self) -> Iterable[Any]:
        m = self.m
        sched = m.scheduler()
        policy = m.policy or (getattr(sched.policy, "name", "") if sched is not None else "")
        info = InfoMetricFamily("qosflow_worker", "The qosflow worker behind these series")
        info.add_metric([], {"pool": m.pool, "worker": m.worker, **({"policy": policy} if policy else {})})
        yield info
        ready = GaugeMetricFamily("qosflow_scheduler_ready", "1 once the worker has its cluster and policy (its first stage), else 0")
        ready.add_metric([], 1.0 if sched is not None else 0.0)
        yield ready
        if sched is None:
            return
        now = time.time()
        stages = GaugeMetricFamily("qosflow_stages", "Stages known to the QoS queue, by state and QoS class", labels=["state", "qos_class"])
        counts: dict[tuple[str, str], int] = {}
        oldest: dict[str, float] = {}
        for e in list(sched.entries.values()):
            state = "running" if e.grant is not None else "queued"
            cls = qos_class(e)
            counts[(state, cls)] = counts.get((state, cls), 0) + 1
            if state == "queued":
                oldest[cls] = max(oldest.get(cls, 0.0), now - e.ready_at if e.ready_at else 0.0)
        for (state, cls), n in sorted(counts.items()):
            stages.add_metric([state, cls], n)
        yield stages
        wait = GaugeMetricFamily("qosflow_queued_oldest_wait_seconds", "How long the longest-waiting queued stage of each QoS class has waited", labels=["qos_class"])
        for cls, w in sorted(oldest.items()):
            wait.add_metric([cls], max(0.0, w))
        yield wait
        total = GaugeMetricFamily("qosflow_node_gpus", "GPUs of each node as the worker schedules them", labels=["node"])
        alloc = GaugeMetricFamily("qosflow_node_gpus_allocated", "GPUs of each node holding at least one stage", labels=["node"])
        shared = GaugeMetricFamily("qosflow_node_gpus_shared", "GPUs of each node holding two or more stages (GPU sharing)", labels=["node"])
        up = GaugeMetricFamily("qosflow_node_up", "1 if the node takes stages, 0 if it is down or retired", labels=["node"])
        cores = GaugeMetricFamily("qosflow_node_cpu_cores_free", "CPU cores of each node no stage holds", labels=["node"])
        for u in node_usage(sched.state):
            total.add_metric([u.name], u.gpus)
            alloc.add_metric([u.name], u.allocated)
            shared.add_metric([u.name], u.shared)
            up.add_metric([u.name], 0.0 if u.down else 1.0)
            cores.add_metric([u.name], u.cpu_free)
        yield from (total, alloc, shared, up, cores)
        rounds = CounterMetricFamily("qosflow_scheduler_rounds", "Scheduling rounds the worker's policy has run")
        rounds.add_metric([], int(getattr(sched, "rounds", 0)))
        yield rounds


class WorkerMetrics:
    """A worker's Prometheus series, in a registry of its own (two workers in one process, as in tests,
    do not collide). `scheduler` returns the worker's QoSScheduler, or None before it has one."""

    def __init__(self, pool: str, worker: str, scheduler: Callable[[], Any], *, policy: str | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.pool, self.worker, self.policy = pool, worker, policy
        self.scheduler = scheduler
        self.registry = registry or CollectorRegistry()
        self.finished = Counter("qosflow_stages_finished", "Stages that ended, by how they ended (ok, user, infra, cancelled)",
                                ["exit"], registry=self.registry)
        self.deadlines = Counter("qosflow_stage_deadlines", "Stages with a deadline that ended, by whether they met it (cancelled ones not counted)",
                                 ["outcome"], registry=self.registry)
        self.wait = Histogram("qosflow_stage_wait_seconds", "Seconds from a stage's ready time to its placement",
                              ["qos_class"], buckets=WAIT_BUCKETS, registry=self.registry)
        self.events = Counter("qosflow_events", "Events the worker emitted (qosflow.stage.placed, qosflow.stage.rescheduled, qosflow.node.down...)",
                              ["event"], registry=self.registry)
        self.registry.register(_Snapshot(self))
        self._server: Any = None
        self._task: Optional[asyncio.Task] = None
        self.port: Optional[int] = None

    # ------------------------------------------------------------------ what happened
    def event(self, name: str) -> None:
        self.events.labels(event=name).inc()

    def placed(self, entry: Any, waited_s: float) -> None:
        self.wait.labels(qos_class=qos_class(entry)).observe(max(0.0, float(waited_s)))

    def stage_finished(self, exit_kind: str, deadline_met: bool | None) -> None:
        self.finished.labels(exit=exit_kind).inc()
        if deadline_met is not None and exit_kind != "cancelled":
            self.deadlines.labels(outcome="met" if deadline_met else "missed").inc()

    # ------------------------------------------------------------------ the endpoint
    async def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve `/metrics` on `host:port` (0: any free port) on this event loop; returns the port. A port
        in use or an address this host does not have is a clear error here, not in a background task."""
        import uvicorn
        from prometheus_client import make_asgi_app

        from qosflow.agent.server import QuietServer, bind

        socks = bind(host, port, port_option="--metrics-port", host_option="QOSFLOW_WORKER_METRICS_HOST", what="another worker's metrics")
        self.port = socks[0].getsockname()[1]
        metrics_app = make_asgi_app(registry=self.registry)

        async def app(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope.get("path") not in ("/metrics", "/metrics/"):
                await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"qosflow worker: the metrics are at /metrics\n"})
                return
            await metrics_app(scope, receive, send)

        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = QuietServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=socks), name="qosflow-metrics")
        for _ in range(200):  # started (listening) or failed
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()
        return self.port

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5.0)
        self._server = self._task = None

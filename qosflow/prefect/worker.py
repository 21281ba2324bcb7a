"""The `qosflow` work pool type and its predictive worker.

    prefect work-pool create gpu --type qosflow
    prefect worker start --pool gpu            # or: qosflow worker start --pool gpu

Flow runs submitted to the pool do not start first-come-first-served. `run()` turns each stage run
into a `Job` (its QoS comes from the run's job variables), puts it in the worker's QoS queue and
awaits a grant from the in-worker scheduler loop, which runs the policy over every waiting stage each
round (`ClusterState` + `commit`-style checked allocation). The granted stage is launched through the
backend with `placement_env()` (CUDA_VISIBLE_DEVICES, MPS share, CPU affinity, OMP_NUM_THREADS), its
placement and prediction are written on the flow run (labels) and announced (`qosflow.stage.placed`).

Runs whose job variables carry no QoS (role `pipeline`, e.g. a deployed pipeline's orchestrating
flow) start at once and hold no slot. Cancelling a flow run kills its process (or takes it out of the
queue).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
import os
import random
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Optional

import anyio
import anyio.abc
import numpy as np
from prefect.exceptions import InfrastructureNotFound
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import Field, PrivateAttr

from qosflow.backends.base import Backend, BackendUnreachable, ExitKind, ExitStatus, LaunchSpec, StageHandle
from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job, JobState, JobStatus
from qosflow.core.qos import MAX_GPUS, QoSSpec
from qosflow.core.speed import width_fraction
from qosflow.env import env_flag, env_number
from qosflow.paths import pipeline_output_dir
from qosflow.failures import Action, decide
from qosflow.placement_api import read_progress
from qosflow.prefect.cluster_table import PIPELINE_HOLD, PODS_HOLD, is_hold
from qosflow.prefect.foreign_pods import book_foreign_pods
from qosflow.prefect.scheduler import STAGE_DEFAULT_DURATION, QoSScheduler, StageCancelled, StageEntry, make_live_estimator
from qosflow.prefect.spec import QOS_FIELDS, spec_from_job_variables

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun



def _qos_fields() -> dict[str, Any]:
    """Pydantic fields for the QoS variables (shared by the variables schema and the configuration)."""
    return {}


class QosflowVariables(BaseVariables):
    role: Literal["auto", "stage", "pipeline"] = Field(
        default="auto",
        description="stage: placed by the QoS scheduler; pipeline: an orchestrating flow, started at once without a slot; "
        "auto: stage if any QoS variable is set.",
    )
    stage_name: Optional[str] = Field(default=None, description="Stage name shown in placements and reports.")
    pipeline: Optional[str] = Field(default=None, description="Pipeline (flow) the stage belongs to.")
    pipeline_run_id: Optional[str] = Field(default=None, description="Flow run id of the pipeline run.")
    signature: Optional[str] = Field(default=None, description="Key of the stage's run history (estimates).")
    gpus: Optional[int] = Field(default=None, ge=0, le=MAX_GPUS, description="Whole GPUs (0: CPU-only stage).")
    min_gpus: Optional[int] = Field(
        default=None,
        ge=1,
        description="Elastic start: the stage may start on fewer GPUs than `gpus` (a divisor of it, at least this many), "
        "with gradient accumulation keeping its global batch.",
    )
    gpu_milli: Optional[int] = Field(default=None, ge=1, le=1000, description="Thousandths of one GPU when sharing (needs gpus=1).")
    gpu_mem_mb: Optional[float] = Field(default=None, gt=0, description="GPU memory per GPU (MiB).")
    cpu_cores: Optional[float] = Field(default=None, ge=0, description="CPU cores.")
    mem_mb: Optional[float] = Field(default=None, ge=0, description="Host memory (MiB).")
    deadline: Optional[float] = Field(default=None, gt=0, description="Deadline, seconds after submission.")
    deadline_at: Optional[float] = Field(default=None, description="Absolute stage deadline (epoch seconds), from the pipeline split.")
    latency_slo: Optional[float] = Field(default=None, gt=0, description="Per-step latency SLO (seconds).")
    min_throughput: Optional[float] = Field(default=None, gt=0, description="Minimum steps per second.")
    priority: Optional[str] = Field(default=None, description="critical, guaranteed, normal or best-effort.")
    shareable: Optional[bool] = Field(default=None, description="May share its GPUs with one other stage.")
    gang: Optional[bool] = Field(default=None, description="All GPUs at once (default true).")
    gpu_model: Optional[str] = Field(default=None, description="Required GPU model.")
    expected_duration: Optional[float] = Field(default=None, gt=0, description="Declared expected duration (seconds).")
    batch_size: Optional[int] = Field(default=None, ge=1, description="Global batch size (for sub-batch plans).")
    early_check_s: Optional[float] = Field(
        default=None,
        ge=0,
        description="Early check: run the stage this many seconds on a 1-GPU slot first, to catch user errors before it "
        "takes its full placement (0: never; unset: the QoS policy block's setting, for new multi-GPU stages).",
    )
    qos_policy: Optional[dict[str, Any]] = Field(
        default=None,
        description="A QoS policy block, e.g. {{ prefect.blocks.qosflow-qos-policy.nightly }} (prefect deploy copies its values: "
        "deploy again after changing the block): "
        "a pipeline run gets its deadline and priority from it.",
    )
    cluster_block: Optional[str] = Field(
        default=None, description="Name of the qosflow-bare-metal-cluster block the worker plans on (pool-level)."
    )
    policy_block: Optional[str] = Field(default=None, description="Name of the qosflow-qos-policy block the worker uses (pool-level).")
    cluster_file: Optional[str] = Field(
        default=None,
        description="A cluster file (hosts and agent URLs, `qosflow agent` docs) the worker runs stages on through the agents "
        "(pool-level; overrides cluster_block).",
    )
    cluster_reload_s: Optional[float] = Field(
        default=None,
        ge=0,
        description="Seconds between two readings of the cluster block (or file) by the worker, which applies an edit "
        "(hosts added, removed, resized) without a restart (pool-level; default 60, 0: read only at start; "
        "QOSFLOW_CLUSTER_RELOAD_SECONDS overrides it). On Kubernetes the nodes are read then too, and a node added, "
        "deleted, resized, Ready or not, cordoned or uncordoned is followed within a second of the node watch's event "
        "whatever this period (not with 0: the worker then keeps the nodes it started with).",
    )
    working_dir: Optional[Path] = Field(default=None, description="Working directory of stage processes.")
    stream_output: bool = Field(default=True, description="Stream stage output to the worker's stdout.")


class QosflowJobConfiguration(BaseJobConfiguration):
    role: Literal["auto", "stage", "pipeline"] = Field(default="auto")
    stage_name: Optional[str] = Field(default=None)
    pipeline: Optional[str] = Field(default=None)
    pipeline_run_id: Optional[str] = Field(default=None)
    signature: Optional[str] = Field(default=None)
    gpus: Optional[int] = Field(default=None)
    min_gpus: Optional[int] = Field(default=None)
    gpu_milli: Optional[int] = Field(default=None)
    gpu_mem_mb: Optional[float] = Field(default=None)
    cpu_cores: Optional[float] = Field(default=None)
    mem_mb: Optional[float] = Field(default=None)
    deadline: Optional[float] = Field(default=None)
    deadline_at: Optional[float] = Field(default=None)
    latency_slo: Optional[float] = Field(default=None)
    min_throughput: Optional[float] = Field(default=None)
    priority: Optional[str] = Field(default=None)
    shareable: Optional[bool] = Field(default=None)
    gang: Optional[bool] = Field(default=None)
    gpu_model: Optional[str] = Field(default=None)
    expected_duration: Optional[float] = Field(default=None)
    batch_size: Optional[int] = Field(default=None)
    early_check_s: Optional[float] = Field(default=None, ge=0)
    qos_policy: Optional[dict[str, Any]] = Field(default=None)
    cluster_block: Optional[str] = Field(default=None)
    policy_block: Optional[str] = Field(default=None)
    cluster_file: Optional[str] = Field(default=None)
    cluster_reload_s: Optional[float] = Field(default=None, ge=0)
    working_dir: Optional[Path] = Field(default=None)
    stream_output: bool = Field(default=True)
    _job_variable_problem: Optional[str] = PrivateAttr(default=None)  # (job_variable_problem: the run fails at once)

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None) -> None:
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        if self.command in (None, "", "prefect flow-run execute"):
            self.command = shlex.join([sys.executable, "-m", "prefect.engine"])
        if self.min_gpus is None and self.role != "pipeline":
            # a pool whose base job template was made before min_gpus existed drops that job variable
            # (Prefect keeps only the template's variables); the run's QoS tags carry it as well
            self.min_gpus = _min_gpus_from_tags(getattr(flow_run, "tags", None) or ())
        if self.qos_policy:
            self.env["QOSFLOW_QOS_POLICY"] = json.dumps({k: v for k, v in self.qos_policy.items() if not k.startswith("_")}, default=str)
        self._job_variable_problem = job_variable_problem(self, flow_run, deployment, flow)
        unknown = unknown_job_variables(flow_run, deployment, work_pool)
        if unknown:
            # Prefect keeps only the pool template's variables: `qos_polcy:` in prefect.yaml or
            # `-jv prioirty=critical` was dropped without a word, and the run had no deadline or class
            from prefect.logging.loggers import flow_run_logger

            flow_run_logger(flow_run).warning(
                "job variable%s %s %s not %s of work pool %r and %s ignored; %s",
                "s" if len(unknown) > 1 else "", ", ".join(repr(k) for k, _ in unknown), "are" if len(unknown) > 1 else "is",
                "variables" if len(unknown) > 1 else "a variable", getattr(work_pool, "name", "?"),
                "are" if len(unknown) > 1 else "is",
                "; ".join(f"did you mean {near!r} for {k!r}?" for k, near in unknown if near)
                or f"its variables: {', '.join(sorted(_template_variables(work_pool)))}",
            )

    @property
    def is_stage(self) -> bool:
        if self.role == "stage":
            return True
        if self.role == "pipeline":
            return False
        return any(getattr(self, k) is not None for k in QOS_FIELDS)



def _template_variables(work_pool: Any) -> dict[str, Any]:
    return (((getattr(work_pool, "base_job_template", None) or {}).get("variables") or {}).get("properties") or {})


def unknown_job_variables(flow_run: Any, deployment: Any, work_pool: Any) -> list[tuple[str, str | None]]:
    """The job variables a run was given (its deployment's and its own) that the pool's base job
    template does not have, each with the variable it most likely meant (or None). Prefect drops them.
    qosflow's own stage runs (role `stage`) are not checked: their variables are qosflow's."""
    from qosflow.errors import closest_name

    given = dict(getattr(deployment, "job_variables", None) or {})
    given.update(getattr(flow_run, "job_variables", None) or {})
    props = _template_variables(work_pool)
    if not props or given.get("role") == "stage":
        return []
    return [(k, closest_name(k, list(props))) for k in sorted(given) if k not in props]


def job_variable_problem(cfg: Any, flow_run: Any, deployment: Any, flow: Any = None) -> str | None:
    """What is wrong with the QoS job variables a deployment (or `prefect deployment run -jv`) gave a run, as
    one message naming the variable, where it was set and how to fix it; None when they are valid, and for
    qosflow's own stage runs (role `stage`: their variables come from a checked `@qos_task`). Before, a
    deployment's `gpus: -1` or `priority: urgent` crashed each of its runs with a traceback ("Failed to submit
    flow run to infrastructure: SpecError: stage 'meek-cricket': ...") on a stage-role run, and was dropped
    without a word on a pipeline-role one."""
    from qosflow.errors import SpecError
    from qosflow.prefect.spec import check_stage_args

    if cfg.role == "stage":
        return None
    try:
        spec = spec_from_job_variables(cfg, where="")
        check_stage_args("", spec, expected_duration=cfg.expected_duration, batch_size=cfg.batch_size)
    except SpecError as exc:
        field, why = exc.field, str(exc).split(": ", 1)[-1]
    else:
        return None
    own = getattr(flow_run, "job_variables", None) or {}
    if deployment is None or field in own:
        where = f"job variable {field!r} of flow run {getattr(flow_run, 'name', '?')!r} (prefect deployment run -jv)"
        fix = "give the run a valid value"
    else:
        name = f"{flow.name}/{deployment.name}" if getattr(flow, "name", None) else deployment.name
        where = f"job variable {field!r} of deployment {name!r}"
        fix = ("correct it in the deployment's work_pool.job_variables (prefect.yaml) and run `prefect deploy` again, "
               "or in the UI: deployment -> Edit -> Job Variables")
    return f"{where}: {why}; {fix}. The run was not started"


def early_check_spec(spec: QoSSpec) -> QoSSpec:
    """The QoS of a stage's early check: one GPU (or its share of one), no gang, at most 2 cores, no
    deadline, and no elastic start (`min_gpus` is about the stage's full run, not this one GPU)."""
    return dataclasses.replace(spec, gpus=1, gpu_milli=min(spec.gpu_milli, 1000), gang=False, cpu_cores=min(spec.cpu_cores, 2.0),
                               deadline=None, min_gpus=None, extra={})


def _min_gpus_from_tags(tags: Any) -> int | None:
    """`min_gpus` from a stage run's QoS tags (`qos:min_gpus=N`), None if it has none."""
    for t in tags:
        if isinstance(t, str) and t.startswith("qos:min_gpus="):
            try:
                return int(t.split("=", 1)[1])
            except ValueError:
                return None  # (not a tag qosflow wrote)
    return None


#: how long a label write keeps retrying while the server's database is busy
LABEL_WRITE_BUDGET_S = 60.0
#: the retries' jitter: a generator of its own, so that the worker's waits never move the global `random` (a stage's or
#: a test's seeded draws in the same process)
_JITTER = random.Random()


def unreported_grace_s() -> float:
    """How long the worker waits for a stage whose process exited 0 to report its end before it marks
    the run Crashed (QOSFLOW_UNREPORTED_END_GRACE_S, default 120 s; `QosflowWorker._settle_unreported`)."""
    return env_number("QOSFLOW_UNREPORTED_END_GRACE_S", 120.0)


#: seconds between a pipeline run's Prefect heartbeats (`prefect.flow-run.heartbeat`, PREFECT_FLOWS_HEARTBEAT_FREQUENCY)
#: when the worker launches it through a host agent and its job's env sets none: Prefect's minimum (its default is 180)
PIPELINE_HEARTBEAT_S = 30
#: a pipeline run whose last heartbeat (or move to its current state) is older than this many heartbeats no longer
#: reports to Prefect (`prefect_pipeline_liveness`)
PIPELINE_HEARTBEATS_MISSED = 2.5
#: Prefect's own heartbeat period when nothing sets one, assumed for a run whose period is not known here
PREFECT_HEARTBEAT_DEFAULT_S = 180.0
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
_HEARTBEAT_VARS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")


def pipeline_heartbeat_s(env: dict[str, str]) -> float:
    """The heartbeat period of a pipeline run launched with `env`: its own PREFECT_FLOWS_HEARTBEAT_FREQUENCY (or the
    legacy PREFECT_RUNNER_HEARTBEAT_FREQUENCY) if set, else PIPELINE_HEARTBEAT_S (which the worker then sets)."""
    for var in _HEARTBEAT_VARS:
        try:
            return max(30.0, float(env[var]))  # (Prefect refuses less than 30 s)
        except (KeyError, TypeError, ValueError):
            continue
    return float(PIPELINE_HEARTBEAT_S)


async def prefect_pipeline_liveness(client: Any, flow_run_id: str, heartbeat_s: float | None) -> ExitStatus | str | None:
    """What Prefect says of a pipeline run whose host went silent (`AgentBackend.pipeline_liveness`): an ExitStatus when
    its run reached a final state (Completed: ok; Cancelled: cancelled; Failed: the run's own failure; Crashed: lost),
    a text saying why it is alive while its last heartbeat event (`prefect.flow-run.heartbeat`, read back through
    /api/events/filter) or its move to its current state is more recent than PIPELINE_HEARTBEATS_MISSED heartbeats,
    else None (silent to Prefect too). The Prefect API's errors are raised.

    `heartbeat_s` None: the period is not known here (a run this worker adopted, launched by another worker or with
    its own setting): the spacing of its last two heartbeats (at least 30 s), or Prefect's default (180 s) while it
    has sent one or none -- a run is then reported lost later rather than too early."""
    from datetime import timedelta

    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventOrder, EventResourceFilter

    fr = await client.read_flow_run(flow_run_id)
    state = fr.state
    if state is None:
        return None
    if state.is_final():
        kind = {"COMPLETED": ExitKind.OK, "CANCELLED": ExitKind.CANCELLED, "FAILED": ExitKind.USER}.get(_type(state) or "", ExitKind.INFRA)
        return ExitStatus(kind, 0 if kind is ExitKind.OK else None, f"its run ended {state.name} while its host was silent")
    now = datetime.now(timezone.utc)
    look = PIPELINE_HEARTBEATS_MISSED * (heartbeat_s or PREFECT_HEARTBEAT_DEFAULT_S)
    page = await client.read_events(filter=EventFilter(
        occurred=EventOccurredFilter(since=now - timedelta(seconds=2 * look + 60), until=now + timedelta(minutes=10)),
        event=EventNameFilter(name=[HEARTBEAT_EVENT]), resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
        order=EventOrder.DESC), limit=1 if heartbeat_s else 2)
    if heartbeat_s is None:
        heartbeat_s = PREFECT_HEARTBEAT_DEFAULT_S
        if len(page.events) >= 2:
            gap = (page.events[0].occurred - page.events[1].occurred).total_seconds()
            heartbeat_s = max(30.0, gap)
    window = PIPELINE_HEARTBEATS_MISSED * heartbeat_s
    if page.events:
        e = page.events[0]
        age = (now - (getattr(e, "received", None) or e.occurred)).total_seconds()
        if age <= window:
            return f"its last heartbeat came {max(0.0, age):.0f}s ago"
    if state.timestamp is not None:
        age = (now - state.timestamp).total_seconds()
        if age <= window:
            return f"{state.name} since {max(0.0, age):.0f}s"
    return None


#: label a qosflow worker writes on a stage run when it takes it into its QoS queue (its name)
QUEUED_BY_LABEL = "qosflow.queued_by"
#: seconds a stage waits in the QoS queue before its run is labelled `QUEUED_BY_LABEL`
QUEUED_LABEL_AFTER_S = 0.5
#: seconds between two reminders that the backend's API still does not answer (`_enter_outage`)
OUTAGE_REMINDER_S = 300.0
#: heartbeats between two looks for stage runs left Pending by a worker that died (`_recover_orphans`)
ORPHAN_CHECK_BEATS = 10
#: seconds between two readings of the cluster block or file (`QosflowWorker.reload_cluster`) by default
CLUSTER_RELOAD_S = 60.0
#: at most one following of the nodes per this many seconds when the backend says they changed (`Backend.on_nodes_changed`):
#: the 20 nodes an autoscaler adds in a burst are followed in one or two readings, not 20
NODES_FOLLOW_S = 1.0


async def patch_labels(client: Any, flow_run_id: Any, labels: dict[str, str], *, budget_s: float = LABEL_WRITE_BUDGET_S) -> int:
    """Merge `labels` into a flow run's labels; return the number of attempts it took.

    Prefect's server merges labels by reading the row and then writing it, in one deferred SQLite
    transaction: any write that commits in between makes it fail with SQLITE_BUSY_SNAPSHOT, which it
    answers with 503. Prefect's client then backs off 2, 4, 8, 16, 32 s, so on a busy server one
    label write took up to a minute, and five failures in a row lost it (measured in the demo). The
    failure is immediate and retrying at once usually succeeds, so this retries a 503 itself after
    a short, growing, jittered pause (0.05-1 s) until `budget_s` is spent; other errors are raised.
    """

    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    give_up = time.monotonic() + budget_s
    attempt = 0
    while True:
        attempt += 1
        try:
            with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
                await client.update_flow_run_labels(flow_run_id, labels)
            return attempt
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code != 503 or time.monotonic() >= give_up:
                raise
        await asyncio.sleep(_JITTER.uniform(0.05, 0.2) * min(attempt, 5))


def _done_with_output(path: str | None, *, remove: bool) -> None:
    """A process's output file (a pipeline's, a local stage's) once the worker is done with it: removed, or kept for a
    failure, its retention (`QOSFLOW_PIPELINE_OUTPUT_MAX_AGE`) counting from now rather than from its last line (days
    ago for a quiet run). Nothing happens when there is no path or the file is gone."""
    if not path:
        return
    try:
        os.remove(path) if remove else os.utime(path)
    except OSError:
        pass


#: flow run ids per read of the server (its default limit, `PREFECT_SERVER_API_DEFAULT_LIMIT`: a larger `limit` is refused)
RUNS_PAGE = 200


class QosflowWorkerResult(BaseWorkerResult):
    """How a stage process ended."""


class QosflowWorker(BaseWorker[QosflowJobConfiguration, QosflowVariables, QosflowWorkerResult]):
    type = "qosflow"
    job_configuration = QosflowJobConfiguration
    job_configuration_variables = QosflowVariables
    _display_name = "qosflow (QoS-aware GPU placement)"
    _description = (
        "Places every stage run on a GPU slot so that its QoS (deadline, priority, GPUs, cores) holds: "
        "a QoS queue, a scheduling policy, duration predictions and CPU-affinity feedback, with local processes, "
        "host agents or Kubernetes as the backend."
    )
    _documentation_url = "https://github.com/qosflow/qosflow/blob/main/docs/prefect.md"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"

    def __init__(
        self,
        *args: Any,
        cluster: ClusterSpec | None = None,
        policy: Any = None,
        estimator: Any = None,
        backend: Backend | None = None,
        coda: bool | None = None,
        round_interval: float | None = None,
        cluster_file: str | None = None,
        leases: Any = None,
        lease_ttl_s: float | None = None,
        max_infra_retries: int | None = None,
        metrics_port: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        #: serve Prometheus metrics on this port (0: any free one; None: QOSFLOW_WORKER_METRICS_PORT, else none)
        self._metrics_port_arg = metrics_port
        self.metrics: Any = None  # qosflow.prefect.metrics.WorkerMetrics once served
        self._cluster_file_arg = cluster_file
        self._leases_arg = leases
        self.lease_ttl_s = float(lease_ttl_s or env_number("QOSFLOW_LEASE_TTL_SECONDS", 30.0, minimum=1.0))
        self.max_infra_retries = int(max_infra_retries if max_infra_retries is not None else env_number("QOSFLOW_MAX_INFRA_RETRIES", 3, integer=True))
        self.leases: Any = None  # qosflow.store.leases.LeaseStore, or None when disabled
        self.holder = ""
        self.recovered: list[dict[str, Any]] = []  # what recover() found at start (tests, logs)
        self._foreign: set[str] = set()  # scheduler hold keys of other workers' leases
        self._pods_booked: dict[str, tuple] = {}  # node -> (wanted, booked) of the pods that are not stages (`book_foreign_pods`)
        self._lease_ids: dict[str, str] = {}  # flow run id -> lease id
        self._health_task: asyncio.Task | None = None
        self._progress_task: asyncio.Task | None = None
        self._adopted_tasks: set[asyncio.Task] = set()
        #: the run tasks of a local pool's pipeline runs: a stop ends their processes (the backend's aclose), and each
        #: task then drops its record and returns, for Prefect's worker to report the run Crashed; `teardown` waits for them
        self._local_pipeline_tasks: set[asyncio.Task] = set()
        self._cluster_arg = cluster
        self._policy_arg = policy
        self._estimator_arg = estimator
        self._backend: Backend | None = backend
        self._coda_arg = coda
        self._round_arg = round_interval
        self.scheduler: QoSScheduler | None = None
        self.records: list[dict[str, Any]] = []  # one per finished stage (benchmarks, tests)
        self._handles: dict[str, StageHandle] = {}
        #: pipeline runs (no slot) when the stages' backend cannot start such a process (agents, Kubernetes):
        #: they run on this worker's host, as with the local backend (`_unplaced_backend`)
        self._pipelines_here: Backend | None = None
        self._pipeline_runs_here: set[str] = set()
        #: pipeline runs of an earlier worker of this name that this one adopted or settles (`_adopt_pipelines`)
        self._pipelines_adopted: set[str] = set()
        #: pipeline run -> the period (s) of the Prefect heartbeats it was launched with here (`_pipeline_liveness`)
        self._pipeline_beats: dict[str, float] = {}
        #: pipeline runs' Jobs deleted for a cancellation, whose runs are marked Cancelled once their engines ended
        self._pipeline_cancels: set[str] = set()
        #: flow runs whose `run()` has not returned yet (their stage may have reported its end already)
        self._in_flight: set[str] = set()
        self._queued_label_tasks: set[asyncio.Future] = set()
        self._orphan_error: str | None = None
        self._queued_labelled: set[str] = set()  # stage runs whose `qosflow.queued_by` label this worker wrote
        self._cancel_asked: set[str] = set()  # running stages set Cancelling because their pipeline was cancelled
        self._stages_in_flight: set[str] = set()  # (the stage runs among them; pipeline runs are not placed)
        self._stopping = False  # set when the worker stops: its stages in flight go back to the pool's queue
        self._left_running: set[str] = set()  # stages left running at a stop, their leases kept for the next worker
        #: local stage processes of an earlier worker process (killed) adopted here: a stop ends them as its own
        self._adopted_local: set[str] = set()
        #: what the estimator learned from the stages this worker ran, per stage (the UI's predictor table)
        self._learned: dict[str, dict[str, Any]] = {}
        self._learned_published = -math.inf
        self._learned_task: asyncio.Task | None = None
        #: learns what the pool's other workers store (`_predictor_refresh_loop`)
        self._refresh_task: asyncio.Task | None = None
        self._learned_run: str | None = None
        self.predictor_artifact_s = env_number("QOSFLOW_PREDICTOR_ARTIFACT_SECONDS", 30.0, minimum=0.0)
        #: seconds between two looks at the cluster for its table artifact (`qosflow-cluster-<pool>`); 0: none
        self.cluster_artifact_s = env_number("QOSFLOW_CLUSTER_ARTIFACT_SECONDS", 30.0, minimum=0.0)
        self._cluster_artifact_task: asyncio.Task | None = None
        self.cluster_artifacts = 0  # versions written (tests)
        self._labels_written: dict[str, dict[str, str]] = {}  # flow run id -> the placement labels last written
        self._checked_ok: set[str] = set()  # stage signatures that passed an early check (or finished in one)
        #: stage signatures whose last run failed with a user error: checked early again (Philly: failures repeat)
        self._failed_last: set[str] = set()
        self.early_checks: list[dict[str, Any]] = []  # one record per early check (tests, benchmarks)
        self._pids: dict[str, str] = {}  # pid -> job id
        self._output_swept_at = -math.inf  # (monotonic) the last sweep of output files without a lease store
        self._rank_end_tasks: set[asyncio.Future] = set()  # end labels written for a gang's ranks (`_write_rank_end`)
        self._cancel_task: asyncio.Task | None = None
        self._qos_setup_lock = asyncio.Lock()
        self.inventory_note = ""
        self.policy_block: Any = None
        self.node_events: list[tuple[float, str, str]] = []  # (time, host, "down" | "up") as the worker saw them
        self._health_error: str | None = None  # why the hosts' health cannot be read (logged once per outage)
        self._lease_store: Any = None  # the lease store, opened at setup (name claim) or with the scheduler
        self._claimed = False  # this process's presence is recorded in the lease store (`_claim_name`)
        self._presence_due = 0.0
        #: why the backend's API (the Kubernetes API server) cannot be reached: nothing is launched meanwhile
        self.outage: str | None = None
        self._outage_down: set[int] = set()  # nodes marked down for the outage (back up when the API answers)
        self.outages: list[tuple[float, str]] = []  # (time, "down: why" | "up") as the worker saw them (tests)
        self._outage_since = 0.0  # (self._clock) when the outage began
        self._outage_said = 0.0  # when it was last logged (`OUTAGE_REMINDER_S`)
        self._clock = time.monotonic
        #: a setup error that cannot fix itself (`_fatal_setup_error`): the worker stops with it
        self._setup_fatal: BaseException | None = None
        #: where the cluster came from, read again every `cluster_reload_s` (`reload_cluster`): ("block" | "file",
        #: name or path), None when the worker was given its cluster or backend
        self._cluster_source: tuple[str, str] | None = None
        self.cluster_reload_s = 0.0
        self._cluster_seen: str | None = None  # fingerprint of the description last taken (`_fingerprint`)
        self._cluster_said: set[str] = set()  # warnings about the current edit, said once
        self._cluster_said_for: str | None = None  # (the edit they are about)
        self._reload_error: str | None = None  # why the description cannot be used now (said once per distinct error)
        #: the hosts as the backend describes them since the last edit (None: no edit yet), which the
        #: scheduler's cluster follows as far as it safely can (`_settle_cluster`)
        self._wanted: dict[str, Any] | None = None
        self._draining: set[str] = set()  # hosts removed from the description while stages of theirs still run
        self._deferred = False  # a host's change waits until its stages end (`_settle_cluster`)
        self._cordoned: set[str] = set()  # nodes cordoned in the last listing of a backend that `lists_nodes` (`_follow_nodes`)
        self._nodes_error: str | None = None  # why the nodes cannot be listed now (said once per distinct error)
        self._no_nodes_said: str | None = None  # the warning that no node is listed, while none is (`_follow_nodes`)
        self.cluster_events: list[tuple[float, str]] = []  # (time, what changed), as logged (tests)
        self._reload_task: asyncio.Task | None = None
        #: flow run id -> its stage's entry, while its `run()` is in flight (a finished stage's grant says where it
        #: ran until the run has recorded it: its host is not forgotten before)
        self._stage_entries: dict[str, StageEntry] = {}

    # ------------------------------------------------------------------ setup
    def _pool_default(self, name: str) -> Any:
        try:
            props = self.work_pool.base_job_template["variables"]["properties"]
            return props.get(name, {}).get("default")
        except Exception:
            return None

    async def _setup(self) -> QoSScheduler:
        """`_ensure_qos`, remembering a setup error that cannot fix itself (`_fatal_setup_error`: a missing
        or invalid block) in `_setup_fatal`, which stops the worker."""
        try:
            return await self._ensure_qos()
        except Exception as exc:
            if _fatal_setup_error(exc):
                self._setup_fatal = exc
            raise

    async def _ensure_qos(self) -> QoSScheduler:
        """Build the backend, the cluster and the scheduler once (after the worker synced its pool)."""
        async with self._qos_setup_lock:
            if self.scheduler is not None:
                return self.scheduler
            if self._work_pool is not None and self._work_pool.type != self.type:
                from qosflow.prefect.local import wrong_pool_type

                raise wrong_pool_type(self._work_pool.name, self._work_pool.type)
            from qosflow.backends.local import LocalBackend
            from qosflow.paths import data_dir
            from qosflow.prefect.blocks import QoSPolicy

            cluster = self._cluster_arg
            cluster_block = os.environ.get("QOSFLOW_CLUSTER_BLOCK") or self._pool_default("cluster_block")
            cluster_file = self._cluster_file_arg or os.environ.get("QOSFLOW_CLUSTER_FILE") or self._pool_default("cluster_file")
            if self._backend is None and cluster is None:
                if cluster_file:
                    from qosflow.prefect.local import load_named_cluster_file

                    source = "arg" if self._cluster_file_arg else "env" if os.environ.get("QOSFLOW_CLUSTER_FILE") else "pool"
                    cf = load_named_cluster_file(str(cluster_file), source, self._work_pool_name)
                    self._backend = cf.backend()
                    self._cluster_source, self._cluster_seen = ("file", str(cluster_file)), _fingerprint(cf)
                elif cluster_block:
                    block = await load_cluster_block(cluster_block)
                    self._backend = block.make_backend()
                    self._cluster_source, self._cluster_seen = ("block", cluster_block), _fingerprint(block)
            self.cluster_reload_s = self._cluster_reload_setting()
            policy_block = os.environ.get("QOSFLOW_POLICY_BLOCK") or self._pool_default("policy_block")
            pb = QoSPolicy()
            if policy_block:
                pb = await aload_block(QoSPolicy, policy_block, "policy_block")
            self.policy_block = pb
            policy = self._policy_arg
            if policy is None:
                policy = pb.make_policy()
            elif isinstance(policy, str):
                from qosflow.policies import get_policy

                policy = get_policy(policy)
            estimator = self._estimator_arg
            if estimator is None and policy_block and ":" in (pb.estimator or ""):
                # a module:attr this worker cannot import does not fix itself: the worker stops saying so (it logged
                # 'setup failed: No module named ...' every 5 s for ever and took no run)
                from qosflow.errors import SpecError

                from qosflow.prefect.scheduler import check_estimator_import

                try:
                    check_estimator_import(pb.estimator, option="estimator")
                except SpecError as exc:
                    raise SpecError("policy_block", f"QoS policy block {policy_block!r}: {exc} (set the block's estimator to "
                                    "one this worker can import, or install the module where the worker runs)") from None
            if estimator is None or isinstance(estimator, str):
                # (off the event loop: the learned estimator opens the store and fits its models, a second or two)
                estimator = await asyncio.to_thread(
                    make_live_estimator, estimator or pb.estimator, history_path=str(data_dir() / "prefect" / "stage-history.json")
                )
            if self._backend is None:
                self._backend = LocalBackend(cluster)
            self._tell_backend_pool()  # (before its first sweep, launch, adoption or reading of the pods)
            spec = await self._backend.inventory()
            if hasattr(self._backend, "pipeline_liveness") and self._backend.pipeline_liveness is None:
                self._backend.pipeline_liveness = self._pipeline_liveness  # (what Prefect says of a silent host's pipeline run)
            self.inventory_note = getattr(self._backend, "inventory_note", "")
            # (a bad QOSFLOW_PROGRESS_SYNC_SECONDS fails the setup, saying what is wrong, not a background task)
            sync_s = env_number("QOSFLOW_PROGRESS_SYNC_SECONDS", float(self._backend.progress_sync_s), minimum=0.05)
            unreported_grace_s()  # (likewise a bad QOSFLOW_UNREPORTED_END_GRACE_S, not the end of the first stage)
            self.scheduler = QoSScheduler(
                spec,
                policy,
                estimator,
                round_interval=self._round_arg or pb.round_interval_s,
                coda=pb.coda_feedback if self._coda_arg is None else self._coda_arg,
                at_risk_margin=pb.at_risk_margin,
                on_event=self._on_scheduler_event,
                set_cpus=self._set_cpus,
            )
            self.scheduler.may_become = self._backend.may_become  # (an autoscaled pool: what it may grow to)
            if _takes(getattr(self._backend, "least_share_milli", None), "node"):  # (the slice of the node placed on)
                self.scheduler.share_floor = lambda i, be=self._backend, s=self.scheduler: be.least_share_milli(s.cluster, i)
            self.scheduler.start()
            loop = asyncio.get_running_loop()
            self._cancel_task = loop.create_task(self._watch_cancellations(), name="qosflow-cancel-watch")
            refresh_s = env_number("QOSFLOW_PREDICTOR_REFRESH_SECONDS", 30.0, minimum=0.0)
            if refresh_s > 0 and hasattr(estimator, "refresh_from_store"):
                self._refresh_task = loop.create_task(self._predictor_refresh_loop(estimator, refresh_s),
                                                      name="qosflow-predictor-refresh")
            virt = any(n.virtual for n in spec.nodes)
            if not self.inventory_note and virt:
                self.inventory_note = "no GPU: virtual GPUs (declared, not detected)"
            self._logger.info(
                "qosflow worker: cluster %s (%d host%s, %d GPU%s%s) through the %s backend, policy %s, estimator %s. %s",
                spec.name,
                len(spec.nodes), "" if len(spec.nodes) == 1 else "s",
                spec.num_gpus, "" if spec.num_gpus == 1 else "s",
                ", virtual GPUs" if virt else "",
                self._backend.name,
                policy.name,
                getattr(estimator, "name", type(estimator).__name__),
                self.inventory_note,
            )
            await self._setup_leases()
            await self._sync_health()
            await self._recover()
            await self._adopt_pipelines()
            await self._recover_orphans()
            await self._sweep_stale_workdirs()
            self._health_task = loop.create_task(self._health_loop(), name="qosflow-heartbeat")
            if (self._cluster_source is not None or getattr(self._backend, "lists_nodes", False)) and self.cluster_reload_s > 0:
                self._reload_task = loop.create_task(self._cluster_reload_loop(), name="qosflow-cluster-reload")
            if self._backend.syncs_progress:  # stages report their progress where they run: copy it here
                self._progress_task = loop.create_task(self._progress_loop(sync_s), name="qosflow-progress")
            if self.cluster_artifact_s > 0:
                self._cluster_artifact_task = loop.create_task(self._cluster_artifact_loop(), name="qosflow-cluster-artifact")
            return self.scheduler

    async def start(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().start(*args, **kwargs)
        except BaseExceptionGroup:
            if self._setup_fatal is not None:  # the error itself, not the loops' exception group
                raise self._setup_fatal from None
            raise

    async def setup(self) -> None:
        await self._claim_name()  # (before Prefect's setup: a refused worker never polls nor heartbeats)
        await super().setup()
        await self._serve_metrics()
        self._poll_task = asyncio.get_running_loop().create_task(self._fast_poll(), name="qosflow-fast-poll")

    async def _fast_poll(self) -> None:
        """Look for new stage runs every QOSFLOW_WORKER_POLL_SECONDS (default 0.5 s), besides Prefect's own
        (slower) polling loop, so that a ready stage reaches the QoS queue within a second."""
        interval = env_number("QOSFLOW_WORKER_POLL_SECONDS", 0.5, minimum=0.01)
        no_pool_since: float | None = None
        next_pool_check = 0.0
        while not self._stopping:
            await asyncio.sleep(interval)
            if self._stopping:
                return
            if self._work_pool is None:
                # Prefect only logs "Work pool 'gpu' not found!"; say how to fix it (a worker started
                # before `qosflow init`, or before its server answered, so that the CLI could not check)
                now = time.monotonic()
                no_pool_since = now if no_pool_since is None else no_pool_since
                if now - no_pool_since >= 5.0 and now >= next_pool_check:
                    next_pool_check = now + 30.0
                    await self._explain_missing_pool()
                continue
            no_pool_since = None
            if self._runs_task_group is None:
                continue
            if self.scheduler is None and getattr(self, "_claimed", False) and time.monotonic() >= self._presence_due:
                self._presence_due = time.monotonic() + self.lease_ttl_s / 3
                try:  # (set up, the heartbeat renews it)
                    await asyncio.to_thread(self._lease_store.renew_holder, self.holder, self.lease_ttl_s)
                except Exception as exc:
                    self._logger.debug("presence renewal failed: %s", exc)
            if self.scheduler is None:
                # set up as soon as the pool is known, not at the first stage: a restarted worker must
                # recover its leases (adopt the stages still running) even if no new stage ever comes
                try:
                    await self._setup()
                except Exception as exc:
                    if self._stopping:
                        return
                    end = "" if str(exc).endswith((".", "?", "!")) else "."
                    if self._setup_fatal is exc:
                        # a block that is missing or fails validation does not fix itself: retrying every 5 s
                        # for ever only filled the log; Prefect's polling loop raises it and the worker stops
                        self._logger.error("qosflow worker setup failed: %s%s This worker stops: fix the block (or the "
                                           "pool's cluster_block / QOSFLOW_CLUSTER_BLOCK) and start it again", exc, end)
                        return
                    self._logger.error(
                        "qosflow worker setup failed: %s%s This worker takes no flow run until that is fixed "
                        "(runs stay scheduled in the pool); retrying every 5 s", exc, end)
                    await asyncio.sleep(5.0)
                    continue
            try:
                await self.get_and_submit_flow_runs()
            except Exception as exc:
                self._logger.debug("fast poll failed: %s", exc)

    async def _explain_missing_pool(self) -> None:
        """Log why this worker has no pool yet and the fix, when the server answers and says why."""
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        from qosflow.prefect.local import missing_pool, qosflow_pool_names, wrong_pool_type

        pool = self._work_pool_name
        try:
            async with get_client() as client:
                try:
                    wp = await client.read_work_pool(pool)
                except ObjectNotFound:
                    missing = missing_pool(pool, await qosflow_pool_names(client))  # (the same client)
                    self._logger.error("%s; this worker takes the pool's runs as soon as it exists", missing)
                    return
        except Exception:  # the server is away: Prefect says so itself and keeps trying
            return
        if wp.type != "qosflow":
            self._logger.error("%s", wrong_pool_type(pool, wp.type))

    def _adoptable(self, fid: str) -> bool:
        """Whether the running stage `fid` can outlive this worker: it holds a lease and runs on a
        backend that finds its stages again (`adopt`: host agents, Kubernetes), so the next worker of
        the pool adopts it (`_recover`) instead of running it again."""
        return (fid in self._handles and fid in self._lease_ids and self.leases is not None
                and getattr(self._backend, "adopt", None) is not None)

    async def _requeue_in_flight(self) -> None:
        """The worker stops (Ctrl-C, SIGTERM) with stage runs in flight. They were left Running or
        Pending with their leases released: no worker ever took them again and their pipelines waited
        for ever. Now:

        * a stage running where the next worker can adopt it (`_adoptable`) keeps running and keeps
          its lease: a worker of the same name adopts it when it starts, any other worker of the pool
          once the lease expires (a worker restarted for an upgrade costs no training time);
        * the others -- waiting in the QoS queue, or processes of this worker (the local backend: a stop
          ends its stages, those it adopted from an earlier process of its name that was killed too) --
          are killed and put back in the pool's queue (AwaitingRetry), so that the next worker runs them
          and their pipelines go on."""
        fids = sorted(self._stages_in_flight | self._adopted_local)  # (an adopted local stage ends with this worker too)
        kept = [fid for fid in fids if self._adoptable(fid)]
        self._left_running.update(kept)
        fids = [fid for fid in fids if fid not in kept]
        if kept:
            self._logger.warning(
                "qosflow worker stopping: %d stage run(s) keep running on their hosts with their leases (%s); a worker "
                "named %r adopts them when it starts, another worker of the pool once the leases expire (%gs)",
                len(kept), ", ".join(kept), str(self.name), self.lease_ttl_s)
        if not fids:
            return
        self._logger.warning(
            "qosflow worker stopping: %d stage run(s) in flight go back to the pool's queue and run again when a "
            "qosflow worker takes them (%s)", len(fids), ", ".join(fids))
        for fid in fids:
            handle = self._handles.get(fid)
            if handle is not None and self._backend is not None:
                try:
                    # at once: a stage engine told to stop (SIGTERM) reports Crashed, which would end its pipeline
                    await asyncio.wait_for(self._backend.kill(handle, reason="the qosflow worker stopped", grace=0), 10.0)
                except Exception as exc:
                    self._logger.warning("could not kill stage run %s: %s", fid, exc)
            where = "while the stage ran (its process was killed)" if handle is not None else "while the stage waited in its QoS queue"
            await self._reschedule(fid, f"qosflow: worker {self.name} stopped {where}; it runs again when a qosflow worker takes it")

    async def get_and_submit_flow_runs(self) -> list["FlowRun"]:
        """Take flow runs only once the cluster, backend and policy are set up: a worker with a broken
        cluster file or block would otherwise take every run and report it Crashed."""
        if self._stopping:
            return []
        if self._setup_fatal is not None:
            raise self._setup_fatal  # (ends Prefect's polling loop: the worker stops with it)
        if self.scheduler is None and self._work_pool is not None:
            try:
                await self._setup()
            except Exception as exc:
                if self._setup_fatal is exc:
                    raise
                self._logger.debug("not taking flow runs, setup failed: %s", exc)
                return []
        return await super().get_and_submit_flow_runs()

    #: seconds between two reads of the pool's and its queues' concurrency limits (`_limits`; a new limit is followed
    #: that much later; the pause is read again at once before a stage run is taken past a limit)
    LIMITS_REFRESH_S = 10.0

    async def _get_scheduled_flow_runs(self) -> list:
        """Prefect's scheduled runs of the pool, plus the **stage runs** that a pool or work-queue concurrency limit
        held back (`_stage_runs_past_limits`). A limit counts the pipeline runs, which run while they wait for
        their stages: with `prefect work-pool set-concurrency-limit gpu 1` (or a limit on the queue) the first
        pipeline run took the only slot and the server never handed out its stage run, so the pipeline waited
        for ever (its log said the worker 'took no run'). A stage of a pipeline that already runs is part of
        work that was admitted; the GPUs it may take are the QoS queue's business."""
        runs = list(await super()._get_scheduled_flow_runs())
        try:
            runs += await self._stage_runs_past_limits({r.flow_run.id for r in runs}, runs)
        except Exception as exc:  # (only an addition to Prefect's own answer)
            self._logger.debug("reading stage runs held by concurrency limits failed: %s", exc)
        return runs

    async def _limits(self, fresh: bool = False) -> dict[str, Any] | None:
        """The pool's pause and concurrency limit and its queues' (read at most every LIMITS_REFRESH_S unless
        `fresh`), with the id of its `qosflow-stage/<pool>` deployment (read again at each refresh, kept for a
        `fresh` read); None when the pool or that deployment does not exist."""
        now = time.monotonic()
        cached = getattr(self, "_limits_cache", None)
        if not fresh and cached is not None and now - cached[0] < self.LIMITS_REFRESH_S:
            return cached[1]
        from prefect.exceptions import ObjectNotFound

        from qosflow.prefect.stage import STAGE_FLOW_NAME

        pool = self._work_pool_name
        info: dict[str, Any] | None
        try:
            wp = await self.client.read_work_pool(pool)
            queues = await self.client.read_work_queues(work_pool_name=pool)
            dep_id = getattr(self, "_stage_deployment_id", None)
            if dep_id is None or not fresh:  # (read again at each refresh: a stage deployment deleted and made again
                # by the next pipeline has a new id, and its stage runs were never found again under the old one)
                dep_id = self._stage_deployment_id = (await self.client.read_deployment_by_name(f"{STAGE_FLOW_NAME}/{pool}")).id
            info = {"pool": wp, "queues": queues, "deployment_id": dep_id}
        except ObjectNotFound:  # (no stage dispatched to this pool yet: nothing to hand out)
            info = None
        self._limits_cache = (now, info)
        return info

    async def _stage_runs_past_limits(self, have: set, handed: Iterable[Any] = ()) -> list:
        """Scheduled stage runs of this pool that Prefect's answer left out because a pool or work-queue
        concurrency limit is full. Pauses still hold them: a paused pool, or a paused queue, hands out nothing
        (as Prefect users expect); its pipelines' stages wait until it is resumed. Only when the pool or one
        of the queues this worker polls has a concurrency limit (else the server's answer is complete)."""
        if self._work_pool is None or self._stopping:
            return []
        handed = list(handed)
        info = await self._limits()
        # (the stage runs in flight counted here too: a limit that stage runs fill is then not read again at every poll)
        if info is None or not await self._under_stage_limits(info, await self._held_by_limits(info, have), handed):
            return []
        # there are stage runs to take past a limit: the pause and limits read now, not up to LIMITS_REFRESH_S ago
        # (a pool paused a second ago must not have its stage runs taken)
        info = await self._limits(fresh=True)
        if info is None:
            return []
        out = await self._under_stage_limits(info, await self._held_by_limits(info, have), handed)
        if out and not getattr(self, "_said_limits", False):
            self._said_limits = True
            wp = info["pool"]
            self._logger.info(
                "work pool %r has a concurrency limit (pool %s, queues %s): it bounds the pipeline runs this pool starts; "
                "the stage runs of pipelines already running are taken past it (else a pipeline holding a slot would wait "
                "for ever for a stage that needs one); the QoS queue places them on the GPUs", self._work_pool_name,
                wp.concurrency_limit, ", ".join(f"{q.name}={q.concurrency_limit}" for q in info["queues"] if q.concurrency_limit is not None) or "none")
        return out

    async def _under_stage_limits(self, info: dict[str, Any], held: list, handed: Iterable[Any] = ()) -> list:
        """Of the `held` stage runs (due first), those a limit would let through if it counted **stage runs only**
        (Pending and Running ones of `qosflow-stage/<pool>`, as Prefect's pool scheduler counts): what the pipeline
        runs holding its slots would otherwise deadlock. A limit that stage runs alone fill (pipelines called
        directly, whose runs are not the pool's; a queue of stage runs limited on purpose) still holds them back:
        taking every held stage run ignored such a limit altogether. The stage runs Prefect `handed` out in this
        poll (still Scheduled, not counted by the server yet) count as in flight."""
        if not held:
            return held
        from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState,
                                                    FlowRunFilterStateType, WorkQueueFilter, WorkQueueFilterId)
        from prefect.client.schemas.objects import StateType

        def in_flight(queue_id: Any = None):
            return self.client.count_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING]))),
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[info["deployment_id"]])),
                work_queue_filter=None if queue_id is None else WorkQueueFilter(id=WorkQueueFilterId(any_=[queue_id])))

        wp = info["pool"]
        limits = {q.id: q.concurrency_limit for q in info["queues"] if q.concurrency_limit is not None}
        mine = [r for r in handed if getattr(r.flow_run, "deployment_id", None) == info["deployment_id"]]
        pool_left = None if wp.concurrency_limit is None else int(wp.concurrency_limit) - int(await in_flight()) - len(mine)
        queue_left: dict[Any, int] = {}
        out = []
        for r in held:
            qid = r.work_queue_id
            if qid in limits and qid not in queue_left:
                queue_left[qid] = int(limits[qid]) - int(await in_flight(qid)) - sum(1 for m in mine if m.work_queue_id == qid)
            if (pool_left is not None and pool_left <= 0) or queue_left.get(qid, 1) <= 0:
                continue
            out.append(r)
            if pool_left is not None:
                pool_left -= 1
            if qid in queue_left:
                queue_left[qid] -= 1
        return out

    async def _held_by_limits(self, info: dict[str, Any], have: set = frozenset()) -> list:
        """The Scheduled stage runs, due now, of the open queues of an unpaused pool with a concurrency limit
        (of the pool or of a queue this worker polls), but those in `have`."""
        from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterNextScheduledStartTime,
                                                    FlowRunFilterState, FlowRunFilterStateType, WorkQueueFilter, WorkQueueFilterId)
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.responses import WorkerFlowRunResponse
        from prefect.client.schemas.sorting import FlowRunSort

        wp = info["pool"]
        if wp.is_paused or str(getattr(wp, "status", "") or "").upper().endswith("PAUSED"):
            return []
        queues = [q for q in info["queues"] if not self._work_queues or q.name in self._work_queues]
        if wp.concurrency_limit is None and not any(q.concurrency_limit is not None for q in queues):
            return []
        open_queues = [q.id for q in queues if not q.is_paused]
        if not open_queues:
            return []
        from datetime import timedelta

        before = datetime.now(timezone.utc) + timedelta(seconds=int(self._prefetch_seconds))
        found = await self.client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                                          next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=before)),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[info["deployment_id"]])),
            work_queue_filter=WorkQueueFilter(id=WorkQueueFilterId(any_=open_queues)),
            sort=FlowRunSort.NEXT_SCHEDULED_START_TIME_ASC, limit=50)
        out = [WorkerFlowRunResponse(work_pool_id=wp.id, work_queue_id=fr.work_queue_id, flow_run=fr)
               for fr in found if fr.id not in have and fr.work_queue_id is not None]
        return out

    async def _serve_metrics(self) -> None:
        """Prometheus metrics on `metrics_port` / QOSFLOW_WORKER_METRICS_PORT (host QOSFLOW_WORKER_METRICS_HOST,
        default 0.0.0.0), /metrics: qosflow.prefect.metrics. A port in use stops the start, saying so."""
        port = self._metrics_port_arg
        if port is None:
            raw = os.environ.get("QOSFLOW_WORKER_METRICS_PORT", "").strip()
            if not raw:
                return
            port = int(env_number("QOSFLOW_WORKER_METRICS_PORT", 0, minimum=0, integer=True))
        from qosflow.prefect.metrics import WorkerMetrics

        self.metrics = WorkerMetrics(self._work_pool_name, str(self.name), lambda: self.scheduler)
        port = await self.metrics.serve(int(port), os.environ.get("QOSFLOW_WORKER_METRICS_HOST", "").strip() or "0.0.0.0")
        self._logger.info("Prometheus metrics of worker %s at http://%s:%d/metrics", self.name,
                          os.environ.get("QOSFLOW_WORKER_METRICS_HOST", "").strip() or _hostname(), port)

    async def teardown(self, *exc_info: Any) -> None:
        self._stopping = True
        if self.metrics is not None:
            await self.metrics.aclose()
        poll = getattr(self, "_poll_task", None)
        if poll is not None and not poll.done():
            # wait for the fast poll to end here, bounded: a plain asyncio task that may be inside Prefect's
            # submission (anyio cancel scopes of the runs task group) or a setup retry; left running, it was
            # cancelled only by asyncio.run's final _cancel_all_tasks, after the task groups had closed,
            # where a stop was seen to hang (anyio re-delivering the cancellation, SIGTERM then ignored)
            poll.cancel()
            await asyncio.wait({poll}, timeout=5.0)
        if self._stages_in_flight or self._adopted_local:
            await self._requeue_in_flight()
        kept = sorted(fid for fid in self._pipeline_runs_here if (h := self._handles.get(fid)) is not None and h.ref.get("start"))
        if kept and self.leases is not None:
            self._logger.warning(
                "qosflow worker stopping: %d pipeline run(s) keep running on this host (%s); a worker named %r adopts them "
                "when it starts here", len(kept), ", ".join(f"{fid} pid {self._handles[fid].ref['pid']}" for fid in kept), str(self.name))
        jobs = sorted(fid for fid, h in self._handles.items() if h.ref.get("role") == "pipeline" and fid in self._lease_ids)
        if jobs:
            how = "as Kubernetes Jobs" if self._backend is not None and self._backend.name == "kubernetes" else "through host agents"
            self._logger.warning(
                "qosflow worker stopping: %d pipeline run(s) keep running %s (%s); a worker named %r adopts "
                "them when it starts, any other worker of the pool once their leases expire (%gs)", len(jobs), how,
                ", ".join(f"{fid} {_pipeline_where(self._handles[fid].ref, short=True)}" for fid in jobs), str(self.name),
                self.lease_ttl_s)
        if self._cancel_task is not None:
            self._cancel_task.cancel()
        for t in list(self._rank_end_tasks):
            t.cancel()
        if self._health_task is not None:
            self._health_task.cancel()
        if self._reload_task is not None:
            self._reload_task.cancel()
        if self._progress_task is not None:
            self._progress_task.cancel()
        if self._cluster_artifact_task is not None:
            self._cluster_artifact_task.cancel()
        # a local pool's adopted pipelines end with its backend (`LocalBackend.aclose`): their watches are left to see
        # that end and drop their records, as a pipeline this worker started does; the others' processes run on
        from qosflow.backends.local import LocalBackend

        ending = set()
        for t in list(self._adopted_tasks):
            if isinstance(self._backend, LocalBackend) and not t.done():
                ending.add(t)
            else:
                t.cancel()
        if self._learned_task is not None:
            self._learned_task.cancel()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        if self.scheduler is not None:
            await self.scheduler.stop()
            close = getattr(self.scheduler.estimator, "close", None)
            if close is not None:  # (the learned estimator writes finished stages in the background)
                await asyncio.to_thread(close)
        try:
            if self._backend is not None:
                await self._backend.aclose()
        finally:
            # their processes ended: each adopted pipeline's watch drops its record, and each pipeline run's task its record
            # too, then Prefect's worker reports the run Crashed; the runs' task group, closed by the teardown below, cancelled
            # such a task that had not finished (its run stayed Running for ever). Not for long
            waiting = ending | {t for t in self._local_pipeline_tasks if not t.done()}
            if waiting:
                await asyncio.wait(waiting, timeout=10.0)
            for t in ending:
                if not t.done():
                    t.cancel()
        if self._pipelines_here is not None:
            await self._pipelines_here.aclose()
        if getattr(self, "_claimed", False):
            try:  # (a worker of this name may start, and adopt what this one left running, at once)
                await asyncio.to_thread(self._lease_store.leave, self.holder)
            except Exception as exc:
                self._logger.warning("could not record this worker's stop in the lease store: %s", exc)
        await super().teardown(*exc_info)

    # ------------------------------------------------------------------ run
    async def run(
        self,
        flow_run: "FlowRun",
        configuration: QosflowJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[int]] = None,
    ) -> QosflowWorkerResult:
        fid = str(flow_run.id)
        self._in_flight.add(fid)
        if configuration.is_stage:
            self._stages_in_flight.add(fid)
        try:
            return await self._run(flow_run, configuration, task_status)
        finally:
            self._in_flight.discard(fid)
            self._stages_in_flight.discard(fid)
            self._stage_entries.pop(fid, None)
            self._queued_labelled.discard(fid)

    async def drain(self, timeout: float) -> set[str]:
        """Wait up to `timeout` seconds for the flow runs this worker is running to be done with: a stage
        reports its end before its process exits, and only then does the worker free its slot, release
        its lease and record its outcome. Returns the flow runs still in flight (a stop cancels them)."""
        end = time.monotonic() + max(0.0, timeout)
        while self._in_flight and time.monotonic() < end:
            await asyncio.sleep(0.1)
        return set(self._in_flight)

    async def _run(
        self,
        flow_run: "FlowRun",
        configuration: QosflowJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[int]] = None,
    ) -> QosflowWorkerResult:
        if task_status is None:
            task_status = anyio.TASK_STATUS_IGNORED
        run_logger = self.get_flow_run_logger(flow_run)
        problem = configuration._job_variable_problem
        if problem:  # (a deployment's `gpus: -1`: no cluster needed to say so)
            from prefect.states import Failed

            run_logger.error("%s", problem)
            await self._set_state(flow_run.id, Failed(message=f"qosflow: {problem}"))
            task_status.started(-1)
            return QosflowWorkerResult(status_code=0, identifier="-1")
        sched = await self._ensure_qos()
        assert self._backend is not None
        command = shlex.split(configuration.command or f"{sys.executable} -m prefect.engine")
        env = {k: v for k, v in configuration.env.items() if v is not None}
        cwd = str(configuration.working_dir) if configuration.working_dir else None
        fid = str(flow_run.id)

        if not configuration.is_stage:
            backend = self._unplaced_backend()
            if getattr(backend, "runs_pipelines", False):
                # (Kubernetes: a Job of its own; host agents with pipelines_on: a process through an agent. Adoptable by any worker)
                return await self._run_pipeline_job(flow_run, configuration, command, env, cwd, task_status)
            if hasattr(backend, "stream_output"):
                backend.stream_output = configuration.stream_output
            handle = await backend.launch_unplaced(fid, command, env, cwd)
            if backend is not self._backend:
                self._pipeline_runs_here.add(fid)
            elif (task := asyncio.current_task()) is not None:  # (the task that reports the run's end: `teardown`)
                self._local_pipeline_tasks.add(task)
                task.add_done_callback(self._local_pipeline_tasks.discard)
            self._register(fid, handle)
            kept = handle.ref.get("start") is not None and self.leases is not None  # (it outlives this worker)
            # a local pool's pipeline process ends with its worker when it stops, but a worker killed (SIGKILL, the OOM
            # killer) leaves it running in its own session: recorded too (pid and start time), so that the worker
            # restarted under this name on this host adopts it, or marks its run Crashed if it died meanwhile
            from qosflow.backends.local import process_start

            start = handle.ref.get("start") or (process_start(int(handle.ref["pid"])) if self.leases is not None else None)
            recorded = start is not None and self.leases is not None
            if recorded:
                # recorded before anything else: a worker stopped from now on leaves it to the next one of its name
                try:
                    await asyncio.shield(asyncio.to_thread(self.leases.record_pipeline, self._pool_key, fid, self.holder,
                                                           int(handle.ref["pid"]), start, handle.ref.get("output"),
                                                           configuration.stream_output))
                except Exception as exc:
                    recorded = False
                    self._logger.warning("pipeline run %s: could not record its process in the lease store (%s): a restarted "
                                         "worker will not adopt it", fid, exc)
            if kept:
                run_logger.info("pipeline run started as process %s on %s (its output: %s); it keeps running if the worker "
                                "stops, and a worker named %r adopts it when it starts", handle.ref["pid"], _hostname(),
                                handle.ref.get("output"), str(self.name))
            elif recorded:
                run_logger.info("pipeline run started as process %s on %s; it stops with the worker, and if the worker is "
                                "killed instead, a worker named %r started on this host adopts it", handle.ref["pid"],
                                _hostname(), str(self.name))
            task_status.started(handle.ref.get("pid"))
            try:
                status = await backend.wait(handle)
            finally:
                self._unregister(fid)
                self._pipeline_runs_here.discard(fid)
            # (not reached when the worker stops and its pipelines outlive it: the wait is cancelled, the process and its
            # record stay. A local pool's stop ends the process first: its wait returns, its record goes)
            if recorded:
                await self._forget_pipeline(fid, handle, remove_output=status.ok)
            return QosflowWorkerResult(status_code=_code(status), identifier=str(handle.ref.get("pid")))

        name = configuration.stage_name or flow_run.name
        if configuration.pipeline_run_id:
            ended = (await self._pipelines_ended([configuration.pipeline_run_id])).get(configuration.pipeline_run_id)
            if ended is not None:  # (its pipeline was killed with its worker, or failed on another stage, before this one started)
                from prefect.states import Cancelled

                why = f"its pipeline run {configuration.pipeline_run_id} was {ended.name} before the stage started: no one waits for its result"
                run_logger.warning("stage %s is not run: %s", name, why)
                await self._set_state(flow_run.id, Cancelled(message=f"qosflow: {why}"))
                task_status.started(-1)
                return QosflowWorkerResult(status_code=0, identifier="-1")
        spec = spec_from_job_variables(configuration, where=f"stage {name!r}")
        spec, why_whole = _whole_gpus_only(spec, self._backend)
        if why_whole:
            run_logger.info("stage %s: %s", name, why_whole)
        spec, why_slice = _at_least_a_slice(spec, self._backend, self.scheduler.cluster if self.scheduler is not None else None)
        if why_slice:
            run_logger.info("stage %s: %s", name, why_slice)
        expected = configuration.expected_duration
        now = time.time()
        spec = _with_pipeline_deadline(spec, configuration.deadline_at, now)
        job = Job(
            job_id=fid,
            submit_time=now,
            qos=spec,
            duration=float(expected or STAGE_DEFAULT_DURATION),
            model=configuration.signature or name,
            batch_size=configuration.batch_size,
            pipeline=configuration.pipeline_run_id,
            expected_duration=expected,
            meta={"flow_run_id": fid, "pipeline": configuration.pipeline},
        )
        deadline_at = configuration.deadline_at
        if deadline_at is None and spec.deadline is not None:
            deadline_at = now + spec.deadline
        entry = StageEntry(JobState(job), name, fid, configuration.pipeline, deadline_at, ready_at=_ready_time(flow_run, now))
        entry.meta["queued_at"] = now
        self._stage_entries[fid] = entry
        # which worker queued it: if this worker dies while the stage waits (no lease yet, nothing to
        # adopt), the next one puts its run back in the pool's queue (`_recover_orphans`). Written only
        # once it has waited QUEUED_LABEL_AFTER_S: a stage placed at once holds a lease instead, and the
        # write would share the event loop with its first policy rounds (+40 ms in the QoS queue, measured)
        label_later = asyncio.get_running_loop().call_later(QUEUED_LABEL_AFTER_S, self._spawn_queued_label, flow_run.id)
        if self._backend.name == "kubernetes" and configuration.command == shlex.join([sys.executable, "-m", "prefect.engine"]):
            command = ["python", "-m", "prefect.engine"]  # the interpreter inside the stage image, not the worker's
        if hasattr(self._backend, "stream_output"):
            self._backend.stream_output = configuration.stream_output
        attempts: list[dict[str, Any]] = []
        infra_failures = 0
        started = False
        label_task: asyncio.Task | None = None  # labels are written right after the launch, off its path
        base_id = await self._attempt_base(flow_run)
        check_s = self._early_check_seconds(configuration, spec, job)
        if check_s:
            outcome = await self._early_check(entry, spec, check_s, command, env, cwd, flow_run, run_logger, base_id)
            if outcome.get("launched"):
                task_status.started(outcome["infra_id"])
                started = True
            if outcome.get("result") is not None:
                return outcome["result"]
        while True:
            why = asyncio.ensure_future(self._say_why_waiting(entry, sched, name, run_logger))
            try:
                grant = await sched.request(entry)
            except StageCancelled as exc:
                run_logger.info("stage %s left the QoS queue: %s", name, exc)
                if label_task is not None:
                    await label_task
                if not started:
                    task_status.started(-1)
                return QosflowWorkerResult(status_code=0, identifier="-1")
            finally:
                why.cancel()
                label_later.cancel()
            n = len(attempts) + 1
            launch = LaunchSpec(
                # one id per attempt (an agent never starts one twice), and per pickup of the run (`_attempt_base`)
                stage_id=base_id if n == 1 else f"{base_id}-r{n - 1}",
                command=gang_command(command, grant.placement),
                placement=grant.placement,
                cluster=sched.cluster,
                env=env,
                cwd=cwd,
                cpusets=grant.cpusets,
                labels={"prefect.io/flow-run-id": fid, "prefect.io/flow-run-name": str(flow_run.name)},
                requested_gpus=spec.gpus,
            )
            try:
                await self._acquire_lease(fid, launch, spec.shareable)
            except Exception as exc:
                from qosflow.store.leases import SlotTaken, StageBusy

                sched.release(fid, ok=False)
                if isinstance(exc, SlotTaken):
                    # another worker on this pool booked the slot first: learn its leases and plan again
                    run_logger.info("stage %s: %s", name, exc)
                    await self._sync_foreign()
                    await asyncio.sleep(0.05)
                    continue
                if isinstance(exc, StageBusy):
                    run_logger.warning("stage %s not started here: %s", name, exc)
                    if not started:
                        task_status.started(-1)
                    return QosflowWorkerResult(status_code=0, identifier="-1")
                raise
            info = sched.describe_grant(entry)
            info["attempt"] = n
            run_logger.info(
                "%s %s on %s (%s, %g core%s%s) after %.2fs in the QoS queue%s; predicted %.1fs (%s)%s%s",
                "placed" if n == 1 else "re-placed",
                name,
                info["host"],
                gpus_said(info),
                info["cpu_cores"], "" if info["cpu_cores"] == 1 else "s",
                f"; {info['elastic']}" if info.get("grad_accumulation", 1) > 1 else "",
                # (a retry's own wait: from its previous attempt's end, when it came back to the queue; it counted from
                # the stage's first arrival, the first attempt's wait and run included)
                max(0.0, grant.granted_at - (now if n == 1 else max(now, attempts[-1]["ended"]))),
                # the rest of the wait was before this worker had the run (Prefect's pickup, the server):
                # said apart, so that it is not blamed on the QoS queue
                f" ({grant.waited_s:.2f}s since its run was created)" if n == 1 and grant.waited_s - (grant.granted_at - now) > 1.0 else "",
                grant.predicted_s,
                info["estimator"],
                "" if n == 1 else f"; attempt {n} after an infrastructure failure",
                f"; policy: {grant.note}" if grant.note else "",
            )
            info["queued_at"] = now
            if label_task is not None:
                await label_task  # the previous attempt's labels land first
            # labels go out while the stage is launched and runs (off the launch path and off failure detection)
            label_task = asyncio.ensure_future(self._label(flow_run.id, dict(info), grant.granted_at))
            try:
                handle = await self._backend.launch(launch)
            except Exception as exc:
                await self._free(fid, ok=False)
                await label_task
                if not _unreachable(exc):
                    raise
                # the API server is away: an outage of the whole cluster, not a failure of this stage. It
                # waits in the QoS queue (every node is down until the API answers) and is placed again
                # then, with the same attempt id (what the failed launch created is adopted, never doubled)
                self._enter_outage(str(exc))
                run_logger.warning("stage %s not launched: %s; it waits in the QoS queue and is launched when the API "
                                   "answers again (no retry of the stage is used)", name, exc)
                continue
            if len(set(grant.placement.nodes)) > 1 and handle.backend == "agent":
                # a gang's parts are in rank order at its launch (kept in its lease: a worker that adopts it knows them)
                for rank, part in enumerate(handle.ref.get("parts") or []):
                    part.setdefault("rank", rank)
            if len(set(grant.placement.nodes)) > 1 and GANG_RANK_MODULE not in launch.command:
                # (a command that is not Prefect's engine, e.g. a job template's shell wrapper, is not run through
                # gang_rank: its ranks write no end label and rank 0 waits for none, so none is written for them)
                handle.ref["gang_labels"] = False
            await self._lease_handle(fid, handle)
            self._register(fid, handle)
            progress = self._backend.progress_file(launch.stage_id)
            sched.attach(fid, handle, progress)
            if not started:
                task_status.started(_infra_id(handle, fid))
                started = True
            launched_at = time.time()
            try:
                status = await self._wait_stage(fid, handle)
            finally:
                ended = time.time()
                self._unregister(fid)
                # (left running at a stop: the next worker adopts it, lease and all)
                await self._free(fid, ok=True, lease=fid not in self._left_running)
            if self._stopping and not status.ok:  # killed by the stop: back in the queue already (_requeue_in_flight)
                if label_task is not None:
                    await label_task
                return QosflowWorkerResult(status_code=0, identifier=_infra_id(handle, fid))
            attempts.append({"attempt": n, "attempt_id": launch.stage_id, "host": info["host"], "hosts": info["hosts"],
                             "launched": launched_at, "ended": ended, "exit": status.kind.value, "exit_reason": status.reason})
            if status.kind is not ExitKind.INFRA:
                break
            if await self._final(flow_run.id):
                # the stage's engine had already reported its end (e.g. Completed) when its host went:
                # nothing is lost, and rerunning it would run it twice
                run_logger.info("stage %s: %s, but its flow run had already ended; not rerun", name, status.reason)
                attempts[-1]["decision"] = "flow run already final: not rerun"
                break
            infra_failures += 1
            d = decide(status, infra_failures=infra_failures, user_failures=0, max_infra_retries=self.max_infra_retries)
            attempts[-1]["decision"] = d.message
            if d.action is not Action.RETRY_ELSEWHERE:
                run_logger.error("stage %s: %s", name, d.message)
                break
            # infrastructure: the policy places it again at once, not on the node(s) it failed on
            run_logger.warning("stage %s: %s", name, d.message)
            # (the entry's grant, not `grant`: an edit of the cluster may have renumbered its nodes since: `_swap_cluster`)
            entry.meta.setdefault("avoid_nodes", set()).update((entry.grant or grant).placement.nodes)
            entry.state.note = d.message
            await self._sync_health()
            # the flow run stays Running across the rerun (the reason is in its log and the event below):
            # forcing a state here would put a Prefect API round trip on the relaunch path, and could land
            # after the new engine's own Running
            self._event("qosflow.stage.rescheduled", entry, {"stage": name, "attempt": n, "hosts": info["hosts"], "reason": status.reason,
                                                             "retry": infra_failures, "max_infra_retries": self.max_infra_retries})

        if label_task is not None:
            await label_task
            await self._repair_labels(flow_run.id)
        # the stage ended when its engine reported it (what the UI and the pipeline show, and what its
        # deadline is judged on); its process may take a few seconds more to exit
        finished = ended
        # a stage whose code raised still exits 0: its engine reported the flow run Failed. Only a run
        # whose flow run completed is learned from (its time, steps and where it ran)
        flow_state: str | None = None
        if status.ok:
            reported, flow_state = await self._settle_unreported(flow_run.id, name, run_logger)
            if reported is not None and launched_at <= reported <= ended:  # (another clock: the process exit)
                finished = reported
        actual = finished - launched_at
        succeeded = status.ok and flow_state in (None, "COMPLETED")
        if succeeded:
            if self._backend.syncs_progress:  # the progress it wrote last, before the estimator learns from it
                try:
                    await asyncio.wait_for(self._backend.sync_progress([handle]), 10.0)
                except Exception as exc:  # noqa: BLE001 - learned from what was copied so far
                    self._logger.debug("stage %s: last progress copy failed: %s", name, exc)
            where = dict(sched.where_ran(entry), started_at=datetime.fromtimestamp(launched_at, timezone.utc),
                         finished_at=datetime.fromtimestamp(finished, timezone.utc))
            self._observe(sched, entry, actual, where)
            try:
                self._note_learned(sched, entry, actual)
            except Exception as exc:  # the UI's predictor table is a view: never let it fail a stage
                self._logger.warning("predictor table: could not note stage %s: %s", name, exc)
        if hasattr(sched.estimator, "forget"):
            sched.estimator.forget(job)
        if status.kind is ExitKind.USER or flow_state == "FAILED":
            self._failed_last.add(job.model)
        elif succeeded:
            self._failed_last.discard(job.model)
        for a in attempts:  # read: a long-running worker keeps no file per stage it ran
            self._backend.drop_progress(a["attempt_id"])
        if succeeded:  # (a local stage's output file: kept for a failure, as a pipeline's)
            _done_with_output(handle.ref.get("output"), remove=True)
        rec = dict(info, flow_run_id=fid, ready=entry.ready_at, queued=now, placed=grant.granted_at, launched=launched_at, ended=finished,
                   exited=ended, actual_s=round(actual, 3), exit=status.kind.value, exit_reason=status.reason, attempts=attempts,
                   flow_state=flow_state)
        rec["deadline_met"] = None if deadline_at is None else finished <= deadline_at
        _keep(self.records, rec)
        if self.metrics is not None:
            self.metrics.stage_finished(status.kind.value, rec["deadline_met"])
        if deadline_at is not None and finished > deadline_at and status.kind is not ExitKind.CANCELLED:
            self._event("qosflow.qos.violated", entry, {"stage": name, "pipeline": entry.pipeline, "deadline": deadline_at, "ended": finished,
                                                        "late_by_s": round(finished - deadline_at, 3)})
        code = _code(status)
        if not status.ok and status.kind is not ExitKind.CANCELLED:
            # the stage's engine may have died before it could say how it ended: say it for it, clearly
            if await self._report_final(flow_run.id, status, len(attempts)):
                code = 0  # the state is set; do not let the base worker overwrite its message
        return QosflowWorkerResult(status_code=code, identifier=_infra_id(handle, fid))

    # ------------------------------------------------------------------ a gang's ranks
    #: seconds between two looks at the ranks (> 0) of a gang on several hosts while it runs (`_watch_gang_ranks`)
    RANK_WATCH_S = 2.0
    #: seconds the worker leaves a rank's own end label to show on the run, after its process ended, before it looks
    RANK_END_SETTLE_S = 2.0
    #: seconds the worker keeps trying to write a rank's end label (SQLite's 503s, concurrent label merges)
    RANK_END_BUDGET_S = 60.0

    async def _wait_stage(self, fid: str, handle: StageHandle) -> ExitStatus:
        """The backend's wait for a stage's end; for a gang on several hosts (host agents, Kubernetes), its ranks > 0
        are watched meanwhile (`_watch_gang_ranks`)."""
        assert self._backend is not None
        watch = asyncio.ensure_future(self._watch_gang_ranks(fid, handle)) if _gang_ranks_watched(handle) else None
        try:
            return await self._backend.wait(handle)
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch_gang_ranks(self, fid: str, handle: StageHandle) -> None:
        """A gang's rank 0 reports its run only once every other rank wrote its end label on it
        (qosflow.prefect.gang_rank); a rank whose process ended without writing it (an `exit(0)` from C code, an
        extension's `_exit`) left rank 0 waiting until the run was cancelled: a rank that exits 0 does not stop its gang.
        While the gang runs (the backend's wait is on), every RANK_WATCH_S its ranks > 0 are looked at; one whose
        process ended on its own has its label written for it, when it is missing (`_write_rank_end`). (A rank that
        ended badly stops its gang at once, the backend's doing: its label, then, is nobody's wait.)"""
        told: set[int] = set()
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                await asyncio.sleep(self.RANK_WATCH_S)
                try:
                    ended = await self._ranks_ended(handle, told)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - looked at again at the next round
                    self._logger.debug("stage %s: could not look at its gang's ranks: %s", fid, exc)
                    continue
                for rank, code in sorted(ended.items()):
                    told.add(rank)
                    t = asyncio.ensure_future(self._write_rank_end(fid, handle, rank, code))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
        finally:
            # (a label being written when the gang's wait ends goes on: `_write_rank_end` sees that and stops)
            for t in list(tasks):
                self._rank_end_tasks.add(t)
                t.add_done_callback(self._rank_end_tasks.discard)

    async def _ranks_ended(self, handle: StageHandle, told: set[int]) -> dict[int, int | None]:
        """The ranks (> 0, not in `told`) of a gang whose process has ended on its own with exit status 0 (not killed by
        qosflow), each with that status. Only those: the backend's wait goes on past a rank that exited 0, and rank 0
        waits for its label; a rank that ended otherwise (an exit code, a signal, a pod Failed) ends the gang's wait, the
        backend stopping the gang, and a label written for it meanwhile could only do harm: a rank SIGKILLed (the OOM
        killer: an infrastructure failure, the gang run again elsewhere) while a host's DELETE was slow to answer got
        `killed by SIGKILL without its end label`, rank 0, its function returned, reported the run Failed with it, and
        the worker, finding the run final, did not run the gang again."""
        assert self._backend is not None
        return {rank: 0 for rank in sorted(await self._backend.ranks_exited_ok(handle, told))}

    async def _write_rank_end(self, fid: str, handle: StageHandle, rank: int, code: int | None) -> bool:
        """Rank `rank`'s process of this launch (`handle`) ended with `code`: if the run still lacks the rank's end label
        of this attempt once the rank had time to show its own (RANK_END_SETTLE_S, and read twice), write it for the rank
        (`unlabelled_outcome`: never `ok`), with the attempt the rank would have written (`attempt_of`: the launch's stage
        id and the run's latest Pending state). Rank 0 then ends the run (Failed, GangRankFailed) instead of waiting for
        ever. Never over a label of this attempt (the rank's own wins), and only while the gang's wait is on (the handle
        is still this run's: not stopped, nor launched again), this worker not stopping and the run Running (a run not
        yet Running, rank 0 slower to start than this rank to end, is looked at again until it is, or ends). Read back
        (again a second later: a concurrent merge of another rank's label may drop it) and written again, as the ranks
        do. True when this call wrote it (and read it back)."""
        from qosflow.prefect.gang_rank import GANG_END_LABEL, attempt_of, unlabelled_outcome

        key = GANG_END_LABEL.format(rank=rank)
        outcome = unlabelled_outcome(code)
        await asyncio.sleep(self.RANK_END_SETTLE_S)
        give_up = time.monotonic() + self.RANK_END_BUDGET_S
        value: str | None = None
        attempt = ""
        absent = 0
        wrote = False
        while time.monotonic() < give_up:
            if self._handles.get(fid) is not handle or self._stopping:
                return wrote
            try:
                fr = await self.client.read_flow_run(fid)
                if _type(fr.state) in NOT_YET_RUNNING:
                    # rank 0's engine has not reported the run Running yet (its pod still pulling its image, its host
                    # slower to start; or its retry between AwaitingRetry and Running): it will wait for this label.
                    # Looked at again, for as long as the gang's wait is on (gave up at once: rank 0 waited for ever)
                    give_up = time.monotonic() + self.RANK_END_BUDGET_S
                    await asyncio.sleep(self.RANK_WATCH_S)
                    continue
                if _type(fr.state) != "RUNNING":
                    return wrote  # (ended, or being cancelled: no rank 0 waits on this launch)
                if value is None:
                    attempt = attempt_of(handle.stage_id, await self.client.read_flow_run_states(fid))
                    value = f"{outcome}@{attempt}"
                cur = (fr.labels or {}).get(key)
                if isinstance(cur, str) and cur.rpartition("@")[2] == attempt:
                    if cur != value or not wrote:
                        return wrote  # the rank's own end (it wins), or written for it already
                    await asyncio.sleep(1.0)
                    if ((await self.client.read_flow_run(fid)).labels or {}).get(key) == value:
                        return True
                    continue  # (dropped by a concurrent merge: written again)
                absent += 1
                if absent < 2 and not wrote:  # (read once more a second later before writing for the rank)
                    await asyncio.sleep(1.0)
                    continue
                if not wrote:
                    self._logger.warning("stage %s: rank %d of its gang (attempt %s) ended (%s) without writing its end label; "
                                         "written for it: %s=%s", fid, rank, handle.stage_id, outcome.removesuffix(" without its end label"),
                                         key, value)
                    self.get_flow_run_logger(fr).error(
                        "qosflow: rank %d of this gang ended (%s) without writing its end on the run (its process left by a path "
                        "that skips it: exit() from C code, a crash); the worker wrote it for it, %s=%s, so that rank 0 "
                        "fails the run rather than waiting for it for ever", rank, outcome.removesuffix(" without its end label"),
                        key, value)
                await patch_labels(self.client, fid, {key: value})
                wrote = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the server away a moment: tried again until the budget
                self._logger.debug("stage %s: writing rank %d's end label: %s", fid, rank, exc)
                await asyncio.sleep(0.5)
        self._logger.warning("stage %s: could not write rank %d's end label %s=%s within %gs", fid, rank, key, value,
                             self.RANK_END_BUDGET_S)
        return wrote

    # ------------------------------------------------------------------ helpers
    #: seconds between two "waits because ..." lines of one stage whose reason keeps changing
    WHY_WAITING_EVERY_S = 15.0

    async def _say_why_waiting(self, entry: Any, sched: QoSScheduler, name: str, run_logger: Any) -> None:
        """While a stage waits in the QoS queue, say why in its flow run's log (the UI shows it): the
        policy's note once the stage has waited a second, then whenever the note changes, at most every
        WHY_WAITING_EVERY_S seconds (notes carry numbers that change every round)."""
        from qosflow.policies.common import with_down_causes

        said, said_at = "", -math.inf
        while True:
            await asyncio.sleep(1.0)
            note = entry.state.note
            backend = getattr(self, "_backend", None)
            if note and backend is not None:  # why the hosts it waits for are down (the policy knows only that)
                note = with_down_causes(note, backend.down_reasons())
            if not note or note == said or entry.state.status is not JobStatus.PENDING:
                continue
            now = sched.clock()
            if now - said_at < self.WHY_WAITING_EVERY_S:
                continue
            run_logger.info("stage %s waits in the QoS queue (%.0fs so far): %s", name, now - entry.ready_at, note)
            said, said_at = note, now

    def _unplaced_backend(self) -> Backend:
        """Where a pipeline run (role pipeline: a process that holds no slot and dispatches its stages) starts:
        through the stages' backend when it can start one (the local backend; Kubernetes, as a Job of its own,
        unless its `pipelines_as_jobs` is off; host agents with `pipelines_on` agents or a host: `Backend.runs_pipelines`),
        else as a process on this worker's host. A pool whose worker ran its stages on host agents or Kubernetes
        crashed every pipeline run deployed on it ('backend agent cannot start an unplaced pipeline run')."""
        assert self._backend is not None
        from qosflow.backends.local import LocalBackend

        if isinstance(self._backend, LocalBackend) or getattr(self._backend, "runs_pipelines", False):
            # (the local backend; a Kubernetes Job or an agent's process under a lease: `_run_pipeline_job`)
            return self._backend
        if self._pipelines_here is None:
            from qosflow.backends.local import LocalBackend

            # a pool whose stages outlive their worker (host agents, Kubernetes: `adopt`): its pipeline runs do
            # too (`keep_unplaced`), recorded in the lease store for the next worker of this name to adopt
            # (`_adopt_pipelines`). Without leases nothing could find them again: they end with the worker
            keep = self.leases is not None and getattr(self._backend, "adopt", None) is not None
            self._pipelines_here = LocalBackend(keep_unplaced=keep, output_dir=str(pipeline_output_dir()) if keep else None)
        return self._pipelines_here

    async def _run_pipeline_job(self, flow_run: "FlowRun", configuration: QosflowJobConfiguration, command: list[str],
                                env: dict[str, str], cwd: str | None, task_status: Any) -> QosflowWorkerResult:
        """A pipeline run launched through a backend that runs pipeline runs itself (`Backend.runs_pipelines`): on a
        Kubernetes pool a Job of its own (`KubernetesBackend.launch_unplaced`: no GPU, a small CPU/memory request, the
        stages' image, env convention, labels and namespace); on a host-agent pool with `pipelines_on` a process with
        no GPU through the agent of the host `AgentBackend.pipeline_host` picks (the up host with the most free cores,
        or the one the setting names). Either holds a lease that books no slot (`LeaseStore.acquire_pipeline`, with
        the host for an agent's). The lease is renewed at this worker's heartbeats; when this worker stops (a rollout
        replaces its pod, its host is lost, it moves to another machine), the pipeline runs on and the next worker of
        the pool adopts it through the same recovery as a stage's (`_recover`, `_recover_expired` ->
        `_take_back_pipeline`): a worker of this name at once, any other once the lease expired."""
        from qosflow.store.leases import StageBusy

        backend = self._backend
        assert backend is not None
        fid = str(flow_run.id)
        run_logger = self.get_flow_run_logger(flow_run)
        if backend.name == "kubernetes" and (configuration.command == shlex.join([sys.executable, "-m", "prefect.engine"])
                                             or not configuration.command):
            command = ["python", "-m", "prefect.engine"]  # the interpreter inside the image, not the worker's
        if backend.name == "agent":
            # its Prefect heartbeats tell a host gone silent from a run gone (`AgentBackend.pipeline_liveness`)
            self._pipeline_beats[fid] = pipeline_heartbeat_s(env)
            if not any(env.get(v) for v in _HEARTBEAT_VARS):
                env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(PIPELINE_HEARTBEAT_S)
        where: dict[str, Any] = {}
        pick = getattr(backend, "pipeline_host", None)
        if pick is not None:  # (host agents: the host is chosen first, and recorded in the lease for `adopt`)
            host = pick(self._free_cores())
            if host is not None:
                where["host"] = host
        cpu = []
        if "host" in where:  # (its cores are booked in the policy's view: `_hold_pipeline`)
            cpu = [(where["host"], float(configuration.cpu_cores or backend.pipeline_cpu_cores))]  # type: ignore[attr-defined]
        if self.leases is not None:
            try:
                lease = await asyncio.to_thread(self.leases.acquire_pipeline, self._pool_key, fid, holder=self.holder,
                                                ttl_s=self.lease_ttl_s, backend=backend.name, command=command,
                                                namespace=getattr(backend, "namespace", ""), nodes=list(where.values()), cpu=cpu)
            except StageBusy as exc:  # (another worker runs it already: never twice)
                run_logger.warning("pipeline run not started here: %s", exc)
                task_status.started(-1)
                return QosflowWorkerResult(status_code=0, identifier="-1")
            self._lease_ids[fid] = lease.lease_id
        self._hold_pipeline(fid, cpu)
        try:
            handle = await backend.launch_unplaced(  # type: ignore[attr-defined]
                fid, command, env, cwd, labels={"prefect.io/flow-run-id": fid, "prefect.io/flow-run-name": str(flow_run.name)},
                cpu_cores=configuration.cpu_cores, mem_mb=configuration.mem_mb, **where)
        except BaseException:
            self._unhold_pipeline(fid)
            await self._release_lease(fid)
            raise
        await self._lease_handle(fid, handle)
        self._register(fid, handle)
        if not handle.ref.get("launch_error"):
            run_logger.info("pipeline run started as %s (no GPU); it keeps running if the worker stops, and the next worker "
                            "of the pool adopts it", _pipeline_where(handle.ref))
        task_status.started(_infra_id(handle, fid))
        try:
            status = await backend.wait(handle)
        finally:
            self._unregister(fid)
            self._unhold_pipeline(fid)
            self._pipeline_beats.pop(fid, None)
        if self._stopping and not status.ok:
            # the worker stops (its wait was stopped): the Job runs on, its lease stays for the next worker to adopt
            self._lease_ids.pop(fid, None)
            return QosflowWorkerResult(status_code=0, identifier=_infra_id(handle, fid))
        await self._release_lease(fid)
        if status.ok or status.kind is ExitKind.CANCELLED:
            if status.ok:
                await self._settle_pipeline_job(fid, handle, status, None, "while this worker watched it")
            return QosflowWorkerResult(status_code=0, identifier=_infra_id(handle, fid))
        if await self._settle_pipeline_job(fid, handle, status, None, "while this worker watched it"):
            return QosflowWorkerResult(status_code=0, identifier=_infra_id(handle, fid))  # (its state says why: not overwritten)
        return QosflowWorkerResult(status_code=_code(status), identifier=_infra_id(handle, fid))

    async def _pipeline_liveness(self, fid: str) -> ExitStatus | str | None:
        """`AgentBackend.pipeline_liveness`: a pipeline run whose host went silent still reports to Prefect, ended, or
        not (`prefect_pipeline_liveness`; the period of its heartbeats as launched here, else read off its heartbeats)."""
        return await prefect_pipeline_liveness(self.client, fid, self._pipeline_beats.get(fid))

    async def _take_back_pipeline(self, lease: Any, handle: StageHandle | None) -> None:
        """A pipeline run's lease (`LeaseStore.acquire_pipeline`) taken over at recovery: an earlier worker of this name
        stopped, or another worker's lease expired (a rollout's old pod). Its Job still there is watched to its end (and
        can be cancelled from the UI); one that is gone (deleted, or its namespace cleaned up, while no worker ran) ends
        its run Crashed, saying so, unless the run reported its own end."""
        fid = lease.stage_key
        from qosflow.store.leases import holder_name

        was = holder_name(lease.holder) if lease.holder != self.holder else str(self.name)
        what = _pipeline_where(None, lease)
        job = ",".join((lease.handle or {}).get("ref", {}).get("jobs") or []) or ("?" if lease.backend == "kubernetes" else what)
        _keep(self.recovered, {"pipeline_run": fid, "job": job, "adopted": handle is not None})
        fr = await self._flow_run(fid)
        if handle is None:  # (its lease is released: `LeaseStore.recover` / `_recover_expired`)
            await self._settle_pipeline_job(fid, None, None, fr, "while no qosflow worker watched it", what=what)
            return
        if fid in self._handles:  # (watched here already)
            return
        self._lease_ids[fid] = lease.lease_id
        self._hold_pipeline(fid, [(n, float(c)) for n, c in (lease.placement or {}).get("cpu") or []])
        self._register(fid, handle)
        self._pipelines_adopted.add(fid)
        what = _pipeline_where(handle.ref, lease)
        self._logger.info("recovery: adopted pipeline run %s (%s) still running as %s, started under worker %r; "
                          "watching it to its end", fid, getattr(fr, "name", "?"), what, was)
        if fr is not None:
            self.get_flow_run_logger(fr).info("worker %s watches this pipeline run (%s) since worker %s stopped",
                                              self.name, what, was)
        t = asyncio.get_running_loop().create_task(self._watch_adopted_pipeline_job(fid, handle), name=f"qosflow-pipeline-{fid}")
        self._adopted_tasks.add(t)
        t.add_done_callback(self._adopted_tasks.discard)

    async def _watch_adopted_pipeline_job(self, fid: str, handle: StageHandle) -> None:
        assert self._backend is not None
        try:
            status = await self._backend.wait(handle)
        finally:
            self._unregister(fid)
            self._unhold_pipeline(fid)
            self._pipelines_adopted.discard(fid)
        if self._stopping and not status.ok:
            self._lease_ids.pop(fid, None)  # (its lease stays: the next worker adopts the Job)
            return
        await self._release_lease(fid)
        if status.kind is ExitKind.CANCELLED:  # (cancelled from the UI: the cancellation watch marks its run Cancelled)
            return
        await self._settle_pipeline_job(fid, handle, status, None, f"while this worker ({self.name}) watched it, adopted at its start")

    async def _settle_pipeline_job(self, fid: str, handle: StageHandle | None, status: Any, fr: Any, when: str, *,
                                   what: str = "") -> bool:
        """A pipeline run's Job (or agent process) ended (`status`), or is gone (`handle` None): if its run did not
        report its own end (the pod was killed, evicted, OOM-killed, or the Job deleted; the process killed, or its
        host or agent lost), it is marked Crashed saying so (`what`: `_pipeline_where`). True if it was."""
        for _ in range(3):  # an engine reports its final state before its process exits; give the API a moment
            if fr is not None and (fr.state is None or fr.state.is_final()):
                break
            fr = await self._flow_run(fid)
            if fr is None or fr.state is None or fr.state.is_final():
                break
            await asyncio.sleep(1.0)
        if fr is None or fr.state is None:
            return False
        if fr.state.is_final():
            self._logger.info("pipeline run %s (%s) ended %s; it is %s", fid, fr.name, when, fr.state.name)
            return False
        from prefect.states import Crashed

        if handle is not None:
            what = _pipeline_where(handle.ref)
        if status is None:
            how = ("is gone: it was deleted, or its pod lost," if what.startswith("Kubernetes") else
                   "is gone: its host's agent no longer knows it (the agent restarted, or the host is not in the cluster any more),")
        else:
            how = f"ended ({status.reason or ('exit code %s' % status.code if status.code is not None else status.kind.value)})"
        why = (f"qosflow: the pipeline run's {what} {how} {when}, and the run did "
               "not report a final state: it was killed or died before it could")
        self._logger.warning("pipeline run %s (%s) is marked Crashed: %s", fid, fr.name, why)
        if await self._set_state(fid, Crashed(message=why)):
            self.get_flow_run_logger(fr).error("%s", why)
            return True
        return False

    def _hold_pipeline(self, fid: str, cpu: list[tuple[str, float]]) -> None:
        """Book the CPU cores of a pipeline run that a host agent runs (`cpu`: (host, cores)) in the policy's view, as
        another worker's lease is (`_sync_foreign`): stages are not placed on them, and the next pipeline run goes to
        another host while this one's has no more free cores than the others (`AgentBackend.pipeline_host`). Before,
        pipeline runs took nothing there: every one went to the host with the most free cores. No-op if they do not
        fit (the host is full: the run goes on regardless, it needs no slot)."""
        sched = self.scheduler
        if sched is None or not cpu:
            return
        key = PIPELINE_HOLD + fid
        got = _placement_from_json({"cpu": [list(c) for c in cpu]}, sched.cluster, key)
        if got is not None and not sched.hold(key, got[0], got[1], got[2]):
            self._logger.debug("pipeline run %s: its %s cores do not fit the policy's view; not booked", fid, cpu)

    def _unhold_pipeline(self, fid: str) -> None:
        sched = self.scheduler
        if sched is not None and PIPELINE_HOLD + fid in sched.state.allocs:
            sched.unhold(PIPELINE_HOLD + fid)
            sched.wake()

    def _free_cores(self) -> dict[str, float]:
        """Each host's CPU cores no stage holds, as the scheduler sees them (hosts it has marked down left out)."""
        sched = self.scheduler
        if sched is None:
            return {}
        st = sched.state
        return {n.name: float(st.cpu_free[i]) for i, n in enumerate(st.spec.nodes) if not bool(st.down[i])}

    def _backend_of(self, fid: str) -> Optional[Backend]:
        """The backend running flow run `fid`'s process (a pipeline run may run here while stages go elsewhere)."""
        return self._pipelines_here if fid in self._pipeline_runs_here else self._backend

    def _register(self, fid: str, handle: StageHandle) -> None:
        self._handles[fid] = handle
        self._pids[str(_infra_id(handle, fid))] = fid

    def _unregister(self, fid: str) -> None:
        h = self._handles.pop(fid, None)
        if h is not None:
            self._pids.pop(str(_infra_id(h, fid)), None)

    # ------------------------------------------------------------------ leases
    @property
    def _pool_key(self) -> str:
        """The pool's key in the lease store: its name and the Prefect server's API URL (`pool_key`);
        worked out once (it is asked at every stage's lease and every heartbeat)."""
        key = getattr(self, "_pool_key_value", None)
        if key is None:
            from prefect.settings import PREFECT_API_URL

            from qosflow.store.leases import pool_key

            key = self._pool_key_value = pool_key(str(self._work_pool_name), PREFECT_API_URL.value())
        return key

    async def _open_leases(self) -> Any:
        """The lease store (opened once), None when leases are off."""
        arg = self._leases_arg
        if arg is False or not env_flag("QOSFLOW_LEASES"):
            return None
        if getattr(self, "_lease_store", None) is None:
            if arg is None or arg is True:
                from qosflow.store.leases import LeaseStore

                self._lease_store = await asyncio.to_thread(LeaseStore)
            else:
                self._lease_store = arg
        return self._lease_store

    async def _claim_name(self) -> None:
        """Refuse to start while a live worker process of this name works on the pool (its presence in
        the lease store: renewed at its heartbeats, gone when it stops or its process is dead on this
        host). Prefect's own status is not used: a SIGKILLed worker stays ONLINE there for a minute and
        more, and a worker restarted under its name must adopt its stages at once. The lease holder id
        is the name plus this process (`holder_id`), so that even two processes that raced past this
        check never take each other's leases for their own."""
        from qosflow.store.leases import holder_id

        self.holder = holder_id(str(self.name))
        store = await self._open_leases()
        if store is not None:
            await asyncio.to_thread(store.claim_name, self._pool_key, self.holder, self.lease_ttl_s)
            self._claimed = True
            # a store of an earlier version keyed this pool's leases by its name alone: this worker's own
            # (its name's) move to the new key, to be recovered as before
            moved = await asyncio.to_thread(store.rekey, str(self._work_pool_name), self._pool_key, str(self.name))
            if moved:
                self._logger.info("lease store: %d lease(s) of worker %s keyed by the pool's name alone now belong to %s",
                                  moved, self.name, self._pool_key)

    async def _setup_leases(self) -> None:
        if not self.holder:
            from qosflow.store.leases import holder_id

            self.holder = holder_id(str(self.name))
        self.leases = await self._open_leases()
        if self.leases is None:
            return
        await self._sync_foreign()

    async def _acquire_lease(self, fid: str, launch: LaunchSpec, shareable: bool) -> None:
        if self.leases is None or self.scheduler is None:
            return
        sched = self.scheduler
        # book the cores this stage owns alone (the scheduler may pack fractional cores onto shared ids)
        owned = {n: sched.cpuset(fid, n) for n in launch.placement.nodes}
        lspec = dataclasses.replace(launch, cpusets={n: c for n, c in owned.items() if c})
        lease = await asyncio.to_thread(
            self.leases.acquire, self._pool_key, fid, lspec, holder=self.holder, ttl_s=self.lease_ttl_s,
            backend=self._backend.name if self._backend else "", shareable=shareable,
        )
        self._lease_ids[fid] = lease.lease_id

    async def _free(self, fid: str, ok: bool, lease: bool = True) -> None:
        """Give a stage's slot back: its lease first, then the policy's slot. The other order lets the
        policy place a waiting stage on the slot while this stage's lease still holds it; that stage's
        lease is then refused (SlotTaken) and it has to plan again (an early check was skipped so)."""
        try:
            if lease:
                await self._release_lease(fid)
        finally:
            if self.scheduler is not None:
                self.scheduler.release(fid, ok=ok)

    async def _lease_handle(self, fid: str, handle: StageHandle) -> None:
        lid = self._lease_ids.get(fid)
        if lid and self.leases is not None:
            await asyncio.to_thread(self.leases.set_handle, lid, handle)

    async def _release_lease(self, fid: str) -> None:
        lid = self._lease_ids.pop(fid, None)
        if lid and self.leases is not None:
            try:
                await asyncio.to_thread(self.leases.release, lid)
            except Exception as exc:  # it expires anyway
                self._logger.warning("could not release lease %s of %s: %s", lid, fid, exc)

    async def _sync_foreign(self) -> None:
        """Show the other workers' leases on this pool to the policy as taken capacity."""
        if self.leases is None or self.scheduler is None:
            return
        sched = self.scheduler
        try:
            leases = await asyncio.to_thread(self.leases.leases, self._pool_key)
        except Exception as exc:
            self._logger.debug("lease read failed: %s", exc)
            return
        # (another worker's pipeline run books the cores it takes on its host, none on Kubernetes: kube-scheduler's)
        live = {f"lease:{le.lease_id}": le for le in leases
                if le.holder != self.holder and (not le.is_pipeline or (le.placement or {}).get("cpu"))}
        for key in list(self._foreign - set(live)):
            sched.unhold(key)
            self._foreign.discard(key)
            sched.wake()
        for key, le in live.items():
            if key in self._foreign:
                continue
            got = _placement_from_lease(le, sched.cluster, key)
            if got is not None and sched.hold(key, got[0], got[1], got[2]):
                self._foreign.add(key)

    async def _recover(self) -> None:
        """After a (re)start: take over this worker's and expired leases of the pool; watch the stages the
        backend still runs (they must not run twice) and reschedule the flow runs of the others."""
        if self.leases is None or self._backend is None:
            return
        try:
            found = await self.leases.recover(self._backend, self._pool_key, self.holder, self.lease_ttl_s)
        except Exception as exc:
            self._logger.warning("lease recovery failed: %s", exc)
            return
        for lease, handle in found:
            await self._take_back(lease, handle)

    async def _recover_expired(self) -> None:
        """Leases of another worker that stopped renewing them: take them over (exactly one worker wins)."""
        if self.leases is None or self._backend is None:
            return
        leases = await asyncio.to_thread(self.leases.leases, self._pool_key)
        from qosflow.backends.base import StageHandle

        for le in leases:
            if le.holder == self.holder or not le.expired or (le.backend and le.backend != self._backend.name):
                continue
            if not await asyncio.to_thread(self.leases.take_over, le.lease_id, le.holder, self.holder, self.lease_ttl_s):
                continue
            handle = None
            adopt = getattr(self._backend, "adopt", None)
            if adopt is not None:
                handle = await adopt(le.attempt_id, le.nodes)
            elif le.handle:
                handle = StageHandle(**le.handle)
            if handle is None:
                await asyncio.to_thread(self.leases.release, le.lease_id)
            await self._take_back(dataclasses.replace(le, holder=self.holder), handle)

    def _spawn_queued_label(self, flow_run_id: Any) -> None:
        t = asyncio.ensure_future(self._label_queued(flow_run_id))
        self._queued_label_tasks.add(t)
        t.add_done_callback(self._queued_label_tasks.discard)

    async def _label_queued(self, flow_run_id: Any) -> None:
        try:
            await patch_labels(self.client, flow_run_id, {QUEUED_BY_LABEL: str(self.name)})
            if str(flow_run_id) in self._in_flight:
                self._queued_labelled.add(str(flow_run_id))
        except Exception as exc:  # (only the recovery of this run after a crash of this worker depends on it)
            self._logger.debug("could not label %s as queued here: %s", flow_run_id, exc)

    async def _recover_orphans(self) -> None:
        """Put back in the pool's queue the stage runs that a worker took and then died with (SIGKILL, an
        OOM kill, a host that went down) while they waited in its QoS queue. Such a run stays Pending
        (Prefect's workers take Scheduled runs only) and holds no lease, so nothing else would ever
        start it, and its pipeline waited for ever. A Pending run of this pool labelled
        `qosflow.queued_by` with a worker that is not online in the pool (Prefect marks a worker
        offline after missed heartbeats), or with this worker's own name while this process does not
        hold it (an earlier process of the same name), is rescheduled (AwaitingRetry) with why. At start
        and every `ORPHAN_CHECK_BEATS` heartbeats."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName
        from prefect.client.schemas.objects import StateType

        pool = self._work_pool_name
        try:
            runs = await self.client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING]))),
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])), limit=200)  # (the server's maximum; the rest next time)
            runs = [fr for fr in runs if (fr.labels or {}).get(QUEUED_BY_LABEL)]
            online = set()
            if runs:
                from qosflow.prefect.local import worker_online

                online = {w.name for w in await self.client.read_workers_for_work_pool(pool) if worker_online(w)}
        except Exception as exc:  # (the next heartbeat tries again; said once per kind of failure)
            if str(exc) != self._orphan_error:
                self._logger.warning("looking for stage runs left by a stopped worker: could not read the pool's runs or workers: %s", exc)
            self._orphan_error = str(exc)
            return
        self._orphan_error = None
        me = str(self.name)
        for fr in runs:
            fid, who = str(fr.id), str(fr.labels[QUEUED_BY_LABEL])
            if fid in self._in_flight or (who != me and who in online):
                continue
            if who == me:
                why = f"an earlier process of worker {who} stopped while the stage waited in its QoS queue"
            else:
                why = f"worker {who} is offline (it stopped while the stage waited in its QoS queue)"
            self._logger.warning("recovery: stage run %s (%s) was left Pending: %s; it goes back to the pool's queue", fid, fr.name, why)
            _keep(self.recovered, {"stage_key": fid, "attempt": None, "nodes": [], "adopted": False, "orphan_of": who})
            await self._reschedule(fid, f"qosflow: {why}; it runs again when a qosflow worker takes it")

    async def _pipelines_ended(self, pipeline_run_ids: Iterable[str]) -> dict[str, Any]:
        """Of these pipeline runs, those that ended without completing, each with its state (Crashed, Failed,
        Cancelled or Cancelling). A pipeline that completed is left out: one may dispatch a stage and not
        wait for it on purpose."""

        ids = sorted({str(p) for p in pipeline_run_ids if p and _is_uuid(p)})
        if not ids:
            return {}
        try:
            runs = await self._runs_by_id(ids)
        except Exception as exc:  # (looked at again at the next heartbeat)
            self._logger.debug("could not read the pipelines' states: %s", exc)
            return {}
        return {str(fr.id): fr.state for fr in runs
                if fr.state is not None and _type(fr.state) in ("CRASHED", "CANCELLED", "CANCELLING", "FAILED")}

    async def _drop_stages_of_ended_pipelines(self) -> None:
        """Stages waiting in the QoS queue whose pipeline run ended without them (killed with the worker that
        ran it, failed on another stage, cancelled) leave the queue and are marked Cancelled: they ran
        later, holding GPUs, for a result no one waited for (admin review: a stage of a Crashed pipeline
        placed and run 36 s after its worker restarted). Running stages of a pipeline run that was
        cancelled are cancelled too (set Cancelling: the cancellation watch stops them as for a `prefect
        flow-run cancel`), since the user asked for the whole pipeline to stop; those of a pipeline that
        crashed or failed are left to end (a long training step's checkpoints may still be wanted)."""
        sched = self.scheduler
        if sched is None:
            return
        queued = {e.job_id: e.state.job.pipeline for e in sched.queued() if e.state.job.pipeline}
        running = {e.job_id: e.state.job.pipeline for e in sched.running() if e.state.job.pipeline}
        self._cancel_asked &= set(running)
        ended = await self._pipelines_ended([*queued.values(), *running.values()])
        if not ended:
            return
        from prefect.states import Cancelled, Cancelling

        for fid, pipeline in queued.items():
            if pipeline in ended and fid in sched.entries:
                why = f"its pipeline run {pipeline} was {ended[pipeline].name} while the stage waited in the QoS queue: no one waits for its result"
                self._logger.warning("stage run %s leaves the QoS queue: %s", fid, why)
                sched.drop(fid, why)
                await self._set_state(fid, Cancelled(message=f"qosflow: {why}"))
        for fid, pipeline in running.items():
            if pipeline in ended and _type(ended[pipeline]) in ("CANCELLED", "CANCELLING") and fid not in self._cancel_asked:
                self._cancel_asked.add(fid)
                why = f"its pipeline run {pipeline} was {ended[pipeline].name}"
                self._logger.warning("stage run %s is cancelled: %s", fid, why)
                await self._set_state(fid, Cancelling(message=f"qosflow: {why}"))

    async def _take_back(self, lease: Any, handle: StageHandle | None) -> None:
        from qosflow.core.cluster import PlacementError

        # the lease was another holder's until now (an earlier process of this worker, or a worker whose
        # lease expired): `_sync_foreign` showed it to the policy as taken capacity. It is this stage's
        # slot (or this pipeline run's cores) from now on: drop that hold, or the stage's own slot is busy
        # for `adopt` ("does not fit the current view") and the stage was watched outside the policy's view;
        # the next sync then dropped the hold too, the GPU looked free while the stage ran, and stages placed
        # on it were refused their lease (SlotTaken) and re-planned every ~70 ms until it ended
        key = f"lease:{lease.lease_id}"
        if key in self._foreign and self.scheduler is not None:
            self.scheduler.unhold(key)
            self._foreign.discard(key)
        if getattr(lease, "is_pipeline", False):  # (a pipeline run's Job: no slot to take back)
            await self._take_back_pipeline(lease, handle)
            return
        fid = lease.stage_key
        sched = self.scheduler
        assert sched is not None and self._backend is not None
        stopped = None
        recorded = handle is not None
        if self._backend.name == "local":  # (also without a handle: the worker was killed as it launched the stage)
            handle, stopped = await self._take_back_local(lease, handle)
        _keep(self.recovered, {"stage_key": fid, "attempt": lease.attempt_id, "nodes": list(lease.nodes), "adopted": handle is not None})
        if handle is None:
            if await self._final(fid):
                # e.g. the previous worker stopped between the stage's end and its own bookkeeping
                self._logger.info("recovery: stage %s (attempt %s on %s) had already ended; its lease is released",
                                  fid, lease.attempt_id, ",".join(lease.nodes))
                return
            where = ", ".join(lease.nodes)
            if stopped is not None:  # (it said "is no longer running" of the process it had just killed)
                why = (f"its process {stopped} on {where} was still running, started by an earlier worker process, and "
                       + ("its lease did not record it (that worker was killed as it launched it)" if not recorded
                          else "an early check is not adopted (it would run on one GPU for good)" if str(lease.attempt_id).endswith("-check")
                          else "its lease did not record its start time (an older qosflow)")
                       + ": it was stopped")
                self._logger.warning("recovery: stage %s (attempt %s): %s; rescheduling its flow run", fid, lease.attempt_id, why)
                await self._reschedule(fid, f"qosflow: {why}; the stage runs again from its start")
                return
            self._logger.warning("recovery: stage %s (attempt %s on %s) is no longer running; rescheduling its flow run",
                                 fid, lease.attempt_id, where)
            await self._reschedule(fid, f"qosflow: attempt {lease.attempt_id} on {where} was lost while no worker "
                                        "watched it; placed again")
            return
        got = _placement_from_lease(lease, sched.cluster, fid)
        job_name = f"recovered:{fid}"
        entry = None
        if got is not None:
            p, qos, cores = got
            job = Job(job_id=fid, submit_time=lease.created_at, qos=qos, duration=STAGE_DEFAULT_DURATION, model=job_name)
            entry = StageEntry(JobState(job), job_name, fid)
            try:
                sched.adopt(entry, p, cores)
            except PlacementError as exc:
                self._logger.warning("recovery: stage %s's slot does not fit the current view (%s); watching it anyway", fid, exc)
                entry = None
        self._lease_ids[fid] = lease.lease_id
        _rank_parts(handle, list(lease.nodes))
        self._register(fid, handle)
        if handle.backend == "local":  # (a process of an earlier worker on this host, found by its pid and start time)
            self._adopted_local.add(fid)
            fr = await self._flow_run(fid)
            if entry is not None:
                sched.attach(fid, handle, handle.ref.get("progress"))
                # its pipeline run, so that a cancellation of the pipeline cancels it (`_drop_stages_of_ended_pipelines`)
                entry.state.job.pipeline = ((getattr(fr, "job_variables", None) or {}).get("pipeline_run_id") or None) if fr is not None else None
            self._logger.info("recovery: adopted stage %s (attempt %s, pid %s) still running on %s, started by an earlier worker "
                              "process; watching it to its end", fid, lease.attempt_id, handle.ref.get("pid"), ",".join(lease.nodes))
            if fr is not None:
                self.get_flow_run_logger(fr).info("worker %s watches this stage again (process %s on %s), left running by a "
                                                  "worker process that was killed; it was not stopped nor run again", self.name,
                                                  handle.ref.get("pid"), _hostname())
        else:
            self._logger.info("recovery: adopted stage %s (attempt %s) still running on %s", fid, lease.attempt_id, ",".join(lease.nodes))
        t = asyncio.get_running_loop().create_task(self._watch_adopted(fid, handle, entry is not None), name=f"qosflow-adopted-{fid}")
        self._adopted_tasks.add(t)
        t.add_done_callback(self._adopted_tasks.discard)

    async def _take_back_local(self, lease: Any, handle: StageHandle | None) -> tuple[StageHandle | None, int | None]:
        """A local stage of an earlier worker process (killed: a stop ends its stages) found through its lease: its
        process, a session of its own, may run on. Adopted (the handle to watch) when it is the very process the lease
        recorded (its pid and its start time, so that a pid another process got since is not taken for it): not an
        early check (it would run on one GPU for good). Otherwise its lease is released, and a process of it that still
        runs (an early check; a lease of an older version, without a start time: its environment names the flow run)
        is stopped, so that the stage never runs twice: (None, its pid) then, (None, None) if nothing ran. A lease
        without a handle (the worker was killed between the stage's launch and `_lease_handle`): a process of its
        flow run that runs in a session of its own on this host is that attempt's, stopped."""
        from qosflow.backends.local import kill_tree, process_start

        fid = lease.stage_key
        if handle is None:
            stopped = None
            for pid in _sessions_running_flow(fid):
                kill_tree(pid, 9)
                stopped = pid
            await asyncio.to_thread(self.leases.release, lease.lease_id)
            return None, stopped
        ref = dict(handle.ref or {})
        pid, start = ref.get("pid"), ref.get("start")
        alive = bool(pid and start and process_start(int(pid)) == start)
        adopt = getattr(self._backend, "adopt_unplaced", None)
        if alive and adopt is not None and not str(lease.attempt_id).endswith("-check"):
            got = adopt(handle.stage_id, int(pid), start, ref.get("output"), ref.get("stream"), node=handle.node,
                        ref={k: v for k, v in ref.items() if k not in ("reaped", "adopted")})
            if got is not None:
                return got, None
            alive = process_start(int(pid)) == start  # (it ended meanwhile: nothing to stop, its pid may be another's)
        stopped = None
        if pid and (alive or (not start and _process_runs_flow(int(pid), fid))):
            kill_tree(int(pid), 9)
            stopped = int(pid)
        await asyncio.to_thread(self.leases.release, lease.lease_id)
        return None, stopped

    # ------------------------------------------------------------------ pipeline processes of an earlier worker
    async def _adopt_pipelines(self) -> None:
        """After a (re)start: the pipeline runs that an earlier process of this worker's name started on this
        host (`keep_unplaced`: their stages run on host agents or Kubernetes) and left running when it stopped, or,
        on a local pool, when it was killed (SIGKILL: its pipelines, sessions of their own, ran on; a stop ends them).
        One still running (its pid, with the start time recorded at its launch) is watched to its end and can
        be cancelled as before; one whose process ended while no worker ran is done with if its run is final
        (it reported its end itself), else its run, Running for ever otherwise, is marked Crashed saying so."""
        if self._stopping:
            return
        if self.leases is None:
            await self._sweep_output_without_leases()
            return
        name = str(self.name)
        try:
            rows = await asyncio.to_thread(self.leases.pipeline_processes, self._pool_key, name, _hostname())
            live = {r.holder for r in await asyncio.to_thread(self.leases.live_workers, self._pool_key, name)}
        except Exception as exc:
            self._logger.warning("looking for pipeline runs left running by an earlier worker %r failed: %s", name, exc)
            return
        for row in rows:
            fid = row.flow_run_id
            if fid in self._handles or fid in self._in_flight or fid in self._pipelines_adopted:
                continue
            if row.holder != self.holder and row.holder in live:
                continue  # (a live process of this name watches it: not possible past `_claim_name`, but never taken from it)
            if not await asyncio.to_thread(self.leases.take_pipeline, fid, row.holder, self.holder):
                continue
            from qosflow.backends.local import LocalBackend

            if isinstance(self._backend, LocalBackend):
                # a local pool: its pipelines are processes of the stages' backend, which stops them with the worker
                backend = self._backend
            else:
                backend = self._pipelines_here
                if backend is None or not hasattr(backend, "adopt_unplaced"):
                    backend = self._pipelines_here = LocalBackend(keep_unplaced=True, output_dir=str(pipeline_output_dir()))
            fr = await self._flow_run(fid)
            handle = backend.adopt_unplaced(fid, row.pid, row.start, row.output, row.stream)
            if handle is None:
                self._pipelines_adopted.add(fid)
                try:
                    await self._pipeline_gone(fid, row, fr, "while no qosflow worker watched it (the worker stopped or was restarted)")
                finally:
                    self._pipelines_adopted.discard(fid)
                continue
            self._pipelines_adopted.add(fid)
            if backend is not self._backend:
                self._pipeline_runs_here.add(fid)
            self._register(fid, handle)
            _keep(self.recovered, {"pipeline_run": fid, "pid": row.pid, "adopted": True})
            self._logger.info("recovery: adopted pipeline run %s (%s, pid %d) still running on this host, started by an earlier "
                              "worker %r; watching it to its end", fid, getattr(fr, "name", "?"), row.pid, name)
            if fr is not None:
                self.get_flow_run_logger(fr).info("worker %s restarted and watches this pipeline run again (process %d on %s)",
                                                  name, row.pid, _hostname())
            t = asyncio.get_running_loop().create_task(self._watch_adopted_pipeline(fid, handle, row), name=f"qosflow-pipeline-{fid}")
            self._adopted_tasks.add(t)
            t.add_done_callback(self._adopted_tasks.discard)
        # the output files of ended pipeline runs kept for their failure (QOSFLOW_PIPELINE_OUTPUT_MAX_AGE): at
        # start and at heartbeats, at most every 10 minutes (LeaseStore.sweep_pipeline_output)
        await asyncio.to_thread(self.leases.sweep_pipeline_output, pipeline_output_dir())

    #: seconds between two sweeps of the output files without a lease store (`_sweep_output_without_leases`)
    OUTPUT_SWEEP_EVERY_S = 600.0

    async def _sweep_output_without_leases(self) -> list[str]:
        """Without a lease store (`QOSFLOW_LEASES=0`) the output files the worker keeps for a failure (a local stage's
        that failed, was cancelled or killed by a stop, `$QOSFLOW_HOME/pipeline-output/<attempt>.log`) were never
        removed: the sweep was the lease store's. Here, at the worker's start and at its heartbeats, at most every
        OUTPUT_SWEEP_EVERY_S: those last written more than `QOSFLOW_PIPELINE_OUTPUT_MAX_AGE` ago (30 days), never the
        file of a process this worker watches, nor one a process of this host has open (`sweep_old_output`)."""
        from qosflow.backends.local import sweep_old_output
        from qosflow.store.leases import PIPELINE_OUTPUT_MAX_AGE_ENV, pipeline_output_max_age

        now = time.monotonic()
        if now - self._output_swept_at < self.OUTPUT_SWEEP_EVERY_S:
            return []
        self._output_swept_at = now
        try:
            age = pipeline_output_max_age()
        except Exception as exc:  # noqa: BLE001 - a bad value: said, nothing removed
            self._logger.warning("output files are not swept: %s", exc)
            return []
        from qosflow.store.leases import _age_text

        # (the default directory, and a local backend's own: `output_file`)
        dirs = {str(pipeline_output_dir())} | {str(b._output_dir) for b in (self._backend, self._pipelines_here)
                                                if b is not None and getattr(b, "_output_dir", None)}
        keep = {h.ref.get("output") for h in self._handles.values() if h.ref.get("output")}
        out: list[str] = []
        for d in sorted(dirs):
            try:
                removed = await asyncio.to_thread(sweep_old_output, d, max_age_s=age, keep=keep)
            except Exception as exc:  # noqa: BLE001
                self._logger.warning("sweeping the output files in %s failed: %s", d, exc)
                continue
            if removed:
                self._logger.info("output files: removed %d in %s last written more than %s ago (%s; no lease store)",
                                  len(removed), d, _age_text(age or 0), PIPELINE_OUTPUT_MAX_AGE_ENV)
            out += removed
        return out

    async def _sweep_stale_workdirs(self) -> list[str]:
        """At the worker's start: the work directories (`/tmp/qosflow-local-<pid>-*`, its stages' progress files) that
        local backends of processes now gone left behind (a worker SIGKILLed never removed its own), except those a
        process still uses (a stage that ran on: `sweep_stale_workdirs`)."""
        from qosflow.backends.local import sweep_stale_workdirs

        try:
            removed = await asyncio.to_thread(sweep_stale_workdirs)
        except Exception as exc:  # noqa: BLE001 - looked at again at the next start
            self._logger.warning("could not look for work directories left by stopped workers: %s", exc)
            return []
        if removed:
            self._logger.info("removed %d work director%s left by worker processes that are gone: %s", len(removed),
                              "y" if len(removed) == 1 else "ies", ", ".join(removed))
        return removed

    async def _watch_adopted_pipeline(self, fid: str, handle: StageHandle, row: Any) -> None:
        try:
            await self._settle_adopted_pipeline(fid, handle, row)
        finally:
            self._pipelines_adopted.discard(fid)

    async def _settle_adopted_pipeline(self, fid: str, handle: StageHandle, row: Any) -> None:
        backend = self._backend_of(fid)
        assert backend is not None
        try:
            status = await backend.wait(handle)
        finally:
            self._unregister(fid)
            self._pipeline_runs_here.discard(fid)
        # (not reached when this worker stops first: its record stays for the next one)
        if status.kind is ExitKind.CANCELLED:  # (cancelled: the cancellation watch marks its run Cancelled)
            await self._forget_pipeline(fid, handle, remove_output=False)
            return
        fr = None
        for _ in range(3):  # an engine reports its final state before its process exits; give the API a moment
            fr = await self._flow_run(fid)
            if fr is None or fr.state is None or fr.state.is_final():
                break
            await asyncio.sleep(1.0)
        await self._pipeline_gone(fid, row, fr, f"while this worker ({self.name}) watched it, adopted after its restart")

    async def _pipeline_gone(self, fid: str, row: Any, fr: Any, when: str) -> None:
        """A pipeline process of an earlier worker has ended: its run reported its own end, or it is marked Crashed."""
        if fr is None:
            if await self._flow_run_deleted(fid):
                await asyncio.to_thread(self.leases.forget_pipeline, fid)
            return  # (its run cannot be read now: looked at again at a later heartbeat)
        _keep(self.recovered, {"pipeline_run": fid, "pid": row.pid, "adopted": False})
        if fr.state is not None and fr.state.is_final():
            self._logger.info("recovery: pipeline run %s (%s, pid %d) ended %s; it is %s", fid, fr.name, row.pid, when, fr.state.name)
            await self._forget_pipeline(fid, None, remove_output=fr.state.is_completed(), output=row.output)
            return
        from prefect.states import Crashed

        why = (f"qosflow: the pipeline run's process (pid {row.pid} on {row.host}, started by worker {row.name}) ended {when} "
               f"without reporting a final state: it was killed or died (its exit status is unknown; its output: {row.output})")
        self._logger.warning("recovery: pipeline run %s (%s) is marked Crashed: %s", fid, fr.name, why)
        if await self._set_state(fid, Crashed(message=why)):
            self.get_flow_run_logger(fr).error("%s", why)
            await self._forget_pipeline(fid, None, remove_output=False)

    async def _flow_run_deleted(self, fid: str) -> bool:
        from prefect.exceptions import ObjectNotFound

        try:
            await self.client.read_flow_run(fid)
        except ObjectNotFound:
            return True
        except Exception:
            return False
        return False

    async def _forget_pipeline(self, fid: str, handle: StageHandle | None, *, remove_output: bool, output: str | None = None) -> None:
        """A pipeline process this worker watched has ended: its record goes, and its output file once its run completed
        (a failed or crashed one's is kept: the traceback of a start-up failure is only there)."""
        try:
            await asyncio.to_thread(self.leases.forget_pipeline, fid)
        except Exception as exc:
            self._logger.warning("could not remove pipeline run %s's record from the lease store: %s", fid, exc)
        _done_with_output(output or (handle.ref.get("output") if handle is not None else None), remove=remove_output)

    async def _watch_adopted(self, fid: str, handle: StageHandle, allocated: bool) -> None:
        assert self._backend is not None
        ended = False
        try:
            status = await self._wait_stage(fid, handle)
            ended = True
        finally:
            self._unregister(fid)
            self._adopted_local.discard(fid)
            release = ended or not self._stopping  # (the worker stops: the stage runs on, for the next worker to adopt)
            if allocated:  # the lease first, then the policy's slot (`_free`)
                await self._free(fid, ok=True, lease=release)
            elif release:
                await self._release_lease(fid)
        if handle.ref.get("adopted") and handle.backend == "local":
            await self._settle_adopted_local(fid, handle, status)
            return
        if status.kind is ExitKind.INFRA:
            await self._reschedule(fid, f"qosflow: infrastructure failure of an adopted stage ({status.reason}); placed again")
        elif not status.ok and status.kind is not ExitKind.CANCELLED:
            await self._report_final(fid, status, None)
        elif status.ok:
            await self._settle_unreported(fid, fid, self._logger)

    async def _settle_adopted_local(self, fid: str, handle: StageHandle, status: Any) -> None:
        """A local stage process adopted after its worker was killed has ended. Not this worker's child: its exit status is
        unknown, but its engine reported the flow run's end before it exited (Completed, Failed: nothing to do, its run is
        not touched). One that ended without that (killed, out of memory) is an infrastructure failure: its run goes back
        to the pool's queue, as a lost stage's. Its progress file goes, and its output file once its run completed."""
        state = None
        if status.kind is not ExitKind.CANCELLED:  # (cancelled: the cancellation watch marks its run Cancelled)
            for _ in range(3):  # (the report may still be on its way to the server)
                fr = await self._flow_run(fid)
                state = fr.state if fr is not None else None
                if state is not None and state.is_final():
                    break
                await asyncio.sleep(1.0)
        pid = handle.ref.get("pid")
        if state is not None and state.is_final():
            self._logger.info("adopted stage %s (pid %s) ended; its flow run is %s", fid, pid, state.name)
        elif status.kind is not ExitKind.CANCELLED:
            await self._reschedule(fid, f"qosflow: the adopted stage's process {pid} on {_hostname()} ended without its flow run "
                                        "reporting its end (killed, or it died); placed again")
        _done_with_output(handle.ref.get("progress"), remove=True)
        _done_with_output(handle.ref.get("output"), remove=state is not None and state.is_completed())

    # ------------------------------------------------------------------ heartbeats
    async def _progress_loop(self, interval: float) -> None:
        """Every `interval` seconds (QOSFLOW_PROGRESS_SYNC_SECONDS, default the backend's `progress_sync_s`:
        2 s for agents, 10 s on Kubernetes), copy the progress that running stages wrote where they run to
        the files the scheduler reads (`Backend.sync_progress`): its forecasts, CODA and the estimator read
        a remote stage's progress as a local one's."""
        while True:
            await asyncio.sleep(interval)
            sched, be = self.scheduler, self._backend
            if sched is None or be is None:
                continue
            handles = [e.handle for e in sched.running() if e.handle is not None and e.progress_file]
            if not handles:
                continue
            try:
                await be.sync_progress(handles)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a view: never let it stop the worker
                if self.outage is not None or _unreachable(exc):  # (the outage is logged once, by the heartbeat)
                    self._logger.debug("qosflow: could not copy the stages' progress: %s", exc)
                else:
                    self._logger.warning("qosflow: could not copy the stages' progress: %s", exc)

    async def _health_loop(self) -> None:
        interval = float(getattr(self._backend, "heartbeat_s", 0) or 2.0)
        interval = max(0.2, min(interval, self.lease_ttl_s / 3))
        beats = 0
        while True:
            await asyncio.sleep(interval)
            beats += 1
            try:
                await self._sync_health()
                await self._sync_capacity_requests()
                if self.leases is not None:
                    await asyncio.to_thread(self.leases.renew_holder, self.holder, self.lease_ttl_s)
                    await self._sync_foreign()
                    if beats % 5 == 0:
                        await self._recover_expired()
                if beats % ORPHAN_CHECK_BEATS == 0:
                    await self._recover_orphans()
                    await self._adopt_pipelines()  # (those whose run could not be read at start)
                await self._drop_stages_of_ended_pipelines()
                if self._draining or self._deferred:
                    await self._settle_cluster()  # (a removed host whose last stage ended; a change that waited for that)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._logger.warning("qosflow heartbeat failed: %s", exc)

    async def _sync_health(self) -> None:
        """Mark hosts that miss heartbeats down in the scheduler's ClusterState (no new stage goes there)
        and hosts that answer again up."""
        sched, be = self.scheduler, self._backend
        if sched is None or be is None:
            return
        failing = self._health_error
        try:
            healthy = await be.healthy_nodes()
        except Exception as exc:
            if _unreachable(exc):
                self._health_error = str(exc)
                self._enter_outage(str(exc))
                return
            # once per outage (and again if the reason changes), not at every heartbeat
            if str(exc) != failing:
                self._logger.warning("cannot read the hosts' health: %s (no host is marked down or up until this "
                                     "works again; retrying at every heartbeat)", exc)
            else:
                self._logger.debug("healthy_nodes failed: %s", exc)
            self._health_error = str(exc)
            return
        usage = await self._read_pods(be)
        if failing is not None:
            if self.outage is None:
                self._logger.info("the hosts' health can be read again")
            self._health_error = None
        if self.outage is not None:
            self._end_outage()
        for i, node in enumerate(sched.cluster.nodes):
            if node.name in self._draining:
                continue  # removed from the cluster's description: down until its stages end (`_settle_cluster`)
            down = node.name not in healthy
            if bool(sched.state.down[i]) == down:
                continue
            on_it = sched.state.set_node_down(i, down)
            _keep(self.node_events, (time.time(), node.name, "down" if down else "up"))
            if down:
                why = ""
                st = getattr(be, "state", {}).get(node.name) if isinstance(getattr(be, "state", None), dict) else None
                reason = st.error if st is not None else be.down_reasons().get(node.name)
                if reason:
                    why = f" ({reason})"
                stages = [j for j in on_it if not is_hold(j)]
                runs = len([j for j in on_it if str(j).startswith(PIPELINE_HOLD)])  # (pipeline runs' booked cores: not rerun, their waits tell their fate)
                also = f"; {runs} pipeline run(s) there are followed until their host or Prefect says how they ended" if runs else ""
                if not stages:  # (e.g. a gang whose other host's loss already ended it: it is queued again already)
                    # ("now": a stage whose wait saw the host's loss before this round is placed again already; the line
                    # said 'no stage of this worker was running on it' of the stage that just ran there)
                    self._logger.warning("host %s is down%s: no new stage goes there; no stage of this worker runs there "
                                         "now%s", node.name, why, also)
                elif be.keeps_stages(node.name):  # (cordoned: its stages are not lost, nothing runs them again)
                    self._logger.warning("host %s is down%s: no new stage goes there; the %d stage(s) on it run on%s",
                                         node.name, why, len(stages), also)
                else:
                    self._logger.warning("host %s is down%s: no new stage goes there; %d stage(s) on it will run again elsewhere%s",
                                         node.name, why, len(stages), also)
            else:
                self._logger.info("host %s answers again", node.name)
            self._node_event("qosflow.node.down" if down else "qosflow.node.up", node.name, {"stages": on_it})
            sched.wake()
        if usage is not None and book_foreign_pods(sched, usage, self._pods_booked):
            sched.wake()

    async def _read_pods(self, be: Backend) -> Any:
        """What the pods that are not qosflow's stages request per node (a backend that reads them: Kubernetes'
        `foreign_pod_usage`), or None (none, or the read failed: the holds stay as they are)."""
        read = getattr(be, "foreign_pod_usage", None)
        if read is None:
            return None
        try:
            return await read()
        except Exception as exc:  # (the next heartbeat reads them again)
            self._logger.debug("could not read the pods on the nodes: %s", exc)
            return None

    async def _sync_capacity_requests(self) -> None:
        """Tell a backend that asks its cluster for nodes (`request_capacity`: Kubernetes' placeholder pods for a
        cluster-autoscaler) which stages have waited `capacity_request_after_s` because no node of the plan has room
        for them (`QoSScheduler.waiting_for_capacity`); it makes and deletes its requests to match. It is told first
        who makes them (this process's lease holder id, the pool's key) and how to read which workers of a pool are
        alive (their presence in the lease store, `Backend.capacity_peers`): another worker's requests are deleted only
        once that worker is gone. Not during an outage (every node is down then, for want of the API, not of room)."""
        sched, be = self.scheduler, self._backend
        if sched is None or be is None or self.outage is not None:
            return
        on = getattr(be, "request_capacity", False) is True
        if not on and getattr(be, "holds_capacity_requests", False) is not True:  # (off, and none left to delete)
            return
        from qosflow.backends.base import CapacityWant

        now = sched.clock()
        wants = [CapacityWant(job_id=e.job_id, name=e.name, gpus=int(math.ceil(e.job.qos.gpus)), cpu_cores=float(e.job.qos.cpu_cores),
                              mem_mb=float(e.job.qos.mem_mb or 0.0), gpu_milli=int(e.job.qos.gpu_milli), waited_s=now - e.ready_at)
                 for e in (sched.waiting_for_capacity(float(be.capacity_request_after_s), now) if on else [])]
        try:
            if self.holder:  # (who makes them, and which other makers live: several workers on one pool)
                self._tell_backend_pool()
            await be.sync_capacity_requests(wants)
        except Exception as exc:  # (the next heartbeat tries again; the stages wait meanwhile, as they would anyway)
            self._logger.warning("could not request capacity for %d waiting stage(s): %s", len(wants), exc)

    def _tell_backend_pool(self) -> None:
        """Tell the backend this process's lease holder id, the pool's key in the lease store and how to read which
        workers of a pool are alive (`Backend.capacity_peers`): the Kubernetes backend labels what it creates with the
        pool (qosflow.dev/pool) and takes only this pool's stage pods and Jobs for its own (`KubernetesBackend.owns`),
        so that another pool's worker on the same cluster, namespace and block name is neither booked as this one nor
        adopted, swept or deleted; and its capacity requests name their maker."""
        tell = getattr(self._backend, "capacity_peers", None)
        if tell is None:
            return
        store = self.leases
        tell(self.holder, self._pool_key, None if store is None else (lambda pool: _live_holders(store, pool)))

    def _enter_outage(self, why: str) -> None:
        """The backend's API cannot be reached: mark every node down in the scheduler's view, so that
        no stage is placed (and launched) into the outage; stages already running go on. Logged once."""
        sched = self.scheduler
        now = self._clock()
        if self.outage is None:
            self._logger.warning("%s: no stage is launched until it answers (stages waiting stay in the QoS queue; "
                                 "stages already running go on); checking at every heartbeat", why)
            _keep(self.outages, (time.time(), f"down: {why}"))
            self._outage_since = self._outage_said = now
        elif now - self._outage_said >= OUTAGE_REMINDER_S:  # a long outage is not silent after its first line
            self._outage_said = now
            self._logger.warning("the backend's API still does not answer after %s (%s): %d stage(s) wait in the QoS "
                                 "queue; none is launched until it answers", _span(now - self._outage_since), why,
                                 self._waiting())
        self.outage = why
        if sched is None:
            return
        for i in range(len(sched.cluster.nodes)):
            if not sched.state.down[i]:
                sched.state.set_node_down(i, True)
                self._outage_down.add(i)

    def _end_outage(self) -> None:
        """The backend's API answers again: the nodes marked down for the outage come back (the health
        just read then marks down the ones that really are), and the waiting stages are placed."""
        sched = self.scheduler
        self._logger.info("the backend's API answers again after an outage of %s (%s): stages are launched again "
                          "(%d waiting)", _span(self._clock() - self._outage_since), self.outage, self._waiting())
        self.outage = None
        _keep(self.outages, (time.time(), "up"))
        if sched is not None:
            for i in sorted(self._outage_down):
                if sched.cluster.nodes[i].name not in self._draining:
                    sched.state.set_node_down(i, False)
            sched.wake()
        self._outage_down.clear()

    def _waiting(self) -> int:
        """Stages waiting in the QoS queue."""
        return len(self.scheduler.queued()) if self.scheduler is not None else 0

    def _node_event(self, name: str, node: str, payload: dict[str, Any]) -> None:
        from prefect.events import emit_event

        if self.metrics is not None:
            self.metrics.event(name)

        related = []
        if self._work_pool is not None:
            related.append({"prefect.resource.id": f"prefect.work-pool.{self._work_pool.id}", "prefect.resource.role": "work-pool",
                            "prefect.resource.name": self._work_pool.name})
        try:
            emit_event(event=name, resource={"prefect.resource.id": f"qosflow.node.{node}", "prefect.resource.name": node},
                       related=related, payload=json.loads(json.dumps(payload, default=str)))
        except Exception as exc:
            self._logger.debug("event %s not emitted: %s", name, exc)

    # ------------------------------------------------------------------ the cluster block (or file) is edited
    def _cluster_reload_setting(self) -> float:
        """Seconds between two readings of the cluster block or file: QOSFLOW_CLUSTER_RELOAD_SECONDS, else the pool's
        `cluster_reload_s` variable, else CLUSTER_RELOAD_S (60 s); 0: read only at start (and a backend's node changes
        are not followed either: no reload loop, `_cluster_reload_loop`, runs)."""
        from qosflow.errors import SpecError

        default = self._pool_default("cluster_reload_s")
        if default is None:
            default = CLUSTER_RELOAD_S
        try:
            value = float(default)
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise SpecError("cluster_reload_s", f"the pool's cluster_reload_s is {default!r}: give a number of seconds >= 0 (0: the "
                                                "cluster block or file is read only when the worker starts)")
        return env_number("QOSFLOW_CLUSTER_RELOAD_SECONDS", value, minimum=0.0)

    @property
    def _cluster_what(self) -> str:
        """"cluster block 'lab'" or "cluster file lab.yaml", for messages."""
        if self._cluster_source is None:  # (a backend given to the worker, whose nodes it follows: `_follow_nodes`)
            return f"cluster {self.scheduler.cluster.name if self.scheduler is not None else '?'!r}"
        kind, name = self._cluster_source
        return f"cluster block {name!r}" if kind == "block" else f"cluster file {name}"

    async def _cluster_reload_loop(self) -> None:
        """`reload_cluster` every `cluster_reload_s`; and, between two, `_follow_nodes` as soon as the backend says that its
        nodes changed in what the plan holds (`Backend.on_nodes_changed`: Kubernetes' node watch saw a node added, deleted,
        resized, Ready or not, cordoned or uncordoned), so that a node the autoscaler added takes the stages waiting for it
        within a second, not up to cluster_reload_s later. At most one such following per NODES_FOLLOW_S (a burst of changes
        is followed together), and none while an outage is declared (they are followed once it ends)."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        changed = False

        def nodes_changed() -> None:  # (in the loop, soon after the backend's thread said so)
            nonlocal changed
            changed = True
            wake.set()

        be = self._backend
        hooked = be is not None and be.on_nodes_changed(lambda: loop.call_soon_threadsafe(nodes_changed))
        try:
            due, followed = loop.time() + self.cluster_reload_s, -math.inf
            while True:
                now = loop.time()
                if now >= due:  # (the reading follows the nodes too)
                    changed, followed = False, now
                    await self._reload_step(self.reload_cluster)
                    due = loop.time() + self.cluster_reload_s
                    continue
                if changed and self.outage is None and now >= followed + NODES_FOLLOW_S:
                    changed, followed = False, now
                    await self._reload_step(self._follow_nodes)
                    continue
                until = due
                if changed:  # (NODES_FOLLOW_S after the last following; during an outage, a look every NODES_FOLLOW_S)
                    until = min(due, (now if self.outage is not None else followed) + NODES_FOLLOW_S)
                wake.clear()
                # (a timer and an event, not asyncio.wait_for: on Python 3.11 that can swallow a cancel that comes as it wakes)
                timer = loop.call_later(until - now, wake.set)
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
        finally:
            if hooked:
                be.on_nodes_changed(None)

    async def _reload_step(self, step) -> None:
        """`step()` (a reading of the cluster, or a following of its nodes); its error is said, not raised."""
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let an edit of the cluster stop the worker
            self._say_reload_error(exc)

    def _say_reload_error(self, exc: BaseException) -> None:
        why = str(exc) or type(exc).__name__
        if why == self._reload_error:
            return
        self._reload_error = why
        sched = self.scheduler
        hosts = ", ".join(sched.cluster.node_names) if sched is not None else "?"
        self._logger.error("%s cannot be used as it is now: %s. The worker keeps the cluster it has (hosts %s) and reads the %s "
                           "again every %gs", self._cluster_what, why, hosts, (self._cluster_source or ("block",))[0], self.cluster_reload_s)

    async def reload_cluster(self) -> list[str]:
        """Read the cluster block (or file) the worker started from again and apply what changed: hosts added are
        used, hosts removed take no new stage (those running there end there, followed as before) and are
        forgotten once empty, resized hosts are resized as far as that is safe with the stages on them
        (`_settle_cluster`). A description that no longer loads or validates is not used (logged once per
        distinct error); the worker keeps the cluster it has. Returns the changes made (also logged).

        A backend whose nodes come from its cluster's API (`Backend.lists_nodes`: Kubernetes) has them listed again
        when the description did not change, and the difference applied the same way (`_follow_nodes`)."""
        if self.scheduler is None or self._backend is None:
            return []
        if self._cluster_source is None:
            return await self._follow_nodes()
        kind, name = self._cluster_source
        new = None
        try:
            if kind == "file":
                from qosflow.backends.agent import load_cluster_file

                def read() -> tuple[Any, str]:  # (off the event loop: 0.35 s for a file of 1,000 hosts)
                    cf = load_cluster_file(name)
                    return cf, _fingerprint(cf)

                desc, fp = await asyncio.to_thread(read)
            else:
                desc = await load_cluster_block(name)
                fp = _fingerprint(desc)
            if fp != self._cluster_seen:
                new = desc.backend() if kind == "file" else desc.make_backend()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._say_reload_error(exc)
            return []
        if self._reload_error is not None:
            self._logger.info("%s can be used again", self._cluster_what)
            self._reload_error = None
        if new is None:
            return await self._follow_nodes()
        try:
            return await self._take_cluster(new, fp)
        finally:
            if new is not self._backend:
                await new.aclose()

    async def _follow_nodes(self) -> list[str]:
        """The description did not change. A backend whose nodes come from its cluster's API (`lists_nodes`: a
        Kubernetes cluster's autoscaler adds a GPU node, an administrator deletes one, without an edit of the block)
        has them listed again (one list call), and what differs from the hosts planned on is applied as an edit of
        the description would be (`_settle_cluster`): a node added is planned on, a node gone drains then is
        forgotten, a node resized (allocatable GPUs, cpu, memory) is resized as far as its stages allow. A node
        cordoned (spec.unschedulable) takes no new stage, its running ones go on; uncordoned, it takes stages
        again. Otherwise (or when the nodes cannot be listed) only what waited for stages to end is settled."""
        sched, be = self.scheduler, self._backend
        assert sched is not None and be is not None
        listing = None
        if getattr(be, "lists_nodes", False) and self.outage is None:  # (during an outage the heartbeat says so, and lists nothing)
            try:
                listing = await be.list_nodes()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the nodes as they were planned stay
                why = str(exc) or type(exc).__name__
                if _unreachable(exc):
                    self._logger.debug("qosflow: could not list the nodes: %s", why)
                elif why != self._nodes_error:
                    self._logger.warning("%s: could not list its nodes to follow them: %s; the worker plans on the nodes it has and "
                                         "tries again every %gs", self._cluster_what, why, self.cluster_reload_s)
                self._nodes_error = why
        if listing is None:
            return await self._settle_cluster() if (self._draining or self._deferred) else []
        if self._nodes_error is not None:
            self._logger.info("%s: its nodes can be listed again", self._cluster_what)
            self._nodes_error = None
        if not listing.nodes:  # (a selector that matches nothing for a moment is no reason to drain every node)
            self._no_nodes_said = (f"{self._cluster_what}: no node of the cluster matches its node selector now (every node deleted, "
                                   f"or scaled to zero?); the worker keeps planning on the nodes it has "
                                   f"({', '.join(sched.cluster.node_names)}), down, and stages wait until nodes come back")
            self._say_once(self._no_nodes_said)
            return await self._settle_cluster() if (self._draining or self._deferred) else []
        said = self._no_nodes_said
        if said is not None:  # nodes again: said again the next time there are none (an autoscaler's scale-to-zero each night)
            self._cluster_said.discard(said)
            self._no_nodes_said = None
            self._logger.info("%s: nodes are listed again (%d)", self._cluster_what, len(listing.nodes))
        planned = self._wanted if self._wanted is not None else {n.name: n for n in sched.cluster.nodes}
        listed = {n.name: n for n in listing.nodes}
        lines: list[str] = []
        if listed.keys() != planned.keys() or any(not _same_node(planned[k], n) for k, n in listed.items()):
            self._wanted = listed
            lines = await self._settle_cluster(listing.healthy)
        elif self._draining or self._deferred:
            lines = await self._settle_cluster(listing.healthy)
        return lines + self._follow_cordons(listing.cordoned, listing.healthy, set(listed))

    def _follow_cordons(self, cordoned: set[str], healthy: set[str], listed: set[str]) -> list[str]:
        """Nodes cordoned since the last listing: down for the policy (their running stages go on); uncordoned: up
        again (unless drained or not Ready). One line and one qosflow.node.changed event per change."""
        sched = self.scheduler
        assert sched is not None
        what, busy = self._cluster_what, self._busy_hosts()
        lines: list[tuple[str, str, str]] = []
        for i, n in enumerate(sched.cluster.nodes):
            if n.name in cordoned and n.name not in self._cordoned:
                sched.state.set_node_down(i, True)
                k = busy.get(n.name, 0)
                lines.append((n.name, "cordoned", f"host {n.name} is cordoned (spec.unschedulable): no new stage goes there; "
                                                  f"{k} stage{'' if k == 1 else 's'} running there go{'es' if k == 1 else ''} on"))
            elif n.name in self._cordoned and n.name not in cordoned and n.name in listed:  # (not one deleted meanwhile)
                if n.name not in self._draining and self.outage is None and n.name in healthy:
                    sched.state.set_node_down(i, False)
                lines.append((n.name, "uncordoned", f"host {n.name} is uncordoned: new stages go there again"))
        self._cordoned = set(cordoned) & set(sched.cluster.node_names)
        for host, change, line in lines:
            self._logger.info("%s: %s", what, line)
            _keep(self.cluster_events, (time.time(), line))
            self._node_event("qosflow.node.changed", host, {"change": change, "cluster": what})
        if lines:
            sched.wake()
        return [line for _, _, line in lines]

    def _say_once(self, msg: str) -> None:
        if msg not in self._cluster_said:
            self._cluster_said.add(msg)
            self._logger.warning("%s", msg)

    async def _take_cluster(self, new: Backend, fp: str) -> list[str]:
        """Hand the edited description (`new`, a backend never started) to the backend, then follow it (`_settle_cluster`)."""
        assert self._backend is not None
        if fp != self._cluster_said_for:  # another edit: what is said about it is said again
            self._cluster_said_for, self._cluster_said = fp, set()
        what = self._cluster_what
        try:
            upd = await self._backend.update_cluster(new, busy=set(self._busy_hosts()))
        except NotImplementedError as exc:
            self._say_once(f"{what} changed, but {exc}: restart the worker to use it (it keeps the cluster it has)")
            self._cluster_seen = fp
            return []
        for msg in upd.not_applied:
            self._say_once(f"{what} changed: {msg}")
        for msg in upd.applied:
            self._logger.info("%s: %s", what, msg)
            _keep(self.cluster_events, (time.time(), msg))
        # (a change that waits for stages to end is handed over again at the next reading)
        self._cluster_seen = None if upd.not_applied else fp
        self._wanted = {n.name: n for n in upd.nodes}
        return await self._settle_cluster()

    def _busy_hosts(self) -> dict[str, int]:
        """Host name -> stages placed there: this worker's (running, or ended and not yet recorded by their run)
        and the slots of other workers' leases it shows its policy."""
        sched = self.scheduler
        if sched is None:
            return {}
        names = sched.cluster.node_names
        out: dict[str, int] = {}
        for key, p in sched.state.allocs.items():
            if key.startswith(PODS_HOLD):  # (not a stage: other pods, `book_foreign_pods`)
                continue
            for n in p.nodes:
                out[names[n]] = out.get(names[n], 0) + 1
        for fid, e in self._stage_entries.items():
            if fid in sched.state.allocs or e.grant is None or e.state.status is JobStatus.PENDING:
                continue
            for n in e.grant.placement.nodes:
                if 0 <= n < len(names):
                    out[names[n]] = out.get(names[n], 0) + 1
        return out

    async def _settle_cluster(self, healthy: set[str] | None = None) -> list[str]:
        """Bring the scheduler's cluster as close to the described one (`_wanted`) as is safe now, log each change
        ("cluster block 'lab': host h3 removed (2 stages still running there, no new ones)") and return them.

        * a host no longer described: down for the policy (draining) while stages of it run; then forgotten;
        * a host added: planned on (down until its agent answers);
        * a host resized: at once where that is safe with the stages on it (more GPUs, cores or memory; fewer
          cores or less memory than it has free; another GPU model or labels); else once they end, with a warning.
        Node indices change when hosts come and go: every placement is renumbered (`_swap_cluster`). `healthy`: the
        hosts that take stages now, if the caller has just read them (else `healthy_nodes` is asked)."""
        sched, be, wanted = self.scheduler, self._backend, self._wanted
        if sched is None or be is None or wanted is None:
            return []
        if healthy is None:
            try:
                healthy = await be.healthy_nodes()
            except Exception:  # (an added host starts down then; the heartbeat brings it up)
                healthy = set()
        # from here on no await: the scheduler's round must not place a stage between this plan and the swap
        what, old = self._cluster_what, sched.cluster
        busy = self._busy_hosts()
        nodes, lines, deferred = [], [], False
        events: list[tuple[str, str, dict[str, Any]]] = []  # (event, host, payload): for automations and metrics
        for i, n in enumerate(old.nodes):
            k = busy.get(n.name, 0)
            w = wanted.get(n.name)
            if w is not None:
                if n.name in self._draining:
                    self._draining.discard(n.name)
                    lines.append(f"host {n.name} is described again: new stages go there again")
                    sched.state.set_node_down(i, n.name not in healthy or self.outage is not None)
                if _same_node(n, w):
                    nodes.append(n)
                    continue
                change = _node_change(n, w)
                why = _why_not_resized(n, w, sched.state, i) if k else None
                if why is None:
                    nodes.append(w)
                    lines.append(f"host {n.name} changed: {change}")
                    events.append(("qosflow.node.changed", n.name, {"change": change}))
                else:
                    nodes.append(n)
                    deferred = True
                    self._say_once(f"{what}: host {n.name} changed ({change}), but {why} while {k} stage(s) run there: the worker "
                                   f"plans it as before until they end (or until it is restarted)")
            elif k or not be.drop_host(n.name):
                nodes.append(n)
                if n.name not in self._draining:
                    self._draining.add(n.name)
                    sched.state.set_node_down(i, True)
                    lines.append(f"host {n.name} removed ({k} stage{'' if k == 1 else 's'} still running there, no new ones)")
                    events.append(("qosflow.node.removed", n.name, {"stages_running": k, "draining": True}))
            else:
                lines.append(f"host {n.name} removed" + (": its last stage ended" if n.name in self._draining else ""))
                if n.name not in self._draining:  # (a draining host's removal was told when it began)
                    events.append(("qosflow.node.removed", n.name, {"stages_running": 0, "draining": False}))
                self._draining.discard(n.name)
        for name, w in wanted.items():
            if name not in old.node_names:
                nodes.append(w)
                lines.append(f"host {name} added ({w.gpus} GPU{'' if w.gpus == 1 else 's'}{', virtual' if w.virtual else ''}, "
                             f"{w.cpu_cores:g} cores)")
                events.append(("qosflow.node.added", name, {"gpus": w.gpus, "virtual": w.virtual, "cpu_cores": w.cpu_cores,
                                                            "gpu_model": w.gpu_model}))
        self._deferred = deferred
        if len(nodes) != len(old.nodes) or any(a is not b for a, b in zip(nodes, old.nodes)):
            spec = ClusterSpec(tuple(nodes), name=old.name)
            self._swap_cluster(spec, healthy)
            be.planned(spec)
        for line in lines:
            self._logger.info("%s: %s", what, line)
            _keep(self.cluster_events, (time.time(), line))
        for name, host, payload in events:
            self._node_event(name, host, dict(payload, cluster=what))
        if lines:
            sched.wake()
        return lines

    def _swap_cluster(self, spec: ClusterSpec, healthy: set[str]) -> None:
        """Make `spec` the scheduler's cluster. Its allocation state moves over node by node (`_moved_state`), and
        every node index held anywhere -- placements, grants, core owners, nodes a rerun avoids, nodes down for
        an outage, the backend's handles -- is renumbered. A node added is down unless `healthy`; a node kept
        keeps its down flag, a draining one stays down."""
        sched = self.scheduler
        assert sched is not None and self._backend is not None
        old = sched.cluster
        index = {n.name: j for j, n in enumerate(spec.nodes)}
        where = {i: index[n.name] for i, n in enumerate(old.nodes) if n.name in index}
        moved: dict[int, Any] = {}

        def move(p: Any) -> Any:
            if id(p) not in moved:  # (one object per placement: the policy recognizes its own by identity)
                moved[id(p)] = dataclasses.replace(p, gpus=tuple((where[n], g) for n, g in p.gpus if n in where),
                                                   cpu=tuple((where[n], c) for n, c in p.cpu if n in where))
            return moved[id(p)]

        state = _moved_state(sched.state, spec, where, move)
        outage_down = {where[i] for i in self._outage_down if i in where}
        for j, n in enumerate(spec.nodes):
            if n.name not in old.node_names:
                state.set_node_down(j, n.name not in healthy or self.outage is not None)
                if self.outage is not None:
                    outage_down.add(j)  # (up when the API answers again, as the others: `_end_outage`)
            elif n.name in self._draining:
                state.set_node_down(j, True)
        self._outage_down = outage_down
        back = {j: i for i, j in where.items()}
        cores: dict[int, list[str]] = {}
        for j, n in enumerate(spec.nodes):
            owners = list(sched._cores.get(back[j], [])) if j in back else []
            size = max(1, int(math.ceil(n.cpu_cores)))
            owners += [""] * (size - len(owners))
            while len(owners) > size and not owners[-1]:
                owners.pop()
            cores[j] = owners
        entries = {id(e): e for e in (*sched.entries.values(), *self._stage_entries.values())}
        for e in entries.values():
            if e.grant is not None:
                e.grant = dataclasses.replace(e.grant, placement=move(e.grant.placement),
                                              cpusets={where[n]: c for n, c in e.grant.cpusets.items() if n in where})
            if e.state.placement is not None:
                e.state.placement = move(e.state.placement)
            if e.meta.get("avoid_nodes"):
                e.meta["avoid_nodes"] = {where[n] for n in e.meta["avoid_nodes"] if n in where}
        for handle in self._handles.values():
            self._backend.renumber(handle, where)
        sched.cluster, sched.state, sched._cores = spec, state, cores

    # ------------------------------------------------------------------ flow run states
    async def _set_state(self, flow_run_id: Any, state: Any) -> bool:
        try:
            await self.client.set_flow_run_state(flow_run_id, state, force=True)
            return True
        except Exception as exc:
            self._logger.warning("could not set the state of flow run %s: %s", flow_run_id, exc)
            return False

    # ------------------------------------------------------------------ early check (Philly)
    def _early_check_seconds(self, configuration: QosflowJobConfiguration, spec: Any, job: Job) -> float:
        """How long to run this stage on a small slot first (0: no check).

        Philly's failures are mostly user errors that show within the first minutes and repeat; a large
        gang stage that fails at once wastes the GPUs it waited for. A stage is checked if it asks for
        it (`early_check_s` > 0), or if the QoS policy block's `early_check_s` is set and the stage needs
        at least `early_check_min_gpus` GPUs, as long as its signature has no successful run yet -- or its
        last run failed with a user error (failures repeat: the code was changed, a new bug is as likely).
        """
        pb = self.policy_block
        own = configuration.early_check_s
        if own is not None:
            secs = float(own)
        elif pb is not None and pb.early_check_s and spec.gpus >= pb.early_check_min_gpus:
            secs = float(pb.early_check_s)
        else:
            return 0.0
        if not secs > 0 or spec.gpus < 1:
            return 0.0
        if spec.gpus == 1 and not spec.gang and spec.gpu_milli >= 1000 and own is None:
            return 0.0  # nothing smaller to check on
        sig = job.model
        if sig in self._failed_last:
            return secs
        if sig in self._checked_ok:
            return 0.0
        samples = getattr(self.scheduler.estimator if self.scheduler else None, "samples", None)
        if callable(samples):
            try:
                if samples(job) > 0:
                    return 0.0
            except Exception:
                pass
        return secs

    async def _early_check(self, entry: StageEntry, spec: Any, check_s: float, command: list[str], env: dict[str, str],
                           cwd: str | None, flow_run: "FlowRun", run_logger: Any, base_id: str | None = None) -> dict[str, Any]:
        """Run the stage for `check_s` seconds on one GPU (one rank, a few cores). It fails there: a user
        error, reported without taking the full placement. It runs on: stopped with SIGKILL (its
        Prefect engine cannot mark the run crashed), and the stage is placed for real. It completes
        there: the stage is done."""
        sched = self.scheduler
        assert sched is not None and self._backend is not None
        fid = entry.flow_run_id or entry.job_id
        job = entry.state.job
        small = early_check_spec(spec)
        # the check is this flow run's entry in the QoS queue while it runs (cancelling the run finds it),
        # with its own attempt id on the infrastructure
        cjob = Job(job_id=fid, submit_time=time.time(), qos=small, duration=check_s, model=f"{job.model} (early check)",
                   expected_duration=check_s, meta=dict(job.meta, early_check=True))
        centry = StageEntry(JobState(cjob), f"{entry.name} (early check)", fid, entry.pipeline, None, ready_at=entry.ready_at)
        t0 = time.time()
        check_id = f"{base_id or fid}-check"
        from qosflow.store.leases import SlotTaken

        for tries_left in range(5, -1, -1):
            try:
                grant = await sched.request(centry)
            except StageCancelled:
                return {}
            launch = LaunchSpec(
                stage_id=check_id, command=command, placement=grant.placement, cluster=sched.cluster,
                env={**env, "QOSFLOW_EARLY_CHECK": "1", "QOSFLOW_EARLY_CHECK_SECONDS": f"{check_s:g}"}, cwd=cwd, cpusets=grant.cpusets,
                labels={"prefect.io/flow-run-id": fid, "prefect.io/flow-run-name": str(flow_run.name), "qosflow.io/early-check": "true"},
            )
            info = sched.describe_grant(centry)
            try:
                await self._acquire_lease(fid, launch, small.shareable)
                handle = await self._backend.launch(launch)
                break
            except Exception as exc:
                await self._free(fid, ok=False)  # (no lease if it was refused)
                if isinstance(exc, SlotTaken) and tries_left:
                    # another worker on this pool booked the slot first: learn its leases and plan the check again
                    run_logger.info("stage %s (early check): %s", entry.name, exc)
                    await self._sync_foreign()
                    await asyncio.sleep(0.05)
                    continue
                run_logger.warning("stage %s: early check not run (%s); placing it for real", entry.name, exc)
                return {}
        run_logger.info("stage %s: early check on %s (GPUs %s, %g core%s) for up to %gs before it takes %d GPU(s)",
                        entry.name, info["host"], ",".join(info["gpus"]) or "-", info["cpu_cores"],
                        "" if info["cpu_cores"] == 1 else "s", check_s, spec.gpus)
        await self._lease_handle(fid, handle)
        self._register(fid, handle)
        out: dict[str, Any] = {"launched": True, "infra_id": _infra_id(handle, fid)}
        waiter = asyncio.ensure_future(self._backend.wait(handle))
        passed = False

        async def stop_check(why: str) -> None:
            try:
                await self._backend.kill(handle, why, grace=0.0)
            except Exception as exc:  # its slot stays held until it ends: freed now, a stage could join a running check
                run_logger.warning("stage %s: could not stop its early check (%s); waiting for it to end", entry.name, exc)

        try:
            # the clock starts when the stage's own code does: its Prefect engine sets the flow run Running
            # right before it calls the stage (engine start-up takes seconds and proves nothing)
            startup_until = time.monotonic() + 600.0
            while not waiter.done() and time.monotonic() < startup_until and _type(await self._state(flow_run.id)) not in ("RUNNING", None):
                await asyncio.wait({waiter}, timeout=0.25)
            status = await asyncio.wait_for(asyncio.shield(waiter), check_s)
        except asyncio.TimeoutError:
            # still running after the check time, unless its engine is only reporting how it ended
            if await self._final(flow_run.id):
                try:
                    status = await asyncio.wait_for(asyncio.shield(waiter), 60.0)
                except asyncio.TimeoutError:
                    await stop_check("early check: the stage ended, its process did not")
                    status = await waiter
            else:
                await stop_check("early check passed: placing the stage for real")
                status = await waiter
                passed = True
        finally:
            self._unregister(fid)
            await self._free(fid, ok=True)
            self._backend.drop_progress(check_id)
        took = time.time() - t0
        rec = {"flow_run_id": fid, "stage": entry.name, "host": info["host"], "seconds": round(took, 3), "check_s": check_s}
        if status.kind not in (ExitKind.INFRA, ExitKind.CANCELLED) or passed:
            # the outcome is what the stage's engine reported (its process exits 0 after a failed run too);
            # a check stopped just after the stage ended counts as that end
            state = await self._state(flow_run.id)
            kind = _type(state)
            if kind == "COMPLETED":
                passed, status = False, ExitStatus(ExitKind.OK, 0, "")
            elif kind in ("CANCELLED", "CANCELLING"):
                passed, status = False, ExitStatus(ExitKind.CANCELLED, status.code, "cancelled during its early check")
            elif kind in ("FAILED", "CRASHED"):
                passed, status = False, ExitStatus(ExitKind.USER, status.code, state.message or kind.lower())
            elif not passed and status.ok:
                status = ExitStatus(ExitKind.INFRA, status.code, "the stage's process ended without its flow run ending")
        if passed or status.ok:  # (a local check's output file: kept for a failure only)
            _done_with_output(handle.ref.get("output"), remove=True)
        if passed:
            self._checked_ok.add(job.model)
            rec["verdict"] = "passed"
            _keep(self.early_checks, rec)
            run_logger.info("stage %s: early check passed (still running after %gs); stopped it, placing the stage for real",
                            entry.name, check_s)
            self._event("qosflow.stage.early_check", entry, {"stage": entry.name, "verdict": "passed", "seconds": round(took, 3)})
            return out
        if status.kind is ExitKind.CANCELLED:
            rec["verdict"] = "cancelled"
            _keep(self.early_checks, rec)
            run_logger.info("stage %s was cancelled during its early check", entry.name)
            out["result"] = QosflowWorkerResult(status_code=0, identifier=out["infra_id"])
            return out
        if status.kind is ExitKind.INFRA:
            rec["verdict"] = "inconclusive"
            _keep(self.early_checks, rec)
            run_logger.warning("stage %s: early check inconclusive (%s); placing the stage for real",
                               entry.name, status.reason)
            return out
        rec["verdict"] = "completed" if status.ok else "failed"
        rec["exit_reason"] = status.reason
        _keep(self.early_checks, rec)
        self._event("qosflow.stage.early_check", entry, {"stage": entry.name, "verdict": rec["verdict"], "seconds": round(took, 3),
                                                         "reason": status.reason})
        if status.ok:
            self._checked_ok.add(job.model)
            run_logger.info("stage %s finished within its early check (%.1fs on one GPU)", entry.name, took)
            out["result"] = QosflowWorkerResult(status_code=0, identifier=out["infra_id"])
            return out
        run_logger.error("stage %s failed its early check after %.1fs on one GPU (%s): a user error, so it does not take its "
                         "%d GPUs; fix the stage and run it again", entry.name, took, status.reason, spec.gpus)
        code = _code(status)
        if await self._report_final(flow_run.id, status, 1):
            code = 0
        out["result"] = QosflowWorkerResult(status_code=code, identifier=out["infra_id"])
        return out

    async def _runs_by_id(self, ids: list[str]) -> list[Any]:
        """The flow runs of `ids`, read `RUNS_PAGE` ids at a time. The server answers a filter with at most its
        default limit (200) of runs, and refuses a larger `limit`: with more stages queued or running than that, the
        cancellation watch saw only the first 200 (a cancelled stage beyond them was never stopped), and the check of
        the pipelines' ends failed as a whole (422) at every heartbeat."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        out: list[Any] = []
        for i in range(0, len(ids), RUNS_PAGE):
            part = list(ids[i:i + RUNS_PAGE])
            out.extend(await self.client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=part)), limit=len(part)))
        return out

    async def _attempt_base(self, flow_run: "FlowRun") -> str:
        """The id of a stage run's first attempt in this pickup (its others add `-r1`, `-r2`, ...; its early check
        `-check`): its flow run id the first time a worker takes the run, `<id>-p<k>` the k-th time after that (a run
        put back in the queue: recovery, a worker stopped or killed). An agent keeps the record of an ended stage,
        and a Kubernetes Job stays, under its attempt id: a launch under an id used before was answered with that
        earlier attempt's end (409: "adopt it, never start it twice"), so the stage did not run and its run got the
        old exit status (e.g. its process killed while no worker ran: one more infrastructure failure, or an early
        check that had passed reported as cancelled). k counts the run's Pending states (one per pickup, this one's
        included), read only when the run may have been taken before: it ran, or its state is not a plain
        `Scheduled` (AwaitingRetry, Late). If they cannot be read, a random suffix keeps the id new."""
        fid = str(flow_run.id)
        st = getattr(flow_run, "state", None)
        if not getattr(flow_run, "run_count", 0) and (st is None or st.name == "Scheduled"):
            return fid
        try:
            states = await self.client.read_flow_run_states(flow_run.id)
            k = sum(1 for x in states if x.type.value == "PENDING") - 1
        except Exception as exc:  # noqa: BLE001 - cannot count: an id no launch used
            import uuid

            self._logger.warning("stage %s: its state history could not be read (%s): attempt ids get a random suffix", fid, exc)
            return f"{fid}-p{uuid.uuid4().hex[:8]}"
        return fid if k <= 0 else f"{fid}-p{k}"

    async def _flow_run(self, flow_run_id: Any) -> Any:
        """The flow run as the server has it now (None if it cannot be read)."""
        try:
            return await self.client.read_flow_run(flow_run_id)
        except Exception:
            return None

    async def _state(self, flow_run_id: Any) -> Any:
        """The flow run's current Prefect state (None if it has none or cannot be read)."""
        fr = await self._flow_run(flow_run_id)
        return None if fr is None else fr.state

    @staticmethod
    def _observe(sched: QoSScheduler, entry: StageEntry, actual: float, where: dict[str, Any] | None = None) -> None:
        """Tell the estimator how long a stage took, and -- when it can learn from it (`observe_stage`)
        -- how many steps it reported and who shared its GPUs (`QoSScheduler.note_sharing`)."""
        est, job = sched.estimator, entry.state.job
        if entry.grant is not None:
            # an elastic start on w of its g GPUs ran at about w / g of its speed: the estimator learns the
            # time it would have taken on all of them (what it predicts is a full-width run)
            actual *= width_fraction(job, entry.grant.placement)
        rec = read_progress(entry.progress_file) if entry.progress_file else None
        steps = int(rec["step"]) if rec and isinstance(rec.get("step"), (int, float)) and rec["step"] >= 1 else None
        resumed = entry.resumed_steps()
        observe_stage = getattr(est, "observe_stage", None)
        if observe_stage is None:
            if hasattr(est, "observe"):
                if resumed:  # a run resumed from a checkpoint: the time a whole run would take at its pace
                    from qosflow.predict.estimator import run_share

                    run = run_share(job, steps, resumed)
                    if run is None:
                        return
                    actual /= run[1]
                est.observe(job, actual)
            return
        partners = entry.meta.get("partners", {})
        known = [j for j in partners.values() if j is not None]
        if len(known) < len(partners):  # a slot held for another worker's stage: who it was is unknown
            steps = None
        extra: dict[str, Any] = {"resumed_from": resumed} if resumed else {}
        if where:
            extra["where"] = where
        if extra and not _takes(observe_stage, *extra):  # an estimator of the user's
            extra = {}
        observe_stage(job, actual, steps=steps, partners=known, ran_alone=bool(entry.meta.get("ran_alone")), **extra)

    def _note_learned(self, sched: QoSScheduler, entry: StageEntry, actual: float) -> None:
        """Keep, per stage, what the UI's predictor table shows: runs, the last duration, the error of the
        predictions the runs were placed on, and the duration the estimator predicts for the next run."""
        est, job = sched.estimator, entry.state.job
        r = self._learned.setdefault(job.model, {"runs": 0, "apes": []})
        r["runs"] += 1
        r["last_s"] = actual
        if entry.grant is not None and entry.grant.predicted_s > 0 and actual > 0 and not entry.resumed:
            # (a run resumed from a checkpoint did part of what its grant predicted: no error to show)
            r["apes"] = (r["apes"] + [abs(entry.grant.predicted_s - actual) / actual])[-50:]
        nxt = dataclasses.replace(job, job_id=f"next:{job.job_id}")
        try:
            predict = getattr(est, "predict_duration", None)
            if predict is not None:
                p = predict(nxt)
                r["predicts_s"], r["basis"] = p.value, p.basis
            else:
                r["predicts_s"] = float(est.duration(nxt))
                r["basis"] = est.basis(nxt) if hasattr(est, "basis") else getattr(est, "name", "")
        finally:
            if hasattr(est, "forget"):
                est.forget(nxt)
        self._learned_run = entry.flow_run_id or entry.job_id  # the version is linked to the stage run that updated it
        if self._learned_task is None or self._learned_task.done():
            self._learned_task = asyncio.get_running_loop().create_task(self._publish_learned(), name="qosflow-predictor-artifact")

    async def _predictor_refresh_loop(self, estimator: Any, interval: float) -> None:
        """Every QOSFLOW_PREDICTOR_REFRESH_SECONDS (default 30; 0: never), learn what the pool's other workers stored
        (`LearnedEstimator.refresh_from_store`: new rows only, read off the event loop; it never raises). Before
        2026-11-28 a worker read the store only when it started, so each worker of a pool learned only its own stages
        and a long-running one planned with less than a restarted one knew."""
        while not self._stopping:
            await asyncio.sleep(interval)
            n = await asyncio.to_thread(estimator.refresh_from_store)
            if n:
                self._logger.debug("predictor: learned %d row(s) other workers stored", n)

    async def _cluster_artifact_loop(self) -> None:
        """The cluster table in the UI (`qosflow-cluster-<pool>`: per host its state -- up, down, draining --, GPUs in
        use and shared, free cores, stages; qosflow.prefect.cluster_table): a new version when it changed, looked
        at every QOSFLOW_CLUSTER_ARTIFACT_SECONDS (30 s)."""
        from prefect.client.schemas.actions import ArtifactCreate

        from qosflow.prefect.cluster_table import cluster_rows
        from qosflow.prefect.tasks import _slug

        last = None
        while True:
            sched = self.scheduler
            if sched is not None:
                rows = cluster_rows(sched.state, draining=self._draining, outage=self.outage is not None)
                if rows != last:
                    try:
                        await self.client.create_artifact(ArtifactCreate(
                            key=f"qosflow-cluster-{_slug(self._work_pool_name)}", type="table", data=json.dumps(rows),
                            description=f"The hosts of work pool {self._work_pool_name!r} as its qosflow worker {self.name} "
                                        f"schedules them ({sched.cluster.name}; policy {sched.policy.name}); `qosflow status` "
                                        "lists the stages"))
                        last = rows
                        self.cluster_artifacts += 1
                    except Exception as exc:  # the UI's table is a view: never let it stop the worker
                        self._logger.debug("could not write the cluster artifact: %s", exc)
            await asyncio.sleep(self.cluster_artifact_s)

    async def _publish_learned(self) -> None:
        """The predictor table artifact (`qosflow-predictor-<pool>`, a new version at most every
        QOSFLOW_PREDICTOR_ARTIFACT_SECONDS): what the worker's estimator learned from the stages it ran."""
        from prefect.client.schemas.actions import ArtifactCreate

        from qosflow.prefect.tasks import _slug

        wait = self._learned_published + self.predictor_artifact_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._learned_published = time.monotonic()
        est = self.scheduler.estimator if self.scheduler is not None else None
        rows = [{"stage": name, "runs": r["runs"], "last (s)": round(r["last_s"], 1),
                 "predicts next (s)": round(r["predicts_s"], 1), "basis": r["basis"],
                 "MAPE of placed predictions": "-" if not r["apes"] else f"{100 * sum(r['apes']) / len(r['apes']):.0f} %"}
                for name, r in sorted(self._learned.items())]
        try:
            await self.client.create_artifact(ArtifactCreate(
                key=f"qosflow-predictor-{_slug(self._work_pool_name)}", type="table", data=json.dumps(rows),
                flow_run_id=self._learned_run,
                description=f"What the qosflow worker's estimator ({getattr(est, 'name', 'estimator')}) learned from the stages it "
                            "ran since it started; the whole store: `qosflow predict stages`"))
        except Exception as exc:  # the UI's table is a view: never let it fail a stage
            self._logger.warning("could not write the predictor artifact: %s", exc)

    #: states of a stage's flow run that only its engine ends: still in one of them after its process
    #: exited 0 (and the grace below), nobody else will (a Paused/Suspended or Cancelling run is left alone)
    UNENDED_STATES = ("RUNNING", "PENDING")

    async def _settle_unreported(self, flow_run_id: Any, name: str, run_logger: Any) -> tuple[float | None, str | None]:
        """After a stage's process exited 0: when its engine reported the flow run's end (epoch seconds)
        and the final state's type (COMPLETED, FAILED...), read at once in the usual case. If the engine
        has not reported it, wait for the report up to QOSFLOW_UNREPORTED_END_GRACE_S (120 s: a report
        may be in Prefect's client retries, 2+4+8+16+32 s, behind a stalled server); if the run is still
        Running (or Pending) then, nobody will end it -- the stage's code left the process itself
        (os._exit(0)), or its engine never reached the server -- and its pipeline would wait for it for
        ever: set it Crashed, saying why, and return (now, "CRASHED"). (None, None) where the server
        cannot say, or the run is in a state not ours to end."""
        from prefect.states import Crashed

        grace = unreported_grace_s()
        end = time.monotonic() + grace
        while True:
            fr = await self._flow_run(flow_run_id)
            if fr is not None and fr.state is not None and fr.state.is_final():
                return (fr.end_time.timestamp() if fr.end_time is not None else None), _type(fr.state)
            if time.monotonic() >= end:
                break
            await asyncio.sleep(min(2.0, max(0.1, end - time.monotonic())))
        state = _type(fr.state) if fr is not None else None
        if state not in self.UNENDED_STATES:  # (unknown: the server cannot say; or paused, cancelling...: not ours)
            return None, None
        msg = (f"qosflow: the process of stage {name} exited with code 0, but its flow run was never reported ended (still "
               f"{state.title()} {grace:g} s later): its code may have ended the process itself (os._exit, sys.exit from "
               "a thread...), or its engine could not reach the Prefect server. Marked Crashed so that its pipeline "
               "does not wait for it for ever (QOSFLOW_UNREPORTED_END_GRACE_S sets the wait)")
        run_logger.error(msg)
        if await self._set_state(flow_run_id, Crashed(message=msg)):
            return time.time(), "CRASHED"
        return None, None

    async def _final(self, flow_run_id: Any) -> bool | None:
        """Has the flow run ended (None: unknown)?"""
        fr = await self._flow_run(flow_run_id)
        if fr is None:
            return None
        return fr.state is not None and fr.state.is_final()

    async def _report_final(self, flow_run_id: Any, status: Any, attempts: int | None) -> bool:
        """Set the Prefect state for a stage that ended badly, unless its engine already did."""
        from qosflow.failures import prefect_state

        if await self._final(flow_run_id) is not False:
            return False
        return await self._set_state(flow_run_id, prefect_state(status, attempt=attempts))

    async def _reschedule(self, flow_run_id: Any, message: str) -> None:
        """Put a stage's flow run back in the queue (Scheduled, AwaitingRetry) unless it already ended."""
        from prefect.states import AwaitingRetry

        if await self._final(flow_run_id) is not False:
            return
        await self._set_state(flow_run_id, AwaitingRetry(message=message))

    async def _set_cpus(self, entry: StageEntry, node: int, cpuset: list[int]) -> None:
        h = self._handles.get(entry.job_id)
        if h is not None and self._backend is not None:
            await self._backend.set_cpus(h, node, cpuset)

    async def _label(self, flow_run_id: Any, info: dict[str, Any], placed_at: float) -> None:
        labels = {
            "qosflow.host": str(info["host"]),
            "qosflow.gpus": ",".join(info["gpus"]) or "-",
            "qosflow.gpu_model": str(info["gpu_model"]),
            "qosflow.gpu_milli": str(info["gpu_milli"]) if info["gpus"] else "0",  # (a CPU-only stage holds no GPU share)
            "qosflow.cpu_cores": f"{info['cpu_cores']:g}",
            "qosflow.cpuset": json.dumps(info["cpuset"]),
            "qosflow.virtual_gpus": str(info["virtual_gpus"]).lower(),
            "qosflow.predicted_s": f"{info['predicted_s']:.3f}",
            "qosflow.waited_s": f"{info['waited_s']:.3f}",
            "qosflow.placed_at": f"{placed_at:.3f}",
            "qosflow.queued_at": f"{info.get('queued_at', placed_at):.3f}",
            "qosflow.class": str(info["priority"]),
            "qosflow.policy": str(info["policy"]),
            "qosflow.estimator": str(info["estimator"]),
        }
        if info.get("deadline_at"):
            labels["qosflow.deadline_at"] = f"{info['deadline_at']:.3f}"
        if info.get("colocated_with"):
            labels["qosflow.colocated_with"] = ",".join(info["colocated_with"])
        if info.get("sub_batch"):
            labels["qosflow.sub_batch"] = json.dumps(info["sub_batch"])
        if info.get("elastic"):  # (written on every attempt of an elastic stage: a rerun may get another width)
            labels["qosflow.elastic"] = info["elastic"]
            labels["qosflow.requested_gpus"] = str(info["requested_gpus"])
            labels["qosflow.grad_accumulation"] = str(info["grad_accumulation"])
        self._labels_written[str(flow_run_id)] = labels
        try:
            await patch_labels(self.client, flow_run_id, labels)
        except Exception as exc:
            self._logger.warning("could not label flow run %s: %s", flow_run_id, exc)

    async def _repair_labels(self, flow_run_id: Any) -> None:
        """Prefect's server merges labels by read-modify-write, so a concurrent merge (the base worker's
        own labels, the engine's trace parent) can drop ours: read them back and write them again if so."""
        labels = self._labels_written.pop(str(flow_run_id), None)
        if not labels:
            return
        try:
            for _ in range(3):
                fr = await self.client.read_flow_run(flow_run_id)
                have = dict(getattr(fr, "labels", None) or {})
                if all(have.get(k) == v for k, v in labels.items()):
                    return
                await patch_labels(self.client, flow_run_id, labels)
        except Exception as exc:
            self._logger.warning("could not check the labels of flow run %s: %s", flow_run_id, exc)

    def _on_scheduler_event(self, name: str, entry: StageEntry, payload: dict[str, Any]) -> None:
        if self.metrics is not None and name == "qosflow.stage.placed" and entry.grant is not None:
            self.metrics.placed(entry, entry.grant.waited_s)
        self._event(name, entry, payload)

    def _event(self, name: str, entry: StageEntry, payload: dict[str, Any]) -> None:
        from prefect.events import emit_event

        if self.metrics is not None:
            self.metrics.event(name)

        related = []
        if entry.job.pipeline:
            related.append({"prefect.resource.id": f"prefect.flow-run.{entry.job.pipeline}", "prefect.resource.role": "pipeline"})
        if self._work_pool is not None:
            related.append(
                {"prefect.resource.id": f"prefect.work-pool.{self._work_pool.id}", "prefect.resource.role": "work-pool", "prefect.resource.name": self._work_pool.name}
            )
        try:
            emit_event(
                event=name,
                # (qosflow.scope: an automation tells a stage's events from its pipeline's)
                resource={"prefect.resource.id": f"prefect.flow-run.{entry.flow_run_id}", "prefect.resource.name": entry.name,
                          "qosflow.scope": "stage"},
                related=related,
                payload=json.loads(json.dumps(payload, default=str)),
            )
        except Exception as exc:
            self._logger.debug("event %s not emitted: %s", name, exc)

    async def _watch_cancellations(self) -> None:
        """Kill (or dequeue) stage runs whose flow run is being cancelled."""
        from prefect.client.schemas.objects import StateType
        from prefect.states import Cancelled

        launching: set[str] = set()  # cancelled while placed but not launched yet (no handle): seen again next round
        kill_failed: set[str] = set()  # cancelled, but their kill failed (said once; tried again each round)
        while True:
            await asyncio.sleep(1.0)
            sched = self.scheduler
            ids = set(self._handles) | (set(sched.entries) if sched else set()) | launching
            ids = {i for i in ids if _is_uuid(i)}  # one id that is not a flow run's would fail the whole query
            if not ids:
                continue
            try:
                runs = await self._runs_by_id(sorted(ids))
            except Exception:
                continue
            listed = {str(fr.id) for fr in runs}
            launching &= listed
            kill_failed &= listed
            for fr in runs:
                if fr.state is None:
                    continue
                fid = str(fr.id)
                if fr.state.type is not StateType.CANCELLING:
                    launching.discard(fid)
                    e = sched.entries.get(fid) if sched is not None else None
                    holder = (fr.labels or {}).get(QUEUED_BY_LABEL)
                    if e is not None and e.state.status is JobStatus.PENDING and fid not in self._handles:
                        # put back in the pool's queue (or ended) while it waited here, or taken by another
                        # worker since: e.g. one that took this worker for dead (`_recover_orphans`); the
                        # run is theirs to start, not this worker's too
                        if fr.state.type is StateType.SCHEDULED or fr.state.is_final():
                            why = f"its flow run is {fr.state.name} now"
                        elif holder and holder != str(self.name) and fid in self._queued_labelled:  # (ours was written: it changed since)
                            why = f"worker {holder} has taken its flow run"
                        else:
                            continue
                        self._logger.warning("stage run %s left this worker's QoS queue: %s", fid, why)
                        sched.drop(fid, why)
                    continue
                h = self._handles.get(fid)
                e = sched.entries.get(fid) if sched is not None else None
                if h is None and e is not None and e.state.status is not JobStatus.PENDING:
                    # placed, its lease and launch under way (or its slot being given back): dropped here, its
                    # slot was freed while its process was still started, and that process, its run marked
                    # Cancelled, was never killed. Its handle is registered by the next round, and killed then
                    launching.add(fid)
                    continue
                launching.discard(fid)
                if h is not None and self._backend_of(fid) is not None:
                    try:
                        await self._backend_of(fid).kill(h, "flow run cancelled")
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        # (an agent or the API server away): the run stays Cancelling and is tried again at
                        # the next round. Raised here, it ended this watch: no cancel was acted on again
                        if fid not in kill_failed:
                            self._logger.warning("stage run %s: could not stop it yet (%s); trying again every second", fid, exc)
                        kill_failed.add(fid)
                        continue
                    kill_failed.discard(fid)
                elif sched is not None:
                    sched.drop(fid, "flow run cancelled")
                if h is not None and h.ref.get("role") == "pipeline":
                    # a pipeline run's Job: deleted, its pod's process gets SIGTERM and its engine reports Crashed a moment
                    # later (having cancelled the stage runs it waited for); marked Cancelled once that is in, not before
                    # (Cancelled first, the engine's Crashed came after it and the run ended Crashed)
                    if fid not in self._pipeline_cancels:
                        self._pipeline_cancels.add(fid)
                        t = asyncio.get_running_loop().create_task(self._mark_pipeline_cancelled(fr.id), name=f"qosflow-cancel-{fid}")
                        self._adopted_tasks.add(t)
                        t.add_done_callback(self._adopted_tasks.discard)
                    continue
                try:
                    what = "stage" if fid in self._stages_in_flight or (sched is not None and fid in sched.entries) else "pipeline run"
                    await self.client.set_flow_run_state(fr.id, Cancelled(message=f"cancelled: the qosflow worker stopped the {what}"), force=True)
                except Exception as exc:
                    self._logger.warning("could not mark %s cancelled: %s", fid, exc)

    async def _mark_pipeline_cancelled(self, flow_run_id: Any, wait_s: float = 40.0) -> None:
        """Mark a cancelled pipeline run's Job's run Cancelled once its engine, stopped by SIGTERM, reported its end (or
        after `wait_s`: a pod's grace period, 30 s by default, then SIGKILL, and nothing is reported)."""
        from prefect.client.schemas.objects import StateType
        from prefect.states import Cancelled

        try:
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                fr = await self._flow_run(flow_run_id)
                if fr is None or fr.state is None or fr.state.type is not StateType.CANCELLING:
                    break
                await asyncio.sleep(0.5)
            how = ("its Kubernetes Job was deleted" if self._backend is not None and self._backend.name == "kubernetes" else
                   "its process was stopped through its host's agent")
            await self._set_state(flow_run_id, Cancelled(message=f"cancelled: the qosflow worker stopped the pipeline run ({how})"))
        finally:
            self._pipeline_cancels.discard(str(flow_run_id))

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: QosflowJobConfiguration, grace_seconds: int = 30) -> None:
        fid = self._pids.get(str(infrastructure_pid))
        if fid is not None and fid in self._handles and self._backend_of(fid) is not None:
            await self._backend_of(fid).kill(self._handles[fid], "killed on request")
            return
        from qosflow.backends.local import kill_tree

        try:
            pid = int(str(infrastructure_pid).rsplit(":", 1)[-1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError, PermissionError):
            raise InfrastructureNotFound(f"no stage process {infrastructure_pid} on this worker")
        # a pid this worker does not watch (an earlier worker's process, not adopted): only if that process runs this
        # flow run (its environment says so), never another process that got the pid since
        fid = (getattr(configuration, "env", None) or {}).get("PREFECT__FLOW_RUN_ID")
        if fid and not _process_runs_flow(pid, str(fid)):
            raise InfrastructureNotFound(f"process {pid} on this host does not run flow run {fid} (it ended; its pid is another's now)")
        import signal

        kill_tree(pid, signal.SIGTERM)


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _live_holders(store: Any, pool: str) -> set[str]:
    """The holder ids of the worker processes of `pool` whose presence in the lease store is live (a blocking read:
    the Kubernetes backend's capacity requests of a maker not among them are deleted, `Backend.capacity_peers`)."""
    return {r.holder for r in store.live_workers(pool)}


def _unreachable(exc: BaseException) -> bool:
    """Did a backend call fail because its API server cannot be reached (not because of the stage)?"""
    return isinstance(exc, (BackendUnreachable, ConnectionError))


def _span(s: float) -> str:
    """A duration for a log line: '42 s', '7 min 5 s', '2 h 03 min'."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _fatal_setup_error(exc: BaseException) -> bool:
    """Is a setup error one that retrying cannot fix: the cluster or policy block is missing or fails
    validation (a SpecError naming the block's field)? An unreachable server is not: it is retried."""
    from qosflow.errors import SpecError

    return isinstance(exc, SpecError) and exc.field in ("cluster_block", "policy_block")


def _pipeline_where(ref: dict | None, lease: Any = None, *, short: bool = False) -> str:
    """Where a pipeline run that a backend runs (`_run_pipeline_job`) runs, in words, from its handle's `ref` or its
    lease: 'Kubernetes Job NAME (namespace NS)', or 'process PID on host H (through its agent)'. `short`: 'Job NAME'
    or 'pid PID on H'."""
    ref = ref or ((getattr(lease, "handle", None) or {}).get("ref") or {})
    if ref.get("jobs") is not None or (lease is not None and lease.backend == "kubernetes"):
        job = ",".join(ref.get("jobs") or []) or "?"
        ns = ref.get("namespace") or ((lease.placement or {}).get("namespace", "") if lease is not None else "")
        return f"Job {job}" if short else f"Kubernetes Job {job} (namespace {ns})"
    parts = ref.get("parts") or []
    host = parts[0]["host"] if parts else (lease.nodes[0] if lease is not None and lease.nodes else "?")
    pid = ref.get("pid") or (parts[0].get("pid") if parts else None) or "?"
    return f"pid {pid} on {host}" if short else f"process {pid} on host {host} (through its agent)"


def _infra_id(handle: StageHandle, fid: str) -> str:
    """The infrastructure id Prefect keeps for a stage run: the pid (local), else the flow run id."""
    pid = handle.ref.get("pid")
    return str(pid) if pid is not None else f"qosflow:{fid}"


def _process_runs_flow(pid: int, flow_run_id: str) -> bool:
    """Does process `pid` still run flow run `flow_run_id` (its environment says so)? Guards against pid reuse."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in env


def _sessions_running_flow(flow_run_id: str) -> list[int]:
    """The session leaders of this host (a local stage's process: `start_new_session`) whose environment names flow run
    `flow_run_id`, this process aside."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for e in entries:
        if not e.isdigit() or int(e) == os.getpid():
            continue
        try:
            if os.getsid(int(e)) != int(e):
                continue
        except OSError:
            continue
        if _process_runs_flow(int(e), flow_run_id):
            out.append(int(e))
    return out


def _placement_from_lease(lease: Any, cluster: ClusterSpec, job_id: str):
    """(Placement, QoSSpec, cores by node index) of a lease's placement JSON in `cluster`, or None."""
    return _placement_from_json(lease.placement or {}, cluster, job_id)


def _placement_from_json(pl: dict, cluster: ClusterSpec, job_id: str):
    """(Placement, QoSSpec, cores by node index) of a placement as a lease stores it (`gpus`, `cpu`, `cpusets`,
    ... by node name) in `cluster`, or None if it does not fit it."""
    from qosflow.core.placement import Placement
    from qosflow.core.qos import QoSSpec

    idx = {n.name: i for i, n in enumerate(cluster.nodes)}
    try:
        gpus = tuple((idx[n], int(g)) for n, g in pl.get("gpus", []))
        cpu = tuple((idx[n], float(c)) for n, c in pl.get("cpu", []))
        cores = {idx[n]: [int(c) for c in ids] for n, ids in (pl.get("cpusets") or {}).items()}
    except (KeyError, TypeError, ValueError):
        return None
    milli = int(pl.get("gpu_milli") or 1000)
    coloc = tuple(pl.get("colocated_with") or ())
    p = Placement(job_id, gpus, cpu, gpu_milli=milli, gpu_mem_mb=float(pl.get("gpu_mem_mb") or 0.0), mem_mb=float(pl.get("mem_mb") or 0.0),
                  colocated_with=coloc)
    try:
        qos = QoSSpec(gpus=len(gpus), gpu_milli=milli if gpus else 1000, cpu_cores=max(sum(c for _, c in cpu), 0.001), shareable=bool(coloc))
    except Exception:
        return None
    return p, qos, cores


async def load_cluster_block(name: str):
    """A cluster block by name: `slug/name`, else a bare-metal cluster block, else a Kubernetes one."""
    from prefect.blocks.core import Block

    from qosflow.errors import SpecError
    from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster

    if "/" in name:
        slug, doc = name.split("/", 1)
        for cls in (BareMetalGPUCluster, KubernetesGPUCluster):
            if cls.get_block_type_slug() == slug:
                return await aload_block(cls, doc, "cluster_block")
        return await Block.aload(name)
    errors = []
    for cls in (BareMetalGPUCluster, KubernetesGPUCluster):
        try:
            return await aload_block(cls, name, "cluster_block")
        except SpecError:
            raise  # the block exists but is invalid
        except ValueError as exc:  # no such block document of this type (an unreachable server is raised as is)
            errors.append(f"{cls.get_block_type_slug()}: {exc}")
    raise SpecError("cluster_block", f"no cluster block named {name!r} ({'; '.join(errors)}); `prefect block ls` lists them")


async def aload_block(cls: Any, name: str, field_name: str) -> Any:
    """`cls.aload(name)`; a saved document that fails validation (edited in the UI or through the API)
    is a SpecError naming the block and each bad field, not Prefect's 'try validate=False'."""
    from pydantic import ValidationError

    from qosflow.errors import SpecError

    try:
        return await cls.aload(name)
    except RuntimeError as exc:  # Prefect: "Unable to load ... due to failed validation", from the ValidationError
        if "failed validation" not in str(exc):
            raise
        verr = exc.__cause__
    if isinstance(verr, ValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'block'}: {e['msg']}" for e in verr.errors())
    else:
        problems = "it failed validation"
    raise SpecError(field_name, f"block {cls.get_block_type_slug()}/{name} is invalid: {problems}; fix it in the Prefect UI "
                                "(Blocks) or save it again") from None


def _fingerprint(desc: Any) -> str:
    """A digest of a cluster block's or cluster file's content, secrets included: equal digests, no edit."""
    import hashlib

    from pydantic import SecretStr

    def plain(v: Any) -> Any:
        if isinstance(v, SecretStr):
            return v.get_secret_value()
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items() if not str(k).startswith("_")}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    if dataclasses.is_dataclass(desc):  # a cluster file (`ClusterFile`)
        data = {f.name: plain(dataclasses.asdict(desc)[f.name]) for f in dataclasses.fields(desc) if f.name != "path"}
    else:  # a block
        data = plain({k: getattr(desc, k) for k in type(desc).model_fields})
    data["_kind"] = type(desc).__name__
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


_NODE_FIELDS = ("gpus", "gpu_mem_mb", "cpu_cores", "mem_mb", "gpu_model", "virtual", "switch", "address")


def _same_node(a: Any, b: Any) -> bool:
    """Two NodeSpecs alike in everything the scheduler and the backend read (labels too, which NodeSpec's == skips)."""
    return a == b and a.labels == b.labels


def _node_change(old: Any, new: Any) -> str:
    """What changed between two NodeSpecs of one host, in words: 'GPUs 4 -> 8, cores 8 -> 16'."""
    said = {"gpus": "GPUs", "gpu_mem_mb": "GPU memory (MiB)", "cpu_cores": "cores", "mem_mb": "memory (MiB)", "gpu_model": "GPU model",
            "virtual": "virtual GPUs", "switch": "switch", "address": "address"}
    def text(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    out = [f"{said[f]} {text(getattr(old, f))} -> {text(getattr(new, f))}" for f in _NODE_FIELDS if getattr(old, f) != getattr(new, f)]
    if old.labels != new.labels:
        out.append("labels")
    return ", ".join(out) or "nothing the scheduler reads"


def _why_not_resized(old: Any, new: Any, state: Any, i: int) -> str | None:
    """Why node `i` of `state`, with stages on it, cannot become `new` now (None if it can): fewer GPUs or other GPU
    memory than the stages there were placed with, fewer cores or less memory than it has free."""
    if new.gpus < old.gpus and state.njobs[i, new.gpus:old.gpus].any():
        return f"GPUs {new.gpus}..{old.gpus - 1} that go away are in use"
    if new.gpu_mem_mb != old.gpu_mem_mb and state.njobs[i].any():
        return "its GPUs' memory is in use"
    if old.cpu_cores - new.cpu_cores > state.cpu_free[i] + 1e-9:
        return f"only {state.cpu_free[i]:g} of its cores are free"
    if old.mem_mb - new.mem_mb > state.mem_free[i] + 1e-6:
        return f"only {state.mem_free[i]:g} MiB of its memory is free"
    return None


def _moved_state(old: Any, spec: ClusterSpec, where: dict[int, int], move: Any) -> Any:
    """The allocation state `old` on cluster `spec`: node i of old is node where[i] of spec (a node of old not in
    `where` holds nothing; a node of spec not in its values is empty), each placement becomes move(placement).
    A node whose size changed keeps its stages (`_why_not_resized` said they fit): its free cores and memory
    change by the difference, GPUs it gained are empty, GPUs it lost were."""
    from qosflow.core.cluster import ClusterState

    new = ClusterState(spec)
    for i, j in where.items():
        a, b = old.spec.nodes[i], spec.nodes[j]
        g = min(a.gpus, b.gpus)
        for name in ("milli_free", "njobs", "whole", "share_ok"):
            getattr(new, name)[j, :g] = getattr(old, name)[i, :g]
        new.gmem_free[j, :g] = np.where(old.njobs[i, :g] > 0, old.gmem_free[i, :g], new.gmem_cap[j])
        new.cpu_free[j] = old.cpu_free[i] + (b.cpu_cores - a.cpu_cores)
        new.mem_free[j] = old.mem_free[i] + (b.mem_mb - a.mem_mb)
        new.down[j] = old.down[i]
        new.empty[j] = int((new.exists[j] & (new.njobs[j] == 0)).sum())
    new.n_empty = int(new.empty[~new.down].sum())
    new.allocs = {jid: move(p) for jid, p in old.allocs.items()}
    new.gpu_jobs = {(where[n], g): jobs for (n, g), jobs in old.gpu_jobs.items() if n in where}
    new._shareable = dict(old._shareable)
    return new


#: entries kept in each of the worker's histories (records, early_checks, node_events, outages, recovered):
#: the newest; each grew by one per stage or event for the worker's whole life (soak run: ~1 KB a stage)
HISTORY_KEPT = 1000


def _keep(history: list, item: Any) -> None:
    """Append `item` to one of the worker's histories, dropping the oldest beyond HISTORY_KEPT."""
    history.append(item)
    del history[:-HISTORY_KEPT]


#: the types of a run's state before its engine reports it Running (Pending: taken by a worker; Scheduled: a retry's
#: AwaitingRetry; Paused): a gang's rank 0 may yet start and wait for its other ranks' end labels (`_write_rank_end`)
NOT_YET_RUNNING = ("PENDING", "SCHEDULED", "PAUSED")


def _type(state: Any) -> str | None:
    """A Prefect state's type name ("RUNNING", "COMPLETED", ...), None for no state."""
    return state.type.value if state is not None else None


def _is_uuid(x: Any) -> bool:
    import uuid

    try:
        uuid.UUID(str(x))
    except ValueError:
        return False
    return True


def gpus_said(info: dict[str, Any]) -> str:
    """The GPUs of a grant (`describe_grant`) as the worker's `placed ...` line says them: 'GPUs 0,1 a100 virtual',
    or 'no GPU' for a CPU-only stage (it said 'GPUs - virtual', as the stage's own log did before 0264612)."""
    if not info["gpus"]:
        return "no GPU"
    return "GPUs %s%s%s" % (",".join(info["gpus"]), "" if info["gpu_model"] in ("generic", "cpu") else f" {info['gpu_model']}",
                            " virtual" if info["virtual_gpus"] else "")


def _code(status: Any) -> int:
    if status.kind is ExitKind.OK or status.kind is ExitKind.CANCELLED:
        return 0
    return int(status.code) if status.code not in (None, 0) else 1


def _gang_ranks_watched(handle: StageHandle) -> bool:
    """Is `handle` a gang on several hosts whose ranks > 0 the worker can look at (`_ranks_ended`)? Host agents: parts
    that know their rank (set at the launch, or from the lease's hosts when a restarted worker adopted the gang);
    Kubernetes: pods of a stage with more than one pod (each says its rank). A local stage is one process (rank 0 of a
    gang runs alone there, with no rank to wait for)."""
    if handle.ref.get("role") == "pipeline" or handle.ref.get("gang_labels") is False:
        return False
    if handle.backend == "agent":
        parts = handle.ref.get("parts") or []
        return len(parts) > 1 and all(isinstance(p.get("rank"), int) for p in parts)
    if handle.backend == "kubernetes":
        return int(handle.ref.get("expected_pods") or 0) > 1 and bool(handle.ref.get("selector"))
    return False


def _rank_parts(handle: StageHandle, hosts: list[str]) -> None:
    """The parts of a gang adopted from host agents (`AgentBackend.adopt`: one per host that answered, in no rank)
    get their rank: their host's place in `hosts`, the lease's, in the placement's order as at the launch."""
    if handle.backend != "agent" or len(hosts) < 2:
        return
    for part in handle.ref.get("parts") or []:
        if "rank" not in part and hosts.count(part.get("host")) == 1:
            part["rank"] = hosts.index(part["host"])


#: the module a gang's ranks run instead of Prefect's engine (`gang_command`)
GANG_RANK_MODULE = "qosflow.prefect.gang_rank"


def gang_command(command: list[str], placement: Any) -> list[str]:
    """The command of a stage placed on several hosts (a gang: one process per host, each with its QOSFLOW_GANG_RANK):
    Prefect's engine (`-m prefect.engine`) becomes `-m qosflow.prefect.gang_rank`, which runs the engine on rank 0 only
    and the stage's function, unreported, on the others (each rank ran the engine: the flow run went Running and
    Completed once per rank, with a result and a log line per rank). A command of one host, or one that does not run
    Prefect's engine that way, is left as it is."""
    if len(set(getattr(placement, "nodes", ()) or ())) < 2:
        return command
    out = list(command)
    for i in range(len(out) - 1):
        if out[i] == "-m" and out[i + 1] == "prefect.engine":
            out[i + 1] = GANG_RANK_MODULE
            break
    return out


def _whole_gpus_only(spec: QoSSpec, backend: Any) -> tuple[QoSSpec, str]:
    """`spec` as the backend can run it: where GPUs cannot be shared (a Kubernetes cluster block with
    sharing "none": every pod gets whole devices) a fractional or shareable stage gets whole GPUs of its
    own, and why, for its log; otherwise `spec` unchanged and ""."""
    if getattr(backend, "shares_gpus", True) or spec.gpus == 0 or not (spec.fractional or spec.shareable):
        return spec, ""
    was = f"{spec.gpu_milli}/1000 of a GPU" if spec.fractional else "a shareable GPU"
    return spec.with_(gpu_milli=1000, shareable=False), (
        f"asked for {was}, but this cluster does not share GPUs (its block's sharing is 'none': the NVIDIA device "
        "plugin gives each pod whole devices), so it runs on a whole GPU of its own; set sharing='time-slicing' "
        "or 'mps' on the cluster block where the device plugin is configured for it")


def _at_least_a_slice(spec: QoSSpec, backend: Any, cluster: Any) -> tuple[QoSSpec, str]:
    """`spec` booked at no less than the least part of a GPU a shared stage takes on this backend
    (`Backend.least_share_milli`: on Kubernetes with time-slicing or MPS, one slice of the device plugin's shared
    resource, 1/replicas of a GPU), and why, for its log; otherwise `spec` unchanged and ""."""
    if backend is None or cluster is None or spec.gpus == 0 or not spec.fractional:
        return spec, ""
    least = int(backend.least_share_milli(cluster) or 0)
    if spec.gpu_milli >= least:
        return spec, ""
    return spec.with_(gpu_milli=least, extra={**spec.extra, "asked_gpu_milli": spec.gpu_milli}), (
        f"asked for {spec.gpu_milli}/1000 of a GPU; its pod gets one slice of the shared GPU resource, up to {least}/1000 of "
        "a GPU here (the nodes' nvidia.com/gpu.replicas), and the plan books it as one slice of the node it lands on, as "
        "Kubernetes counts it")


#: the budget a stage whose deadline has passed already is given: the policy sees a deadline it cannot meet (the
#: `qosflow` policy's admission demotes it to best effort, with a note), not no deadline
PAST_DEADLINE_BUDGET_S = 1e-3


def _with_pipeline_deadline(spec: QoSSpec, deadline_at: float | None, now: float) -> QoSSpec:
    """`spec` with the deadline the policy orders and admits the stage by: its stage deadline `deadline_at` (absolute:
    its share of its pipeline's deadline along the critical path, or its own `@qos_task(deadline=)`, whichever is
    earlier, `tasks.py`), as a budget from `now`, when that is earlier than its own. Before 2026-11-28 a pipeline's
    deadline reached only the stage's at-risk and violated events and its record: the policy saw a stage with no
    deadline of its own as best effort and ordered it after every deadline stage, however near its pipeline's end."""
    if deadline_at is None or not math.isfinite(deadline_at):
        return spec
    budget = max(deadline_at - now, PAST_DEADLINE_BUDGET_S)
    if spec.deadline is not None and spec.deadline <= budget:
        return spec
    return spec.with_(deadline=budget)


def _ready_time(flow_run: Any, now: float) -> float:
    """When the stage became ready: its flow run's creation (the pipeline dispatched it then)."""
    created = getattr(flow_run, "created", None)
    try:
        t = created.timestamp() if created is not None else now
    except Exception:
        t = now
    return min(t, now)


def _takes(fn: Any, *names: str) -> bool:
    """Does `fn` accept these keyword arguments (or any, through **kwargs)?"""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names) or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

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
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

import anyio
import anyio.abc
from prefect.exceptions import InfrastructureNotFound
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import Field

from qosflow.backends.base import Backend, ExitKind, LaunchSpec, StageHandle
from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job, JobState
from qosflow.prefect.scheduler import QoSScheduler, StageCancelled, StageEntry, make_live_estimator
from qosflow.prefect.spec import QOS_FIELDS, spec_from_job_variables

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

STAGE_DEFAULT_DURATION = 60.0


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
    gpus: Optional[int] = Field(default=None, description="Whole GPUs (0: CPU-only stage).")
    gpu_milli: Optional[int] = Field(default=None, description="Thousandths of one GPU when sharing (needs gpus=1).")
    gpu_mem_mb: Optional[float] = Field(default=None, description="GPU memory per GPU (MiB).")
    cpu_cores: Optional[float] = Field(default=None, description="CPU cores.")
    mem_mb: Optional[float] = Field(default=None, description="Host memory (MiB).")
    deadline: Optional[float] = Field(default=None, description="Deadline, seconds after submission.")
    deadline_at: Optional[float] = Field(default=None, description="Absolute stage deadline (epoch seconds), from the pipeline split.")
    latency_slo: Optional[float] = Field(default=None, description="Per-step latency SLO (seconds).")
    min_throughput: Optional[float] = Field(default=None, description="Minimum steps per second.")
    priority: Optional[str] = Field(default=None, description="critical, guaranteed, normal or best-effort.")
    shareable: Optional[bool] = Field(default=None, description="May share its GPUs with one other stage.")
    gang: Optional[bool] = Field(default=None, description="All GPUs at once (default true).")
    gpu_model: Optional[str] = Field(default=None, description="Required GPU model.")
    expected_duration: Optional[float] = Field(default=None, description="Declared expected duration (seconds).")
    batch_size: Optional[int] = Field(default=None, description="Global batch size (for sub-batch plans).")
    qos_policy: Optional[dict[str, Any]] = Field(
        default=None,
        description="A QoS policy block by reference, e.g. {{ prefect.blocks.qosflow-qos-policy.nightly }}: "
        "a pipeline run gets its deadline and priority from it.",
    )
    cluster_block: Optional[str] = Field(
        default=None, description="Name of the qosflow-bare-metal-cluster block the worker plans on (pool-level)."
    )
    policy_block: Optional[str] = Field(default=None, description="Name of the qosflow-qos-policy block the worker uses (pool-level).")
    working_dir: Optional[Path] = Field(default=None, description="Working directory of stage processes.")
    stream_output: bool = Field(default=True, description="Stream stage output to the worker's stdout.")


class QosflowJobConfiguration(BaseJobConfiguration):
    role: Literal["auto", "stage", "pipeline"] = Field(default="auto")
    stage_name: Optional[str] = Field(default=None)
    pipeline: Optional[str] = Field(default=None)
    pipeline_run_id: Optional[str] = Field(default=None)
    signature: Optional[str] = Field(default=None)
    gpus: Optional[int] = Field(default=None)
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
    qos_policy: Optional[dict[str, Any]] = Field(default=None)
    cluster_block: Optional[str] = Field(default=None)
    policy_block: Optional[str] = Field(default=None)
    working_dir: Optional[Path] = Field(default=None)
    stream_output: bool = Field(default=True)

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None) -> None:
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        if self.command in (None, "", "prefect flow-run execute"):
            self.command = shlex.join([sys.executable, "-m", "prefect.engine"])
        if self.qos_policy:
            self.env["QOSFLOW_QOS_POLICY"] = json.dumps({k: v for k, v in self.qos_policy.items() if not k.startswith("_")}, default=str)

    @property
    def is_stage(self) -> bool:
        if self.role == "stage":
            return True
        if self.role == "pipeline":
            return False
        return any(getattr(self, k) is not None for k in QOS_FIELDS)


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
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._cluster_arg = cluster
        self._policy_arg = policy
        self._estimator_arg = estimator
        self._backend: Backend | None = backend
        self._coda_arg = coda
        self._round_arg = round_interval
        self.scheduler: QoSScheduler | None = None
        self.records: list[dict[str, Any]] = []  # one per finished stage (benchmarks, tests)
        self._handles: dict[str, StageHandle] = {}
        self._pids: dict[str, str] = {}  # pid -> job id
        self._cancel_task: asyncio.Task | None = None
        self._qos_setup_lock = asyncio.Lock()
        self.inventory_note = ""
        self.policy_block: Any = None

    # ------------------------------------------------------------------ setup
    def _pool_default(self, name: str) -> Any:
        try:
            props = self.work_pool.base_job_template["variables"]["properties"]
            return props.get(name, {}).get("default")
        except Exception:
            return None

    async def _ensure_qos(self) -> QoSScheduler:
        """Build the backend, the cluster and the scheduler once (after the worker synced its pool)."""
        async with self._qos_setup_lock:
            if self.scheduler is not None:
                return self.scheduler
            from qosflow.backends.local import LocalBackend
            from qosflow.paths import data_dir
            from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy

            cluster = self._cluster_arg
            cluster_block = os.environ.get("QOSFLOW_CLUSTER_BLOCK") or self._pool_default("cluster_block")
            if cluster is None and cluster_block:
                blk = await BareMetalGPUCluster.aload(cluster_block)
                cluster = blk.to_cluster_spec()
            policy_block = os.environ.get("QOSFLOW_POLICY_BLOCK") or self._pool_default("policy_block")
            pb = QoSPolicy()
            if policy_block:
                pb = await QoSPolicy.aload(policy_block)
            self.policy_block = pb
            policy = self._policy_arg
            if policy is None:
                policy = pb.make_policy()
            elif isinstance(policy, str):
                from qosflow.policies import get_policy

                policy = get_policy(policy)
            estimator = self._estimator_arg
            if estimator is None or isinstance(estimator, str):
                estimator = make_live_estimator(
                    estimator or pb.estimator, history_path=str(data_dir() / "prefect" / "stage-history.json")
                )
            if self._backend is None:
                self._backend = LocalBackend(cluster)
            spec = await self._backend.inventory()
            self.inventory_note = getattr(self._backend, "inventory_note", "")
            self.scheduler = QoSScheduler(
                spec,
                policy,
                estimator,
                round_interval=self._round_arg or pb.round_interval_s,
                coda=pb.coda_feedback if self._coda_arg is None else self._coda_arg,
                on_event=self._on_scheduler_event,
                set_cpus=self._set_cpus,
            )
            self.scheduler.start()
            self._cancel_task = asyncio.get_running_loop().create_task(self._watch_cancellations(), name="qosflow-cancel-watch")
            virt = any(n.virtual for n in spec.nodes)
            self._logger.info(
                "qosflow worker: cluster %s (%d hosts, %d GPUs%s), policy %s, estimator %s. %s",
                spec.name,
                len(spec.nodes),
                spec.num_gpus,
                ", virtual GPUs" if virt else "",
                policy.name,
                getattr(estimator, "name", type(estimator).__name__),
                self.inventory_note,
            )
            return self.scheduler

    async def setup(self) -> None:
        await super().setup()
        self._poll_task = asyncio.get_running_loop().create_task(self._fast_poll(), name="qosflow-fast-poll")

    async def _fast_poll(self) -> None:
        """Look for new stage runs every QOSFLOW_WORKER_POLL_SECONDS (default 0.5 s), besides Prefect's own
        (slower) polling loop, so that a ready stage reaches the QoS queue within a second."""
        interval = float(os.environ.get("QOSFLOW_WORKER_POLL_SECONDS", "0.5"))
        while True:
            await asyncio.sleep(interval)
            if self._work_pool is None or self._runs_task_group is None:
                continue
            try:
                await self.get_and_submit_flow_runs()
            except Exception as exc:
                self._logger.debug("fast poll failed: %s", exc)

    async def teardown(self, *exc_info: Any) -> None:
        if getattr(self, "_poll_task", None) is not None:
            self._poll_task.cancel()
        if self._cancel_task is not None:
            self._cancel_task.cancel()
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self._backend is not None:
            await self._backend.aclose()
        await super().teardown(*exc_info)

    # ------------------------------------------------------------------ run
    async def run(
        self,
        flow_run: "FlowRun",
        configuration: QosflowJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[int]] = None,
    ) -> QosflowWorkerResult:
        if task_status is None:
            task_status = anyio.TASK_STATUS_IGNORED
        sched = await self._ensure_qos()
        assert self._backend is not None
        command = shlex.split(configuration.command or f"{sys.executable} -m prefect.engine")
        env = {k: v for k, v in configuration.env.items() if v is not None}
        cwd = str(configuration.working_dir) if configuration.working_dir else None
        run_logger = self.get_flow_run_logger(flow_run)
        fid = str(flow_run.id)

        if not configuration.is_stage:
            if hasattr(self._backend, "stream_output"):
                self._backend.stream_output = configuration.stream_output
            handle = await self._backend.launch_unplaced(fid, command, env, cwd) if hasattr(self._backend, "launch_unplaced") else None
            if handle is None:
                raise RuntimeError(f"backend {self._backend.name} cannot start an unplaced pipeline run")
            self._register(fid, handle)
            task_status.started(handle.ref.get("pid"))
            status = await self._backend.wait(handle)
            self._unregister(fid)
            return QosflowWorkerResult(status_code=_code(status), identifier=str(handle.ref.get("pid")))

        name = configuration.stage_name or flow_run.name
        spec = spec_from_job_variables(configuration, where=f"stage {name!r}")
        expected = configuration.expected_duration
        now = time.time()
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
        try:
            grant = await sched.request(entry)
        except StageCancelled as exc:
            run_logger.info("stage %s left the QoS queue: %s", name, exc)
            task_status.started(-1)
            return QosflowWorkerResult(status_code=0, identifier="-1")
        info = sched.describe_grant(entry)
        run_logger.info(
            "placed %s on %s (GPUs %s%s, %g cores) after %.2fs in the QoS queue; predicted %.1fs (%s)",
            name,
            info["host"],
            ",".join(info["gpus"]) or "-",
            " virtual" if info["virtual_gpus"] else "",
            info["cpu_cores"],
            grant.waited_s,
            grant.predicted_s,
            info["estimator"],
        )
        info["queued_at"] = now
        await self._label(flow_run.id, info, grant.granted_at)
        launch = LaunchSpec(
            stage_id=fid,
            command=command,
            placement=grant.placement,
            cluster=sched.cluster,
            env=env,
            cwd=cwd,
            cpusets=grant.cpusets,
            labels={"prefect.io/flow-run-id": fid},
        )
        if hasattr(self._backend, "stream_output"):
            self._backend.stream_output = configuration.stream_output
        try:
            handle = await self._backend.launch(launch)
        except Exception:
            sched.release(fid, ok=False)
            raise
        self._register(fid, handle)
        progress = self._backend.progress_file(fid) if hasattr(self._backend, "progress_file") else None
        sched.attach(fid, handle, progress)
        task_status.started(handle.ref.get("pid"))
        launched_at = time.time()
        try:
            status = await self._backend.wait(handle)
        finally:
            ended = time.time()
            sched.release(fid, ok=True)
            self._unregister(fid)
        actual = ended - launched_at
        if status.ok and hasattr(sched.estimator, "observe"):
            sched.estimator.observe(job, actual)
        rec = dict(info, flow_run_id=fid, ready=entry.ready_at, queued=now, placed=grant.granted_at, launched=launched_at, ended=ended,
                   actual_s=round(actual, 3), exit=status.kind.value, exit_reason=status.reason)
        rec["deadline_met"] = None if deadline_at is None else ended <= deadline_at
        self.records.append(rec)
        if deadline_at is not None and ended > deadline_at and status.kind is not ExitKind.CANCELLED:
            self._event("qosflow.qos.violated", entry, {"stage": name, "deadline": deadline_at, "ended": ended, "late_by_s": round(ended - deadline_at, 3)})
        if status.kind is ExitKind.INFRA:
            run_logger.warning("stage %s ended by infrastructure: %s", name, status.reason)
        return QosflowWorkerResult(status_code=_code(status), identifier=str(handle.ref.get("pid")))

    # ------------------------------------------------------------------ helpers
    def _register(self, fid: str, handle: StageHandle) -> None:
        self._handles[fid] = handle
        if handle.ref.get("pid") is not None:
            self._pids[str(handle.ref["pid"])] = fid

    def _unregister(self, fid: str) -> None:
        h = self._handles.pop(fid, None)
        if h is not None:
            self._pids.pop(str(h.ref.get("pid")), None)

    async def _set_cpus(self, entry: StageEntry, node: int, cpuset: list[int]) -> None:
        h = self._handles.get(entry.job_id)
        if h is not None and self._backend is not None:
            await self._backend.set_cpus(h, node, cpuset)

    async def _label(self, flow_run_id: Any, info: dict[str, Any], placed_at: float) -> None:
        labels = {
            "qosflow.host": str(info["host"]),
            "qosflow.gpus": ",".join(info["gpus"]) or "-",
            "qosflow.gpu_milli": str(info["gpu_milli"]),
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
        try:
            await self.client.update_flow_run_labels(flow_run_id, labels)
        except Exception as exc:
            self._logger.warning("could not label flow run %s: %s", flow_run_id, exc)

    def _on_scheduler_event(self, name: str, entry: StageEntry, payload: dict[str, Any]) -> None:
        self._event(name, entry, payload)

    def _event(self, name: str, entry: StageEntry, payload: dict[str, Any]) -> None:
        from prefect.events import emit_event

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
                resource={"prefect.resource.id": f"prefect.flow-run.{entry.flow_run_id}", "prefect.resource.name": entry.name},
                related=related,
                payload=json.loads(json.dumps(payload, default=str)),
            )
        except Exception as exc:
            self._logger.debug("event %s not emitted: %s", name, exc)

    async def _watch_cancellations(self) -> None:
        """Kill (or dequeue) stage runs whose flow run is being cancelled."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        from prefect.client.schemas.objects import StateType
        from prefect.states import Cancelled

        while True:
            await asyncio.sleep(1.0)
            sched = self.scheduler
            ids = set(self._handles) | (set(sched.entries) if sched else set())
            if not ids:
                continue
            try:
                runs = await self.client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(ids))))
            except Exception:
                continue
            for fr in runs:
                if fr.state is None or fr.state.type is not StateType.CANCELLING:
                    continue
                fid = str(fr.id)
                h = self._handles.get(fid)
                if h is not None and self._backend is not None:
                    await self._backend.kill(h, "flow run cancelled")
                elif sched is not None:
                    sched.drop(fid, "flow run cancelled")
                try:
                    await self.client.set_flow_run_state(fr.id, Cancelled(message="cancelled: the qosflow worker stopped the stage"), force=True)
                except Exception as exc:
                    self._logger.warning("could not mark %s cancelled: %s", fid, exc)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: QosflowJobConfiguration, grace_seconds: int = 30) -> None:
        fid = self._pids.get(str(infrastructure_pid))
        if fid is not None and fid in self._handles and self._backend is not None:
            await self._backend.kill(self._handles[fid], "killed on request")
            return
        from qosflow.backends.local import kill_tree

        try:
            pid = int(str(infrastructure_pid).rsplit(":", 1)[-1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError, PermissionError):
            raise InfrastructureNotFound(f"no stage process {infrastructure_pid} on this worker")
        import signal

        kill_tree(pid, signal.SIGTERM)


def _code(status: Any) -> int:
    if status.kind is ExitKind.OK or status.kind is ExitKind.CANCELLED:
        return 0
    return int(status.code) if status.code not in (None, 0) else 1


def _ready_time(flow_run: Any, now: float) -> float:
    """When the stage became ready: its flow run's creation (the pipeline dispatched it then)."""
    created = getattr(flow_run, "created", None)
    try:
        t = created.timestamp() if created is not None else now
    except Exception:
        t = now
    return min(t, now)

"""`@qos_task` and `@qos_flow`: pipeline stages that carry a QoS spec.

    @qos_task(gpus=1, cpu_cores=2, expected_duration=30, priority="guaranteed", retries=1)
    def train(X, y): ...

    @qos_flow(deadline=600, pool="gpu")
    def retrain():
        data = load.submit()
        a = train.submit(data)           # independent stages run at the same time,
        b = train_other.submit(data)     # dependent ones wait for their inputs (Prefect futures)
        return evaluate.submit([a, b]).result()

Inside a `qos_flow` with a pool (or with `QOSFLOW_POOL` set), every stage call becomes a run of the
pool's `qosflow-stage` deployment: the worker queues it, places it, and starts it as its own process
with the placement's environment; arguments and results travel through Prefect's result storage.
Without a pool, a stage runs in-process like a plain `@task` (QoS recorded as tags only).

A pipeline deadline is split into stage deadlines along the critical path of the stage DAG (declared
with `plan=`, or recorded from the pipeline's previous run). As stages finish, the pipeline's
completion forecast (with its uncertainty) is updated in a markdown artifact; `qosflow.qos.at-risk`
is emitted when it crosses the deadline, `qosflow.qos.violated` when the deadline is missed. At the
end a table artifact lists every stage (host, GPUs, cores, predicted vs actual, deadline met).
"""

from __future__ import annotations

import collections
import contextvars
import functools
import inspect
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from prefect import Task
from prefect import flow as prefect_flow
from prefect.exceptions import UnfinishedRun

from qosflow.core.qos import DURATION_FORMS, PriorityClass, QoSSpec, to_seconds
from qosflow.errors import QosflowError, SpecError
from qosflow.placement_api import elastic_note
from qosflow.prefect.dag import StageNode, forecast, split_deadline
from qosflow.prefect.labels import label_float, label_int
from qosflow.prefect.spec import (QOS_FIELDS, STAGE_FIELDS, WHO_FIELDS, build_spec, check_stage_args, job_variables, number_hint, qos_tags,
                                  stage_durations, user_from_tags)

#: the QoS spec's fields a stage declares (`@qos_task`, `with_options`): its request and who submits it
_SPEC_ARGS = QOS_FIELDS + WHO_FIELDS

_TASK_PARAMS = set(inspect.signature(Task.__init__).parameters) - {"self", "fn"}
_FLOW_PARAMS = set(inspect.signature(prefect_flow).parameters) - {"__fn"}


class StageFailed(QosflowError, RuntimeError):
    """A dispatched stage's flow run did not complete, and the stage's own exception cannot be raised
    instead: its run crashed or was cancelled, or the exception it raised could not be read back
    (e.g. it does not unpickle in the pipeline's process)."""


class StageCancelled(StageFailed):
    """A dispatched stage's run was cancelled by someone other than its pipeline (`prefect flow-run
    cancel`, the UI): the stage's `retries` do not start it again."""


class StageTimedOut(QosflowError, TimeoutError):
    """A dispatched stage ran past its `timeout_seconds`: its run was cancelled (the worker kills its
    process and frees its slot) and the task attempt failed `TimedOut`, so its `retries` apply."""


# ------------------------------------------------------------------------------------ pipeline runs
@dataclass
class StageRecord:
    name: str
    task_run_id: str | None
    deps: tuple[str, ...]
    expected: float
    spread: float
    dispatched: float
    deadline_at: float | None = None
    flow_run_id: str | None = None
    host: str | None = None
    gpus: list[str] = field(default_factory=list)
    cpu_cores: float | None = None
    virtual_gpus: bool | None = None
    predicted_s: float | None = None
    placed: float | None = None
    started: float | None = None
    ended: float | None = None
    state: str = "dispatched"
    attempts: int = 1
    engine_started: float | None = None
    queued: float | None = None
    #: an elastic start (`min_gpus`): the GPUs the stage asked for, and its gradient accumulation on those it got
    requested_gpus: int | None = None
    grad_accumulation: int | None = None
    #: what the stage raised in the pipeline when its run did not complete
    error: str | None = None

    @property
    def actual_s(self) -> float | None:
        if self.started is None or self.ended is None:
            return None
        return max(0.0, self.ended - self.started)

    @property
    def elastic_note(self) -> str:
        """" (4 of 8, gradient accumulation x2)" after an elastic start on fewer GPUs than asked, else ""."""
        note = elastic_note(self.requested_gpus, self.grad_accumulation, unit="")  # (in the GPUs column)
        return f" ({note})" if note else ""

    @property
    def met(self) -> bool | None:
        if self.deadline_at is None or self.ended is None:
            return None
        return self.ended <= self.deadline_at

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "host": self.host,
            "gpus": self.gpus,
            "requested_gpus": self.requested_gpus,
            "grad_accumulation": self.grad_accumulation,
            "cpu_cores": self.cpu_cores,
            "virtual_gpus": self.virtual_gpus,
            "deps": list(self.deps),
            "ready": self.dispatched,
            "queued": self.queued,
            "placed": self.placed,
            "started": self.started,
            "engine_started": self.engine_started,
            "ended": self.ended,
            "predicted_s": self.predicted_s,
            "actual_s": None if self.actual_s is None else round(self.actual_s, 3),
            "deadline_at": self.deadline_at,
            "deadline_met": self.met,
            "state": self.state,
            "attempts": self.attempts,
            "flow_run_id": self.flow_run_id,
        }


#: the forecast artifact is rewritten at most this often (seconds), except for the final one
FORECAST_MIN_INTERVAL_S = 2.0


#: the pipeline run whose function is running in this context (its subflows inherit it)
_ENCLOSING_PIPELINE: "contextvars.ContextVar[PipelineRun | None]" = contextvars.ContextVar("qosflow_pipeline", default=None)


class PipelineRun:
    """Book-keeping of one running `qos_flow` (its stages, deadline split, forecast, artifacts)."""

    _by_flow_run: dict[str, "PipelineRun"] = {}
    #: in-process history (the demo reads it): the last FINISHED_KEPT runs, not every run of a long-lived
    #: process (a flow server running pipelines nightly kept each run's records for ever)
    FINISHED_KEPT = 1000
    finished: "collections.deque[PipelineRun]" = collections.deque(maxlen=FINISHED_KEPT)
    _lock = threading.Lock()

    def __init__(self, name: str, flow_run_id: str, *, deadline: float | None, priority: PriorityClass | None, pool: str | None, plan: Mapping[str, Sequence[str]] | None, expected: Mapping[str, float],
                 due: float | None = None):
        self.name = name
        self.flow_run_id = flow_run_id
        self.started = time.time()
        self.deadline = deadline
        #: where the deadline counts from: the run's start, or the time a scheduled run was due when it started later
        #: (`deadline_from`: a paused pool, no worker, a deployment's concurrency limit held it)
        self.deadline_from = self.started if due is None else min(self.started, float(due))
        self.deadline_at = None if deadline is None else self.deadline_from + deadline
        self.priority = priority
        self.pool = pool
        self.plan = dict(plan) if plan else None
        self.expected = dict(expected)
        self.stages: dict[str, StageRecord] = {}
        self.by_task_run: dict[str, str] = {}
        self.lock = threading.Lock()
        self.at_risk_sent = False
        self.ended: float | None = None
        self.state = "running"
        self._split: dict[str, float] | None = None
        self.flow_name = name
        self._forecast_written_at = -math.inf

    # -------------------------------------------------------------- registry
    @classmethod
    def current(cls) -> "PipelineRun | None":
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        if ctx is None or ctx.flow_run is None:
            return None
        run = cls._by_flow_run.get(str(ctx.flow_run.id))
        if run is None:
            # a plain @flow (subflow) called by the pipeline's function: its stages are the pipeline's. They
            # went out as no pipeline's ('stage.train': no pipeline deadline or class, not in its record)
            # and, for a pool given as @qos_flow(pool=...), ran in the subflow's process, unplaced
            outer = _ENCLOSING_PIPELINE.get()
            if outer is not None and cls._by_flow_run.get(outer.flow_run_id) is outer:
                run = outer
        return run

    def register(self) -> None:
        with self._lock:
            self._by_flow_run[self.flow_run_id] = self

    def unregister(self) -> None:
        with self._lock:
            self._by_flow_run.pop(self.flow_run_id, None)
            PipelineRun.finished.append(self)

    # -------------------------------------------------------------- deadline split
    def _nodes(self) -> dict[str, StageNode]:
        nodes: dict[str, StageNode] = {}
        if self.plan:
            for n, deps in self.plan.items():
                nodes[n] = StageNode(n, float(self.expected.get(n, 60.0)), tuple(deps))
        for r in self.stages.values():
            base = r.name.split("#", 1)[0]
            if r.name not in nodes and base not in nodes:
                nodes[r.name] = StageNode(r.name, r.expected, r.deps, r.spread)
            else:
                key = r.name if r.name in nodes else base
                nodes[key].spread = r.spread
                nodes[key].expected = r.expected
        return nodes

    def deadline_counted_from(self) -> str:
        """Where the deadline counts from, for messages: "its start", or the scheduled time of a run that started
        later than it was due (its start is then not what the deadline counts from: a run reported MISSED although
        it took 5 s of a 60 s deadline said nothing of why)."""
        if self.started - self.deadline_from < 1.0:
            return "its start"
        return (f"its scheduled time {datetime.fromtimestamp(self.deadline_from, timezone.utc):%Y-%m-%d %H:%M:%S} UTC, "
                f"{self.started - self.deadline_from:.0f}s before it started")

    def stage_deadline(self, name: str, deps: Sequence[str], expected: float) -> float | None:
        if self.deadline_at is None:
            return None
        base = name.split("#", 1)[0]
        if self.plan and base in self.plan:
            if self._split is None:
                self._split = split_deadline(self._nodes(), float(self.deadline))
            return self.deadline_from + self._split[base]
        # no plan: the stage may take the rest of the pipeline deadline
        return self.deadline_at

    # -------------------------------------------------------------- stage events
    def add(self, rec: StageRecord) -> None:
        with self.lock:
            self.stages[rec.name] = rec
            if rec.task_run_id:
                self.by_task_run[rec.task_run_id] = rec.name

    def unique_name(self, base: str, task_run_id: str | None) -> tuple[str, StageRecord | None]:
        with self.lock:
            if task_run_id and task_run_id in self.by_task_run:  # a retry of the same task run
                name = self.by_task_run[task_run_id]
                return name, self.stages.get(name)
            if base not in self.stages:
                return base, None
            k = 2
            while f"{base}#{k}" in self.stages:
                k += 1
            return f"{base}#{k}", None

    def forecast(self):
        now = time.time()
        with self.lock:
            nodes = self._nodes()
            done = {}
            running = {}
            for r in self.stages.values():
                key = r.name if r.name in nodes else r.name.split("#", 1)[0]
                if r.ended is not None and r.state == "completed":
                    done[key] = r.ended
                elif r.started is not None or r.placed is not None:
                    running[key] = r.started or r.placed or now
            overhead = self.start_overhead()
        return forecast(nodes, now=now, done=done, running=running, deadline=self.deadline_at, overhead=overhead)

    def start_overhead(self) -> float:
        """The median time this pipeline's stages took from their dependencies ending (the pipeline's
        start, for the first ones) to their start: the dispatch of the stage's flow run, the worker's
        pickup and the QoS queue, seconds a stage's predicted duration does not cover. 0 before a stage
        has started. (Call with the lock held.)"""
        ends = {r.name: r.ended for r in self.stages.values()}
        gaps = []
        for r in self.stages.values():
            if r.started is None or any(ends.get(d) is None for d in r.deps if d in ends):
                continue
            ready = max((ends[d] for d in r.deps if d in ends), default=self.started)
            gaps.append(max(0.0, r.started - ready))
        return float(statistics.median(gaps)) if gaps else 0.0

    def check_at_risk(self) -> None:
        """While a stage runs: the at-risk event once the forecast finish passes the deadline (with
        the artifact updated then), without an artifact version per check."""
        try:
            if not self.at_risk_sent and self.forecast().at_risk:
                self.publish_forecast()
        except Exception:  # monitoring must never fail a pipeline
            pass

    def publish_forecast(self, *, final: bool = False) -> None:
        """Forecast artifact (markdown, versioned under one key) and the at-risk event."""
        try:
            fc = self.forecast()
            now = time.time()
            done = sum(1 for r in self.stages.values() if r.state == "completed")
            total = max(len(self.plan or {}), len(self.stages))
            lines = [f"### Completion forecast: {self.name}", ""]
            if final and self.ended:
                lines.append(f"Finished after **{self.ended - self.started:.1f}s**.")
            else:
                lines.append(
                    f"Forecast finish in **{max(0.0, fc.finish - now):.1f}s** "
                    f"(± {fc.spread:.1f}s, 1σ; {done}/{total} stages done)."
                )
            if self.deadline_at is not None:
                slack = self.deadline_at - (self.ended if final and self.ended else fc.finish)
                p = fc.p_meet
                lines.append(
                    f"Deadline {self.deadline:g}s after {self.deadline_counted_from()}: slack **{slack:+.1f}s**"
                    + (f", P(meet) ≈ {p:.0%}" if p is not None and not final else "")
                    + (" — **AT RISK**" if slack < 0 and not final else "")
                )
            if fc.remaining_path and not final:
                lines.append("")
                lines.append("Critical path left: " + " → ".join(fc.remaining_path))
                if fc.overhead >= 0.05:
                    lines.append("")
                    lines.append(f"Each stage still to start is counted from {fc.overhead:.1f}s after its dependencies end: "
                                 "the median on this run so far (its dispatch, the worker's pickup, the QoS queue).")
            # a stage's end and its successor's dispatch come within a second of each other: one
            # artifact version for both (each write contends for the server's database lock)
            if final or now - self._forecast_written_at >= FORECAST_MIN_INTERVAL_S:
                _artifact(self, "markdown", f"qosflow-forecast-{_slug(self.name)}", "\n".join(lines), "qosflow completion forecast")
                self._forecast_written_at = now
            with self.lock:  # stages waited for in several threads: one event
                first = not final and fc.at_risk and not self.at_risk_sent
                self.at_risk_sent = self.at_risk_sent or first
            if first:
                _emit(
                    "qosflow.qos.at-risk",
                    self,
                    {"pipeline": self.name, "forecast_finish": fc.finish, "spread_s": fc.spread, "deadline": self.deadline_at, "late_by_s": round(fc.finish - self.deadline_at, 3)},
                )
                # on the run's log too: a deadline out of reach from the start (qos_deadline=5 for a
                # 40 s pipeline) showed only as an event and an artifact; the log said nothing
                _run_logger("qosflow").warning(
                    "pipeline %s is at risk of missing its deadline (%gs after %s): forecast to finish %.0fs after "
                    "it%s", self.name, self.deadline, self.deadline_counted_from(), fc.finish - self.deadline_at,
                    f" (critical path left: {' -> '.join(fc.remaining_path)})" if fc.remaining_path else "")
        except Exception:  # monitoring must never fail a pipeline
            pass

    def first_stage_error(self) -> StageRecord | None:
        """The stage of this run that ended first without completing (its error recorded), or None."""
        with self.lock:
            failed = [r for r in self.stages.values() if r.error and r.state != "completed"]
        return min(failed, key=lambda r: (r.ended or math.inf, r.dispatched)) if failed else None

    # -------------------------------------------------------------- end of run
    @property
    def met(self) -> bool | None:
        if self.deadline_at is None or self.ended is None:
            return None
        return self.ended <= self.deadline_at and self.state == "completed"

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "flow_run_id": self.flow_run_id,
            "priority": self.priority.value if self.priority else None,
            "deadline": self.deadline,
            "started_at": self.started,
            "finished_at": self.ended,
            "elapsed_s": None if self.ended is None else round(self.ended - self.started, 3),
            "met": self.met,
            "state": self.state,
            "stages": [r.to_json() for r in sorted(self.stages.values(), key=lambda r: (r.dispatched, r.name))],
        }

    def finish(self, ok: bool) -> None:
        self.ended = time.time()
        self.state = "completed" if ok else "failed"
        if not self.stages:
            return
        self.catch_up_placements()
        try:
            rows = []
            for r in sorted(self.stages.values(), key=lambda r: (r.dispatched, r.name)):
                rows.append(
                    {
                        "stage": r.name,
                        "host": r.host or "-",
                        "GPUs": (",".join(r.gpus) or "-") + (" (virtual)" if r.virtual_gpus and r.gpus else "") + r.elastic_note,
                        "cores": "-" if r.cpu_cores is None else f"{r.cpu_cores:g}",
                        "predicted_s": "-" if r.predicted_s is None else f"{r.predicted_s:.1f}",
                        "actual_s": "-" if r.actual_s is None else f"{r.actual_s:.1f}",
                        "deadline_met": {True: "yes", False: "NO", None: "-"}[r.met],
                        "state": r.state + (f" ({r.attempts} attempts)" if r.attempts > 1 else ""),
                    }
                )
            _artifact(self, "table", f"qosflow-placements-{_slug(self.name)}", json.dumps(rows), f"qosflow placements of {self.name}")
            _artifact(self, "markdown", f"qosflow-qos-{_slug(self.name)}", self.report_markdown(), "qosflow QoS report")
            self.publish_forecast(final=True)
        except Exception:
            pass
        # one event for the pipeline; a late stage's own event comes from the worker that ran it (the
        # pipeline sent a second one for each: two notifications per late stage)
        if self.deadline_at is not None and self.ended > self.deadline_at:
            _emit("qosflow.qos.violated", self, {"pipeline": self.name, "deadline": self.deadline_at, "ended": self.ended,
                                                 "late_by_s": round(self.ended - self.deadline_at, 3),
                                                 "late_stages": [r.name for r in self.stages.values() if r.met is False]})
        self._remember_plan()

    def catch_up_placements(self, wait_s: float = 10.0) -> list[str]:
        """Read the placement labels of completed stages that finished before the worker's labels
        reached the server (the worker checks and rewrites them once the stage's process has ended).
        Waits at most `wait_s` in all, after the pipeline's end time is taken. Returns the stages
        still without a placement."""
        give_up = time.time() + wait_s
        missing = [r for r in self.stages.values() if r.host is None and r.flow_run_id and r.state == "completed"]
        while missing:
            for r in list(missing):
                labels = read_placement_labels(r.flow_run_id)
                if labels is not None:
                    apply_placement_labels(r, labels)
                    missing.remove(r)
            if not missing or time.time() >= give_up:
                break
            time.sleep(0.5)
        return [r.name for r in missing]

    def report_markdown(self) -> str:
        el = (self.ended or time.time()) - self.started
        head = f"## QoS report: {self.name}\n\n"
        if self.deadline is None:
            head += f"No deadline; finished in {el:.1f}s ({self.state}).\n"
        else:
            verdict = "**met**" if self.met else "**MISSED**" if self.state == "completed" else "**not met** (the pipeline failed)"
            head += f"Deadline {self.deadline:g}s: {verdict} — finished in {el:.1f}s ({self.state}).\n"
            if self.started - self.deadline_from >= 1.0:  # (a late scheduled run: finished in 5 s, and MISSED)
                head += (f"\nThe deadline counts from {self.deadline_counted_from()} (a run of a deployment's schedule is "
                         f"due from then); it finished {(self.ended or time.time()) - self.deadline_from:.1f}s after it.\n")
        if self.priority:
            head += f"\nPriority class: `{self.priority.value}`.\n"
        virt = any(r.virtual_gpus for r in self.stages.values())
        if virt:
            head += "\nGPUs are **virtual** (declared by the cluster block; no NVML on this machine). Stages ran for real on the CPU.\n"
        late = [r for r in self.stages.values() if r.met is False]
        if late:
            head += "\nStages past their (critical-path) deadline: " + ", ".join(f"`{r.name}` by {r.ended - r.deadline_at:.1f}s" for r in late) + "\n"
        errs = [r for r in self.stages.values() if r.predicted_s and r.actual_s]
        if errs:
            mape = sum(abs(r.actual_s - r.predicted_s) / r.actual_s for r in errs if r.actual_s > 0) / len(errs)
            head += f"\nPrediction error (mean absolute, relative to actual): {mape:.0%} over {len(errs)} stages.\n"
        retried = [r for r in self.stages.values() if r.attempts > 1]
        if retried:
            head += "\nRetried: " + ", ".join(f"`{r.name}` ({r.attempts} attempts)" for r in retried) + "\n"
        return head

    def _remember_plan(self) -> None:
        """Record this run's stage DAG so the next run can split its deadline along it."""
        if self.state != "completed" or self.plan:
            return
        try:
            from qosflow.paths import data_dir

            path = data_dir() / "prefect" / "plans.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                plans = json.loads(path.read_text()) if path.exists() else {}
            except ValueError:  # damaged (e.g. a disk that filled up): was never written again, every run's plan lost
                plans = {}
            if not isinstance(plans, dict):
                plans = {}
            plans[self.flow_name] = {
                "plan": {r.name: list(r.deps) for r in self.stages.values()},
                "expected": {r.name: r.actual_s or r.expected for r in self.stages.values()},
            }
            from qosflow.sim.files import replacing

            with replacing(path) as tmp:  # (a temporary file of its own: two pipelines of one process wrote the same one)
                tmp.write_text(json.dumps(plans))
        except Exception:
            pass


def _recorded_plan(name: str) -> tuple[dict[str, list[str]] | None, dict[str, float]]:
    try:
        from qosflow.paths import data_dir

        path = data_dir() / "prefect" / "plans.json"
        d = json.loads(path.read_text()).get(name) if path.exists() else None
    except Exception:
        d = None
    if not d:
        return None, {}
    return d.get("plan"), {k: float(v) for k, v in (d.get("expected") or {}).items() if v}


def _slug(s: str) -> str:
    out = "".join(c.lower() if c.isalnum() else "-" for c in s)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "pipeline"


def _artifact(run: PipelineRun, kind: str, key: str, data: str, description: str) -> None:
    """A new version of the pipeline's artifact `key` (`kind`: "markdown" or "table", `data` as Prefect stores it: the
    markdown, or the rows as JSON), on the pipeline's flow run: its Artifacts tab in the UI shows it. Written through the
    API with the run named, not with `create_markdown_artifact`, which takes the run from the calling thread's context:
    a stage's thread or the pipeline's end may have none (an artifact on no run, and Prefect's FutureWarning that
    artifacts made outside a run will stop being accepted), and a stage's task context would put it on that stage."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    try:
        with get_client(sync_client=True) as client:
            client.create_artifact(ArtifactCreate(key=key, type=kind, data=data, description=description, flow_run_id=run.flow_run_id))
    except Exception as exc:  # (a view: what follows it, the at-risk event and warning, must not depend on it)
        logging.getLogger("qosflow").debug("could not write artifact %s of pipeline %s: %s", key, run.name, exc)


def _emit(name: str, run: PipelineRun, payload: dict[str, Any]) -> None:
    """An event on the pipeline's run, labelled qosflow.scope=pipeline (the worker's events on a stage's
    run say qosflow.scope=stage), so that an automation can tell them apart."""
    try:
        from prefect.events import emit_event

        emit_event(
            event=name,
            resource={"prefect.resource.id": f"prefect.flow-run.{run.flow_run_id}", "prefect.resource.name": run.name, "qosflow.scope": "pipeline"},
            payload=json.loads(json.dumps(payload, default=str)),
        )
    except Exception:
        pass


# ------------------------------------------------------------------------------------ the task
@functools.lru_cache(maxsize=256)
def _import_name(module: str, file: str | None) -> str:
    """`module` as imported from its package: walking up from its file through the directories that
    hold an ``__init__.py`` gives the package-qualified name (``flows/retrain.py`` in the package
    ``flows``: ``flows.retrain``), which replaces `module` when it is a tail of it (a module loaded by
    its path is called ``retrain``); anything else stays as it is."""
    if not file:
        return module
    path = Path(file).resolve()
    parts, d = [path.stem], path.parent
    while (d / "__init__.py").is_file() and d.parent != d:
        parts.append(d.name)
        d = d.parent
    full = ".".join(reversed(parts))
    return full if full.endswith("." + module) else module


class QoSTask(Task):
    """A Prefect task carrying a QoS spec (also encoded in its tags, which survive `with_options`)."""

    def __init__(self, fn: Callable, *, qos: QoSSpec, explicit: Iterable[str] = (), expected_duration: float | None = None, batch_size: int | None = None,
                 early_check: float | None = None, **task_kwargs: Any):
        self.qos = qos
        self.qos_explicit = frozenset(explicit)
        self.expected_duration = expected_duration
        self.batch_size = batch_size
        self.early_check = early_check
        self.qos_fn = fn
        tags = list(task_kwargs.pop("tags", None) or []) + qos_tags(qos, expected_duration=expected_duration)
        # unset is None, as `@task` passes it (Task.__init__'s own default is False): the stage's run then
        # logs its prints unless its pipeline flow says log_prints=False (`_stage_log_prints`)
        task_kwargs.setdefault("log_prints", None)
        wrapper = _make_wrapper(fn, self)
        super().__init__(fn=wrapper, tags=tags, **task_kwargs)

    # `timeout_seconds`: Prefect enforces a task's timeout by injecting an exception into the thread
    # that runs it, which neither interrupts a blocking wait nor reaches the stage's own process: the
    # stage ran on, holding its GPU, and each retry started another copy. A dispatched stage's timeout
    # is enforced by its wait (wait_for_stage), which cancels the stage's run first; Prefect sees None
    # then and enforces it only for a stage that runs in-process (no pool).
    @property
    def timeout_seconds(self) -> float | None:  # type: ignore[override]
        t = self.__dict__.get("_qos_timeout_seconds")
        return None if t is not None and _stage_pool() else t

    @timeout_seconds.setter
    def timeout_seconds(self, value: float | None) -> None:
        self.__dict__["_qos_timeout_seconds"] = value

    # `retry_condition_fn`: a stage whose run was cancelled from outside (`prefect flow-run cancel`,
    # the UI) raised StageFailed in the pipeline, and its `retries` started it again, as a new run: the
    # cancel did not stop it. StageCancelled is never retried; the user's own condition decides the rest.
    @property
    def retry_condition_fn(self) -> Callable | None:  # type: ignore[override]
        return _unless_cancelled(self.__dict__.get("_qos_retry_condition_fn"))

    @retry_condition_fn.setter
    def retry_condition_fn(self, value: Callable | None) -> None:
        self.__dict__["_qos_retry_condition_fn"] = getattr(value, "__qosflow_user_condition__", value)

    @property
    def stage_timeout_seconds(self) -> float | None:
        """The `timeout_seconds` the stage was declared with (whoever enforces it)."""
        return self.__dict__.get("_qos_timeout_seconds")

    @property
    def signature(self) -> str:
        """The name the predictor learns this stage under: its function's module and qualified name.
        A script's module is `__main__`, and a module loaded by its file's path (`python flows/retrain.py`,
        `prefect deploy`'s entrypoint `flows/retrain.py:retrain`) is called by its file's stem; both are
        named as the module is imported from its package instead (`flows.retrain`, `_import_name`), so
        that what the worker learns from a run from the shell counts for the same pipeline deployed or
        imported."""
        fn = self.qos_fn
        module = getattr(fn, "__module__", None) or "?"
        file = getattr(sys.modules.get(module), "__file__", None)
        if module == "__main__":
            main = sys.modules.get("__main__")
            spec_name = getattr(getattr(main, "__spec__", None), "name", None)
            if spec_name and spec_name != "__main__":
                module = spec_name.removesuffix(".__main__")
            elif file:
                module = os.path.splitext(os.path.basename(file))[0]
        return f"{_import_name(module, file)}.{getattr(fn, '__qualname__', self.name)}"

    # `.submit()` / `.map()` outside a flow: Prefect's "Unable to determine task runner ... please use
    # `.delay`" sent users to Prefect's task workers, which do not place the stage on a GPU slot
    def submit(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        _need_a_flow(self.name, "submit")
        return super().submit(*args, **kwargs)

    def map(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if not kwargs.get("deferred"):  # (deferred: Prefect's task workers, asked for by name)
            _need_a_flow(self.name, "map")
        return super().map(*args, **kwargs)

    def with_options(self, **kwargs: Any) -> "QoSTask":  # type: ignore[override]
        qos_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in _SPEC_ARGS}
        stage_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in STAGE_FIELDS}
        base = {k: getattr(self.qos, k) for k in _SPEC_ARGS}
        base["priority"] = self.qos.priority.value
        base.update(qos_kw)
        explicit = set(self.qos_explicit) | set(qos_kw)
        where = f"{self.name}.with_options"
        unknown = sorted(set(kwargs) - _TASK_PARAMS)
        if unknown:  # (was Prefect's TypeError, naming neither the stage nor the QoS arguments)
            raise SpecError(unknown[0], f"not a QoS argument nor a @task argument; QoS: {', '.join(_SPEC_ARGS + STAGE_FIELDS)}", where=where)
        new_tags = kwargs.pop("tags", None)
        # tags given here are checked as the decorator's are ("qos:..." tags were dropped without a word);
        # the stage's own keep only the user's (the qos: ones are made again from the QoS)
        user_tags = new_tags if new_tags is not None else [t for t in self.tags if not t.startswith("qos:")]
        if kwargs.get("timeout_seconds") is None:  # (self.timeout_seconds is None where the stage is dispatched)
            kwargs["timeout_seconds"] = self.stage_timeout_seconds
        plain = super().with_options(**kwargs)  # a plain Task with the merged Prefect options
        opts = {k: getattr(plain, k) for k in ("name", "description", "version", "cache_policy", "cache_key_fn", "cache_expiration", "task_run_name", "retries", "retry_delay_seconds", "retry_jitter_factor", "persist_result", "result_storage", "result_serializer", "result_storage_key", "cache_result_in_memory", "timeout_seconds", "log_prints", "refresh_cache", "retry_condition_fn") if hasattr(plain, k)}
        opts = {k: v for k, v in opts.items() if k in _TASK_PARAMS}
        return _build(self.qos_fn, {k: base[k] for k in base}, explicit, {k: stage_kw.get(k, getattr(self, k)) for k in STAGE_FIELDS}, dict(opts, tags=user_tags))


def _need_a_flow(name: str, how: str) -> None:
    """Refuse `stage.submit()` / `stage.map()` outside a flow run, saying what to do instead."""
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        raise QosflowStageOutsideFlow(
            f"stage {name!r}: .{how}() runs stages side by side inside a pipeline: call it in a @qos_flow function "
            f"(deploy that flow, or call it), or call the stage directly, {name}(...), to run it once (on the qosflow "
            "worker of QOSFLOW_POOL when that is set, else in this process)")


class QosflowStageOutsideFlow(QosflowError, RuntimeError):
    """A stage's `.submit()` or `.map()` called outside a flow run."""


def _unless_cancelled(user: Callable | None) -> Callable:
    """A task retry condition that refuses StageCancelled and otherwise asks `user` (None: retry)."""

    def cancelled(state: Any) -> bool:
        return isinstance(getattr(state, "data", None), StageCancelled)

    if user is not None and inspect.iscoroutinefunction(user):
        async def condition(task: Any, task_run: Any, state: Any) -> bool:
            return not cancelled(state) and bool(await user(task, task_run, state))
    else:
        def condition(task: Any, task_run: Any, state: Any) -> bool:
            return not cancelled(state) and (user is None or bool(user(task, task_run, state)))

    condition.__qosflow_user_condition__ = user  # type: ignore[attr-defined]
    return condition


def _in_stage_process() -> bool:
    return bool(os.environ.get("QOSFLOW_PLACEMENT"))


_NO_RUN = object()


def _stage_pool(run: Any = _NO_RUN) -> str | None:
    """The pool a stage called here is dispatched to (the pipeline run's, else QOSFLOW_POOL); None
    when it runs in-process (no pool, or in a stage's own process)."""
    if _in_stage_process():
        return None
    if run is _NO_RUN:
        run = PipelineRun.current()
    return (run.pool if run else None) or os.environ.get("QOSFLOW_POOL") or None


def _make_wrapper(fn: Callable, task_ref: "QoSTask") -> Callable:
    if inspect.iscoroutinefunction(fn):
        raise SpecError("fn", f"{fn.__qualname__} is async; @qos_task stages run in their own process, write them as plain functions")

    @functools.wraps(fn)
    def _qos_stage(*args: Any, **kwargs: Any) -> Any:
        run = PipelineRun.current() if not _in_stage_process() else None
        pool = _stage_pool(run)
        if not pool:
            return fn(*args, **kwargs)
        return _dispatch(task_ref, run, pool, args, kwargs)

    _qos_stage.__qosflow_stage__ = True  # type: ignore[attr-defined]
    return _qos_stage


_DEPLOYMENTS: set[str] = set()
_DEPLOY_LOCK = threading.Lock()


def _deployed_on_qosflow_pool(flow_run: Any) -> str | None:
    """The work pool a deployed pipeline run was taken from, when it is a qosflow pool; else None
    (not deployed, a pool of another type, or the server does not say)."""
    name = getattr(flow_run, "work_pool_name", None)
    if not name:
        return None
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            return name if client.read_work_pool(name).type == "qosflow" else None
    except Exception:  # noqa: BLE001 - only a default: without it the stages run in-process, as before
        return None


def _missing_pool(client: Any, pool: str) -> Exception:
    """The error for a pool that does not exist, with the server's qosflow pools (`missing_pool`)."""
    from qosflow.prefect.local import missing_pool

    try:
        existing = sorted(wp.name for wp in client.read_work_pools() if wp.type == "qosflow")
    except Exception:  # noqa: BLE001 - a hint only
        existing = []
    return missing_pool(pool, existing)


def ensure_stage_deployment(pool: str) -> str:
    """The `qosflow-stage/<pool>` deployment, created on first use."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from qosflow.prefect.stage import ENTRYPOINT, STAGE_FLOW_NAME

    name = f"{STAGE_FLOW_NAME}/{pool}"
    with _DEPLOY_LOCK:
        if name in _DEPLOYMENTS:
            return name
        with get_client(sync_client=True) as client:
            try:
                wp = client.read_work_pool(pool)
            except ObjectNotFound:
                raise _missing_pool(client, pool) from None
            if wp.type != "qosflow":
                raise SpecError(
                    "pool",
                    f"work pool {pool!r} has type {wp.type!r}; stages need a pool of type 'qosflow' (its worker places them): "
                    "create one with `qosflow init --pool NAME` and pass pool=NAME (or QOSFLOW_POOL=NAME)",
                )
            try:
                client.read_deployment_by_name(name)
            except ObjectNotFound:
                flow_id = client.create_flow_from_name(STAGE_FLOW_NAME)
                client.create_deployment(
                    flow_id=flow_id,
                    name=pool,
                    work_pool_name=pool,
                    entrypoint=ENTRYPOINT,
                    enforce_parameter_schema=False,
                    description="Runs one @qos_task stage on the slot the qosflow worker chose (created by qosflow).",
                    tags=["qosflow"],
                )
        _DEPLOYMENTS.add(name)
    return name


def _stage_log_prints(task: QoSTask) -> bool:
    """Whether the stage's run logs its prints: the task's `log_prints`, else its pipeline flow's, else True
    (a stage runs in a process of its own, often on another host: its prints are in the UI by default)."""
    from prefect.context import FlowRunContext

    if getattr(task, "log_prints", None) is not None:
        return bool(task.log_prints)
    ctx = FlowRunContext.get()
    flow = getattr(ctx, "flow", None) if ctx is not None else None
    if flow is not None and getattr(flow, "log_prints", None) is not None:
        return bool(flow.log_prints)
    return True


def _dispatch(task: QoSTask, run: PipelineRun | None, pool: str, args: tuple, kwargs: dict) -> Any:
    from prefect.context import TaskRunContext
    from prefect.deployments import run_deployment

    from qosflow.prefect.stage import delete_payload, write_payload

    trc = TaskRunContext.get()
    tr_id = str(trc.task_run.id) if trc and trc.task_run else None
    base = task.name
    deps: list[str] = []
    if trc is not None and run is not None:
        for inputs in (trc.task_run.task_inputs or {}).values():
            for inp in inputs:
                up = run.by_task_run.get(str(getattr(inp, "id", "")))
                if up and up not in deps:
                    deps.append(up)
    spec = task.qos
    if run is not None and run.priority is not None and "priority" not in task.qos_explicit:
        spec = spec.with_(priority=run.priority)
    if spec.user is None:
        who = _stage_user(task, trc, run)
        if who is not None:
            spec = spec.with_(user=who)  # (its run's tag qos:user=... tells the worker: `spec.run_user`)
    if run is not None:
        name, prev = run.unique_name(base, tr_id)
        expected = float(task.expected_duration or run.expected.get(base, 60.0))
        deadline_at = run.stage_deadline(name, deps, expected)
    else:
        name, prev, expected, deadline_at = base, None, float(task.expected_duration or 60.0), None
    if spec.deadline is not None:  # the stage's own deadline counts from now
        own = time.time() + spec.deadline
        deadline_at = own if deadline_at is None else min(deadline_at, own)
    rec = StageRecord(name, tr_id, tuple(deps), expected, 0.5 * expected, time.time(), deadline_at)
    if prev is not None:
        rec.attempts = prev.attempts + 1
    if run is not None:
        run.add(rec)
        run.publish_forecast()
    deployment = ensure_stage_deployment(pool)
    key = write_payload(task.qos_fn, args, kwargs, log_prints=_stage_log_prints(task))
    pipeline = run.name if run else None
    jv = job_variables(
        spec,
        stage_name=name,
        pipeline=pipeline,
        pipeline_run_id=run.flow_run_id if run else None,
        signature=task.signature,
        expected_duration=task.expected_duration,
        batch_size=task.batch_size,
        early_check_s=task.early_check,
        deadline_at=deadline_at,
    )
    t0 = time.monotonic()  # a stage's timeout counts from its call, as Prefect's does: its time in the queue included
    # a key of this call alone: if the creation is interrupted (Ctrl-C) or its answer lost, the run the
    # server may have created all the same is found by it and cancelled, not left to run unwatched
    idem = f"qosflow-stage-{uuid.uuid4()}"
    try:
        fr = run_deployment(
            deployment,
            parameters={"payload": key, "stage": name, "pipeline": pipeline or ""},
            flow_run_name=f"{pipeline or 'stage'}.{name}",
            tags=_user_tags(task, trc) + qos_tags(spec, expected_duration=task.expected_duration),
            job_variables=jv,
            timeout=0,  # created, not waited for: wait_for_stage waits (and says so when no worker takes it)
            as_subflow=True,
            idempotency_key=idem,
        )
    except BaseException as exc:
        rec.ended, rec.state = time.time(), "cancelled"
        _cancel_created_run(idem, f"its pipeline stopped while creating it ({type(exc).__name__})", name, _run_logger("qosflow.dispatch"))
        delete_payload(key)
        if run is not None:
            run.publish_forecast()
        raise
    rec.flow_run_id = str(fr.id)
    try:
        fr = wait_for_stage(fr, pool, name, timeout_s=task.stage_timeout_seconds, since=t0,
                            # a stage running past the pipeline's deadline is at risk before it ends
                            on_tick=run.check_at_risk if run is not None and run.deadline_at is not None else None)
    except BaseException as exc:
        _took_cancel(rec.flow_run_id)
        rec.ended = time.time()
        rec.state = "timed out" if isinstance(exc, StageTimedOut) else "cancelled"
        if isinstance(exc, StageTimedOut):
            rec.error = f"{type(exc).__name__}: {exc}"
        delete_payload(key)
        if run is not None:
            run.publish_forecast()
        raise
    told_to_cancel = _took_cancel(rec.flow_run_id)  # (taken at once: nothing below may leave it in the set)
    labels = dict(getattr(fr, "labels", None) or {})
    if "qosflow.host" not in labels and fr.state is not None and fr.state.is_completed():
        # the worker writes the placement labels while it launches the stage, so they are normally
        # there by now; if not, look once more, then go on: the next stage must not wait for
        # bookkeeping (the pipeline reads the missing labels at its end, see PipelineRun.finish)
        time.sleep(0.2)
        labels = read_placement_labels(str(fr.id)) or labels
    rec.engine_started = fr.start_time.timestamp() if fr.start_time else None
    apply_placement_labels(rec, labels)
    rec.ended = fr.end_time.timestamp() if fr.end_time else time.time()
    state = fr.state
    ok = state is not None and state.is_completed()
    rec.state = "completed" if ok else (state.name.lower() if state else "unknown")
    if run is not None:
        run.publish_forecast()
    if not ok:
        delete_payload(key)
        err = _stage_error(state, name, rec, told_to_cancel=told_to_cancel)
        rec.error = f"{type(err).__name__}: {err}"
        raise err
    try:
        return state.result(raise_on_failure=True)
    finally:
        delete_payload(key)


#: deployment id -> the user its runs are for when they name none ("FLOW/DEPLOYMENT"), read once per process
_DEPLOYMENT_USERS: dict[str, str | None] = {}


def _stage_user(task: QoSTask, trc: Any, run: PipelineRun | None) -> str | None:
    """Who a stage that names no `user` runs for: a `user:NAME` tag of the stage (its decorator's or
    `with tags(...)` around its call), else of its pipeline's flow run (which has its deployment's
    tags), else its pipeline's deployment as `FLOW/DEPLOYMENT`, else None. The pipeline's answer is
    worked out once per pipeline run."""
    from prefect.context import FlowRunContext

    who = _valid_user(user_from_tags(_user_tags(task, trc)))
    if who is not None:
        return who
    cached = getattr(run, "_qos_user", _NO_RUN) if run is not None else _NO_RUN
    if cached is not _NO_RUN:
        return cached
    ctx = FlowRunContext.get()
    fr = ctx.flow_run if ctx is not None else None
    who = _valid_user(user_from_tags(getattr(fr, "tags", None))) or _deployment_user(fr)
    if run is not None:
        run._qos_user = who  # type: ignore[attr-defined]
    return who


def _valid_user(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        return QoSSpec(user=name).user
    except SpecError:
        return None


def _deployment_user(flow_run: Any) -> str | None:
    """`FLOW/DEPLOYMENT` of the deployment `flow_run` was created from (None: none, or the server did not say)."""
    dep_id = getattr(flow_run, "deployment_id", None)
    if dep_id is None:
        return None
    key = str(dep_id)
    if key not in _DEPLOYMENT_USERS:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                dep = client.read_deployment(dep_id)
                flow = client.read_flow(dep.flow_id)
            _DEPLOYMENT_USERS[key] = _valid_user(f"{flow.name}/{dep.name}")
        except Exception as exc:  # (no user is the fallback of the fallback: the stage still runs)
            _run_logger("qosflow.dispatch").debug("could not read deployment %s for the stage's user: %s", key, exc)
            return None
    return _DEPLOYMENT_USERS[key]


def _user_tags(task: QoSTask, trc: Any) -> list[str]:
    """The stage's own tags and those of `with tags(...)` around its call, for its flow run: the task
    run has both, the stage's run got the decorator's only (a stage run could not be found by the
    tag its pipeline gave it)."""
    from prefect.context import TagsContext

    tags = list(task.tags)
    extra = getattr(getattr(trc, "task_run", None), "tags", None) or sorted(TagsContext.get().current_tags)
    tags += [t for t in extra if t not in tags]
    return [t for t in tags if not t.startswith("qos:")]


def _stage_error(state: Any, name: str, rec: StageRecord, *, told_to_cancel: bool | None = None) -> BaseException:
    """What a stage whose run did not complete raises in the pipeline: the exception the stage itself
    raised, read back from the Failed state its engine persisted (so that `except ValueError:` and
    `retry_condition_fn` see what they would in-process), with a note saying which stage run raised it;
    StageFailed when there is none (a crash, a cancellation, a Failed state the worker set) or it
    cannot be read back (e.g. its class does not unpickle here). `told_to_cancel`: whether the run
    crashed after a Cancelling (`_took_cancel`); None takes it from `_TOLD_TO_CANCEL`."""
    if told_to_cancel is None:
        told_to_cancel = _took_cancel(rec.flow_run_id)
    if state is not None and (state.is_cancelled() or told_to_cancel):
        # (not only "from outside the pipeline": a pipeline run cancelled in the UI has its running stages cancelled
        # by the worker, and the stage's message said the user had cancelled the stage)
        by = ("with its pipeline's run" if "its pipeline run" in str(getattr(state, "message", "") or "") else
              "from the UI, `prefect flow-run cancel`, or with its pipeline's run")
        return StageCancelled(f"stage {name!r} ({rec.flow_run_id}) was cancelled (its run was cancelled {by}) and ended "
                              f"{state.name}: {state.message}; it is not retried")
    failed = StageFailed(f"stage {name!r} ({rec.flow_run_id}) ended {state.name if state else '?'}: "
                         f"{state.message if state is not None else 'no state'}")
    if state is None or not state.is_failed() or state.data is None:
        return failed
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - not readable here: StageFailed says what the run said
        return failed
    if not isinstance(exc, Exception):
        return failed
    try:
        exc.add_note(f"(raised by qosflow stage {name!r} in its flow run {rec.flow_run_id}"
                     + (f" on {rec.host}" if rec.host else "") + ")")
    except Exception:  # noqa: BLE001 - a note is only a courtesy
        pass
    return exc


def _run_logger(fallback: str) -> Any:
    """The pipeline run's logger (its lines show on the run in the UI); the logger `fallback` outside
    a flow run (a pipeline function called directly)."""
    import logging

    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - no run context
        return logging.getLogger(fallback)


class PipelineEnded(QosflowError):
    """The pipeline's own run was interrupted (Ctrl-C, SIGTERM, a timeout) while one of its stages was waited for."""


def _pipeline_ended() -> str | None:
    """Why the pipeline run this thread dispatches for is going away while it still runs, else None.

    On Ctrl-C, SIGTERM or a flow timeout Prefect's flow engine leaves its run context, and its thread
    pool task runner sets the cancel event of every task run (`cancel_all`) and then waits for its
    threads, before the engine marks the run Crashed: a stage's wait that did not look would keep
    the process alive until the stage ended, or forever when no worker takes it. A flow whose body
    returned (its state is final) without waiting for a stage still waits for it, as Prefect does."""
    from prefect.context import FlowRunContext, TaskRunContext

    ctx, trc = FlowRunContext.get(), TaskRunContext.get()
    if ctx is None or trc is None or trc.task_run is None:
        return None
    event = (getattr(ctx.task_runner, "_cancel_events", None) or {}).get(trc.task_run.id)
    state = getattr(ctx.flow_run, "state", None)
    if event is None or not event.is_set() or (state is not None and state.is_final()):
        return None
    return "interrupted"


def deadline_from(flow_run: Any) -> float | None:
    """When a pipeline run's deadline starts counting if not at its start: the time a run made by a deployment's
    **schedule** was due (its expected start time), so that a scheduled retraining run that starts late (its pool was
    paused, no worker ran, a deployment concurrency limit or the previous run held it) is late by that much, as its
    users count it (a nightly 02:00 run with a 1 h deadline is due by 03:00). Until 2026-11-28 every deadline counted
    from the run's start: such a run had its whole deadline again from whenever it started and was reported met.
    None (its start) for a run not made by a schedule (`prefect deployment run`, a direct call): it is due when it
    starts, or when it was asked to start."""
    if flow_run is None or not getattr(flow_run, "auto_scheduled", False):
        return None
    when = getattr(flow_run, "expected_start_time", None)
    return None if when is None else when.timestamp()


def _pickup_hint(client: Any, pool: str, queue: str | None = None) -> str:
    """Why a stage run is still Scheduled: its pool or its work queue is paused (Prefect hands out no run of a paused
    pool or queue, stage runs included: said first, as no worker can take it then), no worker polls the pool, or
    the ones that do took nothing; with a pool or work-queue concurrency limit, that limit (the worker takes a
    stage run past a full one only while fewer stage runs than it allows are Pending or Running)."""
    limits: list[str] = []
    try:
        wp = client.read_work_pool(pool)
        if wp.is_paused:
            return (f"work pool {pool!r} is paused: no worker takes its runs, stage runs of pipelines already running "
                    f"included, until it is resumed (`prefect work-pool resume {pool}`, or the UI)")
        if getattr(wp, "concurrency_limit", None) is not None:
            limits.append(f"work pool {pool!r} has a concurrency limit of {wp.concurrency_limit} "
                          f"(`prefect work-pool set-concurrency-limit {pool} N` or `clear-concurrency-limit {pool}`)")
        if queue:
            q = next((q for q in client.read_work_queues(work_pool_name=pool) if q.name == queue), None)
            if q is not None and q.is_paused:
                return (f"work queue {queue!r} of work pool {pool!r} is paused: no worker takes its runs until it is resumed "
                        f"(`prefect work-queue resume {queue} --pool {pool}`, or the UI)")
            if q is not None and getattr(q, "concurrency_limit", None) is not None:
                limits.append(f"work queue {queue!r} has a concurrency limit of {q.concurrency_limit} (`prefect work-queue "
                              f"set-concurrency-limit {queue} N --pool {pool}` or `clear-concurrency-limit {queue} --pool {pool}`)")
    except Exception:  # only a hint
        pass
    try:
        workers = client.read_workers_for_work_pool(pool)
    except Exception:  # only a hint
        return f"is a `qosflow worker start --pool {pool}` running?"
    from qosflow.prefect.local import worker_online

    online = [w.name for w in workers if worker_online(w)]
    if not online:
        return f"no worker polls work pool {pool!r}: start one with `qosflow worker start --pool {pool}` (the stage starts when it does)"
    if limits:
        return (f"{' and '.join(limits)}: a stage run is taken past a full limit only while fewer stage runs than it "
                "allows are Pending or Running (pipeline runs holding slots do not count), so this stage starts when one "
                "of them ends, or raise the limit")
    return (f"worker(s) {', '.join(sorted(online))} of work pool {pool!r} took no run: see their log (a worker whose "
            "cluster or policy cannot be set up takes no run until that is fixed; one that just stopped still shows "
            "as online for a minute or two)")


def wait_for_stage(fr: Any, pool: str, name: str, *, poll: float = 0.25, timeout_s: float | None = None,
                   since: float | None = None, on_tick: Callable[[], None] | None = None,
                   tick_s: float = FORECAST_MIN_INTERVAL_S) -> Any:
    """Poll the stage's flow run until it is final. A run still Scheduled after
    QOSFLOW_STAGE_PICKUP_WARN_SECONDS (30 s) is logged on the pipeline with why (no worker polls the
    pool, ...), again every 10 x that.

    The stage's run is cancelled (the worker kills its process, or takes it out of the queue) on any
    other way out of this wait: `timeout_s` after `since` (time.monotonic(); default now) it is cancelled,
    its end awaited (at most QOSFLOW_STAGE_CANCEL_WAIT_SECONDS, 60 s, so that a retry does not start
    while it still holds its GPUs) and StageTimedOut is raised; when the pipeline's own run is
    interrupted (`.submit()`: the task runner's cancel event) PipelineEnded is raised; any exception
    raised into the wait itself (Ctrl-C or SIGTERM in a stage called directly, a crash) is re-raised
    after the cancel. `on_tick` is called every `tick_s` while it waits (the pipeline's forecast, whose
    at-risk event must not wait for the stage's end)."""
    from prefect.client.orchestration import get_client

    from qosflow.env import env_number

    logger = _run_logger("qosflow.dispatch")
    warn_after = env_number("QOSFLOW_STAGE_PICKUP_WARN_SECONDS", 30.0)
    timeout_at = None if not timeout_s else (time.monotonic() if since is None else since) + float(timeout_s)
    waiting_since: float | None = None  # since when its run has been Scheduled (again, after a worker stopped)
    next_warn = 0.0
    next_tick = time.monotonic() + tick_s
    try:
        with get_client(sync_client=True) as client:
            while True:
                state = fr.state
                if state is not None and state.is_final():
                    return _settled_after_cancel(client, fr) if state.is_crashed() else fr
                ended = _pipeline_ended()
                if ended is not None:
                    was = _cancel_stage_run(fr.id, f"its pipeline's run was {ended}", name, logger)
                    raise PipelineEnded(f"the pipeline's run was {ended} while stage {name!r} was {state.name if state else 'new'}; "
                                        f"its run {fr.id} was {was}")
                now = time.monotonic()
                if timeout_at is not None and now >= timeout_at:
                    wait_s = env_number("QOSFLOW_STAGE_CANCEL_WAIT_SECONDS", 60.0)
                    was = _cancel_stage_run(fr.id, f"stage {name!r} exceeded its timeout of {float(timeout_s):g} s", name, logger,
                                            wait_s=wait_s)
                    raise StageTimedOut(f"stage {name!r} exceeded its timeout of {float(timeout_s):g} s "
                                        f"({state.name if state else 'new'}); its run {fr.id} was {was}")
                if state is not None and not state.is_scheduled():
                    waiting_since = None
                elif waiting_since is None:
                    waiting_since, next_warn = now, now + warn_after
                elif warn_after > 0 and now >= next_warn:
                    logger.warning("stage %s has waited %.0fs for a worker to take its run %s: %s",
                                   name, now - waiting_since, fr.id, _pickup_hint(client, pool, getattr(fr, "work_queue_name", None)))
                    next_warn = now + 10 * warn_after
                if on_tick is not None and now >= next_tick:
                    next_tick = now + tick_s
                    on_tick()
                time.sleep(poll)
                fr = client.read_flow_run(fr.id)
    except (PipelineEnded, StageTimedOut):
        raise
    except BaseException as exc:
        # a stage called directly (`step(x)`) waits in the pipeline's own thread: Ctrl-C, SIGTERM or a
        # crash lands here, not in a task runner's cancel event; the stage must not run on without it
        _cancel_stage_run(fr.id, f"its pipeline stopped waiting for it ({type(exc).__name__})", name, logger)
        raise


def _cancel_created_run(idempotency_key: str, why: str, name: str, logger: Any, *, look_s: float = 2.0) -> str | None:
    """Cancel the stage run created with `idempotency_key`, if the server has one: its creation was
    interrupted, or failed after the server took it. Looks for up to `look_s` seconds (the request may
    still be on its way). Returns the run's id, or None. Never raises an Exception."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterIdempotencyKey

    end = time.monotonic() + look_s
    try:
        with get_client(sync_client=True) as client:
            while True:
                found = client.read_flow_runs(flow_run_filter=FlowRunFilter(idempotency_key=FlowRunFilterIdempotencyKey(any_=[idempotency_key])), limit=1)
                if found or time.monotonic() >= end:
                    break
                time.sleep(0.25)
    except Exception as exc:  # noqa: BLE001 - say so, do not hang on it
        logger.warning("stage %s: could not look for the run its interrupted creation may have left: %s", name, exc)
        return None
    if not found:
        return None
    fid = found[0].id
    done = _cancel_stage_run(fid, why, name, logger)
    logger.warning("stage %s: its run %s was created as the pipeline stopped: %s", name, fid, done)
    return str(fid)


#: stage runs that crashed after a Cancelling and were not marked Cancelled, from `_settled_after_cancel`
#: until the pipeline that waited for the run takes the entry (`_took_cancel`): a long-lived process
#: (a flow server running pipelines nightly) kept one entry per such run for ever
_TOLD_TO_CANCEL: set[str] = set()


def _took_cancel(flow_run_id: Any) -> bool:
    """Whether `_settled_after_cancel` found the stage run `flow_run_id` told to cancel; the entry goes."""
    try:
        _TOLD_TO_CANCEL.remove(str(flow_run_id))
    except KeyError:
        return False
    return True


def _settled_after_cancel(client: Any, fr: Any, wait_s: float = 5.0) -> Any:
    """A stage run cancelled while it ran (`prefect flow-run cancel`, the UI) goes Cancelling, then
    Crashed ("Execution was aborted by a termination signal": its engine reporting the worker's SIGTERM),
    then Cancelled (the worker, a moment later). The pipeline read the Crashed state and failed the stage
    as a crash. After a Cancelling, wait up to `wait_s` for the Cancelled; if it does not come, the
    run is remembered as told to cancel (`_stage_error` says so)."""
    try:
        from prefect.client.schemas.objects import StateType

        if not any(s.type == StateType.CANCELLING for s in client.read_flow_run_states(fr.id)):
            return fr
        end = time.monotonic() + wait_s
        while True:
            cur = client.read_flow_run(fr.id)
            if cur.state is not None and cur.state.is_cancelled():
                return cur
            if time.monotonic() >= end:
                break
            time.sleep(0.25)
        _TOLD_TO_CANCEL.add(str(fr.id))
    except Exception:  # noqa: BLE001 - the crash is reported as it was
        pass
    return fr


def _cancel_stage_run(flow_run_id: Any, why: str, name: str, logger: Any, *, wait_s: float = 0.0) -> str:
    """Cancel a stage's run unless it has ended: a Scheduled one at once, a started one through
    Cancelling (its worker kills its process and marks it Cancelled); with `wait_s`, wait that long
    for it to end. Returns what was done, for messages. Never raises an Exception (the pipeline may be
    going away)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling

    try:
        with get_client(sync_client=True) as client:  # a new client: the wait's may have been interrupted mid-request
            state = client.read_flow_run(flow_run_id).state
            if state is not None and state.is_final():
                return f"already {state.name}"
            scheduled = state is None or state.is_scheduled()
            client.set_flow_run_state(flow_run_id, (Cancelled if scheduled else Cancelling)(message=why), force=True)
            if scheduled:
                return "cancelled"
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                state = client.read_flow_run(flow_run_id).state
                if state is not None and state.is_final():
                    return f"cancelled (it ended {state.name})"
                time.sleep(0.25)
            if wait_s > 0:
                logger.warning("stage %s: its run %s was told to cancel %.0fs ago and has not ended yet", name, flow_run_id, wait_s)
            return "told to cancel"
    except Exception as exc:  # noqa: BLE001 - say so, do not hang on it
        logger.warning("stage %s: could not cancel its run %s: %s", name, flow_run_id, exc)
        return "not cancelled (the server did not answer)"


def read_placement_labels(flow_run_id: str) -> dict[str, str] | None:
    """The stage flow run's labels if the worker's placement labels are among them, else None."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            labels = dict(getattr(client.read_flow_run(flow_run_id), "labels", None) or {})
    except Exception:  # bookkeeping only: the stage's own outcome is already known
        return None
    return labels if "qosflow.host" in labels else None


def apply_placement_labels(rec: StageRecord, labels: Mapping[str, str]) -> None:
    """Copy the placement the worker wrote on the stage's flow run (labels `qosflow.*`) into `rec`."""
    rec.host = labels.get("qosflow.host")
    rec.gpus = [g for g in (labels.get("qosflow.gpus") or "").split(",") if g and g != "-"]
    rec.cpu_cores = label_float(labels.get("qosflow.cpu_cores"))
    rec.virtual_gpus = labels.get("qosflow.virtual_gpus") == "true" if "qosflow.virtual_gpus" in labels else None
    rec.requested_gpus = label_int(labels.get("qosflow.requested_gpus"))
    rec.grad_accumulation = label_int(labels.get("qosflow.grad_accumulation"))
    rec.predicted_s = label_float(labels.get("qosflow.predicted_s"))
    rec.placed = label_float(labels.get("qosflow.placed_at"))
    rec.queued = label_float(labels.get("qosflow.queued_at"))
    # the worker launches the stage's process right after placing it: that is when the stage starts
    # (predictions cover the process start-up too); the engine's own start is kept as engine_started
    rec.started = rec.placed or rec.engine_started


def _build(fn: Callable, qos_kw: dict[str, Any], explicit: Iterable[str], stage_kw: dict[str, Any], task_kw: dict[str, Any],
           *, at: str | None = None) -> QoSTask:
    where = (f"@qos_task at {at}" if at else "@qos_task") if fn is _placeholder else f"@qos_task {getattr(fn, '__qualname__', fn)!r}"
    unknown = sorted(set(task_kw) - _TASK_PARAMS)
    if unknown:
        raise SpecError(unknown[0], f"not a QoS argument nor a @task argument; QoS: {', '.join(_SPEC_ARGS + STAGE_FIELDS)}", where=where)
    spec = build_spec(where, **qos_kw)
    stage_kw = stage_durations(stage_kw)
    check_stage_args(
        where,
        spec,
        expected_duration=stage_kw.get("expected_duration"),
        batch_size=stage_kw.get("batch_size"),
        early_check=stage_kw.get("early_check"),
        retries=task_kw.get("retries"),
        retry_delay_seconds=task_kw.get("retry_delay_seconds"),
        timeout_seconds=task_kw.get("timeout_seconds"),
        tags=task_kw.get("tags"),
        name=task_kw.get("name"),
    )
    exp = stage_kw.get("expected_duration")
    chk = stage_kw.get("early_check")
    return QoSTask(fn, qos=spec, explicit=explicit, expected_duration=None if exp is None else float(exp), batch_size=stage_kw.get("batch_size"),
                   early_check=None if chk is None else float(chk), **task_kw)


def qos_task(
    __fn: Callable | None = None,
    *,
    gpus: int = 1,
    min_gpus: int | None = None,
    gpu_milli: int = 1000,
    gpu_mem_mb: float | None = None,
    cpu_cores: float = 1.0,
    mem_mb: float = 0.0,
    deadline: Duration | None = None,
    latency_slo: Duration | None = None,
    min_throughput: float | None = None,
    priority: str | int | PriorityClass = "normal",
    shareable: bool = False,
    gang: bool = True,
    gpu_model: str | None = None,
    expected_duration: Duration | None = None,
    batch_size: int | None = None,
    early_check: Duration | None = None,
    user: str | None = None,
    **task_kwargs: Any,
):
    """Declare a pipeline stage with its QoS; everything `@task` takes is accepted too.

    `user` names who the stage runs for (fairness between users: the qosflow policy lets other users'
    stages go first while this user holds more than their share of the GPUs). Usually left unset: the
    stage then takes its pipeline run's `user:NAME` tag (`prefect deployment run ... --tag user:alice`,
    `with tags("user:alice")`, or the deployment's tags), else its pipeline's deployment
    (`FLOW/DEPLOYMENT`), else no user.

    `early_check=S` runs the stage for S seconds on one GPU before it takes its full placement, so
    that a user error fails it early (0: never; unset: the pool's QoS policy decides for new
    multi-GPU stages). The stage sees `QOSFLOW_EARLY_CHECK=1` while it is checked.

    `min_gpus=N` (elastic start) lets a stage of `gpus=G` whole GPUs start on fewer of them, W of them
    with W a divisor of G and at least N, when its full width is not free and the policy judges the
    narrower run still meets its deadline, or, on a cluster where G GPUs can never be free together,
    on the widest such W that fits (with or without a deadline; the qosflow policy only: baselines
    start every stage on all its GPUs). It then runs G // W steps of gradient accumulation per
    optimizer step, so that the global batch is unchanged: the stage reads the factor with
    `qosflow.accumulation_steps()` and the GPUs it got with `qosflow.granted_gpus()`.

    Durations (`deadline`, `latency_slo`, `expected_duration`, `early_check`) are seconds, a
    `datetime.timedelta` or a string such as ``"90s"``, ``"15min"``, ``"2h"`` or ``"1h30m"``.

    Bad arguments raise `SpecError` here, at decoration time, naming the argument.
    """
    qos_kw = {k: v for k, v in locals().items() if k in _SPEC_ARGS}  # the parameters: nothing else is bound yet
    explicit = {k for k, v in qos_kw.items() if v != _QOS_DEFAULTS[k]}  # what a pipeline's defaults must not override
    stage_kw = dict(expected_duration=expected_duration, batch_size=batch_size, early_check=early_check)
    if __fn is not None:
        if not callable(__fn):
            raise SpecError("fn", f"@qos_task decorates a function, got {__fn!r}")
        return _build(__fn, qos_kw, explicit, stage_kw, task_kwargs)
    # validate now, even before the function is known (decoration time); the error names the decorator's line
    caller = sys._getframe(1)
    _build(_placeholder, qos_kw, explicit, stage_kw, task_kwargs, at=f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")

    def deco(fn: Callable) -> QoSTask:
        return _build(fn, qos_kw, explicit, stage_kw, task_kwargs)

    return deco


#: qos_task's own defaults of the QoS arguments
_QOS_DEFAULTS = {k: p.default for k, p in inspect.signature(qos_task).parameters.items() if k in _SPEC_ARGS}


def _placeholder() -> None:  # used to validate arguments before the function is known
    return None


# ------------------------------------------------------------------------------------ the flow
#: a duration argument: seconds, a timedelta, or a string such as '90s', '15min', '2h', '1h30m'
Duration = float | str | timedelta


def _pipeline_deadline(value: Any, name: str, where: str) -> float | None:
    """A pipeline deadline in seconds (a number, a timedelta or a string such as '2h'), or None."""
    d = to_seconds(value)
    if d is None:
        return None
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d <= 0:
        raise SpecError(name, f"must be a positive number of seconds after the pipeline starts or a duration ({DURATION_FORMS}), got {value!r}{number_hint(name, value, duration=True)}", where=where)
    return float(d)


def qos_flow(
    __fn: Callable | None = None,
    *,
    deadline: Duration | None = None,
    priority: str | int | PriorityClass | None = None,
    pool: str | None = None,
    plan: Mapping[str, Sequence[str]] | None = None,
    **flow_kwargs: Any,
):
    """A Prefect flow whose `@qos_task` stages are placed by the `qosflow` worker of `pool`.

    `deadline` (seconds after the run starts, a timedelta or a string such as ``"2h"``) is split into stage deadlines along the critical path of
    `plan` (stage name -> upstream stage names; default: the DAG recorded from the previous run).
    `priority` is the class of stages that do not set one. A flow parameter named `qos_deadline` or
    `qos_priority` overrides them per run; a QoS policy block referenced by the deployment's job
    variables (`qos_policy`) gives defaults. `pool` defaults to `QOSFLOW_POOL`, else, for a run deployed on
    a qosflow work pool, that pool; with no pool, stages run in-process.
    """
    if __fn is None:  # @qos_flow(...): the error names the decorator's line, as @qos_task's does
        caller = sys._getframe(1)
        where = f"@qos_flow at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
    else:
        where = f"@qos_flow {getattr(__fn, '__qualname__', __fn)!r}"
    deadline = _pipeline_deadline(deadline, "deadline", where)
    prio = None if priority is None else PriorityClass.parse(priority, where=where)
    if pool is not None and (not isinstance(pool, str) or not pool.strip()):
        raise SpecError("pool", f"must be a work pool name, got {pool!r}", where=where)
    if plan is not None:
        if not isinstance(plan, Mapping):
            raise SpecError("plan", f"must map stage names to lists of upstream stage names, got {type(plan).__name__}", where=where)
        for k, v in plan.items():
            if isinstance(v, str) or not all(isinstance(x, str) for x in v):
                raise SpecError("plan", f"stage {k!r}: upstream stages must be a list of names, got {v!r}", where=where)
            for x in v:
                if x not in plan:
                    raise SpecError("plan", f"stage {k!r} depends on {x!r}, which is not in the plan", where=where)
        try:
            split_deadline({k: StageNode(k, 1.0, tuple(v)) for k, v in plan.items()}, 1.0)
        except ValueError as exc:
            raise SpecError("plan", str(exc), where=where) from None
    unknown = sorted(set(flow_kwargs) - _FLOW_PARAMS)
    if unknown:
        raise SpecError(unknown[0], "not a qos_flow nor a @flow argument", where=where)

    def deco(fn: Callable):
        if inspect.iscoroutinefunction(fn):
            raise SpecError("fn", "async pipelines are not supported yet; write the pipeline flow as a plain function", where=where)
        sig = inspect.signature(fn)
        flow_name = flow_kwargs.get("name") or fn.__name__.replace("_", "-")

        @functools.wraps(fn)
        def pipeline(*args: Any, **kwargs: Any) -> Any:
            from prefect.context import FlowRunContext

            bound = sig.bind_partial(*args, **kwargs)
            bound.apply_defaults()
            policy = _policy_defaults()
            d = bound.arguments.get("qos_deadline", None)
            run_where = f"@qos_flow {flow_name!r}, run parameter"
            d = _pipeline_deadline(d, "qos_deadline", run_where)
            d = d if d is not None else deadline if deadline is not None else policy.get("deadline_s")
            pr = bound.arguments.get("qos_priority", None)
            pr = _run_priority(pr, run_where) if pr is not None else prio if prio is not None else (PriorityClass.parse(policy["priority"]) if policy.get("priority") else None)
            ctx = FlowRunContext.get()
            fid = str(ctx.flow_run.id) if ctx and ctx.flow_run else f"local-{time.time_ns()}"
            name = ctx.flow_run.name if ctx and ctx.flow_run and ctx.flow_run.name else flow_name
            the_plan, expected = (plan, {}) if plan else _recorded_plan(flow_name)
            expected = dict(expected)
            for t in _stages_used_by(fn):  # declared durations of planned stages not dispatched yet
                if the_plan and t.name in the_plan and t.expected_duration and t.name not in expected:
                    expected[t.name] = float(t.expected_duration)
            run_pool = pool or os.environ.get("QOSFLOW_POOL")
            source = "@qos_flow(pool=...)" if pool else "QOSFLOW_POOL" if run_pool else None
            if not run_pool and not _in_stage_process() and ctx is not None and ctx.flow_run is not None:
                # deployed on a qosflow pool without QOSFLOW_POOL: its stages ran in the pipeline's own
                # process, unplaced (no GPU slot, no QoS), without a word
                run_pool = _deployed_on_qosflow_pool(ctx.flow_run)
                if run_pool:
                    source = "the work pool this run was deployed on"
                    _run_logger("qosflow").info(
                        "stages go to work pool %r, the qosflow pool this run was deployed on (QOSFLOW_POOL or "
                        "@qos_flow(pool=...) chooses another)", run_pool)
            if not run_pool and not _in_stage_process() and ctx is not None and ctx.flow_run is not None and _stages_used_by(fn):
                # e.g. `pipeline.serve()` (its runs are on no work pool) started from a shell without
                # QOSFLOW_POOL: every stage ran in the pipeline's process, on no GPU slot, and nothing said so
                _run_logger("qosflow").warning(
                    "no qosflow pool for this run (neither @qos_flow(pool=...), QOSFLOW_POOL nor a qosflow work pool it "
                    "was deployed on): its stages run in this process, like plain @task's, not placed by a qosflow worker")
            if run_pool and not _in_stage_process():
                # a missing pool or one of another type fails the pipeline here, once: found at a stage's dispatch it
                # was retried as the stage's error (its retries used up) and the pipeline ended "UnfinishedRun: PENDING"
                try:
                    ensure_stage_deployment(run_pool)
                except SpecError as exc:
                    if exc.field != "pool" or source is None:
                        raise
                    # say where the name came from: a typo in the deployment's env was answered "create it"
                    raise SpecError("pool", f"{str(exc).split('invalid pool: ', 1)[-1]}; the pool's name came from {source}") from None
            if policy:
                _say_what_the_policy_block_sets(policy, d, pr, run_pool)
            run = PipelineRun(name, fid, deadline=None if d is None else float(d), priority=pr, pool=run_pool, plan=the_plan, expected=expected,
                              due=deadline_from(ctx.flow_run if ctx is not None else None))
            run.flow_name = flow_name
            run.register()
            enclosing = _enter_pipeline(run)
            ok = False
            try:
                result = fn(*args, **kwargs)
                result = _resolve(result)
                ok = True
                return result
            except UnfinishedRun as exc:
                # a stage that failed or was cancelled leaves the stages after it NotReady, and the pipeline
                # failed "UnfinishedRun: Run is in PENDING state, its result is not available", naming no stage
                cause = run.first_stage_error()
                if cause is None:
                    raise
                raise (StageCancelled if cause.error.startswith("StageCancelled") else StageFailed)(
                    f"stage {cause.name!r} did not complete ({cause.error}), so the stages that need its result did not "
                    f"run ({type(exc).__name__}: {exc})") from exc
            finally:
                try:
                    run.finish(ok)
                except Exception as exc:  # the server away at the end: the pipeline's own outcome stands
                    _run_logger("qosflow").warning("pipeline %s: could not record its end (artifacts, events, plan): %s", name, exc)
                finally:  # a raising finish() left the run registered, so current() answered it ever after
                    run.unregister()
                    _leave_pipeline(enclosing)

        _resolved_signature(pipeline, fn)
        return prefect_flow(pipeline, **flow_kwargs)

    if __fn is not None:
        return deco(__fn)
    return deco


# (module functions, pickled by reference: the pipeline's wrapper is pickled by value, with the globals it
# names, by `pipeline.serve()`'s runner, and a ContextVar does not pickle)
def _enter_pipeline(run: PipelineRun) -> Any:
    return _ENCLOSING_PIPELINE.set(run)


def _leave_pipeline(token: Any) -> None:
    _ENCLOSING_PIPELINE.reset(token)


def _resolved_signature(wrapper: Callable, fn: Callable) -> None:
    """Give the pipeline's wrapper `fn`'s signature with its annotations resolved in `fn`'s module.

    Prefect validates a flow's parameters with a model built from the signature (`inspect.signature`
    follows `__wrapped__` to `fn`) and resolves string annotations (`from __future__ import
    annotations`) in the flow function's globals: the wrapper's are this module's, so a pipeline
    taking a pydantic model failed every run with "`Pydantic_PipelineModel` is not fully defined;
    you should define `Params`". An annotation not resolvable yet (a name defined further down, or
    only under TYPE_CHECKING) is left as it was written, as Prefect leaves it."""
    try:
        sig = inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 - resolve what can be, one parameter at a time
        sig = inspect.signature(fn)
        hints = {}
        for k, v in getattr(fn, "__annotations__", {}).items():
            if isinstance(v, str):
                try:
                    hints[k] = eval(v, fn.__globals__)  # noqa: S307 - what typing.get_type_hints does
                except Exception:  # noqa: BLE001
                    continue
        sig = sig.replace(parameters=[p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()])
    wrapper.__signature__ = sig  # type: ignore[attr-defined]


def _run_priority(value: Any, where: str) -> PriorityClass:
    try:
        return PriorityClass.parse(value)
    except SpecError as exc:
        raise SpecError("qos_priority", str(exc).split(": ", 1)[-1], where=where) from None


def _stages_used_by(fn: Callable) -> list[QoSTask]:
    """The `@qos_task` stages a pipeline function names (globals or closure)."""
    code = fn.__code__
    found = [fn.__globals__.get(n) for n in code.co_names]
    found += [c.cell_contents for c in (fn.__closure__ or ()) if _cell_set(c)]
    return [t for t in found if isinstance(t, QoSTask)]


def _cell_set(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _resolve(x: Any) -> Any:
    """Wait for futures a pipeline returns (so the run ends when its stages do)."""
    from prefect.futures import PrefectFuture

    if isinstance(x, PrefectFuture):
        return x.result()
    if isinstance(x, (list, tuple)):
        return type(x)(_resolve(v) for v in x)
    if isinstance(x, dict):
        return {k: _resolve(v) for k, v in x.items()}
    return x


def _policy_defaults() -> dict[str, Any]:
    raw = os.environ.get("QOSFLOW_QOS_POLICY")
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {}


def _say_what_the_policy_block_sets(policy: Mapping[str, Any], deadline: Any, priority: Any, pool: str | None) -> None:
    """Log, on the pipeline's run, what its deployment's QoS policy block set: a user who put
    `estimator: history` in the `nightly` block saw the stages run with the worker's `learned`."""
    logger = _run_logger("qosflow")
    from qosflow.prefect.blocks import QoSPolicy

    # off their default only: `prefect deploy` copies the whole block, so every nightly run was told that its
    # at_risk_margin, coda_feedback, early_check_*, ... (all at their defaults) were the worker's settings
    worker_side = QoSPolicy.worker_settings_given(policy)
    logger.info(
        "QoS policy block: this run's deadline %s and class %s%s",
        "none" if deadline is None else f"{float(deadline):g}s", getattr(priority, "value", priority) or "default",
        "" if not worker_side else
        f"; its {', '.join(worker_side)} are the worker's settings: they apply in the pool's policy block "
        f"({pool or 'POOL'}-policy, which qosflow init --pool {pool or 'POOL'} --policy ... --estimator ... writes), not per pipeline",
    )


def register_expected(run: PipelineRun, stages: Iterable[QoSTask]) -> None:
    for t in stages:
        if t.expected_duration:
            run.expected[t.name] = t.expected_duration

"""The flow every dispatched stage runs as: `qosflow-stage`, one deployment per `qosflow` pool.

The parent (pipeline) flow writes the stage's function and its arguments to Prefect's result storage
(cloudpickle), then creates a run of this deployment with the stage's QoS as job variables. The
worker queues it, places it and starts it as its own process with the placement's environment; the
stage's return value is persisted by Prefect and read back by the parent.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import cloudpickle
from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

STAGE_FLOW_NAME = "qosflow-stage"
ENTRYPOINT = "qosflow.prefect.stage.qosflow_stage"
PAYLOAD_PREFIX = "qosflow-payloads"


def _storage():
    from prefect.results import get_default_result_storage

    return get_default_result_storage()


def _call(fn_name: str, *args: Any):
    from prefect.utilities.asyncutils import run_coro_as_sync

    storage = _storage()
    out = getattr(storage, fn_name)(*args)
    if hasattr(out, "__await__"):
        out = run_coro_as_sync(out)
    return out


def _import_root(fn: Any) -> str | None:
    """The sys.path entry the stage function's module was imported from.

    `prefect deploy` loads an entrypoint such as `flows/retrain.py:retrain` as the top-level module
    `retrain` with `flows/` put on the pipeline process's sys.path; the stage process, started by the
    worker, does not have it, and cloudpickle refers to that module's functions by name. A module whose
    name is not importable at all (Prefect's `__prefect_loader_...__` fallback) is pickled by value.
    """
    name = getattr(fn, "__module__", None)
    mod = sys.modules.get(name or "")
    file = getattr(mod, "__file__", None)
    if mod is None or not file or name == "__main__":
        return None
    path = Path(file).resolve()
    parts = name.split(".")
    root = path.parent if path.name != "__init__.py" else path.parent.parent
    for _ in parts[:-1]:
        root = root.parent
    if root.joinpath(*parts[:-1], parts[-1] + ".py") != path and root.joinpath(*parts, "__init__.py") != path:
        cloudpickle.register_pickle_by_value(mod)  # not importable by its name anywhere
        return None
    return str(root)


def pack_payload(fn: Any, args: tuple, kwargs: dict, *, log_prints: bool = True) -> bytes:
    """The stage's function and arguments, with the sys.path entry its module came from and whether the
    stage run logs its prints (`log_prints`: the task's, else its pipeline flow's, else True)."""
    root = _import_root(fn)
    body = cloudpickle.dumps((fn, args, kwargs))
    return cloudpickle.dumps({"qosflow_payload": 2, "sys_path": [root] if root else [], "body": body,
                              "log_prints": bool(log_prints)})


def unpack_payload(raw: bytes) -> tuple[Any, tuple, dict]:
    return _unpack(raw)[0]


def _unpack(raw: bytes) -> tuple[tuple[Any, tuple, dict], bool]:
    """(fn, args, kwargs) and whether to log prints (True for a payload written before that was in it)."""
    data = cloudpickle.loads(raw)
    if not (isinstance(data, dict) and data.get("qosflow_payload") == 2):
        return data, True  # written by an older qosflow
    for entry in data["sys_path"]:  # where the pipeline imported the stage's module from
        if entry not in sys.path and os.path.isdir(entry):
            sys.path.append(entry)
    return cloudpickle.loads(data["body"]), bool(data.get("log_prints", True))


def write_payload(fn: Any, args: tuple, kwargs: dict, *, log_prints: bool = True) -> str:
    key = f"{PAYLOAD_PREFIX}/{uuid.uuid4().hex}.pkl"
    _call("write_path", key, pack_payload(fn, args, kwargs, log_prints=log_prints))
    return key


def read_payload(key: str) -> tuple[Any, tuple, dict]:
    return unpack_payload(_call("read_path", key))


def delete_payload(key: str) -> None:
    base = getattr(_storage(), "basepath", None)
    if base:
        try:
            os.remove(os.path.join(os.path.expanduser(str(base)), key))
        except OSError:
            pass


class _ProgressMirror(threading.Thread):
    """Mirror the stage's progress file into a Prefect progress artifact (created on the first report)."""

    def __init__(self, path: str, stage: str, interval: float = 2.0):
        super().__init__(daemon=True, name="qosflow-progress")
        self.path, self.stage, self.interval = path, stage, interval
        self.stop = threading.Event()
        self.artifact_id = None
        self.last = -1.0
        # the stage flow's run context, for the artifact calls made from this thread: without it Prefect
        # warns that artifacts created outside of a flow run are deprecated (and will stop working)
        self.context = contextvars.copy_context()

    def push(self) -> None:
        from qosflow.placement_api import read_progress

        rec = read_progress(self.path)
        if not rec or not rec.get("total"):
            return
        pct = round(100.0 * min(1.0, float(rec["step"]) / float(rec["total"])), 1)
        if pct == self.last:
            return
        self.last = pct
        try:
            if self.artifact_id is None:
                from prefect.artifacts import create_progress_artifact

                self.artifact_id = create_progress_artifact(pct, description=f"progress of stage {self.stage}")
            else:
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self.artifact_id, pct)
        except Exception:
            pass

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.context.run(self.push)


def _elastic_note(plan: dict) -> str:
    """", started on 4 of 8 GPUs, gradient accumulation x2" for a stage started narrower than it asked."""
    from qosflow.placement_api import elastic_note

    note = elastic_note(plan.get("requested_gpus"), plan.get("grad_accumulation"))
    return f", started on {note}" if note else ""


def where_placed(p: Any) -> str:
    """Where a placed stage runs, for its log: 'host0: GPU 0,1 (virtual), 2 cores (cpuset [0, 1])', or
    'host0: no GPU, 1 core (cpuset [0])' for a CPU-only stage (it read 'GPU - (virtual), 1 cores')."""
    gpus = ",".join(str(g) for g in p.gpus)
    return "%s: %s, %g core%s (cpuset %s)%s%s%s" % (
        p.node,
        (f"GPU{'s' if len(p.gpus) > 1 else ''} {gpus}" + (" (virtual)" if p.virtual_gpus else "")) if gpus else "no GPU",
        p.cpu_cores,
        "" if p.cpu_cores == 1 else "s",
        list(p.cpuset),
        f", share {p.gpu_milli}/1000" if gpus and p.gpu_milli < 1000 else "",
        f", sub-batch plan {p.sub_batch}" if p.sub_batch else "",
        _elastic_note(p.raw),
    )


# log_prints=True here; a stage whose payload says log_prints=False runs its function in a copy of the run's
# context that says so (Prefect's patched print reads the context's flag at each call)
@flow(name=STAGE_FLOW_NAME, persist_result=True, result_serializer="pickle", log_prints=True, validate_parameters=False)
def qosflow_stage(payload: str, stage: str = "", pipeline: str = "") -> Any:
    """Run one `@qos_task` stage on the slot the qosflow worker placed it on."""
    from qosflow.placement_api import PROGRESS_FILE_ENV, placement

    logger = get_run_logger()
    p = placement()
    if p.placed:
        logger.info("stage %s on %s", stage, where_placed(p))
    (fn, args, kwargs), log_prints = _unpack(_call("read_path", payload))
    mirror = None
    if os.environ.get(PROGRESS_FILE_ENV):
        mirror = _ProgressMirror(os.environ[PROGRESS_FILE_ENV], stage)
        mirror.start()
    t0 = time.time()
    try:
        ctx = FlowRunContext.get()
        if log_prints or ctx is None:
            return fn(*args, **kwargs)
        with ctx.model_copy(update={"log_prints": False}):
            return fn(*args, **kwargs)
    finally:
        if mirror is not None:
            mirror.stop.set()
            mirror.push()
        logger.info("stage %s ran %.2fs", stage, time.time() - t0)

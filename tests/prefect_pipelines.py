"""Stage functions for tests/test_prefect_e2e.py (importable by the stage processes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from qosflow.prefect.tasks import qos_flow, qos_task


def _seen() -> dict:
    import qosflow

    p = qosflow.placement()
    return {
        "t0": time.time(),
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "QOSFLOW_NODE", "QOSFLOW_VIRTUAL_GPUS", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")},
        "affinity": sorted(os.sched_getaffinity(0)),
        "placement": {"node": p.node, "gpus": list(p.gpus), "cpu_cores": p.cpu_cores, "cpuset": list(p.cpuset), "placed": p.placed},
    }


@qos_task(gpus=0, cpu_cores=1, expected_duration=5, priority="guaranteed")
def load(n: int) -> dict:
    s = _seen()
    data = list(range(n))
    s["t1"] = time.time()
    return {"data": data, "seen": [("load", s)]}


@qos_task(gpus=1, cpu_cores=2, expected_duration=5, shareable=True, gpu_mem_mb=1000)
def train(d: dict) -> dict:
    s = _seen()
    import qosflow

    for i in range(5):
        qosflow.report_progress(i + 1, 5)
    s["t1"] = time.time()
    return {"model": sum(d["data"]), "seen": d["seen"] + [("train", s)]}


@qos_task(gpus=1, cpu_cores=1, expected_duration=5)
def evaluate(m: dict) -> dict:
    s = _seen()
    s["t1"] = time.time()
    return {"score": m["model"], "seen": m["seen"] + [("evaluate", s)]}


@qos_flow(name="e2e-three-stage", deadline=300, priority="guaranteed", plan={"load": [], "train": ["load"], "evaluate": ["train"]})
def three_stage(n: int = 10) -> dict:
    return evaluate.submit(train.submit(load.submit(n))).result()


@qos_task(gpus=1, cpu_cores=1, expected_duration=5, retries=1, retry_delay_seconds=0)
def flaky(marker: str) -> str:
    path = Path(marker)
    if not path.exists():
        path.write_text("failed once")
        raise RuntimeError("flaky stage: first attempt fails on purpose")
    return "ok on retry"


@qos_task(gpus=0, cpu_cores=1, expected_duration=5, retries=0)
def broken() -> None:
    raise ValueError("broken stage: always fails")


@qos_task(gpus=0, cpu_cores=1, expected_duration=5)
def sibling(x: int) -> int:
    return x * 2


@qos_flow(name="e2e-failures")
def failures(marker: str) -> dict:
    a = flaky.submit(marker)
    b = broken.submit()
    c = sibling.submit(21)
    out = {"flaky": a.result(), "sibling": c.result()}
    b.result()  # raises: the pipeline fails, after the others completed
    return out


@qos_task(gpus=1, cpu_cores=1, expected_duration=60)
def sleeper(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


def _check_mark(marker: str, event: str) -> None:
    import json

    rec = {"event": event, "check": os.environ.get("QOSFLOW_EARLY_CHECK") == "1", "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "stage_id": os.environ.get("QOSFLOW_STAGE_ID"), "pid": os.getpid(), "t": time.time()}
    with open(marker, "a") as f:
        f.write(json.dumps(rec) + "\n")


@qos_task(gpus=2, cpu_cores=1, expected_duration=5, early_check=1.5, retries=0)
def big_bad(marker: str) -> None:
    """A 2-GPU stage with a user error in its first seconds: the early check catches it on one GPU."""
    _check_mark(marker, "start")
    raise ValueError("bad input: a user error the early check catches")


@qos_task(gpus=2, cpu_cores=1, expected_duration=5, early_check=3)
def big_good(marker: str, secs: float) -> str:
    """A 2-GPU stage that runs fine: its check passes (stopped after 3 s), then it runs on both GPUs."""
    _check_mark(marker, "start")
    time.sleep(secs)
    _check_mark(marker, "done")
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


@qos_task(gpus=2, cpu_cores=1, expected_duration=5, early_check=1, retries=0)
def big_late_bad(marker: str, fail: bool) -> str:
    """A 2-GPU stage whose user error (when `fail`) shows only after 1.5 s: after its early check."""
    _check_mark(marker, "start")
    time.sleep(1.5)
    if fail:
        raise ValueError("bad input: found late")
    return "ok"


@qos_flow(name="e2e-early-check-late")
def early_late(marker: str, fail: bool) -> str:
    return big_late_bad.submit(marker, fail).result()


@qos_flow(name="e2e-early-check-bad")
def early_bad(marker: str) -> None:
    big_bad.submit(marker).result()


@qos_flow(name="e2e-early-check-good")
def early_good(marker: str, secs: float = 6.0) -> str:
    return big_good.submit(marker, secs).result()


@qos_task(gpus=2, cpu_cores=1, expected_duration=60, early_check=120)
def big_sleeper(path: str) -> None:
    """A 2-GPU stage whose early check (120 s) is still running when the test cancels it."""
    Path(path).write_text(str(os.getpid()))
    time.sleep(300)


@qos_task(gpus=1, cpu_cores=1, expected_duration=5)
def lingering(seconds: float) -> str:
    """Reports its end, then its process takes `seconds` more to exit (as a stage whose data-loader
    workers shut down slowly does)."""
    import atexit

    atexit.register(time.sleep, seconds)
    return "done"


@qos_flow(name="e2e-lingering")
def lingering_pipeline(seconds: float = 4.0) -> str:
    return lingering.submit(seconds).result()


@qos_task(gpus=1, cpu_cores=1, expected_duration=8)
def napper(seconds: float) -> float:
    """Holds its (only) GPU for `seconds`, reporting its progress every half second: a second one waits in
    the QoS queue meanwhile."""
    import qosflow

    steps = max(1, round(seconds / 0.5))
    for step in range(1, steps + 1):
        time.sleep(seconds / steps)
        qosflow.report_progress(step, steps)
    return seconds


@qos_flow(name="status-two-nappers", deadline=600)
def two_nappers(seconds: float = 8.0) -> list:
    a, b = napper.submit(seconds), napper.submit(seconds)
    return [a.result(), b.result()]


@qos_task(gpus=2, cpu_cores=1, expected_duration=20)
def gpu_holder(marker: str, release: str) -> str:
    """Holds 2 GPUs until `release` exists (at most 120 s); writes `marker` once it runs."""
    Path(marker).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    end = time.time() + 120
    while not Path(release).exists() and time.time() < end:
        time.sleep(0.1)
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


@qos_task(gpus=4, min_gpus=2, cpu_cores=2, expected_duration=2, deadline=600)
def elastic_train() -> dict:
    """An elastic stage: what it was told about its width."""
    import qosflow

    out = {k: os.environ.get(k) for k in ("QOSFLOW_GPUS", "QOSFLOW_GRAD_ACCUMULATION", "CUDA_VISIBLE_DEVICES")}
    out.update(steps=qosflow.accumulation_steps(), granted=qosflow.granted_gpus())
    return out


@qos_flow(name="e2e-elastic", pool="e2e-elastic")
def elastic_pipeline(marker: str, release: str) -> dict:
    """`elastic_train` asks for 4 GPUs while `gpu_holder` holds 2 of the pool's 4."""
    held = gpu_holder.submit(marker, release)
    end = time.time() + 120
    while not Path(marker).exists() and time.time() < end:
        time.sleep(0.1)
    try:
        out = elastic_train.submit().result()
    finally:
        Path(release).touch()
    out["held"] = held.result()
    return out


@qos_task(gpus=0, cpu_cores=1, expected_duration=2, retries=0)
def quits_silently(marker: str) -> int:
    """A stage whose process ends with exit code 0 before its engine can report how the run ended (as a
    library calling os._exit(0) would): its flow run would stay Running, and its pipeline wait, for ever."""
    Path(marker).write_text(str(os.getpid()))
    os._exit(0)


@qos_flow(name="e2e-quits-silently")
def quits_silently_flow(marker: str) -> int:
    return quits_silently.submit(marker).result()


# ------------------------------------------------------------ a stage's timeout, and the stage's own exceptions
@qos_task(gpus=1, cpu_cores=1, expected_duration=2, timeout_seconds=12, retries=1, retry_delay_seconds=0)
def hangs(path: str) -> None:
    """Runs past its 12 s timeout: each attempt appends its pid to `path`. (The timeout counts from the
    stage's call: 4 s expired on a loaded machine while its engine was still starting, before this ran.)"""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(300)


@qos_flow(name="e2e-timeout")
def timeout_pipeline(path: str) -> None:
    return hangs.submit(path).result()


#: the exceptions `parse`'s retry_condition_fn was shown (it runs in the pipeline's process)
RETRY_CONDITION_SAW: list = []


def _note_exception(task, task_run, state) -> bool:
    RETRY_CONDITION_SAW.append(type(state.result(raise_on_failure=False)).__name__)
    return False


@qos_task(gpus=0, cpu_cores=1, expected_duration=2, retries=1, retry_condition_fn=_note_exception)
def parse(s: str) -> int:
    return int(s)  # ValueError on bad input


class NeedsTwoArgs(Exception):
    """Pickles, but does not unpickle (its __init__ wants two arguments, args holds one)."""

    def __init__(self, a: str, b: str):
        super().__init__(f"{a} and {b}")


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def odd_failure() -> None:
    raise NeedsTwoArgs("this", "that")


@qos_flow(name="e2e-stage-exceptions")
def stage_exceptions() -> dict:
    from qosflow.prefect.tasks import StageFailed

    out: dict = {}
    try:
        parse("abc")  # called directly
    except ValueError as exc:
        out["direct"] = (type(exc).__name__, str(exc), list(getattr(exc, "__notes__", [])))
    try:
        parse.submit("xyz").result()
    except ValueError as exc:
        out["submit"] = (type(exc).__name__, str(exc))
    try:
        odd_failure()
    except StageFailed as exc:  # the fallback: its exception does not unpickle here
        out["fallback"] = str(exc)
    out["ok"] = parse("42")
    return out


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def loud(marker: str) -> str:
    print(f"loud stage says {marker}")
    return marker


@qos_task(gpus=0, cpu_cores=1, expected_duration=2, log_prints=False)
def quiet(marker: str) -> str:
    print(f"quiet stage says {marker}")
    return marker


@qos_flow(name="e2e-log-prints")
def log_prints_pipeline(marker: str) -> list:
    """A stage's prints are logged on its run unless the stage says log_prints=False."""
    return [loud(marker), quiet(marker), quiet.with_options(log_prints=True, name="quiet-made-loud")(marker)]


# ---------------------------------------------------------------------------------------- a gang across hosts
@qos_task(gpus=8, gang=True, cpu_cores=1, expected_duration=3)
def wide_gang(marker: str, fail_rank: str = "") -> str:
    """8 GPUs: on two 4-GPU hosts, one process per host (tests/test_prefect_infra.py). Every rank marks that it ran."""
    import json

    import qosflow

    rank = os.environ.get("QOSFLOW_GANG_RANK", "")
    with open(marker, "a") as f:
        f.write(json.dumps({"event": "rank", "rank": rank, "pid": os.getpid(), "node": qosflow.placement().node}) + "\n")
    for _ in qosflow.track(range(2)):
        time.sleep(0.5)
    if rank == fail_rank:
        raise ValueError(f"rank {rank} found bad data")
    if fail_rank:  # (the others wait for it, as ranks of a training step do: stopped with the gang when it fails)
        time.sleep(60)
    return f"rank {rank}"


@qos_flow(name="wide-gang")
def wide_gang_pipeline(marker: str, fail_rank: str = "") -> str:
    return wide_gang(marker, fail_rank)

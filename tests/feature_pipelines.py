"""Stage functions and pipelines for tests/test_prefect_features.py (importable by the stage processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
from prefect import flow, get_run_logger, tags
from prefect.cache_policies import INPUTS
from prefect.utilities.annotations import allow_failure

from qosflow.prefect.tasks import qos_flow, qos_task

CALLS: list = []


class Params(pydantic.BaseModel):
    lr: float = 0.1
    epochs: int = 2


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def pid_of(x: int) -> dict:
    return {"x": x, "pid": os.getpid()}


@qos_task(gpus=0, cpu_cores=1, expected_duration=2, cache_policy=INPUTS, persist_result=True)
def cached(x: int, marker: str) -> int:
    with open(marker, "a") as f:
        f.write("ran\n")
    return x * 2


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def square(x: int) -> int:
    return x * x


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def boom(x: int) -> int:
    raise ValueError(f"boom {x}")


@qos_task(gpus=0, cpu_cores=1, expected_duration=2, task_run_name="fit-lr{p.lr}")
def fit(p: Params) -> Params:
    get_run_logger().info("fitting with lr=%s", p.lr)
    return Params(lr=p.lr * 2, epochs=p.epochs)


def _done(task, task_run, state):
    CALLS.append(("completed", task.name, task_run.name))


def _failed(task, task_run, state):
    CALLS.append(("failed", task.name, task_run.name))


@qos_task(gpus=0, cpu_cores=1, expected_duration=2, on_completion=[_done], on_failure=[_failed])
def hooked(x: int) -> int:
    if x < 0:
        raise ValueError("negative")
    return x


@qos_flow(name="feat-map")
def map_pipeline(xs: list[int]) -> list[int]:
    return [f.result() for f in square.map(xs)]


@qos_flow(name="feat-cache")
def cache_pipeline(marker: str) -> list[int]:
    a = cached(3, marker)
    b = cached(3, marker)
    return [a, b]


@qos_flow(name="feat-allow-failure")
def allow_failure_pipeline() -> dict:
    bad = boom.submit(1)
    after = square.submit(4, wait_for=[allow_failure(bad)])
    st = boom(2, return_state=True)
    return {"after": after.result(), "state": st.type.value, "exc": repr(st.result(raise_on_failure=False))}


@qos_flow(name="feat-tags", flow_run_name="tagged-{run_tag}")
def tags_pipeline(run_tag: str) -> int:
    with tags("ctx-" + run_tag):
        return square(3)


@qos_flow(name="feat-pydantic")
def pydantic_pipeline(p: Params) -> Params:
    return fit(p)


@flow(name="feat-inner")
def inner(x: int) -> dict:
    return pid_of(x)


@qos_flow(name="feat-nested")
def nested_pipeline(x: int) -> dict:
    return inner(x)


@qos_flow(name="feat-nested-pool-arg", pool="feat-gpu")
def nested_pipeline_pool_arg(x: int) -> dict:
    return inner(x)


@qos_flow(name="feat-hooks")
def hooks_pipeline() -> str:
    hooked(1)
    try:
        hooked(-1)
    except ValueError as exc:
        return str(exc)
    return "no error"


@flow(name="feat-async-caller")
async def async_caller(x: int) -> dict:
    return pid_of(x)


@qos_flow(name="feat-with-options")
def with_options_pipeline() -> dict:
    return pid_of.with_options(name="renamed", tags=["wo"], retries=1)(5)


@qos_task(gpus=0, cpu_cores=1, expected_duration=3, tags=["feat-lim"])
def hold(i: int) -> tuple:
    import time

    t0 = time.time()
    time.sleep(3)
    return (t0, time.time())


@qos_flow(name="feat-concurrency")
def concurrency_pipeline() -> list:
    return [f.result() for f in hold.map([1, 2])]


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def pausing(x: int) -> int:
    from prefect.flow_runs import pause_flow_run

    pause_flow_run(timeout=60)
    return x + 1


@qos_flow(name="feat-pause")
def pause_pipeline() -> int:
    return pausing(1)


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def fails_first(marker: str) -> str:
    if not os.path.exists(marker):
        Path(marker).write_text("x")
        raise RuntimeError("first run fails")
    return "ok"


@qos_flow(name="feat-flow-retries", retries=1, retry_delay_seconds=0)
def flow_retries_pipeline(marker: str) -> str:
    return fails_first(marker)


@qos_task(gpus=0, cpu_cores=1, expected_duration=2)
def sleeps(s: float) -> float:
    import time

    time.sleep(s)
    return s


@qos_flow(name="feat-flow-timeout", timeout_seconds=8)
def flow_timeout_pipeline() -> float:
    return sleeps(120)

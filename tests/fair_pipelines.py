"""Stage functions for tests/test_fair_share_prefect.py (importable by the stage processes)."""

from __future__ import annotations

from qosflow.prefect.tasks import qos_flow, qos_task


@qos_task(gpus=1, cpu_cores=1, expected_duration=2)
def tagged_step(x: int) -> int:
    return x + 1


@qos_task(gpus=1, cpu_cores=1, expected_duration=2, user="bob")
def bobs_step(x: int) -> int:
    return x + 2


@qos_flow(name="fair-users-pipe")
def fair_pipe(x: int = 1) -> tuple[int, int]:
    return tagged_step(x), bobs_step(x)

"""Tiny flows the Prefect benchmarks deploy (kept importable: the workers' subprocesses load them)."""

from prefect import flow


@flow(name="bench-noop")
def noop() -> int:
    return 1

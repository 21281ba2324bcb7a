"""A first user's `qosflow` pool whose `cluster_file` variable names a file that is not there (a typo, a file
not yet copied to the worker's host). `qosflow worker start` checked the pool and its cluster block but not
that file: it started, and its worker logged "invalid cluster: cannot read /srv/lab.yaml: No such file or
directory" every 5 s, naming neither the pool variable the path came from nor how to change it."""

from __future__ import annotations

import asyncio

import pytest

from qosflow.prefect.blocks import BareMetalGPUCluster


@pytest.fixture
def pool_with_a_missing_cluster_file(prefect_server, tmp_path):
    from qosflow.prefect.local import setup_pool

    pool, missing = "journey-missing-file", tmp_path / "lab.yaml"
    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1), cluster_file=str(missing)))
    return pool, missing


def _said(pool, missing):
    return (f"invalid cluster_file: the cluster_file variable of work pool {pool!r} names {str(missing)!r}: cannot read "
            f"{missing}: No such file or directory; correct the path in the pool's base job template (UI: work pool -> Edit), "
            "or clear it to use the pool's cluster_block")


def test_qosflow_worker_start_refuses_a_pool_whose_cluster_file_is_missing(pool_with_a_missing_cluster_file):
    """(A process of its own, so that a worker that does start is stopped by the timeout, not left running.)"""
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    pool, missing = pool_with_a_missing_cluster_file
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    got = subprocess.run([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool], env=env, capture_output=True,
                         text=True, timeout=50)
    assert got.returncode == 2, (got.returncode, got.stderr[-2000:])
    assert _said(pool, missing) in " ".join(got.stderr.split()), got.stderr[-2000:]


def test_a_worker_started_otherwise_names_the_pool_variable_in_its_setup_error(pool_with_a_missing_cluster_file):
    """`prefect worker start --pool P`: the worker still waits for the file (logged every 5 s), now saying where
    its path came from and how to change it."""
    from qosflow.errors import SpecError
    from qosflow.prefect.worker import QosflowWorker

    pool, missing = pool_with_a_missing_cluster_file

    async def go():
        async with QosflowWorker(work_pool_name=pool, create_pool_if_not_found=False) as w:
            await w.sync_with_backend()
            with pytest.raises(SpecError) as err:
                await w._ensure_qos()
        return str(err.value)

    assert asyncio.run(go()) == _said(pool, missing)

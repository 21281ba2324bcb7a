"""The mistakes of a first use, against the session's Prefect server: a pipeline run with no worker
says why its stage is not taken, and a Ctrl-C/SIGTERM ends it (and cancels the stage's run) instead
of leaving the process waiting forever; a stage of a pipeline run as a script learns under the name
its module has when imported."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PIPELINE = textwrap.dedent(
    """
    from qosflow import qos_flow, qos_task

    @qos_task(gpus=1, cpu_cores=1, expected_duration=5)
    def lonely(x):
        return x

    @qos_flow(name="dispatch-no-worker", pool="{pool}")
    def pipe():
        return lonely.submit(1).result()

    if __name__ == "__main__":
        pipe()
    """
)


@pytest.mark.slow
def test_a_stage_nobody_takes_is_explained_and_sigterm_ends_the_pipeline(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client

    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import setup_pool

    pool = "dispatch-no-worker"
    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1, cpu_cores=2), policy=QoSPolicy(policy="fifo")))
    script = tmp_path / "pipe.py"
    script.write_text(PIPELINE.replace("{pool}", pool))
    env = dict(os.environ, PREFECT_API_URL=prefect_server, QOSFLOW_STAGE_PICKUP_WARN_SECONDS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("QOSFLOW_POOL", None)
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while "waited" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        text = log.read_text()
        assert "no worker polls work pool 'dispatch-no-worker'" in text, text
        assert "qosflow worker start --pool dispatch-no-worker" in text
        proc.send_signal(signal.SIGTERM)
        try:  # before the fix: blocked for ever in the task runner's shutdown, waiting for the stage
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the pipeline did not end within 30 s of SIGTERM:\n" + log.read_text())
        text = log.read_text()
        assert "PipelineEnded" in text and "was cancelled" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs() if (r.name or "").endswith(".lonely")]
    assert runs and all(r.state is not None and r.state.is_cancelled() for r in runs), [(r.name, r.state) for r in runs]


def test_a_script_stage_learns_under_its_module_name_not_main(tmp_path):
    """`python -m flows.retrain` (the README's command) named every stage `__main__.load_data`, ..., so
    what the worker learned from it never counted for the same pipeline deployed (`retrain.load_data`)
    or imported (`flows.retrain.load_data`)."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pipe.py").write_text(textwrap.dedent(
        """
        from qosflow import qos_task

        @qos_task(gpus=0, expected_duration=1)
        def stage(x):
            return x

        print("SIGNATURE", stage.signature)
        """
    ))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))

    def sig(*args: str) -> str:
        out = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [line.split()[1] for line in out.stdout.splitlines() if line.startswith("SIGNATURE")][0]

    assert sig("-m", "mypkg.pipe") == "mypkg.pipe.stage"
    assert sig("-c", "import mypkg.pipe") == "mypkg.pipe.stage"
    assert sig(str(pkg / "pipe.py")) == "pipe.stage"  # as `prefect deploy` loads mypkg/pipe.py:flow

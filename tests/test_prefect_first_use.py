"""The mistakes of a first use, against the session's Prefect server: a pipeline run with no worker
says why its stage is not taken, and a Ctrl-C/SIGTERM ends it (and cancels the stage's run) instead
of leaving the process waiting forever; a worker whose pool does not exist (yet) says how to create it;
a worker stopped mid-stage puts the stage back in the queue; a stage of a pipeline run as a script
learns under the name its module has when imported; a stage's progress artifact has its run's context."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qosflow import qos_task

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

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


def _pipeline_waiting_for_a_worker(prefect_server, tmp_path, pool: str, script_text: str):
    """A pipeline process on `pool` (a virtual 1-GPU pool, no worker) once its stage has been logged as
    waited for: (process, log path)."""
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import setup_pool

    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1, cpu_cores=2), policy=QoSPolicy(policy="fifo")))
    script = tmp_path / "pipe.py"
    script.write_text(script_text)
    env = dict(os.environ, PREFECT_API_URL=prefect_server, QOSFLOW_STAGE_PICKUP_WARN_SECONDS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("QOSFLOW_POOL", None)
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 90
    while "waited" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    return proc, log


@pytest.mark.slow
def test_a_stage_nobody_takes_is_explained_and_sigterm_ends_the_pipeline(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client

    pool = "dispatch-no-worker"
    proc, log = _pipeline_waiting_for_a_worker(prefect_server, tmp_path, pool, PIPELINE.replace("{pool}", pool))
    try:
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
        runs = [r for r in _pool_runs(client, pool) if (r.name or "").endswith(".lonely")]
    assert runs and all(r.state is not None and r.state.is_cancelled() for r in runs), [(r.name, r.state) for r in runs]



def _pool_runs(client, pool: str) -> list:
    """The flow runs of work pool `pool`. (read_flow_runs() without a filter is one page, the server's default
    limit, of the session server's runs: every test's, so the ones looked for may fall outside it.)"""
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    return client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))

@pytest.mark.slow
def test_ctrl_c_cancels_a_stage_called_directly_that_no_worker_took(prefect_server, tmp_path):
    """A stage called directly (`lonely(1)`, not `.submit`) waits in the pipeline's own thread: Ctrl-C
    crashed the pipeline but left the stage's run Scheduled, and a worker started later ran it (and
    failed: the pipeline had deleted its payload). Its run is cancelled."""
    from prefect.client.orchestration import get_client

    pool = "direct-no-worker"
    proc, log = _pipeline_waiting_for_a_worker(
        prefect_server, tmp_path, pool, PIPELINE.replace("{pool}", pool).replace("lonely.submit(1).result()", "lonely(1)")
        .replace("def lonely(", "def lonely_direct(").replace("return lonely(", "return lonely_direct("))
    try:
        assert "no worker polls work pool 'direct-no-worker'" in log.read_text(), log.read_text()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the pipeline did not end within 30 s of Ctrl-C:\n" + log.read_text())
        assert "KeyboardInterrupt" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    with get_client(sync_client=True) as client:
        runs = [r for r in _pool_runs(client, pool) if (r.name or "").endswith(".lonely_direct")]
    assert len(runs) == 1 and runs[0].state is not None and runs[0].state.is_cancelled(), [(r.name, r.state) for r in runs]


@pytest.mark.slow
def test_a_worker_whose_pool_does_not_exist_says_how_to_create_it(prefect_server):
    """`qosflow worker start` checks the pool first, unless the server did not answer yet: the worker
    then waits for it, and Prefect only said "Work pool 'gpu' not found!" every 30 s."""
    from qosflow.prefect.local import WorkerThread

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(level=logging.ERROR)
    logging.getLogger("prefect.workers").addHandler(handler)
    w = WorkerThread("not-created-yet", name="first-use-worker")
    w.start()
    try:
        deadline = time.monotonic() + 60
        while not any("qosflow init --pool not-created-yet" in m for m in seen) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any("work pool 'not-created-yet' does not exist; create it with `qosflow init --pool not-created-yet`" in m
                   for m in seen), seen
    finally:
        logging.getLogger("prefect.workers").removeHandler(handler)
        w.stop(drain=0)
    assert not w.is_alive()  # a worker thread stopped before its pool came ends too


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
    # run by its path, or loaded by its path as `prefect deploy`'s entrypoint mypkg/pipe.py:flow is (as
    # `pipe`): the same name, so the README's `python -m` runs and the deployment share what was learned
    assert sig(str(pkg / "pipe.py")) == "mypkg.pipe.stage"
    assert sig("-c", "import sys; sys.path.insert(0, 'mypkg'); import pipe") == "mypkg.pipe.stage"
    from prefect.utilities.importtools import load_script_as_module

    loaded = load_script_as_module(str(pkg / "pipe.py"))
    assert loaded.stage.signature == "mypkg.pipe.stage", loaded.__name__
    # a module outside any package keeps its name
    (tmp_path / "loose.py").write_text((pkg / "pipe.py").read_text())
    assert sig(str(tmp_path / "loose.py")) == "loose.stage"


@pytest.mark.slow
def test_a_stages_progress_artifact_belongs_to_its_run_without_a_deprecation_warning(prefect_server, tmp_path, monkeypatch):
    """The progress mirror posts from its own thread, which had no flow run context: every stage
    that reported progress printed Prefect's "Artifact creation outside of a flow or task run is
    deprecated" FutureWarning into the worker's output."""
    import warnings

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    from qosflow.placement_api import PROGRESS_FILE_ENV, write_progress
    from qosflow.prefect.stage import _ProgressMirror

    monkeypatch.setenv(PROGRESS_FILE_ENV, str(tmp_path / "progress.json"))

    @flow(name="first-use-progress")
    def reports() -> str:
        mirror = _ProgressMirror(str(tmp_path / "progress.json"), "s", interval=0.05)
        write_progress(3, 10)
        mirror.start()
        deadline = time.monotonic() + 30
        while mirror.artifact_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
        mirror.stop.set()
        mirror.join(5)
        return str(FlowRunContext.get().flow_run.id)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_id = reports()
    assert not [w for w in caught if "outside of a flow or task run" in str(w.message)], [str(w.message) for w in caught]
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

        arts = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])))
    assert any(str(a.flow_run_id) == run_id and a.data == 30.0 for a in arts), [(a.flow_run_id, a.data) for a in arts]


@qos_task(gpus=1, cpu_cores=1, expected_duration=5)
def stopped_midway(path: str) -> int:
    """Its first run sleeps (the worker is stopped under it); its next one returns at once."""
    p = Path(path)
    n = len(p.read_text().split()) if p.exists() else 0
    with p.open("a") as f:
        f.write(f"{os.getpid()}\n")
    if n == 0:
        time.sleep(120)
    return n + 1


@pytest.mark.slow
def test_a_worker_stopped_mid_stage_puts_it_back_in_the_queue_and_the_next_worker_runs_it(prefect_server, tmp_path, monkeypatch):
    """Ctrl-C on `qosflow worker start` killed the running stage and released its lease but left its
    flow run Running: no worker ever took it again and its pipeline waited for ever."""
    import threading

    from prefect.client.orchestration import get_client

    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool
    from qosflow.prefect.tasks import qos_flow

    pool = "first-use-stop"
    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1, cpu_cores=2), policy=QoSPolicy(policy="fifo"), stream_output=False))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    marks = tmp_path / "pids"

    @qos_flow(name="first-use-stop", pool=pool)
    def pipeline() -> int:
        return stopped_midway.submit(str(marks)).result()

    w1 = WorkerThread(pool).wait_ready(120)
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("state", pipeline(return_state=True)), daemon=True)
    th.start()
    w2 = None
    try:
        deadline = time.monotonic() + 120
        while not (marks.exists() and marks.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = int(marks.read_text().split()[0])
        fid = next(iter(w1.worker._handles))
        w1.stop(drain=0)
        try:  # gone, or a zombie not reaped yet (not exists() then open(): it may be reaped between the two)
            assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            pass
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(fid).state
        assert state.is_scheduled() and state.name == "AwaitingRetry" and "stopped" in (state.message or ""), state
        w2 = WorkerThread(pool).wait_ready(120)
        th.join(180)
        assert not th.is_alive()
        assert out["state"].is_completed() and out["state"].result() == 2, out["state"]
    finally:
        for w in (w1, w2):
            if w is not None and w.is_alive():
                w.stop(drain=0)


@pytest.mark.slow
def test_init_again_says_that_a_running_worker_keeps_its_old_cluster(prefect_server, capsys):
    """`qosflow init --pool gpu --hosts 2` while a worker ran said only "next: qosflow worker start":
    the running worker went on with the cluster it had started with."""
    from qosflow.cli.main import main
    from qosflow.prefect.local import WorkerThread

    pool = "first-use-reinit"
    assert main(["init", "--pool", pool]) == 0
    assert "next: qosflow worker start --pool first-use-reinit" in " ".join(capsys.readouterr().out.split())
    w = WorkerThread(pool, name="first-use-reinit-worker").wait_ready(120)
    try:
        assert main(["init", "--pool", pool, "--hosts", "2"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "first-use-reinit-worker of pool first-use-reinit keep the cluster and policy they started with: restart them" in out, out
    finally:
        w.stop(drain=0)


@pytest.mark.slow
def test_worker_start_with_a_missing_or_invalid_cluster_block_exits_with_the_fix(prefect_server, capsys):
    """`qosflow worker start --cluster-block nosuch` started, then logged the same error every 5 s
    (a bad --cluster-file was refused at once)."""
    import httpx

    from qosflow.cli.main import main
    from qosflow.prefect.blocks import BareMetalGPUCluster

    pool = "first-use-cluster-block"
    assert main(["init", "--pool", pool]) == 0
    capsys.readouterr()
    env = dict(os.environ, PREFECT_API_URL=prefect_server,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))

    def worker(block: str) -> subprocess.CompletedProcess:  # before: ran until the timeout
        return subprocess.run([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool, "--cluster-block", block],
                              capture_output=True, text=True, env=env, timeout=120)

    out = worker("no-such-cluster")
    assert out.returncode == 2 and "no cluster block named 'no-such-cluster'" in out.stderr, out.stderr
    good = BareMetalGPUCluster.virtual(1, 1, cpu_cores=2)
    good.save("first-use-bad-cluster", overwrite=True)
    doc = good._block_document_id
    with httpx.Client(base_url=prefect_server, timeout=30) as c:  # edited through the API into an invalid one
        data = c.get(f"/block_documents/{doc}").json()["data"]
        data["gpus_per_host"] = -3
        assert c.patch(f"/block_documents/{doc}", json={"data": data, "merge_existing_data": False}).status_code == 204
    out = worker("first-use-bad-cluster")
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "first-use-bad-cluster is invalid: gpus_per_host" in err, err

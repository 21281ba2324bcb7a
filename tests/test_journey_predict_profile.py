"""A user's journey with `qosflow profile` and the predictor's store: a real training stage profiled on the CPU,
what the store then shows, and the messages of a wrong interpreter or database."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from qosflow.errors import QosflowError
from qosflow.predict.profiler import detect_gpu, profile
from qosflow.predict.stage_report import stage_report
from qosflow.store import Store


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'qosflow.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def stages(tmp_path, monkeypatch):
    (tmp_path / "journey_stages.py").write_text(textwrap.dedent("""
        import qosflow_journey_no_such_dependency   # torch, on a Python that lacks it

        def train(steps=3):
            pass
    """))
    (tmp_path / "journey_plain.py").write_text(textwrap.dedent("""
        import time
        import qosflow

        def train(steps=3):
            for _ in qosflow.track(range(steps)):
                time.sleep(0.01)
    """))
    (tmp_path / "journey_workers.py").write_text(textwrap.dedent("""
        import multiprocessing as mp, time
        import qosflow

        def _worker(q):   # a DataLoader worker's part: CPU time of its own, and it lives until stopped
            t = time.process_time()
            while time.process_time() - t < 0.5:
                pass
            q.put(time.process_time())
            time.sleep(600)

        def train(steps=3):
            q = mp.get_context("fork").Queue()
            mp.get_context("fork").Process(target=_worker, args=(q,)).start()
            worker_cpu = q.get()
            with open("cpu.txt", "w") as f:
                f.write(f"{time.process_time()} {worker_cpu}")
            for _ in qosflow.track(range(steps + 100)):   # the profile stops it, and its worker
                time.sleep(0.01)
    """))
    (tmp_path / "journey_lost.py").write_text(textwrap.dedent("""
        import os, sqlite3, time
        import qosflow

        def train(steps=3):
            # the store breaks while the stage runs (here its sample table goes; a server going away is the same)
            con = sqlite3.connect(os.environ["JOURNEY_DB"])
            con.execute("DROP TABLE sample")
            con.commit()
            con.close()
            for _ in qosflow.track(range(steps)):
                time.sleep(0.01)
    """))
    (tmp_path / "journey_torch.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        import qosflow

        def train_cnn(steps=4, batch_size=16):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x, y = torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,))
            for step in range(1, steps + 1):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                qosflow.report_progress(step, steps)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_dependency_missing_from_the_python_that_profiles_names_that_python(stages):
    """The stage imports torch, installed in a venv, and `qosflow` ran from another Python: the message said
    "fix the module" of a module with nothing wrong in it."""
    with pytest.raises(QosflowError) as err:
        profile("journey_stages:train", 2, cores=[1], budget_s=60)
    msg = str(err.value)
    assert "imports 'qosflow_journey_no_such_dependency'" in msg and sys.executable in msg, msg
    assert "fix the module" not in msg and "-m qosflow profile journey_stages:train" in msg, msg


def test_a_profiled_only_stage_shows_its_step_time_per_core_count(url):
    """`qosflow predict stages` gave one median over the profile's core counts: 0.134 s for a CNN measured at
    0.053 s on 1 core and 0.214 s on 2 (a busy machine), a step time of neither."""
    with Store.open(url) as store:
        store.add_samples([{"signature": "h3.train_cnn", "gpus": 0, "gpu_type": "cpu", "cpu_cores": c,
                            "step_time_s": t, "steps": 10, "source": "profile"}
                           for c, t in ((1, 0.0533), (2, 0.214), (2, 0.2))])
        [row] = stage_report(store)
    assert row["runs"] == 0 and row["profiled_samples"] == 3 and row["predicts_s"] is None
    basis = row["basis"]
    assert "with no GPU: 0.0533 s on 1 CPU core, 0.207 s on 2 CPU cores (median of 2)" in basis, basis
    assert "0.134" not in basis, basis


def test_a_url_that_does_not_parse_is_shown_with_its_mistake_and_without_its_password():
    """Messages showed what follows the '@' only: 'postgres//qosflow@127.0.0.1/h3' (a ':' left out) was reported
    as '127.0.0.1/h3' is not a database URL, hiding the mistake."""
    with pytest.raises(QosflowError) as err:
        Store.open("postgres//qosflow@127.0.0.1/h3")
    assert "'postgres//qosflow@127.0.0.1/h3' is not a database URL" in str(err.value), err.value
    with pytest.raises(QosflowError) as err:
        Store.open("postgresql+psycopg://u:s3cret@localhost:54x2/db")
    assert "postgresql+psycopg://u:***@localhost:54x2/db" in str(err.value) and "s3cret" not in str(err.value)


def test_an_unreachable_postgres_says_what_to_check(monkeypatch):
    """Was libpq's "Connection refused" alone, with the URL's host and database but not what to check."""
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", "postgresql://nobody:s3cret@127.0.0.1:1/nothing?connect_timeout=2")
    with pytest.raises(QosflowError) as err:
        Store.open()
    msg = str(err.value)
    assert "cannot open the qosflow database postgresql+psycopg://nobody:***@127.0.0.1:1/nothing" in msg, msg
    assert "PostgreSQL server at 127.0.0.1:1 is running and reachable" in msg and "$QOSFLOW_DATABASE_URL" in msg, msg
    assert "s3cret" not in msg


def test_a_real_torch_training_stage_is_profiled_as_cpu_time_only(stages, url):
    """A small CNN trained on the CPU (skipped without torch, which qosflow does not need): without a GPU the
    profile says so, and stores 0-GPU samples in seconds that the CPU-core curve reads."""
    pytest.importorskip("torch")
    from qosflow.predict import Predictor

    if detect_gpu().present:
        pytest.skip("checks a CPU-only profile")
    with Store.open(url) as store:
        res = profile("journey_torch:train_cnn", 3, cores=[1], budget_s=120, store=store)
        assert "profiling CPU time only" in res.gpu.message and res.signature == "journey_torch.train_cnn"
        [cfg] = res.configs
        assert cfg.steps == 3 and cfg.stopped == "3 steps reached" and cfg.gpu_util_pct is None
        [s] = store.samples_for("journey_torch.train_cnn")
        assert (s.gpus, s.gpu_type, s.cpu_cores, s.steps, s.source) == (0, "cpu", 1, 3, "profile")
        assert s.step_time_s == pytest.approx(cfg.step_time_s) and 0 < s.step_time_s < cfg.wall_s
        curve = Predictor.open(store, reference=None).cpu_curve("journey_torch.train_cnn")
        assert curve.basis.startswith("fallback:coda-default")  # one core count: no curve yet, and it says so


def test_measurements_a_store_cannot_take_are_still_shown_and_written(stages, tmp_path, monkeypatch, capsys):
    """The database went away while the function ran (a PostgreSQL server that stopped accepting connections):
    a traceback, and the minutes of measurements were neither shown nor written to --json."""
    from qosflow.cli.main import main

    db = tmp_path / "lost.db"
    monkeypatch.setenv("JOURNEY_DB", str(db))
    out_json = tmp_path / "measured.json"
    rc = main(["profile", "journey_lost:train", "--steps", "2", "--cores", "1", "--db", f"sqlite:///{db}",
               "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "the measurements were not stored in sqlite:///" in err and "no such table: sample" in err, err
    assert f"the measurements are above and in {out_json}" in err and "run the profile again" in err, err
    assert "stored 1 samples" not in out and "journey_lost.train" in out, out
    res = json.loads(out_json.read_text())
    [cfg] = res["configs"]
    assert cfg["steps"] == 2 and cfg["step_time_s"] > 0 and "no such table" in res["store_error"]


def test_the_profile_table_without_gpu_fits_80_columns(stages, capsys, monkeypatch):
    """At a terminal's usual 80 columns the stopped reason was cut to "2 steps reac…" (a GPUs column of zeros
    beside the line saying there is no GPU took its room)."""
    from qosflow.cli.main import main

    if detect_gpu().present:
        pytest.skip("a GPU is present: the GPU columns are shown")
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["profile", "journey_plain:train", "--steps", "2", "--cores", "1", "--no-store"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "reached" in out and "GPUs" not in out, out


def test_the_cpu_time_counts_the_processes_the_function_started(stages):
    """A function stopped at its N-th step is killed with the workers it started (DataLoader workers); their
    CPU time was not counted: 0.06 s was shown for a function whose worker had used 1.5 s."""
    if detect_gpu().present:
        pytest.skip("a GPU's sampler would not change this, but keeps the test to the CPU-only path")
    res = profile("journey_workers:train", 2, cores=[1], budget_s=120)
    [cfg] = res.configs
    own, worker = (float(x) for x in (stages / "cpu.txt").read_text().split())
    tick = 1 / os.sysconf("SC_CLK_TCK")  # /proc counts whole clock ticks: a few per process may be cut off
    assert cfg.stopped == "2 steps reached" and cfg.cpu_time_s >= own + worker - 4 * tick, (cfg, own, worker)


def test_a_profile_on_cores_other_processes_keep_busy_says_so(stages, capsys, monkeypatch):
    """On the shared 2-core machine a CNN's 2-core steps took 4 to 30 times its 1-core ones, stored and shown
    without a word on why (others' work on the same cores). A process spinning on the core the profile pins
    its function to is such work."""
    import subprocess

    from qosflow.cli.main import main

    core = sorted(os.sched_getaffinity(0))[0]  # the profile's 1-core run pins its function there
    spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, [{core}])\nwhile True: pass"])
    try:
        monkeypatch.setenv("COLUMNS", "200")
        assert main(["profile", "journey_plain:train", "--steps", "3", "--cores", "1", "--no-store",
                     "--json", "busy.json"]) == 0
    finally:
        spin.kill()
        spin.wait()
    out = " ".join(capsys.readouterr().out.split())
    [cfg] = json.loads((stages / "busy.json").read_text())["configs"]
    assert cfg["others_busy_pct"] >= 25, cfg  # the spinning process has half the core at least
    assert f"during the 1-core run other processes kept its core {cfg['others_busy_pct']:.0f} % busy" in out, out


def test_a_signature_the_store_refuses_is_refused_before_the_measurements(stages, tmp_path, capsys):
    """A --signature over 500 characters was measured for minutes, then refused by the store, with the advice
    to make the database reachable."""
    from qosflow.cli.main import main

    rc = main(["profile", "journey_plain:train", "--steps", "2", "--cores", "1", "--signature", "x" * 501,
               "--db", f"sqlite:///{tmp_path / 'q.db'}"])
    out, err = capsys.readouterr()
    assert rc == 2 and "--signature: invalid signature: longer than 500 characters" in err, err
    assert "profile of" not in out and "not stored" not in err, (out, err)

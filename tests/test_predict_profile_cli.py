"""`qosflow profile` (no GPU here: said plainly, CPU time only) and `qosflow predict eval`."""

from __future__ import annotations

import json
import textwrap

import pytest

from qosflow.cli.main import main
from qosflow.errors import SpecError
from qosflow.predict.profiler import detect_gpu, profile
from qosflow.store import Store


@pytest.fixture
def stage_module(tmp_path, monkeypatch):
    (tmp_path / "toy_stage.py").write_text(textwrap.dedent("""
        import qosflow

        def train(steps=5):
            x = 0
            for _ in qosflow.track(range(steps + 1)):
                for i in range(20000):
                    x += i

        def exact(steps=50):
            import time
            for _ in qosflow.track(range(steps)):   # exactly the steps it is given
                time.sleep(0.01)

        def silent():
            pass

        def broken():
            raise RuntimeError("boom")

        def reported(steps=3):
            import time
            for i in range(steps + 100):      # far more than measured: the profile stops it, not its end
                time.sleep(0.02)
                qosflow.report_progress(i + 1)   # no step 0: the clock starts at the end of step 1

        def chatty(steps=3):
            import sys, time
            for _ in qosflow.track(range(steps + 100)):   # the profile stops it, not its end
                sys.stderr.write("x" * 100_000 + "\\n")  # far more than a pipe holds
                time.sleep(0.01)

        def spawner(steps=3):
            import subprocess, time
            child = subprocess.Popen(["sleep", "600"])   # inherits stderr, outlives the function
            open("child.pid", "w").write(str(child.pid))
            for _ in qosflow.track(range(steps + 3)):
                time.sleep(0.02)

        def needs_args(data):
            pass

        not_a_function = 3
    """))
    (tmp_path / "broken_import.py").write_text("import qosflow\nraise ImportError('half-installed dependency xyz')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_profile_without_gpu_reports_it_and_stores_cpu_samples(stage_module, tmp_path):
    gpu = detect_gpu()
    store = Store.open(f"sqlite:///{tmp_path / 'p.db'}")
    res = profile("toy_stage:train", 4, cores=[1], budget_s=60, store=store, signature="toy/bs1")
    if not gpu.present:
        assert res.gpu.message.startswith("no GPU") and "CPU time only" in res.gpu.message
        assert all(c.gpus == 0 and c.gpu_util_pct is None and c.gpu_mem_mb is None for c in res.configs)
    [cfg] = res.configs
    assert cfg.steps == 4 and cfg.step_time_s > 0 and cfg.cpu_cores == 1
    [sample] = store.samples_for("toy/bs1")
    assert sample.source == "profile" and sample.cpu_cores == 1 and sample.steps == 4
    if not gpu.present:
        assert sample.gpu_type == "cpu" and sample.gpu_util_pct is None
    assert store.profiles_for("toy/bs1")[0].solo_step_time_s == pytest.approx(cfg.step_time_s)
    store.close()


def test_a_profiled_run_counts_once_in_the_predictor(stage_module, tmp_path):
    """`qosflow profile` stores each run as a sample and its best run as the profile too; the predictor
    used to observe that run twice."""
    from qosflow.predict import Predictor

    if detect_gpu().present:
        pytest.skip("checks the CPU-core curve of a CPU-only profile")
    store = Store.open(f"sqlite:///{tmp_path / 'p.db'}")
    res = profile("toy_stage:train", 3, cores=[1, 2], budget_s=60, store=store, signature="toy/bs1")
    assert len(res.configs) == 2 and len(store.samples_for("toy/bs1")) == 2 and len(store.profiles_for("toy/bs1")) == 1
    p = Predictor.open(store, reference=None)
    p.refit()
    assert p.cpu_curve("toy/bs1").n_samples == 2
    store.close()


def test_profile_cli_no_gpu_message_and_errors(stage_module, tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    assert main(["profile", "toy_stage:train", "--steps", "3", "--cores", "1", "--db", db]) == 0
    out = " ".join(capsys.readouterr().out.split())
    if not detect_gpu().present:
        assert "no GPU" in out
    assert "stored 1 samples" in out
    assert main(["profile", "not-a-target", "--db", db]) == 2
    assert "MODULE:FUNCTION" in capsys.readouterr().err
    assert main(["profile", "toy_stage:broken", "--steps", "2", "--cores", "1", "--db", db]) == 2
    err = capsys.readouterr().err
    assert "boom" in err and 'in broken' in err
    # qosflow's own runner was the first frame of the function's traceback, and its signature line showed
    assert '<string>' not in err and "qosflow-profile-signature" not in err
    assert main(["profile", "toy_stage:silent", "--steps", "2", "--cores", "1", "--no-store"]) == 1
    assert "no steps were reported" in " ".join(capsys.readouterr().out.split())


def test_predict_eval_pairs_cli(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    from qosflow.predict.reference import write_pairs_csv

    spec = importlib.util.spec_from_file_location("_qf_test_predict", Path(__file__).with_name("test_predict.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _synthetic_pairs = mod._synthetic_pairs

    rows = _synthetic_pairs(n_models=4)
    csv_path = tmp_path / "pairs.csv"
    write_pairs_csv([{k: getattr(r, k) for k in ("model1", "batchsize1", "gpu_num1", "speed1", "model2", "batchsize2", "gpu_num2", "speed2")}
                     for r in rows], csv_path)
    out = tmp_path / "out.json"
    assert main(["predict", "eval", "--pairs", str(csv_path), "--folds", "3", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"mape", "p90_ape", "n", "interference"} <= set(res) and res["interference"]["folds"] == 3
    assert "random_forest" in " ".join(capsys.readouterr().out.split())
    assert main(["predict", "eval"]) == 2


def test_profile_counts_steps_reported_without_a_step_zero(stage_module):
    # report_progress(1) after the first step: step 1 is the warm-up, steps 2..N+1 are measured (was N-1)
    res = profile("toy_stage:reported", 3, cores=[1], budget_s=60)
    [cfg] = res.configs
    assert cfg.steps == 3 and cfg.stopped == "3 steps reached"
    assert cfg.step_time_s > 0.015  # each step sleeps 0.02 s


def test_a_function_running_exactly_its_steps_argument_gives_n_measured_steps(stage_module):
    # it is given steps=N+1 (the warm-up and N); given N, its own loop ended after N-1 measured steps
    res = profile("toy_stage:exact", 3, cores=[1], budget_s=60)
    [cfg] = res.configs
    assert cfg.steps == 3 and cfg.step_time_s > 0.005


def test_measured_step_times_drop_exactly_one_warm_up_step():
    # the profile above may see steps beyond N+1 before it stops the function, so it need not fail without
    # the fix; these event lists do: step 1 is the warm-up whether or not a step 0 was reported
    from qosflow.predict.profiler import measured_step_times
    from qosflow.progress import ProgressEvent

    def ev(*pairs):
        return [ProgressEvent(t, step, None, None) for step, t in pairs]

    # report_progress(1..4) after each step: steps 2, 3, 4 are measured (the old drop left 2)
    assert measured_step_times(ev((1, 1.0), (2, 1.5), (3, 2.5), (4, 4.0)), 3) == [0.5, 1.0, 1.5]
    # track: step 0 before the loop, so step 1 (0 -> 1, the warm-up) is known and dropped
    assert measured_step_times(ev((0, 0.0), (1, 9.0), (2, 9.5), (3, 10.5), (4, 12.0)), 3) == [0.5, 1.0, 1.5]
    # a gap of several steps is shared evenly; at most N are kept
    assert measured_step_times(ev((1, 0.0), (3, 2.0), (5, 6.0)), 3) == [1.0, 1.0, 2.0]


@pytest.mark.timeout(120)
def test_profile_survives_chatty_stderr_and_children_that_outlive_the_function(stage_module):
    import os
    import threading

    # a function writing much to stderr blocked on the full pipe until the budget (0 steps)
    [cfg] = profile("toy_stage:chatty", 3, cores=[1], budget_s=30).configs
    assert cfg.steps == 3 and cfg.stopped == "3 steps reached"  # not "budget 30s reached"
    # a process the function started kept the stderr pipe open: the profile waited for it forever
    out = {}
    t = threading.Thread(target=lambda: out.update(res=profile("toy_stage:spawner", 3, cores=[1], budget_s=30)), daemon=True)
    t.start()
    t.join(60)
    pid = int((stage_module / "child.pid").read_text())
    try:
        assert not t.is_alive(), "the profile hung on a process the function started"
        assert out["res"].configs[0].steps == 3
        import time

        for _ in range(100):  # killed with the function's process group
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the function's child process outlived the profile")
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("target, expected", [
    ("toy_stage:nope", ["has no function 'nope'", "reported"]),
    ("toy_stage:not_a_function", ["not a function", "'int'"]),
    # a wrapper's samples would go under its own name, which no stage carries: the stage's signature is named
    ("toy_stage:needs_args", ["needs the argument(s) data", "defaults", "with --signature toy_stage.needs_args so"]),
    ("no_such_module_xyz:f", ["no module named 'no_such_module_xyz'", "directory"]),
    # the end of the module's traceback comes after the message (which said "the traceback is above")
    ("broken_import:f", ["importing module 'broken_import' failed", "half-installed dependency xyz",
                         "(fix the module; the end of its traceback follows)\n"]),
])
def test_profile_bad_target_says_what_and_how_to_fix(stage_module, capsys, target, expected):
    assert main(["profile", target, "--steps", "2", "--cores", "1", "--no-store"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot profile " + target) and "exit code" not in err
    for text in expected:
        assert text in err


def test_profile_empty_signature_is_an_error_before_the_measurements(stage_module, tmp_path, capsys):
    """`--signature '  '` measured, then failed storing ('sample 0: invalid signature'), the measurements lost;
    `--signature ''` (an unset shell variable) silently meant the default."""
    for sig in ("  ", ""):
        assert main(["profile", "toy_stage:train", "--signature", sig, "--db", f"sqlite:///{tmp_path / 'p.db'}"]) == 2
        out = capsys.readouterr()
        assert f"invalid --signature: {sig!r} is empty; give the stage's signature" in out.err and "step time" not in out.out


def test_profile_budget_must_be_positive(stage_module, tmp_path, capsys):
    for budget in ("0", "-1", "inf"):  # inf passed the option's check and failed in profile() as 'invalid budget'
        assert main(["profile", "toy_stage:train", "--budget", budget, "--no-store"]) == 2
        assert "invalid --budget: must be a finite number of seconds > 0" in capsys.readouterr().err


def test_profile_core_counts_out_of_range_name_the_option(stage_module, tmp_path, capsys):
    """--cores 0 said 'invalid cores' (the library's word), after the store had been opened."""
    db = f"sqlite:///{tmp_path / 'p.db'}"
    for cores in ("0", "1,100000"):
        assert main(["profile", "toy_stage:train", "--cores", cores, "--db", db]) == 2
        assert "invalid --cores: " in capsys.readouterr().err
    assert not (tmp_path / "p.db").exists()


def test_profile_refuses_a_core_count_given_twice(stage_module, tmp_path, capsys):
    """--cores 1,1 measured the same configuration twice (and stored both)."""
    db = f"sqlite:///{tmp_path / 'p.db'}"
    assert main(["profile", "toy_stage:train", "--steps", "2", "--cores", "1,1", "--db", db]) == 2
    err = capsys.readouterr().err
    assert "invalid --cores: 1 given more than once (1,1)" in err and "give distinct counts, e.g. 1" in err
    assert not (tmp_path / "p.db").exists()
    with pytest.raises(SpecError, match=r"invalid cores: 1 given more than once \(1,1\)"):
        profile("toy_stage:train", 2, cores=[1, 1], budget_s=30)


def test_profile_of_a_silent_function_fails(stage_module, capsys):
    assert main(["profile", "toy_stage:silent", "--steps", "2", "--cores", "1", "--no-store"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "no steps were reported" in out and "qosflow.track" in out


def test_json_output_is_checked_before_the_work(stage_module, tmp_path, capsys):
    # the --json path was opened only after the whole evaluation (minutes): a traceback, results lost
    (tmp_path / "file").write_text("")
    for bad, said in ((tmp_path, "is a directory"), (tmp_path / "file" / "out.json", "cannot write there")):
        assert main(["predict", "eval", "--pairs", str(tmp_path / "missing.csv"), "--json", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --json {bad}: {said}") and "not found" not in err
        assert main(["profile", "toy_stage:train", "--steps", "2", "--cores", "1", "--no-store", "--json", str(bad)]) == 2
        captured = capsys.readouterr()
        assert said in captured.err and "profile of" not in captured.out
    good = tmp_path / "new" / "p.json"
    assert main(["profile", "toy_stage:train", "--steps", "2", "--cores", "1", "--no-store", "--json", str(good)]) == 0
    assert json.loads(good.read_text())["configs"][0]["steps"] == 2


def test_failed_eval_leaves_no_output_directories(tmp_path, capsys):
    """The --json check made its missing directories before the run; an evaluation that then failed left them."""
    out = tmp_path / "results" / "deep" / "eval.json"
    assert main(["predict", "eval", "--pairs", str(tmp_path / "missing.csv"), "--json", str(out)]) == 2
    assert "missing.csv" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_profile_table_without_gpu_fits_100_columns(stage_module, capsys, monkeypatch):
    # two "n/a (no GPU)" columns wrapped every header and cut the stopped reason ("finish…") at 100 columns
    if detect_gpu().present:
        pytest.skip("a GPU is present: the GPU columns are shown")
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["profile", "toy_stage:train", "--steps", "2", "--cores", "1", "--no-store"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no GPU" in out and "n/a (no GPU)" not in out and "GPU util" not in out
    assert "2 steps reached" in out and "CPU cores" in out
    # the CPU time is mostly the process starting up, not the steps: said under the table
    assert "CPU time and wall: the whole run of the function's process, with Python's start-up" in out


def test_predict_stages_shows_what_finished_stages_taught(tmp_path, capsys):
    """`qosflow predict stages` reads what a worker recorded: runs, the duration predicted now and its
    basis, the error of the predictions the runs were scheduled on, and the step-time samples."""
    from qosflow.core.job import Job
    from qosflow.core.qos import QoSSpec
    from qosflow.predict.estimator import LearnedEstimator

    url = f"sqlite:///{tmp_path / 'w.db'}"
    est = LearnedEstimator.from_store(Store.open(url), reference=None)

    def stage(i: int, model: str) -> Job:
        return Job(f"s{i}", 0.0, QoSSpec(gpus=1, cpu_cores=1.0, shareable=True), 60.0, model=model, expected_duration=40.0)

    for i, t in enumerate((20.0, 22.0, 21.0)):
        j = stage(i, "pipe.train")
        est.duration(j)  # the prediction the stage is scheduled on (recorded with its outcome)
        est.observe_stage(j, t, steps=10)
    est.observe_stage(stage(9, "pipe.train"), 42.0, steps=10, partners=[stage(8, "pipe.etl")], ran_alone=False)
    est.observe_stage(stage(10, "pipe.etl"), 5.0)
    out = tmp_path / "stages.json"
    assert main(["predict", "stages", "--db", url, "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "pipe.train" in text and "pipe.etl" in text and "MAPE" in text
    rows = {r["signature"]: r for r in json.loads(out.read_text())}
    train = rows["pipe.train"]
    assert train["runs"] == 4 and (train["solo_samples"], train["shared_samples"]) == (3, 1)
    assert train["co_runners"] == ["pipe.etl"] and train["predictions_scored"] == 3
    # the first run was planned on the declaration (40 s against 20 s: 100 %); the next on what it had measured
    assert 1.0 / 3 < train["mape"] < 0.4 and train["last_ape"] < 0.05
    # what the worker plans with: the runs and the declared 40 s as a prior (the report had the runs alone,
    # "history(n=3)", though its help says the declaration is blended in); the shared run's 42 s left out
    assert train["basis"] == "declared+history(n=3)" and 20.0 < train["predicts_s"] < 22.0
    assert train["predicts_s"] == round(est.predict_duration(stage(20, "pipe.train")).value, 3)
    assert rows["pipe.etl"]["basis"] == "history(n=1)"  # no prediction recorded for it: its declaration is unknown
    assert rows["pipe.etl"]["runs"] == 1 and rows["pipe.etl"]["mape"] is None
    # the same command again (from cron, say) replaces its own earlier result, a JSON array; it was refused as
    # "not a JSON result (it begins '[')"
    out.write_text("[]\n")
    assert main(["predict", "stages", "--db", url, "--json", str(out)]) == 0, capsys.readouterr().err
    assert {r["signature"] for r in json.loads(out.read_text())} == {"pipe.train", "pipe.etl"}
    assert main(["predict", "stages", "--db", url, "--signature", "nothing"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrapped: where the console wraps depends on the temp path's length
    assert "no completed run of signature 'nothing'" in out and "it has 2 other signature(s)" in out, out
    # a signature one step off what the store has (a @qos_task with a batch_size is recorded as .../bsN): named
    est.observe_stage(stage(11, "pipe.train/bs64"), 30.0)
    for given, meant in (("pipe.train/bs", "'pipe.train/bs64'"), ("pipe.tran", "'pipe.train'"),
                         ("pipe.", "'pipe.etl' or 'pipe.train' or 'pipe.train/bs64'")):
        assert main(["predict", "stages", "--db", url, "--signature", given]) == 0
        out = " ".join(capsys.readouterr().out.split())  # unwrapped
        assert f"no completed run of signature '{given}' in sqlite:///" in out and f"did you mean {meant}?" in out, out


def test_predict_stages_lists_a_signature_only_profiled(stage_module, tmp_path, capsys):
    """Right after `qosflow profile` the report said "no completed run ... yet" and never showed the
    samples just stored."""
    url = f"sqlite:///{tmp_path / 'p.db'}"
    assert main(["profile", "toy_stage:train", "--steps", "2", "--cores", "1", "--db", url, "--signature", "toy/bs1"]) == 0
    capsys.readouterr()
    out = tmp_path / "s.json"
    assert main(["predict", "stages", "--db", url, "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "toy/bs1" in text and "profiled only" in text and "no completed run" not in text, text
    [row] = json.loads(out.read_text())
    assert (row["runs"], row["predicts_s"], row["profiled_samples"]) == (0, None, 1)
    assert "step time" in row["basis"]


def test_profile_stores_under_the_signature_the_worker_gives_the_stage(stage_module, tmp_path):
    """A profile is only worth something to the worker if its samples carry the stage's signature:
    module.function, plus /bsN for a @qos_task with a batch size (whose function is run directly, not as a
    Prefect task). --signature still overrides it."""
    from qosflow.core.job import Job
    from qosflow.core.qos import QoSSpec
    from qosflow.predict.estimator import LearnedEstimator, job_signature

    store = Store.open(f"sqlite:///{tmp_path / 's.db'}")
    (tmp_path / "toy_qos_stage.py").write_text(textwrap.dedent("""
        import qosflow
        from qosflow import qos_task

        @qos_task(gpus=1, cpu_cores=1, batch_size=32, expected_duration=30)
        def stage(steps=4):
            for _ in qosflow.track(range(steps)):
                pass
    """))
    res = profile("toy_qos_stage:stage", 3, cores=[1], budget_s=60, store=store)
    assert res.signature == "toy_qos_stage.stage/bs32" and res.configs[0].steps == 3
    worker_job = Job("f1", 0.0, QoSSpec(gpus=1, cpu_cores=1.0), 30.0, model="toy_qos_stage.stage", batch_size=32)
    assert job_signature(worker_job) == res.signature  # what the worker calls the stage
    assert {x.signature for x in store.samples_for()} == {"toy_qos_stage.stage/bs32"}
    est = LearnedEstimator.from_store(store, reference=None)
    if detect_gpu().present:  # the worker's estimate of the stage rests on the profile
        assert est.predict_duration(Job("f2", 0.0, QoSSpec(gpus=1, cpu_cores=1.0), 30.0, model="toy_qos_stage.stage",
                                        batch_size=32, iterations=100)).basis.startswith("iterations×step-time:samples(")
    else:  # a CPU-only profile (its CPU curve needs two core counts) never gives a GPU step time
        assert [x.gpus for x in store.samples_for(res.signature)] == [0]
    assert profile("toy_stage:train", 2, cores=[1], budget_s=60).signature == "toy_stage.train"
    assert profile("toy_stage:train", 2, cores=[1], budget_s=60, signature="mine").signature == "mine"


def test_predict_stages_does_not_create_a_database_it_was_asked_to_read(tmp_path, capsys):
    """A mistyped --db path is an error that names it, not a new empty database and an empty report."""
    missing = tmp_path / "nowhere" / "qosflow.db"
    assert main(["predict", "stages", "--db", f"sqlite:///{missing}"]) == 2
    err = capsys.readouterr().err
    assert f"no qosflow database at {missing}" in err and "sqlite:///PATH/qosflow.db" in err
    assert not missing.exists() and not missing.parent.exists()


def test_db_that_is_not_a_sqlite_database_is_named(stage_module, tmp_path, capsys, monkeypatch):
    """--db at a CSV ended in a sqlalchemy traceback ('file is not a database'), at a directory in 'unable to open
    database file ... must be writable', and `predict stages` turned an empty file into a new database."""
    text = tmp_path / "results.csv"
    text.write_text("a,b\n1,2\n")
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    for argv in (["predict", "stages"], ["profile", "toy_stage:train", "--steps", "2", "--cores", "1"]):
        assert main([*argv, "--db", f"sqlite:///{text}"]) == 2
        assert f"{text} is not a SQLite database" in capsys.readouterr().err
        assert main([*argv, "--db", f"sqlite:///{tmp_path}"]) == 2
        assert f"{tmp_path} is a directory, not a database file" in capsys.readouterr().err
    assert text.read_text() == "a,b\n1,2\n"
    assert main(["predict", "stages", "--db", f"sqlite:///{empty}"]) == 2
    assert f"{empty} is an empty file, not a qosflow database" in capsys.readouterr().err
    assert empty.read_bytes() == b""
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", f"sqlite:///{text}")
    assert main(["predict", "stages"]) == 2
    assert "$QOSFLOW_DATABASE_URL" in capsys.readouterr().err


def test_predict_stages_says_three_slashes_are_a_relative_path(tmp_path, capsys, monkeypatch):
    db = tmp_path / "qosflow.db"
    Store.open(f"sqlite:///{db}").close()
    monkeypatch.chdir(tmp_path)
    assert main(["predict", "stages", "--db", f"sqlite://{db}"]) == 2  # sqlite:// + /abs = three slashes
    err = capsys.readouterr().err
    assert "three slashes is a relative path" in err and f"write sqlite:///{db}" in err


def test_json_output_that_is_the_targets_module_or_the_store_is_refused(stage_module, tmp_path, capsys):
    """`profile toy_stage:train --json toy_stage.py` measured and then wrote its JSON over the stage's own
    source; `--json` naming the SQLite store (profile's or predict stages' --db) overwrote the store a worker
    learns from. Both are refused before the work, and the files are left as they were. (The fixture runs
    from tmp_path.)"""
    src = tmp_path / "toy_stage.py"
    code = src.read_text()
    db = tmp_path / "q.db"
    assert main(["profile", "toy_stage:train", "--steps", "2", "--cores", "1", "--db", f"sqlite:///{db}"]) == 0
    store_bytes = db.read_bytes()
    capsys.readouterr()
    for argv, says in (
        (["profile", "toy_stage:train", "--no-store", "--json", "toy_stage.py"],
         "--json toy_stage.py: that is the TARGET module file this command uses, and the results would overwrite it"),
        (["profile", "toy_stage:train", "--db", f"sqlite:///{db}", "--json", str(db)], f"--json {db}: that is the --db file"),
        (["predict", "stages", "--db", f"sqlite:///{db}", "--json", "q.db"], "--json q.db: that is the --db file"),
    ):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert says in err, err
    assert src.read_text() == code and db.read_bytes() == store_bytes



@pytest.mark.parametrize("target, meant", [
    ("toy_stage.py:train", "toy_stage:train"),
    ("./pkg/toy_stage.py:train", "pkg.toy_stage:train"),
    ("pkg/toy_stage:train", "pkg.toy_stage:train"),
])
def test_profile_target_given_as_a_file_path_names_the_module_spelling(stage_module, capsys, target, meant):
    """`qosflow profile mystages/train.py:train` said "no module named 'mystages/train.py'"."""
    assert main(["profile", target, "--steps", "2", "--cores", "1", "--no-store"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"invalid target: {target!r} names a file" in err and err.endswith(f"current directory: {meant}"), err


def test_profile_missing_function_lists_the_modules_stages_and_the_closest(stage_module, capsys):
    """The list of "its functions" held what the module imported (qos_task) but not its @qos_task stages,
    the likeliest targets (Prefect tasks, not functions)."""
    (stage_module / "toy_qos_mod.py").write_text(textwrap.dedent("""
        import qosflow
        from qosflow import qos_task
        from os.path import join

        @qos_task(gpus=0, cpu_cores=1, expected_duration=30)
        def train_model(steps=3):
            for _ in qosflow.track(range(steps)):
                pass

        def helper():
            pass
    """))
    assert main(["profile", "toy_qos_mod:train_modle", "--steps", "2", "--cores", "1", "--no-store"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has no function 'train_modle' (did you mean toy_qos_mod:train_model?)" in err, err
    assert err.endswith("its functions and stages: helper, train_model"), err


def test_profile_and_stages_refuse_an_in_memory_database(stage_module, tmp_path, capsys, monkeypatch):
    """`--db sqlite://` (a path left out) measured, said "stored 2 samples in sqlite://", and the samples were gone
    with the process; `predict stages` showed that empty database. Refused before the measurements."""
    for url in ("sqlite://", "sqlite:///:memory:"):
        for argv in (["profile", "toy_stage:train", "--steps", "2", "--cores", "1", "--db", url],
                     ["predict", "stages", "--db", url]):
            assert main(argv) == 2, argv
            out = capsys.readouterr()
            err = " ".join(out.err.split())
            assert f"invalid --db: '{url}' is an in-memory SQLite database" in err and "give a file" in err, err
            assert "step time" not in out.out
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", "sqlite://")
    assert main(["predict", "stages"]) == 2
    assert "invalid $QOSFLOW_DATABASE_URL: 'sqlite://' is an in-memory" in " ".join(capsys.readouterr().err.split())
    assert main(["profile", "toy_stage:train", "--steps", "2", "--cores", "1", "--no-store"]) == 0  # stores nothing


def test_predict_stages_signature_hint_covers_profiled_stages_and_the_profile_spelling(stage_module, tmp_path, capsys):
    """A store holding only a profile of a @qos_task stage (MODULE.FUNCTION/bsN): `--signature MODULE.FUNCTION`
    said "no completed run ... yet: stages are recorded by a qosflow worker", though the table lists it;
    `--signature MODULE:FUNCTION` (how `qosflow profile` names it) found nothing either."""
    url = f"sqlite:///{tmp_path / 'p.db'}"
    store = Store.open(url)
    for sig in ("toy_stage.train", "toy_stage.train_big/bs32"):
        store.add_sample(signature=sig, gpu_type="cpu", placement="consolidated", gpus=0, cpu_cores=1,
                         step_time_s=0.01, source="profile")
    store.close()
    for given, meant in (("toy_stage.train_big", "'toy_stage.train_big/bs32'"),
                         ("toy_stage:train", "'toy_stage.train'"),
                         ("toy_stage:train_big", "'toy_stage.train_big/bs32'")):
        assert main(["predict", "stages", "--db", url, "--signature", given]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"no completed run of signature '{given}'" in out and f"did you mean {meant}?" in out, out

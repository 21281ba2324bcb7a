"""What a new user met on the command line (review of 2026-11-28): help without an example, a rejected job
hidden behind ten others, table cells broken mid-word, an estimator no worker can import saved without a word."""

from __future__ import annotations

import json

import pytest

from qosflow.cli.main import main


def _helps():
    import inspect

    from qosflow.cli.main import app

    def walk(typer_app, prefix):
        for cmd in typer_app.registered_commands:
            name = cmd.name or cmd.callback.__name__
            yield f"{prefix}{name}", cmd.help if cmd.help is not None else inspect.getdoc(cmd.callback)
        for group in typer_app.registered_groups:
            yield from walk(group.typer_instance, f"{prefix}{group.name} ")

    return dict(walk(app, ""))


@pytest.mark.parametrize("command", ["simulate", "pack", "demo", "init", "status", "profile", "predict eval",
                                     "predict stages", "predict prune"])
def test_every_command_help_has_an_example(command):
    """`qosflow profile --help` had none: a new user could not tell how TARGET is written on a command line."""
    text = _helps()[command]
    assert "Examples:" in text and f"qosflow {command}" in text.split("Examples:", 1)[1], text


def test_simulate_policies_help_names_every_policy():
    """--policies said 'comma-separated policy names' and showed a default without gavel: the policy for
    clusters of mixed GPU models could be found only in the docs."""
    from qosflow.cli.main import app
    from qosflow.policies import available

    cmd = next(c for c in app.registered_commands if c.name == "simulate")
    import inspect

    opt = inspect.signature(cmd.callback).parameters["policies"].default
    for name in available():
        assert name in opt.help.replace(",", " ").split(), (name, opt.help)


def test_rejected_jobs_show_each_kind_of_reason_first():
    from qosflow.cli.simulate import _rejected_to_show

    pending = [(f"pod-{i}", "never scheduled in the trace (pod_phase Pending, no scheduled_time): no running time")
               for i in range(15)]
    model = ("pod-x", "can never be placed on nodes: no node has GPU model 'H100X' (the cluster has G2, T4)")
    shown, left = _rejected_to_show(pending + [model])
    assert len(shown) == 10 and model in shown and left == 0
    assert shown[:9] == pending[:9]  # otherwise in the order of the trace
    # reasons that differ only in their figures are one kind: the next ones of the list fill the ten
    wide = [(f"j{i}", f"can never be placed on 1x1: asks for {g} GPUs; the cluster has 1 that fit it") for i, g in
            enumerate((4, 8, 4, 16, 8, 4, 4, 8, 4, 4, 8, 2))]
    assert _rejected_to_show(wide) == (wide[:10], 0)
    assert _rejected_to_show(wide[:3]) == (wide[:3], 0)
    # more kinds than lines: the first ten kinds, and how many are not shown
    many = [(f"k{i}", f"reason {chr(97 + i)}") for i in range(13)]
    assert _rejected_to_show(many) == (many[:10], 3)


ALIBABA_PODS = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
                "scheduled_time\n")
ALIBABA_NODES = "sn,cpu_milli,memory_mib,gpu,model\nnode-0,64000,262144,2,T4\nnode-1,64000,262144,2,T4\n"


def test_a_job_of_a_gpu_model_no_node_has_is_listed_among_many_pending_ones(tmp_path, capsys):
    """Twelve Pending pods before it in the list: the pod asking for a GPU model no node has was the eleventh
    rejected job, so the command said only '… 3 more rejected jobs', and the user never learnt of it."""
    rows = [f"p{i:02d},4000,8192,1,1000,,LS,Pending,{i * 10},{i * 10 + 500},\n" for i in range(12)]
    rows += ["ok0,4000,8192,1,1000,,LS,Running,0,3600,0\n", "h100,4000,8192,1,1000,H100X,LS,Running,5,3600,5\n"]
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(ALIBABA_PODS + "".join(rows))
    nodes.write_text(ALIBABA_NODES)
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(pods), "--cluster", str(nodes), "--policies", "fifo", "--no-plots",
                 "--parallel", "1", "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "rejected h100: can never be placed" in text and "'H100X'" in text, text
    assert f"… 3 more rejected jobs, for the reasons above; {out} lists them all (workload.rejected)" in text, text
    assert len(json.loads(out.read_text())["workload"]["rejected"]) == 13


def test_a_cluster_of_one_node_is_not_one_nodes(capsys):
    assert main(["simulate", "--trace", "synthetic", "--jobs", "4", "--cluster", "1x1", "--policies", "fifo",
                 "--no-plots", "--parallel", "1"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "on 1x1 (1 node, 1 GPU)" in text, text
    assert main(["simulate", "--trace", "synthetic", "--jobs", "4", "--cluster", "2x4", "--policies", "fifo",
                 "--no-plots", "--parallel", "1"]) == 0
    assert "on 2x4 (2 nodes, 8 GPUs)" in " ".join(capsys.readouterr().out.split())


def test_allocation_per_gpu_model_keeps_each_model_with_its_share():
    """On the Alibaba node list (six models) the cell wrapped at the column's width: 'P100 19% T4' / '0% V100M16 0%'."""
    from rich.console import Console

    from qosflow.sim.metrics import Bounds, Metrics
    from qosflow.sim.report import render_table

    share = {"G2": 0.0, "G3": 0.05, "P100": 0.19, "T4": 0.0, "V100M16": 0.0, "V100M32": 0.0}
    m = {p: Metrics(p, "oracle", 10, 10, 0, 3600.0, 1800.0, 7200.0, 9000.0, 60.0, 1.0, 5, 0.06, 0.0, 1.0, 0, 0, 0, 0,
                    0.0, 0.0, 0, gpu_util_by_model=dict(share)) for p in ("fifo", "qosflow")}
    console = Console(width=120, record=True)
    console.print(render_table(m, Bounds(3000.0, 8000.0, 1.0)))
    lines = console.export_text().splitlines()
    for g, u in share.items():
        cell = f"{g} {u:.0%}"
        assert sum(cell in ln for ln in lines) == 2, (cell, "\n".join(lines))  # whole, once per policy
    assert all(len(ln) <= 120 for ln in lines)
    assert any("15.0 min" not in ln and "30.0 min" in ln for ln in lines)  # the other cells unwrapped


def test_init_warns_of_an_estimator_this_machine_cannot_import(capsys, monkeypatch):
    """`init --estimator mymod:Est` with a typo saved the block without a word; every worker of the pool then
    logged 'qosflow worker setup failed: No module named ...' every 5 s and took no run."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["init", "--estimator", "review_nomod:Est"]) == 2  # then: no server
        err = " ".join(capsys.readouterr().err.split())
        assert "warning: invalid --estimator: 'review_nomod:Est': no module named 'review_nomod' on this machine's" in err
        assert "every worker of the pool imports it when it starts" in err and "Traceback" not in err, err
        assert main(["init", "--estimator", "qosflow.core.estimate:OracleEstimator"]) == 2
        err = capsys.readouterr().err
        assert "warning" not in err and "PREFECT_API_URL is not set" in err, err


def test_status_names_whole_and_where_a_stage_runs(tmp_path, capsys, monkeypatch):
    """At 120 columns the stage runs table cut names ('train_softma' / 'x', 'furious-star' / 'ling': an empty
    'why it waits' column took its share), and 'where' repeated the host ('host0 host0:0', 'host0 -' for a stage
    without a GPU). Where a stage runs or why it waits now share the last column."""
    import qosflow.prefect.local as local
    import qosflow.prefect.status as status
    from qosflow.cli.status import _where
    from qosflow.prefect.status import PoolStatus, StageStatus, WorkerStatus

    assert _where("host0", "host0:0") == "host0 GPU 0"
    assert _where("host0", "host0:0,host0:1") == "host0 GPUs 0,1"
    assert _where("host0", "-") == "host0" and _where("host0", "") == "host0"
    assert _where("host0", "host0:0,host1:3") == "host0 host0:0, host1:3"  # a gang across hosts: each GPU's host

    async def no_check(pool, **kw):
        return None

    async def fake_status(pool, limit=200):
        return PoolStatus(pool, workers=[WorkerStatus("w", "ONLINE", True, 1.0)], stages=[
            StageStatus("1", "train_softmax", "furious-starling", "Running", "running",
                        host="host0", gpus="host0:0", priority="guaranteed", since_s=3.0, predicted_s=4.3),
            StageStatus("2", "featurize", "furious-starling", "Running", "running",
                        host="host0", gpus="-", priority="guaranteed", since_s=2.0),
            StageStatus("3", "evaluate", "gentle-otter", "Scheduled", "queued",
                        priority="best-effort", why_waiting="waits for 1 GPU: all 8 are taken by stages of higher "
                        "QoS classes; the earliest frees in 12 min")])

    monkeypatch.setattr(local, "check_pool", no_check)
    monkeypatch.setattr(local, "require_api_url", lambda what: "http://127.0.0.1:1/api")
    monkeypatch.setattr(status, "pool_status", fake_status)
    assert main(["status", "--pool", "gpu"]) in (0, None)
    text = capsys.readouterr().out
    for name in ("train_softmax", "featurize", "evaluate",
                 "furious-starling", "gentle-otter"):
        assert name in text, (name, text)
    assert "host0 GPU 0" in text and "host0 -" not in text and "host0:0" not in text, text
    assert "why it waits" not in text.split("train_softmax")[1]  # no column of its own, empty for every running stage
    assert "QoS queue: waits for 1 GPU" in " ".join(text.replace("│", " ").split()), text


def test_predict_stages_basis_wraps_at_spaces(tmp_path, capsys):
    """At 80 columns the basis column read 'declared+his' / 'tory(n=2)'."""
    from qosflow.core.job import Job
    from qosflow.core.qos import QoSSpec
    from qosflow.predict.estimator import LearnedEstimator
    from qosflow.store.store import Store

    url = f"sqlite:///{tmp_path / 'w.db'}"
    est = LearnedEstimator.from_store(Store.open(url), reference=None)
    for i, t in enumerate((20.0, 22.0)):
        j = Job(f"s{i}", 0.0, QoSSpec(gpus=1, cpu_cores=1.0), 60.0, model="flows.retrain.train_softmax/bs64",
                expected_duration=40.0)
        est.duration(j)
        est.observe_stage(j, t, steps=10)
    assert main(["predict", "stages", "--db", url]) == 0
    text = capsys.readouterr().out
    assert "declared +" in text and "history(n=2)" in text and "declared+his" not in text, text


def test_a_run_without_json_or_out_says_nothing_was_written(tmp_path, capsys):
    """`qosflow simulate --trace synthetic --cluster 8x8`, the README's first example, printed its tables and
    wrote nothing, without a word of the JSON, plots and per-job CSVs the README promises (they need --json/--out)."""
    argv = ["simulate", "--trace", "synthetic", "--jobs", "4", "--cluster", "1x2", "--policies", "fifo", "--parallel", "1"]
    assert main(argv) == 0
    assert "nothing written: --json FILE keeps these results, --out DIR the PNG plots" in " ".join(capsys.readouterr().out.split())
    assert main(argv + ["--json", str(tmp_path / "r.json"), "--no-plots"]) == 0
    assert "nothing written" not in capsys.readouterr().out
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(ALIBABA_PODS + "".join(f"p{i},4000,8192,1,500,,LS,Running,0,10,0\n" for i in range(6)))
    nodes.write_text(ALIBABA_NODES)
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--seeds", "1", "--parallel", "1"]) == 0
    assert "nothing written: --json FILE keeps these results, --out DIR the allocation curve" in " ".join(capsys.readouterr().out.split())


def test_profile_db_with_three_slashes_before_an_absolute_path_is_refused(tmp_path, capsys, monkeypatch):
    """`profile ... --db sqlite:///tmp/q/x.db` (meant: /tmp/q/x.db) measured, created ./tmp/q/ under the current
    directory and said 'stored 2 samples in sqlite:///tmp/q/x.db', where no worker reads them."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "review_stage.py").write_text(
        "import qosflow\n\ndef train(steps=3):\n    for _ in qosflow.track(range(steps)):\n        sum(range(20000))\n")
    monkeypatch.chdir(work)
    target = tmp_path / "q" / "x.db"  # absolute, under the root's /tmp (or wherever tmp_path is)
    rel = str(target).lstrip("/")
    assert main(["profile", "review_stage:train", "--steps", "1", "--cores", "1", "--db", f"sqlite:///{rel}"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"is the relative path {rel} under {work}" in err and f"write sqlite:////{rel} (four slashes)" in err, err
    assert "Traceback" not in err and sorted(p.name for p in work.iterdir()) == ["review_stage.py"]  # nothing created
    # the four-slash spelling, and a relative path written as one, are taken
    assert main(["profile", "review_stage:train", "--steps", "1", "--cores", "1", "--db", f"sqlite:///{target}"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert target.is_file() and f"stored 1 samples in sqlite:///{target}" in out, out
    assert main(["profile", "review_stage:train", "--steps", "1", "--cores", "1", "--db", "sqlite:///./here/x.db"]) == 0
    assert (work / "here" / "x.db").is_file()


def test_profile_says_what_it_runs_before_the_measurements(tmp_path, capsys, monkeypatch):
    """`qosflow profile` printed nothing until its table, up to --budget seconds per configuration (two minutes
    by default): it now says what it runs, and for how long at most, first."""
    (tmp_path / "review_stage2.py").write_text(
        "import qosflow\n\ndef train(steps=3):\n    for _ in qosflow.track(range(steps)):\n        sum(range(20000))\n")
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "review_stage2:train", "--steps", "2", "--cores", "1", "--budget", "30", "--no-store"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    said = "profiling review_stage2:train at 1 CPU core: 2 steps after a warm-up step, at most 30 s"
    assert said in out and out.index(said) < out.index("profile of review_stage2.train"), out
    from qosflow.predict.profiler import check_core_counts

    try:
        check_core_counts([1, 2])
    except Exception:  # a machine of one core
        return
    assert main(["profile", "review_stage2:train", "--steps", "1", "--cores", "1,2", "--budget", "90", "--no-store"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "at 1 and 2 CPU cores: 1 step after a warm-up step, at most 90 s each (3 min in all)" in out, out


def test_plots_give_times_in_the_tables_unit(tmp_path, capsys, monkeypatch):
    """avg_jct.png and gpu_timeline.png were always in hours: on the Muri trace the average JCT read '802.80'
    (hours) under a table that said 33.4 d, and the timeline ran to 8,000 hours."""
    import qosflow.sim.report as report

    assert report.time_unit(33.4 * 86400) == (86400.0, "days")
    assert report.time_unit(5 * 3600) == (3600.0, "hours") and report.time_unit(600) == (60.0, "minutes")
    seen: dict[str, tuple[str, str]] = {}
    save = report._save

    def recording(fig, path, on_file=None):
        ax = fig.axes[0]
        seen[path.name] = (ax.get_xlabel(), ax.get_ylabel())
        save(fig, path, on_file)

    monkeypatch.setattr(report, "_save", recording)
    # 40 synthetic jobs on 2 GPUs: days of work
    assert main(["simulate", "--jobs", "40", "--cluster", "1x2", "--policies", "fifo", "--parallel", "1",
                 "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert seen["avg_jct.png"][1] == "average JCT (days)" and seen["gpu_timeline.png"][0] == "time (days)", (seen, table)
    assert " d │" in table  # the table's unit too



def test_pack_says_where_every_pod_that_never_fits_is_listed(tmp_path, capsys):
    """Five pods that fit no node were named, then '12 of 40 pods fit no node ...': the other seven were in the
    JSON (config.never_fit_pods), which the message did not say."""
    rows = [f"big{i},4000,8192,4,1000,,LS,Running,0,10,0\n" for i in range(7)]  # 4 GPUs: no node has them
    rows += [f"p{i},4000,8192,1,500,,LS,Running,0,10,0\n" for i in range(10)]
    pods, nodes, out = tmp_path / "pods.csv", tmp_path / "nodes.csv", tmp_path / "pack.json"
    pods.write_text(ALIBABA_PODS + "".join(rows))
    nodes.write_text(ALIBABA_NODES)
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--seeds", "1", "--parallel", "1", "--no-plots"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("never fits big") == 5 and "(the first 5 are above; --json lists them all, config.never_fit_pods)" in text, text
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--seeds", "1", "--parallel", "1", "--no-plots",
                 "--json", str(out)]) == 0
    assert f"{out} lists them all, config.never_fit_pods" in " ".join(capsys.readouterr().out.split())
    assert len(json.loads(out.read_text())["config"]["never_fit_pods"]) == 7


def test_predict_stages_on_a_machine_where_no_worker_ran_says_nothing_was_learned_yet(tmp_path, capsys, monkeypatch):
    """The README's `qosflow predict stages`, on a new install, was 'error: no qosflow database at ..., so nothing
    to read' (exit 2), as for a mistyped --db. It says nothing was learned yet, and where stages are recorded."""
    monkeypatch.setenv("QOSFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QOSFLOW_DATABASE_URL", raising=False)
    out = tmp_path / "stages.json"
    assert main(["predict", "stages", "--json", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"nothing learned yet: no qosflow worker has recorded a stage on this machine (no store at {tmp_path / 'home'}" in said
    assert json.loads(out.read_text()) == [] and not (tmp_path / "home" / "qosflow.db").exists()
    # a --db given, or $QOSFLOW_DATABASE_URL, that is not there is still an error naming it
    missing = tmp_path / "nowhere.db"
    assert main(["predict", "stages", "--db", f"sqlite:///{missing}"]) == 2
    assert f"no qosflow database at {missing}" in capsys.readouterr().err
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", f"sqlite:///{missing}")
    assert main(["predict", "stages"]) == 2
    assert f"no qosflow database at {missing}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["demo"], ["profile"], ["predict", "prune"], ["predict", "stages"], ["worker", "start"]])
def test_option_help_at_80_columns_cuts_no_word(command):
    """At 80 columns a word too long for the help column was cut with an ellipsis: 'postgresql+psycopg://USER:
    PASSWORD@H…' (profile, predict prune, demo), '$QOSFLOW_WORKER_METRIC…' (worker start). It is folded now."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    env.pop("NO_COLOR", None)
    r = subprocess.run([sys.executable, "-m", "qosflow", *command, "--help"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    if command != ["worker", "start"]:
        # the URL is all there, folded at the column's edge
        joined = "".join("".join(line.replace("│", " ").split()) for line in r.stdout.splitlines())
        assert "USER:PASSWORD@HOST:PORT" in joined, r.stdout


def test_status_marks_an_online_worker_whose_heartbeats_stopped(capsys, monkeypatch):
    """A worker stopped a minute ago was listed 'ONLINE, 92.2 s ago' like a live one until Prefect's own
    timeout marked it OFFLINE: it is marked silent, and the caption says what that means."""
    import qosflow.prefect.local as local
    import qosflow.prefect.status as status
    from qosflow.prefect.status import PoolStatus, WorkerStatus

    async def no_check(pool, **kw):
        return None

    async def fake_status(pool, limit=200):
        return PoolStatus(pool, workers=[WorkerStatus("w1", "ONLINE", True, 12.0), WorkerStatus("wtest", "ONLINE", True, 92.0),
                                         WorkerStatus("old", "OFFLINE", False, 900.0)])

    monkeypatch.setattr(local, "check_pool", no_check)
    monkeypatch.setattr(local, "require_api_url", lambda what: "http://127.0.0.1:1/api")
    monkeypatch.setattr(status, "pool_status", fake_status)
    assert main(["status", "--pool", "gpu"]) in (0, None)
    text = capsys.readouterr().out
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in text.splitlines() if ln.count("│") == 4}
    assert rows == {"w1": "ONLINE", "wtest": "ONLINE, silent", "old": "OFFLINE"}, text
    assert "no heartbeat for over 60 s" in " ".join(text.split()), text

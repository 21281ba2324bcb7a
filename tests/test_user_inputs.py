"""A user's own traces and clusters given to `qosflow simulate` (and `qosflow pack`): the mistakes of a
hand-made input, and what an earlier run leaves in the output directory."""

from __future__ import annotations

import json

import pytest

from qosflow.cli.main import main
from qosflow.errors import TraceFormatError
from qosflow.sim.clusters import load_cluster
from qosflow.sim.traces.muri import load_muri

TRACE = """job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,iteration_time
a1,1,0,1000,resnet18,128,3600000,3600
a2,2,60000,2000,bert,4,7200000,3600
a3,4,120000,500,gpt2,4,1800000,3600
a4,1,180000,1000,vgg16,16,3600000,3600
a5,8,240000,1000,resnet18,128,3600000,3600
a6,1,300000,1000,dqn,128,600000,600
"""
CLUSTER = "num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,2,4,32,256\n"
PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p1,4000,8192,1,500,,LS,Succeeded,0,3600,10
p2,2000,4096,0,0,,Burstable,Succeeded,200,900,200
"""


def _files(tmp_path, trace=TRACE, cluster=CLUSTER):
    t, c = tmp_path / "trace.csv", tmp_path / "cluster.csv"
    t.write_text(trace)
    c.write_text(cluster)
    return t, c


@pytest.mark.parametrize("cell, unit, value", [("60min", "milliseconds", "3600000"), ("2 h", "milliseconds", "7200000"),
                                                ("1500ms", "milliseconds", "1500")])
def test_a_duration_with_a_unit_says_what_to_write(tmp_path, cell, unit, value):
    """'60min' in the duration column was "expected duration in ms (a number), got '60min'", with no word on
    how to write it."""
    t, _ = _files(tmp_path, TRACE.replace("a1,1,0,1000,resnet18,128,3600000", f"a1,1,0,1000,resnet18,128,{cell}"))
    with pytest.raises(TraceFormatError) as e:
        load_muri(t)
    msg = str(e.value)
    assert f"{t}:2: column 'duration'" in msg
    assert f"the column is in {unit}, written without a unit: {cell!r} is {value}" in msg


def test_an_alibaba_time_with_a_unit_says_what_to_write(tmp_path, capsys):
    t, _ = _files(tmp_path, PODS.replace(",0,3600,10", ",0,1h,10"))
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,4,T4\n")
    assert main(["simulate", "--trace", str(t), "--cluster", str(nodes), "--policies", "fifo", "--no-plots"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{t}:2: column 'deletion_time'" in err and "in seconds, written without a unit: '1h' is 3600" in err


def test_a_muri_cluster_of_zero_gpus_per_node_is_refused_at_its_line(tmp_path):
    """num_gpu_p_node 0 made a cluster of no GPUs: every job was then rejected, 'the cluster has 0 that fit
    it', and the error named the trace, not the cluster file."""
    _, c = _files(tmp_path, cluster=CLUSTER.replace("1,2,4,32,256", "1,2,0,32,256"))
    with pytest.raises(TraceFormatError, match=r"cluster.csv:2: column 'num_gpu_p_node': must be > 0"):
        load_cluster(c)


def test_a_cluster_without_any_gpu_is_refused_by_simulate(tmp_path, capsys):
    """A node list of CPU nodes only was simulated: GPU jobs rejected one by one, the rest compared at 0 %
    GPU allocation."""
    t, _ = _files(tmp_path, PODS)
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,0,\n")
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(t), "--cluster", str(nodes), "--policies", "fifo", "--json", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{nodes}: the cluster has no GPUs" in err
    assert not out.exists()


def _simulate(t, c, *extra):
    return main(["simulate", "--trace", str(t), "--cluster", str(c), *extra])


def test_files_an_earlier_run_left_in_out_are_named(tmp_path, capsys):
    """A second run into the same --out, without sjf and without deadlines, left jobs-sjf.csv and the first
    run's dsr_by_class.png beside its own results without a word. They are named (not removed: a user may
    gather one policy per run in one directory); a CSV of the user's own is left out of it."""
    t, c = _files(tmp_path)
    out = tmp_path / "out"
    assert _simulate(t, c, "--policies", "fifo,sjf", "--out", str(out)) == 0
    assert (out / "dsr_by_class.png").is_file() and (out / "jobs-sjf.csv").is_file()
    (out / "jobs-mine.csv").write_text("job,whatever\n1,2\n")
    capsys.readouterr()
    assert _simulate(t, c, "--policies", "fifo", "--deadline-share", "0", "--out", str(out)) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "also holds 2 file(s) of an earlier run that this run did not write: dsr_by_class.png, jobs-sjf.csv" in text
    assert "jobs-mine.csv" not in text
    assert (out / "jobs-sjf.csv").is_file() and (out / "jobs-mine.csv").is_file()  # nothing removed


def test_ctrl_c_during_the_runs_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    """Ctrl-C ended simulate with exit status 130 and not a word on what it left."""
    from qosflow.sim.batch import Batch

    def interrupt(self, on_progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(Batch, "run", interrupt)
    t, c = _files(tmp_path)
    out = tmp_path / "res" / "r.json"
    assert _simulate(t, c, "--policies", "fifo", "--json", str(out)) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert f"interrupted before the runs had finished: nothing was written to {out} or {out.parent}" in err
    assert not out.parent.exists()


def test_ctrl_c_while_writing_a_plot_leaves_the_earlier_one_whole(tmp_path, capsys, monkeypatch):
    """A plot interrupted while being saved was left half written over the earlier run's; now the earlier
    file stays whole, and the message says what this run wrote and what it did not."""
    import matplotlib.figure

    t, c = _files(tmp_path)
    out = tmp_path / "out"
    assert _simulate(t, c, "--policies", "fifo", "--json", str(out / "r.json")) == 0
    before = (out / "jct_cdf.png").read_bytes()
    real = matplotlib.figure.Figure.savefig

    def half_then_interrupt(self, fname, *args, **kwargs):
        real(self, fname, *args, **kwargs)
        with open(fname, "r+b") as f:
            f.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_interrupt)
    capsys.readouterr()
    assert _simulate(t, c, "--policies", "fifo,sjf", "--json", str(out / "r.json")) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert f"interrupted while writing the results: written {out / 'r.json'}; not written the plots, the per-job CSVs" in err
    assert (out / "jct_cdf.png").read_bytes() == before
    assert not list(out.glob(".*.part"))
    assert set(json.loads((out / "r.json").read_text())["policies"]) == {"fifo", "sjf"}


def test_jobs_of_a_model_without_measurements_are_named(tmp_path, capsys):
    """A model of the user's own ('llama-7b') ran on an assumed GPU memory and the fallback pair slowdown
    without a word; the trace's other models are known and not named."""
    t, c = _files(tmp_path, TRACE.replace("a2,2,60000,2000,bert", "a2,2,60000,2000,llama-7b")
                  .replace("a6,1,300000,1000,dqn", "a6,1,300000,1000,llama-7b"))
    assert _simulate(t, c, "--policies", "fifo", "--no-plots") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "2 jobs of a model qosflow has no measurements of: llama-7b (2 jobs)" in text
    assert "assumed to be the largest profiled (10532 MiB)" in text
    t, c = _files(tmp_path)
    assert _simulate(t, c, "--policies", "fifo", "--no-plots") == 0
    assert "no measurements" not in capsys.readouterr().out
    # an Alibaba pod list names no model at all (its jobs are 'alibaba-pod'): nothing to say
    p = tmp_path / "pods.csv"
    p.write_text(PODS)
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,4,T4\n")
    assert main(["simulate", "--trace", str(p), "--cluster", str(nodes), "--policies", "fifo", "--no-plots"]) == 0
    assert "no measurements" not in capsys.readouterr().out


GAVEL = ("ResNet-18 (batch size 128)\tcmd\t-n\t1\t10000\t0\t1\n"
         "LM (batch size 80)\tcmd\t-n\t1\t5000\t60\t2\n")


@pytest.mark.parametrize("sep, says", [("    ", "no tab, only spaces"), (",", "separated by commas")])
def test_a_gavel_trace_without_tabs_says_how_it_is_separated(tmp_path, sep, says):
    """A hand-written Gavel trace whose tabs an editor turned into spaces (or a CSV export) got only
    'expected 7 tab-separated fields ..., got 1'."""
    from qosflow.sim.traces.gavel import load_gavel

    t = tmp_path / "mine.trace"
    t.write_text(GAVEL.replace("\t", sep))
    with pytest.raises(TraceFormatError) as e:
        load_gavel(t)
    assert f"{t}:1: expected 7 tab-separated fields" in str(e.value) and says in str(e.value)
    t.write_text(GAVEL)
    assert len(load_gavel(t)[0]) == 2


def test_the_json_says_what_the_run_was_given(tmp_path):
    """Two result files of runs with another --deadline-share, --error or trace could not be told apart:
    the JSON held the seed and estimator, not the trace, the cluster as given, the deadline share, the
    noisy estimator's error or the qosflow version."""
    import qosflow

    t, c = _files(tmp_path)
    out = tmp_path / "r.json"
    assert _simulate(t, c, "--policies", "fifo", "--estimator", "noisy", "--error", "0.2", "--deadline-share", "0.8",
                     "--seed", "3", "--json", str(out), "--no-plots") == 0
    d = json.loads(out.read_text())
    assert d["workload"]["trace"] == str(t) and d["workload"]["format"] == "muri"
    assert d["workload"]["deadline_share"] == 0.8 and d["error"] == 0.2 and d["seed"] == 3
    assert d["cluster"]["given"] == str(c) and d["cluster"]["gpus"] == 8
    assert d["qosflow_version"] == qosflow.__version__


def test_cores_assumed_per_gpu_are_said_and_can_be_set(tmp_path, capsys):
    """A Muri trace gives no CPU cores; each job takes 4 per GPU. On a user's 8-GPU, 16-core node the 8-GPU
    job was rejected ('no node has 8 GPUs with 32 cores', cores the user never asked for) and the others ran
    four GPUs at a time (29 % GPU allocation), without a word on why; nothing could change the 4."""
    t, c = _files(tmp_path, cluster=CLUSTER.replace("1,2,4,32,256", "1,1,8,16,256"))
    out = tmp_path / "r.json"
    assert _simulate(t, c, "--policies", "fifo", "--no-plots", "--json", str(out)) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "each job takes 4 per GPU (the default), and cluster has 2 per GPU on its GPU nodes" in text
    assert "1 job is rejected for cores" in text and "--cores-per-gpu 2" in text
    assert [r["job"] for r in json.loads(out.read_text())["workload"]["rejected"]] == ["a5"]
    assert _simulate(t, c, "--policies", "fifo", "--no-plots", "--json", str(out), "--cores-per-gpu", "2") == 0
    assert "CPU cores per job" not in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["workload"]["rejected"] == [] and d["workload"]["cores_per_gpu"] == 2
    # an Alibaba pod list has its own cores
    p = tmp_path / "pods.csv"
    p.write_text(PODS)
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,4,T4\n")
    assert main(["simulate", "--trace", str(p), "--cluster", str(nodes), "--cores-per-gpu", "2"]) == 2
    assert "gives each pod's cores (cpu_milli)" in capsys.readouterr().err


def test_a_result_place_taken_by_a_directory_is_an_error_not_a_traceback(tmp_path, capsys):
    """A directory named like one of the plots (dsr.png) ended the run, its results done, in an
    IsADirectoryError traceback; the error now names the place and what had been written."""
    t, c = _files(tmp_path)
    out = tmp_path / "out"
    (out / "dsr.png").mkdir(parents=True)
    assert _simulate(t, c, "--policies", "fifo", "--json", str(out / "r.json")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cannot write {out / 'dsr.png'}: Is a directory; written before it: {out / 'r.json'}, {out / 'jct_cdf.png'}" in err
    assert not list(out.glob(".*.part"))


def test_a_column_named_twice_is_an_error(tmp_path):
    """A trace with a second 'duration' column pasted at its end read the last one without a word (a job
    of 1 h ran 60 ms); a Muri cluster CSV likewise."""
    t, c = _files(tmp_path, "job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,iteration_time,duration\n"
                            "x1,1,0,10,resnet18,32,3600000,100,60\n",
                  CLUSTER.replace("mem_p_node\n", "mem_p_node,num_gpu_p_node\n").replace("256\n", "256,8\n"))
    with pytest.raises(TraceFormatError, match=r"trace.csv:1: the header names 'duration' \(columns 7 and 9\) twice"):
        load_muri(t)
    with pytest.raises(TraceFormatError, match=r"cluster.csv:1: the header names 'num_gpu_p_node' \(columns 3 and 6\) twice"):
        load_cluster(c)


PAIRS = """model1,batchsize1,gpu_num1,speed1,model2,batchsize2,gpu_num2,speed2
resnet18,128,1,0.8,bert,4,1,0.7
resnet18,128,1,0.9,gpt2,4,1,0.6
bert,4,1,0.75,gpt2,4,1,0.65
vgg16,16,1,0.5,bert,4,1,0.8
vgg16,16,1,0.55,resnet18,128,1,0.85
dqn,128,1,0.9,a2c,64,1,0.9
a2c,64,1,0.8,bert,4,1,0.85
dqn,128,1,0.7,gpt2,4,1,0.9
shufflenet,128,1,0.9,bert,4,1,0.8
shufflenet,128,1,0.95,vgg16,16,1,0.6
"""


def test_pair_speeds_that_look_like_slowdowns_are_warned_of(tmp_path, capsys):
    """A pair table with slowdowns (1.8: alone / shared) where speeds go (shared / alone) was evaluated
    as if the jobs ran faster side by side, without a word."""
    p = tmp_path / "pairs.csv"
    p.write_text(PAIRS.replace("resnet18,128,1,0.8,bert", "resnet18,128,1,1.8,bert"))
    assert main(["predict", "eval", "--pairs", str(p), "--folds", "3"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"warning: {p}: 1 speed(s) above 1.2 (line 2 speed1 1.8)" in err and "give 1/x instead" in err
    p.write_text(PAIRS)
    assert main(["predict", "eval", "--pairs", str(p), "--folds", "3"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_muri_trace_written_in_seconds_gets_a_note(tmp_path, capsys):
    """A Muri trace is in milliseconds; one written in seconds ran every job 1000 times shorter without a
    word. simulate's --help did not say where the formats are described, nor their units."""
    t, c = _files(tmp_path, TRACE.replace("3600000,3600", "3600,3.6").replace("7200000,3600", "7200,3.6")
                  .replace("1800000,3600", "1800,3.6").replace("600000,600", "600,0.6"))
    assert _simulate(t, c, "--policies", "fifo", "--no-plots") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "the jobs' median duration is 3.6 s. A Muri trace gives times in milliseconds" in text
    t, c = _files(tmp_path)
    assert _simulate(t, c, "--policies", "fifo", "--no-plots") == 0
    assert "median duration" not in capsys.readouterr().out
    from typer.testing import CliRunner

    from qosflow.cli.main import app

    r = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"})
    assert "times in milliseconds" in r.output and "docs/workloads.md" in r.output


def test_a_long_run_without_a_terminal_reports_progress_on_stderr(monkeypatch):
    """Without a terminal (a batch job, nohup, a pipe) the progress bar is off, and a run of hours showed
    nothing at all until it ended. Past `after` seconds it now prints a line per tenth of each task."""
    import io

    from rich.console import Console

    from qosflow.cli.output import LogProgress, progress_bar

    assert isinstance(progress_bar(console=Console(file=io.StringIO())), LogProgress)
    now = [0.0]
    out = io.StringIO()
    p = LogProgress(after=10, every=60, stream=out)
    p._clock = lambda: now[0]
    p._start = 0.0
    a = p.add_task("     fifo", total=1000)
    p.update(a, completed=500)  # before `after`: nothing
    assert out.getvalue() == ""
    now[0] = 70.0
    for done in range(510, 1001, 10):
        p.update(a, completed=done)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[0:01:10] fifo: 510/1,000 (51%)"
    assert lines[-1] == "[0:01:10] fifo: 1,000/1,000 (100%)" and len(lines) == 6  # 51 %, then 60, 70, 80, 90, 100 %


def test_a_second_json_in_the_same_directory_says_the_plots_are_now_its(tmp_path, capsys):
    """Comparing seeds with --json out/seed0.json, then --json out/seed1.json: the second run's plots and
    per-job CSVs (next to its JSON) replaced the first's without a word, and seed0.json no longer matched the
    files beside it."""
    t, c = _files(tmp_path)
    out = tmp_path / "out"
    assert _simulate(t, c, "--policies", "fifo", "--seed", "0", "--json", str(out / "seed0.json")) == 0
    assert "another run" not in capsys.readouterr().out
    assert _simulate(t, c, "--policies", "fifo", "--seed", "1", "--json", str(out / "seed1.json")) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"{out} also holds seed0.json, the results of another run" in text and f"--out {out / 'seed1'}" in text
    # with --out of its own, nothing of the other run's is touched, and nothing is said
    assert _simulate(t, c, "--policies", "fifo", "--seed", "2", "--json", str(out / "seed2.json"), "--out", str(out / "seed2")) == 0
    assert "another run" not in capsys.readouterr().out


@pytest.mark.parametrize("written, meant", [("Duration", "duration"), ("num_gpus", "num_gpu"), ("dur", "duration"),
                                            ("submit time", "submit_time")])
def test_a_misnamed_column_is_named_with_the_one_it_stands_for(tmp_path, written, meant):
    """'missing column(s) 'duration' ... (found: ...,Duration,...)' left the user to spot the difference."""
    header = TRACE.splitlines()[0]
    t, _ = _files(tmp_path, TRACE.replace(header, header.replace(meant, written, 1)))
    with pytest.raises(TraceFormatError) as e:
        load_muri(t)
    assert f"missing column(s) '{meant}'" in str(e.value)
    assert f"the header has '{written}' for '{meant}': rename it" in str(e.value)


def test_a_misnamed_pod_list_column_is_named_too(tmp_path, capsys):
    p = tmp_path / "pods.csv"
    p.write_text(PODS.replace("gpu_milli", "GPU_milli", 1))
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,4,T4\n")
    assert main(["pack", "--pods", str(p), "--nodes", str(nodes), "--seeds", "1"]) == 2
    assert "the header has 'GPU_milli' for 'gpu_milli': rename it" in " ".join(capsys.readouterr().err.split())


def test_the_declared_estimator_on_a_trace_says_it_knows_nothing(tmp_path, capsys):
    """--estimator declared on a trace: no job declares a duration, so every one was taken for 600 s, and
    neither --help nor the run said so."""
    t, c = _files(tmp_path)
    assert _simulate(t, c, "--policies", "fifo", "--estimator", "declared", "--no-plots") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "no job of trace declares a duration (traces carry none), so the policies take every job for 600 s" in text
    assert _simulate(t, c, "--policies", "fifo", "--no-plots") == 0
    assert "declares a duration" not in capsys.readouterr().out


def test_ctrl_c_while_the_trace_loads_says_so_too(tmp_path, capsys, monkeypatch):
    import qosflow.sim.runner as runner

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "resolve_workload", interrupt)
    t, c = _files(tmp_path)
    out = tmp_path / "res" / "r.json"
    assert _simulate(t, c, "--policies", "fifo", "--json", str(out)) == 130
    assert "interrupted before the runs had finished: nothing was written" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("cell, says", [('"3,600,000"', "write numbers without thousands separators: 3600000"),
                                        ('"3600000,5"', "write the decimal point as a point: 3600000.5")])
def test_a_number_exported_with_separators_says_how_to_write_it(tmp_path, cell, says):
    """A spreadsheet export with thousands separators or a decimal comma got only "expected duration in ms
    (a number), got '3,600,000'"."""
    t, _ = _files(tmp_path, TRACE.replace("a1,1,0,1000,resnet18,128,3600000", f"a1,1,0,1000,resnet18,128,{cell}"))
    with pytest.raises(TraceFormatError) as e:
        load_muri(t)
    assert f"{t}:2: column 'duration'" in str(e.value) and says in str(e.value)

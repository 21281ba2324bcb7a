"""`qosflow simulate` end to end: table, JSON schema, plots, and clear errors on bad input."""

import json
import os
import re
import subprocess
import sys

import pytest

from qosflow.cli.main import main
from tiny_inputs import MURI_ONE_JOB, PODS_ONE


def test_simulate_synthetic_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = main(["simulate", "--trace", "synthetic", "--jobs", "60", "--cluster", "2x4", "--policies", "fifo,sjf-bsbf,qosflow", "--seed", "3", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"fifo", "sjf-bsbf", "qosflow"}
    for m in data["policies"].values():
        for key in ("avg_jct", "p99_jct", "makespan", "dsr", "gpu_util", "avg_queue", "jobs"):
            assert key in m
        assert 0 <= m["dsr"] <= 1 and 0 <= m["gpu_util"] <= 1
        assert m["jobs"] == 60
    assert set(data["bounds"]) >= {"avg_jct", "dsr"}
    for png in ("jct_cdf.png", "dsr.png", "gpu_util.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # the help names every plot written (it left out the average JCT and the GPU timeline)
    from qosflow.cli.simulate import HELP

    said = {"jct_cdf.png": "JCT CDF", "avg_jct.png": "average JCT", "dsr.png": "DSR", "gpu_util.png": "GPU allocation",
            "gpu_timeline.png": "GPU timeline", "dsr_by_class.png": "DSR by job class"}
    assert {p.name for p in tmp_path.glob("*.png")} == set(said)
    assert all(words in HELP for words in said.values())
    text = " ".join(capsys.readouterr().out.split())
    assert "qosflow" in text and "bound" in text
    # 60 jobs load 8 GPUs: no note, and the JSON says how loaded the cluster is while jobs arrive
    assert "few for" not in text
    offered = data["workload"]["offered_load"]
    assert offered["gpus"] == 8 and offered["load"] == pytest.approx(1.0) and offered["thin"] is False


def test_simulate_notes_a_synthetic_workload_too_small_for_the_cluster(tmp_path, capsys):
    """`--jobs 60` on the default 8x8 showed no queueing and identical policies without a word: its
    long jobs run after the last arrival, and the jobs never ask for all 64 GPUs."""
    out = tmp_path / "r.json"
    assert main(["simulate", "--jobs", "60", "--policies", "fifo,srtf", "--no-plots", "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "note: 60 jobs are few for 64 GPUs" in text and "--jobs 384" in text and "60 jobs on about 10 GPUs" in text
    offered = json.loads(out.read_text())["workload"]["offered_load"]
    assert offered["thin"] is True and offered["peak_gpus"] <= 64 and offered["during_arrivals"] < 0.5


def test_simulate_says_where_pair_slowdowns_come_from(tmp_path, capsys, monkeypatch):
    """Without Gavel's table (a pip-installed qosflow does not find ../shared/data) the simulator fell
    back to its default slowdowns without a word, so results differed from a checkout's unexplained."""
    from qosflow.paths import shared_data

    if not (shared_data() / "throughputs" / "gavel_simulation_throughputs.json").is_file():
        pytest.skip(f"Gavel's throughput table is not under {shared_data()} (set QOSFLOW_SHARED_DATA)")
    out = tmp_path / "r.json"
    args = ["simulate", "--jobs", "12", "--cluster", "2x4", "--policies", "fifo", "--no-plots", "--json", str(out)]
    assert main(args) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Gavel's measured table (v100, 26 job types" in text and "was not found" not in text
    assert json.loads(out.read_text())["speed_model"].startswith("pair and spread slowdowns: Gavel's measured table")
    monkeypatch.setenv("QOSFLOW_SHARED_DATA", str(tmp_path / "nowhere"))
    assert main(args) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Gavel's measured throughput table was not found at " + str(tmp_path / "nowhere") in text
    assert "Point QOSFLOW_SHARED_DATA at" in text
    assert json.loads(out.read_text())["speed_model"].startswith("pair slowdowns: the jobs' per-iteration resource profiles")


def test_default_policies_compare_qosflow_with_the_baselines(tmp_path):
    out = tmp_path / "d.json"
    assert main(["simulate", "--jobs", "12", "--cluster", "2x4", "--no-plots", "--json", str(out)]) == 0
    names = set(json.loads(out.read_text())["policies"])
    assert {"qosflow", "fifo", "srtf", "tiresias", "sjf-bsbf", "genie"} <= names


def test_python_dash_m_works_like_the_script(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, "-m", "qosflow", "simulate", "--trace", "synthetic", "--jobs", "20", "--cluster", "1x4", "--policies", "fifo", "--json", str(out), "--no-plots"],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    # 8-GPU jobs can never fit a 4-GPU node: reported as rejected, never silently dropped
    rejected = data["workload"]["rejected"]
    assert data["policies"]["fifo"]["jobs"] + len(rejected) == 20
    assert all("GPU" in r["reason"] for r in rejected)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "fifo,nope"], "unknown policy 'nope'"),
        (["--cluster", "8y8"], "8y8"),
        (["--trace", "/does/not/exist.csv"], "does not exist"),
        (["--estimator", "psychic"], "unknown estimator 'psychic'"),
        # a misspelt --format with --jobs: was "invalid --jobs: ... synthetic (xyz) is simulated whole"
        (["--policies", "fifo", "--format", "xyz"], "unknown trace format 'xyz'; choose one of: alibaba, gavel, muri, synthetic"),
        (["--trace", "/"], "/ is a directory; give a trace file in it"),  # was "cannot tell the trace format from its header"
        (["--policies", "qosflow", "--set", "qosflow.expres_share=0.1"], "has no option 'expres_share'; it has: "),
        (["--policies", "qosflow", "--set", "qosflow.express_share=2"], "express_share must be in [0, 1)"),
        (["--policies", "fifo", "--set", "qosflow.express_share=0.1"], "policy 'qosflow' is not among --policies"),
        (["--policies", "qosflow", "--set", "express_share"], "POLICY.OPTION=VALUE"),
        # options written into --policies, or no name at all: were "unknown policy 'qosflow:express_share=0.1'" / "''"
        (["--policies", "fifo,qosflow:express_share=0.1"], "'qosflow:express_share=0.1': --policies takes policy names "
                                                            "only; give a policy's options with --set qosflow.OPTION=VALUE"),
        (["--policies", ","], "invalid --policies: give at least one policy name"),
        # a value of the wrong type: a text failed mid-run with a traceback, "False" or "maybe" turned a switch on
        (["--policies", "qosflow", "--set", "qosflow.qos_weight=abc"], "option 'qos_weight' of policy 'qosflow' takes a number, got 'abc'"),
        (["--policies", "qosflow", "--set", "qosflow.align=FALSE"], "option 'align' of policy 'qosflow' takes true or false, got 'FALSE'"),
        (["--policies", "fifo", "--set", "fifo.backfill=maybe"], "takes true or false, got 'maybe'"),
        # output places are checked before the runs, not after them
        (["--policies", "fifo", "--json", "/proc/no/such/dir/out.json"], "--json /proc/no/such/dir/out.json: cannot write there"),
        (["--policies", "fifo", "--json", "/"], "--json /: is a directory"),
        # --out takes the per-job CSVs even with --no-plots: it was checked only with plots, and an unwritable
        # --out ended the finished runs in a FileNotFoundError traceback, their results lost
        (["--policies", "fifo", "--out", "/proc/no/such/dir"], "--out /proc/no/such/dir: cannot write there"),
        # checked whatever the estimator (it used to run, or crash with a traceback under noisy)
        (["--policies", "fifo", "--error", "2"], "invalid --error: must be in [0, 1)"),
        (["--policies", "fifo", "--estimator", "noisy", "--error", "-0.1"], "invalid --error: must be in [0, 1)"),
        (["--policies", "fifo", "--failures", "1.5"], "invalid --failures: must be a share of jobs in [0, 1]"),
        (["--policies", "fifo", "--deadline-share", "2"], "invalid --deadline-share: must be a share of jobs in [0, 1]"),
    ],
)
def test_bad_input_is_a_clear_error(args, message, capsys):
    rc = main(["simulate", "--jobs", "10", "--no-plots", *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_policy_options_reach_the_policy(tmp_path):
    """`--set` changes what the policy does (the express node keeps a node free, so the makespan of
    a workload that wants every node changes) and is recorded in the JSON."""
    runs = {}
    for extra in ([], ["--set", "qosflow.express_share=0.5", "--set", "qosflow.express_max_s=60"]):
        out = tmp_path / f"r{len(extra)}.json"
        rc = main(["simulate", "--trace", "synthetic", "--jobs", "80", "--cluster", "2x4", "--policies", "qosflow", "--seed", "1",
                   "--json", str(out), "--no-plots", *extra])
        assert rc == 0
        runs[len(extra)] = json.loads(out.read_text())
    assert runs[0]["policy_options"] == {}
    assert runs[4]["policy_options"] == {"qosflow": {"express_share": 0.5, "express_max_s": 60}}
    assert runs[0]["policies"]["qosflow"]["makespan"] != runs[4]["policies"]["qosflow"]["makespan"]


def test_policy_option_values_of_the_declared_type_pass():
    from qosflow.policies import parse_policy_options

    got = parse_policy_options(
        ["qosflow.align=true", "qosflow.makespan_beta=null", "qosflow.qos_weight=5", "qosflow.partner_rank=benefit",
         "tiresias.thresholds=[100, 2000]"],
        ["qosflow", "tiresias"],
    )
    assert got == {"qosflow": {"align": True, "makespan_beta": None, "qos_weight": 5, "partner_rank": "benefit"},
                   "tiresias": {"thresholds": [100, 2000]}}
    # Python's spelling, as docs/policies.md writes the options (`align=True`), is read as Python reads it
    got = parse_policy_options(["qosflow.align=True", "qosflow.makespan_beta=None", "qosflow.gpu_models=False"], ["qosflow"])
    assert got == {"qosflow": {"align": True, "makespan_beta": None, "gpu_models": False}}


def test_locality_takes_one_of_its_names():
    """`--set fifo.locality=foo` used to run, placing as if 'spread'."""
    from qosflow.errors import SpecError
    from qosflow.policies import parse_policy_options

    for pol in ("fifo", "sjf", "srtf", "sjf-ffs", "sjf-bsbf"):
        with pytest.raises(SpecError, match=rf"option 'locality' of policy '{pol}' takes one of consolidated, spread, any, got 'foo'"):
            parse_policy_options([f"{pol}.locality=foo"], [pol])
        assert parse_policy_options([f"{pol}.locality=spread"], [pol]) == {pol: {"locality": "spread"}}


def test_malformed_trace_row_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "t.csv"
    bad.write_text(
        "job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,interval,iteration_time,resource_time_0,resource_time_1,resource_time_2,priority\n"
        "0,1,0,10,resnet18,128,1000,0,100,50,40,0,0\n"
        "1,one,0,10,resnet18,128,1000,0,100,50,40,0,0\n"
    )
    rc = main(["simulate", "--trace", str(bad), "--format", "muri", "--policies", "fifo", "--no-plots"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{bad}:3" in err and "num_gpu" in err


MURI_COLS = "job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,interval,iteration_time,resource_time_0,resource_time_1,resource_time_2,priority"


def test_jobs_with_a_trace_file_is_a_clear_error(tmp_path, capsys):
    """--jobs sizes the synthetic workload only; with a trace file it ended in a TypeError traceback."""
    trace = tmp_path / "t.csv"
    trace.write_text(MURI_COLS + "\n0,1,0,10,resnet18,128,1000,0,100,50,40,0,0\n")
    assert main(["simulate", "--trace", str(trace), "--jobs", "5", "--policies", "fifo", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "invalid --jobs: only the synthetic workload takes a number of jobs" in err and "Traceback" not in err
    assert main(["simulate", "--jobs", "0", "--policies", "fifo", "--no-plots"]) == 2
    assert "invalid --jobs: must be a positive number of jobs, got 0" in capsys.readouterr().err


def test_format_guessed_despite_bom_reordered_and_extra_columns(tmp_path):
    from qosflow.sim.runner import guess_format

    cols = MURI_COLS.split(",")
    p = tmp_path / "bom.csv"
    p.write_text(MURI_COLS + "\n0,1,0,10,resnet18,128,1000,0,100,50,40,0,0\n", encoding="utf-8-sig")
    assert guess_format(str(p)) == "muri"
    p = tmp_path / "reordered.csv"
    p.write_text(",".join(["note"] + cols[::-1]) + "\n")
    assert guess_format(str(p)) == "muri"
    p = tmp_path / "pods.csv"
    p.write_text("\ufeffname,num_gpu,gpu_milli,cpu_milli,memory_mib,owner\np0,1,500,1000,1024,x\n", encoding="utf-8")
    assert guess_format(str(p)) == "alibaba"


def test_no_job_left_is_a_clear_error(tmp_path, capsys):
    # pods that were never scheduled in the trace: no running time, so nothing can be simulated
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,scheduled_time,deletion_time\n"
                    "p0,1000,1024,1,500,0,,\np1,1000,1024,1,1000,5,,\n")
    rc = main(["simulate", "--trace", str(pods), "--cluster", "2x4", "--policies", "fifo", "--no-plots"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no job left to simulate" in err and "all 2 were rejected" in err and "no scheduled_time" in err


def _simulate_next_to_fifo(policy_cls, tmp_path, monkeypatch) -> dict:
    """Register a test policy, simulate it next to FIFO (exit code 2: one policy failed) and return
    the JSON, after checking that FIFO's results are all there."""
    from qosflow.policies import _REGISTRY, register

    monkeypatch.setitem(_REGISTRY, policy_cls.name, policy_cls)
    register(policy_cls)
    out = tmp_path / "r.json"
    rc = main(["simulate", "--jobs", "10", "--cluster", "2x4", "--policies", f"{policy_cls.name},fifo", "--json", str(out), "--no-plots"])
    assert rc == 2
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"fifo"} and data["policies"]["fifo"]["jobs"] == 10
    return data


def test_a_stalling_policy_does_not_hide_the_others(tmp_path, capsys, monkeypatch):
    from qosflow.policies import Decision, Policy

    class Idle(Policy):  # never starts anything: the simulator stops it as stalled
        name = "idle-test"

        def schedule(self, view):
            return Decision()

    data = _simulate_next_to_fifo(Idle, tmp_path, monkeypatch)
    assert "pending on an idle cluster" in data["failed_policies"]["idle-test"]
    assert "idle-test failed" in " ".join(capsys.readouterr().out.split())


def test_a_failed_run_leaves_no_output_directories(tmp_path, capsys):
    """The output checks made --json's and --out's missing directories before the run; a run that then
    failed left them behind, empty."""
    rc = main(["simulate", "--jobs", "10", "--trace", str(tmp_path / "missing.csv"), "--policies", "fifo",
               "--json", str(tmp_path / "j" / "deep" / "r.json"), "--out", str(tmp_path / "plots" / "deep")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sim_config_and_noisy_estimator_reject_out_of_range_values():
    from qosflow.core.estimate import NoisyEstimator
    from qosflow.errors import SpecError
    from qosflow.sim.engine import SimConfig

    with pytest.raises(SpecError, match="failure_share"):
        SimConfig(failure_share=-0.1)
    with pytest.raises(SpecError, match="checkpoint_fraction"):
        SimConfig(checkpoint_fraction=2)
    with pytest.raises(SpecError, match="restart_overhead"):
        SimConfig(restart_overhead=-1)
    with pytest.raises(SpecError, match=r"relative error must be in \[0, 1\)"):
        NoisyEstimator(error=1.0)


def test_a_trace_missing_a_column_is_named_by_what_it_lacks(tmp_path, capsys):
    """A Muri CSV without its duration column used to get 'cannot tell the trace format'; it is taken
    as a Muri trace, whose loader names the file, the line and the column it lacks."""
    trace = tmp_path / "t.csv"
    trace.write_text(MURI_COLS.replace(",duration", "") + "\n0,1,0,10,resnet18,128,0,100,50,40,0,0\n")
    assert main(["simulate", "--trace", str(trace), "--policies", "fifo", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:1" in err and "missing column(s) 'duration'; a Muri trace needs" in err, err
    other = tmp_path / "o.csv"
    other.write_text("a,b,c\n1,2,3\n")
    assert main(["simulate", "--trace", str(other), "--policies", "fifo", "--no-plots"]) == 2
    assert "cannot tell the trace format from its header (a, b, c); pass --format" in capsys.readouterr().err


def test_no_job_left_groups_the_same_reason_across_lines(tmp_path, capsys):
    # every row rejected for the same reason: one group naming its lines, not one group per line
    rows = "".join(f"{i},1,{i * 1000},0,resnet18,128,0,0,0,0,0,0,0\n" for i in range(7))
    p = tmp_path / "zero.csv"
    p.write_text(MURI_COLS + "\n" + rows)
    assert main(["simulate", "--trace", str(p), "--cluster", "2x4", "--policies", "fifo", "--no-plots"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "all 7 were rejected (7 x duration 0 ms, nothing to run (lines 2, 3, 4, 5, 6, ...))" in err


def test_format_guess_tells_other_inputs_apart(tmp_path):
    from qosflow.errors import QosflowError
    from qosflow.sim.runner import guess_format

    cases = {
        "nodes.csv": ("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\n", "an Alibaba node list", "--cluster"),
        "spec.csv": ("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,8,8,92,520\n",
                     "a Muri cluster spec", "--cluster"),
        "pairs.csv": ("Model1,batchsize1,gpu_num1,Speed1,model2,batchsize2,gpu_num2,speed2\nlm,20,1,0.5,lm,20,1,0.5\n",
                      "a co-location pair table", "predict eval --pairs"),
    }
    for name, (text, what, hint) in cases.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(QosflowError) as ei:
            guess_format(str(p))
        assert what in str(ei.value) and hint in str(ei.value) and name in str(ei.value)
    # a Gavel trace under another suffix: 7 tab-separated fields, no header
    p = tmp_path / "vc.txt"
    p.write_text("ResNet-18 (batch size 32)\tcd %s && python3 main.py\t--num_steps\t1\t1000\t0\t1\n")
    assert guess_format(str(p)) == "gavel"


def test_an_invalid_placement_ends_that_policy_only(tmp_path, capsys, monkeypatch):
    """A policy placing a job where it does not fit (on a mixed cluster, a GPU with too little memory)
    made the whole comparison die with 'invalid placement'; it now fails that policy's run only."""
    from qosflow.core.placement import Placement
    from qosflow.policies import Decision, Policy

    class Greedy(Policy):  # every pending job on GPU 0 of node 0, whatever is there
        name = "greedy-test"

        def schedule(self, view):
            return Decision(starts=[Placement(s.job_id, ((0, 0),)) for s in view.pending])

    data = _simulate_next_to_fifo(Greedy, tmp_path, monkeypatch)
    assert "policy 'greedy-test' at t=" in data["failed_policies"]["greedy-test"]
    assert "invalid placement" in data["failed_policies"]["greedy-test"]


def test_out_writes_a_per_job_csv_that_adds_up_to_the_summary(tmp_path):
    """--out writes jobs-<policy>.csv: one row per job, whose JCTs and deadline outcomes give the JSON's
    average JCT and DSR, and which carries the policy's note on why a job waited or shared."""
    import csv

    out = tmp_path / "res.json"
    rc = main(["simulate", "--trace", "synthetic", "--jobs", "60", "--cluster", "1x8", "--policies", "sjf,qosflow",
               "--seed", "1", "--json", str(out), "--out", str(tmp_path / "o"), "--no-plots"])
    assert rc == 0
    data = json.loads(out.read_text())
    for name in ("sjf", "qosflow"):
        rows = list(csv.DictReader((tmp_path / "o" / f"jobs-{name}.csv").open()))
        m = data["policies"][name]
        assert len(rows) == m["jobs"] == 60
        jct = [float(r["jct_s"]) for r in rows if r["status"] == "done"]
        assert sum(jct) / len(jct) == pytest.approx(m["avg_jct"], rel=1e-6)
        met = [r["deadline_met"] for r in rows if r["deadline_met"]]
        assert len(met) == m["deadline_jobs"] and met.count("yes") / len(met) == pytest.approx(m["dsr"])
        assert all(float(r["queue_s"]) >= 0 for r in rows)
    notes = [r["note"] for r in csv.DictReader((tmp_path / "o" / "jobs-qosflow.csv").open()) if r["note"]]
    assert any(n.startswith("waiting") or "shar" in n for n in notes), notes[:5]


def test_deadlines_met_by_job_class_add_up_to_the_dsr(tmp_path, capsys):
    """Each policy's deadline jobs per class of GPU count and isolated duration (JSON "dsr_by_class", a
    terminal table, dsr_by_class.png): the classes hold every deadline job once, their met counts are the
    per-job CSV's, and the table shows each policy's count per class."""
    import csv

    from qosflow.core.job import Job
    from qosflow.core.qos import QoSSpec
    from qosflow.sim.metrics import job_class
    from qosflow.sim.runner import resolve_workload

    out = tmp_path / "res.json"
    assert main(["simulate", "--trace", "synthetic", "--jobs", "80", "--cluster", "2x4", "--policies", "sjf,qosflow",
                 "--seed", "2", "--json", str(out), "--out", str(tmp_path / "o")]) == 0
    data = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "Deadlines met by job class" in text
    assert (tmp_path / "o" / "dsr_by_class.png").stat().st_size > 1000
    table = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]] for ln in text.splitlines()
             if ln.startswith("│") and "GPU" in ln.split("│")[1]}
    jobs = {r.job_id: r for r in resolve_workload("synthetic", None, "2x4", seed=2, jobs=80)[0].jobs}
    for col, name in enumerate(("sjf", "qosflow"), start=1):
        by = data["policies"][name]["dsr_by_class"]
        assert sum(c["jobs"] for c in by.values()) == data["policies"][name]["deadline_jobs"] > 0
        rows = [r for r in csv.DictReader((tmp_path / "o" / f"jobs-{name}.csv").open()) if r["deadline_met"]]
        want: dict[str, list[int]] = {}
        for r in rows:
            c = want.setdefault(job_class(jobs[r["job_id"]])[2], [0, 0])
            c[0] += 1
            c[1] += r["deadline_met"] == "yes"
        assert {k: [v["jobs"], v["met"]] for k, v in by.items()} == want
        for k, v in by.items():
            assert table[k][0] == str(v["jobs"]) and table[k][col].startswith(f"{v['met']} ("), (k, table[k])
    # class boundaries: GPUs none | 1 | 2 | 3-4 | 5-8 | > 8 (a fraction of a GPU counts as one); durations < 1 h | 1-6 h | ...
    cls = lambda g, d, **q: job_class(Job("x", 0.0, QoSSpec(gpus=g, **q), d))[2]  # noqa: E731
    assert cls(1, 3599.0) == "1 GPU, < 1 h" and cls(1, 3600.0) == "1 GPU, 1-6 h" and cls(1, 60.0, gpu_milli=500) == "1 GPU, < 1 h"
    assert cls(0, 60.0) == "no GPU, < 1 h" and cls(2, 60.0) == "2 GPUs, < 1 h"
    assert cls(4, 86399.0) == "3-4 GPUs, 6 h-1 d" and cls(8, 3 * 86400.0) == "5-8 GPUs, > 3 d" and cls(16, 1e5) == "> 8 GPUs, 1-3 d"


def test_trace_that_is_compressed_or_starts_empty_says_so(tmp_path, capsys):
    """A gzip-compressed trace said 'cannot tell the trace format from its header (<binary>)'; an empty file
    'cannot tell the trace format from its header ((empty))'."""
    import gzip

    p = tmp_path / "muri.csv.gz"
    p.write_bytes(gzip.compress(b"job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,iteration_time\n"))
    assert main(["simulate", "--trace", str(p), "--policies", "fifo", "--no-plots"]) == 2
    assert "muri.csv.gz: is gzip-compressed: unpack it first (gunzip); a trace is a text file" in capsys.readouterr().err
    p = tmp_path / "empty.csv"
    p.write_text("")
    assert main(["simulate", "--trace", str(p), "--policies", "fifo", "--no-plots"]) == 2
    assert "empty.csv: the first line is empty; a trace starts with its header" in capsys.readouterr().err


def test_format_guess_names_a_semicolon_or_tab_separated_header(tmp_path):
    """A Muri trace saved with semicolons said 'cannot tell the trace format ...; pass --format', and --format
    muri then said every column was missing."""
    from qosflow.errors import QosflowError
    from qosflow.sim.runner import guess_format

    header = "job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,iteration_time"
    for delim, name in ((";", "semicolons"), ("\t", "tabs")):
        p = tmp_path / "t.csv"
        p.write_text(header.replace(",", delim) + "\n")
        with pytest.raises(QosflowError, match=f"t.csv: its header is separated by {name} .*must be comma-separated"):
            guess_format(str(p))
    p.write_text("a\tb\tc\td\n")  # neither a trace header nor a Gavel line: no delimiter advice
    with pytest.raises(QosflowError, match="cannot tell the trace format"):
        guess_format(str(p))


def test_a_trace_or_table_given_in_the_wrong_place_says_where_it_goes(tmp_path):
    """A trace given as --cluster said "not a cluster file qosflow knows: expected a Muri CSV header ..." (a
    cluster spec given as --trace already said "pass it as --cluster"); Gavel's throughput table as --cluster
    said "'k80': expected a list of "V:P:K" strings", and as --trace "cannot tell the trace format from its
    header ({)". Each now says what the file is and where it goes."""
    import json as _json

    from qosflow.errors import QosflowError
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.runner import guess_format

    muri = tmp_path / "philly.csv"
    muri.write_text(MURI_ONE_JOB)
    pods = tmp_path / "pods.csv"
    pods.write_text(PODS_ONE)
    gavel = tmp_path / "vc.trace"
    gavel.write_text("ResNet-50 (batch size 64)\tcmd\t--num_steps\t1\t1000\t0\t1\n")
    table = tmp_path / "throughputs.json"
    table.write_text(_json.dumps({"k80": {"('ResNet-50 (batch size 64)', 1)": {"null": 1.0}}}))
    for path, what in ((muri, "this is a Muri trace, not a cluster file; pass it as --trace"),
                       (pods, "this is an Alibaba pod list, not a cluster file; pass it as --trace"),
                       (gavel, "this is a Gavel trace (tab-separated job lines), not a cluster file; pass it as --trace"),
                       (table, "this is a Gavel throughput table (worker type -> job -> throughputs), not a cluster spec")):
        with pytest.raises(QosflowError, match=re.escape(f"{path.name}")) as ei:
            load_cluster(str(path))
        assert what in str(ei.value), ei.value
    with pytest.raises(QosflowError) as ei:
        guess_format(str(table))
    assert "this is JSON, not a trace" in str(ei.value) and "qosflow predict eval --throughputs FILE" in str(ei.value)
    # the files qosflow does take as clusters still load
    spec = tmp_path / "cluster_specs.json"
    spec.write_text(_json.dumps({"vc": ["2:0:0"]}))
    assert load_cluster(str(spec)).num_gpus == 2


def test_without_deadlines_the_bound_row_shows_no_dsr_either(capsys):
    """With --deadline-share 0 every policy's DSR is '-', but the bound row said 100.0%."""
    assert main(["simulate", "--jobs", "20", "--cluster", "1x4", "--policies", "fifo", "--deadline-share", "0", "--no-plots"]) == 0
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("│")}
    dsr = 5  # avg JCT, median JCT, p99 JCT, makespan, avg queue, DSR
    assert rows["fifo"][dsr] == "-" and rows["bound"][dsr] == "-", rows
    assert main(["simulate", "--jobs", "20", "--cluster", "1x4", "--policies", "fifo", "--no-plots"]) == 0
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("│")}
    assert rows["bound"][dsr].endswith("%"), rows  # with deadlines, as before


def test_without_deadlines_the_json_dsr_is_null(tmp_path):
    """The JSON said "dsr": 1.0 for every policy and the bound, which scripts averaged as 100 %."""
    out = tmp_path / "r.json"
    args = ["simulate", "--jobs", "20", "--cluster", "1x4", "--policies", "fifo,qosflow", "--no-plots", "--json", str(out)]
    assert main([*args, "--deadline-share", "0"]) == 0
    data = json.loads(out.read_text())
    assert [m["dsr"] for m in data["policies"].values()] == [None, None] and data["bounds"]["dsr"] is None
    assert all(m["deadline_jobs"] == 0 for m in data["policies"].values())
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert all(0 <= m["dsr"] <= 1 and m["deadline_jobs"] > 0 for m in data["policies"].values())
    assert 0 <= data["bounds"]["dsr"] <= 1


def test_throughputs_option_names_the_table_for_a_gavel_trace(tmp_path, capsys, monkeypatch):
    """Without the shared table the error said "pass throughputs=PATH", a Python argument the CLI lacks."""
    monkeypatch.setenv("QOSFLOW_SHARED_DATA", str(tmp_path / "nowhere"))
    monkeypatch.delenv("QOSFLOW_THROUGHPUTS", raising=False)
    trace = tmp_path / "vc.trace"
    trace.write_text("A3C\tcd x\t--max-steps\t0\t7000\t0\t1\nA3C\tcd x\t--max-steps\t0\t700\t5\t1\n")
    assert main(["simulate", "--trace", str(trace), "--cluster", "1x4", "--policies", "fifo", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "--throughputs PATH" in err and "QOSFLOW_SHARED_DATA" in err and "throughputs=PATH)" in err
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"v100": {"('A3C', 1)": {"null": 7.0}}}))
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--cluster", "1x4", "--policies", "fifo", "--no-plots",
                 "--throughputs", str(table), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["policies"]["fifo"]["jobs"] == 2
    assert "QOSFLOW_THROUGHPUTS" not in os.environ  # for this run only, not for the rest of the process
    assert main(["simulate", "--trace", str(trace), "--policies", "fifo", "--throughputs", str(tmp_path / "no.json")]) == 2
    assert "invalid --throughputs" in capsys.readouterr().err


def test_the_class_table_keeps_one_line_per_class_with_every_policy(capsys):
    """With the nine policies side by side the class table is wider than the 120 columns the summary
    uses; its cells wrapped ('27' over '(100%)') until it was printed as wide as it needs."""
    assert main(["simulate", "--jobs", "40", "--cluster", "2x4", "--no-plots", "--parallel", "1",
                 "--policies", "fifo,sjf,srtf,tiresias,sjf-ffs,sjf-bsbf,genie,gavel,qosflow"]) == 0
    text = capsys.readouterr().out
    part = text[text.index("Deadlines met by job class"):]
    rows = [ln for ln in part.splitlines() if ln.startswith("│")]
    assert rows and all(ln.split("│")[1].strip() for ln in rows), rows  # no continuation line (empty class cell)
    assert all(ln.count("%)") == 9 for ln in rows), rows


def test_several_estimators_give_a_class_table_each(capsys):
    """With --estimator oracle,noisy,learned one class table held every policy x estimator (about 330
    columns); now one per estimator, with a column per policy."""
    assert main(["simulate", "--jobs", "40", "--cluster", "2x4", "--no-plots", "--parallel", "1",
                 "--policies", "fifo,qosflow", "--estimator", "oracle,noisy"]) == 0
    text = capsys.readouterr().out
    assert "Deadlines met by job class (oracle)" in text and "Deadlines met by job class (noisy" in text
    part = text[text.index("Deadlines met by job class (oracle)"):text.index("Deadlines met by job class (noisy")]
    rows = [ln for ln in part.splitlines() if ln.startswith("│")]
    assert rows and all(ln.count("%)") == 2 for ln in rows), rows


def test_format_that_contradicts_the_trace_is_an_error(tmp_path, capsys):
    """`--format synthetic --trace FILE` simulated the embedded generator's 400 jobs and never read FILE, and
    `--format muri` without --trace looked for a file named 'synthetic' ('synthetic: Muri trace not found';
    with --jobs, 'synthetic (muri) is simulated whole'). Both now say what --format and --trace are for;
    --format synthetic with the generator, or a trace's own format, run as before."""
    from qosflow.errors import SpecError
    from qosflow.sim.runner import resolve_workload

    trace = tmp_path / "t.csv"
    trace.write_text(MURI_ONE_JOB)
    for argv, says in (
        (["--format", "synthetic", "--trace", str(trace)],
         f"invalid --format: synthetic is the embedded generator, which reads no file, so {trace} would not be read: "
         "leave --format out"),
        (["--format", "muri"], "invalid --format: muri is the format of a trace file: give the file with --trace FILE"),
        (["--format", "Gavel", "--jobs", "5"], "invalid --format: gavel is the format of a trace file"),
        (["--format", "alibaba", "--users", "3"], "invalid --format: alibaba is the format of a trace file"),
    ):
        assert main(["simulate", "--policies", "fifo", "--no-plots"] + argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert says in err and "Traceback" not in err, err
    with pytest.raises(SpecError, match="reads no file"):
        resolve_workload(str(trace), "synthetic", "2x4")
    assert main(["simulate", "--policies", "fifo", "--no-plots", "--format", "synthetic", "--jobs", "5", "--cluster", "1x4"]) == 0
    assert main(["simulate", "--policies", "fifo", "--no-plots", "--format", "muri", "--trace", str(trace), "--cluster", "1x4"]) == 0
    assert main(["simulate", "--format", "xyz"]) == 2
    assert "unknown trace format 'xyz'" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["", " , "])
def test_empty_estimator_is_an_error(given, capsys):
    """`--estimator ""` (a variable left empty in a script) ran every policy under the oracle without a word."""
    assert main(["simulate", "--jobs", "5", "--policies", "fifo", "--no-plots", "--estimator", given]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"invalid --estimator: give at least one estimator, e.g. --estimator oracle or --estimator oracle,noisy,learned; " \
           f"got {given!r}" in err, err

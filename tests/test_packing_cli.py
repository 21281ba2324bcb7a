"""`qosflow pack` end to end on tiny CSVs: JSON shape, curve files, error exit codes."""

from __future__ import annotations

import json

import pytest

from qosflow.cli.main import main
from tiny_inputs import PODS_ONE

PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,4000,8192,1,1000,,LS,Running,0,100,0
p1,2000,4096,1,500,,LS,Running,1,100,1
p2,2000,4096,1,250,,BE,Running,2,100,2
p3,8000,16384,2,1000,,LS,Running,3,100,3
p4,16000,8192,0,0,,BE,Running,4,100,4
p5,2000,4096,1,750,T4,LS,Running,5,100,5
"""
NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,131072,4,V100M16
n1,16000,65536,2,T4
n2,16000,65536,2,T4
"""


def test_pack_cli_writes_json_csv_png(tmp_path, capsys):
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text(NODES)
    out_json = tmp_path / "res" / "pack.json"
    rc = main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit,best-fit,fgd,qosflow",
               "--seed", "3", "--seeds", "2", "--json", str(out_json)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert set(data["policies"]) == {"first-fit", "best-fit", "fgd", "qosflow"}
    for d in data["policies"].values():
        assert 0 < d["alloc_ratio"] <= 1
        assert d["allocated_gpus"] + d["unallocated_gpus"] == 8
        assert d["failed_pods"] >= 0 and len(d["per_seed"]) == 2
    assert data["config"]["seeds"] == [3, 4] and data["config"]["total_gpus"] == 8
    csv_text = (tmp_path / "res" / "pack_curve.csv").read_text().splitlines()
    assert csv_text[0].startswith("arrived_pct,first-fit,first-fit_std,best-fit")
    assert len(csv_text) == 132
    assert (tmp_path / "res" / "pack_curve.png").stat().st_size > 1000
    assert "GPU allocation at 100 % arrived demand" in " ".join(capsys.readouterr().out.split())


def test_pack_cli_errors_exit_2(tmp_path, capsys):
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text(NODES)
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "fgd,tetris", "--seeds", "1"]) == 2
    assert "unknown packing policy 'tetris'" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text(PODS.replace("p2,2000,4096,1,250", "p2,2000,4096,1,2500"))
    assert main(["pack", "--pods", str(bad), "--nodes", str(nodes), "--seeds", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4: column 'gpu_milli'" in err
    # output places are checked before the runs, not after them
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--seeds", "1", "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path}: is a directory" in capsys.readouterr().err
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--seeds", "1", "--out", str(pods)]) == 2
    assert f"--out {pods}: is a file, not a directory" in capsys.readouterr().err


def test_pack_cli_reports_pods_that_never_fit(tmp_path, capsys):
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS + "p6,2000,4096,8,1000,,LS,Running,6,100,6\np7,2000,4096,1,1000,A100,LS,Running,7,100,7\n")
    nodes.write_text(NODES)
    out_json = tmp_path / "pack.json"
    rc = main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit", "--seeds", "1",
               "--json", str(out_json), "--no-plots"])
    assert rc == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 of 8 pods fit no node" in out and "p6" in out and "no node has GPU model A100" in out
    never = json.loads(out_json.read_text())["config"]["never_fit_pods"]
    assert [n["pod"] for n in never] == ["p6", "p7"] and "8 GPU(s)" in never[0]["reason"]


def test_pack_cli_names_seeds_whose_arrivals_stop_short(tmp_path, capsys):
    # one 4-GPU node and only 3-GPU pods: 75 % arrive, the next pod would pass --ratio, so no
    # figure exists at 100 %: the seed is named and left out, not averaged in as NaN
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS.splitlines()[0] + "\np0,4000,8192,3,1000,,LS,Running,0,100,0\n")
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,4,V100M16\n")
    out_json = tmp_path / "pack.json"
    rc = main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "best-fit", "--seeds", "1",
               "--json", str(out_json), "--no-plots"])
    assert rc == 0
    assert "never reached 100 % of capacity with seed(s) 42" in " ".join(capsys.readouterr().out.split())
    d = json.loads(out_json.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))["policies"]["best-fit"]
    assert d["seeds_short_of_demand"] == [42]
    assert d["alloc_ratio"] is None  # no figure at 100 %: null, not NaN (which jq and JavaScript refuse)


def test_a_failed_run_leaves_no_output_directories(tmp_path, capsys):
    """The output checks made --json's and --out's missing directories before the run; a run that then
    failed left them behind, empty."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(NODES)
    rc = main(["pack", "--pods", str(tmp_path / "missing.csv"), "--nodes", str(nodes), "--seeds", "1",
               "--json", str(tmp_path / "j" / "deep" / "p.json"), "--out", str(tmp_path / "res" / "deep")])
    assert rc == 2 and "missing.csv" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nodes.csv"]
    # an unwritable place is still found before the run, and a good one still made when writing
    (tmp_path / "file").write_text("")
    rc = main(["pack", "--pods", str(tmp_path / "missing.csv"), "--nodes", str(nodes), "--seeds", "1",
               "--out", str(tmp_path / "file" / "res")])
    assert rc == 2 and f"--out {tmp_path / 'file' / 'res'}: cannot write there" in capsys.readouterr().err
    pods = tmp_path / "pods.csv"
    pods.write_text(PODS)
    rc = main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit", "--seeds", "1",
               "--json", str(tmp_path / "j" / "p.json"), "--out", str(tmp_path / "res" / "deep"), "--no-plots"])
    assert rc == 0 and (tmp_path / "j" / "p.json").exists() and (tmp_path / "res" / "deep" / "pack_curve.csv").exists()


def test_pack_cli_rejects_a_ratio_below_1(tmp_path, capsys):
    """The headline is read at 100 % arrived demand; with --ratio below 1 arrivals stop before it,
    so every seed of every policy was short and the table was all nan (exit 0). Now refused up front."""
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text(NODES)
    out_json = tmp_path / "pack.json"
    rc = main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit", "--seeds", "1",
               "--ratio", "0.5", "--json", str(out_json), "--no-plots"])
    captured = capsys.readouterr()
    assert rc == 2 and not out_json.exists() and "nan" not in captured.out
    assert "invalid --ratio: must be in [1, 10]" in captured.err and "got 0.5" in captured.err
    # 1 itself is accepted (whether a seed's arrivals then reach 100 % depends on the pods' sizes)
    rc = main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit", "--seeds", "1",
               "--ratio", "1", "--json", str(out_json), "--no-plots"])
    assert rc == 0 and out_json.exists()


def test_an_error_inside_the_progress_bar_follows_the_output_without_a_blank_line(tmp_path, capsys):
    """rich's Progress prints an empty line when it stops on a console that is not interactive (a pipe, a
    log, TERM=dumb), where a transient bar shows nothing at all: a run failing inside the bar printed its
    error after a stray blank line (and a successful one its table)."""
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS.splitlines()[0] + "\np4,16000,8192,0,0,,BE,Running,4,100,4\n")  # asks for no GPU
    nodes.write_text(NODES)
    rc = main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit", "--seeds", "1"])
    captured = capsys.readouterr()
    assert rc == 2 and "no pod asks for a GPU" in captured.err  # raised by the run, inside the bar
    assert captured.out.startswith("1 pods (pods.csv) on 3 nodes") and "" not in captured.out.splitlines()
    pods.write_text(PODS)
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit", "--seeds", "1"]) == 0
    assert "" not in capsys.readouterr().out.splitlines()


def test_pack_cli_parallel_gives_the_same_results(tmp_path, capsys):
    """`--parallel 2` runs the policy x seed runs in two worker processes: the same JSON as one after
    another (but the runs' own timing); `--parallel 0` is refused, naming the option."""
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text(NODES)
    data = {}
    for p in ("1", "2"):
        out = tmp_path / f"p{p}.json"
        assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit,best-fit,fgd,qosflow",
                     "--seeds", "3", "--parallel", p, "--no-plots", "--json", str(out)]) == 0
        data[p] = json.loads(out.read_text())

    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in ("seconds_per_run", "seconds", "parallel")}
        if isinstance(d, list):
            return [strip(x) for x in d]
        return d

    assert strip(data["1"]) == strip(data["2"])
    assert (data["1"]["config"]["parallel"], data["2"]["config"]["parallel"]) == (1, 2)
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--seeds", "1", "--parallel", "0"]) == 2
    err = capsys.readouterr().err
    assert "--parallel" in err and "at least 1" in err


def test_pack_without_the_shared_data_says_where_the_default_lists_are_read_from(tmp_path, capsys, monkeypatch):
    """`qosflow pack` (its defaults: the shared Alibaba lists) with the shared data elsewhere said only
    "...: pod list file not found"; it now says how to give the list or where the default is read from."""
    monkeypatch.setenv("QOSFLOW_SHARED_DATA", str(tmp_path / "nowhere"))
    assert main(["pack", "--seeds", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "alibaba_v2023_openb_pod_list_default.csv: the default pod list (Alibaba v2023, shared data) is not there: " \
           "give --pods FILE, or point QOSFLOW_SHARED_DATA at the directory that holds traces/" in err, err
    pods = tmp_path / "pods.csv"
    pods.write_text(PODS_ONE)
    assert main(["pack", "--seeds", "1", "--pods", str(pods)]) == 2  # the node list: the same
    assert "the default node list (Alibaba v2023, shared data) is not there: give --nodes FILE" in " ".join(capsys.readouterr().err.split())


# a list whose arrivals reach 100 % of the 8 GPUs with seed 43 only (42 and 44 stop short: the next pod
# would take them past 130 %); first-fit fails one pod with seed 43
SHORT_PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p1,4000,8192,1,500,,LS,Succeeded,0,3600,10
p2,8000,16384,2,1000,,BE,Succeeded,100,7300,100
p3,2000,4096,0,0,,Burstable,Succeeded,200,900,200
p4,4000,8192,1,250,T4,LS,Succeeded,300,4000,300
p5,16000,32768,4,1000,,Guaranteed,Succeeded,400,10000,400
"""
SHORT_NODES = """sn,cpu_milli,memory_mib,gpu,model
n1,32000,131072,4,V100M32
n2,32000,131072,4,T4
n3,16000,65536,0,
"""


def test_pack_failures_are_averaged_over_the_seeds_the_allocation_is(tmp_path, capsys):
    """The allocation at 100 % left the short seeds out, the failures did not: one counted seed with 1 failed
    pod read 'failed 0' (0.3 in the JSON, the mean over three seeds) beside that seed's allocation."""
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(SHORT_PODS)
    nodes.write_text(SHORT_NODES)
    out = tmp_path / "r.json"
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "first-fit", "--seed", "42",
                 "--seeds", "3", "--json", str(out), "--no-plots"]) == 0
    d = json.loads(out.read_text())["policies"]["first-fit"]
    assert d["seeds_short_of_demand"] == [42, 44]
    counted = [s for s in d["per_seed"] if s["alloc_ratio"] is not None]
    assert [s["seed"] for s in counted] == [43]
    assert d["alloc_ratio"] == counted[0]["alloc_ratio"]
    assert d["failed_pods"] == counted[0]["failed_pods"] == 1
    # a small cluster's GPUs are shown to a tenth: 7.0 allocated, 1.0 idle
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "first-fit" in ln and "│" in ln)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[3:6] == ["7.0", "1.0", "1"], cells


def test_pack_with_no_seed_reaching_100_percent_says_so_instead_of_nan(tmp_path, capsys):
    """Every seed short of 100 %: the table read 'nan' in every column, under a note per policy that only
    said those seeds were 'left out of the mean'. Each policy given twice in another case ran twice."""
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(SHORT_PODS.replace("p2,8000,16384,2,1000", "p2,8000,16384,16,1000"))
    nodes.write_text(SHORT_NODES)
    out = tmp_path / "r.json"
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "fgd,FGD", "--seeds", "2",
                 "--json", str(out), "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "nan" not in text
    assert "with seed(s) 42, 43, all of them, so there is no figure at 100 %" in " ".join(text.split())
    rows = [ln for ln in text.splitlines() if "│" in ln and "fgd" in ln.lower()]
    assert len(rows) == 1 and "–" in rows[0]
    d = json.loads(out.read_text())
    assert list(d["policies"]) == ["fgd"]
    assert d["policies"]["fgd"]["alloc_ratio"] is None and d["policies"]["fgd"]["failed_pods"] is None


def test_ctrl_c_during_the_runs_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    """Ctrl-C ended qosflow pack with exit status 130 and not a word."""
    import qosflow.packing.experiment as experiment

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "run_experiment", interrupt)
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text(NODES)
    out = tmp_path / "res" / "pack.json"
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--seeds", "1", "--json", str(out)]) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert f"interrupted before the runs had finished: nothing was written to {out} or {out.parent}" in err
    assert not out.parent.exists()


def test_a_gpu_model_spelt_in_another_case_is_the_same_model(tmp_path, capsys):
    """A pod list asking for 't4' on nodes of model 'T4': simulate placed those pods (it compares models
    without regard to case), pack said they fit no node. A model no node has names the nodes' models."""
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS.replace(",T4,LS", ",t4,LS"))
    nodes.write_text(NODES)
    out = tmp_path / "r.json"
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "fgd", "--seeds", "1",
                 "--json", str(out), "--no-plots"]) == 0
    assert json.loads(out.read_text())["config"]["never_fit_pods"] == []
    pods.write_text(PODS.replace(",T4,LS", ",A100,LS"))
    assert main(["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "fgd", "--seeds", "1",
                 "--json", str(out), "--no-plots"]) == 0
    assert json.loads(out.read_text())["config"]["never_fit_pods"] == [
        {"pod": "p5", "reason": "no node has GPU model A100 (the nodes have T4, V100M16)"}]


def test_pack_help_says_what_lists_of_ones_own_need():
    """pack --help named no column of a pod or node list: a user with lists of their own had to read the code."""
    from typer.testing import CliRunner

    from qosflow.cli.main import app

    r = CliRunner().invoke(app, ["pack", "--help"], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert "name, cpu_milli, memory_mib, num_gpu, gpu_milli" in text and "sn, cpu_milli, memory_mib, gpu, model" in text


def test_a_second_json_in_the_same_directory_says_the_curve_is_now_its(tmp_path, capsys):
    """--json out/a.json then --json out/b.json: b's pack_curve.csv/.png replaced a's without a word."""
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text(NODES)
    out = tmp_path / "out"
    base = ["pack", "--pods", str(pods), "--nodes", str(nodes), "--policies", "fgd", "--seeds", "1", "--no-plots"]
    assert main(base + ["--json", str(out / "a.json")]) == 0
    assert "another run" not in capsys.readouterr().out
    assert main(base + ["--seed", "7", "--json", str(out / "b.json")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"{out} also holds a.json, the results of another run" in text and f"--out {out / 'b'}" in text

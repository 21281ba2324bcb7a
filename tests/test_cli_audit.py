"""A user's bad input, found in a fresh-eyes audit of the CLI and the stage API: each is a one-line
error (exit 2, no traceback) before any work is done."""

from __future__ import annotations

import json

import pytest

from qosflow.cli.main import main
from tiny_inputs import MURI_ONE_JOB, PODS_ONE


@pytest.mark.parametrize(
    "argv, says",
    [
        # numpy's SeedSequence and scikit-learn's random_state take 0 .. 2**32-1: a negative seed was a
        # "ValueError: expected non-negative integer" traceback (after the trace had loaded)
        (["simulate", "--jobs", "10", "--no-plots", "--policies", "fifo", "--seed", "-1"], "Invalid value for '--seed'"),
        (["pack", "--seeds", "1", "--seed", "-1"], "Invalid value for '--seed'"),
        (["predict", "eval", "--throughputs", "t.json", "--seed", "-1"], "Invalid value for '--seed'"),
        (["predict", "eval", "--throughputs", "t.json", "--seed", str(2**32)], "Invalid value for '--seed'"),
    ],
)
def test_a_seed_out_of_range_is_a_usage_error(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_demo_port_out_of_range_or_in_use_is_an_error_before_the_server_starts(tmp_path, capsys, monkeypatch):
    """`demo --port 99999` (or -1, or a port another server holds) started the Prefect server, which exited
    at once, and the demo ended in 'RuntimeError: prefect server exited with 1; see .../server.log'."""
    import socket

    import qosflow.prefect.local as local

    def no_server(*a, **k):
        raise AssertionError("the Prefect server was started")

    monkeypatch.setattr(local.LocalServer, "start", no_server)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv, says in (
            (["--port", "99999"], "Invalid value for '--port'"),
            (["--port", "-1"], "Invalid value for '--port'"),
            (["--port", str(port)], f"invalid --port: 127.0.0.1:{port} is already in use"),
        ):
            assert main(["demo", "--no-ui", "--home", str(tmp_path / "home"), *argv]) == 2, argv
            err = capsys.readouterr().err
            assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv, says",
    [
        # against a server these were tracebacks: '405 Method Not Allowed' (an empty name), a pydantic
        # ValidationError (a name its block names POOL-cluster / POOL-policy cannot take: 'GPU', 'my_pool', 'a/b')
        (["init", "--pool", ""], "invalid --pool: give a work pool name, e.g. --pool gpu"),
        (["init", "--pool", "a/b"], "invalid --pool: 'a/b': a work pool name cannot contain /"),
        (["init", "--pool", "GPU"], "Prefect block names take lowercase letters, digits and dashes only; e.g. --pool gpu"),
        (["init", "--pool", "my_pool"], "blocks my_pool-cluster and my_pool-policy, and Prefect block names take lowercase "
                                        "letters, digits and dashes only; e.g. --pool my-pool"),
        (["status", "--pool", " "], "invalid --pool: give a work pool name"),
        (["status", "--pool", "a&b"], "invalid --pool: 'a&b': a work pool name cannot contain &"),
        (["worker", "start", "--pool", ""], "invalid --pool: give a work pool name"),
        (["worker", "start", "--pool", "x>y"], "a work pool name cannot contain >"),
    ],
)
def test_a_pool_name_prefect_refuses_is_an_error_before_the_server(argv, says, capsys, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # no server: the name is checked first
        assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert says in err and "PREFECT_API_URL" not in err and "Traceback" not in err, err


def test_json_file_and_output_directory_at_one_path_is_an_error_before_the_work(tmp_path, capsys, monkeypatch):
    """`--json R --out R` (or --out inside R) passed both checks; simulate and pack then wrote the JSON and
    ended in a FileExistsError traceback on the plots, and the demo ran its pipelines and then could not
    write its JSON over its --home directory."""
    import qosflow.prefect.local as local

    monkeypatch.setattr(local.LocalServer, "start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("server started")))
    r = tmp_path / "r"
    for argv, says in (
        (["simulate", "--jobs", "10", "--policies", "fifo", "--json", str(r), "--out", str(r)],
         f"--json {r} and --out {r}: --json names a file and --out a directory at the same path; give them different "
         f"paths, e.g. --json {r / 'results.json'}"),
        (["simulate", "--jobs", "10", "--policies", "fifo", "--json", str(r), "--out", str(r / "plots")],
         "--out would be a directory inside the file --json names"),
        (["pack", "--seeds", "1", "--json", str(r), "--out", str(r)], "--json names a file and --out a directory at the same path"),
        (["demo", "--no-ui", "--json", str(r), "--home", str(r)], "--json names a file and --home a directory at the same path"),
    ):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert says in err and "Traceback" not in err, err
        assert not r.exists()  # nothing was run or written


def test_worker_estimator_module_attr_is_imported_before_the_worker_starts(tmp_path, capsys, monkeypatch):
    """`worker start --estimator mymod:Est` with a typo started the worker, which then logged 'qosflow worker
    setup failed: No module named ...; retrying every 5 s' for ever (it cannot be fixed without a restart)."""
    import sys

    from prefect.settings import PREFECT_API_URL, temporary_settings

    (tmp_path / "audit_est.py").write_text("from qosflow.core.estimate import OracleEstimator as Mine\nthing = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # no server: the estimator is checked first
        for est, says in (
            ("audit_nomod:Est", "invalid --estimator: 'audit_nomod:Est': no module named 'audit_nomod' on this worker's Python path"),
            ("audit_est:Nope", "invalid --estimator: 'audit_est:Nope': module 'audit_est' has no attribute 'Nope'"),
            ("audit_est:thing", "'audit_est:thing' is of type int, neither an estimator (with a duration method) nor a class"),
            ("audit_est:Mine", "PREFECT_API_URL is not set"),  # a good one gets as far as the server
        ):
            assert main(["worker", "start", "--pool", "gpu", "--estimator", est]) == 2, est
            err = " ".join(capsys.readouterr().err.split())
            assert says in err and "Traceback" not in err, err
    sys.modules.pop("audit_est", None)


def test_json_output_that_is_an_input_file_is_an_error_and_the_input_is_kept(tmp_path, capsys, monkeypatch):
    """`simulate --cluster cl.csv --json cl.csv` ran and wrote its results over the cluster file (likewise the
    trace, pack's pod or node list, predict eval's table, the demo's cluster file): the output check passed,
    since the file is writable. Now it is an error before the work, and the input is left as it was."""
    import qosflow.prefect.local as local

    monkeypatch.setattr(local.LocalServer, "start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("server started")))
    cluster = tmp_path / "cl.csv"
    cluster.write_text("num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,2,4,32,256\n")
    trace = tmp_path / "t.csv"
    trace.write_text(MURI_ONE_JOB)
    pods = tmp_path / "pods.csv"
    pods.write_text(PODS_ONE)
    table = tmp_path / "tp.json"
    table.write_text('{"v100": {}}\n')
    lab = tmp_path / "lab.yaml"
    lab.write_text("token: x\nhosts:\n  - {name: a, agent_url: 'http://127.0.0.1:9'}\n")
    before = {p: p.read_text() for p in (cluster, trace, pods, table, lab)}
    for argv, opt, path in (
        (["simulate", "--jobs", "10", "--policies", "fifo", "--cluster", str(cluster), "--json", str(cluster)], "--cluster", cluster),
        (["simulate", "--trace", str(trace), "--policies", "fifo", "--json", str(tmp_path / "." / "t.csv")], "--trace", trace),
        (["pack", "--seeds", "1", "--pods", str(pods), "--json", str(pods)], "--pods", pods),
        (["predict", "eval", "--throughputs", str(table), "--json", str(table)], "--throughputs", table),
        (["demo", "--no-ui", "--home", str(tmp_path / "home"), "--cluster", str(lab), "--json", str(lab)], "--cluster", lab),
    ):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert f"that is the {opt} file this command uses, and the results would overwrite it; give another file, e.g. " \
               f"--json {path.with_name(path.stem + '-results.json')}" in err, err
    assert {p: p.read_text() for p in before} == before


def test_demo_server_that_cannot_start_says_why_without_a_traceback(tmp_path, capsys):
    """`demo --database-url` naming a PostgreSQL that is not there ended in 'RuntimeError: prefect server
    exited with 3; see .../server.log' (a traceback, the reason only in the log). Now one line: the
    server's own error from its log, where the log is, and what to check. The demo's SIGTERM handler
    (which ends it through its cleanup) is gone again once it returns: it outlived the failed start in
    this process, and a process forked later (a simulation's worker pool) inherited it."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    home = tmp_path / "home"
    rc = main(["demo", "--no-ui", "--home", str(home), "--database-url", "postgresql://u:p@127.0.0.1:9/nodb"])
    err = " ".join(capsys.readouterr().err.split())
    assert signal.getsignal(signal.SIGTERM) is before
    assert rc == 2, err
    assert "the local Prefect server exited at start with code" in err and "Connect call failed ('127.0.0.1', 9)" in err, err
    assert f"(its log: {home / 'prefect' / 'server.log'}); is PostgreSQL running there" in err and "Traceback" not in err, err


def test_json_dash_is_not_a_file_named_dash(tmp_path, capsys, monkeypatch):
    """`--json -` (standard output, in many tools) wrote the results to a file named '-' in the current
    directory, with the table on standard output as usual."""
    monkeypatch.chdir(tmp_path)
    for argv in (["simulate", "--jobs", "10", "--policies", "fifo", "--no-plots", "--json", "-"],
                 ["pack", "--seeds", "1", "--json", "-"], ["status", "--json", "-"]):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert "--json -: the results go to a file, not to standard output (the table goes there); give a file name, " \
               "e.g. --json out.json" in err, err
    assert not (tmp_path / "-").exists()


def test_demo_on_a_cluster_file_whose_hosts_are_all_down_fails_before_the_server(tmp_path, capsys, monkeypatch):
    """`demo --cluster lab.yaml` with no agent running started the Prefect server and the worker, logged
    'host a is down' once, and then waited for ever for stages no host could run."""
    import qosflow.prefect.local as local

    monkeypatch.setattr(local.LocalServer, "start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("server started")))
    lab = tmp_path / "lab.yaml"
    lab.write_text("token: x\nhosts:\n  - {name: a, agent_url: 'http://127.0.0.1:9'}\n  - {name: b, agent_url: 'http://127.0.0.1:19'}\n")
    assert main(["demo", "--no-ui", "--home", str(tmp_path / "home"), "--cluster", str(lab)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--cluster {lab}: no host answers (a (http://127.0.0.1:9): " in err and "; b (http://127.0.0.1:19): " in err, err
    assert f"check them with `qosflow agent status --cluster {lab}`" in err and "Traceback" not in err, err


def test_an_option_the_run_does_not_use_is_named_in_a_warning(tmp_path, capsys):
    """`simulate --error 0.1` without the noisy estimator, and `predict eval --throughputs ... --folds 10`,
    were validated and then dropped without a word."""
    assert main(["simulate", "--jobs", "10", "--policies", "fifo", "--no-plots", "--error", "0.1"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: --error 0.1 is the noisy estimator's error, and --estimator oracle has no noisy: add it, e.g. " \
           "--estimator oracle,noisy" in err, err
    assert main(["simulate", "--jobs", "10", "--policies", "fifo", "--no-plots", "--error", "0.1", "--estimator", "noisy"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["predict", "eval", "--throughputs", str(tmp_path / "missing.json"), "--folds", "10"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: --folds 10 is for --pairs; a throughput table is cross-validated leaving one job type out" in err, err


@pytest.mark.parametrize("cluster,says", [
    ("100000x100000", "100000 GPUs per node; a node is one server, with at most 128"),  # was a 75 GiB numpy MemoryError
    ("36:36:36/4:4:400", "k80: 400 GPUs per server"),
])
def test_a_server_with_more_gpus_than_any_server_holds_is_a_cluster_error(cluster, says, capsys):
    assert main(["simulate", "--trace", "synthetic", "--jobs", "10", "--cluster", cluster]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_running_out_of_memory_is_an_error_that_says_what_to_shrink(capsys, monkeypatch):
    import qosflow.cli.main as cli_main

    def app(**kwargs):
        raise MemoryError("Unable to allocate 74.5 GiB for an array with shape (100000, 100000) and data type int64")

    monkeypatch.setattr(cli_main, "app", app)
    assert cli_main.main(["simulate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory (Unable to allocate 74.5 GiB") and "--cluster" in err, err


def test_json_output_over_a_file_that_is_not_a_result_is_an_error_and_the_file_is_kept(tmp_path, capsys, monkeypatch):
    """`simulate --trace synthetic --json ../shared/data/traces/muri_philly_trace1.csv` wrote its results over
    the shared Muri trace, and its plots beside it: the trace was no input of that run, so the input check
    passed, and the file's read-only mode does not stop root. An existing file that is not a JSON object (a
    trace, a stage's source) is now refused, for every command's --json; an earlier result is replaced."""
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "trace.csv"
    trace.write_text(MURI_ONE_JOB)
    stage = tmp_path / "stage.py"
    stage.write_text("print('hello')\n")
    before = {p: p.read_text() for p in (trace, stage)}
    for argv, path in (
        (["simulate", "--jobs", "10", "--policies", "fifo", "--json", str(trace)], trace),
        (["pack", "--seeds", "1", "--json", str(stage)], stage),
        (["predict", "stages", "--db", f"sqlite:///{tmp_path / 'none.db'}", "--json", str(trace)], trace),
        (["status", "--json", str(stage)], stage),
    ):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert f"--json {path}: the file exists and is not a JSON result (it begins " in err, err
        assert f"the results would overwrite it. Give another file, e.g. --json {path.with_name(path.stem + '-results.json')}" \
               in err and "Traceback" not in err, err
    assert {p: p.read_text() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage.py", "trace.csv"]  # no plots beside them
    earlier = tmp_path / "r.json"
    earlier.write_text('{"policies": {}}\n')
    assert main(["simulate", "--jobs", "10", "--policies", "fifo", "--no-plots", "--json", str(earlier)]) == 0
    assert "fifo" in json.loads(earlier.read_text())["policies"]


def test_output_into_the_shared_data_is_an_error_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    """The shared public data is read in place and never written: --json (an existing JSON file there, such
    as Gavel's throughput table, or a new one) and --out inside it are refused before the run."""
    shared = tmp_path / "shared" / "data"
    (shared / "throughputs").mkdir(parents=True)
    table = shared / "throughputs" / "table.json"
    table.write_text('{"v100": {}}\n')
    monkeypatch.setenv("QOSFLOW_SHARED_DATA", str(shared))
    run = ["simulate", "--jobs", "10", "--policies", "fifo"]
    for argv, opt, path in (
        (run + ["--json", str(table)], "--json", table),
        (run + ["--json", str(shared / "traces" / "new.json")], "--json", shared / "traces" / "new.json"),
        (run + ["--out", str(shared / "plots")], "--out", shared / "plots"),
        (["pack", "--seeds", "1", "--json", str(shared / "pack.json")], "--json", shared / "pack.json"),
    ):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert f"{opt} {path}: that is in the shared public data ({shared}), which is read in place and never written; " \
               f"give a place of your own, e.g. {opt} " in err and "Traceback" not in err, err
    assert table.read_text() == '{"v100": {}}\n'
    assert sorted(str(p.relative_to(shared)) for p in shared.rglob("*")) == ["throughputs", "throughputs/table.json"]


@pytest.mark.parametrize("command", ["init", "demo"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_cores_per_host_that_is_not_a_finite_number_is_an_error_before_the_server(command, value, tmp_path, capsys, monkeypatch):
    """`init --cores-per-host nan` passed the option's min=1 and ended in pydantic's ValidationError traceback
    from the cluster block (inf was saved as is); the demo's started its server first."""
    import qosflow.prefect.local as local

    monkeypatch.setattr(local.LocalServer, "start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("server started")))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # no server there: the check comes first
    argv = [command, "--cores-per-host", value] + (["--no-ui", "--home", str(tmp_path / "home")] if command == "demo" else [])
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"invalid --cores-per-host: must be a finite number of CPU cores >= 1 (e.g. 16), got {value}" in err, err
    assert "Traceback" not in err and "cannot reach the Prefect server" not in err, err

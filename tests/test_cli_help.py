"""CLI help texts reflow to the terminal's width: prose paragraphs are not hard-wrapped."""

from qosflow.cli.main import _reflow, app


def test_reflow_joins_prose_and_keeps_examples_and_lists():
    text = """First line
    goes on.

    A paragraph wrapped
    at 60 columns.
    - an item
    - another

    Examples:

      qosflow pack --seeds 1 \\
          --json out.json
    """
    assert _reflow(text) == (
        "First line goes on.\n\nA paragraph wrapped at 60 columns.\n- an item\n- another\n\n"
        "Examples:\n\n  qosflow pack --seeds 1 \\\n      --json out.json"
    )
    assert _reflow(None) is None


def test_every_command_help_is_reflowed():
    import inspect

    def helps(typer_app):
        yield typer_app.info.help
        for cmd in typer_app.registered_commands:
            # a docstring is the help of a command without help= (agent start/status were not reflowed)
            yield cmd.help if cmd.help is not None else inspect.getdoc(cmd.callback)
        for group in typer_app.registered_groups:
            yield from helps(group.typer_instance)

    texts = [h for h in helps(app) if isinstance(h, str)]
    assert len(texts) >= 8
    for h in texts:
        for para in h.split("\n\n"):
            lines = para.split("\n")
            # a prose line is never followed by another prose line: they were joined
            for a, b in zip(lines, lines[1:]):
                assert a[:1].isspace() or b[:1].isspace() or b.lstrip().startswith(("- ", "* ")), (a, b)


def test_usage_errors_are_messages_not_tracebacks(capsys):
    """typer >= 0.24 raises its own copy of click's exceptions (typer._click): an unknown option, a
    non-number or a value out of range printed a Python traceback instead of the usage message."""
    from qosflow.cli.main import main

    for argv, says in (
        (["agent", "start", "--bogus"], "No such option: --bogus"),
        (["agent", "start", "--port", "abc"], "Invalid value for '--port'"),
        (["init", "--hosts", "0"], "Invalid value for '--hosts'"),
        (["worker", "start", "--pool", "gpu", "--limit", "0"], "Invalid value for '--limit'"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and "--help' for help" in err, err


def test_bad_option_values_are_errors_before_any_server_or_port(capsys, monkeypatch):
    """`init --deadline -5` printed a pydantic traceback (after asking for a Prefect server first), and
    `agent start --log-level loud` a KeyError traceback from uvicorn once the port was bound."""
    from qosflow.cli.main import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    for argv, says in (
        (["init", "--deadline", "-5"], "invalid --deadline: must be a positive duration, got '-5'"),
        (["init", "--deadline", "tomorrow"], "invalid --deadline: expected seconds or a duration such as 90s, 15min, 2h"),
        (["init", "--policy", "nope"], "unknown policy 'nope'"),  # not "PREFECT_API_URL is not set"
        (["worker", "start", "--pool", "gpu", "--policy", "nope"], "unknown policy 'nope'"),
        (["agent", "start", "--token", "t", "--log-level", "loud"], "invalid --log-level: 'loud' is not one of critical | error"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err


def test_init_deadline_takes_a_duration_as_qos_flow_does():
    """`qosflow init --deadline 1h` was rejected: the option took seconds only."""
    from qosflow.cli.init import deadline_seconds

    assert deadline_seconds("1h30m") == 5400.0 and deadline_seconds("90") == 90.0 and deadline_seconds("15 min") == 900.0


def test_every_option_says_what_it_does():
    """`--help` showed options with no text at all (predict eval --seed, agent start --log-level)."""
    import typer.main

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                yield from walk(sub, f"{path} {name}")
        else:
            yield path, cmd

    missing = [
        f"{path} {p.opts[0]}"
        for path, cmd in walk(typer.main.get_command(app), "qosflow")
        for p in cmd.params
        if getattr(p, "param_type_name", "") == "option" and p.opts[0] != "--help" and not (p.help or "").strip()
    ]
    assert not missing, missing


def test_init_real_gpus_warns_when_this_machine_has_none(capsys, monkeypatch):
    """`init --real-gpus` on a machine without NVML said "1 x 4 GPUs" and created a pool whose worker
    there then refused every run ("the local backend has no real GPUs here")."""
    import qosflow.backends.local as local
    from qosflow.cli.main import main

    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(local, "nvml_gpus", lambda: (None, "no GPU: NVML unavailable (Library Not Found); using virtual GPUs"))
    # (no server, also when the session's test server is up: its harness sets the URL in Prefect's settings)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["init", "--real-gpus"]) == 2  # no server here: the warning comes first
    err = capsys.readouterr().err
    assert "warning: --real-gpus, but this machine has no GPU (NVML unavailable (Library Not Found))" in err, err
    assert "leave --real-gpus out" in err and "PREFECT_API_URL is not set" in err, err
    # the cluster-size options it does not use are named (they were dropped without a word)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["init", "--real-gpus", "--hosts", "3", "--cores-per-host", "8"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: --hosts 3, --cores-per-host 8 not used with --real-gpus: the worker's own host is the one host" in err, err


def test_demo_home_that_is_a_file_is_an_error_before_anything_starts(tmp_path, capsys):
    """`demo --home FILE` ended in a FileExistsError traceback."""
    from qosflow.cli.main import main

    home = tmp_path / "home"
    home.write_text("not a directory")
    assert main(["demo", "--no-ui", "--home", str(home)]) == 2
    err = capsys.readouterr().err
    assert f"--home {home}: is a file, not a directory" in err and "Traceback" not in err, err


def test_agent_workdir_that_is_a_file_is_an_error_before_the_port_is_bound(tmp_path, capsys, monkeypatch):
    """`agent start --workdir FILE` bound the port, then ended in a FileExistsError traceback."""
    import qosflow.agent.server as server
    from qosflow.cli.main import main

    def no_bind(*_a, **_k):
        raise AssertionError("the port was bound before --workdir was checked")

    monkeypatch.setattr(server, "bind", no_bind)
    workdir = tmp_path / "logs"
    workdir.write_text("not a directory")
    assert main(["agent", "start", "--token", "t", "--virtual-gpus", "1", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert f"--workdir {workdir}: is a file, not a directory" in err and "Traceback" not in err, err


def test_version_option_prints_the_package_version(capsys):
    """There was no `qosflow --version` ("No such option"), the first thing a bug report asks for."""
    import qosflow
    from qosflow.cli.main import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"qosflow {qosflow.__version__}"
    assert main([]) == 2  # no arguments still shows the help, as before (no_args_is_help: click's usage code)
    assert "simulate" in " ".join(capsys.readouterr().out.split())


def test_optional_values_say_what_leaving_them_out_means():
    """`worker start --limit` and `agent start --virtual-gpus` had no default in --help (no value shown, no
    words): what does leaving them out do?"""
    import typer.main

    from qosflow.cli.main import app

    root = typer.main.get_command(app)
    helps = {(cmd, p.opts[0]): p.help for cmd in ("worker", "agent") for p in root.commands[cmd].commands["start"].params}
    assert "(default: no limit)" in helps[("worker", "--limit")]
    assert "(default: none; without NVML the host is then CPU-only)" in helps[("agent", "--virtual-gpus")]


def test_flags_show_no_value_in_help():
    """A flag (--no-plots) takes no value, and --help must not print one after it: typer 0.29 prints
    '<bool>' there, which is why pyproject pins typer below 0.29."""
    from typer.testing import CliRunner

    runner = CliRunner()
    for args in (["simulate", "--help"], ["demo", "--help"], ["pack", "--help"]):
        r = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert "--no-plots" in r.output or "--no-ui" in r.output
        assert "<bool>" not in r.output, args


def test_research_commands_help_is_not_cut_at_80_columns():
    """In an 80-column terminal rich cuts a word longer than the help column with '…': simulate's default
    policies read 'fifo,sjf,srtf,tiresias,sjf-ffs,…', --throughputs '(gavel_simulation_throughputs.j…' and
    predict eval's --pairs '(model1,batchsize1,gpu_num…', the columns a pair table needs."""
    from typer.testing import CliRunner

    runner = CliRunner()
    for args in (["simulate", "--help"], ["pack", "--help"], ["predict", "eval", "--help"]):
        r = runner.invoke(app, args, env={"COLUMNS": "80"})
        assert r.exit_code == 0, r.output
        assert "…" not in r.output, (args, [ln for ln in r.output.splitlines() if "…" in ln])
    r = runner.invoke(app, ["predict", "eval", "--help"], env={"COLUMNS": "80"})
    assert "gpu_num2, speed2" in " ".join(r.output.replace("│", " ").split())


def test_the_command_list_gives_each_command_a_line_or_two(monkeypatch):
    """`qosflow --help` lists the commands by their short help (click cuts the help at its first sentence only
    when no short_help is given): `status` took eight lines of the list with its whole first paragraph."""
    from typer.testing import CliRunner

    monkeypatch.setenv("COLUMNS", "100")
    out = CliRunner().invoke(app, ["--help"]).output
    listing = out.split("Commands")[1]
    rows = [ln for ln in listing.splitlines() if ln.startswith("│")]
    starts = [i for i, ln in enumerate(rows) if ln[2:3].strip()]  # a command's name begins its first line
    assert len(starts) >= 8
    for i, nxt in zip(starts, starts[1:] + [len(rows)]):
        assert nxt - i <= 2, rows[i:nxt]

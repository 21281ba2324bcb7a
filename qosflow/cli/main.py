"""The `qosflow` command line.

Each command group lives in its own module under `qosflow.cli` with a `register(app)` function,
so that `qosflow --help` stays fast: heavy libraries are imported inside the commands.
"""

from __future__ import annotations

import importlib
import inspect
import sys

import typer

from qosflow.errors import QosflowError

COMMAND_MODULES = [
    "simulate",  # qosflow simulate
    "pack",  # qosflow pack
    "demo",  # qosflow demo
    "init",  # qosflow init
    "worker",  # qosflow worker ...
    "predict",  # qosflow predict eval, qosflow profile
    "agent",  # qosflow agent start
    "status",  # qosflow status
]

app = typer.Typer(
    name="qosflow",
    help=(
        "QoS-aware scheduling of deep-learning pipelines on shared GPU clusters, inside Prefect 3.\n\n"
        "Start with `qosflow demo` (a local Prefect server, a virtual 2-host x 4-GPU cluster, three pipelines),\n"
        "or compare scheduling policies on public traces with `qosflow simulate` and `qosflow pack`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from qosflow import __version__

        typer.echo(f"qosflow {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print qosflow's version and exit (for bug reports)"),
) -> None:
    # the app's own options; its help is the Typer's (no docstring here on purpose)
    pass


def _load_commands() -> None:
    for name in COMMAND_MODULES:
        modname = f"qosflow.cli.{name}"
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:  # a command group not written yet
            if exc.name == modname:
                continue
            raise
        mod.register(app)


def _reflow(text: str | None) -> str | None:
    """Join the hard-wrapped lines of each help paragraph, so the terminal wraps them at its own
    width (rich keeps single line breaks: at 80 columns a 100-column source line became one long
    and one short line). Indented lines (examples) and list items stay on their own line."""
    if not text:
        return text
    paragraphs = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines: list[str] = []
        for line in para.split("\n"):
            starts_own = not lines or line[:1].isspace() or line.lstrip().startswith(("- ", "* ")) or lines[-1][:1].isspace()
            if starts_own:
                lines.append(line)
            else:
                lines[-1] = f"{lines[-1].rstrip()} {line.strip()}"
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def _reflow_help(typer_app: typer.Typer) -> None:
    if isinstance(typer_app.info.help, str):
        typer_app.info.help = _reflow(typer_app.info.help)
    for cmd in typer_app.registered_commands:
        # a command without help= shows its function's docstring (as typer would): reflow that too
        cmd.help = _reflow(cmd.help if cmd.help is not None else inspect.getdoc(cmd.callback))
    for group in typer_app.registered_groups:
        if group.help:
            group.help = _reflow(group.help)
        if group.typer_instance is not None:
            _reflow_help(group.typer_instance)


def _fold_long_words_in_option_help() -> None:
    """Let an option's help break a word too long for its column (a URL such as
    postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB) onto the next line: at 80 columns rich cut it with an ellipsis
    ('postgresql+psycopg://USER:PASSWORD@H…', '$QOSFLOW_WORKER_METRIC…'), and what it was could not be read. Typer's
    option rows are `Columns` of `Text`s (typer.rich_utils._get_parameter_help, typer < 0.29); any other shape is
    left as it is."""
    try:
        from rich.text import Text
        from typer import rich_utils
    except ImportError:
        return
    original = getattr(rich_utils, "_get_parameter_help", None)
    if original is None or getattr(original, "_qosflow_folds", False):
        return

    def folding(*args, **kwargs):
        help_ = original(*args, **kwargs)
        for item in getattr(help_, "renderables", ()):
            if isinstance(item, Text) and item.overflow is None:
                item.overflow = "fold"
        return help_

    folding._qosflow_folds = True
    rich_utils._get_parameter_help = folding


_load_commands()
_reflow_help(app)
_fold_long_words_in_option_help()


def main(argv: list[str] | None = None) -> int:
    try:
        # without standalone mode click *returns* the code of a `typer.Exit(n)` instead of exiting
        rc = app(args=argv, standalone_mode=False)
    except QosflowError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        return getattr(exc, "exit_code", 2)
    except SystemExit as exc:  # typer/click exits
        return int(exc.code or 0)
    except MemoryError as exc:  # (was numpy's traceback, e.g. "Unable to allocate 74.5 GiB for an array ...")
        why = f" ({exc})" if str(exc) else ""
        typer.secho(f"error: out of memory{why}: the cluster, trace or run asked for more memory than this machine has; "
                    "try a smaller --cluster or trace (--jobs), or fewer parallel runs (--parallel 1)", err=True, fg="red")
        return 2
    except Exception as exc:  # click usage errors and friends
        usage, abort = _click_exceptions()
        if isinstance(exc, usage):
            exc.show()
            return exc.exit_code
        if isinstance(exc, abort):
            typer.secho("aborted", err=True)
            return 130
        raise
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


def _click_exceptions() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Usage errors and aborts of click and of the click copy that typer >= 0.24 carries
    (`typer._click`, whose exceptions are not click's: without it `--port abc`, an unknown option
    or a value out of its range printed a traceback instead of the usage message)."""
    import click

    usage: list[type] = [click.exceptions.ClickException]
    abort: list[type] = [click.exceptions.Abort]
    try:
        from typer._click.exceptions import ClickException
    except ImportError:  # older typer uses click itself
        pass
    else:
        usage.append(ClickException)
    abort.append(getattr(typer, "Abort", click.exceptions.Abort))
    return tuple(usage), tuple(abort)


if __name__ == "__main__":
    sys.exit(main())

"""The `qosflow` command line.

Each command group lives in its own module under `qosflow.cli` with a `register(app)` function,
so that `qosflow --help` stays fast: heavy libraries are imported inside the commands.
"""

from __future__ import annotations

import importlib
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


_load_commands()


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=False)
    except QosflowError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        return 2
    except SystemExit as exc:  # typer/click exits
        return int(exc.code or 0)
    except Exception as exc:  # click usage errors and friends
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return exc.exit_code
        if isinstance(exc, click.exceptions.Abort):
            typer.secho("aborted", err=True)
            return 130
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``grpo-cli`` command line: typer only. Each command parses its options into a config, calls the command in
:mod:`grpo_cli.commands` and hands the result to :mod:`grpo_cli.render`; every failure becomes one line on stderr
and an exit code (0 ok, 1 a check failed, 2 usage, input or internal error). Results go to stdout (or
``--output``); progress, warnings and errors go to stderr.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator

import typer

from grpo_cli._launch import is_secondary_rank
from grpo_cli.cli._app import STATE, app
from grpo_cli.errors import EXIT_ERROR, GrpoCliError

# isort: off
from grpo_cli.cli import _analyze, _diff, _check_report, _dump_tools, _explain  # noqa: F401  # register the commands, in the order --help lists
# isort: on

__all__ = ["app", "main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and map every failure to one line on stderr and an exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if is_secondary_rank() and "--debug" not in args:
        import os

        # torchrun: rank 0 writes the report and every message (errors are agreed across ranks first).
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            return _main(args)
    return _main(args)


def _main(args: list[str]) -> int:
    # --debug is honoured anywhere on the line (also after the command), so it is taken out before parsing.
    STATE["debug"] = "--debug" in args
    if STATE["debug"]:
        args = [arg for arg in args if arg != "--debug"]
    command = typer.main.get_command(app)
    try:
        # Standalone mode: the parser reports usage errors itself (exit 2) and exits through SystemExit.
        with _plain_choice_errors():
            command.main(args=args, prog_name="grpo-cli", standalone_mode=True)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except GrpoCliError as exc:
        if STATE["debug"]:
            traceback.print_exc()
        if str(exc):  # an empty message: the verdict was already shown (check's table on this terminal)
            typer.echo(f"grpo-cli: error: {exc}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        typer.echo("grpo-cli: interrupted", err=True)
        return 130
    except Exception as exc:  # an internal error: one line, the traceback only on request
        if STATE["debug"]:
            traceback.print_exc()
            return EXIT_ERROR
        typer.echo(
            f"grpo-cli: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True
        )
        return EXIT_ERROR
    return 0


@contextlib.contextmanager
def _plain_choice_errors() -> Iterator[None]:
    """Typer validates choices through pydantic, whose message starts with "Value error, "; the user sees
    "Invalid value for '--on-invalid': 'ignore' is not one of 'error', 'skip'." without it."""
    original = typer.BadParameter.format_message

    def format_message(self: typer.BadParameter) -> str:
        return original(self).replace(": Value error, ", ": ")

    typer.BadParameter.format_message = format_message  # type: ignore[method-assign]  # for this call only
    try:
        yield
    finally:
        typer.BadParameter.format_message = original  # type: ignore[method-assign]  # restored


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    typer.echo(str(code), err=True)
    return EXIT_ERROR


def run() -> None:
    sys.exit(main())

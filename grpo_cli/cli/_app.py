"""The typer application every command registers on, and the options that come before the command."""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

import typer

from grpo_cli import __version__

__all__ = ["STATE", "app"]

app = typer.Typer(
    name="grpo-cli",
    help="Offline diagnostics for GRPO/PPO rollout dumps: off-policy-ness, train/inference mismatch, clipping, "
    "proximal approximation and regression gates.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

STATE = {"debug": False}
"""``--debug`` (tracebacks of internal errors), honoured anywhere on the line."""


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _version_callback(value: bool) -> None:
    # Read from the installed packages' metadata: importing torch to ask its version costs a second.
    if value:
        typer.echo(f"grpo-cli {__version__} (torch {_installed('torch')}, pyarrow {_installed('pyarrow')})")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print versions and exit."),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors.")] = False,
) -> None:
    STATE["debug"] = STATE["debug"] or debug

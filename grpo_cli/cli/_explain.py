"""``explain CODE``: a finding's page (docs/findings.md) on the terminal."""

from __future__ import annotations

from typing import Annotated

import typer

from grpo_cli.cli._app import app
from grpo_cli.cli._options import emit

__all__ = ["explain"]


@app.command()
def explain(
    code: Annotated[str, typer.Argument(metavar="CODE", help="A finding's code, e.g. GRP101.")],
) -> None:
    """What a finding means, why it matters, how it is detected and how to fix it (docs/findings.md)."""
    from grpo_cli.findings import explain as explanation

    emit(explanation(code), None)

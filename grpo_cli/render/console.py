"""The one place that handles the terminal: ``NO_COLOR``, whether output is a TTY, and the width."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from rich.console import Console

__all__ = ["make_console"]


def make_console(*, stderr: bool = False, file: TextIO | None = None, record: bool = False) -> Console:
    """A console that honours ``NO_COLOR`` and writes plain text when not attached to a terminal."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    no_color = bool(os.environ.get("NO_COLOR"))
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(
        file=stream,
        no_color=no_color or not is_tty,
        highlight=False,
        soft_wrap=False,
        record=record,
        width=None if is_tty else 120,
        color_system="auto" if is_tty and not no_color else None,
    )

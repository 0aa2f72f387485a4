"""Exceptions the CLI turns into one line on stderr and an exit code.

Library code raises ``ValueError``/``TypeError`` for bad arguments (as the AReaL/torch peers do);
I/O and validation raise :class:`InputError`, which names the file, column and row.
"""

from __future__ import annotations

__all__ = ["CheckFailed", "GrpoCliError", "InputError", "UsageError"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_ERROR = 2


class GrpoCliError(Exception):
    """Base class for errors reported to the user in one line (exit code 2)."""

    exit_code: int = EXIT_ERROR


class UsageError(GrpoCliError):
    """A bad option value or combination of options."""


class InputError(GrpoCliError):
    """Unreadable or invalid input data; the message names the file, column and row where known."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        column: str | None = None,
        row: int | None = None,
        token: int | None = None,
    ) -> None:
        self.file, self.column, self.row, self.token = file, column, row, token
        where = []
        if file is not None:
            where.append(str(file))
        if column is not None:
            where.append(f"column '{column}'")
        if row is not None:
            where.append(f"row {row}")
        if token is not None:
            where.append(f"token {token}")
        self.reason = message
        super().__init__(f"{': '.join([', '.join(where)] if where else [])}{': ' if where else ''}{message}")

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps file/column/row when the error crosses a process boundary (--workers, torchrun ranks).
        location = {"file": self.file, "column": self.column, "row": self.row, "token": self.token}
        return (_rebuild, (type(self), self.reason, location))


def _rebuild(cls: type[InputError], message: str, location: dict[str, object]) -> InputError:
    return cls(message, **location)  # type: ignore[arg-type]  # the values __reduce__ took from the error


class CheckFailed(GrpoCliError):
    """A regression check failed (exit code 1)."""

    exit_code = EXIT_CHECK_FAILED

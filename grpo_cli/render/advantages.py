"""The table of ``grpo-cli advantages``: the ``adv_check/*`` figures, then the worst sequences."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from grpo_cli._format import format_value
from grpo_cli.render.tables import render_table

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.commands.advantages import AdvantageCheckResult

__all__ = ["render_advantages_table"]


def render_advantages_table(console: Console, result: AdvantageCheckResult) -> None:
    """Figures (as ``analyze`` renders them), the verdict, and the sequences that disagree most."""
    render_table(console, title="grpo-cli advantages", metrics=result.metrics, omitted=result.omitted,
                 inputs=result.inputs, config=result.config)
    worst = result.metrics.get("adv_check/worst") or []
    if worst:
        table = Table(title="Sequences that disagree most (|recomputed − dumped|)", title_justify="left")
        for column in ("file", "row", "position", "max_abs_diff", "expected", "dumped", "group_id", "step"):
            table.add_column(column, justify="right")
        for record in worst:
            index = record["file"]
            name = os.path.basename(result.inputs[index]) if 0 <= index < len(result.inputs) else str(index)
            table.add_row(
                name,
                str(record["row"]),
                str(record["position"]),
                *(format_value(record[c]) for c in ("max_abs_diff", "expected", "dumped")),
                *("–" if record[c] is None else str(record[c]) for c in ("group_id", "step")),
            )
        console.print(table)
    if "adv_check/n_sequences_mismatch" in result.metrics:
        bad = result.metrics["adv_check/n_sequences_mismatch"]
        total = result.metrics["adv_check/n_sequences_compared"]
        verdict = (
            Text(f"MISMATCH: {bad:,} of {total:,} sequences differ beyond the tolerance", style="bold red")
            if bad
            else Text(f"OK: all {total:,} compared sequences agree", style="bold green")
        )
        console.print(verdict)
    if result.written is not None:
        console.print(Text(f"wrote {result.written}", style="dim"))

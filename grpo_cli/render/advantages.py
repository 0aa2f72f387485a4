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

__all__ = ["mismatch_line", "render_advantages_table"]


def mismatch_line(result: AdvantageCheckResult) -> str:
    """The verdict of a mismatching check in one line, with the variant that matches when one does."""
    bad = result.metrics["adv_check/n_sequences_mismatch"]
    total = result.metrics["adv_check/n_sequences_compared"]
    config = result.config
    line = (f"{bad:,} of {total:,} sequences differ from the recomputed {config['estimator']} advantages beyond "
            f"atol={config['atol']}, rtol={config['rtol']}")
    if result.matching_variant is not None:
        return f"{line}; they match {_variant_words(result.matching_variant['options'])}"
    if result.variants:
        return f"{line}; no common variant matches either"
    return line


def _variant_words(options: str) -> str:
    """``--estimator grpo --std-eps 1e-4`` → ``grpo with --std-eps 1e-4``."""
    words = options.split()
    estimator, rest = words[1], " ".join(words[2:])
    return f"{estimator} with {rest}" if rest else estimator


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
    if result.variants:
        table = Table(title="Common variants of the estimator (same rewards and tolerance)", title_justify="left")
        for column in ("options", "sequences mismatched", "tokens mismatched", "max_abs_diff"):
            table.add_column(column, justify="left" if column == "options" else "right")
        for variant in result.variants:
            table.add_row(variant["options"], f"{variant['n_sequences_mismatch']:,}",
                          f"{variant['n_tokens_mismatch']:,}", format_value(variant["max_abs_diff"]))
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
        if result.matching_variant is not None:
            options = result.matching_variant["options"]
            console.print(Text(f"matches {_variant_words(options)} (rerun with {options})", style="bold"))
        elif result.variants:
            console.print(Text("no common variant of the estimator matches either", style="bold"))
    if result.written is not None:
        console.print(Text(f"wrote {result.written}", style="dim"))

"""The figures of ``grpo-cli advantages``: the dump's advantages against the recomputed ones."""

from __future__ import annotations

from grpo_cli.engine.figures import Figure

__all__ = ["ADV_CHECK_FIGURES"]

ADV_CHECK_FIGURES: tuple[Figure, ...] = (
    Figure("adv_check/max_abs_diff", "largest |recomputed − dumped| over compared tokens"),
    Figure("adv_check/mean_abs_diff", "mean |recomputed − dumped| over compared tokens"),
    Figure("adv_check/n_sequences", "sequences read"),
    Figure("adv_check/n_sequences_compared", "sequences with at least one compared token"),
    Figure("adv_check/n_sequences_mismatch", "sequences with a token beyond the tolerance"),
    Figure("adv_check/n_tokens_compared", "tokens compared (valid, or all per-token)"),
    Figure("adv_check/n_tokens_mismatch", "compared tokens beyond the tolerance"),
    Figure("adv_check/n_masked_tokens_compared", "compared tokens with loss_mask = 0"),
    Figure("adv_check/n_masked_tokens_mismatch", "mismatches at loss_mask = 0 (prompt tokens)"),
    Figure("adv_check/n_nonfinite", "compared tokens where either value is NaN/±inf"),
    Figure("adv_check/worst", "the sequences that disagree most (file, row, position, values)", reduce="table"),
)

"""The **zeros** family: exact-zero log-probs, trailing zero runs (padding) and loss-mask coverage
(prompt tokens in the loss, generated tokens out of it, holes)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from grpo_cli.core.diagnosis._common import (
    LOGP_COLUMNS,
    TOP_FIELDS,
    as_float,
    table_rows,
    update_top,
)
from grpo_cli.core.packing import segment_count, segment_ids, segment_span
from grpo_cli.core.state import MetricState, count, top_rows

__all__ = ["ZERO_GAP", "zeros_compute", "zeros_state", "zeros_update"]

ZERO_GAP = 1.0
"""``old_logp`` = 0 counts as "no log-prob returned" where ``new_logp`` < −ZERO_GAP (trainer probability < e⁻¹).
An engine that renormalises over a top-p/top-k set legitimately reports 0 when the set holds one token, whose
probability is then at least top_p; the gap keeps those tokens (top_p ≥ 0.37) out of the count."""


def zeros_state(device: torch.device | str | None = None, top_k: int = 8) -> MetricState:
    """An empty state for :func:`zeros_update`."""
    specs = {f"n_zero_{c}": count() for c in LOGP_COLUMNS}
    specs.update({f"n_{c}": count() for c in LOGP_COLUMNS})
    for name in (
        "n_valid", "n_old_zero_new_not", "n_seq", "n_seq_trailing", "n_tok_trailing", "n_versions_valid",
        "n_prompt_in_loss", "n_generated", "n_generated_masked", "n_holes", "n_holes_generated", "n_seq_suspect",
    ):
        specs[name] = count()
    specs["top"] = top_rows(top_k, len(TOP_FIELDS))
    return MetricState(specs, device)


def zeros_update(
    state: MetricState,
    *,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    columns: dict[str, Tensor | None],
    versions: Tensor | None = None,
    file_index: int = 0,
    rows: Tensor | None = None,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of whole sequences (all tokens) into ``state``.

    Args:
        state: from :func:`zeros_state`.
        loss_mask: ``[N]`` bool.
        cu_seqlens: ``[B + 1]`` offsets.
        columns: ``{name: [N] log-probs or None}`` for the names of :data:`LOGP_COLUMNS` (``new_logp`` required).
        versions: ``[N]`` behaviour version per token (−1 for prompt tokens), or ``None``.
        file_index, rows, step: sequence locations for the ``top`` table, which ranks sequences by their suspicious
            tokens (valid tokens with ``old_logp`` = 0 while ``new_logp`` < −ZERO_GAP, valid tokens in a trailing
            zero run, prompt tokens in the loss, generated tokens out of it); ``value`` = the sequence's valid tokens.

    A trailing zero run is the run of valid tokens at the end of a sequence's valid tokens whose ``new_logp`` (and
    ``old_logp`` when present) are exactly 0; runs of at least 2 tokens count (a single certain last token is
    ordinary).
    """
    n = loss_mask.numel()
    n_seq = cu_seqlens.numel() - 1
    if n == 0 or n_seq == 0:
        return
    valid = loss_mask.to(torch.bool)
    device = valid.device
    seq = segment_ids(cu_seqlens, n).to(device)
    new = as_float(cast(Tensor, columns["new_logp"]))  # required (see Args)
    state.update(n_valid=valid.sum())
    zero_all = valid.clone()
    for name in LOGP_COLUMNS:
        col = columns.get(name)
        if col is None:
            continue
        is_zero = valid & (as_float(col) == 0)
        state.update(**{f"n_zero_{name}": is_zero.sum(), f"n_{name}": valid.sum()})
        if name in ("new_logp", "old_logp"):
            zero_all &= as_float(col) == 0
    suspect = torch.zeros(n, dtype=torch.bool, device=device)
    old = columns.get("old_logp")
    if old is not None:
        gap = valid & (as_float(old) == 0) & (new < -ZERO_GAP)
        state.update(n_old_zero_new_not=gap.sum())
        suspect |= gap
    # trailing zero runs: the valid zero tokens after a sequence's last valid non-zero token
    n_valid_seq, first_valid, last_valid = segment_span(valid, cu_seqlens)
    idx = torch.arange(n, device=device)
    last_breaker = segment_span(valid & ~zero_all, cu_seqlens)[2]
    in_run = valid & zero_all & (idx > last_breaker.index_select(0, seq))
    run_len = segment_count(in_run, cu_seqlens)
    trailing = (run_len >= 2) & (last_valid >= 0)
    state.update(n_seq=(n_valid_seq > 0).sum(), n_seq_trailing=trailing.sum(), n_tok_trailing=run_len[trailing].sum())
    suspect |= in_run & trailing.index_select(0, seq)
    # holes: masked tokens strictly between a sequence's first and last valid token
    inside = (idx > first_valid.index_select(0, seq)) & (idx < last_valid.index_select(0, seq))
    hole = inside & ~valid
    state.update(n_holes=hole.sum())
    if versions is not None:
        generated = versions >= 0
        has_valid = (n_valid_seq > 0).index_select(0, seq)
        prompt_in_loss = valid & ~generated
        generated_masked = generated & ~valid & has_valid
        state.update(
            n_versions_valid=valid.sum(), n_prompt_in_loss=prompt_in_loss.sum(),
            n_generated=(generated & has_valid).sum(), n_generated_masked=generated_masked.sum(),
            n_holes_generated=(hole & generated).sum(),
        )
        suspect |= prompt_in_loss | generated_masked
    per_seq = segment_count(suspect, cu_seqlens)
    flagged = per_seq > 0
    state.update(n_seq_suspect=flagged.sum())
    update_top(state, per_seq.to(torch.float64), flagged, n_valid_seq, file_index=file_index, rows=rows, step=step)


def zeros_compute(state: MetricState) -> dict[str, Any]:
    """``diag/zero_frac/<column>`` (valid tokens with log-prob exactly 0), ``diag/old_zero_new_nonzero_frac``,
    ``diag/trailing_zero_seq_frac`` and ``diag/trailing_zero_tokens``, ``diag/mask_hole_frac`` (masked tokens inside
    a sequence's response span / valid tokens), with ``versions``: ``diag/prompt_in_loss_frac`` (valid tokens with
    version < 0 / valid tokens), ``diag/generated_masked_frac`` (generated tokens out of the loss / generated tokens
    of sequences with a valid token) and ``diag/mask_hole_generated_frac``; ``diag/mask_suspect_seq_frac`` and
    ``diag/mask_top``."""
    n_valid = int(state["n_valid"])
    if n_valid == 0:
        return {}
    out: dict[str, Any] = {}
    for name in LOGP_COLUMNS:
        if int(state[f"n_{name}"]):
            out[f"diag/zero_frac/{name}"] = int(state[f"n_zero_{name}"]) / int(state[f"n_{name}"])
    if int(state["n_old_logp"]):
        out["diag/old_zero_new_nonzero_frac"] = int(state["n_old_zero_new_not"]) / n_valid
    n_seq = int(state["n_seq"])
    if n_seq:
        out["diag/trailing_zero_seq_frac"] = int(state["n_seq_trailing"]) / n_seq
        out["diag/mask_suspect_seq_frac"] = int(state["n_seq_suspect"]) / n_seq
    out["diag/trailing_zero_tokens"] = int(state["n_tok_trailing"])
    out["diag/mask_hole_frac"] = int(state["n_holes"]) / n_valid
    if int(state["n_versions_valid"]):
        out["diag/prompt_in_loss_frac"] = int(state["n_prompt_in_loss"]) / int(state["n_versions_valid"])
        out["diag/mask_hole_generated_frac"] = int(state["n_holes_generated"]) / n_valid
        if int(state["n_generated"]):
            out["diag/generated_masked_frac"] = int(state["n_generated_masked"]) / int(state["n_generated"])
    out["diag/mask_top"] = table_rows(state["top"])
    return out

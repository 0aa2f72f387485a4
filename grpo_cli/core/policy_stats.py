"""The GRPOMetric family's figures as a functional core: ``policy_stats_state`` / ``_update`` / ``_compute``.

Inputs are *valid tokens only* (already compacted by the loss mask), packed with ``cu_seqlens``. Definitions follow the
twinkle's ``GRPOMetric``, with the corrections grpo-cli makes on purpose (see ``docs/metrics.md``):
means divide by the tokens that actually had the input, maxima are true maxima over valid tokens, advantage tensors are
honoured.

With ``d = T·new − T·base`` (``T`` the sampling temperature, rescaling log-probs back to T = 1 as twinkle's
GRPOMetric does) and
``r = exp(d)``:

- ``kl/k3 = mean(exp(d_old) − d_old − 1)``: Schulman's k3 estimator of KL(π_old ‖ π_θ) with samples from π_old.
- GRPO clipping (token level, gated by the advantage sign, as PPO's clip is only active there):
  low = [r < 1 − ε ∧ A < 0], high = [r > 1 + ε_high ∧ A > 0].
- GSPO clipping (sequence level): s = exp(mean_t d) and Ā = mean_t A per non-empty sequence, the same gates.
- CISPO clipping: low = [r < 1 − ε], high = [r > 1 + ε_high], not gated by A.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_ids, segment_sum
from grpo_cli.core.state import MetricState, count, maximum, top_rows, total

__all__ = [
    "TOP_KL_FIELDS",
    "TOP_RATIO_FIELDS",
    "policy_stats_compute",
    "policy_stats_state",
    "policy_stats_update",
    "rescale_to_unit_temperature",
]

TOP_KL_FIELDS = ("kl", "file", "row", "position", "ratio", "new_logp", "old_logp", "ratio_base")
"""Columns of the ``top_kl`` state table: the KL value ranks; ``file``/``row`` locate the sequence (for the
stateful metric, ``file`` is 0 and ``row`` the running sequence index); ``position`` is the token index in its row.
``ratio`` is exp(new − old); ``ratio_base`` is the ratio against the figures' ratio base (``prox_logp`` when given,
so both ratios of a decoupled-PPO token are listed; equal to ``ratio`` otherwise)."""

TOP_RATIO_FIELDS = ("ratio", "file", "row", "position", "new_logp", "base_logp")
"""Columns of the ``top_ratio`` state table: the ratio exp(new − base) ranks (base: ``prox_logp`` when given, else
``old_logp``), located like ``top_kl``: the token behind ``ratio/max`` is its first row."""


def policy_stats_state(
    top_k: int = 0, device: torch.device | str | None = None, top_ratio: bool = False
) -> MetricState:
    """An empty state for :func:`policy_stats_update` (counts int64, sums float64); ``top_ratio`` adds the
    ``top_ratio`` table (``top_k`` rows) beside ``top_kl``."""
    specs = {
        "n_valid": count(),
        "sum_new": total(),
        "n_entropy": count(),
        "sum_entropy": total(),
        "n_old": count(),
        "sum_old": total(),
        "sum_diff": total(),
        "sum_k3": total(),
        "max_k3": maximum(),
        "n_ratio": count(),
        "max_ratio": maximum(),
        "n_clip_tokens": count(),
        "clip_low": count(),
        "clip_high": count(),
        "cispo_low": count(),
        "cispo_high": count(),
        "n_clip_seqs": count(),
        "seq_clip_low": count(),
        "seq_clip_high": count(),
    }
    if top_k > 0:
        specs["top_kl"] = top_rows(top_k, len(TOP_KL_FIELDS))
        if top_ratio:
            specs["top_ratio"] = top_rows(top_k, len(TOP_RATIO_FIELDS))
    return MetricState(specs, device)


def rescale_to_unit_temperature(logp: Tensor, temperature: float) -> Tensor:
    """Log-probs sampled at temperature T rescaled to T = 1 as twinkle's GRPOMetric does: ``ℓ·T`` when T > 0 and T ≠ 1.

    (twinkle's ``GRPOMetric``; an approximation, since T·log softmax(z/T) ≠ log softmax(z).) Every figure that
    honours ``--temperature`` goes through this one function.
    """
    if temperature > 0 and temperature != 1.0:
        return logp * temperature
    return logp


def _fsum(x: Tensor) -> Tensor:
    return x.sum(dtype=torch.float64)


def policy_stats_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    cu_seqlens: Tensor,
    old_logp: Tensor | None = None,
    ratio_base_logp: Tensor | None = None,
    advantages: Tensor | None = None,
    entropy: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    temperature: float = 1.0,
    sequence_keys: Tensor | None = None,
    positions: Tensor | None = None,
) -> None:
    """Fold one batch of valid tokens into ``state``.

    Args:
        state: from :func:`policy_stats_state`.
        new_logp: ``[N]`` log π_θ of the valid tokens.
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens' sequences (empty sequences allowed).
        old_logp: ``[N]`` behaviour log-probs; ``kl/*`` and ``logp/old_mean`` compare against it.
        ratio_base_logp: ``[N]`` base of the PPO ratio for ``ratio/*`` and ``clip/*`` (default ``old_logp``;
            ``prox_logp`` for decoupled PPO).
        advantages: ``[N]`` per-token advantages; clip figures need them.
        entropy: ``[N]`` token entropies (not temperature-rescaled, as twinkle's GRPOMetric does).
        epsilon: lower clip width ε.
        epsilon_high: upper clip width (default ε).
        temperature: sampling temperature the log-probs were computed at.
        sequence_keys: ``[B, 2]`` int64 (file, row) per sequence, for ``top_kl`` locations.
        positions: ``[N]`` token positions within their rows, for ``top_kl`` locations.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    new = rescale_to_unit_temperature(new_logp, temperature)
    n_valid = new.numel()
    state.update(n_valid=torch.tensor(n_valid), sum_new=_fsum(new))
    if entropy is not None:
        state.update(n_entropy=torch.tensor(entropy.numel()), sum_entropy=_fsum(entropy))
    if n_valid == 0:
        return

    if old_logp is not None:
        old = rescale_to_unit_temperature(old_logp, temperature)
        diff = new - old
        k3 = k3_of_log_weight(diff)  # exp(d) − 1 − d
        state.update(
            n_old=torch.tensor(n_valid),
            sum_old=_fsum(old),
            sum_diff=_fsum(diff),
            sum_k3=_fsum(k3),
            max_k3=k3.max(),
        )
        if "top_kl" in state:
            base_diff = diff if ratio_base_logp is None else new - rescale_to_unit_temperature(ratio_base_logp,
                                                                                                temperature)
            _update_top_kl(state, k3, diff, new, old, cu_seqlens, sequence_keys, positions, base_diff)

    base = old_logp if ratio_base_logp is None else ratio_base_logp
    if base is None:
        return
    base_scaled = rescale_to_unit_temperature(base, temperature)
    log_ratio = new - base_scaled
    ratio = torch.exp(log_ratio)
    state.update(n_ratio=torch.tensor(n_valid), max_ratio=ratio.max())
    if "top_ratio" in state:
        _update_top(state, "top_ratio", ratio, cu_seqlens, sequence_keys, positions, (new, base_scaled))
    # Compare in the log-probs' dtype against bounds rounded to that dtype (docs/losses.md, "Dtypes").
    below, above = ratio < 1 - epsilon, ratio > 1 + eps_high
    state.update(cispo_low=below.sum(), cispo_high=above.sum())
    if advantages is None:
        return
    state.update(
        n_clip_tokens=torch.tensor(n_valid),
        clip_low=(below & (advantages < 0)).sum(),
        clip_high=(above & (advantages > 0)).sum(),
    )
    # GSPO: sequence ratio s = exp(mean_t log r), mean advantage Ā, over non-empty sequences.
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    non_empty = lengths > 0
    n_tok = lengths[non_empty].to(torch.float64)
    seq_log_ratio = (segment_sum(log_ratio, cu_seqlens, torch.float64)[non_empty] / n_tok).to(ratio.dtype)
    seq_adv = segment_sum(advantages, cu_seqlens, torch.float64)[non_empty] / n_tok
    seq_ratio = torch.exp(seq_log_ratio)
    state.update(
        n_clip_seqs=non_empty.sum(),
        seq_clip_low=((seq_ratio < 1 - epsilon) & (seq_adv < 0)).sum(),
        seq_clip_high=((seq_ratio > 1 + eps_high) & (seq_adv > 0)).sum(),
    )


def _update_top_kl(
    state: MetricState,
    k3: Tensor,
    diff: Tensor,
    new: Tensor,
    old: Tensor,
    cu_seqlens: Tensor,
    sequence_keys: Tensor | None,
    positions: Tensor | None,
    base_diff: Tensor | None = None,
) -> None:
    k = state["top_kl"].shape[0]
    n = k3.numel()
    # Keep every token tied with the k-th value: which of several tied tokens wins must not depend on batching,
    # so the final choice among ties is made by select_top_rows' (file, row, position) order.
    # Once the table holds k rows, a token below its k-th value can never enter it, so only tokens at or above
    # that floor need ranking: usually a handful, which spares a top-k over the whole batch.
    floor = float(state["top_kl"][-1, 0])  # -inf until the table is full; exactly a float32 value after
    cand = None if floor == -math.inf else torch.nonzero(k3 >= floor).flatten()
    if cand is None or cand.numel() > k:
        values = k3 if cand is None else k3[cand]
        kth = torch.topk(values, min(k, values.numel())).values[-1]
        cand = torch.nonzero(k3 >= kth).flatten()
    seq = segment_ids(cu_seqlens, n)[cand]
    if sequence_keys is None:
        keys = torch.stack([torch.zeros_like(seq), seq], dim=1)
    else:
        keys = sequence_keys.to(k3.device)[seq]
    pos = cand - cu_seqlens.to(cand.device)[seq] if positions is None else positions[cand]
    rows = torch.stack(
        [
            k3[cand].to(torch.float64),
            keys[:, 0].to(torch.float64),
            keys[:, 1].to(torch.float64),
            pos.to(torch.float64),
            torch.exp(diff[cand]).to(torch.float64),
            new[cand].to(torch.float64),
            old[cand].to(torch.float64),
            torch.exp((diff if base_diff is None else base_diff)[cand]).to(torch.float64),
        ],
        dim=1,
    )
    state.update(top_kl=rows)


def _update_top(
    state: MetricState,
    name: str,
    values: Tensor,
    cu_seqlens: Tensor,
    sequence_keys: Tensor | None,
    positions: Tensor | None,
    extra: tuple[Tensor, ...],
) -> None:
    """Offer the batch's highest ``values`` to the bounded table ``name``: (value, file, row, position, *extra),
    with ties kept as :func:`_update_top_kl` keeps them (the final choice is by location, not by batching)."""
    k = state[name].shape[0]
    n = values.numel()
    floor = float(state[name][-1, 0])
    cand = None if floor == -math.inf else torch.nonzero(values >= floor).flatten()
    if cand is None or cand.numel() > k:
        ranked = values if cand is None else values[cand]
        kth = torch.topk(ranked, min(k, ranked.numel())).values[-1]
        cand = torch.nonzero(values >= kth).flatten()
    seq = segment_ids(cu_seqlens, n)[cand]
    keys = torch.stack([torch.zeros_like(seq), seq], dim=1) if sequence_keys is None else (
        sequence_keys.to(values.device)[seq])
    pos = cand - cu_seqlens.to(cand.device)[seq] if positions is None else positions[cand]
    columns = [values[cand], keys[:, 0], keys[:, 1], pos, *(column[cand] for column in extra)]
    state.update(**{name: torch.stack([c.to(torch.float64) for c in columns], dim=1)})


def _ratio(num: Tensor, den: Tensor) -> float:
    return float(num.to(torch.float64) / den.to(torch.float64))


def policy_stats_compute(state: MetricState) -> dict[str, Any]:
    """Figures under grpo-cli's canonical keys; keys whose inputs were never seen are absent.

    Returns keys ``n_valid_tokens``, ``logp/new_mean``, ``policy_confidence``, ``entropy/mean``, ``logp/old_mean``,
    ``logp/diff_mean``, ``kl/k3``, ``kl/k3_token_max``, ``ratio/max``, ``clip/cispo``, ``clip/cispo_low``,
    ``clip/cispo_high``, ``clip/ratio``, ``clip/low``, ``clip/high``, ``clip/seq_ratio``, ``clip/seq_low``,
    ``clip/seq_high`` and ``top_kl``, as far as their inputs exist.
    """
    s = state
    out: dict[str, Any] = {"n_valid_tokens": int(s["n_valid"])}
    if int(s["n_valid"]) > 0:
        new_mean = _ratio(s["sum_new"], s["n_valid"])
        out["logp/new_mean"] = new_mean
        out["policy_confidence"] = math.exp(new_mean)
    if int(s["n_entropy"]) > 0:
        out["entropy/mean"] = _ratio(s["sum_entropy"], s["n_entropy"])
    if int(s["n_old"]) > 0:
        out["logp/old_mean"] = _ratio(s["sum_old"], s["n_old"])
        out["logp/diff_mean"] = _ratio(s["sum_diff"], s["n_old"])
        out["kl/k3"] = _ratio(s["sum_k3"], s["n_old"])
        out["kl/k3_token_max"] = float(s["max_k3"])
    if int(s["n_ratio"]) > 0:
        n = s["n_ratio"]
        out["ratio/max"] = float(s["max_ratio"])
        out["clip/cispo_low"] = _ratio(s["cispo_low"], n)
        out["clip/cispo_high"] = _ratio(s["cispo_high"], n)
        out["clip/cispo"] = _ratio(s["cispo_low"] + s["cispo_high"], n)
    if int(s["n_clip_tokens"]) > 0:
        n = s["n_clip_tokens"]
        out["clip/low"] = _ratio(s["clip_low"], n)
        out["clip/high"] = _ratio(s["clip_high"], n)
        out["clip/ratio"] = _ratio(s["clip_low"] + s["clip_high"], n)
    if int(s["n_clip_seqs"]) > 0:
        n = s["n_clip_seqs"]
        out["clip/seq_low"] = _ratio(s["seq_clip_low"], n)
        out["clip/seq_high"] = _ratio(s["seq_clip_high"], n)
        out["clip/seq_ratio"] = _ratio(s["seq_clip_low"] + s["seq_clip_high"], n)
    if "top_kl" in s and int(s["n_old"]) > 0:
        out["top_kl"] = top_kl_records(s["top_kl"])
    if "top_ratio" in s and int(s["n_ratio"]) > 0:
        out["top_ratio"] = top_kl_records(s["top_ratio"], TOP_RATIO_FIELDS)
    return out


def top_kl_records(table: Tensor, fields: tuple[str, ...] = TOP_KL_FIELDS) -> list[dict[str, Any]]:
    """The filled rows of a ``top_kl`` (or ``top_ratio``) table as dicts (``file``/``row``/``position`` as ints)."""
    records = []
    for row in table.cpu().tolist():
        if row[0] == -math.inf:
            continue
        record: dict[str, Any] = dict(zip(fields, row))
        for key in ("file", "row", "position"):
            record[key] = int(record[key])
        records.append(record)
    return records

"""The remaining statistics AReaL's PPO actor logs that a dump supports (AReaL ``areal/engine/ppo/actor.py``).

Per sequence (AReaL's ``n_seqs`` denominators), over every sequence of the dump:

* ``seq/prompt_len_*`` — the index of the first loss-mask token (AReaL [N]: the first generated token); a sequence
  without one counts its whole length. AReaL's older ``seqlen − Σ loss_mask`` agrees on single-turn data;
* ``seq/total_len_*`` — all tokens (AReaL ``seq_len``, prompt + response);
* ``seq/no_eos_frac`` — sequences cut off without EOS (AReaL ``no_eos_ratios``), from an ``eos`` column or
  ``response length ≥ max_new_tokens``;
* ``reward/min``, ``reward/max`` and, split by the task reward (> 0 correct, ≤ 0 incorrect as AReaL),
  ``seq/n_correct``, ``seq/n_incorrect``, ``seq/{correct,incorrect}_total_len_*``.

Per valid token: ``ratio/log_mean`` = mean(new − base) (AReaL ``approx_kl``), and over the tokens AReaL's PPO
clip mask selects, ``logp/clipped_new_mean`` and ``logp/clipped_old_mean`` (the behaviour log-prob).
Counts are int64, sums float64, extrema exact; everything merges exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_ids, segment_min
from grpo_cli.core.state import MetricState, count, maximum, minimum, total

__all__ = ["actor_stats_compute", "actor_stats_state", "actor_stats_update"]

_F64 = torch.float64
_LENGTHS = ("prompt", "total", "correct", "incorrect")


def actor_stats_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`actor_stats_update`."""
    specs = {"n_seq": count(), "n_eos_known": count(), "n_no_eos": count(), "n_reward": count(),
             "reward_min": minimum(), "reward_max": maximum(), "n_ratio": count(), "log_ratio_sum": total(),
             "n_clipped": count(), "clipped_new_sum": total(), "n_clipped_old": count(), "clipped_old_sum": total()}
    for name in _LENGTHS:
        specs.update({f"{name}_n": count(), f"{name}_sum": total(), f"{name}_min": minimum(),
                      f"{name}_max": maximum()})
    return MetricState(specs, device)


def _lengths(state: MetricState, name: str, values: Tensor) -> None:
    if values.numel() == 0:
        return
    v = values.to(_F64)
    state.update(**{f"{name}_n": torch.tensor(v.numel()), f"{name}_sum": v.sum(), f"{name}_min": v.min(),
                    f"{name}_max": v.max()})


def actor_stats_update(
    state: MetricState,
    *,
    cu_seqlens: Tensor,
    loss_mask: Tensor,
    rewards: Tensor | None = None,
    no_eos: Tensor | None = None,
    log_ratio: Tensor | None = None,
    clip_mask: Tensor | None = None,
    new_logp: Tensor | None = None,
    old_logp: Tensor | None = None,
    prompt_lengths: Tensor | None = None,
) -> None:
    """Fold one batch into ``state``.

    Args:
        state: from :func:`actor_stats_state`.
        cu_seqlens: ``[B + 1]`` offsets of the *whole* sequences.
        loss_mask: ``[N]`` bool mask of the whole sequences.
        rewards: ``[B]`` task rewards, or None.
        no_eos: ``[B]`` bool "cut off without EOS", or None when unknown.
        log_ratio: ``[M]`` ``new − base`` of the valid tokens, or None.
        clip_mask: ``[M]`` bool, AReaL's PPO clip mask of the valid tokens, or None.
        new_logp, old_logp: ``[M]`` log-probs of the valid tokens, for the clipped-token means.
        prompt_lengths: ``[B]`` position of each sequence's first loss-mask token (its length when it has none),
            if the caller already knows them; otherwise they are found by scanning ``loss_mask``.
    """
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    n_seq = lengths.numel()
    state.update(n_seq=torch.tensor(n_seq))
    if n_seq:
        if prompt_lengths is None:
            n = loss_mask.numel()
            position = torch.arange(n, device=loss_mask.device) - cu_seqlens[:-1].to(loss_mask.device)[
                segment_ids(cu_seqlens, n)
            ]
            first = segment_min(torch.where(loss_mask, position.to(_F64), torch.inf), cu_seqlens)
            prompt = torch.where(torch.isinf(first), lengths.to(_F64), first)  # no loss-mask token: all prompt
        else:
            prompt = prompt_lengths
        _lengths(state, "prompt", prompt)
        _lengths(state, "total", lengths)
    if no_eos is not None:
        state.update(n_eos_known=torch.tensor(n_seq), n_no_eos=no_eos.sum())
    if rewards is not None and n_seq:
        r = rewards.to(_F64)
        state.update(n_reward=torch.tensor(n_seq), reward_min=r.min(), reward_max=r.max())
        # AReaL: correct = task reward > 0, incorrect = ≤ 0.
        _lengths(state, "correct", lengths[r > 0])
        _lengths(state, "incorrect", lengths[r <= 0])
    if log_ratio is not None:
        state.update(n_ratio=torch.tensor(log_ratio.numel()), log_ratio_sum=log_ratio.to(_F64).sum())
    if clip_mask is not None and new_logp is not None:
        state.update(n_clipped=clip_mask.sum(), clipped_new_sum=torch.where(clip_mask, new_logp.to(_F64), 0.0).sum())
        if old_logp is not None:
            state.update(n_clipped_old=clip_mask.sum(),
                         clipped_old_sum=torch.where(clip_mask, old_logp.to(_F64), 0.0).sum())


def actor_stats_compute(state: MetricState) -> dict[str, Any]:
    """Figures under grpo-cli keys; a figure whose denominator is 0 (no clipped token, no correct sequence) is absent
    (AReaL drops such a statistic too)."""
    s = state
    out: dict[str, Any] = {}
    names = {"prompt": "seq/prompt_len", "total": "seq/total_len", "correct": "seq/correct_total_len",
             "incorrect": "seq/incorrect_total_len"}
    for name, key in names.items():
        n = int(s[f"{name}_n"])
        if n:
            out[f"{key}_mean"] = float(s[f"{name}_sum"]) / n
            out[f"{key}_min"] = int(s[f"{name}_min"])
            out[f"{key}_max"] = int(s[f"{name}_max"])
    if int(s["n_eos_known"]):
        out["seq/no_eos_frac"] = int(s["n_no_eos"]) / int(s["n_eos_known"])
    if int(s["n_reward"]):
        out["reward/min"] = float(s["reward_min"])
        out["reward/max"] = float(s["reward_max"])
        out["seq/n_correct"] = int(s["correct_n"])
        out["seq/n_incorrect"] = int(s["incorrect_n"])
    if int(s["n_ratio"]):
        out["ratio/log_mean"] = float(s["log_ratio_sum"]) / int(s["n_ratio"])
    if int(s["n_clipped"]):
        out["logp/clipped_new_mean"] = float(s["clipped_new_sum"]) / int(s["n_clipped"])
    if int(s["n_clipped_old"]):
        out["logp/clipped_old_mean"] = float(s["clipped_old_sum"]) / int(s["n_clipped_old"])
    return out

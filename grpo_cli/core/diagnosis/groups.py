"""The **groups** family: per GRPO group (step, group_id), the sign, centring and scale of the sequence
advantages against the rewards."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_count, segment_sum
from grpo_cli.core.state import Reduce

__all__ = ["SCALE_TOLERANCE", "groups_compute", "groups_state", "groups_update"]

_GROUP_OPS = (Reduce.SUM,) * 7 + (Reduce.MIN, Reduce.MIN)
SCALE_TOLERANCE = 0.1
"""Tolerance on a group's log advantage scale (±10 %). The models account for the group size (the unbiased std's
factor √(n/(n − 1))), so only the std's ε (1e-6 to 1e-4 in the peers) and float rounding move a consistent group."""


def groups_state(device: torch.device | str | None = None) -> KeyedState:
    """An empty state for :func:`groups_update`: a keyed table ``g`` with columns (n, Σr, Σr², ΣA, ΣA², ΣrA,
    n_masked_out, step, group_id)."""
    return KeyedState({}, {"g": _GROUP_OPS}, device)


def groups_update(
    state: KeyedState,
    *,
    rewards: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    group_id: Tensor,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of whole sequences into ``state``.

    Args:
        state: from :func:`groups_state`.
        rewards: ``[B]`` per-sequence rewards.
        advantages: ``[N]`` per-token advantages (per-sequence ones broadcast); a sequence's advantage is their mean
            over its loss-mask tokens, or over all its tokens when it has none (a sequence whose mask was emptied
            still belongs to its group's statistics).
        loss_mask: ``[N]`` bool.
        cu_seqlens: ``[B + 1]`` offsets.
        group_id: ``[B]`` group ids; the key is (step, group_id) when ``step`` is given, stored as
            ``step·2³² + group_id`` in float64 (exact for steps below 2²¹ and ids in [0, 2³²)).
        step: ``[B]`` steps, or ``None``.

    Sequences with a non-finite reward or advantage are left out. The float sums are float64 and merge by
    ``scatter_reduce``, so they are independent of batching up to summation order (1e-15 relative).
    """
    n_seq = cu_seqlens.numel() - 1
    if n_seq == 0:
        return
    device = advantages.device
    valid = loss_mask.to(torch.bool)
    adv = advantages.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    v_sum = segment_sum(torch.where(valid, adv, zero), cu_seqlens, torch.float64)
    v_n = segment_count(valid, cu_seqlens)
    all_sum = segment_sum(adv, cu_seqlens, torch.float64)
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(device)
    a = torch.where(v_n > 0, v_sum / v_n.clamp_min(1), all_sum / lengths.clamp_min(1))
    r = rewards.to(device=device, dtype=torch.float64)
    # An empty row (TRL writes a completion emptied by mask_truncated_completions as one) stays in its group, marked
    # masked out: its advantage was part of the group's normalisation, so the rest alone is not centred.
    keep = torch.isfinite(r) & (torch.isfinite(a) | (lengths == 0))
    gid = group_id.to(device=device, dtype=torch.int64)
    st = step.to(device=device, dtype=torch.int64) if step is not None else torch.zeros_like(gid)
    key = (st * (1 << 32) + gid).to(torch.float64)
    masked_out = (v_n == 0).to(torch.float64)
    rows = torch.stack(
        [key, torch.ones_like(r), r, r * r, a, a * a, r * a, masked_out, st.to(torch.float64), gid.to(torch.float64)],
        dim=1,
    )
    state.update(g=rows[keep])


def groups_compute(state: KeyedState, *, limit: int = 8) -> dict[str, Any]:
    """Per-group consistency of advantages with rewards, over groups of at least 2 sequences.

    Keys:

    - ``diag/groups_n``: groups; ``diag/groups_spread_n``: groups whose rewards differ;
    - ``diag/adv_sign_flip_frac``: spread groups where cov(r, A) < 0 (higher reward, lower advantage);
    - ``diag/adv_uncentred_frac``: groups whose mean A is not 0 (|mean A| > 1e-3 + 0.05·sd A), among the groups
      without a sequence wholly outside the loss mask (``diag/adv_centring_n``): a dump writes such a row's advantages
      as padding (TRL's masked completions), so its group's mean says nothing about the advantages it trained on;
    - ``diag/adv_scale_exponent``: the least-squares slope of log(cov(r, A)/var(r)) against log sd(r) over spread
      groups with positive cov: −1 when A is divided by the group std, 0 when it is not or by a batch-wide std, −2
      when divided by the variance; absent with fewer than 4 such groups or a range of log sd below 0.05;
    - ``diag/adv_scale_outlier_frac``: the fraction of those groups whose log scale log(cov/var) is more than
        :data:`SCALE_TOLERANCE` off the best of the legitimate models (A = c·(r − mean)/sd with the population or the
      unbiased sd, or A = c·(r − mean), c one constant fitted by the median): one worker normalising differently;
    - ``diag/adv_group_std_mean``: the mean population sd of A in spread groups;
    - ``diag/adv_where``: up to ``limit`` groups, sign-flipped first, then uncentred.
    """
    table = state["g"]
    out: dict[str, Any] = {}
    if table.shape[0] == 0:
        return out
    n = table[:, 1]
    big = n >= 2
    t = table[big]
    n = t[:, 1]
    mr, ma = t[:, 2] / n, t[:, 4] / n
    vr = (t[:, 3] / n - mr * mr).clamp_min(0)
    va = (t[:, 5] / n - ma * ma).clamp_min(0)
    cov = t[:, 6] / n - mr * ma
    spread = vr > 1e-12
    out["diag/groups_n"] = int(t.shape[0])
    out["diag/groups_spread_n"] = int((spread & (t[:, 7] == 0)).sum())
    if t.shape[0] == 0:
        return out
    judged = t[:, 7] == 0
    spread = spread & judged
    flipped = spread & (cov < 0)
    uncentred = judged & (ma.abs() > 1e-3 + 0.05 * va.sqrt())
    if int(spread.sum()):
        out["diag/adv_sign_flip_frac"] = int(flipped.sum()) / int(spread.sum())
        out["diag/adv_group_std_mean"] = float(va[spread].sqrt().mean())
    out["diag/adv_centring_n"] = int(judged.sum())
    if int(judged.sum()):
        out["diag/adv_uncentred_frac"] = int(uncentred.sum()) / int(judged.sum())
    fit = spread & (cov > 0)
    if int(fit.sum()) >= 4:
        lx = 0.5 * torch.log(vr[fit])
        ly = torch.log(cov[fit] / vr[fit])
        vx = float(((lx - lx.mean()) ** 2).mean())
        if float(lx.max() - lx.min()) >= 0.05 and vx > 0:
            out["diag/adv_scale_exponent"] = float(((lx - lx.mean()) * (ly - ly.mean())).mean()) / vx
        # the legitimate scalings: A ∝ (r − mean)/sd (log scale + log sd constant) or A ∝ r − mean (log scale
        # constant); groups off the better-fitting one by more than SCALE_TOLERANCE are inconsistent
        nf = n[fit]
        lx_unbiased = lx + 0.5 * torch.log(nf / (nf - 1))
        candidates = [(ly + z - (ly + z).median()).abs() for z in (lx, lx_unbiased)] + [(ly - ly.median()).abs()]
        resid = min(candidates, key=lambda r: float(r.median()))
        out["diag/adv_scale_outlier_frac"] = int((resid > SCALE_TOLERANCE).sum()) / int(fit.sum())
    where: list[dict[str, Any]] = []
    for mask, why in ((flipped, "sign"), (uncentred & ~flipped, "uncentred")):
        for r in t[mask][:limit].tolist():
            if len(where) < limit:
                where.append({"step": int(r[8]), "group_id": int(r[9]), "problem": why})
    out["diag/adv_where"] = where
    return out

"""The **pairs** family: each behaviour log-prob (``old_logp``) against the training log-prob of the same token under
the *same weights* — the physical signatures of what the engine and the trainer disagree on.

At lag 0 (or where versions are unknown, on every generated token) the trainer's recompute uses the weights the
engine sampled with: ``new_logp`` in dumps whose ``new_logp`` is the step's first forward, ``prox_logp`` in AReaL-style
dumps whose ``new_logp`` carries the step's minibatch updates. Both are kept and :func:`pairs_compute` takes the one
closer to ``old_logp`` (mean |Δ|), so no staleness and no in-step update enters the statistics. With x the training
and y the behaviour log-prob of a token and d = y − x:

- **temperature** — y = log softmax(z/T_b) against x = log softmax(z/T_t) is, within a context, exactly the line
  y = (T_t/T_b)·x + c: a *tilt*. Numerical noise in either column attenuates the least-squares slope of the other
  (errors in variables), so the tilt must hold in both regression directions: b_yx = cov/var(x) and
  b_xy⁻¹ = var(y)/cov lie on the same side of 1 only when the tilt is real. The estimate is their geometric mean
  (the reduced-major-axis slope sd(y)/sd(x)), and T_b/T_t = 1/b. A tilt also flips the sign of d between likely
  and unlikely tokens (a colder engine lifts the likely ones and sinks the rest).
- **truncated sampling** — renormalising over a top-k/top-p set lifts y by −log(kept mass) on *every* sampled token:
  d > 0 on both likely (p ≥ 1/2) and unlikely tokens, with no sign flip.
- **mismatch** — NeMo RL's mean exp(|d|) (1 = identical) and the weight tail, the fraction of tokens whose weight
  exp(−d) leaves [1/2, 2] (verl's ``rollout_is_threshold`` 2).
- **re-tokenisation** — the trainer scored another token id than the engine sampled: x far below y
  (x ≤ y − :data:`RETOK_GAP`) where the engine found the token likely (y ≥ log :data:`RETOK_LIKELY`), on the
  same-weights tokens (a learning-rate spike can move a stale token by e^5; nothing moves a lag-0 token so far).
- **proximal recompute** — on stale tokens (lag ≥ 1) a recomputed ``prox_logp`` never equals ``old_logp`` bitwise;
  a sequence whose every stale token does was not recomputed.

Tokens with |d| > :data:`OUTLIER` (re-tokenised, broken) are left out of the tilt and shift statistics so a few cannot
steer them. Every statistic is kept per block of sequences (``block``, a hash of the GRPO group), so
:func:`~grpo_cli.core.diagnosis._common.jackknife` gives its interval over the natural unit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli._intervals import wilson
from grpo_cli.core.diagnosis._common import (
    TOP_FIELDS,
    as_float,
    counts_by,
    jackknife,
    locations,
    table_rows,
    top_table,
)
from grpo_cli.core.packing import segment_ids
from grpo_cli.core.state import MetricState, count, top_rows, total

__all__ = ["FIELDS", "N_BLOCKS", "OUTLIER", "RETOK_GAP", "RETOK_LIKELY", "pairs_compute", "pairs_state",
           "pairs_update"]

N_BLOCKS = 20
"""Blocks of sequences for the jackknife (as ``diff``'s hash blocks)."""
FIELDS = ("n", "sx", "sy", "sxx", "sxy", "syy", "sh", "shh", "sxh", "syh", "n_lik", "d_lik", "gt_lik", "n_unl",
          "d_unl", "gt_unl", "n_all", "abs_d", "exp_abs", "n_tail")
"""Per-block sums of the pair statistics (all but the last four over tokens with |d| ≤ OUTLIER; h is the trainer's
entropy at the token, 0 when the dump has none)."""
_F = {name: i for i, name in enumerate(FIELDS)}
OUTLIER = 4.0
"""|d| (nats) above which a token stays out of the tilt and shift statistics."""
LIKELY = math.log(0.5)
"""A token is *likely* for the trainer when x ≥ log 1/2."""
TAIL = math.log(2.0)
"""A weight exp(−d) outside [1/2, 2]: |d| > log 2."""
RETOK_LIKELY = 0.2
"""Re-tokenisation: the engine's probability of the token is at least this …"""
RETOK_GAP = 5.0
"""… and the trainer's log-prob is at least this many nats lower (the trainer finds it ≤ e^−5 ≈ 0.7 % as likely)."""
RATIO_RESOLUTION = 0.03
"""The temperature ratio's interval is at least ±3 % of it, whatever the number of tokens: the entropy stands in for
each context's offset only approximately (the corpus's engines at 0.7, 0.85 and 1.3 read within 2 % of the truth),
and bfloat16 logits carry 8 significant bits."""
_SEQ = ("n_seq", "n_seq_retok", "n_stale_seq", "n_stale_seq_equal")
_PARTNERS = ("new_logp", "prox_logp")


def pairs_state(device: torch.device | str | None = None, top_k: int = 8) -> MetricState:
    """An empty state for :func:`pairs_update`."""
    return MetricState({
        "pair": total((len(_PARTNERS), N_BLOCKS, len(FIELDS))),
        "seq": count((N_BLOCKS, len(_SEQ))),
        "n_retok_tokens": count(),
        "n_lag_known": count(),
        "top_retok": top_rows(top_k, len(TOP_FIELDS)),
    }, device)


def _pair_sums(x: Tensor, y: Tensor, h: Tensor, tok_block: Tensor) -> Tensor:
    """``[N_BLOCKS, FIELDS]`` sums over same-weights tokens (training ``x``, behaviour ``y``, entropy ``h``)."""
    d = y - x
    use = d.abs() <= OUTLIER
    lik = x >= LIKELY
    # One field per row of a [FIELDS, N] buffer, summed along the tokens by one index_add_: a [N, FIELDS] stack
    # would be a strided copy costing more than all the arithmetic. Masked tokens are exact zeros, so products of
    # the masked columns equal the masked products bit for bit.
    values = torch.empty(len(FIELDS), x.numel(), dtype=torch.float64, device=x.device)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    f = _F
    values[f["n"]].copy_(use)
    xu = torch.where(use, x, zero, out=values[f["sx"]])
    yu = torch.where(use, y, zero, out=values[f["sy"]])
    hu = torch.where(use, h, zero, out=values[f["sh"]])
    torch.mul(xu, xu, out=values[f["sxx"]])
    torch.mul(xu, yu, out=values[f["sxy"]])
    torch.mul(yu, yu, out=values[f["syy"]])
    torch.mul(hu, hu, out=values[f["shh"]])
    torch.mul(xu, hu, out=values[f["sxh"]])
    torch.mul(yu, hu, out=values[f["syh"]])
    du = yu - xu
    positive = d > 0
    for mask, n_key, d_key, gt_key in ((lik, "n_lik", "d_lik", "gt_lik"), (~lik, "n_unl", "d_unl", "gt_unl")):
        in_bin = use & mask
        values[f[n_key]].copy_(in_bin)
        torch.where(mask, du, zero, out=values[f[d_key]])
        values[f[gt_key]].copy_(in_bin & positive)
    ad = torch.abs(d, out=values[f["abs_d"]])
    values[f["n_all"]].fill_(1.0)
    torch.exp(ad, out=values[f["exp_abs"]])
    values[f["n_tail"]].copy_(ad > TAIL)
    return torch.zeros(len(FIELDS), N_BLOCKS, dtype=torch.float64, device=x.device).index_add_(
        1, tok_block, values).T


def pairs_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    cu_seqlens: Tensor,
    block: Tensor,
    prox_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    lag: Tensor | None = None,
    file_index: int = 0,
    rows: Tensor | None = None,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of **valid tokens** (compacted by the loss mask) into ``state``.

    Args:
        state: from :func:`pairs_state`.
        new_logp, old_logp, prox_logp: ``[N]`` valid-token log-probs as dumped (``prox_logp`` optional).
        entropy: ``[N]`` the trainer's entropy at each token, optional: it stands in for each context's
            log-partition offset in the temperature fit.
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens.
        block: ``[B]`` int64 block in ``[0, N_BLOCKS)`` per sequence.
        lag: ``[N]`` ``current_version − versions`` (negative: not generated); ``None`` when unknown (then every
            token counts as same-weights and nothing is stale).
        file_index, rows, step: locations for the ``top_retok`` table (``value``: re-tokenised tokens in the
            sequence).
    """
    n = new_logp.numel()
    if n == 0:
        return
    device = new_logp.device
    seq = segment_ids(cu_seqlens, n).to(device)
    n_seq = cu_seqlens.numel() - 1
    if lag is not None:
        lag = lag.to(device)
        state.update(n_lag_known=(lag >= 0).sum())
    # Every statistic but the stale-sequence counts reads the same-weights tokens only: compact them once (in order,
    # so every sum adds the same numbers in the same order as over the masked full batch).
    picked = None if lag is None else (lag == 0).nonzero().squeeze(1)

    def same_weights(column: Tensor) -> Tensor:
        return column if picked is None else column.index_select(0, picked)

    same_seq = same_weights(seq)
    tok_block = block.to(device=device, dtype=torch.int64)[same_seq]
    y = same_weights(as_float(old_logp)).to(torch.float64)
    x_new = same_weights(as_float(new_logp)).to(torch.float64)
    h = same_weights(as_float(entropy)).to(torch.float64) if entropy is not None else torch.zeros_like(y)
    x_prox = same_weights(as_float(prox_logp)).to(torch.float64) if prox_logp is not None else None
    pair = torch.zeros(len(_PARTNERS), N_BLOCKS, len(FIELDS), dtype=torch.float64, device=device)
    pair[0] = _pair_sums(x_new, y, h, tok_block)
    if x_prox is not None:
        pair[1] = _pair_sums(x_prox, y, h, tok_block)
    state.update(pair=pair)

    # Only same-weights tokens (a policy blown up by a learning-rate spike moves stale tokens by e^5 too), and against
    # the closer of new and prox: in a second PPO epoch new_logp has moved on by an update, prox_logp has not.
    x_retok = x_new if x_prox is None else torch.maximum(x_new, x_prox)
    retok = (y >= math.log(RETOK_LIKELY)) & (x_retok <= y - RETOK_GAP)
    per_seq_retok = counts_by(same_seq, retok, n_seq)
    has_gen = torch.bincount(same_seq, minlength=n_seq) > 0
    flags = [has_gen, per_seq_retok > 0]
    if prox_logp is not None and lag is not None:
        stale = lag >= 1
        n_stale = counts_by(seq, stale, n_seq)
        n_equal = counts_by(seq, stale & (prox_logp == old_logp), n_seq)
        flags += [n_stale > 0, (n_stale > 0) & (n_equal == n_stale)]
    else:
        zeros = torch.zeros(n_seq, dtype=torch.bool, device=device)
        flags += [zeros, zeros]
    seq_block = block.to(device=device, dtype=torch.int64)
    counts = torch.zeros(N_BLOCKS, len(_SEQ), dtype=torch.int64, device=device).index_add_(
        0, seq_block, torch.stack(flags, dim=1).to(torch.int64))
    state.update(seq=counts, n_retok_tokens=retok.sum())
    score = per_seq_retok.to(torch.float64)
    file, row = locations(file_index, rows, n_seq, device)
    state.update(top_retok=top_table(score, score > 0, file, row, step, score))


def _moments(v: Tensor) -> tuple[float, float, float] | None:
    """(var x, var y, cov) of the used tokens from the totals, partialled on the entropy h when the dump has it
    (Frisch–Waugh: the residuals of x and y on h), ``None`` when degenerate.

    Within one context the tilt is exact, y = b·x + c, with c = b·lse(z/T_t) − lse(z/T_b) larger in flatter
    contexts; across contexts c correlates with x and biases every slope towards 1 (by ~5 % at T_b/T_t = 0.7 on a
    peaked policy). The context's entropy carries that offset, and holding it fixed removes the bias."""
    n = float(v[_F["n"]])
    if n < 3:
        return None

    def c(a: str, b: str) -> float:
        return float(v[_F[f"s{a}{b}"]]) / n - float(v[_F[f"s{a}"]]) / n * float(v[_F[f"s{b}"]]) / n

    vx, vy, cxy = c("x", "x"), c("y", "y"), c("x", "y")
    vh = float(v[_F["shh"]]) / n - (float(v[_F["sh"]]) / n) ** 2
    if vh > 1e-12:
        cxh, cyh = c("x", "h"), c("y", "h")
        vx, vy, cxy = vx - cxh * cxh / vh, vy - cyh * cyh / vh, cxy - cxh * cyh / vh
    if vx <= 1e-12 or vy <= 1e-12 or cxy <= 1e-12:
        return None
    return vx, vy, cxy


def _slope_old_on_new(v: Tensor) -> float:
    m = _moments(v)
    return m[2] / m[0] if m else math.nan


def _slope_new_on_old_inverse(v: Tensor) -> float:
    m = _moments(v)
    return m[1] / m[2] if m else math.nan


def _temperature_ratio(v: Tensor) -> float:
    m = _moments(v)
    return math.sqrt(m[0] / m[1]) if m else math.nan


def _ratio(num: str, den: str, min_den: float = 1.0) -> Any:
    def stat(v: Tensor) -> float:
        d = float(v[_F[den]])
        return float(v[_F[num]]) / d if d >= min_den else math.nan
    return stat


def _onesided(v: Tensor) -> float:
    """The smaller of the likely and the unlikely tokens' fractions with d > 0 (a bin with fewer than 10 tokens is
    left out)."""
    fracs = [float(v[_F[gt]]) / float(v[_F[n]]) for gt, n in (("gt_lik", "n_lik"), ("gt_unl", "n_unl"))
             if float(v[_F[n]]) >= 10]
    return min(fracs) if fracs else math.nan


def _est(stat: Any, blocks: Tensor) -> dict[str, float]:
    value, low, high = jackknife(stat, blocks)
    return {"value": value, "low": low, "high": high}


def pairs_compute(state: MetricState) -> dict[str, Any]:
    """The pair statistics as ``{"value", "low", "high"}`` estimates (jackknife 95 % intervals over blocks, Wilson
    intervals for fractions of sequences):

    ``diag/pair_partner`` (``new_logp`` or ``prox_logp``), ``diag/pair_scope`` (``lag 0`` or ``all tokens``),
    ``diag/pair_n_tokens``; ``diag/pair_slope_old_on_new`` b_yx, ``diag/pair_slope_new_on_old_inverse`` b_xy⁻¹,
    ``diag/temperature_ratio`` T_behaviour/T_train = 1/b; ``diag/pair_d_likely`` and ``diag/pair_d_unlikely`` (mean
    d by token likelihood), ``diag/pair_onesided`` (the smaller of the two bins' fractions with d > 0);
    ``diag/pair_mult_prob_error`` (mean exp|d|), ``diag/pair_abs_diff_mean``, ``diag/pair_tail_frac`` (|d| > log 2);
    ``diag/retok_seq_frac`` (sequences with a re-tokenised token among those with same-weights tokens),
    ``diag/retok_n_seq``, ``diag/retok_n_tokens``, ``diag/retok_top``; ``diag/prox_equal_old_seq_frac`` (stale
    sequences whose ``prox_logp`` equals ``old_logp`` on every stale token), ``diag/prox_equal_old_n_stale``.
    """
    out: dict[str, Any] = {}
    pair = state["pair"].to(torch.float64).cpu()
    means = []
    for j in range(len(_PARTNERS)):
        n_all = float(pair[j, :, _F["n_all"]].sum())
        if n_all > 0:
            means.append((float(pair[j, :, _F["abs_d"]].sum()) / n_all, j))
    if means:
        j = min(means)[1]
        blocks = pair[j]
        out["diag/pair_partner"] = _PARTNERS[j]
        out["diag/pair_scope"] = "lag 0" if int(state["n_lag_known"]) else "all tokens"
        out["diag/pair_n_tokens"] = int(blocks[:, _F["n_all"]].sum())
        out["diag/pair_slope_old_on_new"] = _est(_slope_old_on_new, blocks)
        out["diag/pair_slope_new_on_old_inverse"] = _est(_slope_new_on_old_inverse, blocks)
        ratio = _est(_temperature_ratio, blocks)
        half = RATIO_RESOLUTION * ratio["value"]
        ratio["low"] = min(ratio["low"], ratio["value"] - half)
        ratio["high"] = max(ratio["high"], ratio["value"] + half)
        out["diag/temperature_ratio"] = ratio
        out["diag/pair_d_likely"] = _est(_ratio("d_lik", "n_lik", 10), blocks)
        out["diag/pair_d_unlikely"] = _est(_ratio("d_unl", "n_unl", 10), blocks)
        out["diag/pair_onesided"] = _est(_onesided, blocks)
        out["diag/pair_mult_prob_error"] = _est(_ratio("exp_abs", "n_all"), blocks)
        out["diag/pair_abs_diff_mean"] = _est(_ratio("abs_d", "n_all"), blocks)
        out["diag/pair_tail_frac"] = _est(_ratio("n_tail", "n_all"), blocks)
    seq = state["seq"].sum(0).tolist()
    n_seq, n_retok, n_stale, n_equal = (int(v) for v in seq)
    if n_seq:
        low, high = wilson(n_retok, n_seq)
        out["diag/retok_seq_frac"] = {"value": n_retok / n_seq, "low": low, "high": high}
        out["diag/retok_n_seq"] = n_retok
        out["diag/retok_n_tokens"] = int(state["n_retok_tokens"])
        out["diag/retok_top"] = table_rows(state["top_retok"])
    if n_stale:
        low, high = wilson(n_equal, n_stale)
        out["diag/prox_equal_old_seq_frac"] = {"value": n_equal / n_stale, "low": low, "high": high}
        out["diag/prox_equal_old_n_stale"] = n_stale
    return out

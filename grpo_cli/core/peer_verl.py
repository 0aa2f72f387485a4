"""verl's losses, KL penalty and data metrics as it logs them (verl ``verl/trainer/ppo/core_algos.py``:
``compute_policy_loss_vanilla``, ``compute_policy_loss_cispo``, ``compute_policy_loss_gspo``, ``agg_loss``,
``kl_penalty``;
``verl/trainer/ppo/metric_utils.py``: ``compute_data_metrics``). Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.core._loss_common import (
    as_bool_mask,
    check_real,
)
from grpo_cli.core._peer_common import (
    F64,
    VERL_SAFETY_BOUND,
    masked_mean,
    prepare,
    where,
)
from grpo_cli.core.aggregate import aggregate_loss
from grpo_cli.core.kl import kl_estimate

__all__ = [
    "VERL_GSPO_LOG_RATIO_MAX",
    "verl_data_metrics",
    "verl_kl_penalty",
    "verl_policy_loss",
]


_VERL_LOSSES = ("vanilla", "cispo", "gspo")

VERL_GSPO_LOG_RATIO_MAX = 10.0
"""verl's ``compute_policy_loss_gspo`` clamps the combined sequence log-ratio at this, from above only ("clamp for
numerical stability"), and does not apply the ±20 bound of its other losses."""


def verl_policy_loss(
    variant: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
    convention: str | None = "verl",
) -> tuple[Tensor, dict[str, float]]:
    """verl's ``vanilla`` (PPO with dual clip), ``cispo`` and ``gspo`` policy losses and their ``actor/*`` metrics.

    ``log r = clamp(ℓ − ℓ_old, −20, 20)``, ``r = exp(log r)`` (``vanilla``, ``cispo``).

    - ``vanilla`` (``compute_policy_loss_vanilla``): ``L1 = −A·r``, ``L2 = −A·clip(r, 1 − ε_l, 1 + ε_h)``,
      ``Lc = max(L1, L2)``; where ``A < 0`` the dual clip ``min(−A·c, Lc)``. Metrics ``pg_clipfrac`` =
      masked mean ``[L2 > L1]``, ``pg_clipfrac_lower`` = masked mean ``[Lc > −A·c ∧ A < 0]``.
    - ``cispo`` (``compute_policy_loss_cispo``): ``−sg(clip(r, 1 − ε_l, 1 + ε_h))·A·ℓ`` (two-sided);
      ``pg_clipfrac`` = masked mean ``[r ≠ clip(r)]``, ``pg_clipfrac_lower`` = 0.
    - ``gspo`` (``compute_policy_loss_gspo``): the sequence log-ratio ``σ = Σ_t (ℓ − ℓ_old)·m / max(n, 1)``
      (not bounded at ±20), on every token ``log s = min(ℓ − sg(ℓ) + sg(σ), 10)`` (value σ capped at 10 from
      above, gradient ``s`` per token below the cap and 0 above it), ``L = max(−A·s, −A·clip(s, 1 − ε_l,
      1 + ε_h))``; ``pg_clipfrac`` = masked mean ``[L2 > L1]``, ``ppo_kl`` = masked mean of ``ℓ_old − ℓ``
      (unclamped), ``pg_clipfrac_lower`` = 0. grpo-cli's own ``loss/gspo`` (twinkle's) clamps each token's
      log-ratio at ±20 before the mean and has no cap at 10, so the two differ for extreme ratios.
    - all: ``ppo_kl`` = masked mean of ``−log r`` (after the clamp; ``gspo`` above); the per-token loss times
      ``rollout_is_weights`` when given, then :func:`~grpo_cli.core.aggregate.aggregate_loss` with
      ``loss_agg_mode`` and ``convention`` (``"verl"``: the current release's ``seq-mean-token-sum-norm``).

    Args:
        variant: ``"vanilla"``, ``"cispo"`` or ``"gspo"``.
        old_log_prob: ``[B, T]`` old log-probs.
        log_prob: ``[B, T]`` current log-probs (carry the gradient).
        advantages: ``[B, T]`` per-token advantages.
        response_mask: ``[B, T]`` bool or 0/1.
        loss_agg_mode: one of :data:`~grpo_cli.core.aggregate.AGG_MODES`.
        clip_ratio_low: ε_l (verl ``clip_ratio_low``).
        clip_ratio_high: ε_h (verl ``clip_ratio_high``).
        clip_ratio_c: dual-clip constant ``c > 1`` (verl ``clip_ratio_c``, default 3).
        rollout_is_weights: optional ``[B, T]`` rollout-correction weights (detached).
        convention: passed to :func:`~grpo_cli.core.aggregate.aggregate_loss`.

    Returns:
        ``(loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``; ``loss`` in ``log_prob``'s dtype.

    Raises:
        ValueError: an unknown variant or mode, ``clip_ratio_c <= 1``, bad shapes or mask.

    Example:
        >>> lp = torch.log(torch.tensor([[2.0, 0.5]])); old = torch.zeros(1, 2)
        >>> loss, m = verl_policy_loss("vanilla", old, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
        >>> round(loss.item(), 6), m["pg_clipfrac"]  # (-1.2 + 0.8) / 2; both tokens clipped
        (-0.2, 1.0)
    """
    if variant not in _VERL_LOSSES:
        raise ValueError(f"Unknown verl policy loss {variant!r}; choose one of {_VERL_LOSSES}")
    eps_lo = check_real(clip_ratio_low, "clip_ratio_low", minimum=0.0)
    eps_hi = check_real(clip_ratio_high, "clip_ratio_high", minimum=0.0)
    c = check_real(clip_ratio_c, "clip_ratio_c")
    if variant == "vanilla" and c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual-clip PPO), got {c}")
    m, cd = prepare(
        log_prob, response_mask, old_log_prob=old_log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights
    )
    lp = where(m, log_prob.to(cd))
    old = where(m, old_log_prob.detach().to(cd))
    adv = where(m, advantages.detach().to(cd))
    if variant == "gspo":
        per_token, metrics = _verl_gspo_terms(lp, old, adv, m, eps_lo, eps_hi)
    else:
        per_token, metrics = _verl_clipped_terms(variant, lp, old, adv, m, eps_lo, eps_hi, c)
    if rollout_is_weights is not None:
        per_token = per_token * where(m, rollout_is_weights.detach().to(cd))
    loss = aggregate_loss(where(m, per_token), m, loss_agg_mode, convention=convention)
    return loss.to(log_prob.dtype), {k: metrics[k] for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")}


def _verl_gspo_terms(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, eps_lo: float, eps_hi: float
) -> tuple[Tensor, dict[str, float]]:
    """verl 0.9.1 ``compute_policy_loss_gspo``'s per-token loss and metrics (see :func:`verl_policy_loss`)."""
    log_r = lp - old  # verl's negative_approx_kl: no ±20 bound here
    n = m.sum(-1).clamp(min=1).to(lp.dtype)
    seq = where(m, log_r).sum(-1) / n
    log_s = (lp - lp.detach() + seq.detach().unsqueeze(-1)).clamp(max=VERL_GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_s)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    metrics = {"pg_clipfrac": masked_mean((loss2 > loss1).detach(), m), "ppo_kl": masked_mean(-log_r.detach(), m),
               "pg_clipfrac_lower": 0.0}
    return torch.maximum(loss1, loss2), metrics


def _verl_clipped_terms(
    variant: str, lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, eps_lo: float, eps_hi: float, c: float
) -> tuple[Tensor, dict[str, float]]:
    """verl 0.9.1 ``compute_policy_loss_vanilla``/``_cispo``'s per-token loss and metrics."""
    log_r = (lp - old).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    ratio = torch.exp(log_r)
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    metrics = {"ppo_kl": masked_mean(-log_r.detach(), m)}
    if variant == "vanilla":
        loss1 = -adv * ratio
        loss2 = -adv * clipped
        clip_loss = torch.maximum(loss1, loss2)
        loss3 = -adv * c
        per_token = torch.where(adv < 0, torch.minimum(loss3, clip_loss), clip_loss)
        metrics["pg_clipfrac"] = masked_mean((loss2 > loss1).detach(), m)
        metrics["pg_clipfrac_lower"] = masked_mean(((clip_loss > loss3) & (adv < 0)).detach(), m)
    else:
        per_token = -clipped.detach() * adv * lp
        metrics["pg_clipfrac"] = masked_mean((ratio != clipped).detach(), m)
        metrics["pg_clipfrac_lower"] = 0.0
    return per_token, metrics


_VERL_KL = {
    "kl": ("k1", None),
    "k1": ("k1", None),
    "abs": ("abs", None),
    "mse": ("k2", None),
    "k2": ("k2", None),
    "low_var_kl": ("k3", 10.0),
    "k3": ("k3", 10.0),
}


def verl_kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's ``kl_penalty`` by its names: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``
    (k3 clamped to ±10), each also with a ``+`` suffix (straight-through: the value of the kind, the gradient
    of k2). Maps onto :func:`~grpo_cli.core.kl.kl_estimate`.

    Raises:
        ValueError: an unknown name (verl raises ``NotImplementedError``, also for ``full``).

    Example:
        >>> verl_kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "low_var_kl").item()  # clamped
        10.0
    """
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    if base not in _VERL_KL:
        raise ValueError(f"Unknown verl kl_penalty {kl_penalty!r}; choose one of {sorted(_VERL_KL)} (optionally +)")
    kind, clamp = _VERL_KL[base]
    return kl_estimate(logprob, ref_logprob, kind + ("+" if kl_penalty.endswith("+") else ""), clamp=clamp)




def verl_data_metrics(
    scores: Tensor, response_attention_mask: Tensor, max_response_length: int | None = None
) -> dict[str, float]:
    """verl's ``compute_data_metrics`` for the score and the response length.

    The response length is the sum of the *response attention mask* (``attention_mask[:, -T:]``), which counts
    observation/tool tokens inside a multi-turn response too (not the loss mask). A response of length 0 is
    *aborted*: ``critic/score/{mean,max,min}`` leave aborted rows out (NaN when all are), while
    ``response_length/{mean,max,min,clip_ratio}`` keep them; ``response_length_non_aborted/*`` leave them out;
    ``response/aborted_ratio`` is their fraction. ``clip_ratio`` is the fraction of lengths equal to
    ``max_response_length`` (default the mask width ``T``).

    Args:
        scores: ``[B]`` sequence scores (verl: ``token_level_scores.sum(-1)``).
        response_attention_mask: ``[B, T]`` attention mask of the response part.
        max_response_length: the response width (verl ``responses.shape[-1]``); default ``T``.

    Example:
        >>> verl_data_metrics(torch.tensor([1.0, 5.0]), torch.tensor([[1, 1], [0, 0]]))["critic/score/mean"]
        1.0
    """
    mask = as_bool_mask(response_attention_mask, "response_attention_mask")
    if mask.ndim != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(f"scores {tuple(scores.shape)} must be [B] for a [B, T] mask {tuple(mask.shape)}")
    width = mask.shape[-1] if max_response_length is None else max_response_length
    length = mask.sum(-1).to(F64)
    s = scores.detach().to(F64)
    alive = length > 0
    nan = float("nan")

    def _stats(x: Tensor) -> tuple[float, float, float]:
        return (float(x.mean()), float(x.max()), float(x.min())) if x.numel() else (nan, nan, nan)

    out: dict[str, float] = {}
    for name, x in (
        ("critic/score", s[alive]),
        ("response_length", length),
        ("response_length_non_aborted", length[alive]),
    ):
        out[f"{name}/mean"], out[f"{name}/max"], out[f"{name}/min"] = _stats(x)
    out["response_length/clip_ratio"] = float((length == width).to(F64).mean()) if length.numel() else nan
    alive_len = length[alive]
    out["response_length_non_aborted/clip_ratio"] = (
        float((alive_len == width).to(F64).mean()) if alive_len.numel() else nan
    )
    out["response/aborted_ratio"] = float((~alive).to(F64).mean()) if length.numel() else nan
    return out

"""The GRPO-family losses (GRPO, GSPO, SAPO, CISPO, BNPO, Dr.GRPO) as streaming terms.

One core function, :func:`grpo_family_loss_terms`, computes ``(numerator, denominator)`` for a batch of
packed tokens; the loss is ``Σ numerator / Σ denominator`` over any split of the data into batches of whole
sequences. The loss objects in :mod:`grpo_cli.core.loss_objects` call it after aligning twinkle-style inputs.
Conventions follow twinkle (twinkle's ``twinkle.loss`` classes) and TRL; see ``docs/losses.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_cli._choices import GRPO_VARIANTS
from grpo_cli.core._loss_common import (
    as_bool_mask,
    check_real,
    check_same_shape,
    compute_dtype,
    fill_outside,
    flat_layout,
    masked_sum64,
    seq_count,
    seq_ids,
    seq_sum64,
    sigmoid,
    validate_cu_seqlens,
)
from grpo_cli.core.conventions import check_convention
from grpo_cli.core.kl import kl_from_log_ratio
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_sum

__all__ = [
    "GRPO_CONVENTIONS",
    "GRPO_VARIANTS",
    "LOG_RATIO_CLAMP",
    "grpo_family_loss_terms",
    "grpo_family_per_token_loss",
    "grpo_family_valid_terms",
    "log_ratio_clamp",
]

# twinkle clamps the token log-ratio to ±20 before exp (and before the GSPO mean); TRL does not clamp.
LOG_RATIO_CLAMP = 20.0
GRPO_CONVENTIONS: tuple[str, ...] = ("trl", "twinkle")
"""``convention`` values of the GRPO-family functions. ``"trl"`` makes ``use_bias_correction_kl`` default to True
(TRL 1.16 ``GRPOConfig.use_bias_correction_kl``; twinkle and grpo-cli have no such correction) and drops the ±20
clamp of the log-ratio (TRL 1.16 ``GRPOTrainer._compute_loss`` takes ``exp`` of the raw log-ratio); ``None`` and
``"twinkle"`` clamp it (:data:`LOG_RATIO_CLAMP`)."""


def log_ratio_clamp(convention: str | None) -> float | None:
    """The bound of the log-ratio before ``exp`` under ``convention``: :data:`LOG_RATIO_CLAMP`, or ``None`` (no
    clamp) under ``"trl"``."""
    conv = check_convention(convention, GRPO_CONVENTIONS, "the GRPO-family loss")
    return None if conv == "trl" else LOG_RATIO_CLAMP


def _clamped(log_w: Tensor, bound: float | None) -> Tensor:
    return log_w if bound is None else log_w.clamp(-bound, bound)


def resolve_bias_correction_kl(use_bias_correction_kl: bool | None, convention: str | None) -> bool:
    """The effective ``use_bias_correction_kl``: the explicit value, else True only under ``convention="trl"``."""
    conv = check_convention(convention, GRPO_CONVENTIONS, "the GRPO-family loss")
    if use_bias_correction_kl is None:
        return conv == "trl"
    if not isinstance(use_bias_correction_kl, bool):
        raise TypeError(f"use_bias_correction_kl must be a bool or None, got {type(use_bias_correction_kl).__name__}")
    return use_bias_correction_kl


def _check_variant(variant: str) -> None:
    if variant not in GRPO_VARIANTS:
        raise ValueError(f"Unknown GRPO-family variant '{variant}'; choose one of {GRPO_VARIANTS}")


def grpo_family_per_token_loss(
    variant: str,
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cu_seqlens: Tensor | None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    beta: float = 0.0,
    tau_pos: float = 1.0,
    tau_neg: float | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    use_bias_correction_kl: bool | None = None,
    convention: str | None = None,
) -> Tensor:
    """Per-token loss ``L_tok`` (flat ``[N]``, working dtype, 0 off the mask) before aggregation.

    - log-ratio ``w = clamp(ℓ − ℓ_old, −20, 20)`` (``ℓ_old = sg(ℓ)`` when ``old_logp`` is None: ratio 1,
      gradient kept; ``convention="trl"``: not clamped, as TRL); GSPO replaces it by the sequence mean
      ``Σ_t w·m / max(1, n)`` on every token.
    - ``grpo``/``gspo``/``bnpo``/``dr_grpo``: ``−min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)``.
    - ``sapo``: ``−σ(τ(r − 1))·4/τ·A`` with ``τ = τ₊`` where ``A > 0`` else ``τ₋``.
    - ``cispo``: ``−sg(min(r, 1 + ε_high))·A·ℓ`` (upper cap only).
    - plus ``β·k3`` with ``k3 = exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1`` when ``β > 0`` and ``ref_logp`` is given,
      minus ``entropy_coef·H`` when ``entropy_coef > 0``.
    - with ``use_bias_correction_kl`` (TRL ``GRPOConfig.use_bias_correction_kl``, TRL's default True) the KL
      term is ``β·k3·r`` with the differentiable ratio ``r`` of the variant (the sequence ratio for GSPO), as
      TRL's ``_compute_loss`` does: the value differs whenever ``r ≠ 1`` and the gradient always
      (``∂(k3·r)/∂ℓ = r·(1 − e^{ℓ_ref−ℓ}) + k3·r``; on-policy ℓ = −1, ℓ_ref = −2: 1.0 instead of 0.632).
      ``None`` means True under ``convention="trl"`` and False otherwise (grpo-cli's and twinkle's loss).
    """
    _check_variant(variant)
    bias_kl = resolve_bias_correction_kl(use_bias_correction_kl, convention)
    eps_lo = check_real(clip_low, "clip_low", minimum=0.0)
    eps_hi = eps_lo if clip_high is None else check_real(clip_high, "clip_high", minimum=0.0)
    b = check_real(beta, "beta", minimum=0.0)
    tp = check_real(tau_pos, "tau_pos", minimum=0.0, strict=True)
    tn = tp if tau_neg is None else check_real(tau_neg, "tau_neg", minimum=0.0, strict=True)
    ec = check_real(entropy_coef, "entropy_coef", minimum=0.0)
    if not isinstance(logp, Tensor):
        raise TypeError(f"logp must be a torch.Tensor, got {type(logp).__name__}")
    m = as_bool_mask(mask, "mask")
    check_same_shape("logp", logp, mask=m, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, entropy=entropy)
    if ec > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs per-token entropies")
    cu = flat_layout(logp, cu_seqlens, need_segments=variant == "gspo", what=f"the '{variant}' loss")
    cd = compute_dtype(logp.dtype)
    mflat = m.reshape(-1)
    zero = torch.zeros((), dtype=cd, device=logp.device)

    def _flat(x: Tensor) -> Tensor:
        return fill_outside(mflat, x.reshape(-1).to(cd), zero)

    lp = _flat(logp)
    old = lp.detach() if old_logp is None else _flat(old_logp.detach())
    adv = _flat(advantages.detach())
    log_w = _clamped(fill_outside(mflat, lp - old, zero), log_ratio_clamp(convention))
    if variant == "gspo":
        # GSPO (arXiv 2507.18071; twinkle GSPOLoss): geometric-mean sequence ratio, gradient to every token.
        assert cu is not None
        n_s = seq_count(mflat, cu).clamp(min=1).to(torch.float64)
        log_w = (seq_sum64(log_w, mflat, cu) / n_s).to(cd)[seq_ids(cu, lp.numel())]
    ratio = torch.exp(log_w)

    per_token = _surrogate(variant, ratio, adv, lp, eps_lo, eps_hi, tp, tn)
    if b > 0 and ref_logp is not None:
        kl = _ref_k3(lp, _flat(ref_logp.detach()))
        per_token = per_token + b * (kl * ratio if bias_kl else kl)
    if ec > 0:
        assert entropy is not None
        per_token = per_token - ec * _flat(entropy)
    return fill_outside(mflat, per_token, zero)


def _surrogate(
    variant: str, ratio: Tensor, adv: Tensor, lp: Tensor, eps_lo: float, eps_hi: float, tp: float, tn: float
) -> Tensor:
    """The per-token policy term of ``variant`` (the formulas of :func:`grpo_family_per_token_loss`)."""
    if variant == "sapo":
        gate_pos = sigmoid(tp * (ratio - 1.0)) * (4.0 / tp)
        gate_neg = sigmoid(tn * (ratio - 1.0)) * (4.0 / tn)
        return -torch.where(adv > 0, gate_pos, gate_neg) * adv
    if variant == "cispo":
        return -torch.clamp(ratio, max=1.0 + eps_hi).detach() * adv * lp
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi) * adv)


def _ref_k3(lp: Tensor, ref: Tensor) -> Tensor:
    # k3 of KL(π_θ‖π_ref) from π_θ samples (twinkle/TRL): exp(ref − ℓ) − (ref − ℓ) − 1, unclamped.
    return kl_from_log_ratio(lp - ref, "k3")


def grpo_family_valid_terms(
    variants: Sequence[str],
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    cu_seqlens: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    beta: float = 0.0,
    tau_pos: float = 1.0,
    tau_neg: float | None = None,
    max_completion_length: int = 1024,
    use_bias_correction_kl: bool | None = None,
    convention: str | None = None,
) -> dict[str, tuple[Tensor, Tensor]]:
    """:func:`grpo_family_loss_terms` for several variants at once, over packed tokens that *all* enter the loss.

    The streaming pass calls this on a batch already compacted to its loss-mask tokens, where a mask would be all
    ones. Every ``torch.where`` against it is then the identity, and the log-ratio, the ratio, the clipped
    surrogate (the same for ``grpo``, ``bnpo`` and ``dr_grpo``), the token sum (``bnpo``, ``dr_grpo``) and the
    per-sequence counts are shared across variants instead of being rebuilt per variant. The operations that
    remain are those of :func:`grpo_family_loss_terms` in the same order, so each ``(numerator, denominator)`` is
    bitwise that function's with ``mask = ones`` (tested). Inputs are detached: this is for figures, not training.

    Returns:
        ``{variant: (numerator, denominator)}`` as float64 scalars, for ``variants`` in order.

    Example:
        >>> lp = torch.log(torch.tensor([1.5, 1.0, 0.5])); old = torch.zeros(3); cu = torch.tensor([0, 2, 3])
        >>> terms = grpo_family_valid_terms(["grpo", "bnpo"], lp, old, None, torch.tensor([1.0, 1.0, -1.0]), cu)
        >>> # per token -1.2, -1, 0.8; grpo: seq means -1.1 and 0.8 over 2 seqs; bnpo: the token sum over 3 tokens
        >>> [(round(n.item(), 6), d.item()) for n, d in terms.values()]
        [(-0.3, 2.0), (-1.4, 3.0)]
    """
    for variant in variants:
        _check_variant(variant)
    bias_kl = resolve_bias_correction_kl(use_bias_correction_kl, convention)
    eps_lo = check_real(clip_low, "clip_low", minimum=0.0)
    eps_hi = eps_lo if clip_high is None else check_real(clip_high, "clip_high", minimum=0.0)
    b = check_real(beta, "beta", minimum=0.0)
    tp = check_real(tau_pos, "tau_pos", minimum=0.0, strict=True)
    tn = tp if tau_neg is None else check_real(tau_neg, "tau_neg", minimum=0.0, strict=True)
    mcl = max_completion_length
    if isinstance(mcl, bool) or not isinstance(mcl, int) or mcl <= 0:
        raise ValueError(f"max_completion_length must be a positive int, got {mcl!r}")
    if logp.ndim != 1:
        raise ValueError(f"expected packed 1-D tokens, got shape {tuple(logp.shape)}")
    check_same_shape("logp", logp, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages)
    cu = validate_cu_seqlens(cu_seqlens.to(logp.device), logp.numel())
    cd = compute_dtype(logp.dtype)
    lp = logp.detach().to(cd)
    adv = advantages.detach().to(cd)
    log_w = _clamped(lp - old_logp.detach().to(cd), log_ratio_clamp(convention))
    kl = b * _ref_k3(lp, ref_logp.detach().to(cd)) if b > 0 and ref_logp is not None else None
    n_seq = torch.tensor(float(cu.numel() - 1), dtype=torch.float64, device=logp.device)
    n_tok = torch.tensor(float(lp.numel()), dtype=torch.float64, device=logp.device)  # Σ m with m all ones
    ids = seq_ids(cu, lp.numel())
    counts = lengths_from_cu_seqlens(cu)  # seq_count of an all-ones mask
    cache: dict[str, Tensor] = {}

    def per_token(variant: str) -> Tensor:
        shape = "clip" if variant in ("grpo", "bnpo", "dr_grpo") else variant  # one clipped surrogate for three
        if shape not in cache:
            if variant == "gspo":
                # GSPO's sequence-mean log-ratio on every token, as in grpo_family_per_token_loss.
                n_s = counts.clamp(min=1).to(torch.float64)
                w = segment_sum(log_w, cu, torch.float64)
                ratio = torch.exp((w / n_s).to(cd).index_select(0, ids))
            else:
                if "ratio" not in cache:
                    cache["ratio"] = torch.exp(log_w)
                ratio = cache["ratio"]
            value = _surrogate(variant, ratio, adv, lp, eps_lo, eps_hi, tp, tn)
            if kl is None:
                cache[shape] = value
            else:
                cache[shape] = value + (kl * ratio if bias_kl else kl)
        return cache[shape]

    out: dict[str, tuple[Tensor, Tensor]] = {}
    token_sums: dict[str, Tensor] = {}
    for variant in variants:
        values = per_token(variant)
        if variant in ("bnpo", "cispo", "dr_grpo"):
            key = "cispo" if variant == "cispo" else "clip"
            if key not in token_sums:
                token_sums[key] = values.to(torch.float64).sum()
            out[variant] = (token_sums[key], n_seq * mcl if variant == "dr_grpo" else n_tok)
        else:
            seq_sums = segment_sum(values, cu, torch.float64)  # seq_sum64 with an all-ones mask
            out[variant] = ((seq_sums / counts.clamp(min=1)).sum(), n_seq)
    return out


def grpo_family_loss_terms(
    variant: str,
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cu_seqlens: Tensor | None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    beta: float = 0.0,
    tau_pos: float = 1.0,
    tau_neg: float | None = None,
    max_completion_length: int = 1024,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    use_bias_correction_kl: bool | None = None,
    convention: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(numerator, denominator)`` (float64 scalars) of one GRPO-family loss over a batch.

    Inputs are packed ``[N]`` tokens with ``cu_seqlens`` ``[S + 1]`` (one segment per sequence) or padded
    ``[S, T]`` rows; ``advantages`` is per token. The per-token loss is
    :func:`grpo_family_per_token_loss`; the aggregation (``n_s`` = valid tokens of sequence ``s``):

    - ``grpo``, ``gspo``, ``sapo``: numerator ``Σ_s Σ_t L·m / max(1, n_s)``, denominator ``S`` (every
      sequence counts, also one without valid tokens: twinkle/TRL's per-sequence mean then batch mean).
    - ``bnpo``, ``cispo``: ``Σ L·m`` over the token count ``Σ m`` (token mean).
    - ``dr_grpo``: ``Σ L·m`` over ``S·max_completion_length`` (Dr. GRPO, arXiv 2503.20783).

    Both terms add up over disjoint batches of whole sequences, so streaming and merging is exact. The
    numerator back-propagates into ``logp``; ``old_logp``, ``ref_logp`` and ``advantages`` are detached.

    Raises:
        ValueError: an unknown variant, bad shapes, mask or hyper-parameters, packed input without
            ``cu_seqlens`` (needed to count sequences: all variants except ``bnpo`` and ``cispo``).

    Example:
        >>> lp = torch.log(torch.tensor([1.5, 1.0, 0.5])); old = torch.zeros(3)
        >>> num, den = grpo_family_loss_terms("grpo", lp, old, None, torch.tensor([1.0, 1.0, -1.0]),
        ...                                   torch.ones(3, dtype=torch.bool), torch.tensor([0, 2, 3]))
        >>> round(num.item(), 6), den.item()  # seq 0: (-1.2 - 1) / 2, seq 1: 0.8
        (-0.3, 2.0)
    """
    _check_variant(variant)
    mcl = max_completion_length
    if isinstance(mcl, bool) or not isinstance(mcl, int) or mcl <= 0:
        raise ValueError(f"max_completion_length must be a positive int, got {mcl!r}")
    per_token = grpo_family_per_token_loss(
        variant,
        logp,
        old_logp,
        ref_logp,
        advantages,
        mask,
        cu_seqlens,
        clip_low=clip_low,
        clip_high=clip_high,
        beta=beta,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        entropy=entropy,
        entropy_coef=entropy_coef,
        use_bias_correction_kl=use_bias_correction_kl,
        convention=convention,
    )
    mflat = as_bool_mask(mask, "mask").reshape(-1)
    if variant in ("bnpo", "cispo"):
        return masked_sum64(per_token, mflat), mflat.sum().to(torch.float64)
    cu = flat_layout(logp, cu_seqlens, need_segments=True, what=f"the '{variant}' loss (it counts sequences)")
    assert cu is not None
    n_seq = torch.tensor(float(cu.numel() - 1), dtype=torch.float64, device=logp.device)
    if variant == "dr_grpo":
        return masked_sum64(per_token, mflat), n_seq * mcl
    counts = seq_count(mflat, cu).clamp(min=1)
    return (seq_sum64(per_token, mflat, cu) / counts).sum(), n_seq

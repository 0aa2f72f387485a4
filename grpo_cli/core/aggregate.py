"""Loss aggregation modes (verl ``agg_loss`` in ``verl/trainer/ppo/core_algos.py``), as numerator/denominator terms.

Every mode is a ratio ``numerator / denominator`` whose terms add up over disjoint sets of whole sequences,
so a dump can be streamed in batches and merged exactly (pass the global ``num_tokens``/``num_sequences``/
``loss_scale_factor`` or sum the terms yourself).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.core._loss_common import (
    as_bool_mask,
    check_real,
    check_same_shape,
    flat_layout,
    masked_sum64,
    safe_ratio,
    seq_count,
    seq_sum64,
)
from grpo_cli.core.conventions import check_convention
from grpo_cli.core.packing import lengths_from_cu_seqlens

__all__ = ["AGG_CONVENTIONS", "AGG_MODES", "aggregate_loss", "aggregate_loss_terms"]

AGG_CONVENTIONS: tuple[str, ...] = ("verl", "verl<=0.6")
"""``convention`` values of :func:`aggregate_loss`: verl's current ``agg_loss`` (0.7 and later divide
``seq-mean-token-sum-norm`` by the sequence count too) and verl up to 0.6 (no division by it)."""

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate_loss_terms(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    cu_seqlens: Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    loss_scale_factor: float | None = None,
    convention: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(numerator, denominator)`` (float64 scalars) of :func:`aggregate_loss`; see there for the modes.

    Under ``convention="verl"`` the ``seq-mean-token-sum-norm`` denominator is ``B·loss_scale_factor``, a
    product: streamed batches add their numerators and ``B`` (pass the global ``num_sequences``), not the
    denominators.
    """
    conv = check_convention(convention, AGG_CONVENTIONS, "aggregate_loss")
    if mode not in AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {mode!r}; choose one of {AGG_MODES}")
    m = as_bool_mask(mask, "mask")
    check_same_shape("per_token", per_token, mask=m)
    need_segments = mode != "token-mean"
    cu = flat_layout(per_token, cu_seqlens, need_segments=need_segments, what=f"aggregation mode '{mode}'")
    flat, mflat = per_token.reshape(-1), m.reshape(-1)
    device = per_token.device

    def _given(value: float | None, name: str) -> Tensor | None:
        if value is None:
            return None
        return torch.tensor(check_real(value, name, minimum=0.0), dtype=torch.float64, device=device)

    if mode == "token-mean":
        # verl: Σ(L·m) / N_tok, N_tok = the global token count when given, else the local Σm.
        den = _given(num_tokens, "num_tokens")
        if den is None:
            den = mflat.sum().to(torch.float64)
        return masked_sum64(flat, mflat), den
    assert cu is not None
    counts = seq_count(mflat, cu)
    sums = seq_sum64(flat, mflat, cu)
    non_empty = counts > 0
    n_seq = _given(num_sequences, "num_sequences")
    n_non_empty = non_empty.sum().to(torch.float64)
    if mode == "seq-mean-token-mean":
        # verl: per-sequence masked mean, averaged over sequences with ≥1 valid token. verl divides by
        # (Σm + 1e-8) as a 0/0 guard; we leave empty sequences out instead, which is exact.
        means = torch.where(non_empty, sums / counts.clamp(min=1), torch.zeros_like(sums))
        return means.sum(), n_non_empty if n_seq is None else n_seq
    if mode == "seq-mean-token-sum":
        # verl: per-sequence token sum, averaged over sequences with ≥1 valid token.
        return sums.sum(), n_non_empty if n_seq is None else n_seq
    # seq-mean-token-sum-norm (Dr. GRPO-like): Σ_i S_i / loss_scale_factor; verl's default factor is the
    # padded width T = mask.shape[-1]; for packed input the equivalent is the longest sequence. verl's agg_loss
    # (verl/trainer/ppo/core_algos.py) from 0.7 on shares the seq-mean-token-sum branch and then divides by the
    # factor, so its value is Σ_i S_i / B / T; up to 0.6 it was Σ_i S_i / T (grpo-cli's default).
    scale = _given(loss_scale_factor, "loss_scale_factor")
    if scale is None:
        if per_token.ndim == 2:
            width = per_token.shape[-1]
        else:
            lengths = lengths_from_cu_seqlens(cu)
            width = int(lengths.max()) if lengths.numel() else 0
        scale = torch.tensor(float(width), dtype=torch.float64, device=device)
    if conv == "verl":
        return sums.sum(), scale * (n_non_empty if n_seq is None else n_seq)
    return sums.sum(), scale


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    cu_seqlens: Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    loss_scale_factor: float | None = None,
    convention: str | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar with one of verl's ``loss_agg_mode`` definitions.

    With ``S_i = Σ_t L_it·m_it`` and ``n_i = Σ_t m_it``:

    - ``token-mean``: ``Σ_i S_i / N_tok`` with ``N_tok = num_tokens`` or the local ``Σ n_i``
      (TRL ``bnpo``/``dapo``, AReaL's loss, twinkle ``BNPOLoss``).
    - ``seq-mean-token-mean``: ``Σ_{i: n_i>0} (S_i / n_i) / B`` with ``B = num_sequences`` or the number of
      sequences with ``n_i > 0`` (TRL/twinkle ``grpo`` count empty rows in B; verl does not).
    - ``seq-mean-token-sum``: ``Σ_i S_i / B`` (same ``B``).
    - ``seq-mean-token-sum-norm``: ``Σ_i S_i / loss_scale_factor`` (default the padded width ``T``; for
      packed input the longest sequence). No division by B (verl up to 0.6). With ``convention="verl"``
      (verl 0.7 and later, the current release): ``Σ_i S_i / (B·loss_scale_factor)`` with the ``B`` above
      (TRL ``dr_grpo`` divides by ``B·max_completion_length`` and counts empty rows in B).

    ``convention`` (see :mod:`grpo_cli.core.conventions`): ``None`` (grpo-cli, = ``"verl<=0.6"``), ``"verl"``
    or ``"verl<=0.6"``; it only changes ``seq-mean-token-sum-norm``.

    A zero denominator gives 0. verl's ``dp_size`` factor is left out (one process). Masked entries are
    neutralised with ``torch.where``; sums are accumulated in float64 and the result takes ``per_token``'s
    dtype. Padded ``[B, T]`` rows or packed ``[N]`` + ``cu_seqlens`` (needed by the ``seq-*`` modes).

    Raises:
        ValueError: an unknown ``mode`` (verl raises ``ValueError`` too) or ``convention``, mismatched shapes,
            a bad mask, packed input without ``cu_seqlens`` for a ``seq-*`` mode, negative overrides.

    Example:
        >>> L = torch.tensor([[1.0, 3.0], [2.0, 0.0]]); m = torch.tensor([[1, 1], [1, 0]])
        >>> [aggregate_loss(L, m, k).item() for k in AGG_MODES]
        [2.0, 2.0, 3.0, 3.0]
        >>> aggregate_loss(L, m, "seq-mean-token-sum-norm", convention="verl").item()  # (4 + 2) / 2 / 2
        1.5
    """
    num, den = aggregate_loss_terms(
        per_token,
        mask,
        mode,
        cu_seqlens=cu_seqlens,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        loss_scale_factor=loss_scale_factor,
        convention=convention,
    )
    return safe_ratio(num, den).to(per_token.dtype if per_token.is_floating_point() else torch.float64)

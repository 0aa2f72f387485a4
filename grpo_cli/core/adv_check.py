"""Streaming pieces of the advantage check (``grpo-cli advantages``): batch-level token statistics and the diff.

Group and batch statistics need every sequence of a group or training batch, but a dump is streamed in batches of
whole sequences that may split a group or a training step anywhere. The per-sequence estimators only need one scalar
per sequence (the caller collects those, O(n_sequences)); the per-token statistics below are accumulated over
streamed batches instead and applied in a later pass, so no per-token tensor of the whole dump is ever held:

* :class:`StreamingNormalization` — AReaL's ``Normalization`` (:func:`~grpo_cli.core.advantages.normalize`) of
  token values (``adv_norm``) with batch or group levels, leave-one-out means and (un)biased std;
* :class:`StreamingWhiten` — verl's ``masked_whiten`` (:func:`~grpo_cli.core.advantages.masked_whiten`) per
  training batch (REINFORCE++);
* :func:`adv_diff_state` / :func:`adv_diff_update` / :func:`adv_diff_compute` — recomputed vs dumped advantages:
  the largest and mean absolute difference, mismatching tokens and sequences, and the worst sequences.

Sequences are addressed by a global index ``0 … n_sequences − 1`` (their order in the stream); ``batch_index`` and
``group_index`` map each one to its training batch (e.g. its ``step``) and its group (``(step, group_id)``).
Statistics are float64 sums, exact up to summation order, so results do not depend on how the dump is batched.
Pure torch, no I/O; every tensor is created on the input's device.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor

from grpo_cli.core.advantages import NormConfig
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_ids, segment_max, segment_min
from grpo_cli.core.state import MetricState, count, maximum, top_rows, total

__all__ = [
    "WORST_FIELDS",
    "StreamingNormalization",
    "StreamingWhiten",
    "adv_diff_compute",
    "adv_diff_state",
    "adv_diff_update",
    "adv_mismatch",
]

_F64 = torch.float64


def _token_segments(per_sequence: Tensor, seq_index: Tensor, cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """The segment of every token: ``per_sequence[seq_index[b]]`` for each token of batch sequence ``b``."""
    seq = segment_ids(cu_seqlens.to(per_sequence.device), n_tokens)
    return per_sequence[seq_index.to(per_sequence.device)][seq]


class _SegmentMoments:
    """Float64 per-segment valid-token counts, sums and (second pass) sums of squared deviations."""

    def __init__(self, n_segments: int, device: torch.device) -> None:
        self.count = torch.zeros(n_segments, dtype=_F64, device=device)
        self.sum = torch.zeros(n_segments, dtype=_F64, device=device)
        self.sum_sq = torch.zeros(n_segments, dtype=_F64, device=device)

    def add(self, target: Tensor, values: Tensor, mask: Tensor, segment: Tensor) -> None:
        target.index_add_(0, segment, torch.where(mask, values, 0.0))


class StreamingNormalization:
    """AReaL's ``Normalization`` of token values streamed in batches of whole sequences.

    The same rules as :func:`~grpo_cli.core.advantages.normalize` (``docs/advantages.md``), with the batch level
    meaning *one training batch* (``batch_index``) instead of "the tensor passed in", and groups given per sequence:

    * mean — batch/group: ``S/N`` over the segment's valid tokens (0 when ``N = 0``); ``None``: 0; leave-one-out:
      ``(S − x_i)/(N − 1)`` for a valid token (0 when ``N ≤ 1``), and a group of one sequence is its own mean;
    * std around each token's own mean — unbiased ``sqrt(Σ(x − mean_i)²/(N − 1))`` (1 when ``N ≤ 1`` or for a group
      of one sequence), biased ``/N`` (1 when ``N = 0``), ``None``: 1 and eps 0;
    * output ``(x − mean_i)/(std + eps)`` on valid tokens, 0 elsewhere.

    Usage: one pass of :meth:`update_mean` over every batch (if :attr:`needs_mean_pass`), one pass of
    :meth:`update_std` (if :attr:`needs_std_pass`), then :meth:`apply` per batch. Because ``Σ(x − mean_i)²`` is
    summed around the final means in a pass of its own, no ``Σx² − (Σx)²/N`` cancellation occurs.

    Args:
        config: the :class:`~grpo_cli.core.advantages.NormConfig`.
        batch_index: ``[S]`` int64 training batch of every sequence (dense, ``0 … n_batches − 1``).
        group_index: ``[S]`` int64 group of every sequence (dense), or None when no level is ``"group"``.

    Example (one batch, one group of two sequences, mean and std over the batch, eps 0):
        >>> norm = StreamingNormalization(NormConfig(eps=0.0), torch.tensor([0, 0]))
        >>> x, m, cu = torch.tensor([1.0, 3.0, 5.0]), torch.tensor([True, True, True]), torch.tensor([0, 2, 3])
        >>> norm.update_mean(x, m, torch.tensor([0, 1]), cu); norm.update_std(x, m, torch.tensor([0, 1]), cu)
        >>> norm.apply(x, m, torch.tensor([0, 1]), cu).tolist()
        [-1.0, 0.0, 1.0]
    """

    def __init__(self, config: NormConfig, batch_index: Tensor, group_index: Tensor | None = None) -> None:
        if not isinstance(config, NormConfig):
            raise TypeError(f"config must be a NormConfig, got {type(config).__name__}")
        self.config = config
        device = batch_index.device
        self._index = {"batch": batch_index.to(torch.int64)}
        self._single: Tensor | None = None
        if "group" in (config.mean_level, config.std_level):
            if group_index is None:
                raise ValueError("group_index is required for a 'group' level")
            group_index = group_index.to(device=device, dtype=torch.int64)
            self._index["group"] = group_index
            rows = torch.bincount(group_index, minlength=int(group_index.max()) + 1 if group_index.numel() else 0)
            self._single = rows == 1  # per group: a one-sequence group (AReaL's special cases)
        sizes = {name: (int(idx.max()) + 1 if idx.numel() else 0) for name, idx in self._index.items()}
        self._mean = _SegmentMoments(sizes[config.mean_level], device) if config.mean_level else None
        self._std = _SegmentMoments(sizes[config.std_level], device) if config.std_level else None

    @property
    def needs_mean_pass(self) -> bool:
        return self._mean is not None

    @property
    def needs_std_pass(self) -> bool:
        return self._std is not None

    def _segments(self, level: str, seq_index: Tensor, cu_seqlens: Tensor, n_tokens: int) -> Tensor:
        return _token_segments(self._index[level], seq_index, cu_seqlens, n_tokens)

    def update_mean(self, x: Tensor, mask: Tensor, seq_index: Tensor, cu_seqlens: Tensor) -> None:
        """Pass 1: fold the valid tokens of one batch into the mean segments' counts and sums."""
        if self._mean is None:
            return
        seg = self._segments(cast(str, self.config.mean_level), seq_index, cu_seqlens, x.numel())  # set: _mean is
        self._mean.add(self._mean.count, torch.ones_like(x, dtype=_F64), mask, seg)
        self._mean.add(self._mean.sum, x.to(_F64), mask, seg)

    def _token_mean(self, x64: Tensor, mask: Tensor, seq_index: Tensor, cu_seqlens: Tensor) -> Tensor:
        level = self.config.mean_level
        if self._mean is None or level is None:
            return torch.zeros_like(x64)
        seg = self._segments(level, seq_index, cu_seqlens, x64.numel())
        s, n = self._mean.sum[seg], self._mean.count[seg]
        if not self.config.mean_leave1out:
            return torch.where(n > 0, s / n.clamp(min=1.0), 0.0)
        x_valid = torch.where(mask, x64, 0.0)
        # AReaL: (S − x_i·m_i)/clamp(N − m_i, 1) where N > 1, else 0; masked tokens get S/N.
        others = torch.where(mask, (s - x_valid) / (n - 1).clamp(min=1.0), s / n.clamp(min=1.0))
        mean = torch.where(n > 1, others, 0.0)
        if level == "group" and self._single is not None:  # a one-sequence group is its own baseline
            mean = torch.where(self._single[seg], x_valid, mean)
        return mean

    def update_std(self, x: Tensor, mask: Tensor, seq_index: Tensor, cu_seqlens: Tensor) -> None:
        """Pass 2 (after every :meth:`update_mean`): fold ``Σ(x − mean_i)²`` and counts into the std segments."""
        if self._std is None:
            return
        x64 = x.to(_F64)
        centered = torch.where(mask, x64 - self._token_mean(x64, mask, seq_index, cu_seqlens), 0.0)
        seg = self._segments(cast(str, self.config.std_level), seq_index, cu_seqlens, x.numel())  # set: _std is
        self._std.add(self._std.count, torch.ones_like(x64), mask, seg)
        self._std.add(self._std.sum_sq, centered.square(), mask, seg)

    def apply(self, x: Tensor, mask: Tensor, seq_index: Tensor, cu_seqlens: Tensor) -> Tensor:
        """The normalised values of one batch (float64; 0 at masked positions)."""
        x64 = x.to(_F64)
        centered = torch.where(mask, x64 - self._token_mean(x64, mask, seq_index, cu_seqlens), 0.0)
        level = self.config.std_level
        if self._std is None or level is None:
            return centered  # std 1 and eps 0
        seg = self._segments(level, seq_index, cu_seqlens, x.numel())
        sum_sq, n = self._std.sum_sq[seg], self._std.count[seg]
        if self.config.std_unbiased:
            std = torch.where(n > 1, torch.sqrt(sum_sq / (n - 1).clamp(min=1.0)), 1.0)
            if level == "group" and self._single is not None:  # AReaL: a one-row group gets std 1
                std = torch.where(self._single[seg], 1.0, std)
        else:
            std = torch.where(n > 0, torch.sqrt(sum_sq / n.clamp(min=1.0)), 1.0)
        return torch.where(mask, centered / (std + self.config.eps), 0.0)


class StreamingWhiten:
    """verl's ``masked_whiten`` per training batch, on token values streamed in batches of whole sequences.

    ``(x − μ_b)·rsqrt(σ²_b + eps)`` with μ_b and the (Bessel-corrected when ``unbiased``) variance over the valid
    tokens of training batch ``b``, 0 at masked positions; a batch with ≤ 1 valid token has variance 0 — the rules
    of :func:`~grpo_cli.core.advantages.masked_whiten`. Two passes (:meth:`update_mean`, :meth:`update_var`), then
    :meth:`apply`.

    Example:
        >>> w = StreamingWhiten(torch.tensor([0]), eps=0.0)
        >>> x, m, cu, idx = torch.tensor([1.0, 3.0, 99.0]), torch.tensor([True, True, False]), torch.tensor([0, 3]), \
torch.tensor([0])
        >>> w.update_mean(x, m, idx, cu); w.update_var(x, m, idx, cu); w.apply(x, m, idx, cu).tolist()
        [-0.7071067811865475, 0.7071067811865475, 0.0]
    """

    def __init__(self, batch_index: Tensor, *, eps: float = 1e-8, unbiased: bool = True) -> None:
        if not isinstance(unbiased, bool):
            raise TypeError(f"unbiased must be a bool, got {type(unbiased).__name__}")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        self.batch_index = batch_index.to(torch.int64)
        self.eps, self.unbiased = float(eps), unbiased
        n = int(self.batch_index.max()) + 1 if self.batch_index.numel() else 0
        self._moments = _SegmentMoments(n, batch_index.device)

    def _seg(self, seq_index: Tensor, cu_seqlens: Tensor, n_tokens: int) -> Tensor:
        return _token_segments(self.batch_index, seq_index, cu_seqlens, n_tokens)

    def _mean(self, seg: Tensor) -> Tensor:
        return self._moments.sum[seg] / self._moments.count[seg].clamp(min=1.0)

    def update_mean(self, x: Tensor, mask: Tensor, seq_index: Tensor, cu_seqlens: Tensor) -> None:
        seg = self._seg(seq_index, cu_seqlens, x.numel())
        self._moments.add(self._moments.count, torch.ones_like(x, dtype=_F64), mask, seg)
        self._moments.add(self._moments.sum, x.to(_F64), mask, seg)

    def update_var(self, x: Tensor, mask: Tensor, seq_index: Tensor, cu_seqlens: Tensor) -> None:
        seg = self._seg(seq_index, cu_seqlens, x.numel())
        self._moments.add(self._moments.sum_sq, (x.to(_F64) - self._mean(seg)).square(), mask, seg)

    def apply(self, x: Tensor, mask: Tensor, seq_index: Tensor, cu_seqlens: Tensor) -> Tensor:
        """Whitened values of one batch (float64; 0 at masked positions)."""
        seg = self._seg(seq_index, cu_seqlens, x.numel())
        n = self._moments.count[seg]
        var = self._moments.sum_sq[seg] / ((n - 1) if self.unbiased else n).clamp(min=1.0)
        return torch.where(mask, (x.to(_F64) - self._mean(seg)) * torch.rsqrt(var + self.eps), 0.0)


# ----------------------------------------------------------------------------------------------------
# recomputed vs dumped
# ----------------------------------------------------------------------------------------------------

WORST_FIELDS = ("max_abs_diff", "file", "row", "position", "expected", "dumped", "group_id", "step")
"""Columns of the worst-sequences table: the sequence's largest |expected − dumped| ranks (non-finite = inf), then
its location (file index, row, token position of that difference), the two values there, and its group and step
(NaN when the dump has none)."""


def adv_diff_state(top_k: int = 10, device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`adv_diff_update` (counts int64, sums float64, the worst ``top_k`` sequences)."""
    specs = {
        "n_sequences": count(),
        "n_sequences_compared": count(),
        "n_sequences_mismatch": count(),
        "n_tokens": count(),
        "n_tokens_mismatch": count(),
        "n_masked_tokens": count(),
        "n_masked_mismatch": count(),
        "n_nonfinite": count(),
        "sum_abs_diff": total(),
        "max_abs_diff": maximum(),
    }
    if top_k > 0:
        specs["worst"] = top_rows(top_k, len(WORST_FIELDS))
    return MetricState(specs, device)


def adv_mismatch(
    expected: Tensor, dumped: Tensor, compare: Tensor, atol: float, rtol: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Where recomputed advantages disagree with the dump: ``(|expected − dumped|`` in float64, where it is finite,
    the compared tokens that mismatch)``; a token mismatches when the difference exceeds ``atol + rtol·|expected|``
    or is not finite. Broadcasting: :func:`adv_diff_update` compares ``[N]`` tokens, the variant search of
    ``grpo-cli advantages`` ``[V, N]`` variants at once.

    Example:
        >>> adv_mismatch(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]), torch.tensor([True, True]), 0.1, 0.0)[2]
        tensor([False,  True])
    """
    exp64 = expected.to(_F64)
    diff = (exp64 - dumped.to(device=exp64.device, dtype=_F64)).abs()
    finite = torch.isfinite(diff)
    return diff, finite, compare & ((~finite) | (diff > atol + rtol * exp64.abs()))


def adv_diff_update(
    state: MetricState,
    *,
    expected: Tensor,
    dumped: Tensor,
    compare: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    sequence_keys: Tensor,
    group_id: Tensor | None = None,
    step: Tensor | None = None,
    atol: float = 1e-5,
    rtol: float = 0.0,
) -> None:
    """Fold one batch's comparison into ``state``.

    A compared token mismatches when ``|expected − dumped| > atol + rtol·|expected|`` or the difference is not
    finite (NaN/inf in either); a sequence mismatches when any of its compared tokens does.

    Args:
        state: from :func:`adv_diff_state`.
        expected: ``[N]`` recomputed advantages (float64 preferred).
        dumped: ``[N]`` the dump's advantages.
        compare: ``[N]`` bool, the tokens to compare.
        loss_mask: ``[N]`` bool, to count mismatches at masked positions separately.
        cu_seqlens: ``[B + 1]`` offsets.
        sequence_keys: ``[B, 2]`` int64 (file, row) per sequence.
        group_id, step: ``[B]`` ints for the worst-sequences table, or None.
        atol, rtol: tolerances (≥ 0).
    """
    if not (atol >= 0 and rtol >= 0):
        raise ValueError(f"atol and rtol must be >= 0, got {atol}, {rtol}")
    device = expected.device
    exp64, dump64 = expected.to(_F64), dumped.to(device=device, dtype=_F64)
    diff, finite, bad = adv_mismatch(exp64, dump64, compare, atol, rtol)
    # A NaN/inf on either side is a mismatch of unbounded size: rank it as +inf.
    absd = torch.where(compare, torch.where(finite, diff, math.inf), -math.inf)
    n_seq = cu_seqlens.numel() - 1
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    seq = segment_ids(cu_seqlens, expected.numel())
    bad_seq = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, bad.to(torch.int64)) > 0
    compared_seq = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, compare.to(torch.int64))
    masked = compare & ~loss_mask
    state.update(
        n_sequences=torch.tensor(n_seq),
        n_sequences_compared=(compared_seq > 0).sum(),
        n_sequences_mismatch=bad_seq.sum(),
        n_tokens=compare.sum(),
        n_tokens_mismatch=bad.sum(),
        n_masked_tokens=masked.sum(),
        n_masked_mismatch=(bad & ~loss_mask).sum(),
        n_nonfinite=(compare & ~finite).sum(),
        sum_abs_diff=torch.where(compare & finite, diff, 0.0).sum(),
        max_abs_diff=absd.max() if absd.numel() else torch.tensor(-math.inf),
    )
    if "worst" not in state or not bool(bad_seq.any()):
        return
    seq_max = segment_max(absd, cu_seqlens)
    # The first position holding the sequence's largest difference (a batching-independent choice).
    position = torch.arange(expected.numel(), device=device) - cu_seqlens[:-1].to(device)[seq]
    at_max = compare & (absd == seq_max[seq])
    first_all = segment_min(torch.where(at_max, position.to(_F64), math.inf), cu_seqlens)
    chosen = bad_seq & (lengths > 0)
    first = first_all[chosen]  # finite: a mismatching sequence has a compared token
    token = cu_seqlens[:-1].to(device)[chosen] + first.to(torch.int64)
    nan = torch.full((int(chosen.sum()),), math.nan, dtype=_F64, device=device)
    keys = sequence_keys.to(device)[chosen]
    rows = torch.stack(
        [
            seq_max[chosen],
            keys[:, 0].to(_F64),
            keys[:, 1].to(_F64),
            first,
            exp64[token],
            dump64[token],
            nan if group_id is None else group_id.to(device)[chosen].to(_F64),
            nan if step is None else step.to(device)[chosen].to(_F64),
        ],
        dim=1,
    )
    state.update(worst=rows)


def adv_diff_compute(state: MetricState) -> dict[str, Any]:
    """Figures under the ``adv_check/`` keys (``docs/metrics.md``); the worst sequences as ``adv_check/worst``."""
    s = state
    n_tokens = int(s["n_tokens"])
    out: dict[str, Any] = {
        "adv_check/n_sequences": int(s["n_sequences"]),
        "adv_check/n_sequences_compared": int(s["n_sequences_compared"]),
        "adv_check/n_sequences_mismatch": int(s["n_sequences_mismatch"]),
        "adv_check/n_tokens_compared": n_tokens,
        "adv_check/n_tokens_mismatch": int(s["n_tokens_mismatch"]),
        "adv_check/n_masked_tokens_compared": int(s["n_masked_tokens"]),
        "adv_check/n_masked_tokens_mismatch": int(s["n_masked_mismatch"]),
        "adv_check/n_nonfinite": int(s["n_nonfinite"]),
    }
    if n_tokens > 0:
        n_finite = n_tokens - int(s["n_nonfinite"])
        out["adv_check/max_abs_diff"] = float(s["max_abs_diff"])
        if n_finite > 0:
            out["adv_check/mean_abs_diff"] = float(s["sum_abs_diff"]) / n_finite
    if "worst" in s:
        records = []
        for row in s["worst"].cpu().tolist():
            if row[0] == -math.inf:
                continue
            record: dict[str, Any] = dict(zip(WORST_FIELDS, row))
            for key in ("file", "row", "position", "group_id", "step"):
                value = record[key]
                record[key] = None if math.isnan(value) else int(value)
            records.append(record)
        out["adv_check/worst"] = records
    return out

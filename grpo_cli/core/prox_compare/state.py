"""The mergeable state of ``compare-prox`` and how a batch folds into it: :func:`prox_compare_state`,
:func:`prox_compare_fold` (a prepared batch) and :func:`prox_compare_update` (prepare, then fold)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from grpo_cli.core.histogram import N_BINS, ZERO, histogram_counts
from grpo_cli.core.ppo import ppo_actor_loss_terms
from grpo_cli.core.prox import PROX_ERROR_KEYS, prox_approximation_errors
from grpo_cli.core.prox_compare._common import DEFAULT_MAX_LAG, bin_counts, check_methods, masked_max, state_methods
from grpo_cli.core.prox_compare.prepare import ProxCompareBatch, prox_compare_prepare, rejection_changes
from grpo_cli.core.rejection import RejectionSamplingConfig
from grpo_cli.core.staleness import lag_bin_sums
from grpo_cli.core.state import MetricState, count, maximum, total

__all__ = ["prox_compare_fold", "prox_compare_state", "prox_compare_update"]


def prox_compare_state(
    methods: Iterable[str] | None = None,
    *,
    max_lag: int = DEFAULT_MAX_LAG,
    device: torch.device | str | None = None,
) -> MetricState:
    """An empty state for :func:`prox_compare_update` (counts int64, sums float64).

    Args:
        methods: approximation methods to compare (default all of
            :data:`~grpo_cli.core.prox.PROX_APPROX_METHODS`).
        max_lag: lags 0..``max_lag`` − 1 get a ``by_staleness`` row each (>= 1).
        device: where the state lives (the batches' device).
    """
    names = check_methods(methods)
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 1:
        raise ValueError(f"max_lag must be an int >= 1, got {max_lag!r}")
    n_lag = max_lag + 2  # lags 0..max_lag − 1 | ≥ max_lag (overflow) | < 0 (negative)
    specs = {
        "n_tokens": count(),  # compared tokens: loss_mask ∧ versions ≥ 0
        "n_valid": count(),  # N0: loss-mask tokens (the loss denominator)
        "n_clip_tokens": count(),  # compared tokens whose clip decision was evaluated (advantages present)
        "n_rs_tokens": count(),  # compared tokens whose rejection outcome was evaluated
        "n_loss": count(),  # N0 of the batches whose loss was evaluated
        "loss_truth": total(),
        "lag_max": maximum(),
        "lag/n": count((n_lag,)),
        "lag/n_clip": count((n_lag,)),
    }
    for m in names:
        specs.update({f"{m}/{key}": total() for key in PROX_ERROR_KEYS})
        specs.update(
            {
                f"{m}/abs_error_max": maximum(),
                f"{m}/abs_error_hist": count((N_BINS,)),
                f"{m}/clip_flips": count(),
                f"{m}/behave_flips": count(),
                f"{m}/loss": total(),
                f"{m}/lag/abs_error": total((n_lag,)),
                f"{m}/lag/squared_error": total((n_lag,)),
                f"{m}/lag/clip_flips": count((n_lag,)),
            }
        )
    return MetricState(specs, device)


def _bin_sums(bins: Tensor, values: Tensor, present: list[int], n_bins: int) -> Tensor:
    """Float64 Σ ``values`` per bin (``values`` already 0 outside the compared tokens, ``present``: the bins with
    compared tokens), with :func:`grpo_cli.core.staleness.lag_bin_sums` (segmented sums over runs of equal lag, no
    atomics); a 0 outside the mask adds nothing to its run."""
    return lag_bin_sums(bins, present, [values], n_bins)[0]


def _without_zeros(counts: Tensor, n_zeros: Tensor | int) -> Tensor:
    counts = counts.clone()
    counts[ZERO] -= n_zeros
    return counts


def prox_compare_fold(state: MetricState, batch: ProxCompareBatch) -> None:
    """Fold a prepared batch into ``state``: the shared counts and the figures of the state's methods."""
    methods = state_methods(state)
    n_lag = state["lag/n"].shape[0]
    if batch.lag_counts.shape[0] != n_lag:
        prepared = batch.lag_counts.shape[0] - 2
        raise ValueError(f"the batch was prepared with max_lag {prepared}, the state has {n_lag - 2}")
    compared, lag_bin, present, n_compared = batch.compared, batch.lag_bin, batch.present, batch.n_compared
    new, old, truth, valid, cu = batch.new, batch.old, batch.truth, batch.valid, batch.cu_seqlens
    state.update(n_tokens=n_compared, n_valid=valid.sum(), lag_max=batch.lag_max, **{"lag/n": batch.lag_counts})

    missing = [m for m in methods if m not in batch.approximations]
    if missing:
        raise ValueError(f"the batch was prepared without the approximations of {missing}")
    approximations = batch.approximations
    for m in methods:
        errors = prox_approximation_errors(approximations[m], truth, old, new, compared)  # 0 outside `compared`
        abs_error = errors["abs_error"]
        state.update(
            **{f"{m}/{key}": errors[key].sum(dtype=torch.float64) for key in PROX_ERROR_KEYS},
            **{
                f"{m}/abs_error_max": masked_max(abs_error, compared),
                # the shared fixed-edge histogram (grpo_cli.core.histogram) of the compared tokens' |d|: every
                # other token holds an exact 0, so it is counted out of the zero bin instead of compacting |d|
                f"{m}/abs_error_hist": _without_zeros(histogram_counts(abs_error), batch.n_outside),
                f"{m}/lag/abs_error": _bin_sums(lag_bin, abs_error, present, n_lag),
                f"{m}/lag/squared_error": _bin_sums(lag_bin, errors["squared_error"], present, n_lag),
            },
        )

    if batch.rejection_sampling is not None:
        assert batch.changed_truth is not None
        state.update(n_rs_tokens=n_compared)
        for m in methods:
            changed = rejection_changes(approximations[m], old, valid, cu, batch.rejection_sampling)
            state.update(**{f"{m}/behave_flips": ((changed != batch.changed_truth) & compared).sum()})

    if batch.loss_truth is None:
        return
    adv = batch.advantages
    assert adv is not None
    num_truth, n0, stats_truth = batch.loss_truth
    state.update(
        n_loss=n0.to(torch.int64),
        loss_truth=num_truth,
        n_clip_tokens=n_compared,
        **{"lag/n_clip": batch.lag_counts},
    )
    for m in methods:
        num, _, stats = ppo_actor_loss_terms(
            new, approximations[m], old, adv, batch.eps_clip, valid, **batch.loss_kwargs
        )
        # The clip decision is the pair (clip, dual clip): a token moving between them also changes its gradient.
        flips = (stats["clip_mask"] != stats_truth["clip_mask"]) | (
            stats["dual_clip_mask"] != stats_truth["dual_clip_mask"]
        )
        flips = flips & compared
        state.update(
            **{
                f"{m}/loss": num,
                f"{m}/clip_flips": flips.sum(),
                f"{m}/lag/clip_flips": bin_counts(lag_bin, flips, n_lag),
            }
        )


def prox_compare_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    prox_logp: Tensor,
    versions: Tensor,
    current_version: int | Tensor,
    cu_seqlens: Tensor | None = None,
    loss_mask: Tensor | None = None,
    advantages: Tensor | None = None,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
) -> None:
    """Fold one batch of whole sequences into ``state``.

    Args:
        state: from :func:`prox_compare_state`.
        new_logp: ℓθ, packed ``[N]`` (with ``cu_seqlens``) or padded ``[B, T]``.
        old_logp: ℓb (behaviour, inference engine).
        prox_logp: ℓp*, the recomputed proximal log-probs (the truth).
        versions: per-token behaviour versions v_b (< 0 for prompt tokens).
        current_version: v_θ: an ``int``, a per-sequence ``[B]`` tensor or a per-token tensor.
        cu_seqlens: ``[B + 1]`` sequence offsets of packed input (ignored for padded input).
        loss_mask: tokens in the loss (bool or 0/1); ``None`` means all. Other positions may hold garbage.
        advantages: per-token advantages; without them the loss and clip figures are not evaluated.
        eps_clip, eps_clip_higher, c_clip, importance_sampling_level: as :func:`~grpo_cli.core.ppo.
            ppo_actor_loss`.
        rejection_sampling: AReaL's rejection sampling; ``None`` (off) leaves the behaviour-weight flips and the
            loss's behaviour weight out, as AReaL does.
    """
    prepared = prox_compare_prepare(
        new_logp=new_logp, old_logp=old_logp, prox_logp=prox_logp, versions=versions,
        current_version=current_version, cu_seqlens=cu_seqlens, loss_mask=loss_mask, advantages=advantages,
        eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, c_clip=c_clip, rejection_sampling=rejection_sampling,
        importance_sampling_level=importance_sampling_level, max_lag=state["lag/n"].shape[0] - 2,
        methods=state_methods(state),
    )
    prox_compare_fold(state, prepared)

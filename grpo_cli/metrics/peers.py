"""Figures exactly as a peer framework logs them, reported only under that peer's ``--names``.

Where grpo-cli's own figure and a peer's logged figure differ in definition (verl's rollout-correction statistics
of the *truncated* weights and of its recomputed log-probs, TRL's bias-corrected ``kl``, AReaL's sequence-level
``clip_ratio``, ...), the peer's is declared here, once, with the peer's key in ``peers``; grpo-cli's own keys keep
their values and no longer map to that peer key. Each group is enabled only when ``AnalyzeConfig.names`` is its
peer, so the default report does not change.

Every state is a set of float64 sums, int64 counts and running min/max (TRL's per-micro-batch figures: a keyed
table of them, one row per (step, micro_batch)), so the figures do not depend on how the dump is cut into
batches. A peer logs per training step; these are over the whole dump (``--group-by step`` gives per-step
figures). The definitions are those of :mod:`grpo_cli.core.peer_figures` (the peers' functions, tested
against their released code in ``tests/peers``) computed on one batch holding the whole dump (or one step):

- verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
  ``compute_is_metrics``, ``compute_offpolicy_metrics``), ``verl/utils/debug/metrics.py``
  (``calculate_debug_metrics``: the Pearson figure), ``verl/trainer/ppo/metric_utils.py``
  (``compute_data_metrics``: ``critic/score/*``);
- TRL ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``, ``_generate_and_score_completions``);
- AReaL ``areal/trainer/ppo/actor.py`` (``grpo_loss_fn``, ``_log_proximal_approximation_stats``,
  ``_log_version_staleness_stats``) with ``areal/utils/stats_tracker.py`` (``avg``/``min``/``max``).

Peer figures read the log-probs as stored (no ``--temperature`` rescaling): the peers log them as computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.packing import broadcast_to_tokens, lengths_from_cu_seqlens, segment_sum
from grpo_cli.core.peer_figures import VERL_SAFETY_BOUND
from grpo_cli.core.ppo import ppo_actor_loss_terms
from grpo_cli.core.state import MetricState, Reduce, StateSpec, count, maximum, minimum, total
from grpo_cli.engine.figures import Figure, Requirement, column, columns, option
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.policy import ADV, BASE, OLD

__all__ = ["ArealPeerGroup", "TrlPeerGroup", "VerlPeerGroup", "peer_groups"]

_F64 = torch.float64
DECOUPLED = columns("old_logp", "prox_logp", reason="needs 'prox_logp' and 'old_logp' columns (decoupled PPO)")
REF = column("ref_logp")
REJECTION_SAMPLING = option(lambda c: c.rejection_sampling() is not None,
                            "rejection sampling is off (set an --rs-* option)")
LAGS = (column("versions"), Requirement("needs a 'current_version' column or --current-version",
                                        lambda cols, c: "current_version" in cols or c.current_version is not None))


def _under(peer: str) -> Callable[[Any], bool]:
    return lambda config: getattr(config, "names", None) == peer


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(_F64)


def _fold_stat(state: MetricState, name: str, values: Tensor) -> None:
    """Fold AReaL-style ``avg``/``min``/``max`` (Σ, count, extrema) of ``values`` (all of them count)."""
    if values.numel() == 0:
        return
    v = _f64(values)
    state.update(**{f"{name}:sum": v.sum(), f"{name}:n": torch.tensor(v.numel()), f"{name}:min": v.min(),
                    f"{name}:max": v.max()})


def _stat_specs(name: str) -> dict[str, StateSpec]:
    return {f"{name}:sum": total(), f"{name}:n": count(), f"{name}:min": minimum(), f"{name}:max": maximum()}


def _stat_out(state: MetricState, name: str, key: str, out: dict[str, Any]) -> None:
    n = int(state[f"{name}:n"])
    if n:  # AReaL drops a reduction whose denominator is empty
        out[f"{key}/avg"] = float(state[f"{name}:sum"]) / n
        out[f"{key}/min"] = float(state[f"{name}:min"])
        out[f"{key}/max"] = float(state[f"{name}:max"])


# ------------------------------------------------------------------------------------------------------------
# verl
# ------------------------------------------------------------------------------------------------------------

_VERL_IS = {
    "rollout_is_mean": "mean truncated weight w̃ = min(w, C), w = exp(clamp(train − rollout, ±20))",
    "rollout_is_max": "largest w̃ (at most C)",
    "rollout_is_min": "smallest w̃",
    "rollout_is_std": "std of w̃ (0 for one token)",
    "rollout_is_eff_sample_size": "1 / mean((w̃ / (mean w̃ + 1e-8))²)",
    "rollout_is_ratio_fraction_high": "fraction of tokens with raw w > C (--is-threshold)",
    "rollout_is_ratio_fraction_low": "fraction of tokens with raw w < 1/C",
    "rollout_is_seq_mean": "mean over sequences of the per-sequence mean w̃ (an empty sequence counts 0)",
    "rollout_is_seq_std": "unbiased std of the per-sequence mean w̃",
    "rollout_is_seq_max": "largest per-sequence mean w̃",
    "rollout_is_seq_min": "smallest per-sequence mean w̃",
    "rollout_is_seq_max_deviation": "largest |per-sequence mean w̃ − 1|",
    "rollout_is_seq_fraction_high": "fraction of sequences whose mean raw w > C",
    "rollout_is_seq_fraction_low": "fraction of sequences whose mean raw w < 1/C",
}
_VERL_OFF = {
    "training_ppl": "mean over sequences of exp(−mean train log-prob) (empty sequences count exp(0) = 1)",
    "training_log_ppl": "mean over sequences of −mean train log-prob",
    "kl": "token mean of (rollout − train): k1 estimate of KL(rollout ‖ train)",
    "k3_kl": "token mean of e^ℓ − ℓ − 1, ℓ = train − rollout (never clamped)",
    "rollout_ppl": "mean over sequences of exp(−mean rollout log-prob)",
    "rollout_log_ppl": "mean over sequences of −mean rollout log-prob",
    "log_ppl_diff": "mean over sequences of (mean rollout − mean train)",
    "log_ppl_abs_diff": "mean over sequences of |mean rollout − mean train|",
    "log_ppl_diff_max": "largest per-sequence (mean rollout − mean train)",
    "log_ppl_diff_min": "smallest per-sequence (mean rollout − mean train)",
    "ppl_ratio": "mean over sequences of exp(mean rollout − mean train)",
    "chi2_token": "token mean of exp(2·clamp(ℓ, ±20)) − 1",
    "chi2_seq": "mean over sequences of exp(2·clamp(Σ ℓ, ±20)) − 1",
}
_VERL_SETS = {
    # (grpo-cli prefix, verl prefix, requirement, what "train" is)
    "decoupled": ("verl/rollout_corr/", "rollout_corr/", DECOUPLED,
                  "train = prox_logp (verl's recomputed old_log_prob)"),
    "bypass": ("verl/actor/rollout_corr/", "actor/rollout_corr/", OLD, "train = new_logp (verl's bypass mode)"),
}
_VERL_PEARSON = "verl/rollout_actor_probs_pearson_corr"
_VERL_SCORE = "verl/critic/score/"


def _verl_figures() -> tuple[Figure, ...]:
    out: list[Figure] = []
    enabled = _under("verl")
    for ours, theirs, need, train in _VERL_SETS.values():
        for name, meaning in (*_VERL_IS.items(), *_VERL_OFF.items()):
            out.append(Figure(ours + name, f"{meaning}; {train}, rollout = old_logp", section="verl",
                              needs=(need,), enabled=enabled, peers={"verl": theirs + name}))
    out.append(Figure(_VERL_PEARSON, "Pearson correlation of e^prox (verl's old_log_prob) vs e^old (rollout)",
                      section="verl", reduce="correlation", needs=(DECOUPLED,), enabled=enabled,
                      peers={"verl": "training/rollout_actor_probs_pearson_corr"}))
    for stat, meaning in (("mean", "mean reward over sequences with a valid token (zero-length responses left out)"),
                          ("max", "largest reward over sequences with a valid token"),
                          ("min", "smallest reward over sequences with a valid token")):
        out.append(Figure(_VERL_SCORE + stat, meaning, section="verl", needs=(column("rewards"),), enabled=enabled,
                          peers={"verl": f"critic/score/{stat}"}))
    return tuple(out)


def _verl_specs(p: str) -> dict[str, StateSpec]:
    sums = ("w", "v", "v2", "r", "r2", "ppl_t", "lppl_t", "kl", "k3", "ppl_r", "lppl_r", "diff", "adiff", "pplratio",
            "rho2", "chi2seq")
    specs: dict[str, StateSpec] = {f"{p}{s}": total() for s in sums}
    specs.update({f"{p}{c}": count() for c in ("n", "n_high", "n_low", "rows", "rows_high", "rows_low")})
    specs.update({f"{p}{m}": maximum() for m in ("w_max", "r_max", "dev_max", "diff_max")})
    specs.update({f"{p}{m}": minimum() for m in ("w_min", "r_min", "diff_min")})
    return specs


def _verl_update(state: MetricState, p: str, train: Tensor, rollout: Tensor, cu: Tensor, c: float,
                 truncate: bool = True) -> None:
    """Fold verl's IS and off-policy sums of one batch (valid tokens, packed) into ``state`` (prefix ``p``).

    ``truncate``: verl 0.8 and later take the IS statistics of the truncated weights min(w, C); ``False`` is verl
    0.7 and earlier (mean, extrema and per-sequence figures of the raw w, std and ESS of clamp(w, 1/C, C))."""
    t, r = _f64(train), _f64(rollout)
    lengths = lengths_from_cu_seqlens(cu).to(t.device)
    n_rows = lengths.numel()
    denom = lengths.to(_F64).clamp(min=1.0)
    log_ratio = t - r
    raw = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    w = raw.clamp(max=c) if truncate else raw
    v = w if truncate else raw.clamp(min=1.0 / c, max=c)
    row_w = segment_sum(w, cu, _F64) / denom
    row_raw = segment_sum(raw, cu, _F64) / denom
    mu_t = segment_sum(t, cu, _F64) / denom
    mu_r = segment_sum(r, cu, _F64) / denom
    diff = mu_r - mu_t
    seq_log = segment_sum(log_ratio, cu, _F64).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    upd: dict[str, Tensor] = {
        "n": torch.tensor(t.numel()), "w": w.sum(), "v": v.sum(), "v2": (v * v).sum(),
        "n_high": (raw > c).sum(), "n_low": (raw < 1.0 / c).sum(),
        "rows": torch.tensor(n_rows), "r": row_w.sum(), "r2": (row_w * row_w).sum(),
        "rows_high": (row_raw > c).sum(), "rows_low": (row_raw < 1.0 / c).sum(),
        "ppl_t": torch.exp(-mu_t).sum(), "lppl_t": (-mu_t).sum(), "kl": (-log_ratio).sum(),
        "k3": (torch.expm1(log_ratio) - log_ratio).sum(), "ppl_r": torch.exp(-mu_r).sum(), "lppl_r": (-mu_r).sum(),
        "diff": diff.sum(), "adiff": diff.abs().sum(), "pplratio": torch.exp(diff).sum(),
        "rho2": (raw * raw).sum(), "chi2seq": torch.exp(2.0 * seq_log).sum(),
    }
    if t.numel():
        upd.update(w_max=w.max(), w_min=w.min())
    if n_rows:
        upd.update(r_max=row_w.max(), r_min=row_w.min(), dev_max=(row_w - 1.0).abs().max(), diff_max=diff.max(),
                   diff_min=diff.min())
    state.update(**{p + k: v for k, v in upd.items()})


def _verl_compute(state: MetricState, p: str, c: float) -> dict[str, float]:
    n, rows = int(state[p + "n"]), int(state[p + "rows"])
    if n == 0 or rows == 0:  # verl raises on a batch without valid tokens
        return {}
    mean = float(state[p + "w"]) / n
    v_mean, v_sq = float(state[p + "v"]) / n, float(state[p + "v2"]) / n
    r_mean = float(state[p + "r"]) / rows
    r_var = (float(state[p + "r2"]) - rows * r_mean * r_mean) / (rows - 1) if rows > 1 else 0.0
    return {
        "rollout_is_mean": mean,
        "rollout_is_max": float(state[p + "w_max"]),
        "rollout_is_min": float(state[p + "w_min"]),
        "rollout_is_std": math.sqrt(max(v_sq - v_mean * v_mean, 0.0)) if n > 1 else 0.0,
        "rollout_is_eff_sample_size": (v_mean + 1e-8) ** 2 / v_sq if v_sq > 0 else math.nan,
        "rollout_is_ratio_fraction_high": int(state[p + "n_high"]) / n,
        "rollout_is_ratio_fraction_low": int(state[p + "n_low"]) / n,
        "rollout_is_seq_mean": r_mean,
        "rollout_is_seq_std": math.sqrt(max(r_var, 0.0)),
        "rollout_is_seq_max": float(state[p + "r_max"]),
        "rollout_is_seq_min": float(state[p + "r_min"]),
        "rollout_is_seq_max_deviation": float(state[p + "dev_max"]),
        "rollout_is_seq_fraction_high": int(state[p + "rows_high"]) / rows,
        "rollout_is_seq_fraction_low": int(state[p + "rows_low"]) / rows,
        "training_ppl": float(state[p + "ppl_t"]) / rows,
        "training_log_ppl": float(state[p + "lppl_t"]) / rows,
        "kl": float(state[p + "kl"]) / n,
        "k3_kl": float(state[p + "k3"]) / n,
        "rollout_ppl": float(state[p + "ppl_r"]) / rows,
        "rollout_log_ppl": float(state[p + "lppl_r"]) / rows,
        "log_ppl_diff": float(state[p + "diff"]) / rows,
        "log_ppl_abs_diff": float(state[p + "adiff"]) / rows,
        "log_ppl_diff_max": float(state[p + "diff_max"]),
        "log_ppl_diff_min": float(state[p + "diff_min"]),
        "ppl_ratio": float(state[p + "pplratio"]) / rows,
        "chi2_token": float(state[p + "rho2"]) / n - 1.0,
        "chi2_seq": float(state[p + "chi2seq"]) / rows - 1.0,
    }


class VerlPeerGroup(MetricGroup):
    """verl's rollout-correction figures (``--names verl``): ``rollout_corr/*`` from verl's recomputed old
    log-probs (our ``prox_logp``) against the rollout's (our ``old_logp``), ``actor/rollout_corr/*`` (bypass mode:
    the current policy, our ``new_logp``, against the rollout), the Pearson figure and ``critic/score/*``.

    The importance weights are token level with verl's truncation (TIS) at C = ``--is-threshold``; verl 0.8 and
    later take the statistics of the truncated weights (w = [4, 0.25, 1], C = 2: mean 1.083, max 2, ESS 0.695),
    ``--convention verl<=0.7`` those of the raw weights (1.75, 4, 0.778).
    """

    name = "verl"
    figures = _verl_figures()

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "rewards"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        if config.peer() != "verl":
            return MetricState({}, device)
        specs = {**_verl_specs("d_"), **_verl_specs("b_")}
        specs.update({k: total() for k in ("px", "py", "pxx", "pyy", "pxy", "score")})
        specs.update(pn=count(), n_scored=count(), score_max=maximum(), score_min=minimum())
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if config.peer() != "verl":
            return
        c, truncate = config.is_threshold, config.convention != "verl<=0.7"
        if valid.old_logp is not None:
            _verl_update(state, "b_", valid.new_logp, valid.old_logp, valid.cu_seqlens, c, truncate)
            if valid.prox_logp is not None:
                _verl_update(state, "d_", valid.prox_logp, valid.old_logp, valid.cu_seqlens, c, truncate)
                x, y = torch.exp(_f64(valid.prox_logp)), torch.exp(_f64(valid.old_logp))
                state.update(px=x.sum(), py=y.sum(), pxx=(x * x).sum(), pyy=(y * y).sum(), pxy=(x * y).sum(),
                             pn=torch.tensor(x.numel()))
        if valid.rewards is not None:
            scored = lengths_from_cu_seqlens(valid.cu_seqlens).to(valid.rewards.device) > 0
            s = _f64(valid.rewards[scored])
            state.update(score=s.sum(), n_scored=torch.tensor(s.numel()))
            if s.numel():
                state.update(score_max=s.max(), score_min=s.min())

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        if config.peer() != "verl":
            return {}
        out: dict[str, Any] = {}
        for prefix, (ours, _, _, _) in (("d_", _VERL_SETS["decoupled"]), ("b_", _VERL_SETS["bypass"])):
            out.update({ours + k: v for k, v in _verl_compute(state, prefix, config.is_threshold).items()})
        n = int(state["pn"])
        if n > 1:
            mx, my = float(state["px"]) / n, float(state["py"]) / n
            cov = float(state["pxy"]) / n - mx * my
            vx, vy = float(state["pxx"]) / n - mx * mx, float(state["pyy"]) / n - my * my
            out[_VERL_PEARSON] = cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan
        m = int(state["n_scored"])
        if m:
            out[_VERL_SCORE + "mean"] = float(state["score"]) / m
            out[_VERL_SCORE + "max"] = float(state["score_max"])
            out[_VERL_SCORE + "min"] = float(state["score_min"])
        return out


# ------------------------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------------------------

_TRL_CLIP = {
    "low_mean": "token mean of [r < 1 − ε ∧ A < 0], r = exp(new − base) (TRL's coef_1)",
    "high_mean": "token mean of [r > 1 + ε_high ∧ A > 0]",
    "region_mean": "token mean of low ∨ high",
    "low_min": "smallest per-sequence low-clip fraction (sequences without a valid token skipped)",
    "high_max": "largest per-sequence high-clip fraction",
}


def _trl_is_ratio(delta: Tensor, cu: Tensor, config: AnalyzeConfig) -> Tensor:
    """TRL's vLLM importance-sampling ratio of one batch (``_generate_and_score_completions``): per sequence
    exp(Σ Δ) (every sequence, an empty one exp(0) = 1) for the ``sequence_*`` modes, per valid token exp(Δ) for the
    ``token_*`` modes; ``*_truncate`` clamps to [C_min, C_max], ``*_mask`` sets ratios outside to 0.
    ``delta`` = prox − old per valid token (NaN already 0)."""
    mode, lo, hi = config.vllm_is_mode, config.vllm_is_clip_min, config.vllm_is_clip_max
    ratio = torch.exp(segment_sum(delta, cu, _F64) if mode.startswith("sequence") else delta)
    if mode.endswith("truncate"):
        return ratio.clamp(min=lo, max=hi)
    outside = ratio > hi
    if lo is not None:
        outside |= ratio < lo
    return ratio.masked_fill(outside, 0.0)


def _trl_figures() -> tuple[Figure, ...]:
    enabled = _under("trl")
    out = [Figure(f"trl/clip_ratio/{k}", meaning, section="trl", reduce="fraction", needs=(BASE, ADV),
                  enabled=enabled, peers={"trl": f"clip_ratio/{k}"}) for k, meaning in _TRL_CLIP.items()]
    out.append(Figure("trl/cispo_clip_ratio", "token mean of [r > 1 + ε_high ∧ A > 0] (TRL's CISPO cap "
                      "epsilon_high = 1 + --epsilon-high)", section="trl", reduce="fraction", needs=(BASE, ADV),
                      enabled=enabled, peers={"trl": "cispo_clip_ratio"}))
    out.append(Figure("trl/kl", "token mean of k3(ref vs new)·r (TRL use_bias_correction_kl, its default; r = 1 "
                      "without old_logp or prox_logp, TRL's on-policy shortcut)", section="trl", needs=(REF,),
                      enabled=enabled, peers={"trl": "kl"}))
    out.append(Figure("trl/entropy", "token mean of the entropy column (TRL's global_masked_mean; with the "
                      "micro_batch column per micro-batch, then the plain mean over micro-batches)", section="trl",
                      needs=(column("entropy"),), enabled=enabled, peers={"trl": "entropy"}))
    out.append(Figure("trl/sampling/sampling_logp_difference/mean", "mean |prox − old| (TRL's recomputed "
                      "old_per_token_logps vs vLLM's sampling log-probs)", section="trl", needs=(DECOUPLED,),
                      enabled=enabled, peers={"trl": "sampling/sampling_logp_difference/mean"}))
    out.append(Figure("trl/sampling/sampling_logp_difference/max", "largest |prox − old|", section="trl",
                      needs=(DECOUPLED,), enabled=enabled, peers={"trl": "sampling/sampling_logp_difference/max"}))
    out.append(Figure("trl/reward_std", "Bessel-corrected std of the sequences' rewards, NaN rewards skipped (TRL's "
                      "nanstd over the generation batch; with --group-by step one step's rows)", section="trl",
                      needs=(column("rewards"),), enabled=enabled, peers={"trl": "reward_std"}))
    for stat in ("min", "mean", "max"):
        out.append(Figure(f"trl/sampling/importance_sampling_ratio/{stat}",
                          f"{stat} of TRL's vLLM IS ratio exp(prox − old) per --vllm-is-mode: over sequences "
                          "(sequence_*) or tokens (token_*), clamped (*_truncate) or 0 outside [C_min, C_max] (*_mask)",
                          section="trl", needs=(DECOUPLED,), enabled=enabled,
                          peers={"trl": f"sampling/importance_sampling_ratio/{stat}"}))
    return tuple(out)


def _row_first(values: Tensor, cu: Tensor) -> Tensor:
    """Each sequence's first value (0 for an empty sequence)."""
    lengths = lengths_from_cu_seqlens(cu).to(values.device)
    if values.numel() == 0:
        return torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device)
    first = values.index_select(0, cu[:-1].to(values.device).clamp(max=values.numel() - 1))
    return torch.where(lengths > 0, first, torch.zeros_like(first))


_TRL_MB = ("n", "low", "high", "cispo", "kl", "n_kl", "low_min", "high_max", "ent", "n_ent")
"""Columns of the per-(step, micro_batch) table ``mb`` of :class:`TrlPeerGroup` (after the key column)."""
_TRL_MB_OPS = (Reduce.SUM,) * 6 + (Reduce.MIN, Reduce.MAX) + (Reduce.SUM,) * 2
_MB_SHIFT = 2.0**32  # key = step · 2^32 + micro_batch, exact in float64 for step < 2^21


def _trl_mb_rows(valid: TokenBatch, clip: dict[str, Tensor] | None, kl: tuple[Tensor, Tensor] | None,
                 ent: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One table row per sequence, keyed by (step, micro_batch); :class:`KeyedState` sums rows of one key.

    ``n``, ``low``, ``high``, ``cispo``, ``n_kl`` and ``n_ent`` are integer counts (exact float64 sums); ``kl``
    and ``ent`` are float64 sums. Sequences without a valid token still add their key, so a fully masked
    micro-batch is a row with ``n = 0``: TRL logs 0 for it (``global_masked_mean`` divides by ``count.clamp(min=1)``).
    """
    assert valid.micro_batch is not None
    mb = valid.micro_batch.to(valid.device, torch.int64)
    step = valid.step.to(valid.device, torch.int64) if valid.step is not None else torch.zeros_like(mb)
    if mb.numel() and (int(mb.min()) < 0 or int(mb.max()) >= 2**32 or int(step.min()) < 0
                       or int(step.max()) >= 2**21):
        raise ValueError("micro_batch must be in [0, 2^32) and step in [0, 2^21) for per-micro-batch averaging")
    rows = torch.zeros((mb.numel(), 1 + len(_TRL_MB)), dtype=_F64, device=valid.device)
    rows[:, 0] = step.to(_F64) * _MB_SHIFT + mb.to(_F64)
    rows[:, 7], rows[:, 8] = math.inf, -math.inf
    if clip is not None:
        for i, name in enumerate(("n", "low", "high", "cispo"), start=1):
            rows[:, i] = clip[name]
        rows[:, 7], rows[:, 8] = clip["low_min"], clip["high_max"]
    if kl is not None:
        rows[:, 5], rows[:, 6] = kl
    if ent is not None:
        rows[:, 9], rows[:, 10] = ent
    return rows


def _trl_mb_compute(table: Tensor, *, clip: bool, kl: bool, entropy: bool = False) -> dict[str, float]:
    """TRL's per-micro-batch averaging: each micro-batch's value as ``GRPOTrainer._compute_loss`` computes it
    (``global_masked_mean``: Σ / max(count, 1); ``clip_ratio/low_min|high_max``: ``nanmin``/``nanmax`` of the
    per-sequence means, NaN for a micro-batch without a valid token), then ``GRPOTrainer.log``'s plain mean over
    the micro-batches (NaNs dropped). Under ``--group-by step`` the table holds one step's micro-batches."""
    col = {name: table[:, i] for i, name in enumerate(_TRL_MB, start=1)}
    out: dict[str, float] = {}
    if clip:
        n = col["n"].clamp(min=1.0)
        low, high = col["low"] / n, col["high"] / n
        out.update({"trl/clip_ratio/low_mean": float(low.mean()), "trl/clip_ratio/high_mean": float(high.mean()),
                    "trl/clip_ratio/region_mean": float((low + high).mean()),
                    "trl/cispo_clip_ratio": float((col["cispo"] / n).mean())})
        for name, key in (("low_min", "trl/clip_ratio/low_min"), ("high_max", "trl/clip_ratio/high_max")):
            finite = torch.isfinite(col[name])
            if bool(finite.any()):
                out[key] = float(col[name][finite].mean())
    if kl:
        out["trl/kl"] = float((col["kl"] / col["n_kl"].clamp(min=1.0)).mean())
    if entropy:
        out["trl/entropy"] = float((col["ent"] / col["n_ent"].clamp(min=1.0)).mean())
    return out


class TrlPeerGroup(MetricGroup):
    """TRL's clip ratios, ``cispo_clip_ratio``, its logged (bias-corrected) ``kl`` and the vLLM
    importance-sampling figures (``--names trl``). The ratio base is TRL's ``old_per_token_logps``: our
    ``prox_logp`` when the dump has it, else ``old_logp``; ``--importance-level sequence`` uses TRL's sequence
    ratio exp(mean log-ratio), the means then running over sequences.

    With the dump's ``micro_batch`` column, ``clip_ratio/*``, ``cispo_clip_ratio`` and ``kl`` follow TRL's
    averaging (``GRPOTrainer._compute_loss`` per micro-batch, then the plain mean in ``GRPOTrainer.log``) from a
    keyed table with one row per (step, micro_batch); without it they are pooled token means."""

    name = "trl"
    figures = _trl_figures()

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "ref_logp", "advantages", "step", "micro_batch",
                          "rewards", "entropy"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        if config.peer() != "trl":
            return MetricState({}, device)
        specs: dict[str, StateSpec] = {k: count() for k in ("n", "low", "high", "cispo", "n_is")}
        specs.update({k: total() for k in ("kl", "d_sum", "is_sum")})
        specs.update(ent=total(), n_ent=count())
        specs.update(n_kl=count(), n_d=count(), low_min=minimum(), high_max=maximum(), d_max=maximum(),
                     is_min=minimum(), is_max=maximum(), r_n=count(), r_sum=total(), r_sq=total())
        # One row per (step, micro_batch) when the dump has the micro_batch column (see _TRL_MB).
        return KeyedState(specs, {"mb": _TRL_MB_OPS}, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if config.peer() != "trl":
            return
        base, cu = valid.ratio_base_logp, valid.cu_seqlens
        lengths = lengths_from_cu_seqlens(cu).to(valid.device)
        coef_tokens = torch.ones(valid.n_tokens, dtype=_F64, device=valid.device)  # TRL: no old log-probs, r = 1
        rows: dict[str, Tensor] | None = None  # per-sequence clip sums for the micro-batch table
        kl_rows: tuple[Tensor, Tensor] | None = None  # per-sequence Σ k3·r and token counts
        if base is not None:
            log_ratio = _f64(valid.new_logp) - _f64(base)
            if config.importance_level == "sequence":
                row = segment_sum(log_ratio, cu, _F64) / lengths.to(_F64).clamp(min=1.0)
                coef_tokens = torch.exp(broadcast_to_tokens(row, cu, log_ratio.numel()))
            else:
                coef_tokens = torch.exp(log_ratio)
            if valid.advantages is not None:
                rows = self._clip(state, coef_tokens, _f64(valid.advantages), cu, lengths, config)
        if valid.ref_logp is not None:
            y = _f64(valid.ref_logp) - _f64(valid.new_logp)
            k3 = torch.expm1(y) - y
            state.update(kl=(k3 * coef_tokens).sum(), n_kl=torch.tensor(y.numel()))
            kl_rows = (segment_sum(k3 * coef_tokens, cu, _F64), lengths.to(_F64))
        ent_rows: tuple[Tensor, Tensor] | None = None  # per-sequence Σ entropy and token counts
        if valid.entropy is not None:
            e = _f64(valid.entropy)
            state.update(ent=e.sum(), n_ent=torch.tensor(e.numel()))
            ent_rows = (segment_sum(e, cu, _F64), lengths.to(_F64))
        if valid.micro_batch is not None:
            state.update(mb=_trl_mb_rows(valid, rows, kl_rows, ent_rows))
        if valid.rewards is not None:
            r = _f64(valid.rewards)
            r = r[~torch.isnan(r)]
            state.update(r_n=torch.tensor(r.numel()), r_sum=r.sum(), r_sq=(r * r).sum())
        if valid.prox_logp is not None and valid.old_logp is not None:
            delta = _f64(valid.prox_logp) - _f64(valid.old_logp)
            finite = ~torch.isnan(delta)
            d = delta.abs()[finite]
            state.update(d_sum=d.sum(), n_d=torch.tensor(d.numel()))
            if d.numel():
                state.update(d_max=d.max())
            ratio = _trl_is_ratio(torch.nan_to_num(delta, nan=0.0), cu, config)
            state.update(is_sum=ratio.sum(), n_is=torch.tensor(ratio.numel()))
            if ratio.numel():
                state.update(is_min=ratio.min(), is_max=ratio.max())

    @staticmethod
    def _clip(state: MetricState, coef: Tensor, adv: Tensor, cu: Tensor, lengths: Tensor,
              config: AnalyzeConfig) -> dict[str, Tensor]:
        """Fold the pooled clip counts; return the per-sequence sums the micro-batch table needs (``n``, ``low``,
        ``high``, ``cispo`` and the per-sequence clip fractions ``low_min``/``high_max``, ±inf where TRL's
        ``masked_seq_mean`` is NaN)."""
        eps_lo = config.epsilon
        eps_hi = config.epsilon if config.epsilon_high is None else config.epsilon_high
        if config.importance_level == "sequence":
            # TRL keeps one ratio per sequence and reads the advantage at its first position; an empty
            # sequence has ratio exp(0) = 1 and is never clipped, but counts.
            coef = torch.where(lengths > 0, _row_first(coef, cu), torch.ones_like(lengths, dtype=_F64))
            adv = _row_first(adv, cu)
            low, high = (coef < 1 - eps_lo) & (adv < 0), (coef > 1 + eps_hi) & (adv > 0)
            cispo = (coef > 1 + eps_hi) & (adv > 0)
            state.update(n=torch.tensor(coef.numel()), low=low.sum(), high=high.sum(), cispo=cispo.sum())
            if coef.numel():
                state.update(low_min=low.to(_F64).min(), high_max=high.to(_F64).max())
            return {"n": torch.ones_like(coef), "low": low.to(_F64), "high": high.to(_F64),
                    "cispo": cispo.to(_F64), "low_min": low.to(_F64), "high_max": high.to(_F64)}
        low, high = (coef < 1 - eps_lo) & (adv < 0), (coef > 1 + eps_hi) & (adv > 0)
        state.update(n=torch.tensor(coef.numel()), low=low.sum(), high=high.sum(), cispo=high.sum())
        has = lengths > 0
        denom = lengths.to(_F64).clamp(min=1.0)
        low_seq, high_seq = segment_sum(low.to(_F64), cu, _F64), segment_sum(high.to(_F64), cu, _F64)
        if bool(has.any()):
            state.update(low_min=(low_seq / denom)[has].min(), high_max=(high_seq / denom)[has].max())
        inf = torch.full_like(low_seq, math.inf)
        return {"n": lengths.to(_F64), "low": low_seq, "high": high_seq, "cispo": high_seq,
                "low_min": torch.where(has, low_seq / denom, inf), "high_max": torch.where(has, high_seq / denom, -inf)}

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        if config.peer() != "trl":
            return {}
        out: dict[str, Any] = {}
        n = int(state["n"])
        if n:
            low, high = int(state["low"]), int(state["high"])
            out.update({"trl/clip_ratio/low_mean": low / n, "trl/clip_ratio/high_mean": high / n,
                        # low and high exclude each other (A < 0 vs A > 0)
                        "trl/clip_ratio/region_mean": (low + high) / n,
                        "trl/clip_ratio/low_min": float(state["low_min"]),
                        "trl/clip_ratio/high_max": float(state["high_max"]),
                        "trl/cispo_clip_ratio": int(state["cispo"]) / n})
        if int(state["n_kl"]):
            out["trl/kl"] = float(state["kl"]) / int(state["n_kl"])
        if int(state["n_ent"]):
            out["trl/entropy"] = float(state["ent"]) / int(state["n_ent"])
        table = state["mb"] if "mb" in state.values else None
        if table is not None and table.shape[0]:
            out.update(_trl_mb_compute(table, clip=bool(n), kl=bool(int(state["n_kl"])),
                                       entropy=bool(int(state["n_ent"]))))
        m = int(state["r_n"])
        if m:  # torch.std (unbiased) as TRL's nanstd in _generate_and_score_completions; NaN for one reward
            mean = float(state["r_sum"]) / m
            out["trl/reward_std"] = (math.sqrt(max(float(state["r_sq"]) - m * mean * mean, 0.0) / (m - 1))
                                     if m > 1 else math.nan)
        if int(state["n_is"]):
            nd = int(state["n_d"])
            out["trl/sampling/sampling_logp_difference/mean"] = float(state["d_sum"]) / nd if nd else 0.0
            out["trl/sampling/sampling_logp_difference/max"] = float(state["d_max"]) if nd else 0.0
            out["trl/sampling/importance_sampling_ratio/min"] = float(state["is_min"])
            out["trl/sampling/importance_sampling_ratio/mean"] = float(state["is_sum"]) / int(state["n_is"])
            out["trl/sampling/importance_sampling_ratio/max"] = float(state["is_max"])
        return out


# ------------------------------------------------------------------------------------------------------------
# AReaL
# ------------------------------------------------------------------------------------------------------------

_U = "ppo_actor/update/"
_TERMS = Requirement("needs 'advantages' and a ratio base ('prox_logp' or 'old_logp')",
                     lambda cols, _: "advantages" in cols and bool({"old_logp", "prox_logp"} & cols))
_RS_TERMS = Requirement("under rejection sampling needs 'advantages' and 'prox_logp' (the filter's mask)",
                        lambda cols, c: c.rejection_sampling() is None or {"advantages", "prox_logp"} <= cols)
# (name, meaning, requirements); each is logged as <name>/{avg,min,max}
_AREAL_STATS: tuple[tuple[str, str, tuple[Requirement, ...]], ...] = (
    ("importance_weight", "PPO ratio exp(new − base) (the sequence ratio under --importance-level sequence)",
     (_TERMS,)),
    ("approx_kl", "new − base", (_TERMS,)),
    ("actor_loss", "per-token PPO actor loss", (_TERMS,)),
    ("new_logp", "new log-prob", ()),
    ("old_logp", "behaviour log-prob", (OLD,)),
    ("entropy", "token entropy", (column("entropy"),)),
    ("behave_imp_weight", "behaviour weight exp(prox − old) over the tokens rejection sampling keeps",
     (DECOUPLED, _TERMS, REJECTION_SAMPLING)),
    ("behave_approx_kl", "prox − old over the tokens rejection sampling keeps",
     (DECOUPLED, _TERMS, REJECTION_SAMPLING)),
    ("compute_logp/kl_div_direct", "−(new − old) (over the kept tokens under rejection sampling)", (OLD, _RS_TERMS)),
    ("compute_logp/kl_div_taylor", "(new − old)²/2", (OLD, _RS_TERMS)),
    ("compute_logp/kl_div_dual", "e^(new − old) − 1 − (new − old)", (OLD, _RS_TERMS)),
)
_AREAL_VERSION = tuple(f"sample_staleness_{lag}_{stat}"
                       for lag in ("theta", "proximal") for stat in ("avg", "min", "max"))


def _areal_figures() -> tuple[Figure, ...]:
    enabled = _under("areal")
    out: list[Figure] = []
    for name, meaning, needs in _AREAL_STATS:
        for stat, what in (("avg", "mean"), ("min", "smallest"), ("max", "largest")):
            out.append(Figure(f"areal/{name}/{stat}", f"{what} {meaning}", section="areal",
                              reduce={"avg": "mean", "min": "min", "max": "max"}[stat], needs=needs,
                              enabled=enabled, peers={"areal": f"{_U}{name}/{stat}"}))
    out.append(Figure("areal/clip_ratio/avg", "tokens PPO clips (the sequence clip under --importance-level "
                      "sequence)", section="areal", reduce="fraction", needs=(_TERMS,), enabled=enabled,
                      peers={"areal": _U + "clip_ratio/avg"}))
    out.append(Figure("areal/dual_clip_ratio/avg", "tokens the dual clip (--c-clip) binds", section="areal",
                      reduce="fraction", needs=(_TERMS,), enabled=enabled,
                      peers={"areal": _U + "dual_clip_ratio/avg"}))
    out.append(Figure("areal/behave_filtered_ratio/avg", "valid tokens rejection sampling drops", section="areal",
                      reduce="fraction", needs=(DECOUPLED, _TERMS, REJECTION_SAMPLING), enabled=enabled,
                      peers={"areal": _U + "behave_filtered_ratio/avg"}))
    out.append(Figure("areal/n_valid_tokens_in_loss", "tokens with loss_mask = 1 (before rejection sampling)",
                      section="areal", reduce="count", enabled=enabled,
                      peers={"areal": _U + "n_valid_tokens_in_loss"}))
    out.append(Figure("areal/masked_token_ratio", "1 − valid tokens / all tokens", section="areal",
                      reduce="fraction", enabled=enabled, peers={"areal": _U + "masked_token_ratio"}))
    for name in _AREAL_VERSION:
        lag = "current − version" if "theta" in name else "current − 1 − version"
        out.append(Figure(f"areal/version_stats/{name}", f"{name.rsplit('_', 1)[1]} lag {lag} over the tokens "
                          "rejection sampling keeps", section="areal", needs=(*LAGS, _RS_TERMS), enabled=enabled,
                          peers={"areal": f"{_U}version_stats/{name}"}))
    out.append(Figure("areal/version_stats/n_valid_generated_tokens", "generated tokens (version ≥ 0) rejection "
                      "sampling keeps", section="areal", reduce="count", needs=(*LAGS, _RS_TERMS), enabled=enabled,
                      peers={"areal": _U + "version_stats/n_valid_generated_tokens"}))
    return tuple(out)


def areal_terms(valid: TokenBatch, config: AnalyzeConfig) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """AReaL 1.0.4's ``ppo_actor_loss`` terms of a batch of valid tokens (``convention="areal"``: the statistics
    masks AReaL logs), memoised per batch. The batch must have ``advantages`` and a ratio base."""

    def compute() -> tuple[Tensor, Tensor, dict[str, Any]]:
        base = valid.ratio_base_logp
        assert base is not None and valid.advantages is not None
        return ppo_actor_loss_terms(
            valid.new_logp, base, valid.old_logp if valid.old_logp is not None else base, valid.advantages,
            config.epsilon, torch.ones_like(valid.new_logp, dtype=torch.bool), eps_clip_higher=config.epsilon_high,
            c_clip=config.c_clip, rejection_sampling=config.rejection_sampling(),
            importance_sampling_level=config.importance_level, cu_seqlens=valid.cu_seqlens, convention="areal",
        )

    return valid.memoised("ppo_terms_areal", compute)


class ArealPeerGroup(MetricGroup):
    """AReaL's ``ppo_actor/update`` statistics with their ``/min`` and ``/max`` companions (``--names areal``),
    computed as AReaL 1.0.4's ``grpo_loss_fn`` logs them: the PPO terms with ``convention="areal"``, the
    ``compute_logp/kl_div_*`` and ``version_stats/*`` over the tokens rejection sampling keeps (its
    ``behave_mask``), ``clip_ratio`` from the sequence ratio under ``--importance-level sequence``."""

    name = "areal"
    figures = _areal_figures()

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "advantages", "entropy", "versions",
                          "current_version"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        if config.peer() != "areal":
            return MetricState({}, device)
        specs: dict[str, StateSpec] = {}
        for name, _, _ in _AREAL_STATS:
            specs.update(_stat_specs(name))
        specs.update(_stat_specs("version_theta"))
        specs.update(n_valid=count(), n_all=count(), n_clip=count(), n_dual=count(), n_filtered=count(),
                     n_terms=count())
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if config.peer() != "areal":
            return
        state.update(n_valid=torch.tensor(valid.n_tokens), n_all=torch.tensor(batch.n_tokens))
        _fold_stat(state, "new_logp", valid.new_logp)
        if valid.old_logp is not None:
            _fold_stat(state, "old_logp", valid.old_logp)
        if valid.entropy is not None:
            _fold_stat(state, "entropy", valid.entropy)
        keep: Tensor | None = torch.ones(valid.n_tokens, dtype=torch.bool, device=valid.device)
        if valid.advantages is not None and valid.ratio_base_logp is not None and valid.n_tokens:
            _, _, st = areal_terms(valid, config)
            _fold_stat(state, "importance_weight", st["importance_weight"])
            _fold_stat(state, "approx_kl", st["approx_kl"])
            _fold_stat(state, "actor_loss", st["loss"])
            state.update(n_clip=st["clip_mask"].sum(), n_dual=st["dual_clip_mask"].sum(),
                         n_terms=torch.tensor(valid.n_tokens))
            if "behave_mask" in st:
                keep = st["behave_mask"]
                _fold_stat(state, "behave_imp_weight", st["behave_imp_weight"][keep])
                _fold_stat(state, "behave_approx_kl", st["behave_approx_kl"][keep])
                state.update(n_filtered=(~keep).sum())
        elif config.rejection_sampling() is not None:
            keep = None  # the filter's mask needs the PPO terms
        if keep is None:
            return
        if valid.old_logp is not None:
            d = (_f64(valid.new_logp) - _f64(valid.old_logp))[keep]
            _fold_stat(state, "compute_logp/kl_div_direct", -d)
            _fold_stat(state, "compute_logp/kl_div_taylor", d * d / 2.0)
            _fold_stat(state, "compute_logp/kl_div_dual", torch.expm1(d) - d)
        current = valid.current_version
        if current is None and config.current_version is not None:
            current = torch.full((valid.n_sequences,), config.current_version, dtype=torch.int64, device=valid.device)
        if valid.versions is not None and current is not None:
            current_tokens = broadcast_to_tokens(current.to(valid.device), valid.cu_seqlens, valid.n_tokens)
            generated = keep & (valid.versions >= 0)
            _fold_stat(state, "version_theta", (current_tokens - valid.versions)[generated])

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        if config.peer() != "areal":
            return {}
        out: dict[str, Any] = {}
        for name, _, _ in _AREAL_STATS:
            _stat_out(state, name, f"areal/{name}", out)
        n_terms = int(state["n_terms"])
        if n_terms:
            out["areal/clip_ratio/avg"] = int(state["n_clip"]) / n_terms
            out["areal/dual_clip_ratio/avg"] = int(state["n_dual"]) / n_terms
            if int(state["behave_imp_weight:n"]) + int(state["n_filtered"]):  # rejection sampling ran
                out["areal/behave_filtered_ratio/avg"] = int(state["n_filtered"]) / n_terms
        n_valid, n_all = int(state["n_valid"]), int(state["n_all"])
        out["areal/n_valid_tokens_in_loss"] = n_valid
        out["areal/masked_token_ratio"] = 1.0 - n_valid / max(n_all, 1)
        n = int(state["version_theta:n"])
        if n:
            total_lag = float(state["version_theta:sum"])
            lo, hi = float(state["version_theta:min"]), float(state["version_theta:max"])
            v = "areal/version_stats/sample_staleness_"
            out.update({v + "theta_avg": total_lag / n, v + "theta_min": lo, v + "theta_max": hi,
                        v + "proximal_avg": total_lag / n - 1.0, v + "proximal_min": lo - 1.0,
                        v + "proximal_max": hi - 1.0, "areal/version_stats/n_valid_generated_tokens": n})
        return out


def peer_groups() -> list[MetricGroup]:
    """The peer-exact groups, each a no-op unless ``--names`` is its peer."""
    return [VerlPeerGroup(), TrlPeerGroup(), ArealPeerGroup()]

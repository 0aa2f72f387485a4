"""TRL's peer-exact figures (``--names trl``): :class:`TrlPeerGroup`. See :mod:`grpo_cli.metrics.peers`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.packing import broadcast_to_tokens, lengths_from_cu_seqlens, segment_sum
from grpo_cli.core.peer_trl import trl_bound_is_ratio, trl_clip_indicators
from grpo_cli.core.state import MetricState, Reduce, StateSpec, count, maximum, minimum, total
from grpo_cli.engine.figures import Figure, column
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics._peers_common import (
    DECOUPLED,
    F64,
    REF,
    f64,
    under,
)
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.policy import ADV, BASE

__all__ = ["TrlPeerGroup"]


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
    mode = config.vllm_is_mode
    ratio = torch.exp(segment_sum(delta, cu, F64) if mode.startswith("sequence") else delta)
    return trl_bound_is_ratio(ratio, mode, config.vllm_is_clip_min, config.vllm_is_clip_max)


def _trl_figures() -> tuple[Figure, ...]:
    enabled = under("trl")
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
    rows = torch.zeros((mb.numel(), 1 + len(_TRL_MB)), dtype=F64, device=valid.device)
    rows[:, 0] = step.to(F64) * _MB_SHIFT + mb.to(F64)
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
    ratio exp(mean log-ratio), the clip means then running over sequences for a per-sequence advantages column (TRL's
    ``[B]``) and over tokens for a per-token one (``config.advantages_per_token``; TRL's ``[B, T]``).

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
        coef_tokens = torch.ones(valid.n_tokens, dtype=F64, device=valid.device)  # TRL: no old log-probs, r = 1
        rows: dict[str, Tensor] | None = None  # per-sequence clip sums for the micro-batch table
        kl_rows: tuple[Tensor, Tensor] | None = None  # per-sequence Σ k3·r and token counts
        if base is not None:
            log_ratio = f64(valid.new_logp) - f64(base)
            if config.importance_level == "sequence":
                row = segment_sum(log_ratio, cu, F64) / lengths.to(F64).clamp(min=1.0)
                coef_tokens = torch.exp(broadcast_to_tokens(row, cu, log_ratio.numel()))
            else:
                coef_tokens = torch.exp(log_ratio)
            if valid.advantages is not None:
                rows = self._clip(state, coef_tokens, f64(valid.advantages), cu, lengths, config)
        if valid.ref_logp is not None:
            y = f64(valid.ref_logp) - f64(valid.new_logp)
            k3 = k3_of_log_weight(y)
            state.update(kl=(k3 * coef_tokens).sum(), n_kl=torch.tensor(y.numel()))
            kl_rows = (segment_sum(k3 * coef_tokens, cu, F64), lengths.to(F64))
        ent_rows: tuple[Tensor, Tensor] | None = None  # per-sequence Σ entropy and token counts
        if valid.entropy is not None:
            e = f64(valid.entropy)
            state.update(ent=e.sum(), n_ent=torch.tensor(e.numel()))
            ent_rows = (segment_sum(e, cu, F64), lengths.to(F64))
        if valid.micro_batch is not None:
            state.update(mb=_trl_mb_rows(valid, rows, kl_rows, ent_rows))
        if valid.rewards is not None:
            r = f64(valid.rewards)
            r = r[~torch.isnan(r)]
            state.update(r_n=torch.tensor(r.numel()), r_sum=r.sum(), r_sq=(r * r).sum())
        if valid.prox_logp is not None and valid.old_logp is not None:
            delta = f64(valid.prox_logp) - f64(valid.old_logp)
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
        if config.importance_level == "sequence" and not config.advantages_per_token:
            # TRL's (B, 1) sequence ratio against its (B,) advantages: one indicator per sequence, the means over
            # sequences; an empty sequence has ratio exp(0) = 1 and is never clipped, but counts. With per-token
            # advantages TRL broadcasts the sequence ratio against them: the token branch below, coef being the
            # sequence ratio repeated over its tokens (trl_clip_ratio_metrics).
            coef = torch.where(lengths > 0, _row_first(coef, cu), torch.ones_like(lengths, dtype=F64))
            adv = _row_first(adv, cu)
            low, high = trl_clip_indicators(coef, adv, eps_lo, eps_hi)
            cispo = (coef > 1 + eps_hi) & (adv > 0)
            state.update(n=torch.tensor(coef.numel()), low=low.sum(), high=high.sum(), cispo=cispo.sum())
            if coef.numel():
                state.update(low_min=low.to(F64).min(), high_max=high.to(F64).max())
            return {"n": torch.ones_like(coef), "low": low.to(F64), "high": high.to(F64),
                    "cispo": cispo.to(F64), "low_min": low.to(F64), "high_max": high.to(F64)}
        low, high = trl_clip_indicators(coef, adv, eps_lo, eps_hi)
        state.update(n=torch.tensor(coef.numel()), low=low.sum(), high=high.sum(), cispo=high.sum())
        has = lengths > 0
        denom = lengths.to(F64).clamp(min=1.0)
        low_seq, high_seq = segment_sum(low.to(F64), cu, F64), segment_sum(high.to(F64), cu, F64)
        if bool(has.any()):
            state.update(low_min=(low_seq / denom)[has].min(), high_max=(high_seq / denom)[has].max())
        inf = torch.full_like(low_seq, math.inf)
        return {"n": lengths.to(F64), "low": low_seq, "high": high_seq, "cispo": high_seq,
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

"""TRL's peer-exact figures (``--names trl``): :class:`TrlPeerGroup`. See :mod:`grpo_cli.metrics.peers`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_sum
from grpo_cli.core.peer_trl import trl_clip_terms, trl_importance_ratio, trl_kl_terms, trl_sampling_terms
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
        coef_tokens: Tensor | None = None  # TRL: no old log-probs, r = 1
        rows: dict[str, Tensor] | None = None  # per-sequence clip sums for the micro-batch table
        kl_rows: tuple[Tensor, Tensor] | None = None  # per-sequence Σ k3·r and token counts
        if base is not None:
            coef_tokens = trl_importance_ratio(f64(valid.new_logp) - f64(base), cu, config.importance_level)
            if valid.advantages is not None:
                rows = self._clip(state, coef_tokens, f64(valid.advantages), cu, config)
        if valid.ref_logp is not None:
            kl = trl_kl_terms(f64(valid.new_logp), f64(valid.ref_logp), coef_tokens)
            state.update(kl=kl.sum(), n_kl=torch.tensor(kl.numel()))
            kl_rows = (segment_sum(kl, cu, F64), lengths.to(F64))
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
            sampling = trl_sampling_terms(f64(valid.prox_logp), f64(valid.old_logp), cu, mode=config.vllm_is_mode,
                                          clip_min=config.vllm_is_clip_min, clip_max=config.vllm_is_clip_max)
            d, ratio = sampling["logp_difference"], sampling["ratio"]
            state.update(d_sum=d.sum(), n_d=torch.tensor(d.numel()))
            if d.numel():
                state.update(d_max=d.max())
            state.update(is_sum=ratio.sum(), n_is=torch.tensor(ratio.numel()))
            if ratio.numel():
                state.update(is_min=ratio.min(), is_max=ratio.max())

    @staticmethod
    def _clip(state: MetricState, coef: Tensor, adv: Tensor, cu: Tensor, config: AnalyzeConfig) -> dict[str, Tensor]:
        """Fold the pooled clip counts; return the per-sequence sums the micro-batch table needs (``n``, ``low``,
        ``high``, ``cispo`` and the per-sequence clip fractions ``low_min``/``high_max``, ±inf where TRL's
        ``masked_seq_mean`` is NaN)."""
        eps_lo = config.epsilon
        eps_hi = config.epsilon if config.epsilon_high is None else config.epsilon_high
        # TRL's (B, 1) sequence ratio against its (B,) advantages: one indicator per sequence, the means over
        # sequences. With per-token advantages TRL broadcasts the sequence ratio against them: token indicators,
        # coef being the sequence ratio repeated over its tokens (trl_clip_ratio_metrics).
        per_sequence = config.importance_level == "sequence" and not config.advantages_per_token
        t = trl_clip_terms(coef, adv, cu, epsilon_low=eps_lo, epsilon_high=eps_hi, per_sequence=per_sequence)
        low, high = t["low"], t["high"]
        # TRL's CISPO cap is 1 + epsilon_high here, so its indicator is the high clip's
        state.update(n=torch.tensor(low.numel()), low=low.sum(), high=high.sum(), cispo=high.sum())
        low_seq, high_seq = t["low_fraction"], t["high_fraction"]
        seen = ~torch.isnan(low_seq)
        if bool(seen.any()):
            state.update(low_min=low_seq[seen].min(), high_max=high_seq[seen].max())
        inf = torch.full_like(low_seq, math.inf)
        return {"n": t["units"], "low": t["low_count"], "high": t["high_count"], "cispo": t["high_count"],
                "low_min": torch.where(seen, low_seq, inf), "high_max": torch.where(seen, high_seq, -inf)}

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

"""AReaL's peer-exact figures (``--names areal``): :class:`ArealPeerGroup`. See :mod:`grpo_cli.metrics.peers`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.packing import broadcast_to_tokens
from grpo_cli.core.peer_areal import areal_kl_div_terms, areal_staleness
from grpo_cli.core.ppo import ppo_actor_loss_terms
from grpo_cli.core.state import MetricState, StateSpec, count
from grpo_cli.engine.figures import Figure, Requirement, column
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics._peers_common import (
    DECOUPLED,
    LAGS,
    REJECTION_SAMPLING,
    f64,
    fold_stat,
    stat_out,
    stat_specs,
    under,
)
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.policy import OLD

__all__ = ["ArealPeerGroup", "areal_terms"]


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
    enabled = under("areal")
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
            specs.update(stat_specs(name))
        specs.update(stat_specs("version_theta"))
        specs.update(n_valid=count(), n_all=count(), n_clip=count(), n_dual=count(), n_filtered=count(),
                     n_terms=count())
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if config.peer() != "areal":
            return
        state.update(n_valid=torch.tensor(valid.n_tokens), n_all=torch.tensor(batch.n_tokens))
        fold_stat(state, "new_logp", valid.new_logp)
        if valid.old_logp is not None:
            fold_stat(state, "old_logp", valid.old_logp)
        if valid.entropy is not None:
            fold_stat(state, "entropy", valid.entropy)
        keep: Tensor | None = torch.ones(valid.n_tokens, dtype=torch.bool, device=valid.device)
        if valid.advantages is not None and valid.ratio_base_logp is not None and valid.n_tokens:
            _, _, st = areal_terms(valid, config)
            fold_stat(state, "importance_weight", st["importance_weight"])
            fold_stat(state, "approx_kl", st["approx_kl"])
            fold_stat(state, "actor_loss", st["loss"])
            state.update(n_clip=st["clip_mask"].sum(), n_dual=st["dual_clip_mask"].sum(),
                         n_terms=torch.tensor(valid.n_tokens))
            if "behave_mask" in st:
                keep = st["behave_mask"]
                fold_stat(state, "behave_imp_weight", st["behave_imp_weight"][keep])
                fold_stat(state, "behave_approx_kl", st["behave_approx_kl"][keep])
                state.update(n_filtered=(~keep).sum())
        elif config.rejection_sampling() is not None:
            keep = None  # the filter's mask needs the PPO terms
        if keep is None:
            return
        if valid.old_logp is not None:
            d = (f64(valid.new_logp) - f64(valid.old_logp))[keep]
            for name, values in areal_kl_div_terms(d).items():
                fold_stat(state, f"compute_logp/{name}", values)
        current = valid.current_version
        if current is None and config.current_version is not None:
            current = torch.full((valid.n_sequences,), config.current_version, dtype=torch.int64, device=valid.device)
        if valid.versions is not None and current is not None:
            current_tokens = broadcast_to_tokens(current.to(valid.device), valid.cu_seqlens, valid.n_tokens)
            fold_stat(state, "version_theta", areal_staleness(valid.versions, current_tokens, keep))

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        if config.peer() != "areal":
            return {}
        out: dict[str, Any] = {}
        for name, _, _ in _AREAL_STATS:
            stat_out(state, name, f"areal/{name}", out)
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

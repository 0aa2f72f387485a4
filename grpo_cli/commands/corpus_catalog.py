"""The corpus's faults and healthy controls: what each one injects, at which magnitudes, and what a correct
diagnosis names (:mod:`grpo_cli.commands.corpus` generates them; the findings tests and ``bench/power.py`` run them).

Each fault is listed with its *realistic* magnitude first (the size at which stacks break it in practice: a whole
engine at another temperature, a top-k of 2 on a peaked model, one rollout worker of four broken) and smaller ones
after it, for the power table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONTROLS", "FAULTS", "Case"]


@dataclass(frozen=True)
class Case:
    """One corpus entry.

    Attributes:
        name: short name (``temperature@0.7``).
        spec: :class:`~grpo_cli.commands.corpus.RunSpec` fields that differ from the healthy default.
        category: the finding category a correct diagnosis names (``None`` for a healthy control).
        options: ``analyze`` options the run needs (``max_staleness``, ``prox_approximation``).
        localised: whether the fault hits identifiable rows (precision of ``where`` is testable).
        magnitude: the fault's size, for the power table (e.g. the temperature ratio).
        also: other categories that name the same physical fault correctly (a learning-rate blow-up shows as
            clipping or, once the policy has collapsed, as entropy collapse).
    """

    name: str
    spec: dict[str, Any]
    category: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    localised: bool = False
    magnitude: float | None = None
    also: tuple[str, ...] = ()


def _cases(fault: str, category: str, variants: list[tuple[float, dict[str, Any]]], **kw: Any) -> list[Case]:
    return [Case(f"{fault}@{m:g}", spec, category, magnitude=m, **kw) for m, spec in variants]


FAULTS: dict[str, list[Case]] = {
    # Alignment: the dump code writes old_logp one slot late on a fraction of the workers.
    "shift": _cases("shift", "alignment", [(1.0, {"shift": 1}), (0.25, {"shift": 1, "fault_frac": 0.25})],
                    localised=True),
    # One side at another temperature: the engine samples and reports at T_s, the trainer scores at 1.
    "temperature": _cases("temperature", "temperature",
                          [(0.7, {"behaviour_temperature": 0.7}), (0.85, {"behaviour_temperature": 0.85}),
                           (1.3, {"behaviour_temperature": 1.3})]),
    # The engine samples from a truncated set and reports renormalised log-probs.
    "top_k": _cases("top_k", "truncated-sampling", [(2, {"top_k": 2}), (3, {"top_k": 3})]),
    "top_p": _cases("top_p", "truncated-sampling", [(0.9, {"top_p": 0.9}), (0.95, {"top_p": 0.95})]),
    # Mask slips in the dump code.
    "prompt_in_loss": _cases("prompt_in_loss", "mask", [(1.0, {"mask_fault": "prompt"}),
                                                        (0.25, {"mask_fault": "prompt", "fault_frac": 0.25})],
                             localised=True),
    "last_token_masked": _cases("last_token_masked", "mask",
                                [(1.0, {"mask_fault": "missing"}),
                                 (0.25, {"mask_fault": "missing", "fault_frac": 0.25})], localised=True),
    # The dumped reference is the actor's or the engine's tensor.
    "ref_is_policy": _cases("ref_is_policy", "reference", [(1.0, {"ref_equals": "new"}),
                                                           (0.5, {"ref_equals": "new", "fault_frac": 0.5})]),
    # A rank writes its shard twice.
    "duplicates": _cases("duplicates", "duplicates", [(1.0, {"duplicate": True}),
                                                      (0.25, {"duplicate": True, "fault_frac": 0.25})],
                         localised=True),
    # Rollout engines whose weight refit stopped after step 1 while the version stamp advances.
    "weight_sync": _cases("weight_sync", "weight-sync",
                          [(1.0, {"weight_sync_from": 1, "steps": 10}),
                           (0.25, {"weight_sync_from": 1, "fault_frac": 0.25, "steps": 10})], localised=True),
    # Quantised rollouts (int4 weights) against a float32 trainer.
    "quantised_engine": _cases("quantised_engine", "mismatch", [(1.0, {"engine_bits": 4}),
                                                                (0.5, {"engine_bits": 4, "fault_frac": 0.5})],
                               localised=True),
    # Responses decoded and re-encoded between engine and trainer (one token id changes).
    "retokenize": _cases("retokenize", "retokenization", [(0.25, {"retokenize": 1.0, "fault_frac": 0.25}),
                                                          (0.1, {"retokenize": 0.4, "fault_frac": 0.25})],
                         localised=True),
    # A decoupled loss fed old_logp as prox_logp.
    "no_prox_recompute": _cases("no_prox_recompute", "prox-approximation",
                                [(1.0, {"prox": "old"}), (0.25, {"prox": "old", "fault_frac": 0.25})]),
    # Lags past the bound the run's correction is set for.
    "stale": _cases("stale", "staleness", [(8, {"lags": (0, 8)}), (6, {"lags": (0, 6)})]),
    # A learning-rate blow-up from step 2 on: the clip fraction jumps, or, once the policy has collapsed onto its
    # likeliest tokens (ratios of sampled tokens near 1 again), the entropy falls.
    "lr_blowup": _cases("lr_blowup", "clipping", [(30, {"lr_scale": 30.0, "lr_scale_from": 2}),
                                                  (10, {"lr_scale": 10.0, "lr_scale_from": 2})],
                        also=("entropy-collapse",)),
    # Advantage bugs.
    "adv_sign": _cases("adv_sign", "advantage", [(1.0, {"advantage_fault": "sign"}),
                                                 (0.25, {"advantage_fault": "sign", "fault_frac": 0.25})]),
    "adv_grouping": _cases("adv_grouping", "advantage", [(1.0, {"advantage_fault": "grouping"}),
                                                         (0.5, {"advantage_fault": "grouping", "fault_frac": 0.5})]),
    "adv_unnormalised": _cases("adv_unnormalised", "advantage",
                               [(0.5, {"advantage_fault": "unnormalised", "fault_frac": 0.5}),
                                (0.25, {"advantage_fault": "unnormalised", "fault_frac": 0.25})]),
    # A reward server that returns 0.
    "zero_reward": _cases("zero_reward", "no-signal", [(1.0, {"zero_reward": True}),
                                                       (0.75, {"zero_reward": True, "fault_frac": 0.75})]),
    # A generation limit below the answer's length.
    "length_limit": _cases("length_limit", "length-truncation", [(1.0, {"short_limit": True}),
                                                                 (0.5, {"short_limit": True, "fault_frac": 0.5})]),
}
"""Fault name → its cases, realistic magnitude first."""

CONTROLS: dict[str, Case] = {
    "async": Case("async", {}),
    "async_lag6": Case("async_lag6", {"lags": (0, 6)}, options={"max_staleness": 6}),
    "on_policy": Case("on_policy", {"lags": (0, 0)}),
    "tempered": Case("tempered", {"temperature": 0.7}),
    "one_step": Case("one_step", {"steps": 1, "prompts_per_step": 16}),
    "small": Case("small", {"steps": 4, "prompts_per_step": 2}),
}
"""Healthy runs: asynchronous (lags 0–3), lags to 6 with ``--max-staleness 6``, on-policy, T = 0.7 on both sides,
one step, and a 64-sequence dump; each has the bf16 engine against the float32 trainer."""

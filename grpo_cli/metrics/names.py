"""``--names areal|verl|trl|twinkle``: every figure that has an equivalent, under the key that framework logs.

One table per framework maps a grpo-cli key to the framework's key and a transform that converts our value into
theirs (``"neg"``: the framework logs the opposite sign, e.g. verl's ``actor/ppo_kl`` = mean(old − new);
``"square"``: AReaL logs ``squared_error`` where we report the rmse). Figures without an equivalent keep their
grpo-cli key. ``docs/metrics.md`` ("Names per framework") has the same tables with each framework's reduction
conventions where they differ from ours; ``tests/test_names.py`` checks the two agree.

Example:
    >>> rename_metrics({"logp/diff_mean": 0.25, "n_sequences": 3}, "areal")
    {'ppo_actor/update/logp_diff/avg': -0.25, 'ppo_actor/n_seqs': 3}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FRAMEWORKS", "NAMES", "TRANSFORMS", "FrameworkKey", "rename_keys", "rename_metrics", "rename_result", "sources",
]

FRAMEWORKS: tuple[str, ...] = ("areal", "verl", "trl", "twinkle")
"""Frameworks ``--names`` accepts (besides ``grpo-cli``, the default: no renaming)."""

TRANSFORMS: tuple[str, ...] = ("", "neg", "square")
"""``""`` identity, ``"neg"`` the framework's value is −ours, ``"square"`` it is ours squared."""


@dataclass(frozen=True)
class FrameworkKey:
    """A framework's key for one grpo-cli figure and how our value converts to theirs."""

    key: str
    transform: str = ""

    def convert(self, value: Any) -> Any:
        """Our value as the framework logs it (non-numbers, bools and None pass through)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        if self.transform == "neg":
            return -value
        if self.transform == "square":
            return value * value
        return value


_U = "ppo_actor/update/"  # AReaL: grpo_loss_fn stats (per micro-batch), compute_logp/, version_stats/
_P = "ppo_actor/"  # AReaL: _ppo_update stats (once per PPO update)
_PROX_METHODS = ("loglinear", "linear", "rollout")


def _areal() -> dict[str, FrameworkKey]:
    table = {
        "n_sequences": FrameworkKey(_P + "n_seqs"),
        "n_tokens": FrameworkKey(_U + "n_tokens"),
        "n_valid_tokens": FrameworkKey(_U + "n_valid_tokens"),
        "logp/new_mean": FrameworkKey(_U + "new_logp/avg"),
        "logp/old_mean": FrameworkKey(_U + "old_logp/avg"),
        "logp/diff_mean": FrameworkKey(_U + "logp_diff/avg", "neg"),
        "entropy/mean": FrameworkKey(_U + "entropy/avg"),
        "kl/abs_diff_mean": FrameworkKey(_U + "logp_abs_diff/avg"),
        "kl/abs_diff_max": FrameworkKey(_U + "logp_abs_diff/max"),
        "kl/k1": FrameworkKey(_U + "compute_logp/kl_div_direct/avg"),
        "kl/k2": FrameworkKey(_U + "compute_logp/kl_div_taylor/avg"),
        "kl/k3": FrameworkKey(_U + "compute_logp/kl_div_dual/avg"),
        "ratio/mean": FrameworkKey(_U + "importance_weight/avg"),
        "ratio/min": FrameworkKey(_U + "importance_weight/min"),
        "ratio/max": FrameworkKey(_U + "importance_weight/max"),
        "ratio/log_mean": FrameworkKey(_U + "approx_kl/avg"),
        "clip/ratio": FrameworkKey(_U + "clip_ratio/avg"),
        "clip/dual": FrameworkKey(_U + "dual_clip_ratio/avg"),
        "loss/ppo": FrameworkKey(_U + "actor_loss/avg"),
        "logp/clipped_new_mean": FrameworkKey(_U + "clipped_new_logp/avg"),
        "logp/clipped_old_mean": FrameworkKey(_U + "clipped_old_logp/avg"),
        "behave/imp_weight_mean": FrameworkKey(_U + "behave_imp_weight/avg"),
        "behave/imp_weight_min": FrameworkKey(_U + "behave_imp_weight/min"),
        "behave/imp_weight_max": FrameworkKey(_U + "behave_imp_weight/max"),
        "behave/approx_kl": FrameworkKey(_U + "behave_approx_kl/avg"),
        "rs/filtered_fraction": FrameworkKey(_U + "rs_filtered_fraction"),
        "kd/rkl_mean": FrameworkKey(_U + "rkl_loss/avg"),
        "staleness/n_tokens": FrameworkKey(_U + "version_stats/n_valid_generated_tokens"),
        "adv/mean": FrameworkKey(_P + "advantages/avg"),
        "reward/mean": FrameworkKey(_P + "task_reward/avg"),
        "reward/min": FrameworkKey(_P + "task_reward/min"),
        "reward/max": FrameworkKey(_P + "task_reward/max"),
        "seq/no_eos_frac": FrameworkKey(_P + "no_eos_ratios/avg"),
        "seq/n_correct": FrameworkKey(_P + "correct_n_seqs"),
        "seq/n_incorrect": FrameworkKey(_P + "incorrect_n_seqs"),
    }
    for lag in ("theta", "proximal"):
        for ours, theirs in (("mean", "avg"), ("min", "min"), ("max", "max")):
            table[f"staleness/{lag}_{ours}"] = FrameworkKey(f"{_U}version_stats/sample_staleness_{lag}_{theirs}")
    for ours, theirs in (("prompt_len", "prompt_len"), ("total_len", "seq_len"),
                         ("correct_total_len", "correct_seq_len"), ("incorrect_total_len", "incorrect_seq_len")):
        for stat, reduction in (("mean", "avg"), ("min", "min"), ("max", "max")):
            table[f"seq/{ours}_{stat}"] = FrameworkKey(f"{_P}{theirs}/{reduction}")
    for m in _PROX_METHODS:  # compare-prox figures (AReaL prox_logp_method: metrics)
        base = f"{_U}compute_logp/{m}/"
        table.update({
            f"prox/{m}/abs_error_mean": FrameworkKey(base + "abs_error/avg"),
            f"prox/{m}/abs_error_max": FrameworkKey(base + "abs_error/max"),
            f"prox/{m}/rel_error_mean": FrameworkKey(base + "rel_error/avg"),
            f"prox/{m}/rmse": FrameworkKey(base + "squared_error/avg", "square"),
            f"prox/{m}/behave_imp_weight_abs_error_mean": FrameworkKey(base + "behave_imp_weight_abs_error/avg"),
            f"prox/{m}/behave_imp_weight_rel_error_mean": FrameworkKey(base + "behave_imp_weight_rel_error/avg"),
            f"prox/{m}/importance_weight_abs_error_mean": FrameworkKey(base + "importance_weight_abs_error/avg"),
            f"prox/{m}/importance_weight_rel_error_mean": FrameworkKey(base + "importance_weight_rel_error/avg"),
        })
    return table


def _verl() -> dict[str, FrameworkKey]:
    rc = "rollout_corr/"
    return {
        "entropy/mean": FrameworkKey("actor/entropy"),
        "clip/ratio": FrameworkKey("actor/pg_clipfrac"),
        "clip/dual": FrameworkKey("actor/pg_clipfrac_lower"),
        "ratio/log_mean": FrameworkKey("actor/ppo_kl", "neg"),
        "loss/ppo": FrameworkKey("actor/pg_loss"),
        "kl_ref/k3": FrameworkKey("actor/kl_loss"),
        "kl/k1": FrameworkKey(rc + "kl"),
        "kl/k3": FrameworkKey(rc + "k3_kl"),
        "is/mean": FrameworkKey(rc + "rollout_is_mean"),
        "is/min": FrameworkKey(rc + "rollout_is_min"),
        "is/max": FrameworkKey(rc + "rollout_is_max"),
        "is/std": FrameworkKey(rc + "rollout_is_std"),
        "is/ess": FrameworkKey(rc + "rollout_is_eff_sample_size"),
        "is/frac_high": FrameworkKey(rc + "rollout_is_ratio_fraction_high"),
        "is/frac_low": FrameworkKey(rc + "rollout_is_ratio_fraction_low"),
        "is/chi2_token": FrameworkKey(rc + "chi2_token"),
        "is/chi2_seq": FrameworkKey(rc + "chi2_seq"),
        "ppl/new": FrameworkKey(rc + "training_ppl"),
        "ppl/old": FrameworkKey(rc + "rollout_ppl"),
        "ppl/log_diff_mean": FrameworkKey(rc + "log_ppl_diff"),
        "ppl/log_diff_abs_mean": FrameworkKey(rc + "log_ppl_abs_diff"),
        "ppl/ratio": FrameworkKey(rc + "ppl_ratio"),
        "prob/pearson": FrameworkKey("training/rollout_actor_probs_pearson_corr"),
        "adv/mean": FrameworkKey("critic/advantages/mean"),
        "reward/mean": FrameworkKey("critic/score/mean"),
        "reward/min": FrameworkKey("critic/score/min"),
        "reward/max": FrameworkKey("critic/score/max"),
        "seq/len_mean": FrameworkKey("response_length/mean"),
        "seq/len_min": FrameworkKey("response_length/min"),
        "seq/len_max": FrameworkKey("response_length/max"),
        "seq/no_eos_frac": FrameworkKey("response_length/clip_ratio"),
        "seq/prompt_len_mean": FrameworkKey("prompt_length/mean"),
        "seq/prompt_len_min": FrameworkKey("prompt_length/min"),
        "seq/prompt_len_max": FrameworkKey("prompt_length/max"),
    }


def _trl() -> dict[str, FrameworkKey]:
    return {
        "clip/low": FrameworkKey("clip_ratio/low_mean"),
        "clip/high": FrameworkKey("clip_ratio/high_mean"),
        "clip/ratio": FrameworkKey("clip_ratio/region_mean"),
        "kl_ref/k3": FrameworkKey("kl"),
        "entropy/mean": FrameworkKey("entropy"),
        "kl/abs_diff_mean": FrameworkKey("sampling/sampling_logp_difference/mean"),
        "kl/abs_diff_max": FrameworkKey("sampling/sampling_logp_difference/max"),
        "reward/mean": FrameworkKey("reward"),
        "groups/zero_std_frac": FrameworkKey("frac_reward_zero_std"),
        "seq/len_mean": FrameworkKey("completions/mean_length"),
        "seq/len_min": FrameworkKey("completions/min_length"),
        "seq/len_max": FrameworkKey("completions/max_length"),
        "seq/no_eos_frac": FrameworkKey("completions/clipped_ratio"),
    }


def _twinkle() -> dict[str, FrameworkKey]:
    return {
        "policy_confidence": FrameworkKey("train/policy_confidence"),
        "logp/new_mean": FrameworkKey("train/mean_new_logp"),
        "logp/old_mean": FrameworkKey("train/mean_old_logp"),
        "logp/diff_mean": FrameworkKey("train/logp_diff_mean"),
        "kl/k3": FrameworkKey("train/approx_kl"),
        "kl/k3_token_max": FrameworkKey("train/token_kl_max"),
        "ratio/max": FrameworkKey("train/token_ratio_max"),
        "entropy/mean": FrameworkKey("train/entropy"),
        "clip/ratio": FrameworkKey("train/clip_ratio"),
        "clip/low": FrameworkKey("train/clip_ratio_low"),
        "clip/high": FrameworkKey("train/clip_ratio_high"),
    }


NAMES: dict[str, dict[str, FrameworkKey]] = {
    "areal": _areal(),
    "verl": _verl(),
    "trl": _trl(),
    "twinkle": _twinkle(),
}
"""``{framework: {grpo-cli key: FrameworkKey}}``."""


def _table(framework: str | None) -> dict[str, FrameworkKey]:
    if framework is None or framework == "grpo-cli":
        return {}
    if framework not in NAMES:
        raise ValueError(f"unknown framework {framework!r}; choose one of grpo-cli, {', '.join(FRAMEWORKS)}")
    return NAMES[framework]


def rename_metrics(metrics: Mapping[str, Any], framework: str | None) -> dict[str, Any]:
    """``metrics`` with every mapped key renamed and its value converted; order and unmapped keys kept."""
    table = _table(framework)
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        target = table.get(key)
        out[target.key if target else key] = target.convert(value) if target else value
    return out


def rename_keys(mapping: Mapping[str, Any], framework: str | None) -> dict[str, Any]:
    """``mapping`` (e.g. the omitted keys with their reasons) with mapped keys renamed, values untouched."""
    table = _table(framework)
    return {(table[k].key if k in table else k): v for k, v in mapping.items()}


def sources(keys: Mapping[str, Any] | list[str], framework: str | None) -> dict[str, str]:
    """``{framework key: grpo-cli key}`` for the mapped keys among ``keys`` (the grpo-cli names)."""
    table = _table(framework)
    return {table[k].key: k for k in keys if k in table}


def rename_result(result: Any, framework: str | None) -> tuple[Any, dict[str, str]]:
    """An ``AnalysisResult``-like dataclass with ``metrics``, ``omitted`` and per-group metrics renamed.

    Returns ``(renamed result, {framework key: grpo-cli key})``; the JSON ``config`` records ``names``. With
    ``framework`` None or ``"grpo-cli"`` the result is returned unchanged.
    """
    import dataclasses

    if not _table(framework):
        return result, {}
    keys = list(result.metrics) + list(result.omitted)
    groups = [dict(group, metrics=rename_metrics(group["metrics"], framework)) for group in result.groups]
    for group in result.groups:
        keys.extend(group["metrics"])
    renamed = dataclasses.replace(
        result,
        metrics=rename_metrics(result.metrics, framework),
        omitted=rename_keys(result.omitted, framework),
        groups=groups,
        config={**result.config, "names": framework},
    )
    return renamed, sources(keys, framework)

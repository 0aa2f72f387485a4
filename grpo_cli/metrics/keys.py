"""Metric keys: the section each belongs to and a one-line meaning (the table's explanations).

Keys are a public contract (``docs/metrics.md`` has each formula and peer equivalent). Add freely; never rename or drop
one without bumping the JSON ``schema_version``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KEYS", "SECTIONS", "KeyInfo", "section_of"]


@dataclass(frozen=True)
class KeyInfo:
    section: str
    meaning: str


SECTIONS: dict[str, str] = {
    "dump": "What was read",
    "invalid": "Invalid sequences left out (--on-invalid skip; docs/errors.md)",
    "logp": "Log-probabilities (valid tokens)",
    "kl": "KL between training and behaviour policy (samples from old)",
    "ratio": "PPO importance ratio exp(new − base), base = prox_logp if present else old_logp",
    "clip": "Clipping",
    "kl_ref": "KL between training and reference policy (samples from new)",
    "behave": "Decoupled PPO behaviour weight exp(prox − old) (over tokens rejection sampling keeps)",
    "rs": "Rejection sampling (AReaL, --rs-*)",
    "m2po": "M2PO second-moment masking (AReaL, --m2-threshold)",
    "is": "Importance weight w = exp(new − old) health (verl rollout correction)",
    "ppl": "Perplexities (per sequence, then averaged)",
    "prob": "Token probabilities",
    "abs_diff": "|new − old| distribution",
    "staleness": "Staleness (valid generated tokens)",
    "spikes": "Spikes",
    "adv": "Advantages (valid tokens)",
    "seq": "Sequences",
    "reward": "Rewards (per sequence)",
    "groups": "GRPO groups",
    "loss": "Losses over the whole dump (ratio base = prox_logp if present else old_logp)",
    "sanity": "Sanity (valid tokens; every log-prob column)",
    "prox": "compare-prox: proximal approximation ℓp̂ vs the recomputed prox_logp ℓp* (valid generated tokens)",
    "kd": "Distillation against teacher_logp (AReaL joint KD)",
    "adv_check": "Advantage check: recomputed vs the dump's advantages (grpo-cli advantages)",
    "other": "Other",
}

KEYS: dict[str, KeyInfo] = {
    "n_sequences": KeyInfo("dump", "sequences (rows) read"),
    "n_tokens": KeyInfo("dump", "tokens read, masked or not"),
    "n_valid_tokens": KeyInfo("dump", "tokens with loss_mask = 1 (every other figure is over these)"),
    "logp/new_mean": KeyInfo("logp", "mean log π_θ"),
    "logp/old_mean": KeyInfo("logp", "mean behaviour log-prob"),
    "logp/diff_mean": KeyInfo("logp", "mean (new − old); > 0: trainer likes the samples more than the sampler did"),
    "policy_confidence": KeyInfo("logp", "exp(mean log π_θ): geometric-mean token probability"),
    "entropy/mean": KeyInfo("logp", "mean token entropy of π_θ"),
    "kl/k3": KeyInfo("kl", "mean(e^d − 1 − d), d = new − old: k3 estimate of KL(old ‖ new)"),
    "kl/k3_token_max": KeyInfo("kl", "largest per-token k3"),
    "ratio/max": KeyInfo("ratio", "largest per-token ratio"),
    "clip/ratio": KeyInfo("clip", "tokens clipped by PPO: clip/low + clip/high"),
    "clip/low": KeyInfo("clip", "r < 1 − ε with A < 0"),
    "clip/high": KeyInfo("clip", "r > 1 + ε_high with A > 0"),
    "clip/seq_ratio": KeyInfo("clip", "GSPO: sequences whose geometric-mean ratio is clipped"),
    "clip/seq_low": KeyInfo("clip", "GSPO: s < 1 − ε with mean A < 0"),
    "clip/seq_high": KeyInfo("clip", "GSPO: s > 1 + ε_high with mean A > 0"),
    "clip/cispo": KeyInfo("clip", "CISPO: r outside [1 − ε, 1 + ε_high], regardless of A"),
    "clip/cispo_low": KeyInfo("clip", "CISPO: r < 1 − ε"),
    "clip/cispo_high": KeyInfo("clip", "CISPO: r > 1 + ε_high"),
    "top_kl": KeyInfo("kl", "the highest-k3 tokens"),
    "clip/dual": KeyInfo("clip", "AReaL dual clip (--c-clip): A < 0 and r > c_clip, loss capped at c_clip·|A|"),
    "loss/grpo": KeyInfo("loss", "GRPOLoss: per-sequence token mean of −min(rA, clip(r)A) (+β·k3), then batch mean"),
    "loss/gspo": KeyInfo("loss", "GSPOLoss: as GRPO with the sequence geometric-mean ratio"),
    "loss/sapo": KeyInfo("loss", "SAPOLoss: soft sigmoid gate instead of the hard clip (τ₊, τ₋)"),
    "loss/cispo": KeyInfo("loss", "CISPOLoss: −sg(min(r, 1 + ε_high))·A·log π over the token count"),
    "loss/bnpo": KeyInfo("loss", "BNPOLoss: token mean of the clipped surrogate over the whole dump"),
    "loss/dr_grpo": KeyInfo("loss", "DRGRPOLoss: token sum / (sequences · max_completion_length)"),
    "loss/ppo": KeyInfo("loss", "AReaL ppo_actor_loss (decoupled with prox_logp; dual clip, rejection sampling)"),
    # `check` only: from the validation counts (0 unless --on-invalid skip dropped sequences; docs/check.md).
    "sanity/n_nonfinite_logp": KeyInfo("sanity", "sequences dropped for a NaN/±inf log-prob, once per column (check)"),
    "sanity/n_positive_logp": KeyInfo("sanity", "sequences dropped for a log-prob > 1e-4, once per column (check)"),
}

# compare-prox (docs/metrics.md, section "compare-prox"): one key per method and figure. The methods are
# grpo_cli.core.prox.PROX_APPROX_METHODS, spelled out here so this module stays free of torch.
PROX_FIGURE_MEANINGS: dict[str, str] = {
    "abs_error_mean": "mean |ℓp* − ℓp̂| over valid generated tokens (nats)",
    "abs_error_max": "largest |ℓp* − ℓp̂|",
    "abs_error_p99": "99th percentile of |ℓp* − ℓp̂| (log-spaced histogram, ±0.58 % relative)",
    "rel_error_mean": "mean |ℓp* − ℓp̂| / (|ℓp*| + 1e−8), a fraction (AReaL compute_logp/<m>/rel_error)",
    "rmse": "√ mean (ℓp* − ℓp̂)²",
    "behave_imp_weight_abs_error_mean": "mean |w* − ŵ|, w = exp(ℓp − ℓb) = π_prox/π_behave",
    "behave_imp_weight_rel_error_mean": "mean |w* − ŵ| / (|w*| + 1e−8)",
    "importance_weight_abs_error_mean": "mean |r* − r̂|, r = exp(ℓθ − ℓp), the PPO ratio",
    "importance_weight_rel_error_mean": "mean |r* − r̂| / (|r*| + 1e−8)",
    "clip_flip_frac": "tokens whose PPO clip decision (clip or dual clip) differs from the truth's",
    "behave_weight_flip_frac": "tokens whose rejection-sampling outcome (dropped/truncated) differs",
    "loss_ppo": "AReaL's loss/ppo computed with ℓp̂ instead of ℓp*",
    "loss_abs_error": "|loss/ppo(ℓp̂) − loss/ppo(ℓp*)|",
    "loss_rel_error": "|loss/ppo(ℓp̂) − loss/ppo(ℓp*)| / (|loss/ppo(ℓp*)| + 1e−8)",
    "by_staleness": "per lag k = v_θ − v_b: n_tokens, abs_error_mean, rmse, clip_flip_frac",
    "max_safe_lag": "largest lag k ≥ 1 with abs_error_mean ≤ --tolerance at every lag in [1, k]",
}
KEYS["prox/n_tokens"] = KeyInfo("prox", "valid generated tokens compared (loss_mask = 1, versions ≥ 0)")
KEYS["prox/loss_ppo"] = KeyInfo("prox", "AReaL's loss/ppo with the recomputed prox_logp (the truth)")
for _method in ("loglinear", "linear", "rollout"):
    for _figure, _meaning in PROX_FIGURE_MEANINGS.items():
        KEYS[f"prox/{_method}/{_figure}"] = KeyInfo("prox", f"{_method}: {_meaning}")

KEYS["invalid/n_sequences_skipped"] = KeyInfo("invalid", "sequences dropped as invalid (left out of every figure)")
KEYS["invalid/n_tokens_skipped"] = KeyInfo("invalid", "tokens of the dropped sequences")
# Sequences dropped per reason (grpo_cli.engine.validate.CHECKS; present only when non-zero).
_LOGPS = ("new_logp", "old_logp", "prox_logp", "ref_logp", "teacher_logp")
for _reason, _meaning in {
    "loss_mask_not_binary": "a loss_mask value other than 0 and 1",
    **{f"{_c}_not_finite": f"NaN or ±inf {_c} at a valid token" for _c in (*_LOGPS, "entropy", "advantages")},
    **{f"{_c}_positive": f"{_c} > 1e-4 at a valid token" for _c in _LOGPS},
    "entropy_negative": "entropy < −1e-4 at a valid token",
    "versions_below_minus_one": "version < −1 at a valid token",
    "versions_above_current": "version above the sequence's current_version at a valid token",
    "rewards_not_finite": "NaN or ±inf reward",
    "eos_not_binary": "an eos flag other than 0 and 1",
}.items():
    KEYS[f"invalid/{_reason}"] = KeyInfo("invalid", f"sequences dropped: {_meaning}")

# Issue 4: off-policy diagnostics (grpo_cli/offpolicy_groups.py; docs/metrics.md, sections from "KL families" on).
_Q = {"p001": "0.1 %", "p01": "1 %", "p50": "median", "p99": "99 %", "p999": "99.9 %"}
KEYS.update(
    {
        "kl/k1": KeyInfo("kl", "mean(−x), x = new − old: k1 estimate of KL(old ‖ new) (AReaL kl_div_direct)"),
        "kl/k2": KeyInfo("kl", "mean(x²/2): k2 estimate (AReaL kl_div_taylor)"),
        "kl/abs_diff_mean": KeyInfo("kl", "mean |new − old| (slime train_rollout_logprob_abs_diff)"),
        "kl/abs_diff_max": KeyInfo("kl", "largest |new − old|"),
        "kl_ref/k1": KeyInfo("kl_ref", "mean(−y), y = ref − new: k1 estimate of KL(new ‖ ref)"),
        "kl_ref/k2": KeyInfo("kl_ref", "mean(y²/2)"),
        "kl_ref/k3": KeyInfo("kl_ref", "mean(eʸ − 1 − y): k3 estimate of KL(new ‖ ref) (the usual KL penalty)"),
        "behave/imp_weight_mean": KeyInfo("behave", "mean exp(prox − old) (AReaL behave_imp_weight)"),
        "behave/imp_weight_min": KeyInfo("behave", "smallest behaviour weight"),
        "behave/imp_weight_max": KeyInfo("behave", "largest behaviour weight"),
        "behave/approx_kl": KeyInfo("behave", "mean(prox − old) (AReaL behave_approx_kl)"),
        "rs/filtered_fraction": KeyInfo("rs", "valid tokens rejected (mask) or truncated (clamp)"),
        "m2po/masked_fraction": KeyInfo("m2po", "valid tokens M2PO masks over the whole dump"),
        "m2po/m2_mean": KeyInfo("m2po", "mean (old − prox)²; M2PO masks nothing while this is below the threshold"),
        "m2po/exact": KeyInfo("m2po", "true when the masked count is exact (≤ 8192 tokens masked)"),
        "is/mean": KeyInfo("is", "mean w (1 when the sampler and trainer agree)"),
        "is/std": KeyInfo("is", "std of w clamped to [1/C, C] (verl rollout_is_std)"),
        "is/min": KeyInfo("is", "smallest w"),
        "is/max": KeyInfo("is", "largest w"),
        "is/ess": KeyInfo("is", "effective sample size fraction 1/mean((w̃/mean w̃)²), w̃ = clamp(w, 1/C, C)"),
        "is/frac_high": KeyInfo("is", "fraction with w > C (--is-threshold)"),
        "is/frac_low": KeyInfo("is", "fraction with w < 1/C"),
        "is/chi2_token": KeyInfo("is", "mean(w²) − 1: token-level χ² divergence"),
        "is/chi2_seq": KeyInfo("is", "mean over sequences of exp(2·clamp(Σ log w, ±20)) − 1"),
        "ppl/new": KeyInfo("ppl", "mean over sequences of exp(−mean new) (verl training_ppl)"),
        "ppl/old": KeyInfo("ppl", "mean over sequences of exp(−mean old) (verl rollout_ppl)"),
        "ppl/log_diff_mean": KeyInfo("ppl", "mean over sequences of (mean old − mean new) = log(ppl_new/ppl_old)"),
        "ppl/log_diff_abs_mean": KeyInfo("ppl", "mean over sequences of |mean old − mean new|"),
        "ppl/ratio": KeyInfo("ppl", "mean over sequences of ppl_new / ppl_old"),
        "prob/pearson": KeyInfo("prob", "Pearson correlation of token probabilities e^new vs e^old"),
        "ratio/mean": KeyInfo("ratio", "mean PPO ratio"),
        "ratio/min": KeyInfo("ratio", "smallest PPO ratio"),
        "ratio/std": KeyInfo("ratio", "std of the PPO ratio"),
        "ratio/hist": KeyInfo("ratio", "log-spaced histogram of the PPO ratio (display)"),
        "abs_diff/mean": KeyInfo("abs_diff", "mean |new − old|"),
        "abs_diff/min": KeyInfo("abs_diff", "smallest |new − old|"),
        "abs_diff/max": KeyInfo("abs_diff", "largest |new − old|"),
        "abs_diff/std": KeyInfo("abs_diff", "std of |new − old|"),
        "abs_diff/hist": KeyInfo("abs_diff", "log-spaced histogram of |new − old| (display)"),
        "staleness/n_tokens": KeyInfo("staleness", "valid generated tokens (versions ≥ 0)"),
        "staleness/theta_mean": KeyInfo("staleness", "mean lag current − version (token-weighted)"),
        "staleness/theta_min": KeyInfo("staleness", "smallest lag"),
        "staleness/theta_max": KeyInfo("staleness", "largest lag"),
        "staleness/proximal_mean": KeyInfo("staleness", "mean current − 1 − version (lag behind the proximal policy)"),
        "staleness/proximal_min": KeyInfo("staleness", "smallest proximal lag"),
        "staleness/proximal_max": KeyInfo("staleness", "largest proximal lag"),
        "staleness/hist": KeyInfo("staleness", "tokens per lag"),
        "by_staleness": KeyInfo("staleness", "per lag: tokens, kl/k3, clip/ratio, is/mean, abs_diff/mean"),
        "sanity/n_on_policy_tokens": KeyInfo("sanity", "valid tokens sampled by the trainer's own version (lag 0)"),
        "sanity/on_policy_ratio_dev": KeyInfo("sanity", "max |exp(new − old) − 1| over lag-0 tokens (≈ 0 if aligned)"),
        "spikes/n_ratio_gt_1e3": KeyInfo("spikes", "tokens with exp(new − old) > 1e3 (listed first in top_kl)"),
        "adv/mean": KeyInfo("adv", "mean advantage"),
        "adv/std": KeyInfo("adv", "std of the advantages"),
        "adv/pos_frac": KeyInfo("adv", "fraction with A > 0"),
        "adv/neg_frac": KeyInfo("adv", "fraction with A < 0"),
        "adv/zero_frac": KeyInfo("adv", "fraction with A = 0 (no policy-gradient signal)"),
        "seq/len_mean": KeyInfo("seq", "mean valid (response) tokens per sequence"),
        "seq/len_min": KeyInfo("seq", "fewest valid tokens in a sequence"),
        "seq/len_max": KeyInfo("seq", "most valid tokens in a sequence"),
        "reward/mean": KeyInfo("reward", "mean reward per sequence"),
        "reward/std": KeyInfo("reward", "std of the rewards"),
        "groups/n": KeyInfo("groups", "distinct group_id values"),
        "groups/zero_std_frac": KeyInfo("groups", "groups whose rewards are all equal (no learning signal)"),
    }
)
for _name, _label in _Q.items():
    KEYS[f"ratio/{_name}"] = KeyInfo("ratio", f"{_label} quantile of the PPO ratio (histogram, see config)")
    KEYS[f"abs_diff/{_name}"] = KeyInfo("abs_diff", f"{_label} quantile of |new − old| (histogram, see config)")

# Issue 9: the advantage check (grpo_cli/advantages_check.py) and distillation (grpo_cli/distill_groups.py).
KEYS.update(
    {
        "adv_check/max_abs_diff": KeyInfo("adv_check", "largest |recomputed − dumped| over compared tokens"),
        "adv_check/mean_abs_diff": KeyInfo("adv_check", "mean |recomputed − dumped| over compared tokens"),
        "adv_check/n_sequences": KeyInfo("adv_check", "sequences read"),
        "adv_check/n_sequences_compared": KeyInfo("adv_check", "sequences with at least one compared token"),
        "adv_check/n_sequences_mismatch": KeyInfo("adv_check", "sequences with a token beyond the tolerance"),
        "adv_check/n_tokens_compared": KeyInfo("adv_check", "tokens compared (valid, or all per-token)"),
        "adv_check/n_tokens_mismatch": KeyInfo("adv_check", "compared tokens beyond the tolerance"),
        "adv_check/n_masked_tokens_compared": KeyInfo("adv_check", "compared tokens with loss_mask = 0"),
        "adv_check/n_masked_tokens_mismatch": KeyInfo("adv_check", "mismatches at loss_mask = 0 (prompt tokens)"),
        "adv_check/n_nonfinite": KeyInfo("adv_check", "compared tokens where either value is NaN/±inf"),
        "adv_check/worst": KeyInfo("adv_check", "the sequences that disagree most (file, row, position, values)"),
        "kd/rkl_mean": KeyInfo("kd", "mean(new − teacher): single-sample estimate of KL(π_θ ‖ π_teacher)"),
        "loss/kd": KeyInfo("loss", "AReaL's distillation term: w_d·mean(new − teacher), or its IS form when w_rl = 0"),
        # AReaL actor statistics (grpo_cli/areal_groups.py)
        "ratio/log_mean": KeyInfo("ratio", "mean(new − base) = mean log r (AReaL approx_kl; verl ppo_kl = −this)"),
        "logp/clipped_new_mean": KeyInfo("logp", "mean new over the tokens AReaL's PPO clip mask selects"),
        "logp/clipped_old_mean": KeyInfo("logp", "mean old (behaviour) over the PPO-clipped tokens"),
        "seq/prompt_len_mean": KeyInfo("seq", "mean index of the first loss-mask token (prompt length)"),
        "seq/prompt_len_min": KeyInfo("seq", "shortest prompt"),
        "seq/prompt_len_max": KeyInfo("seq", "longest prompt"),
        "seq/total_len_mean": KeyInfo("seq", "mean tokens per sequence, prompt included"),
        "seq/total_len_min": KeyInfo("seq", "shortest sequence (all tokens)"),
        "seq/total_len_max": KeyInfo("seq", "longest sequence (all tokens)"),
        "seq/no_eos_frac": KeyInfo("seq", "sequences cut off without EOS (eos column or --max-new-tokens)"),
        "seq/n_correct": KeyInfo("seq", "sequences with reward > 0"),
        "seq/n_incorrect": KeyInfo("seq", "sequences with reward ≤ 0"),
        "seq/correct_total_len_mean": KeyInfo("seq", "mean length (all tokens) of sequences with reward > 0"),
        "seq/correct_total_len_min": KeyInfo("seq", "shortest sequence with reward > 0"),
        "seq/correct_total_len_max": KeyInfo("seq", "longest sequence with reward > 0"),
        "seq/incorrect_total_len_mean": KeyInfo("seq", "mean length (all tokens) of sequences with reward ≤ 0"),
        "seq/incorrect_total_len_min": KeyInfo("seq", "shortest sequence with reward ≤ 0"),
        "seq/incorrect_total_len_max": KeyInfo("seq", "longest sequence with reward ≤ 0"),
        "reward/min": KeyInfo("reward", "smallest reward"),
        "reward/max": KeyInfo("reward", "largest reward"),
    }
)


def section_of(key: str) -> str:
    """The section of a key: declared, else its prefix before '/', else 'other'."""
    if key in KEYS:
        return KEYS[key].section
    prefix = key.split("/", 1)[0]
    return prefix if prefix in SECTIONS else "other"

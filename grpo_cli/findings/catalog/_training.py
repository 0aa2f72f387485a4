"""The GRP3xx/GRP4xx rules: the learning signal and its course — advantages against rewards, groups without reward
variance, entropy collapse, length truncation."""

from __future__ import annotations

from grpo_cli.findings.catalog._rule import Rule

RULES = (
    Rule(
        code="GRP301",
        category="advantage",
        name="advantage sign opposite to reward",
        title=(
            "advantages fall as rewards rise in {frac:.0%} of groups: the advantage sign is flipped"
        ),
        evidence=("diag/adv_sign_flip_frac",),
        thresholds=("SIGN_WARNING",),
        severity=(
            "`warning` when the 95 % (Wilson) interval of the fraction of groups lies above "
            "{SIGN_WARNING:%} (`error` above {SIGN_WARNING:*2%}), `inconclusive` when only the estimate does, `info` "
            "below."
        ),
        meaning=(
            "Within a group, sequences with higher rewards get lower advantages."
        ),
        why=(
            "The policy is pushed away from its rewarded samples."
        ),
        detection=(
            "A keyed table per (step, group_id) of sums of r, r², A, A², rA (A = the sequence's mean advantage over "
            "its valid tokens); `diag/adv_sign_flip_frac`; `where` lists the groups (`diag/adv_where`). Healthy GRPO "
            "groups: exactly 0. Measured: 1.00 (100 %), 0.29 (30 %)."
        ),
        fix=(
            "Check the sign convention between reward, advantage and loss (loss = −A·ratio): a reward model "
            "returning a cost, or a negated advantage in one worker, produces this. Compute advantages per group "
            "from that group's rewards, A = (r − mean_g r)/(std_g r + ε) (TRL `scale_rewards`, AReaL "
            "`reward_norm`/`adv_norm` with group level and `group_size` = samples per prompt, OpenRLHF `group_norm`, "
            "slime `--advantage-estimator grpo`), with group ids that match the prompts."
        ),
    ),
    Rule(
        code="GRP302",
        category="advantage",
        name="advantages not centred within groups",
        title=(
            "advantages are not centred within {frac:.0%} of groups: group boundaries do not match group_id"
        ),
        evidence=("diag/adv_uncentred_frac",),
        thresholds=("UNCENTRED_WARNING",),
        severity=(
            "`warning` when the 95 % (Wilson) interval of the fraction of groups lies above "
            "{UNCENTRED_WARNING:%}, `inconclusive` when only the estimate does, `info` "
            "below."
        ),
        meaning=(
            "The group baseline was computed over other sequences than the group: group boundaries do not match "
            "`group_id` (a wrong `group_size`, or sequences reordered before reshaping to `[groups, group_size]`)."
        ),
        why=(
            "Each sequence is then compared with a neighbouring prompt's rewards: the advantage measures prompt "
            "difficulty, not the sample's quality."
        ),
        detection=(
            "`diag/adv_uncentred_frac`: groups (≥ 2 sequences) with |mean A| > 1e-3 + 0.05·sd(A). GRPO, RLOO and "
            "Dr.GRPO advantages are centred per group by construction (healthy: 0); a batch-level baseline "
            "(REINFORCE++) is not, by design, and reads as this finding. Measured: window shifted by half a group: "
            "0.90 (100 %), 0.28 (30 %)."
        ),
        fix=(
            "If the run uses a group baseline (GRPO, RLOO, Dr.GRPO), make the group statistics run over the group's "
            "own sequences: `group_size` equal to the samples per prompt, no shuffling between "
            "generation and the reshape to `[groups, group_size]`. Compute advantages per group "
            "from that group's rewards, A = (r − mean_g r)/(std_g r + ε) (TRL `scale_rewards`, AReaL "
            "`reward_norm`/`adv_norm` with group level and `group_size` = samples per prompt, OpenRLHF `group_norm`, "
            "slime `--advantage-estimator grpo`), with group ids that match the prompts. A batch-level baseline "
            "(REINFORCE++) is not centred per group by design: there this finding is expected."
        ),
    ),
    Rule(
        code="GRP303",
        category="advantage",
        name="advantage scale inconsistent across groups",
        title=(
            "advantage scale is inconsistent across groups: {frac:.0%} of groups are normalised differently (scale "
            "exponent {exponent:.2f}; −1 = group std, 0 = none)"
        ),
        evidence=("diag/adv_scale_outlier_frac", "diag/adv_scale_exponent"),
        thresholds=("SCALE_WARNING",),
        severity=(
            "`warning` when the 95 % (Wilson) interval of the fraction of groups lies above "
            "{SCALE_WARNING:%}, `inconclusive` when only the estimate does, `info` "
            "below."
        ),
        meaning=(
            "Most groups divide (r − mean) by one thing and some by another: a worker with a different normalisation "
            "(for example the variance instead of the standard deviation, or a different ε)."
        ),
        why=(
            "Advantage scales then differ between groups by factors unrelated to the samples, so some prompts "
            "dominate the update."
        ),
        detection=(
            "For groups with reward spread and cov > 0, the log scale log(cov(r, A)/var(r)) is compared with the "
            "legitimate models: A = c·(r − mean)/sd (population or unbiased sd) or A = c·(r − mean), one constant c "
            "fitted by the median; groups more than 0.1 off the best model are outliers "
            "(`diag/adv_scale_outlier_frac`); `diag/adv_scale_exponent` is the slope of log scale against log sd(r) "
            "(−1 group std, 0 none or batch std, −2 variance). Measured: healthy 0.00 (exponent −1.00); variance "
            "normalisation: 0.47 (100 %, exponent −2.00), 0.29 (30 %)."
        ),
        fix=(
            "Normalise every group the same way (divide by the group std plus a small ε, or not at all), with one "
            "code path for every worker. Compute advantages per group from that group's rewards, A = (r − mean_g "
            "r)/(std_g r + ε) (TRL `scale_rewards`, AReaL `reward_norm`/`adv_norm` with group level and `group_size` "
            "= samples per prompt, OpenRLHF `group_norm`, slime `--advantage-estimator grpo`), with group ids that "
            "match the prompts."
        ),
    ),
    Rule(
        code="GRP304",
        category="no-signal",
        name="most groups have zero reward variance",
        title=(
            "{frac:.0%} of groups have zero reward variance: no learning signal"
        ),
        evidence=("groups/zero_std_frac",),
        thresholds=("ZERO_STD_INFO", "ZERO_STD_WARNING", "ZERO_STD_ERROR"),
        severity=(
            "`error` when the 95 % (Wilson, over the dump's groups) interval lies at or above {ZERO_STD_ERROR:%} of "
            "groups, `warning` above {ZERO_STD_WARNING:%}, `inconclusive` when only the estimate does, `info` from "
            "{ZERO_STD_INFO:%}."
        ),
        meaning=(
            "In most groups every sample got the same reward, so group-normalised advantages are 0 and those groups "
            "give no learning signal."
        ),
        why=(
            'The effective batch shrinks to the groups with spread; with "most" groups flat, training stalls or '
            "becomes noisy."
        ),
        detection=(
            "`groups/zero_std_frac` (TRL `frac_reward_zero_std`). Measured: healthy 0.05–0.12 (success rates "
            '0.15–0.85, 4–8 samples); all groups flat: 1.00; 30 % flat: 0.36 (`info`: not "most").'
        ),
        fix=(
            "Filter groups whose rewards are all equal and sample more prompts (DAPO's dynamic sampling), adjust the "
            "prompt difficulty, or raise the samples per prompt; TRL logs this as `frac_reward_zero_std`, slime as "
            "`zero_std/count_*`."
        ),
    ),
    Rule(
        code="GRP401",
        category="entropy-collapse",
        name="entropy falls towards zero over steps",
        title=(
            "entropy falls from {first:.3f} to {last:.3f} nats over the steps (×{ratio:.2f}): entropy collapse"
        ),
        evidence=(
            "diag/by_step[{series}] last/first quarter",
            "diag/by_step[reward_mean] last − first quarter",
        ),
        thresholds=("ENTROPY_RATIO_WARNING", "ENTROPY_RATIO_ERROR", "REWARD_RISE"),
        severity=(
            "`error` when the entropy at the end of the run (the lower of the last quarter's mean and the last "
            "step's) over the first quarter's mean has a 95 % interval (delete-one-step jackknife over the steps "
            "that enter it) at or below {ENTROPY_RATIO_ERROR}, `warning` below {ENTROPY_RATIO_WARNING}, "
            "`inconclusive` when only the estimate is (at least 4 steps); capped at `info` when the mean reward "
            "rises by at least {REWARD_RISE} between the same quarters: a policy converging on its task loses "
            "entropy as its reward rises."
        ),
        meaning=(
            "The policy becomes near-deterministic over the run."
        ),
        why=(
            "A collapsed policy stops exploring: groups become flat (GRP304) and learning stalls."
        ),
        detection=(
            "Per step: `entropy_mean` of `diag/by_step` (or `entropy/mean` of `--group-by step`); without an "
            "`entropy` column the mean −new_logp of sampled tokens (`neg_logp_mean`, a Monte-Carlo estimate of the "
            "entropy); the reward per step is `reward_mean` of `diag/by_step` (or `reward/mean` of `--group-by "
            "step`). Measured: healthy 1.62 → 1.59 (ratio ≈ 0.98); collapse over the whole run: 1.01 → 0.08; over "
            "the last 30 % of steps: 1.63 → 0.60 (ratio 0.37; 0.44 for two other seeds, whose last-quarter means "
            "alone give 0.53)."
        ),
        fix=(
            "Slow the collapse: an entropy bonus (verl `entropy_coeff`, TRL `entropy_coef`), a higher clip on the "
            "upper side (clip-higher: verl `clip_ratio_high`, AReaL `eps_clip_higher`, slime `--eps-clip-high`), "
            "Clip-Cov/KL-Cov (verl), or a lower learning rate."
        ),
    ),
    Rule(
        code="GRP402",
        category="length-truncation",
        name="many responses cut at the length limit",
        title=(
            "{frac:.0%} of responses end without EOS (cut at the length limit)"
        ),
        evidence=("seq/no_eos_frac",),
        thresholds=("NO_EOS_INFO", "NO_EOS_WARNING", "NO_EOS_ERROR"),
        severity=(
            "`error` from {NO_EOS_ERROR:%} of sequences without EOS, `warning` from {NO_EOS_WARNING:%}, `info` from "
            "{NO_EOS_INFO:%}."
        ),
        meaning=(
            "Responses hit the generation limit instead of ending."
        ),
        why=(
            "Truncated responses get rewards for unfinished answers and their last tokens are trained towards text "
            "that was cut; a high share biases the policy towards length or penalises it arbitrarily."
        ),
        detection=(
            "`seq/no_eos_frac` (the `eos` column, else response length ≥ `--max-new-tokens`), per step from "
            "`diag/by_step` `no_eos_frac`. Measured: healthy 0.03–0.06 (0.16 at temperature 0.7: longer responses, "
            "`info`); EOS suppressed: 1.00 (100 %), 0.34 (30 %)."
        ),
        fix=(
            "Raise the limit (AReaL `max_new_tokens`, verl `data.max_response_length`, TRL `max_completion_length`), "
            "or keep truncated responses out of the loss (TRL `mask_truncated_completions`, AReaL "
            "`mask_no_eos_with_zero`) or shape their reward (AReaL `overlong_reward_penalty`, DAPO's overlong "
            "penalty)."
        ),
    ),
)
"""The rules of this family, in code order."""

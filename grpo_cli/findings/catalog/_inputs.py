"""The GRP1xx rules: how the dump was written — alignment, temperature, truncated sampling, the loss mask, the
reference policy, duplicated sequences."""

from __future__ import annotations

from grpo_cli.findings.catalog._rule import Rule

RULES = (
    Rule(
        code="GRP101",
        category="alignment",
        name="old_logp shifted against new_logp",
        title=(
            "old_logp looks one token {side} against new_logp in {frac:.1%} of sequences"
        ),
        evidence=("diag/shift_seq_{side}_frac", "diag/shift_abs_diff_0", "diag/shift_abs_diff_{shift}"),
        thresholds=("SHIFT_SEQ_WARNING", "SHIFT_SEQ_ERROR", "MIN_FLAGGED_SEQUENCES"),
        severity=(
            "`error` when at least {SHIFT_SEQ_ERROR:%} of the sequences agree better at a one-token shift, `warning` "
            "from {SHIFT_SEQ_WARNING:%}, `info` below, with fewer than {MIN_FLAGGED_SEQUENCES} such sequences, or on "
            "a small dump."
        ),
        meaning=(
            "`old_logp` (the engine's log-probs) is one token late or early against `new_logp`: value t belongs to "
            "token t − 1 or t + 1. The title says which way."
        ),
        why=(
            "Every importance weight, KL and clip decision then compares a token's training log-prob with its "
            "neighbour's behaviour log-prob: the ratio is noise of order e^±1.5, and the loss optimises the wrong "
            "objective."
        ),
        detection=(
            "For each sequence, the mean |new_t − old_(t+s)| over pairs of loss-mask tokens of that sequence, for s "
            "∈ {{−1, 0, +1}} (`diag/shift_abs_diff_{{m1,0,p1}}` overall). A sequence prefers a shift when its "
            "shift-s mean is below half its shift-0 mean and the shift-0 mean is above 0.02 nats (sequences whose "
            "columns already agree prefer nothing), with at least 3 pairs per shift. Figures: "
            "`diag/shift_seq_late_frac`, `diag/shift_seq_early_frac` (threshold {SHIFT_SEQ_WARNING} warning, "
            "{SHIFT_SEQ_ERROR} error); `where` lists `diag/shift_top` (the sequences with the largest gain). "
            "Measured: healthy presets 0.00; the fault at 100 % gives 1.00, at 30 % 0.30 (the shift-0 mean rises "
            "from 0.025 to 1.74 nats while the shifted mean is 0.024)."
        ),
        fix=(
            "Write every per-token column with the same alignment: value t belongs to token t. Next-token-aligned "
            "tensors (AReaL's loss inputs, OpenRLHF's `[B, T − 1]` action tensors, twinkle) must be un-rolled once: "
            '`RolloutWriter(alignment="next_token")` when writing, `--preset areal|openrlhf|twinkle` when reading. '
            "If only some sequences are affected, look at the worker or code path that fills `old_logp` for them "
            "(for example a response-only engine output placed one slot off against the prompt)."
        ),
    ),
    Rule(
        code="GRP102",
        category="temperature",
        name="behaviour and training log-probs at different temperatures",
        title=(
            "old_logp is tilted against new_logp (slope {slope:.2f}): behaviour and training log-probs look computed "
            "at different temperatures (ratio ≈ {ratio:.2f})"
        ),
        evidence=(
            "diag/lag0_old_vs_new_slope",
            "diag/old_vs_new_slope",
            "diag/old_vs_new_intercept",
            "diag/old_gt_new_frac",
        ),
        thresholds=("SLOPE_WARNING", "SLOPE_ERROR", "SLOPE_MIN_LAG0"),
        severity=(
            "`error` when |b − 1| ≥ {SLOPE_ERROR}, `warning` from {SLOPE_WARNING}, where b is the slope of old "
            "against new."
        ),
        meaning=(
            "The engine's log-probs and the trainer's come from distributions at different temperatures: the "
            "relation between them is tilted (b ≈ T_train/T_behaviour to first order), not shifted."
        ),
        why=(
            "Every weight exp(new − old) is then biased by a factor that grows with how unlikely the token is; clip "
            "decisions and importance corrections act on that bias, and the policy is trained towards a distribution "
            "the engine does not sample from."
        ),
        detection=(
            "The least-squares line old ≈ a + b·new over lag-0 valid tokens (`diag/lag0_old_vs_new_slope`, when at "
            "least {SLOPE_MIN_LAG0} lag-0 tokens exist; otherwise over all valid tokens, `diag/old_vs_new_slope`). "
            "Lag-0 tokens are used because at lag > 0 the policy's own drift (an entropy that falls between "
            "versions) tilts the line too. Measured: healthy presets b = 0.999–1.001 (bf16 noise lies in old, so it "
            "does not dilute b); engine at 0.6, trainer at 1.0: b = 1.33 (100 %), 1.10 (30 %)."
        ),
        fix=(
            "Use the sampling temperature on both sides: the trainer divides the logits by the rollout temperature "
            "before log_softmax (AReaL `temperature` in the actor config, verl `rollout.temperature`, TRL "
            "`temperature`, slime `--rollout-temperature`, OpenRLHF `--temperature`), and the engine reports "
            "log-probs at that temperature: vLLM's default `raw_logprobs` are pre-temperature, "
            "`logprobs_mode=processed_logprobs` applies it (verl sets it by default); SGLang returns "
            "temperature-scaled log-probs unless `SGLANG_RETURN_ORIGINAL_LOGPROB` is set."
        ),
    ),
    Rule(
        code="GRP103",
        category="truncated-sampling",
        name="behaviour log-probs renormalised over a truncated set",
        title=(
            "old_logp sits above new_logp on nearly every token in {frac:.0%} of sequences (mean +{shift:.3f} nats): "
            "behaviour log-probs look renormalised over a top-p/top-k set"
        ),
        evidence=("diag/onesided_seq_frac", "diag/seq_old_minus_new_mean", "diag/old_gt_new_frac"),
        thresholds=("ONESIDED_WARNING", "ONESIDED_ERROR", "ONESIDED_MIN_SHIFT"),
        severity=(
            "`error` when at least {ONESIDED_ERROR:%} of the sequences are one-sided, `warning` from "
            "{ONESIDED_WARNING:%}, provided the mean old − new over sequences is at least {ONESIDED_MIN_SHIFT} nats; "
            "`info` when its 95 % interval reaches {ONESIDED_MIN_SHIFT}."
        ),
        meaning=(
            "The engine samples from a top-p/top-k/min-p set and reports log-probs renormalised over it, while the "
            "trainer scores the full softmax: log π_engine = log π − log S with S ≤ 1 the kept mass, so old sits "
            "above new on nearly every token."
        ),
        why=(
            "The importance ratio π_θ/π_old is scaled by the kept mass on every token (the log-ratio is offset by "
            "log S): corrections and clipping see a bias that is not a policy change, and tokens outside the kept "
            "set can never be corrected for."
        ),
        detection=(
            "Per sequence with ≥ 8 valid tokens: the fraction of tokens with old > new; a sequence is one-sided at ≥ "
            "95 % (`diag/onesided_seq_frac`); plus the mean over sequences of each sequence's mean old − new with "
            "its 95 % interval (`diag/seq_old_minus_new_mean`, `diag/seq_old_minus_new_ci`). Healthy sequences are "
            "one-sided with probability about 2⁻⁸. Measured: healthy ≤ 0.003 (mean −0.003 to 0.001); top-p 0.8: 0.99 "
            "at 100 % (mean +0.18), 0.34 at 30 % (+0.056). When GRP102 also fires, read both: a colder engine lifts "
            "confident tokens too."
        ),
        fix=(
            "Score the same truncated distribution in the trainer (slime replays the top-p set with "
            "`--rollout-top-p`), or take the engine's full-softmax log-probs (vLLM `logprobs_mode=raw_logprobs`, "
            "with the temperature applied in the trainer), or sample without truncation (top_p = 1, top_k = −1). "
            "With top-p < 1 and renormalised log-probs, a gap between behaviour and proximal policy is expected, not "
            "a bug; the fix is to make both sides agree on the distribution."
        ),
    ),
    Rule(
        code="GRP104",
        category="mask",
        name="prompt or padding tokens in the loss",
        title=(
            "loss_mask covers prompt or padding tokens: {what}"
        ),
        evidence=(
            "diag/prompt_in_loss_frac",
            "diag/old_zero_new_nonzero_frac",
            "diag/trailing_zero_seq_frac",
        ),
        thresholds=("MASK_FRAC_WARNING", "MASK_FRAC_ERROR", "MASK_SEQ_WARNING"),
        severity=(
            "the worst of: prompt tokens in the loss and engine log-probs of exactly 0 (fractions of valid tokens, "
            "`warning` ≥ {MASK_FRAC_WARNING}, `error` ≥ {MASK_FRAC_ERROR}); sequences ending in a run of exact-zero "
            "log-probs (`warning` ≥ {MASK_SEQ_WARNING}, `error` ≥ {MASK_FRAC_ERROR:*4}); `info` for any below those."
        ),
        meaning=(
            "`loss_mask` = 1 on tokens that are not generated response tokens: prompt tokens, or padding."
        ),
        why=(
            "Prompt tokens were not sampled by the policy, so their ratio and advantage terms are meaningless and "
            "dilute token means; padding with log-prob 0 looks like certain tokens and pulls every mean towards 0."
        ),
        detection=(
            "With `versions`: valid tokens whose version is < 0 (`diag/prompt_in_loss_frac`). Without: valid tokens "
            "where `old_logp` is exactly 0 while `new_logp` < −1 (`diag/old_zero_new_nonzero_frac`; an engine that "
            "returned no log-prob; the −1 gap keeps top-p renormalisation, which gives 0 only to a token of "
            "probability ≥ top_p, out), and sequences whose last valid tokens form a run (≥ 2) of exact zeros in new "
            "and old (`diag/trailing_zero_seq_frac`). Healthy dumps have exactly 0 of each. Measured: prompt in the "
            "loss 0.36 (100 %) and 0.15 (30 %) of valid tokens; padding: trailing runs in 100 % / 31 % of sequences. "
            "`where` lists `diag/mask_top` (sequences by suspicious tokens). Engine zeros that are the fill of a "
            "shifted column are capped at `info` while GRP101 stands."
        ),
        fix=(
            "Build `loss_mask` from the response positions only (1 on generated tokens including EOS, 0 on prompt "
            "and padding): verl `response_mask`, TRL `completion_mask`, slime `loss_masks`, OpenRLHF `action_mask`, "
            "AReaL `loss_mask` (rolled with the log-probs). Padding belongs at mask 0, not at log-prob 0.0 under a 1."
        ),
    ),
    Rule(
        code="GRP105",
        category="mask",
        name="response tokens missing from the loss",
        title=(
            "loss_mask misses response tokens: {frac:.1%} of generated tokens are outside the loss"
        ),
        evidence=("diag/generated_masked_frac", "diag/mask_hole_frac"),
        thresholds=("MASK_FRAC_WARNING", "MASK_FRAC_ERROR", "HOLE_INFO"),
        severity=(
            "`error` when ≥ {MASK_FRAC_ERROR:%} of generated tokens are outside the loss, `warning` from "
            "{MASK_FRAC_WARNING:%}, `info` for any below; without `versions`, `info` when masked tokens inside "
            "response spans reach {HOLE_INFO:%} of valid tokens."
        ),
        meaning=(
            "Tokens the engine generated (version ≥ 0) in sequences that do enter the loss have `loss_mask` = 0."
        ),
        why=(
            "Those tokens get no gradient: the policy is trained on fragments of its own samples, and the token-mean "
            "denominators no longer match the trainer's."
        ),
        detection=(
            "`diag/generated_masked_frac` = generated tokens with mask 0 in sequences with at least one valid token "
            "/ generated tokens of those sequences (whole sequences filtered out are legitimate and not counted). "
            "Without versions, `diag/mask_hole_frac` counts masked tokens between a sequence's first and last valid "
            "token; multi-turn dumps mask tool output there legitimately, hence only `info`. Measured: healthy 0; a "
            "quarter of the response tokens dropped: 0.25 (100 %), 0.076 (30 %)."
        ),
        fix=(
            "Set `loss_mask` = 1 on every generated token of a kept sequence; only tool/environment output in "
            "multi-turn rollouts and whole filtered sequences belong at 0. Check the code that edits the mask in "
            "flight (rejection sampling, truncation masks) and dump the mask before such edits."
        ),
    ),
    Rule(
        code="GRP106",
        category="reference",
        name="ref_logp is not a reference policy",
        title=(
            "ref_logp equals {column}_logp bitwise on {frac:.0%} of tokens: it is not a reference policy"
        ),
        evidence=("diag/equal_frac/{column}_ref", "diag/zero_frac/ref_logp"),
        thresholds=("REF_EQUAL_WARNING", "REF_EQUAL_ERROR", "REF_ZERO_ERROR"),
        severity=(
            "`error` when `ref_logp` equals another column on ≥ {REF_EQUAL_ERROR:%} of valid tokens or is exactly 0 "
            "on ≥ {REF_ZERO_ERROR:%}; `warning` from {REF_EQUAL_WARNING:%} equality; capped at `info` when the dump "
            "holds step 0 only and the equal column is `new_logp`."
        ),
        meaning=(
            "`ref_logp` is bitwise equal to `new_logp`, `old_logp` or `prox_logp`, or it is all zeros: the reference "
            "model was never run, or the wrong tensor was written."
        ),
        why=(
            "The KL penalty to the reference is then zero or measures the wrong thing; a run that relies on it for "
            "stability has none."
        ),
        detection=(
            "`diag/equal_frac/<a>_ref`: the fraction of valid tokens where the columns are bitwise equal and not 0 "
            "(zeros say nothing about which policy produced a column); `diag/zero_frac/ref_logp`. A reference that "
            "differs from the policy by any training step matches on ~0 tokens. Measured: healthy 0.00; copies of "
            "old/new: 1.00 (100 %), 0.29 (30 %)."
        ),
        fix=(
            "Run the reference model for `ref_logp` (verl with `use_kl_loss`/`use_kl_in_reward` and a reference "
            "worker; TRL loads it when `beta` > 0; AReaL fills zeros when no reference model is configured, so write "
            "no `ref_logp` then), and check that the dump writes the reference tensor, not the actor's or the "
            "engine's."
        ),
    ),
    Rule(
        code="GRP107",
        category="duplicates",
        name="sequences counted more than once",
        title=(
            "{n} sequences repeat a (step, seq_id) already seen ({frac:.1%} of sequences)"
        ),
        evidence=("diag/dup_id_extra", "diag/dup_id_frac", "diag/dup_content_frac"),
        thresholds=("DUP_ID_ERROR", "DUP_CONTENT_WARNING"),
        severity=(
            "a repeated (step, seq_id) is a `warning` at any count and an `error` from {DUP_ID_ERROR:%} of the "
            "sequences; without `seq_id`, identical sequences (every token's new and old log-prob) from "
            "{DUP_CONTENT_WARNING:%} are a `warning`; with distinct seq_ids they are `info` (identical samples of "
            "one prompt)."
        ),
        meaning=(
            "The same sequence appears several times in the dump: two ranks wrote the same shard, a step was retried "
            "and appended, or several forwards of one sequence (PPO epochs) were all written."
        ),
        why=(
            "Every token mean, clip fraction and group statistic counts those sequences twice."
        ),
        detection=(
            "Two keyed tables (one row per distinct key, merged exactly): (step, seq_id) keys and a 52-bit hash of "
            "each sequence's float32 bit patterns of `new_logp` and `old_logp` with their positions "
            "(`grpo_cli.core.diagnosis.sequence_hash`). `diag/dup_id_extra`, `diag/dup_id_frac`, "
            "`diag/dup_content_frac`; `where` gives two locations (file, row) of each repeated key "
            "(`diag/dup_where`). Memory: 64 bytes per sequence. Measured: healthy 0 (the strictly on-policy preset "
            "has 2.2 % identical samples with distinct seq_ids); 30 % of groups written twice: 0.24 of the rows "
            "repeat."
        ),
        fix=(
            "Write each sequence once per step: one writer per rank with a distinct `rank`, no re-write after a "
            "retried step, `RolloutWriter(dedupe=True)` when a sequence is seen by several forwards (PPO epochs). "
            "Deduplicate the dump before trusting token means."
        ),
    ),
)
"""The rules of this family, in code order."""

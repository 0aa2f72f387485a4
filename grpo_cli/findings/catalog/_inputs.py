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
        thresholds=("SHIFT_SEQ_WARNING", "SHIFT_SEQ_ERROR"),
        severity=(
            "`error` when the 95 % (Wilson) interval of the fraction of sequences that agree better at a one-token "
            "shift lies at or above {SHIFT_SEQ_ERROR:%}, `warning` above {SHIFT_SEQ_WARNING:%}, `inconclusive` when "
            "only the estimate does (two sequences of a hundred), `info` below."
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
            "∈ {{−1, 0, +1}} (`diag/shift_abs_diff_{{m1,0,p1}}` overall); with `versions`, over lag-0 tokens only "
            "(a stale token of a fast-moving policy can agree better with a neighbour by chance, a lag-0 token only "
            "when the column is shifted). A sequence prefers a shift when its "
            "shift-s mean is below half its shift-0 mean and the shift-0 mean is above 0.02 nats (sequences whose "
            "columns already agree prefer nothing), with at least 3 pairs per shift. Figures: "
            "`diag/shift_seq_late_frac`, `diag/shift_seq_early_frac` (threshold {SHIFT_SEQ_WARNING} warning, "
            "{SHIFT_SEQ_ERROR} error), graded by their Wilson interval; `where` lists `diag/shift_top` (the "
            "sequences with the largest gain). Short re-tokenised sequences can look shifted too: when no more "
            "sequences prefer a shift than twice those GRP108 flags, GRP108 is the cause. Measured on the simulator: "
            "healthy 0.00; the fault at 100 % gives 1.00, at 30 % 0.30; on the corpus the same."
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
            "behaviour log-probs are tilted against training log-probs in both regression directions: sampled at "
            "{ratio:.2f}× the training temperature (T_behaviour/T_train, 95 % {low:.2f}–{high:.2f}; {partner} at "
            "{scope})"
        ),
        evidence=(
            "diag/temperature_ratio",
            "diag/pair_slope_old_on_new",
            "diag/pair_slope_new_on_old_inverse",
            "diag/pair_d_likely",
            "diag/pair_d_unlikely",
        ),
        thresholds=("TEMPERATURE_WARNING", "TEMPERATURE_ERROR"),
        severity=(
            "`error` when the 95 % interval of the temperature ratio r = T_behaviour/T_train lies beyond a factor "
            "1 + {TEMPERATURE_ERROR} from 1 (|ln r| ≥ ln(1 + {TEMPERATURE_ERROR})), `warning` beyond 1 + "
            "{TEMPERATURE_WARNING}, `inconclusive` when the estimate is beyond 1 + {TEMPERATURE_WARNING} but its "
            "interval is not; nothing unless both one-sided slopes lie on the same side of 1."
        ),
        meaning=(
            "The engine's log-probs and the trainer's come from distributions at different temperatures: within a "
            "context, y = log softmax(z/T_b) against x = log softmax(z/T_t) is exactly the line y = (T_t/T_b)·x + c. "
            "The title gives r = T_b/T_t: 0.70 means the engine sampled (and reported log-probs) at 0.7 while the "
            "trainer scored at 1."
        ),
        why=(
            "Every weight exp(new − old) is then biased by a factor that grows with how unlikely the token is; clip "
            "decisions and importance corrections act on that bias, and the policy is trained towards a distribution "
            "the engine does not sample from."
        ),
        detection=(
            "The pair is the behaviour log-prob y (`old_logp`) and the training log-prob x of the same token under the "
            "same weights: lag-0 tokens (every token when the dump has no versions), x = `new_logp` or `prox_logp`, "
            "whichever is closer to `old_logp` (`diag/pair_partner`: AReaL-style dumps recompute `prox_logp` with the "
            "engine's weights while `new_logp` carries the step's minibatch updates). Tokens with |y − x| > 4 nats "
            "(re-tokenised, broken) are left out. Noise in either column attenuates the least-squares slope of the "
            "other (errors in variables), so the tilt must hold in both directions: b_yx = cov/var(x) "
            "(`diag/pair_slope_old_on_new`) and b_xy⁻¹ = var(y)/cov (`diag/pair_slope_new_on_old_inverse`) must both "
            "lie on the same side of 1 with their intervals. The estimate is their geometric mean b = sd(y)/sd(x) and "
            "r = 1/b (`diag/temperature_ratio`). The offset c of a context grows with its flatness and would bias "
            "every slope towards 1 (about 5 % at r = 0.7 on a peaked policy); when the dump has the trainer's "
            "`entropy`, x and y are first residualised on it (Frisch–Waugh), which removes that bias. Intervals: "
            "delete-a-block jackknife over 20 hash blocks of GRPO groups, at least ±3 % of r (the entropy stands in "
            "for the offset only approximately). Renormalisation over a truncated set lifts every token and can "
            "flatten the line (slope below 1) but never steepen it: a flatter tilt together with a conclusive "
            "one-sided lift (GRP103) is explained by the truncation, a steeper one is a colder engine. "
            "Measured on the corpus: healthy runs r = 1.00 ± 0.01 (T = 1 and T = 0.7 on both sides, lags "
            "0–6, bf16 against fp32); engines at 0.7, 0.85 and 1.3 read 0.70, 0.85 and 1.30."
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
            "behaviour log-probs sit above training log-probs on likely and unlikely tokens alike ({frac:.0%} of "
            "each, likely tokens +{shift:.3f} nats at {scope}): they look renormalised over a top-k/top-p set"
        ),
        evidence=("diag/pair_onesided", "diag/pair_d_likely", "diag/pair_d_unlikely"),
        thresholds=("ONESIDED_WARNING", "ONESIDED_ERROR"),
        severity=(
            "`error` when the 95 % interval of the one-sided fraction lies at or above {ONESIDED_ERROR}, `warning` "
            "above {ONESIDED_WARNING}, `inconclusive` when only the estimate does; nothing unless the mean excess is "
            "positive on likely and unlikely tokens."
        ),
        meaning=(
            "The engine sampled from a truncated set (top-k, top-p, min-p) and reported log-probs renormalised over "
            "it, while the trainer scores the full softmax: every sampled token's behaviour log-prob is lifted by "
            "−log(kept mass)."
        ),
        why=(
            "The importance ratio π_θ/π_old is scaled by the kept mass on every token (the log-ratio is offset by "
            "log S): corrections and clipping see a bias that is not a policy change, and tokens outside the kept "
            "set can never be corrected for."
        ),
        detection=(
            "On the same pairs as GRP102 (lag 0, the same-weights training log-prob, |y − x| ≤ 4), the fraction of "
            "tokens with y > x among likely tokens (trainer p ≥ 1/2) and among unlikely ones; the statistic "
            "`diag/pair_onesided` is the smaller of the two (a bin of fewer than 10 tokens is left out). Numerical "
            "noise gives ≈ 0.5 in both; a temperature lifts one bin and sinks the other (≤ 0.1 in one); "
            "renormalisation lifts both (≈ 1). The mean excess per bin is `diag/pair_d_likely` and "
            "`diag/pair_d_unlikely`. Measured on the corpus (a peaked policy after SFT, most sampled tokens p > 0.9): "
            "healthy 0.45–0.6; top-k 2 and top-p 0.9 give 1.00. A colder engine lifts every likely token as well "
            "(and a peaked policy samples few others), but it steepens the line (GRP102's slopes above 1), which "
            "renormalisation cannot: then GRP102 is the cause and this finding is capped."
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
            "ref_logp equals {other}_logp bitwise on {frac:.0%} of the tokens of {steps}: it is not a reference "
            "policy"
        ),
        variants={"zero": "ref_logp is exactly 0 on {frac:.0%} of tokens: no reference model was run"},
        evidence=(
            "diag/by_step[ref_equal_{other}] later half", "diag/equal_frac/{other}_ref", "diag/zero_frac/ref_logp",
        ),
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
            "Per step, the valid tokens where `ref_logp` equals `new_logp`, `old_logp` or `prox_logp` bitwise and is "
            "not 0 (zeros say nothing about which policy produced a column), pooled over the later half of the "
            "dump's steps, from its third step on: a reference that is the policy's initial weights equals the "
            "policy in the first steps, before the first update (and the proximal policy one step longer), and "
            "never after. A dump of two steps says nothing. Without a step column, the dump-wide "
            "`diag/equal_frac/<a>_ref`. Also "
            "`diag/zero_frac/ref_logp` (AReaL's placeholder). Measured on the corpus: healthy runs 0.00 on the later "
            "steps (0.25 dump-wide, all from steps 0–1); a dump whose `ref_logp` is the actor's tensor: 1.00."
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
        variants={"content": "{frac:.1%} of sequences repeat another sequence's log-probs exactly"},
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
    Rule(
        code="GRP108",
        category="retokenization",
        name="the trainer scored other tokens than the engine sampled",
        title=(
            "{frac:.1%} of sequences ({n}) hold a token the engine found likely and the trainer scores ≥ 5 nats lower "
            "({tokens} tokens): the trainer scores re-tokenised text"
        ),
        evidence=("diag/retok_seq_frac", "diag/retok_n_tokens"),
        thresholds=("RETOK_WARNING", "RETOK_ERROR"),
        severity=(
            "`error` when the 95 % (Wilson) interval of the fraction of sequences lies at or above {RETOK_ERROR:%}, "
            "`warning` above {RETOK_WARNING:%}, `inconclusive` when only the estimate does, `info` for fewer."
        ),
        meaning=(
            "Between the engine and the trainer the response was decoded to text and encoded again (multi-turn "
            "chat templates, tool output, a tokenizer that merges differently), so at some positions the trainer's "
            "token id is not the one the engine sampled: its `new_logp` scores a token the policy never chose."
        ),
        why=(
            "The importance ratio of such a token is e^−10 or smaller and the loss pushes up a token the policy "
            "did not produce; every position after it is conditioned on a different context, so the whole "
            "sequence's figures are wrong, and the ratio tails (GRP203) and disagreement (GRP202) follow from it."
        ),
        detection=(
            "A generated token is re-tokenised when the engine's probability of it is at least 0.2 (`old_logp` ≥ "
            "log 0.2) and the trainer's `new_logp` is at least 5 nats lower, on same-weights tokens (lag 0, or every "
            "token without versions: a learning-rate spike can move a stale token by e^5, nothing moves a lag-0 "
            "one so far). `diag/retok_seq_frac` is the fraction of sequences with such a token among those with "
            "lag-0 tokens (Wilson interval), `where` lists the sequences with the most (`diag/retok_top`). "
            "Measured on the corpus: healthy runs 0; one worker of four re-tokenising 40 % to 100 % of its "
            "responses gives 0.10 to 0.25."
        ),
        fix=(
            "Train on the engine's token ids, never on re-encoded text: keep the sampled `token_ids` from the "
            "rollout (vLLM/SGLang return them) and build the training batch from them (verl and slime keep the "
            "rollout's response ids; in multi-turn or agentic loops append each turn's ids rather than re-applying "
            "the chat template to the whole conversation, as TRL's and verl's multi-turn rollouts do). Check the "
            "rows in `where`: the first mismatching position is where the two tokenisations diverge."
        ),
    ),
)
"""The rules of this family, in code order."""

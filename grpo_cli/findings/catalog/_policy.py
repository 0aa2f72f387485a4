"""The GRP2xx rules: trainer against inference engine and off-policy data — weight sync, numeric mismatch,
importance weights, staleness, the proximal approximation, clipping."""

from __future__ import annotations

from grpo_cli.findings.catalog._rule import Rule

RULES = (
    Rule(
        code="GRP201",
        category="weight-sync",
        name="train/inference disagreement grows step by step at lag 0",
        title=(
            "train/inference disagreement at recorded lag 0 grows step by step ({series} {first:.3f} → {last:.3f} "
            "nats, fitted ×{ratio:.1f}) while the recorded lag does not: the engine seems to sample with stale "
            "weights"
        ),
        evidence=(
            "diag/by_step[{series}] fitted last/first",
            "diag/by_step[{series}] fitted rise",
            "diag/by_step[{series}] rank correlation with step",
        ),
        thresholds=(
            "SYNC_RATIO_WARNING",
            "SYNC_RATIO_ERROR",
            "SYNC_MIN_RISE",
            "SYNC_MIN_SEQ_RISE",
            "SYNC_RANK_CORR",
            "SYNC_LAG_DRIFT",
            "SYNC_LAG0_SPREAD",
            "SYNC_DRIFT_RATIO",
        ),
        severity=(
            "`error` when the fitted line through a per-step series rises ×{SYNC_RATIO_ERROR}, `warning` from "
            "×{SYNC_RATIO_WARNING}, provided the rise is at least {SYNC_MIN_RISE} nats and the series' rank "
            "correlation with the step is ≥ {SYNC_RANK_CORR}; capped at `info` when the recorded lag rises by more "
            "than {SYNC_LAG_DRIFT} too, or when the dump has no versions."
        ),
        meaning=(
            "At recorded lag 0 the engine should sample with the trainer's weights; a disagreement that grows with "
            "every step while the recorded lag stays flat means the engine keeps older weights than its version "
            "stamp claims."
        ),
        why=(
            "The run is more off-policy than every staleness figure says, and corrections keyed to the recorded lag "
            "do not correct it. A public comparison of two rollout engines under slime showed "
            "`train_rollout_logprob_abs_diff` flat at ~0.011 on one and climbing to ~0.036 over 30 steps on the "
            "other: a trend is the signature of a sync problem, a constant level that of numerics (GRP202)."
        ),
        detection=(
            "Three per-step series (`diag/by_step`, `diag/by_step_lag`):\n"
            "\n"
            "- `lag0_seq_max`: the largest per-sequence mean |new − old| over lag-0 tokens (sequences with ≥ 4 of "
            "them) — the worst engine of the step, which one broken worker sets whatever its share of the batch;\n"
            "- `lag0_abs_diff_mean`: the step's lag-0 mean (from `--group-by step` figures: the lag-0 row of "
            "`by_staleness`);\n"
            "- `lag_excess`: the largest excess of a sequence's mean |new − old| over the median (over steps) at its "
            "own lag. A stale engine raises the disagreement at every lag, so this shows the broken worker even in "
            "steps where it produced no lag-0 sequence. It is used only with lag-0 evidence (some step's worst lag-0 "
            "sequence ≥ {SYNC_LAG0_SPREAD}× another step's) while the policy's own change per version, mean |new − "
            "prox| per step, stays flat (fitted ratio < {SYNC_DRIFT_RATIO}), and its rise must exceed that change's "
            "median: a larger policy step (GRP206, GRP401) raises the lag > 0 disagreement too.\n"
            "\n"
            "For each series with ≥ 4 steps: the Spearman rank correlation with the step (≥ {SYNC_RANK_CORR}) and "
            "the least-squares line's first and last value (ratio ≥ {SYNC_RATIO_WARNING}, rise ≥ {SYNC_MIN_RISE} "
            "nats). The recorded lag's trend comes from `lag_mean` (or `staleness/theta_mean` per step). Measured: "
            "healthy worst-sequence series 0.011 → 0.012 (flat; no warning over 24 healthy dumps with six seeds); an "
            "engine falling one version further behind every step: 0.014 → 0.12 at 100 % and at 30 % (×8); at 30 % "
            "the fault is found with three other seeds as well, where the lag-0 series alone misses it in two (the "
            "broken worker has no lag-0 sequence in some steps)."
        ),
        fix=(
            "Check the weight update of the inference engine after every optimiser step: the refit/broadcast "
            "succeeded on every engine and rank, and the version counter is bumped only after the new weights are "
            "loaded (AReaL `update_weights` then `set_version`; the rollout weight sync in verl and slime). A stale "
            "engine whose version stamp advances looks exactly like this. The sequences in `where` are the worst "
            "lag-0 sequences: if one worker is affected, its sequences lead."
        ),
    ),
    Rule(
        code="GRP202",
        category="mismatch",
        name="train/inference disagreement above bf16 level",
        title=(
            "train/inference disagreement at {scope} is above bf16 level: mean exp(|old − same-weights training "
            "log-prob|) = {error:.3f}, {frac:.0%} of lag-0 sequences above 0.1 nats"
        ),
        evidence=(
            "diag/pair_mult_prob_error",
            "diag/lag0_big_seq_frac",
        ),
        thresholds=("MULT_ERROR_WARNING", "MULT_ERROR_ERROR", "BIG_SEQ_WARNING"),
        severity=(
            "`error` when the 95 % interval of NeMo RL's multiplicative probability error lies at or above "
            "{MULT_ERROR_ERROR}, `warning` above {MULT_ERROR_WARNING}; `warning` also when the (Wilson) interval of "
            "the share of lag-0 sequences with a mean |new − old| above 0.1 nats lies above {BIG_SEQ_WARNING:%}; "
            "`inconclusive` when only an estimate does; `info` without versions (staleness cannot be separated from "
            "numerics)."
        ),
        meaning=(
            "Tokens sampled with the trainer's own weights (lag 0) get log-probs from the engine that differ from "
            "the trainer's more than bf16 inference explains."
        ),
        why=(
            'Published analyses of RL collapse from train/inference mismatch (2025: "Your efficient RL framework '
            'secretly brings you off-policy RL training"; "When speed kills stability") show the mismatch '
            "concentrating on low-probability tokens and growing over training; uncorrected, it biases the gradient."
        ),
        detection=(
            "On the pairs of GRP102 (each behaviour log-prob against the training log-prob of the same weights: lag "
            "0, `new_logp` or `prox_logp`, whichever is closer), `diag/pair_mult_prob_error` = mean exp(|old − x|) "
            "(the metric NeMo RL's model-validation guide uses; 1 = identical), with a jackknife interval over blocks "
            "of GRPO groups; `diag/lag0_big_seq_frac` finds one broken worker among healthy ones. Staleness and the "
            "step's own updates never enter. Healthy corpus runs (bf16 engine, fp32 trainer): 1.01–1.03; "
            "{MULT_ERROR_WARNING} is about twice the healthy excess. Measured: an int4-quantised engine gives "
            "≈ 1.1 on every worker."
        ),
        fix=(
            "Find the numerical difference between engine and trainer: precision (bf16/fp8), attention and fused "
            "kernels, MoE routing, a sampling parameter applied on one side (NeMo RL's model-validation guide lists "
            "these). Meanwhile correct for it: verl rollout correction (`rollout_is`, `rollout_is_threshold`, "
            "`rollout_rs`), TRL `vllm_importance_sampling_correction` (`vllm_importance_sampling_mode`, "
            "`vllm_importance_sampling_clip_max`), slime `--use-tis --tis-clip`, OpenRLHF "
            "`enable_vllm_is_correction` (`vllm_is_correction_type`), AReaL `use_decoupled_loss` with "
            "`rejection_sampling`."
        ),
    ),
    Rule(
        code="GRP203",
        category="importance-weights",
        name="heavy-tailed importance weights",
        title=(
            "importance weights exp(x − old) against the same-weights training log-prob ({partner}, {scope}) are "
            "heavy-tailed: {frac:.2%} of tokens outside [0.5, 2]"
        ),
        evidence=(
            "diag/pair_tail_frac",
            "is/ess",
        ),
        thresholds=("TAIL_WARNING", "TAIL_ERROR"),
        severity=(
            "`error` when the 95 % interval of the tail fraction lies at or above {TAIL_ERROR:%}, `warning` above "
            "{TAIL_WARNING:%}, `inconclusive` when only the estimate does. A mismatch finding (GRP202) or a cause "
            "before it explains the tail and caps this one."
        ),
        meaning=(
            "A small share of tokens carries most of the importance weight: some behaviour log-probs are far below "
            "(or above) the trainer's."
        ),
        why=(
            "Token-level ratio tails matter more than the mean: a few tokens with weights of 10–10⁸ dominate the "
            "gradient or are clipped away silently (users of OpenRLHF have reported on-policy ratios jumping from ≈ "
            "1 to 5e8)."
        ),
        detection=(
            "The weight is judged on the ratio a correction applies to the engine/trainer part: exp(x − old) with x "
            "the same-weights training log-prob of GRP102's pairs (lag 0; `prox_logp` when it is the closer "
            "column, as in AReaL's decoupled loss). The weights of stale tokens also carry the policy's own change "
            "between versions, which the decoupled loss or rejection sampling corrects by design, so they are not "
            "counted: an asynchronous run with lags 0–6 is quiet. `diag/pair_tail_frac` is the fraction of those "
            "tokens outside [1/2, 2] (verl's `rollout_is_threshold` 2), with a jackknife interval; `is/ess` is "
            "shown for context. `where` lists the first rows of `top_kl`. Measured on the corpus: healthy runs "
            "≤ 0.3 %."
        ),
        fix=(
            "Bound the weights with truncated or masked importance sampling: verl `rollout_is` (token/sequence) with "
            "`rollout_is_threshold` and `rollout_rs`; TRL `vllm_importance_sampling_mode` (token/sequence, "
            "truncate/mask) with `vllm_importance_sampling_clip_max`; slime `--use-tis --tis-clip` (or icepop); "
            "OpenRLHF `vllm_is_correction_type` (`tis`, `icepop`, `seq-mask-tis`) with "
            "`vllm_is_truncated_threshold`; AReaL `rejection_sampling` (level, action mask/clamp, upper). Inspect "
            "the worst tokens first."
        ),
    ),
    Rule(
        code="GRP204",
        category="staleness",
        name="lags beyond what the run corrects",
        title=(
            "{frac:.0%} of generated tokens are more than {limit} versions stale (max lag {lag_max})"
        ),
        variants={"below": "{frac:.1%} of generated tokens have a lag above {limit}"},
        evidence=("lag beyond max_staleness frac", "staleness/theta_max"),
        thresholds=("STALE_WARNING", "STALE_ERROR"),
        severity=(
            "`error` when ≥ {STALE_ERROR:%} of generated tokens have a lag above `max_staleness`, `warning` from "
            "{STALE_WARNING:%}, `info` for any."
        ),
        meaning=(
            "Samples were generated by policies more versions behind the trainer than the run's correction is meant "
            "for."
        ),
        why=(
            "Off-policy corrections (decoupled PPO, truncated IS) are derived for a bounded lag; beyond it the "
            "weights' variance grows and the proximal policy drifts from the behaviour policy."
        ),
        detection=(
            "`staleness/hist` (or `diag/by_lag`): the fraction of generated tokens with lag > "
            "`DetectConfig.max_staleness` (default 4, TRL async `max_staleness`'s default). `where` lists the lags "
            "(rows of `by_staleness`). Measured: healthy max lag 3 (0 beyond 4); a worker with lags 5–12: 1.00 of "
            "generated tokens beyond 4 at 100 %, 0.28 at 30 %."
        ),
        fix=(
            "Bound the lag where samples are produced or dropped (AReaL `max_head_offpolicyness`, TRL async "
            "`max_staleness`) or correct for it (AReaL `use_decoupled_loss` with a recomputed `prox_logp` and "
            "`rejection_sampling`; verl rollout correction, `rollout_is` and `rollout_rs`). Check that the lag the "
            "correction assumes (`--max-staleness` here) is the run's."
        ),
    ),
    Rule(
        code="GRP205",
        category="prox-approximation",
        name="approximated proximal policy beyond its safe lag",
        title=(
            "{frac:.0%} of stale tokens lie beyond the log-linear proximal approximation's safe lag {safe_lag} (max "
            "lag {lag_max})"
        ),
        evidence=("diag/prox_beyond_safe_frac", "diag/prox_loglinear_safe_lag"),
        thresholds=("PROX_BEYOND_WARNING", "PROX_INFO_LAG"),
        severity=(
            "`warning` when the run approximates the proximal policy (`DetectConfig.prox_approximation`) and ≥ "
            "{PROX_BEYOND_WARNING:%} of stale tokens lie beyond the approximation's safe lag; `info` when the run "
            "did not say so, with the same share, and lags reach {PROX_INFO_LAG}."
        ),
        meaning=(
            "AReaL's `prox_logp_method: loglinear` replaces the recomputed proximal log-prob by old + α(new − old), "
            "α = (k − 1)/k; its error grows with the lag k. The dump's recomputed `prox_logp` shows how large it is."
        ),
        why=(
            "An inaccurate proximal policy moves the clip window and the behaviour weight exp(prox − old): the loss "
            "is no longer the decoupled PPO objective."
        ),
        detection=(
            "Per lag bin (`diag/by_lag`), the mean |prox − (old + α(new − old))| over generated valid tokens; the "
            "safe lag (`diag/prox_loglinear_safe_lag`) is the largest k such that every observed lag in [1, k] has a "
            "mean error ≤ 0.01 (compare-prox's default `--tolerance`, the same rule as `prox/<m>/max_safe_lag`); "
            "`diag/prox_beyond_safe_frac` is the share of lag ≥ 1 tokens above it. AReaL's docs advise care above "
            "about 10 steps of staleness. Measured (random-walk drift of 0.04 per version): healthy safe lag 1 with "
            "0.69 of stale tokens beyond it — the tolerance is strict, hence the finding only when the run declares "
            "the approximation; a worker with lags 4–12 and drift 0.1: 1.00 of stale tokens beyond (100 %), 0.77 (30 "
            "%)."
        ),
        fix=(
            "Recompute the proximal policy (AReaL `prox_logp_method: recompute`, the default) or keep lags within "
            "the safe lag (`max_head_offpolicyness`); `grpo-cli compare-prox` reports each method's error by lag "
            "(`prox/<m>/max_safe_lag`). AReaL's docs advise care above about 10 steps of staleness."
        ),
    ),
    Rule(
        code="GRP206",
        category="clipping",
        name="clip fraction signals too large an update",
        title=(
            "clip fraction {value:.0%} (overall {overall:.0%}): updates move the policy too far per step"
        ),
        evidence=("clip/ratio", "max over steps of clip fraction"),
        thresholds=("CLIP_WARNING", "CLIP_ERROR"),
        severity=(
            "`error` when the 95 % (Wilson, over tokens) interval of `clip/ratio` (overall, or on its worst step) lies "
            "at or above {CLIP_ERROR}, `warning` above {CLIP_WARNING}, `inconclusive` when only the estimate does "
            "(59 clipped tokens of 288 on one step are 0.205, interval 0.16–0.25)."
        ),
        meaning=(
            "A large share of tokens have a PPO ratio outside [1 − ε, 1 + ε_high] on the side their advantage "
            "pushes: the policy moves further per step than the clip allows."
        ),
        why=(
            "Clipped tokens give no gradient, so most of the batch is wasted, and the update is driven by the few "
            "unclipped tokens."
        ),
        detection=(
            "`clip/ratio` (base `prox_logp` when present, else `old_logp`) and the per-step clip fraction "
            "(`diag/by_step` `clip_frac`, the same rule with ε = 0.2; `clip/ratio` of `--group-by step`). Measured: "
            "healthy 0.000; a 12× larger version step in the hit versions: 0.22 overall (100 %), 0.08 overall but "
            "0.24 on the worst step (30 %)."
        ),
        fix=(
            "Take smaller policy steps (a lower learning rate; fewer PPO epochs/minibatches per batch: AReaL "
            "`ppo_n_minibatches`, verl `ppo_epochs`/`ppo_mini_batch_size`, TRL `num_iterations`) or check that the "
            "clip range matches the run (verl `clip_ratio_low`/`clip_ratio_high`, AReaL "
            "`eps_clip`/`eps_clip_higher`, slime `--eps-clip`/`--eps-clip-high`)."
        ),
    ),
    Rule(
        code="GRP207",
        category="prox-approximation",
        name="prox_logp is old_logp: the proximal policy was not recomputed",
        title=(
            "prox_logp equals old_logp bitwise on every stale token of {frac:.0%} of stale sequences: the "
            "proximal policy was not recomputed"
        ),
        evidence=("diag/prox_equal_old_seq_frac", "diag/prox_equal_old_n_stale"),
        thresholds=("PROX_EQUAL_WARNING", "PROX_EQUAL_ERROR"),
        severity=(
            "`error` when the 95 % (Wilson) interval of the fraction of stale sequences lies at or above "
            "{PROX_EQUAL_ERROR:%}, `warning` above {PROX_EQUAL_WARNING:%}, `inconclusive` when only the estimate does."
        ),
        meaning=(
            "A decoupled loss (AReaL's decoupled PPO) clips against a proximal policy recomputed by the trainer and "
            "weights by exp(prox − old); here `prox_logp` is the engine's `old_logp`, so the decoupling is off: the "
            "ratio is clipped against the stale behaviour policy and the staleness correction is 1."
        ),
        why=(
            "Every stale token's ratio then carries the whole policy change since it was sampled, the clip range is "
            "spent on staleness instead of on this step's update, and the run behaves as plain PPO on off-policy "
            "data — the failure decoupled PPO exists to prevent."
        ),
        detection=(
            "Over generated tokens with a lag of at least 1 (`versions` needed): a sequence counts when `prox_logp` "
            "equals `old_logp` bitwise on all its stale tokens (a recompute in the trainer's precision never matches "
            "the engine's numerics on every token). `diag/prox_equal_old_seq_frac` is their fraction of the stale "
            "sequences, with a Wilson interval. Lag-0 tokens are not counted: there the two policies coincide and a "
            "trainer may legitimately reuse `old_logp`. Measured on the corpus: healthy runs 0; the fault 1.0."
        ),
        fix=(
            "Recompute the proximal log-probs with the trainer's current weights before the update (AReaL "
            "`use_decoupled_loss: true` with `prox_logp_method: recompute`, the default; in a custom loop, one "
            "no-grad forward of the batch before the first minibatch), and pass that tensor as `prox_logp`. If the "
            "run does not use a decoupled loss, do not dump a `prox_logp` column."
        ),
    ),
)
"""The rules of this family, in code order."""

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
            "train/inference disagreement at lag 0 is above bf16 level: mean exp(|new − old|) = {error:.3f}, "
            "{frac:.0%} of lag-0 sequences above 0.1 nats"
        ),
        evidence=(
            "diag/lag0_mult_prob_error",
            "diag/lag0_big_seq_frac",
            "exp(by_staleness[lag 0].abs_diff/mean)",
            "exp(kl/abs_diff_mean)",
        ),
        thresholds=("MULT_ERROR_WARNING", "MULT_ERROR_ERROR", "BIG_SEQ_WARNING", "MIN_FLAGGED_SEQUENCES"),
        severity=(
            "`error` when NeMo RL's multiplicative probability error at lag 0 is ≥ {MULT_ERROR_ERROR}, `warning` "
            "from {MULT_ERROR_WARNING}; `warning` also when ≥ {BIG_SEQ_WARNING:%} of lag-0 sequences (≥ "
            "{MIN_FLAGGED_SEQUENCES}) have a mean |new − old| above 0.1 nats; `info` without versions (staleness "
            "cannot be separated from numerics)."
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
            "`diag/lag0_mult_prob_error` = mean over lag-0 tokens of exp(|new − old|) (the metric NeMo RL's "
            "model-validation guide uses; 1 = identical) and `diag/lag0_big_seq_frac`. From `analyze`'s keys alone, "
            "exp of the lag-0 row's `abs_diff/mean` in `by_staleness` serves as a lower bound (Jensen); without "
            "versions, exp(`kl/abs_diff_mean`) gives an `info`. Staleness is accounted for by using lag-0 tokens "
            "only. Healthy bf16 level: 1.008 in the simulation (mean |Δ| 0.008), in line with published bf16 stacks "
            "(~0.011); {MULT_ERROR_WARNING} is about 5× the healthy excess. Measured: extra noise of std 0.6 on the "
            "engine's logits: 1.56 (100 %), 1.13 with 24 % of lag-0 sequences above 0.1 nats (30 %)."
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
            "importance weights exp(new − old) are heavy-tailed: {frac:.2%} of {lag0}tokens outside [0.5, 2], ESS "
            "{ess:.2f}"
        ),
        evidence=(
            "diag/by_step[lag0_tail_frac]",
            "is/frac_high + is/frac_low",
            "is/ess",
            "spikes/n_ratio_gt_1e3",
        ),
        thresholds=("TAIL_WARNING", "TAIL_ERROR", "ESS_WARNING", "MIN_FLAGGED_SEQUENCES", "MIN_TOKENS"),
        severity=(
            "`error` when ≥ {TAIL_ERROR:%} of valid tokens have w = exp(new − old) outside [1/2, 2], `warning` from "
            "{TAIL_WARNING:%}; `warning` also when `is/ess` < {ESS_WARNING} or any weight exceeds 10³; `info` with "
            "fewer than about {MIN_FLAGGED_SEQUENCES:*10} tail tokens."
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
            "Existing keys: `is/frac_high` + `is/frac_low` (verl's `rollout_is_threshold` C = 2), `is/ess` (verl's "
            "effective sample size of truncated weights), `spikes/n_ratio_gt_1e3`. With at least "
            "`DetectConfig.min_tokens` ({MIN_TOKENS} by default) lag-0 tokens the tail fraction is taken over lag-0 "
            "tokens only (`lag0_tail_frac` of `diag/by_step`): the weights of stale tokens also carry the policy's "
            "own change between versions, which decoupled PPO or rejection sampling corrects by design. `where` "
            "lists the first rows of `top_kl`. Measured: healthy 0.0000 (ESS ≥ 0.998); 5 % of the hit sequences' "
            "tokens lowered by a heavy-tailed draw: 0.029 (100 %), 0.008 (30 %)."
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
            "`error` when `clip/ratio` (overall, or on any step) is ≥ {CLIP_ERROR}, `warning` from {CLIP_WARNING}."
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
)
"""The rules of this family, in code order."""

"""The findings' thresholds: every number a detector compares a statistic with, each documented here (its reason
or source) and in ``docs/findings.md``'s section of its code."""

from __future__ import annotations

SHIFT_SEQ_WARNING, SHIFT_SEQ_ERROR = 0.02, 0.10
"""GRP101: fraction of sequences agreeing better at a one-token shift (healthy simulated dumps: 0)."""
TEMPERATURE_WARNING, TEMPERATURE_ERROR = 0.05, 0.15
"""GRP102: the temperature ratio r = T_behaviour/T_train (``diag/temperature_ratio``) off 1 by this factor, graded
on |ln r| (r = 0.95 or 1.05 is a warning, 0.87 or 1.15 an error), and only when the tilt holds in both regression
directions. Healthy corpus runs: |ln r| ≤ 0.005 (bf16 engine against a float32 trainer, T = 1 or 0.7 on both
sides); a sampler at 0.85 reads 0.85 ± 0.01."""
ONESIDED_WARNING, ONESIDED_ERROR = 0.8, 0.95
"""GRP103: the smaller of the likely and the unlikely tokens' fractions with behaviour above training log-prob at
lag 0 (``diag/pair_onesided``). Healthy: ≈ 0.5 (the sign of bf16 noise); a temperature gives ≤ 0.1 in one bin; a
top-k or top-p renormalisation lifts every sampled token: ≈ 1."""
RETOK_WARNING, RETOK_ERROR = 0.01, 0.05
"""GRP108: fraction of sequences with a token the engine found likely (p ≥ 0.2) and the trainer scored ≥ 5 nats
lower (``diag/retok_seq_frac``). Healthy corpus runs: 0 (no policy step moves a likely token by e^5)."""
MASK_FRAC_WARNING, MASK_FRAC_ERROR = 0.005, 0.05
"""GRP104/105: fractions of valid (or generated) tokens that are prompt tokens in the loss, engine zeros, trailing
zero runs or generated tokens out of the loss; healthy dumps have exactly 0 of each."""
MASK_SEQ_WARNING = 0.02
"""GRP104: fraction of sequences with a trailing run of exact zeros under the mask (padding in the loss)."""
HOLE_INFO = 0.05
"""GRP105 without ``versions``: masked tokens inside a response span / valid tokens; multi-turn dumps mask tool
output legitimately, so this alone is ``info``."""
REF_EQUAL_WARNING, REF_EQUAL_ERROR = 0.2, 0.9
"""GRP106: fraction of valid tokens where ``ref_logp`` equals another column bitwise; a reference that differs by
any training step matches on ~0 tokens (healthy: 0)."""
REF_ZERO_ERROR = 0.9
"""GRP106: fraction of valid tokens with ``ref_logp`` exactly 0 (AReaL's placeholder without a reference model)."""
DUP_ID_ERROR = 0.05
"""GRP107: a repeated (step, seq_id) is a bug at any count (warning); above this fraction of sequences, error."""
DUP_CONTENT_WARNING = 0.05
"""GRP107 without ``seq_id``: identical sequences (hash of every token's new and old log-prob) above this
fraction; identical samples of one prompt are legitimate for short low-entropy answers (on-policy sim: 2 %)."""
PROX_EQUAL_WARNING, PROX_EQUAL_ERROR = 0.2, 0.9
"""GRP207: fraction of stale sequences (lag ≥ 1) whose ``prox_logp`` equals ``old_logp`` bitwise on every stale token
(``diag/prox_equal_old_seq_frac``); a recomputed proximal policy differs from the engine's numerics on every
token (healthy: 0)."""
SYNC_RATIO_WARNING, SYNC_RATIO_ERROR = 2.0, 4.0
"""GRP201: last over first value of the least-squares line through the per-step lag-0 disagreement (the worst
lag-0 sequence of each step, or the step's lag-0 mean); healthy simulated dumps: ≈ 1."""
SYNC_RANK_CORR = 0.6
"""GRP201: and the Spearman rank correlation of that series with the step must be at least this (a steady rise,
not one bad step; with 6 steps a chance value ≥ 0.6 has probability ≈ 0.12, and the ratio and rise must hold too:
healthy simulated dumps stay at ×1.2)."""
SYNC_LAG0_SPREAD = 3.0
"""GRP201's all-lag series needs lag-0 evidence: the largest per-step worst lag-0 sequence at least this many times
the smallest (healthy simulated dumps: ≤ 2; a larger policy step leaves lag 0 flat)."""
SYNC_DRIFT_RATIO = 1.5
"""GRP201's all-lag series is used only while the policy's own change per version (mean |new − prox| per step)
stays flat (fitted last/first below this)."""
SYNC_MIN_RISE = 0.01
"""GRP201: and the rise must be at least this many nats (slime's healthy level is ~0.011; a public SGLang run
drifting 0.011 → 0.036 over 30 steps is the pattern)."""
SYNC_MIN_SEQ_RISE = 0.05
"""GRP201: the rise the per-sequence series (the worst lag-0 sequence of a step, its excess over its lag) must
clear: a maximum over sequences of a healthy bf16 engine wanders by up to ~0.02 nats over 8 steps on the corpus,
while one engine a version stale puts its sequences 0.1–0.4 nats off."""
SYNC_LAG_DRIFT = 0.5
"""GRP201: the recorded mean lag must not rise by more than this over the steps (fitted line), else the rise may
be staleness."""
MULT_ERROR_WARNING, MULT_ERROR_ERROR = 1.02, 1.1
"""GRP202: NeMo RL's mean exp(|Δ|) between behaviour and same-weights training log-probs (1 = identical). Published
bf16 stacks show mean |Δ| ≈ 0.011 (exp ≈ 1.011); the corpus's bf16 engine against its fp32 trainer 1.002. 1.02 is
about twice the published healthy excess; an int4-quantised engine reads ≈ 1.04."""
BIG_SEQ_WARNING = 0.05
"""GRP202: fraction of lag-0 sequences whose mean |new − old| > 0.1 (one broken worker); healthy: 0."""
TAIL_WARNING, TAIL_ERROR = 0.005, 0.05
"""GRP203: fraction of valid tokens with w = exp(new − old) outside [1/2, 2] (verl's ``rollout_is_threshold`` 2,
``is/frac_high + is/frac_low``); healthy simulated dumps: 0."""
STALE_WARNING, STALE_ERROR = 0.05, 0.25
"""GRP204: fraction of generated tokens with a lag above :attr:`DetectConfig.max_staleness`."""
PROX_BEYOND_WARNING = 0.05
"""GRP205: fraction of stale tokens (lag ≥ 1) beyond the log-linear approximation's safe lag (mean error ≤ 0.01,
compare-prox's default ``--tolerance``)."""
PROX_INFO_LAG = 8
"""GRP205 without a declared approximation: only when lags reach this (AReaL's docs: be careful above ~10)."""
CLIP_WARNING, CLIP_ERROR = 0.2, 0.4
"""GRP206: ``clip/ratio`` overall or on any step; healthy simulated dumps: 0, PPO runs in verl/TRL logs typically
stay at a few percent; above 0.2 most of the update's tokens have no gradient."""
SIGN_WARNING = 0.05
"""GRP301: fraction of groups with spread where cov(reward, advantage) < 0 (healthy GRPO: exactly 0)."""
UNCENTRED_WARNING = 0.05
"""GRP302: fraction of groups whose mean advantage is not 0 (healthy GRPO/RLOO/Dr.GRPO: exactly 0)."""
SCALE_WARNING = 0.05
"""GRP303: fraction of groups whose advantage scale is off the run's normalisation by > 10 % (healthy: 0)."""
ZERO_STD_INFO, ZERO_STD_WARNING, ZERO_STD_ERROR = 0.25, 0.5, 0.8
"""GRP304: ``groups/zero_std_frac`` (TRL ``frac_reward_zero_std``); healthy simulation (success rates 0.15–0.85,
8 samples): ≈ 0.1."""
ENTROPY_RATIO_WARNING, ENTROPY_RATIO_ERROR = 0.5, 0.2
"""GRP401: the lower of the last quarter's mean entropy and the last step's, over the first quarter's mean
(healthy simulated dumps: 0.92–1.05)."""
REWARD_RISE = 0.05
"""GRP401: a rise of the mean reward (last quarter of the steps over the first) from which an entropy fall reads as
convergence (``info``), not collapse: five points of a [0, 1] reward. A healthy on-policy corpus run halves its
entropy in 8 steps while its mean reward rises by 0.085 from 0.8; a collapsing run's reward does not follow."""
NO_EOS_INFO, NO_EOS_WARNING, NO_EOS_ERROR = 0.05, 0.2, 0.5
"""GRP402: ``seq/no_eos_frac`` overall or on any step (healthy simulation: ≈ 0.03)."""

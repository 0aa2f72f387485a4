"""Statistics for the findings layer (``diag/*`` keys) as a functional core: ``*_state`` / ``*_update`` / ``*_compute``.

Each family answers one question a detector (:mod:`grpo_cli.findings.detect`) asks of a dump, from a
:class:`~grpo_cli.core.state.MetricState` (int64 counts, float64 sums, min/max, bounded top-k tables) or a
:class:`~grpo_cli.core.keyed_state.KeyedState` (one row per key), so every figure merges across batches, workers and
ranks and does not depend on batching (float64 sums up to summation order). Log-probs are used **as dumped** (no
``--temperature`` rescaling: the temperature test needs the raw values).

Families (inputs are whole packed sequences, the loss mask included, unless said otherwise):

- **shift** (:func:`shift_update`): mean |new_t − old_(t+s)| for s ∈ {−1, 0, +1} over pairs of loss-mask tokens of
  the same sequence. s = +1 compares a token's ``new_logp`` with the *next* slot's ``old_logp``, which is where the
  value sits when ``old_logp`` was written one token late. Per sequence: the best shift and a table of the sequences
  that agree best at s ≠ 0.
- **pairs** (:func:`pairs_update`): each behaviour log-prob against the training log-prob of the same weights (lag
  0; ``new_logp`` or ``prox_logp``, whichever is closer): the two-direction tilt and temperature ratio, the one-sided
  lift of likely and unlikely tokens, exp|d| and the weight tail, re-tokenised tokens, ``prox_logp == old_logp`` on
  stale tokens — each per block of GRPO groups, for jackknife intervals.
- **zeros** (:func:`zeros_update`): valid tokens whose log-prob is exactly 0 per column, ``old_logp`` = 0 where
  ``new_logp`` is clearly below 0 (an engine that returned no log-prob), trailing runs of exact zeros (padding), and
  with ``versions``: prompt tokens (version < 0) in the loss and generated tokens (version ≥ 0) left out of it.
- **equality** (:func:`equality_update`): valid tokens where two log-prob columns are bitwise equal, per pair.
- **duplicates** (:func:`duplicates_update`): keyed tables of sequence content hashes and of (step, seq_id) keys.
- **groups** (:func:`groups_update`): per GRPO group (step, group_id), sums of reward r and sequence advantage A
  (the mean over the sequence's valid tokens): sign, centring and scale of A against r.
- **by_step** (:func:`by_step_update`): per training step, |new − old| overall and at lag 0, NeMo RL's multiplicative
  probability error exp(|new − old|) at lag 0, entropy (or −new as its proxy), and EOS counts.
- **lags** (:func:`lags_update`): per lag bin, |new − old| and the error of AReaL's log-linear proximal
  approximation ``old + α(new − old)``, α = (k − 1)/k, against the dumped (recomputed) ``prox_logp``; lag-0 figures.

One module per family (``shift``, ``pairs``, ``zeros``, ``equality``, ``duplicates``, ``groups``, ``by_step``,
``lags``) and the shared plumbing (and the jackknife) in ``_common``; this package re-exports them all. The one
wiring of the families into a streaming run is :mod:`grpo_cli.metrics.diagnosis`.
"""

from __future__ import annotations

from grpo_cli.core.diagnosis._common import LOGP_COLUMNS, TOP_FIELDS
from grpo_cli.core.diagnosis.by_step import LAG0_SEQ_MIN_TOKENS, by_step_compute, by_step_state, by_step_update
from grpo_cli.core.diagnosis.duplicates import (
    duplicates_compute,
    duplicates_retire_,
    duplicates_state,
    duplicates_update,
    sequence_hash,
)
from grpo_cli.core.diagnosis.equality import equality_compute, equality_state, equality_update
from grpo_cli.core.diagnosis.groups import SCALE_TOLERANCE, groups_compute, groups_state, groups_update
from grpo_cli.core.diagnosis.lags import BIG_SEQ_MISMATCH, MAX_DIAG_LAG, lags_compute, lags_state, lags_update
from grpo_cli.core.diagnosis.pairs import pairs_compute, pairs_state, pairs_update
from grpo_cli.core.diagnosis.shift import (
    MIN_SEQ_PAIRS,
    SHIFT_FLOOR,
    SHIFT_PREFERENCE,
    shift_compute,
    shift_state,
    shift_update,
)
from grpo_cli.core.diagnosis.zeros import ZERO_GAP, zeros_compute, zeros_state, zeros_update

__all__ = [
    "LOGP_COLUMNS",
    "MAX_DIAG_LAG",
    "MIN_SEQ_PAIRS",
    "SHIFT_PREFERENCE",
    "TOP_FIELDS",
    "ZERO_GAP",
    "by_step_compute",
    "by_step_state",
    "by_step_update",
    "duplicates_compute",
    "duplicates_retire_",
    "duplicates_state",
    "duplicates_update",
    "equality_compute",
    "equality_state",
    "equality_update",
    "groups_compute",
    "groups_state",
    "groups_update",
    "lags_compute",
    "lags_state",
    "lags_update",
    "pairs_compute",
    "pairs_state",
    "pairs_update",
    "sequence_hash",
    "shift_compute",
    "shift_state",
    "shift_update",
    "zeros_compute",
    "zeros_state",
    "zeros_update",
    "BIG_SEQ_MISMATCH",
    "LAG0_SEQ_MIN_TOKENS",
    "SCALE_TOLERANCE",
    "SHIFT_FLOOR",
]

"""The validation layer (grpo_cli.engine.validate): every rule, its boundary, the error location and the skip policy."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.core.batch import TokenBatch
from grpo_cli.engine.validate import (
    CHECKS,
    LOGP_TOLERANCE,
    BatchValidator,
    require_data,
    skipped_warning,
    validation_compute,
    validation_state,
)
from grpo_cli.errors import InputError
from grpo_cli.metrics.registry import KEYS

NAN, INF = math.nan, math.inf


def batch(device: str = "cpu", **over) -> TokenBatch:
    """Three sequences of lengths 3, 2, 3 (rows 10, 11, 12); token 0 of each is a masked prompt token."""
    cu = torch.tensor([0, 3, 5, 8])
    cols = {
        "new_logp": [-1.0, -0.5, -0.25, -2.0, -0.1, -3.0, -0.2, -0.7],
        "old_logp": [-1.0, -0.4, -0.3, -2.0, -0.2, -3.0, -0.1, -0.6],
        "prox_logp": [-1.0, -0.45, -0.3, -2.0, -0.15, -3.0, -0.1, -0.6],
        "ref_logp": [-1.0, -0.6, -0.3, -2.0, -0.2, -3.0, -0.3, -0.6],
        "entropy": [0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 1.0, 2.0],
        "advantages": [0.5, 0.5, 0.5, -1.0, -1.0, 0.2, 0.2, 0.2],
    }
    tensors = {k: torch.tensor(over.pop(k, v), dtype=torch.float32) for k, v in cols.items()}
    mask = torch.tensor(over.pop("loss_mask", [0, 1, 1, 0, 1, 0, 1, 1]), dtype=over.pop("mask_dtype", torch.int8))
    versions = torch.tensor(over.pop("versions", [-1, 3, 3, -1, 2, -1, 5, 4]), dtype=torch.int64)
    current = torch.tensor(over.pop("current_version", [3, 4, 5]), dtype=torch.int64)
    rewards = torch.tensor(over.pop("rewards", [1.0, 0.0, 1.0]), dtype=torch.float32)
    assert not over, over
    b = TokenBatch(cu_seqlens=cu, loss_mask=mask, versions=versions, current_version=current, rewards=rewards,
                   rows=torch.tensor([10, 11, 12]), seq_id=torch.tensor([100, 101, 102]), file_index=1, **tensors)
    return b.to(device)


def with_value(column: str, index: int, value: float) -> TokenBatch:
    b = batch()
    values = getattr(b, column).clone()
    values[index] = value
    setattr(b, column, values)
    return b


VALIDATOR = BatchValidator("error", files=["a.parquet", "b.parquet"], column_names={"old_logp": "behav_lp"})


def test_clean_batch_passes_and_gets_a_bool_mask(device):
    b = batch(device)
    out = VALIDATOR(b)
    assert out.loss_mask.dtype == torch.bool and out.loss_mask.device == b.loss_mask.device
    assert out.loss_mask.tolist() == [False, True, True, False, True, False, True, True]
    assert torch.equal(out.new_logp, b.new_logp) and torch.equal(out.cu_seqlens, b.cu_seqlens)
    state = validation_state(device)
    out = BatchValidator("skip")(batch(device), state)
    assert out.n_sequences == 3 and validation_compute(state) == {
        "invalid/n_sequences_skipped": 0, "invalid/n_tokens_skipped": 0}


def test_masked_positions_may_hold_anything():
    # Token 0 of every sequence is masked: NaN, +inf, a positive log-prob, a future version are all ignored there.
    garbage = {col: [NAN, -0.5, -0.25, INF, -0.1, 7.0, -0.2, -0.7]
               for col in ("new_logp", "old_logp", "prox_logp", "ref_logp")}
    b = batch(**garbage, entropy=[NAN, 0.4, 0.3, -5.0, 0.1, INF, 1.0, 2.0],
              advantages=[NAN, 0.5, 0.5, INF, -1.0, -INF, 0.2, 0.2], versions=[-7, 3, 3, 99, 2, 100, 5, 4])
    assert VALIDATOR(b).n_sequences == 3


# (column, token index in the packed batch, bad value, reason, expected row, token, message fragment)
CASES = [
    ("new_logp", 2, NAN, "new_logp_not_finite", 10, 2, "log-prob is nan at a valid token"),
    ("old_logp", 4, INF, "old_logp_not_finite", 11, 1, "log-prob is inf"),
    ("prox_logp", 7, -INF, "prox_logp_not_finite", 12, 2, "log-prob is -inf"),
    ("ref_logp", 1, 0.5, "ref_logp_positive", 10, 1, "log-prob 0.5 > 0 at a valid token (tolerance 0.0001)"),
    ("entropy", 6, NAN, "entropy_not_finite", 12, 1, "entropy is nan"),
    ("entropy", 4, -0.01, "entropy_negative", 11, 1, "entropy -0.01 < 0"),
    ("advantages", 6, INF, "advantages_not_finite", 12, 1, "advantage is inf"),
    ("versions", 1, 4, "versions_above_current", 10, 1, "version 4 at a valid token is above the sequence's "
     "current_version 3"),
    ("versions", 4, -2, "versions_below_minus_one", 11, 1, "version -2 < -1"),
    ("loss_mask", 3, 2, "loss_mask_not_binary", 11, 0, "loss_mask value 2 (must be 0 or 1)"),
    ("loss_mask", 0, -1, "loss_mask_not_binary", 10, 0, "loss_mask value -1"),
]


@pytest.mark.parametrize("column, index, value, reason, row, token, fragment", CASES)
def test_error_names_file_column_row_token(column, index, value, reason, row, token, fragment):
    with pytest.raises(InputError) as info:
        VALIDATOR(with_value(column, index, value))
    err = info.value
    name = "behav_lp" if column == "old_logp" else column  # --map names appear as in the file
    assert (err.file, err.column, err.row, err.token) == ("b.parquet", name, row, token)
    assert fragment in err.reason and "--on-invalid skip" in err.reason
    assert "\n" not in str(err)


@pytest.mark.parametrize("column, index, value, reason, row, token, fragment", CASES)
def test_skip_drops_exactly_the_offending_sequence(column, index, value, reason, row, token, fragment):
    state = validation_state()
    out = BatchValidator("skip")(with_value(column, index, value), state)
    lengths = [3, 2, 3]
    dropped = [10, 11, 12].index(row)
    assert out.rows.tolist() == [r for r in (10, 11, 12) if r != row]
    assert out.seq_id.tolist() == [s for i, s in enumerate((100, 101, 102)) if i != dropped]
    assert out.loss_mask.dtype == torch.bool
    clean = batch()
    keep = [t for s in range(3) if s != dropped for t in range(sum(lengths[:s]), sum(lengths[: s + 1]))]
    assert out.new_logp.tolist() == clean.new_logp[keep].tolist()
    assert out.cu_seqlens.tolist()[-1] == len(keep)
    figures = validation_compute(state)
    assert figures == {"invalid/n_sequences_skipped": 1, "invalid/n_tokens_skipped": lengths[dropped],
                       f"invalid/{reason}": 1}


def test_rewards_are_checked_per_sequence():
    with pytest.raises(InputError) as info:
        VALIDATOR(batch(rewards=[1.0, NAN, 0.0]))
    assert (info.value.column, info.value.row, info.value.token) == ("rewards", 11, None)
    assert "reward is nan" in info.value.reason


def test_tolerance_boundaries():
    tol = LOGP_TOLERANCE
    assert tol == 1e-4
    # float32(1e-4) rounds a little above 1e-4 but the comparison is in float32 against float32(1e-4): equal, passes.
    VALIDATOR(with_value("new_logp", 1, tol))
    VALIDATOR(with_value("entropy", 1, -tol))
    VALIDATOR(with_value("new_logp", 1, 0.0))
    VALIDATOR(with_value("versions", 1, 3))  # == current_version 3: allowed
    VALIDATOR(with_value("versions", 1, -1))  # a valid token may carry the prompt version
    with pytest.raises(InputError, match="log-prob 0.0002 > 0"):
        VALIDATOR(with_value("new_logp", 1, 2 * tol))
    with pytest.raises(InputError, match="entropy -0.0002 < 0"):
        VALIDATOR(with_value("entropy", 1, -2 * tol))
    with pytest.raises(ValueError, match="tolerance"):
        BatchValidator(tolerance=-1.0)
    # A bool mask needs no value check; without current_version only the lower bound applies.
    b = batch(mask_dtype=torch.bool)
    b.current_version = None
    b.versions = torch.tensor([-1, 99, 3, -1, 2, -1, 5, 4])
    assert VALIDATOR(b).n_sequences == 3


def test_first_offender_in_file_order_wins():
    b = with_value("old_logp", 7, NAN)  # sequence 2
    b.versions = b.versions.clone()
    b.versions[4] = 9  # sequence 1, an earlier row: reported first
    with pytest.raises(InputError) as info:
        VALIDATOR(b)
    assert (info.value.column, info.value.row) == ("versions", 11)
    # Within one token, the CHECKS order decides (new_logp before old_logp).
    b = with_value("old_logp", 2, NAN)
    b.new_logp = b.new_logp.clone()
    b.new_logp[2] = 3.0
    with pytest.raises(InputError) as info:
        VALIDATOR(b)
    assert (info.value.column, info.value.token) == ("new_logp", 2)


def test_skip_counts_every_reason_but_each_sequence_once():
    b = with_value("old_logp", 1, NAN)
    b.new_logp = b.new_logp.clone()
    b.new_logp[2] = 1.0  # same sequence (row 10), second reason
    b.rewards = torch.tensor([1.0, 0.0, INF])
    state = validation_state()
    out = BatchValidator("skip")(b, state)
    assert out.rows.tolist() == [11]
    assert validation_compute(state) == {
        "invalid/n_sequences_skipped": 2, "invalid/n_tokens_skipped": 6, "invalid/new_logp_positive": 1,
        "invalid/old_logp_not_finite": 1, "invalid/rewards_not_finite": 1}
    # The state merges like every other (int64 sums).
    assert state["n_sequences_skipped"].dtype == torch.int64
    merged = state.merge(state)
    assert int(merged["n_tokens_skipped"]) == 12


def test_token_layout_reports_the_token_row():
    validator = BatchValidator("error", files=["t.parquet"], token_layout=True)
    b = with_value("new_logp", 7, NAN)
    b.file_index = 0
    b.rows = torch.tensor([0, 3, 5])  # first row of each sequence's tokens
    with pytest.raises(InputError) as info:
        validator(b)
    assert (info.value.file, info.value.row, info.value.token) == ("t.parquet", 7, None)


def test_skip_needs_a_state_and_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="validation_state"):
        BatchValidator("skip")(batch())
    with pytest.raises(ValueError, match="'error' or 'skip'"):
        BatchValidator("ignore")


def test_dropping_sequences_filters_every_column(device):
    b = batch(device)
    b.loss_mask = b.loss_mask != 0
    valid = b.valid()  # positions set: they must be filtered too
    out = valid.select_sequences(torch.tensor([True, False, True], device=device))
    assert out.cu_seqlens.tolist() == [0, 2, 4]
    assert out.positions.tolist() == [1, 2, 1, 2]
    assert out.rewards.tolist() == [1.0, 1.0] and out.current_version.tolist() == [3, 5]
    assert out.versions.tolist() == [3, 3, 5, 4]
    empty = b.select_sequences(torch.zeros(3, dtype=torch.bool, device=device))
    assert empty.n_sequences == 0 and empty.n_tokens == 0 and empty.valid().n_tokens == 0


def test_nan_in_one_valid_token_is_found_on_device(device):
    # The fused clean-path check must see a single bad token among many (no sampling, no early exit).
    n = 10_000
    b = TokenBatch(cu_seqlens=torch.tensor([0, n // 2, n]), new_logp=-torch.rand(n),
                   loss_mask=torch.ones(n, dtype=torch.bool), rows=torch.tensor([0, 1])).to(device)
    b.new_logp[n - 3] = NAN
    with pytest.raises(InputError) as info:
        BatchValidator()(b)
    assert (info.value.row, info.value.token) == (1, n // 2 - 3)


def test_every_reason_has_a_key_and_the_warning_is_one_line():
    for check in CHECKS:
        assert f"invalid/{check.reason}" in KEYS, check.reason
        assert KEYS[f"invalid/{check.reason}"].section == "invalid"
    metrics = {"invalid/n_sequences_skipped": 2, "invalid/n_tokens_skipped": 9, "invalid/old_logp_not_finite": 2,
               "n_sequences": 5}
    text = skipped_warning(metrics)
    assert text is not None and "\n" not in text
    assert "skipped 2 of 7 sequences (9 tokens)" in text and "old_logp_not_finite: 2" in text
    assert skipped_warning({"invalid/n_sequences_skipped": 0}) is None
    assert skipped_warning({}) is None


def test_require_data():
    require_data({"n_sequences": 3, "n_valid_tokens": 1})
    require_data({})  # nothing to check
    with pytest.raises(InputError, match="x.parquet: the input has no rows"):
        require_data({"n_sequences": 0, "n_valid_tokens": 0}, ["x.parquet"])
    no_valid = r"no valid tokens: loss_mask is 0 on all 12 tokens of 3 sequences \(2 files\)"
    with pytest.raises(InputError, match=no_valid):
        require_data({"n_sequences": 3, "n_tokens": 12, "n_valid_tokens": 0}, ["a", "b"])
    with pytest.raises(InputError, match=r"every sequence \(4\) was skipped as invalid \(old_logp_not_finite: 4\)"):
        require_data({"n_sequences": 0, "invalid/n_sequences_skipped": 4, "invalid/n_tokens_skipped": 8,
                      "invalid/old_logp_not_finite": 4})


def test_teacher_logp_eos_and_a_current_version_option():
    b = batch()
    b.teacher_logp = b.new_logp.clone()
    b.teacher_logp[6] = 0.5
    with pytest.raises(InputError) as info:
        VALIDATOR(b)
    assert (info.value.column, info.value.row, info.value.token) == ("teacher_logp", 12, 1)
    b = batch()
    b.eos = torch.tensor([1, 0, 3])
    with pytest.raises(InputError, match="eos flag 3 \\(must be 0 or 1\\)") as info:
        VALIDATOR(b)
    assert (info.value.column, info.value.row, info.value.token) == ("eos", 12, None)
    # Without a current_version column, --current-version (compare-prox) bounds the versions.
    b = batch()
    b.current_version = None
    BatchValidator(current_version=5)(b)
    with pytest.raises(InputError, match="version 5 at a valid token is above the sequence's current_version 4"):
        BatchValidator(current_version=4)(b)

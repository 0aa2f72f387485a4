"""Tests for grpo_cli.commands.sample: the tiny asynchronous GRPO run behind `grpo-cli sample` and sample_data/.

Every property is checked from the table's own columns with independent plain-Python recomputations (the
reward, the group normalisation, the staleness), never by calling the module's helpers.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_cli.commands.sample import SAMPLE_SCHEMA, generate_sample, write_sample

COMMITTED = Path(__file__).resolve().parents[1] / "sample_data" / "rollouts.parquet"
TINY = {"steps": 7, "prompts_per_step": 3, "group_size": 4}
LOGP_COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp")
PER_TOKEN = ("input_ids", *LOGP_COLUMNS, "entropy", "loss_mask", "versions")
# Token ids of the toy task (documented in grpo_cli.commands.sample): digits 0..5, BOS 6, SEP 7, EOS 8.
N_DIGITS, BOS, SEP, EOS = 6, 6, 7, 8


@pytest.fixture(scope="module")
def tiny() -> pa.Table:
    return generate_sample(seed=0, **TINY)


@pytest.fixture(scope="module")
def tiny_rows(tiny: pa.Table) -> list[dict]:
    return tiny.to_pylist()


@pytest.fixture(scope="module")
def committed() -> dict[str, np.ndarray]:
    """The committed default sample as flat numpy arrays: per-sequence columns and per-token "tok_*" ones."""
    table = pq.read_table(COMMITTED)
    out: dict[str, np.ndarray] = {"n_rows": np.asarray(table.num_rows)}
    lengths = None
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type):
            out[f"tok_{name}"] = col.flatten().to_numpy()
            lengths = np.diff(col.offsets.to_numpy())
        else:
            out[name] = col.to_numpy()
    assert lengths is not None
    for name in ("current_version", "step", "group_id", "advantages", "rewards"):
        out[f"tok_{name}"] = np.repeat(out[name], lengths)
    return out


# ---------------------------------------------------------------------------------------------------------
# determinism, schema, layout
# ---------------------------------------------------------------------------------------------------------


def test_same_seed_identical_other_seed_different(tiny: pa.Table) -> None:
    assert generate_sample(seed=0, **TINY).equals(tiny)
    other = generate_sample(seed=1, **TINY)
    assert other.num_rows == tiny.num_rows
    assert not other.equals(tiny)
    assert other.column("input_ids").to_pylist() != tiny.column("input_ids").to_pylist()


def test_caller_rng_and_threads_untouched() -> None:
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    state = torch.random.get_rng_state()
    generate_sample(seed=5, steps=2, prompts_per_step=1, group_size=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.get_num_threads() == threads


def test_schema_and_types(tiny: pa.Table) -> None:
    f32 = pa.list_(pa.field("item", pa.float32(), nullable=False))
    expected = [
        ("seq_id", pa.int64()),
        ("step", pa.int64()),
        ("group_id", pa.int64()),
        ("current_version", pa.int64()),
        ("rewards", pa.float32()),
        ("advantages", pa.float32()),
        ("input_ids", pa.list_(pa.field("item", pa.int32(), nullable=False))),
        ("new_logp", f32),
        ("old_logp", f32),
        ("prox_logp", f32),
        ("ref_logp", f32),
        ("entropy", f32),
        ("loss_mask", pa.list_(pa.field("item", pa.int8(), nullable=False))),
        ("versions", pa.list_(pa.field("item", pa.int32(), nullable=False))),
    ]
    assert [(f.name, f.type) for f in tiny.schema] == expected
    assert all(not f.nullable for f in tiny.schema)
    assert all(not f.type.value_field.nullable for f in tiny.schema if pa.types.is_list(f.type))
    assert tiny.schema == SAMPLE_SCHEMA
    assert tiny.num_rows == TINY["steps"] * TINY["prompts_per_step"] * TINY["group_size"]
    assert all(tiny.column(name).null_count == 0 for name in tiny.column_names)


def test_rows_ordered_and_ids(tiny_rows: list[dict]) -> None:
    g = TINY["group_size"]
    per_step = TINY["prompts_per_step"] * g
    for i, row in enumerate(tiny_rows):
        assert row["seq_id"] == i
        assert row["group_id"] == i // g
        assert row["step"] == i // per_step
        # one trainer version per step, starting from version 0 (the initial weights)
        assert row["current_version"] == row["step"]


def test_per_token_columns_aligned_and_prompt_layout(tiny_rows: list[dict]) -> None:
    for row in tiny_rows:
        n = len(row["input_ids"])
        assert all(len(row[c]) == n for c in PER_TOKEN)
        mask, versions, ids = row["loss_mask"], row["versions"], row["input_ids"]
        p = mask.index(1)  # prompt = BOS d1..dk SEP, then the response
        assert ids[0] == BOS and ids[p - 1] == SEP and 2 <= p - 2 <= 4
        assert all(0 <= t < N_DIGITS for t in ids[1 : p - 1])
        assert mask == [0] * p + [1] * (n - p)
        assert versions[:p] == [-1] * p
        resp_versions = set(versions[p:])
        assert len(resp_versions) == 1 and min(resp_versions) >= 0
        # the response stops at its first EOS, or is truncated after k + 3 tokens without EOS
        resp = ids[p:]
        assert EOS not in resp[:-1]
        assert resp[-1] == EOS or len(resp) == (p - 2) + 3
        # position 0 (BOS) is never predicted: every per-token float holds 0.0 there
        assert all(row[c][0] == 0.0 for c in (*LOGP_COLUMNS, "entropy"))


def test_response_lengths_vary(tiny_rows: list[dict]) -> None:
    lengths = {len(r["input_ids"]) - r["loss_mask"].index(1) for r in tiny_rows}
    assert len(lengths) >= 3


# ---------------------------------------------------------------------------------------------------------
# the numbers: log-probs, rewards, advantages
# ---------------------------------------------------------------------------------------------------------


def test_logps_nonpositive_entropy_in_range(tiny_rows: list[dict]) -> None:
    log_v = math.log(N_DIGITS + 3)  # entropy of a distribution over the 9-token vocabulary is ≤ log 9
    for row in tiny_rows:
        for c in LOGP_COLUMNS:
            assert all(x <= 0.0 and math.isfinite(x) for x in row[c])
        assert all(-1e-6 <= h <= log_v + 1e-5 for h in row["entropy"])


def _expected_reward(ids: list[int], p: int) -> float:
    """Reverse task, recomputed by hand: hits / max(k, answer length), the answer ends before EOS."""
    digits = ids[1 : p - 1]
    resp = ids[p:]
    answer = resp[: resp.index(EOS)] if EOS in resp else resp
    target = list(reversed(digits))
    hits = sum(1 for i in range(min(len(answer), len(target))) if answer[i] == target[i])
    return hits / max(len(target), len(answer))


def test_rewards_are_the_checkable_reward(tiny_rows: list[dict]) -> None:
    for row in tiny_rows:
        expected = _expected_reward(row["input_ids"], row["loss_mask"].index(1))
        assert row["rewards"] == pytest.approx(expected, abs=1e-7)


def test_group_normalised_advantages(tiny_rows: list[dict]) -> None:
    groups: dict[int, list[dict]] = defaultdict(list)
    for row in tiny_rows:
        groups[row["group_id"]].append(row)
    assert all(len(g) == TINY["group_size"] for g in groups.values())
    for rows in groups.values():
        rewards = [r["rewards"] for r in rows]
        mean = statistics.fmean(rewards)
        std = statistics.stdev(rewards)  # Bessel-corrected, as TRL's GRPOTrainer
        for r in rows:
            assert r["advantages"] == pytest.approx((r["rewards"] - mean) / (std + 1e-4), rel=1e-5, abs=1e-6)
        if std == 0:
            assert all(r["advantages"] == 0.0 for r in rows)


def test_version_relationships_are_exact(tiny_rows: list[dict]) -> None:
    # At version 0 new, prox (documented: version 0 when there is no v − 1) and ref are the same fp32 weights
    # applied to the same batch, so they agree bit for bit; at version 1 prox (v − 1 = 0) equals ref.
    for row in tiny_rows:
        if row["current_version"] == 0:
            assert row["new_logp"] == row["prox_logp"] == row["ref_logp"]
        elif row["current_version"] == 1:
            assert row["prox_logp"] == row["ref_logp"]
            assert row["new_logp"] != row["prox_logp"]  # one update happened


def test_staleness_within_max_lag(tiny_rows: list[dict]) -> None:
    for row in tiny_rows:
        v = row["current_version"]
        lags = {v - x for x, m in zip(row["versions"], row["loss_mask"], strict=True) if m}
        assert lags <= set(range(min(4, v) + 1))
    one = generate_sample(seed=3, steps=5, prompts_per_step=4, group_size=2, max_lag=1)
    lags = {r["current_version"] - r["versions"][-1] for r in one.to_pylist()}
    assert lags == {0, 1}


def test_bf16_mismatch_at_lag_zero(tiny_rows: list[dict]) -> None:
    # Lag 0: the behaviour snapshot holds the trainer's own weights, so old − new is only bf16 vs fp32.
    diffs = [
        abs(o - n)
        for row in tiny_rows
        if row["versions"][-1] == row["current_version"]
        for o, n, m in zip(row["old_logp"], row["new_logp"], row["loss_mask"], strict=True)
        if m
    ]
    assert len(diffs) > 20
    assert sum(d > 0 for d in diffs) / len(diffs) > 0.5  # a real mismatch…
    assert statistics.fmean(diffs) < 0.05  # …of rounding size, not a different policy


def test_progress_callback() -> None:
    calls: list[tuple[int, int]] = []
    generate_sample(
        seed=0, steps=3, prompts_per_step=1, group_size=2, progress=lambda d, t: calls.append((d, t))
    )
    assert calls == [(1, 3), (2, 3), (3, 3)]


@pytest.mark.parametrize(
    "kwargs", [{"steps": 0}, {"group_size": 1}, {"prompts_per_step": 0}, {"max_lag": -1}, {"steps": 2.0}]
)
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        generate_sample(**kwargs)


def test_write_sample_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "s.parquet"
    write_sample(path, seed=2, steps=3, prompts_per_step=2, group_size=3, row_group_size=5)
    f = pq.ParquetFile(path)
    assert f.metadata.num_row_groups == 4  # 18 rows / 5
    assert f.read().equals(generate_sample(seed=2, steps=3, prompts_per_step=2, group_size=3))
    for i in range(f.metadata.num_columns):
        col = f.metadata.row_group(0).column(i)
        if col.physical_type == "FLOAT":
            assert not col.has_dictionary_page, col.path_in_schema
    with pytest.raises(TypeError):
        write_sample(path, bogus=1)


# ---------------------------------------------------------------------------------------------------------
# the committed default sample: staleness, clipping, mismatch, learning
# ---------------------------------------------------------------------------------------------------------


def test_committed_file_shape() -> None:
    f = pq.ParquetFile(COMMITTED)
    assert f.schema_arrow == SAMPLE_SCHEMA
    assert f.metadata.num_rows == 128 * 8 * 8
    assert f.metadata.num_row_groups >= 4
    assert COMMITTED.stat().st_size < 4 * 2**20


def test_committed_every_lag_present(committed: dict[str, np.ndarray]) -> None:
    resp = committed["tok_loss_mask"] == 1
    lags = (committed["tok_current_version"] - committed["tok_versions"])[resp]
    counts = Counter(lags.tolist())
    assert set(counts) == {0, 1, 2, 3, 4}
    assert min(counts.values()) > 1000
    assert np.all(committed["tok_versions"][~resp] == -1)


def test_committed_real_clipping(committed: dict[str, np.ndarray]) -> None:
    resp = (committed["tok_loss_mask"] == 1) & (committed["tok_current_version"] >= 1)
    ratio = np.exp(committed["tok_new_logp"][resp].astype(np.float64) - committed["tok_prox_logp"][resp])
    clipped = (ratio < 0.8) | (ratio > 1.2)
    assert 0.01 < clipped.mean() < 0.5
    assert (ratio < 0.8).any() and (ratio > 1.2).any()


def test_committed_mismatch_and_learning(committed: dict[str, np.ndarray]) -> None:
    resp = committed["tok_loss_mask"] == 1
    lag0 = resp & (committed["tok_current_version"] == committed["tok_versions"])
    diff = np.abs(committed["tok_old_logp"] - committed["tok_new_logp"])
    assert (diff[lag0] > 0).mean() > 0.5
    # staleness shows: stale tokens disagree far more than the pure-precision lag-0 ones
    assert diff[resp & ~lag0].mean() > 5 * diff[lag0].mean()
    # the policy learns: mean reward of the last quarter well above the first
    step, rewards = committed["step"], committed["rewards"]
    assert rewards[step >= 96].mean() > rewards[step < 32].mean() + 0.3
    # some groups have all-equal rewards (advantage 0 for the whole group)
    per_group: dict[int, set[float]] = defaultdict(set)
    for g, r in zip(committed["group_id"].tolist(), rewards.tolist(), strict=True):
        per_group[g].add(r)
    flat_groups = [g for g, s in per_group.items() if len(s) == 1]
    assert len(flat_groups) >= 10
    assert np.all(committed["advantages"][np.isin(committed["group_id"], flat_groups)] == 0)
    for c in LOGP_COLUMNS:
        assert np.all(committed[f"tok_{c}"] <= 0)

"""`grpo-cli advantages`: recomputed vs dumped advantages, streaming across split groups, broken dumps, --write.

Expected advantages are derived by hand in comments or computed by the plain-Python loops below (straight from the
formulas in docs/advantages.md), never by grpo_cli itself.
"""

from __future__ import annotations

import itertools
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_cli.cli import main
from grpo_cli.commands.advantages import parse_norm_spec
from grpo_cli.core import NormConfig, normalize
from grpo_cli.core.adv_check import (
    StreamingNormalization,
    StreamingWhiten,
    adv_diff_compute,
    adv_diff_state,
    adv_diff_update,
)

F32 = pa.float32()


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *args):
    code, out, err = run(capsys, *args, "--format", "json")
    assert code in (0, 1), err
    return code, json.loads(out)["metrics"]


def write_dump(path, seqs, *, row_group_size=3, per_token_adv=False, token_layout=False):
    """seqs: dicts with new (list), mask, reward, group, step, adv (float or list), old, ref, eos (optional)."""
    cols: dict[str, pa.Array] = {}
    first = seqs[0]
    if token_layout:
        cols["new_logp"] = pa.array([v for s in seqs for v in s["new"]], F32)
        cols["loss_mask"] = pa.array([v for s in seqs for v in s["mask"]], pa.int8())
        cols["seq_id"] = pa.array([i for i, s in enumerate(seqs) for _ in s["new"]], pa.int64())
        for name, key, typ in (("rewards", "reward", F32), ("group_id", "group", pa.int64())):
            if key in first:
                cols[name] = pa.array([s[key] for s in seqs for _ in s["new"]], typ)
        if "adv" in first:
            cols["advantages"] = pa.array([v for s in seqs for v in s["adv"]], F32)
    else:
        cols["new_logp"] = pa.array([s["new"] for s in seqs], pa.list_(F32))
        cols["loss_mask"] = pa.array([s["mask"] for s in seqs], pa.list_(pa.int8()))
        for name in ("old", "ref"):
            if name in first:
                cols[f"{name}_logp"] = pa.array([s[name] for s in seqs], pa.list_(F32))
        for name, key, typ in (("rewards", "reward", F32), ("group_id", "group", pa.int64()),
                               ("step", "step", pa.int64()), ("eos", "eos", pa.bool_())):
            if key in first:
                cols[name] = pa.array([s[key] for s in seqs], typ)
        if "adv" in first:
            typ = pa.list_(F32) if per_token_adv else F32
            cols["advantages"] = pa.array([s["adv"] for s in seqs], typ)
        cols["extra_text"] = pa.array([f"row {i}" for i in range(len(seqs))])  # an unknown column --write keeps
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


# ==============================================================================================================
# plain-Python references
# ==============================================================================================================


def grpo_ref(rewards, keys, eps=1e-6):
    """verl GRPO: (r − μ_g)/(σ_g + ε), σ unbiased; a one-sequence group has μ = 0, σ = 1."""
    out = []
    for r, k in zip(rewards, keys):
        members = [x for x, kk in zip(rewards, keys) if kk == k]
        n = len(members)
        if n == 1:
            out.append(r / (1 + eps))
            continue
        mu = sum(members) / n
        sd = math.sqrt(sum((x - mu) ** 2 for x in members) / (n - 1))
        out.append((r - mu) / (sd + eps))
    return out


def rloo_ref(rewards, keys):
    out = []
    for r, k in zip(rewards, keys):
        members = [x for x, kk in zip(rewards, keys) if kk == k]
        n = len(members)
        out.append(r if n == 1 else r - (sum(members) - r) / (n - 1))
    return out


def seqs_with(rewards, groups, advs, *, steps=None, prompt=2, length=5):
    seqs = []
    for i, (r, g, a) in enumerate(zip(rewards, groups, advs)):
        s = {"new": [-0.5] * length, "mask": [0] * prompt + [1] * (length - prompt), "reward": r, "group": g,
             "adv": a}
        if steps is not None:
            s["step"] = steps[i]
        seqs.append(s)
    return seqs


# ==============================================================================================================
# per-sequence estimators
# ==============================================================================================================


def test_grpo_hand_derived_passes_and_counts(capsys, tmp_path):
    # Group 7: rewards 1, 0 → μ = 0.5, σ = √(0.5) → ±0.5/0.70710678 = ±0.70710678 (ε 1e-6 changes the 7th digit).
    # Group 3: a single sequence with reward 2 → μ = 0, σ = 1 → 2/(1 + 1e-6).
    rewards, groups = [1.0, 0.0, 2.0], [7, 7, 3]
    advs = [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 2 / (1 + 1e-6)]
    path = tmp_path / "d.parquet"
    write_dump(path, seqs_with(rewards, groups, advs))
    code, m = run_json(capsys, "advantages", path, "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 0
    assert m["adv_check/n_sequences"] == 3 and m["adv_check/n_sequences_mismatch"] == 0
    assert m["adv_check/n_tokens_compared"] == 9  # 3 valid tokens each; a per-sequence column: valid tokens only
    assert m["adv_check/n_masked_tokens_compared"] == 0
    assert m["adv_check/max_abs_diff"] < 1e-6
    assert m["adv_check/worst"] == []


def test_drgrpo_and_rloo_hand_derived(capsys, tmp_path):
    rewards, groups = [1.0, 2.0, 6.0, 4.0], [3, 3, 3, 8]
    # Dr.GRPO: μ = 3 → −2, −1, 3; singleton keeps r = 4.
    path = tmp_path / "dr.parquet"
    write_dump(path, seqs_with(rewards, groups, [-2.0, -1.0, 3.0, 4.0]))
    _, m = run_json(capsys, "advantages", path, "--estimator", "drgrpo")
    assert m["adv_check/n_sequences_mismatch"] == 0 and m["adv_check/max_abs_diff"] == 0.0
    # RLOO: r − mean(others): 1 − 4 = −3, 2 − 3.5 = −1.5, 6 − 1.5 = 4.5; singleton keep → 4, zero → 0.
    path = tmp_path / "rloo.parquet"
    write_dump(path, seqs_with(rewards, groups, [-3.0, -1.5, 4.5, 0.0]))
    _, m = run_json(capsys, "advantages", path, "--estimator", "rloo", "--rloo-singleton", "zero")
    assert m["adv_check/n_sequences_mismatch"] == 0
    _, m = run_json(capsys, "advantages", path, "--estimator", "rloo")  # keep: the singleton should be 4
    assert m["adv_check/n_sequences_mismatch"] == 1
    assert m["adv_check/max_abs_diff"] == pytest.approx(4.0)
    worst = m["adv_check/worst"][0]
    assert (worst["row"], worst["expected"], worst["dumped"], worst["group_id"]) == (3, 4.0, 0.0, 8)
    assert worst["position"] == 2  # the first valid token (2 prompt tokens)


def split_dump(tmp_path, rewards, groups, advs, steps=None):
    """Two files, tiny row groups: groups 0..2 are interleaved and cross row-group and file boundaries."""
    seqs = seqs_with(rewards, groups, advs, steps=steps)
    half = len(seqs) // 2
    write_dump(tmp_path / "a.parquet", seqs[:half], row_group_size=2)
    write_dump(tmp_path / "b.parquet", seqs[half:], row_group_size=3)
    return tmp_path


@pytest.fixture
def group_data():
    rewards = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25, 0.75, 1.0, 0.0, 0.5]
    groups = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]  # non-contiguous: every group spans both files
    return rewards, groups


@pytest.mark.parametrize("batch_tokens", [1, 7, 1 << 20])
def test_groups_split_across_batches_and_files(capsys, tmp_path, group_data, batch_tokens):
    rewards, groups = group_data
    advs = grpo_ref(rewards, groups)
    split_dump(tmp_path, rewards, groups, advs)
    code, m = run_json(capsys, "advantages", tmp_path, "--estimator", "grpo", "--batch-tokens", batch_tokens,
                       "--fail-on-mismatch")
    assert code == 0, m
    assert m["adv_check/n_sequences"] == 12 and m["adv_check/max_abs_diff"] < 1e-6


def test_group_ids_reused_across_steps(capsys, tmp_path):
    # Step 0 and step 1 both use group id 0; by default (batch_by = step) they are different groups.
    rewards, groups, steps = [1.0, 0.0, 3.0, 1.0], [0, 0, 0, 0], [0, 0, 1, 1]
    advs = grpo_ref(rewards, list(zip(steps, groups)))  # ±0.7071 in each step
    split_dump(tmp_path, rewards, groups, advs, steps=steps)
    _, m = run_json(capsys, "advantages", tmp_path, "--estimator", "grpo")
    assert m["adv_check/n_sequences_mismatch"] == 0
    # Merging the steps (one group of 4: μ = 1.25) is the wrong-group-boundary bug: every sequence disagrees.
    _, m = run_json(capsys, "advantages", tmp_path, "--estimator", "grpo", "--batch-by", "none")
    assert m["adv_check/n_sequences_mismatch"] == 4


# ==============================================================================================================
# the classic bugs
# ==============================================================================================================


def test_broken_dump_wrong_group_boundaries(capsys, tmp_path, group_data):
    rewards, groups = group_data
    shifted = [(i + 1) // 4 for i in range(12)]  # a trainer that sliced contiguous groups of 4 (off by one)
    split_dump(tmp_path, rewards, groups, grpo_ref(rewards, shifted))
    code, out, err = run(capsys, "advantages", tmp_path, "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 1
    assert "MISMATCH" in out and "differ from the recomputed grpo advantages" in err
    code, m = run_json(capsys, "advantages", tmp_path, "--estimator", "grpo")
    assert code == 0  # without --fail-on-mismatch the report is the result
    assert m["adv_check/n_sequences_mismatch"] > 0 and m["adv_check/max_abs_diff"] > 0.1
    assert len(m["adv_check/worst"]) == min(10, m["adv_check/n_sequences_mismatch"])
    diffs = [w["max_abs_diff"] for w in m["adv_check/worst"]]
    assert diffs == sorted(diffs, reverse=True)


def test_broken_dump_std_over_the_wrong_axis(capsys, tmp_path, group_data):
    rewards, groups = group_data
    # Group means are right but the std is the whole batch's (normalised over the wrong axis).
    mu = {g: sum(r for r, gg in zip(rewards, groups) if gg == g) / 4 for g in set(groups)}
    mean_all = sum(rewards) / len(rewards)
    sd_all = math.sqrt(sum((r - mean_all) ** 2 for r in rewards) / (len(rewards) - 1))
    advs = [(r - mu[g]) / (sd_all + 1e-6) for r, g in zip(rewards, groups)]
    split_dump(tmp_path, rewards, groups, advs)
    code, _, _ = run(capsys, "advantages", tmp_path, "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 1
    # Dr.GRPO does not divide by a std: these advantages are not Dr.GRPO's either.
    code, _, _ = run(capsys, "advantages", tmp_path, "--estimator", "drgrpo", "--fail-on-mismatch")
    assert code == 1


def test_broken_dump_advantages_broadcast_to_prompt_tokens(capsys, tmp_path, group_data):
    rewards, groups = group_data
    advs = grpo_ref(rewards, groups)
    good = [{"new": [-0.5] * 5, "mask": [0, 0, 1, 1, 1], "reward": r, "group": g, "adv": [0, 0, a, a, a]}
            for r, g, a in zip(rewards, groups, advs)]
    write_dump(tmp_path / "good.parquet", good, per_token_adv=True)
    code, m = run_json(capsys, "advantages", tmp_path / "good.parquet", "--estimator", "grpo")
    assert m["adv_check/n_sequences_mismatch"] == 0
    assert m["adv_check/n_tokens_compared"] == 60 and m["adv_check/n_masked_tokens_compared"] == 24

    bad = [dict(s, adv=[a] * 5) for s, a in zip(good, advs)]  # the scalar broadcast over the prompt too
    write_dump(tmp_path / "bad.parquet", bad, per_token_adv=True)
    code, _, _err = run(capsys, "advantages", tmp_path / "bad.parquet", "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 1
    code, m = run_json(capsys, "advantages", tmp_path / "bad.parquet", "--estimator", "grpo")
    nonzero = sum(1 for a in advs if abs(a) > 1e-5)
    assert m["adv_check/n_masked_tokens_mismatch"] == 2 * nonzero  # the response tokens all agree
    assert m["adv_check/n_tokens_mismatch"] == 2 * nonzero
    assert all(w["position"] in (0, 1) and w["expected"] == 0.0 for w in m["adv_check/worst"])
    # Restricted to the loss-mask tokens, the dump is fine.
    code, _, _ = run(capsys, "advantages", tmp_path / "bad.parquet", "--estimator", "grpo", "--valid-only",
                     "--fail-on-mismatch")
    assert code == 0


def test_nan_advantage_is_a_mismatch(capsys, tmp_path):
    path = tmp_path / "nan.parquet"
    write_dump(path, seqs_with([1.0, 0.0], [0, 0], [float("nan"), -0.5 / (math.sqrt(0.5) + 1e-6)]))
    code, m = run_json(capsys, "advantages", path, "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 1
    assert m["adv_check/n_nonfinite"] == 3 and m["adv_check/n_sequences_mismatch"] == 1
    assert m["adv_check/max_abs_diff"] is None  # +inf → null in strict JSON
    assert m["adv_check/mean_abs_diff"] < 1e-6  # over the finite differences


# ==============================================================================================================
# GAE (AReaL) and REINFORCE++
# ==============================================================================================================


def test_gae_hand_derived_with_kl_reward(capsys, tmp_path):
    # Token-aligned: prompt p, response r1 r2 r3; d_i = old_i − ref_i = 0.5, −1.0, 0.2; kl_ctl 0.1 (k1), R = 1.
    # Rolled to next-token alignment the rewards are [−0.05, 0.1, −0.02 + 1, 0] (R at seqlen − 2 = 2).
    # γλ = 0.9·0.5 = 0.45, V = 0: A2 = 0.98, A1 = 0.1 + 0.45·0.98 = 0.541, A0 = −0.05 + 0.45·0.541 = 0.19345.
    # Un-rolled to tokens: [0 (first token), A0, A1, A2].
    seq = {"new": [-1.0, -1.0, -1.0, -1.0], "mask": [0, 1, 1, 1], "old": [-9.0, -0.5, -2.0, -0.3],
           "ref": [-7.0, -1.0, -1.0, -0.5], "reward": 1.0, "adv": [0.0, 0.19345, 0.541, 0.98]}
    path = tmp_path / "g.parquet"
    write_dump(path, [seq], per_token_adv=True)
    args = ("advantages", path, "--estimator", "gae", "--kl-ctl", "0.1", "--discount", "0.9", "--gae-lambda", "0.5")
    code, m = run_json(capsys, *args, "--fail-on-mismatch")
    assert code == 0 and m["adv_check/max_abs_diff"] < 1e-6
    # The same column read as already next-token aligned is a different (wrong) recomputation.
    code, m = run_json(capsys, *args, "--alignment", "next")
    assert m["adv_check/n_sequences_mismatch"] == 1


def test_gae_skips_masked_positions(capsys, tmp_path):
    # Multi-turn mask [0, 1, 0, 1] (token 2 is a tool output). Rolled mask [1, 0, 1, 0]; kl_ctl 0.1, d1 = 0.5,
    # d3 = 0.2, R = 1: rewards [−0.05, 0, 0.98, 0]. γλ = 0.45: A2 = 0.98; position 1 is masked and carries 0.98;
    # A0 = −0.05 + 0.45·0.98 = 0.391. Tokens: [0, 0.391, 0.98 (masked, carried), 0.98].
    seq = {"new": [-1.0] * 4, "mask": [0, 1, 0, 1], "old": [-9.0, -0.5, -5.0, -0.3], "ref": [-7.0, -1.0, -1.0, -0.5],
           "reward": 1.0, "adv": [0.0, 0.391, 0.98, 0.98]}
    path = tmp_path / "m.parquet"
    write_dump(path, [seq], per_token_adv=True)
    code, m = run_json(capsys, "advantages", path, "--estimator", "gae", "--kl-ctl", "0.1", "--discount", "0.9",
                       "--gae-lambda", "0.5", "--fail-on-mismatch")
    assert code == 0 and m["adv_check/n_masked_tokens_compared"] == 2


def two_step_gae_dump(tmp_path, advs):
    # γ = λ = 1, no KL: every valid token of a sequence gets its reward.
    lens = [(3, 1.0, 0), (1, 0.0, 0), (2, 2.0, 1), (2, 0.0, 1), (1, 1.0, 1)]
    seqs = []
    for (n_valid, reward, step), adv in zip(lens, advs):
        seqs.append({"new": [-1.0] * (n_valid + 1), "mask": [0] + [1] * n_valid, "reward": reward, "step": step,
                     "group": 0, "adv": adv})
    write_dump(tmp_path / "s.parquet", seqs, row_group_size=2, per_token_adv=True)
    return tmp_path / "s.parquet"


@pytest.mark.parametrize("batch_tokens", [1, 1 << 20])
def test_gae_adv_norm_per_training_batch(capsys, tmp_path, batch_tokens):
    # Step 0: token values [1, 1, 1, 0]: mean 0.75, Σ(x − μ)² = 0.75, unbiased var 0.25, std 0.5 (+ eps 1e-5).
    # Step 1: [2, 2, 0, 0, 1]: mean 1, Σ(x − μ)² = 4, var 1, std 1.
    s0, s1 = 0.5 + 1e-5, 1.0 + 1e-5
    a = [[0.0] + [0.25 / s0] * 3, [0.0, -0.75 / s0], [0.0] + [1 / s1] * 2, [0.0] + [-1 / s1] * 2, [0.0, 0.0]]
    path = two_step_gae_dump(tmp_path, a)
    code, m = run_json(capsys, "advantages", path, "--estimator", "gae", "--adv-norm", "batch",
                       "--batch-tokens", batch_tokens, "--fail-on-mismatch")
    assert code == 0 and m["adv_check/max_abs_diff"] < 1e-6
    assert m["adv_check/n_tokens_compared"] == 14  # prompt tokens too: adv_norm leaves 0 there


def test_reinforce_pp_hand_derived(capsys, tmp_path):
    # γ = 1: returns [1, 1] and [0]; whitened over the batch's 3 tokens: μ = 2/3, Σ(x − μ)² = 2/3, var = 1/3
    # (unbiased), rsqrt(1/3 + 1e-8) = √3 → [1/√3, 1/√3, −2/√3].
    k = 1 / math.sqrt(3)
    seqs = [{"new": [-1.0] * 3, "mask": [0, 1, 1], "reward": 1.0, "adv": [0.0, k, k]},
            {"new": [-1.0] * 2, "mask": [0, 1], "reward": 0.0, "adv": [0.0, -2 * k]}]
    path = tmp_path / "r.parquet"
    write_dump(path, seqs, per_token_adv=True)
    code, m = run_json(capsys, "advantages", path, "--estimator", "reinforce_pp", "--fail-on-mismatch")
    assert code == 0 and m["adv_check/max_abs_diff"] < 1e-6
    # γ = 0.5: returns [0.5, 1] and [0] — different advantages.
    code, m = run_json(capsys, "advantages", path, "--estimator", "reinforce_pp", "--discount", "0.5")
    assert m["adv_check/n_sequences_mismatch"] == 2


def test_reward_shaping_and_reward_norm(capsys, tmp_path):
    # Bias −0.5, scaling 10, clip 20: rewards 0, 1, 3 → −5, 5, 20 (25 clipped). drgrpo in one group: μ = 20/3.
    shaped = [-5.0, 5.0, 20.0]
    advs = [x - 20 / 3 for x in shaped]
    path = tmp_path / "shape.parquet"
    write_dump(path, seqs_with([0.0, 1.0, 3.0], [0, 0, 0], advs))
    code, m = run_json(capsys, "advantages", path, "--estimator", "drgrpo", "--reward-bias", "-0.5",
                       "--reward-scaling", "10", "--reward-clip", "20", "--fail-on-mismatch")
    assert code == 0, m
    # reward_norm batch/none (centre only) of the shaped rewards, then Dr.GRPO centres again: same values.
    code, m = run_json(capsys, "advantages", path, "--estimator", "drgrpo", "--reward-bias", "-0.5",
                       "--reward-scaling", "10", "--reward-clip", "20", "--reward-norm", "batch/none")
    assert m["adv_check/max_abs_diff"] < 1e-5


# ==============================================================================================================
# --write
# ==============================================================================================================


def test_write_recomputed_dump(capsys, tmp_path, group_data):
    rewards, groups = group_data
    advs = [0.0] * 12  # a dump whose advantages are all wrong
    split_dump(tmp_path, rewards, groups, advs)
    out = tmp_path / "out" / "fixed.parquet"
    out.parent.mkdir()
    code, _out_text, err = run(capsys, "advantages", tmp_path / "a.parquet", tmp_path / "b.parquet",
                              "--estimator", "grpo", "--write", out, "--batch-tokens", 4)
    assert code == 0 and f"wrote {out}" in err
    table = pq.read_table(out)
    assert table.num_rows == 12
    assert table.column("extra_text").to_pylist() == [f"row {i}" for i in range(6)] * 2
    assert table.schema.field("advantages").type == pa.float32()  # a per-sequence column stays one
    assert table.column("advantages").to_pylist() == pytest.approx(grpo_ref(rewards, groups), abs=1e-6)
    assert b"grpo_cli.advantages" in table.schema.metadata
    code, m = run_json(capsys, "advantages", out, "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 0 and m["adv_check/max_abs_diff"] < 1e-6


def test_write_per_token_and_token_per_row(capsys, tmp_path):
    seqs = [{"new": [-1.0] * 3, "mask": [0, 1, 1], "reward": 1.0, "group": 0, "adv": [9.0, 9.0, 9.0]},
            {"new": [-1.0] * 2, "mask": [0, 1], "reward": 0.0, "group": 0, "adv": [9.0, 9.0]}]
    for layout in (False, True):
        path = tmp_path / f"in{layout}.parquet"
        out = tmp_path / f"out{layout}.parquet"
        write_dump(path, seqs, token_layout=layout, per_token_adv=True, row_group_size=2)
        code, _, _ = run(capsys, "advantages", path, "--estimator", "reinforce_pp", "--write", out, "-q")
        assert code == 0
        values = pq.read_table(out).column("advantages").to_pylist()
        k = 1 / math.sqrt(3)
        expected = [[0.0, k, k], [0.0, -2 * k]]
        flat = [v for row in expected for v in row]
        if layout:
            assert values == pytest.approx(flat, abs=1e-6)
        else:
            assert [v for row in values for v in row] == pytest.approx(flat, abs=1e-6)
        code, _, _ = run(capsys, "advantages", out, "--estimator", "reinforce_pp", "--fail-on-mismatch")
        assert code == 0


def test_write_without_advantages_column(capsys, tmp_path):
    seqs = [{"new": [-1.0] * 2, "mask": [0, 1], "reward": r, "group": 0} for r in (1.0, 0.0)]
    path, out = tmp_path / "na.parquet", tmp_path / "na_out.parquet"
    write_dump(path, seqs)
    code, _, err = run(capsys, "advantages", path, "--estimator", "grpo")
    assert code == 2 and "no 'advantages' column" in err
    code, text, _ = run(capsys, "advantages", path, "--estimator", "drgrpo", "--write", out, "-f", "json")
    assert code == 0 and "adv_check/*" in json.loads(text)["omitted"]
    assert pq.read_table(out).column("advantages").to_pylist() == [0.5, -0.5]


# ==============================================================================================================
# usage errors (exit 2)
# ==============================================================================================================


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--estimator", "grpo", "--kl-ctl", "0.1"], "--kl-ctl does not apply"),
        (["--estimator", "gae", "--adv-norm", "median"], "--adv-norm: expected MEAN[/STD]"),
        (["--estimator", "gae", "--adv-norm", "batch,wat"], "unknown option 'wat'"),
        (["--estimator", "gae", "--kl-ctl", "0.1"], "no 'old_logp' column"),
        (["--estimator", "gae", "--mask-no-eos-with-zero"], "needs an 'eos' column"),
        (["--estimator", "grpo", "--atol", "-1"], "--atol must be"),
        (["--estimator", "grpo", "--batch-by", "rewards"], "--batch-by must be"),
        (["--estimator", "grpo", "--batch-by", "step"], "no 'step' column"),
        (["--estimator", "grpo", "--overlong-tokens", "8"], "go together"),
    ],
)
def test_usage_errors(capsys, tmp_path, extra, message):
    path = tmp_path / "u.parquet"
    write_dump(path, seqs_with([1.0, 0.0], [0, 0], [0.0, 0.0]))
    code, _, err = run(capsys, "advantages", path, *extra)
    assert code == 2 and message in err, err


def test_missing_columns_and_write_onto_input(capsys, tmp_path):
    path = tmp_path / "m.parquet"
    write_dump(path, [{"new": [-1.0, -1.0], "mask": [0, 1], "reward": 1.0, "adv": 0.0}])
    code, _, err = run(capsys, "advantages", path, "--estimator", "grpo")
    assert code == 2 and "no 'group_id' column" in err
    code, _, err = run(capsys, "advantages", path, "--estimator", "reinforce_pp", "--write", path)
    assert code == 2 and "is one of the inputs" in err
    write_dump(path, [{"new": [-1.0, -1.0], "mask": [0, 1], "group": 0, "adv": 0.0}])
    code, _, err = run(capsys, "advantages", path, "--estimator", "grpo")
    assert code == 2 and "no 'rewards' column" in err


# ==============================================================================================================
# the core pieces
# ==============================================================================================================


def test_parse_norm_spec():
    assert parse_norm_spec(None) is None and parse_norm_spec("none") is None
    cfg = parse_norm_spec("group/batch,leave1out,biased,eps=0.5,group_size=4")
    assert cfg == NormConfig("group", True, "batch", False, 0.5, 4)
    assert parse_norm_spec("batch/none") == NormConfig("batch", std_level=None)


def test_streaming_normalization_leave1out_and_singletons(device):
    # Batch 0: sequence 0 (group 0) tokens [1, 3, (masked 50)], sequence 1 (group 0) [5];
    # sequence 2 (group 1, alone) [2, 4]. Group level, leave-one-out, unbiased, eps 0:
    # group 0: S = 9, N = 3 → means (9 − x)/2 = 4, 3, 2; centred −3, 0, 3; Σ² = 18, std = √(18/2) = 3 → −1, 0, 1.
    # group 1 is one sequence: its own mean (centred 0) and std 1 → 0, 0.
    x = torch.tensor([1.0, 3.0, 50.0, 5.0, 2.0, 4.0], dtype=torch.float64, device=device)
    m = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool, device=device)
    cu = torch.tensor([0, 3, 4, 6], device=device)
    batch_index = torch.zeros(3, dtype=torch.int64, device=device)
    group_index = torch.tensor([0, 0, 1], device=device)
    cfg = NormConfig("group", True, "group", True, 0.0)
    expected = [-1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    for splits in ([0, 3], [0, 1, 2, 3]):  # whole batch, or one sequence at a time
        norm = StreamingNormalization(cfg, batch_index, group_index)
        parts = [(torch.arange(a, b, device=device), int(cu[a]), int(cu[b])) for a, b in itertools.pairwise(splits)]
        for step in ("update_mean", "update_std"):
            for idx, t0, t1 in parts:
                getattr(norm, step)(x[t0:t1], m[t0:t1], idx, cu[idx[0]: idx[-1] + 2] - t0)
        out = torch.cat([norm.apply(x[t0:t1], m[t0:t1], idx, cu[idx[0]: idx[-1] + 2] - t0) for idx, t0, t1 in parts])
        torch.testing.assert_close(out.cpu(), torch.tensor(expected, dtype=torch.float64))
    # The in-memory core normalize (a separate implementation) agrees on the same batch.
    ref = normalize(x, m, cfg, group_ids=group_index, cu_seqlens=cu)
    torch.testing.assert_close(ref.cpu(), torch.tensor(expected, dtype=torch.float64))


def test_streaming_normalization_biased_batch(device):
    # One batch, tokens [1, 2, 6]: mean 3, Σ² = 4 + 1 + 9 = 14, biased std √(14/3), eps 0.
    x = torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64, device=device)
    m = torch.ones(3, dtype=torch.bool, device=device)
    cu, idx = torch.tensor([0, 1, 3], device=device), torch.tensor([0, 1], device=device)
    norm = StreamingNormalization(NormConfig(std_unbiased=False, eps=0.0), torch.zeros(2, dtype=torch.int64,
                                                                                      device=device))
    norm.update_mean(x, m, idx, cu)
    norm.update_std(x, m, idx, cu)
    sd = math.sqrt(14 / 3)
    torch.testing.assert_close(norm.apply(x, m, idx, cu).cpu(),
                               torch.tensor([-2 / sd, -1 / sd, 3 / sd], dtype=torch.float64))


def test_streaming_whiten_per_batch(device):
    # Batch 0: [1, 3] → μ 2, var (1 + 1)/1 = 2 → ±1/√(2 + 1e-8). Batch 1: [10] alone → var 0 → 0·rsqrt(1e-8) = 0.
    x = torch.tensor([1.0, 3.0, 10.0], dtype=torch.float64, device=device)
    m = torch.ones(3, dtype=torch.bool, device=device)
    cu, idx = torch.tensor([0, 1, 2, 3], device=device), torch.tensor([0, 1, 2], device=device)
    w = StreamingWhiten(torch.tensor([0, 0, 1], device=device), eps=1e-8)
    w.update_mean(x, m, idx, cu)
    w.update_var(x, m, idx, cu)
    out = w.apply(x, m, idx, cu).cpu()
    k = 1 / math.sqrt(2 + 1e-8)
    assert out.tolist() == pytest.approx([-k, k, 0.0], rel=1e-12, abs=1e-12)


def test_adv_diff_tolerance_and_worst_order(device):
    # Sequence 0: diffs [0, 2e-5]; sequence 1: [1e-6]; sequence 2: [0.5, 0.5] (tie: first position wins).
    expected = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0], dtype=torch.float64, device=device)
    dumped = torch.tensor([0.0, 1.00002, 2.000001, 2.5, 2.5], dtype=torch.float64, device=device)
    mask = torch.ones(5, dtype=torch.bool, device=device)
    cu = torch.tensor([0, 2, 3, 5], device=device)
    keys = torch.tensor([[0, 10], [0, 11], [1, 0]], device=device)
    state = adv_diff_state(5, device)
    adv_diff_update(state, expected=expected, dumped=dumped, compare=mask, loss_mask=mask, cu_seqlens=cu,
                    sequence_keys=keys, atol=1e-5)
    out = adv_diff_compute(state)
    assert out["adv_check/n_sequences_mismatch"] == 2 and out["adv_check/n_tokens_mismatch"] == 3
    assert out["adv_check/max_abs_diff"] == pytest.approx(0.5)
    assert out["adv_check/mean_abs_diff"] == pytest.approx((2e-5 + 1e-6 + 1.0) / 5, rel=1e-6)
    worst = out["adv_check/worst"]
    assert [(w["file"], w["row"], w["position"]) for w in worst] == [(1, 0, 0), (0, 10, 1)]
    # rtol widens the band: |d| ≤ 1e-5 + 0.5·|expected| accepts sequence 2's 0.5 (≤ 1.5) too.
    state = adv_diff_state(0, device)
    adv_diff_update(state, expected=expected, dumped=dumped, compare=mask, loss_mask=mask, cu_seqlens=cu,
                    sequence_keys=keys, atol=1e-5, rtol=0.5)
    assert adv_diff_compute(state)["adv_check/n_sequences_mismatch"] == 0


def test_gae_streaming_equals_in_memory_pipeline(capsys, tmp_path):
    """The streamed AReaL pipeline equals the core's in-memory compute_advantages run on each step at once."""
    from grpo_cli.core import AdvantageConfig, compute_advantages, roll_to_next_token
    from grpo_cli.core.packing import cu_seqlens_from_lengths
    from grpo_cli.io.align import unroll_next_token

    gen = torch.Generator().manual_seed(5)
    cfg = AdvantageConfig(reward_bias=-0.5, reward_scaling=2.0, reward_clip=20.0, kl_ctl=0.05, kl_estimator="k3",
                          discount=0.95, gae_lambda=0.9, reward_norm=NormConfig("group", std_level="group"),
                          adv_norm=NormConfig("group", True, "batch"))
    seqs = []
    for step in range(2):
        n = 9
        lengths = torch.randint(3, 9, (n,), generator=gen)
        prompts = torch.randint(1, 3, (n,), generator=gen)
        rewards = torch.randint(0, 2, (n,), generator=gen).to(torch.float64)
        groups = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 3])  # group 3 is a single sequence
        cu = cu_seqlens_from_lengths(lengths)
        total = int(cu[-1])
        mask = torch.cat([torch.tensor([0] * int(p) + [1] * int(L - p)) for p, L in zip(prompts, lengths)]).bool()
        old = -torch.rand(total, generator=gen, dtype=torch.float64)
        ref = -torch.rand(total, generator=gen, dtype=torch.float64)
        out = compute_advantages(
            rewards, roll_to_next_token(mask, cu_seqlens=cu), old_logp=roll_to_next_token(old, cu_seqlens=cu),
            ref_logp=roll_to_next_token(ref, cu_seqlens=cu), group_ids=groups, cu_seqlens=cu, config=cfg,
        )
        adv = unroll_next_token(out["advantages"], cu, 0.0)
        for b in range(n):
            a, z = int(cu[b]), int(cu[b + 1])
            seqs.append({"new": [-1.0] * (z - a), "mask": mask[a:z].int().tolist(), "old": old[a:z].tolist(),
                         "ref": ref[a:z].tolist(), "reward": float(rewards[b]), "group": int(groups[b]),
                         "step": step, "adv": adv[a:z].tolist()})
    # Shuffle the steps' rows together so every batch mixes steps and groups.
    order = [i // 2 if i % 2 == 0 else 9 + i // 2 for i in range(18)]
    write_dump(tmp_path / "x.parquet", [seqs[i] for i in order], per_token_adv=True, row_group_size=4)
    code, m = run_json(capsys, "advantages", tmp_path / "x.parquet", "--estimator", "gae", "--reward-bias", "-0.5",
                       "--reward-scaling", "2", "--reward-clip", "20", "--kl-ctl", "0.05", "--kl-estimator", "k3",
                       "--discount", "0.95", "--gae-lambda", "0.9", "--reward-norm", "group",
                       "--adv-norm", "group/batch,leave1out", "--batch-tokens", "3", "--fail-on-mismatch")
    assert code == 0, m
    assert m["adv_check/max_abs_diff"] < 1e-5  # float32 storage of the dumped values
    # Without the leave-one-out mean the same dump disagrees (the check can fail).
    _, m = run_json(capsys, "advantages", tmp_path / "x.parquet", "--estimator", "gae", "--reward-bias", "-0.5",
                    "--reward-scaling", "2", "--reward-clip", "20", "--kl-ctl", "0.05", "--kl-estimator", "k3",
                    "--discount", "0.95", "--gae-lambda", "0.9", "--reward-norm", "group", "--adv-norm", "group/batch")
    assert m["adv_check/n_sequences_mismatch"] > 0


def test_gae_mask_no_eos_with_zero(capsys, tmp_path):
    # γ = λ = 1, no KL, mask [0, 1, 1]: rolled mask [1, 1, 0], R at seqlen − 2 = 1 → A = [1, 1, 0] → tokens
    # [0, 1, 1]. A sequence cut off without EOS gets reward 0 under --mask-no-eos-with-zero → [0, 0, 0].
    seqs = [{"new": [-1.0] * 3, "mask": [0, 1, 1], "reward": 1.0, "eos": eos, "adv": [0.0, 1.0, 1.0]}
            for eos in (True, False)]
    path = tmp_path / "eos.parquet"
    write_dump(path, seqs, per_token_adv=True)
    _, m = run_json(capsys, "advantages", path, "--estimator", "gae")
    assert m["adv_check/n_sequences_mismatch"] == 0
    _, m = run_json(capsys, "advantages", path, "--estimator", "gae", "--mask-no-eos-with-zero")
    assert m["adv_check/n_sequences_mismatch"] == 1
    assert [(w["row"], w["expected"], w["dumped"]) for w in m["adv_check/worst"]] == [(1, 0.0, 1.0)]


def test_sample_data_uses_trls_epsilon(capsys):
    """The bundled sample run normalises groups as TRL does (ε = 1e-4): verl's 1e-6 is off by up to ~1 %."""
    from pathlib import Path

    sample = Path(__file__).resolve().parent.parent / "sample_data" / "rollouts.parquet"
    if not sample.exists():
        pytest.skip("no sample data")
    code, m = run_json(capsys, "advantages", sample, "--estimator", "grpo", "--std-eps", "1e-4", "--fail-on-mismatch")
    assert code == 0 and m["adv_check/max_abs_diff"] < 1e-6
    code, m = run_json(capsys, "advantages", sample, "--estimator", "grpo")
    assert m["adv_check/n_sequences_mismatch"] > 0 and 1e-3 < m["adv_check/max_abs_diff"] < 0.05


# ==============================================================================================================
# options from the engine: --workers, --on-invalid, --preset/--map
# ==============================================================================================================


@pytest.mark.parametrize("estimator", [["grpo"], ["gae", "--adv-norm", "group,leave1out"], ["reinforce_pp"]])
def test_workers_give_the_same_bits(capsys, tmp_path, group_data, estimator):
    rewards, groups = group_data
    split_dump(tmp_path, rewards, groups, [0.25 * i for i in range(12)], steps=[i % 2 for i in range(12)])
    docs = []
    for workers in ("1", "3"):
        code, out, err = run(capsys, "advantages", tmp_path, "--estimator", *estimator, "--workers", workers,
                             "--batch-tokens", 4, "-f", "json")
        assert code == 0, err
        docs.append(json.loads(out))
    assert docs[0]["metrics"] == docs[1]["metrics"]
    assert docs[0]["metrics"]["adv_check/n_sequences"] == 12


def test_on_invalid_skip_drops_a_sequence_from_every_pass(capsys, tmp_path):
    # Sequence 2 (group 1) has a positive log-prob at a valid token: invalid input.
    rewards, groups = [1.0, 0.0, 5.0, 3.0, 1.0], [0, 0, 1, 1, 1]
    kept = [0, 1, 3, 4]
    advs = [0.0] * 5
    for i, a in zip(kept, grpo_ref([rewards[i] for i in kept], [groups[i] for i in kept])):
        advs[i] = a  # group 1 without sequence 2: rewards 3, 1 → ±0.7071
    seqs = seqs_with(rewards, groups, advs)
    seqs[2]["new"] = [-0.5, -0.5, -0.5, 0.5, -0.5]
    path = tmp_path / "bad.parquet"
    write_dump(path, seqs)
    code, out, err = run(capsys, "advantages", path, "--estimator", "grpo")
    assert code == 2 and "new_logp" in err and "row 2" in err
    code, out, err = run(capsys, "advantages", path, "--estimator", "grpo", "--on-invalid", "skip", "-f", "json",
                         "--fail-on-mismatch")
    assert code == 0, err
    doc = json.loads(out)
    m = doc["metrics"]
    assert m["invalid/n_sequences_skipped"] == 1 and m["invalid/new_logp_positive"] == 1
    assert m["adv_check/n_sequences"] == 4 and m["adv_check/n_sequences_mismatch"] == 0
    assert doc["config"]["on_invalid"] == "skip"
    assert "skipped" in err  # the warning every command prints
    code, _, err = run(capsys, "advantages", path, "--estimator", "grpo", "--on-invalid", "skip",
                       "--write", tmp_path / "o.parquet")
    assert code == 2 and "--on-invalid error" in err


def test_map_and_preset(capsys, tmp_path):
    rewards, groups = [1.0, 0.0], [7, 7]
    path = tmp_path / "d.parquet"
    write_dump(path, seqs_with(rewards, groups, grpo_ref(rewards, groups)))
    renamed = pq.read_table(path).rename_columns(
        ["new_logp", "loss_mask", "score", "group_id", "adv", "extra_text"]
    )
    pq.write_table(renamed, tmp_path / "renamed.parquet")
    code, m = run_json(capsys, "advantages", tmp_path / "renamed.parquet", "--estimator", "grpo",
                       "--map", "rewards=score", "--map", "advantages=adv", "--fail-on-mismatch")
    assert code == 0 and m["adv_check/n_sequences"] == 2
    code, _, err = run(capsys, "advantages", path, "--estimator", "grpo", "--preset", "areal",
                       "--write", tmp_path / "o.parquet")
    assert code == 2 and "--preset" in err

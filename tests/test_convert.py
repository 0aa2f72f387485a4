"""grpo-cli convert: slime debug dumps (v2 + legacy, joined), torch-dict, jsonl, --optimize; unsafe pickles refused."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dump_columns import f32, f32s, read_columns
from reference import random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.io import read_metadata


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# -- slime fixtures (keys as slime's rollout dump names them) ----------------------------------------------------
PROMPT = 3


def slime_rollout(rollout_id: int, lengths: list[int], versions: list[list[str]]) -> dict:
    """A --save-debug-rollout-data payload: one Sample.to_dict() per rollout position."""
    samples = []
    for pos, (length, weight_versions) in enumerate(zip(lengths, versions)):
        samples.append({
            "group_index": pos // 2, "index": pos, "rollout_id": rollout_id, "prompt": "p",
            "tokens": list(range(PROMPT + length)), "response": "r", "response_length": length, "label": "l",
            "reward": float(pos % 2), "loss_mask": [1] * length, "weight_versions": weight_versions,
            "rollout_log_probs": [-0.5 - 0.01 * t for t in range(length)], "status": "completed",
            "metadata": {"source": "test"},
        })
    return {"rollout_id": rollout_id, "samples": samples}


def train_sample(pos: int, length: int) -> dict:
    """One sample of a --save-debug-train-data v2 payload (response-only, token-aligned tensors)."""
    def values(f):  # computed in float64, stored as float32 once (like a real dump)
        return torch.tensor([f(t) for t in range(length)], dtype=torch.float32)

    return {
        "data_parallel_rank": pos % 2, "rollout_position": pos, "sample_index": pos,
        "tokens": torch.arange(PROMPT + length), "response_lengths": length, "total_lengths": PROMPT + length,
        "rewards": 0.7, "truncated": 0, "loss_masks": torch.tensor([1] * (length - 1) + [0]),
        "rollout_log_probs": values(lambda t: -0.5 - 0.01 * t),
        "log_probs": values(lambda t: -0.4 - 0.01 * t - 0.001 * pos),
        "ref_log_probs": values(lambda t: -0.45 - 0.01 * t), "values": torch.zeros(length),
        "advantages": torch.full((length,), 0.1 * pos),
        "returns": torch.zeros(length), "kl": torch.zeros(length), "round_number": 0,
    }


@pytest.fixture
def slime_dump(tmp_path):
    lengths = [4, 2, 5, 3]
    rollout = slime_rollout(7, lengths, [["5", "6"], ["6"], ["6"], ["4", "6"]])
    positions = [0, 2, 3]  # position 1 was filtered out before training
    train = {"format_version": 2, "rollout_id": 7, "rank": 0,
             "samples": [train_sample(p, lengths[p]) for p in positions],
             "dp_shards": [[0, 2], [3]], "raw_reward": [0.0, 1.0, 0.0, 1.0]}
    (tmp_path / "train_data").mkdir()
    (tmp_path / "rollout_data").mkdir()
    torch.save(train, tmp_path / "train_data" / "7.pt")
    torch.save(rollout, tmp_path / "rollout_data" / "7.pt")
    return tmp_path, lengths, positions


def expected_slime(lengths, positions):
    return {
        "new_logp": f32s([[-0.4 - 0.01 * t - 0.001 * p for t in range(lengths[p])] for p in positions]),
        "old_logp": f32s([[-0.5 - 0.01 * t for t in range(lengths[p])] for p in positions]),
        "loss_mask": [[True] * (lengths[p] - 1) + [False] for p in positions],
        "seq_id": positions,
    }


def test_slime_train_joined_with_rollout(capsys, slime_dump, tmp_path_factory):
    root, lengths, positions = slime_dump
    out = tmp_path_factory.mktemp("out")
    code, _, err = run(capsys, "convert", root / "train_data", "-o", out, "--from", "slime-train",
                       "--join", root / "rollout_data")
    assert code == 0, err
    got = read_columns(out)
    exp = expected_slime(lengths, positions)
    for key, value in exp.items():
        assert got[key] == value, key
    # log_probs is the recompute (proximal, = first training forward): stored as new_logp, no fake prox column
    assert "prox_logp" not in got["columns"]
    assert got["ref_logp"] == f32s([[-0.45 - 0.01 * t for t in range(lengths[p])] for p in positions])
    assert got["advantages"] == f32s([[0.1 * p] * lengths[p] for p in positions])
    # joined: versions = int(weight_versions[-1]) on every response token, group = group_index, raw reward
    assert got["versions"] == [[6] * lengths[p] for p in positions]
    assert got["group_id"] == [p // 2 for p in positions]
    assert got["rewards"] == [float(p % 2) for p in positions]
    assert got["step"] == [7, 7, 7]
    files = sorted(out.iterdir())
    assert [f.name for f in files] == ["part-step000007-rank000.parquet"]
    meta = read_metadata(files[0])
    assert meta["framework"] == "slime" and meta["window"] == "response" and meta["source_format"] == "slime-train"


def test_slime_dump_details_directory_and_rollout_primary(capsys, slime_dump, tmp_path_factory):
    root, lengths, positions = slime_dump
    out1, out2 = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    assert run(capsys, "convert", root, "-o", out1, "--from", "slime-train")[0] == 0  # --dump-details layout
    code, _, err = run(capsys, "convert", root / "rollout_data", "-o", out2, "--from", "slime-rollout",
                       "--join", root / "train_data")
    assert code == 0, err
    assert read_columns(out1) == read_columns(out2)
    assert read_columns(out1)["versions"] == [[6] * lengths[p] for p in positions]


def test_slime_rollout_alone_is_refused(capsys, slime_dump, tmp_path_factory):
    root, _, _ = slime_dump
    code, _, err = run(capsys, "convert", root / "rollout_data", "-o", tmp_path_factory.mktemp("o"),
                       "--from", "slime-rollout")
    assert code == 2 and "--join" in err


def test_slime_train_without_join_uses_raw_reward(capsys, slime_dump, tmp_path_factory):
    root, _, positions = slime_dump
    out = tmp_path_factory.mktemp("out")
    assert run(capsys, "convert", root / "train_data" / "7.pt", "-o", out, "--from", "slime-train")[0] == 0
    got = read_columns(out)
    assert got["rewards"] == [[0.0, 1.0, 0.0, 1.0][p] for p in positions]  # raw_reward by rollout position
    assert "versions" not in got["columns"] and "group_id" not in got["columns"]


def test_slime_legacy_per_rank_layout(capsys, tmp_path):
    # Before slime #2266: one file per rank, column-oriented lists, with numpy arrays (allow-listed).
    for rank, positions in ((0, [0, 2]), (1, [1])):
        samples = [train_sample(p, 3) for p in positions]
        data = {key: [s[key] for s in samples] for key in samples[0]}
        data["log_probs"] = [s["log_probs"].numpy() for s in samples]
        torch.save({"rollout_id": 2, "rank": rank, "rollout_data": data}, tmp_path / f"train_{rank}.pt")
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", tmp_path / "train_0.pt", tmp_path / "train_1.pt", "-o", out,
                       "--from", "slime-train")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["part-step000002-rank000.parquet",
                                                     "part-step000002-rank001.parquet"]
    got = read_columns(out)
    assert got["seq_id"] == [0, 2, 1]
    assert got["new_logp"][2] == f32([-0.4 - 0.01 * t - 0.001 for t in range(3)])


def test_slime_cp_local_chunk_is_refused(capsys, tmp_path):
    sample = train_sample(0, 4)
    sample["log_probs"] = sample["log_probs"][:2]  # a context-parallel chunk
    torch.save({"format_version": 2, "rollout_id": 0, "rank": 0, "samples": [sample]}, tmp_path / "t.pt")
    code, _, err = run(capsys, "convert", tmp_path / "t.pt", "-o", tmp_path / "o", "--from", "slime-train")
    assert code == 2 and "CP-local" in err and "t.pt" in err


class Evil:
    """Unpickling this would call open(marker, 'w') and create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("how", ["torch.save", "pickle protocol 2", "pickle protocol 5"])
def test_malicious_pickle_is_refused(capsys, tmp_path, how):
    marker = tmp_path / "pwned"
    payload = {"format_version": 2, "rollout_id": 0, "samples": [{"x": Evil(marker)}]}
    path = tmp_path / "evil.pt"
    if how == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=int(how[-1])))
    assert not marker.exists()
    for fmt in ("slime-train", "torch-dict"):
        code, _, err = run(capsys, "convert", path, "-o", tmp_path / "out", "--from", fmt)
        assert code == 2
        assert "refusing to unpickle" in err and "evil.pt" in err
        if how != "pickle protocol 5":  # protocol 5 is refused earlier, at an opcode torch's unpickler lacks
            assert "open" in err
        assert not marker.exists()
        assert "Traceback" not in err


# -- torch-dict -----------------------------------------------------------------------------------------------------
def test_torch_dict_padded_with_attention_mask(capsys, tmp_path):
    seqs = random_sequences(9, seed=3, max_len=8)
    width = max(len(s.new) for s in seqs) + 2
    new = torch.full((9, width), float("nan"))
    old = torch.full((9, width), float("nan"))
    mask = torch.zeros(9, width, dtype=torch.int64)
    attention = torch.zeros(9, width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s.new)
        new[i, :n], old[i, :n] = torch.tensor(s.new), torch.tensor(s.old)
        mask[i, :n], attention[i, :n] = torch.tensor(s.mask), True
    steps = torch.tensor([0] * 5 + [1] * 4)
    torch.save({"new_logp": new, "old_logp": old, "loss_mask": mask, "attention_mask": attention,
                "advantages": torch.tensor([s.advantage for s in seqs]), "step": steps,
                "input_ids": torch.zeros(9, width)}, tmp_path / "d.pt")
    code, _, err = run(capsys, "convert", tmp_path / "d.pt", "-o", tmp_path / "out", "--from", "torch-dict")
    assert code == 0, err
    assert "ignored keys input_ids" in err
    got = read_columns(tmp_path / "out")
    assert got["new_logp"] == f32s([s.new for s in seqs])
    assert got["old_logp"] == f32s([s.old for s in seqs])
    assert got["loss_mask"] == [[bool(m) for m in s.mask] for s in seqs]
    assert got["step"] == [0] * 5 + [1] * 4
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-step000000-rank000.parquet",
                                                                     "part-step000001-rank000.parquet"]


def test_torch_dict_with_areal_preset_unrolls(capsys, tmp_path):
    # AReaL _ppo_update names, rolled by -1 except versions; lengths from the rolled loss mask (+1).
    torch.save({"new_logprobs": torch.tensor([[-0.1, -0.2, -0.3, 0.0]]),
                "logprobs": torch.tensor([[-0.15, -0.25, -0.35, 0.0]]),
                "loss_mask": torch.tensor([[0, 1, 1, 0]]), "versions": torch.tensor([[-1, -1, 3, 3]]),
                "global_step": 5}, tmp_path / "a.pt")
    code, _, err = run(capsys, "convert", tmp_path / "a.pt", "-o", tmp_path / "out", "--from", "torch-dict",
                       "--preset", "areal")
    assert code == 0, err
    got = read_columns(tmp_path / "out")
    assert got["new_logp"] == f32s([[0.0, -0.1, -0.2, -0.3]])
    assert got["old_logp"] == f32s([[0.0, -0.15, -0.25, -0.35]])
    assert got["loss_mask"] == [[False, False, True, True]]
    assert got["versions"] == [[-1, -1, 3, 3]]
    assert got["step"] == [5]
    # the file says it is token-aligned now: reading it with --preset areal does not shift it again
    assert run(capsys, "analyze", tmp_path / "out", "--preset", "areal", "-f", "json")[0] == 0


def test_torch_dict_openrlhf_pads_one_slot(capsys, tmp_path):
    # [B, T-1] action tensors (index j scores token j+1): 3 actions → 4 tokens.
    torch.save({"new_action_log_probs": torch.tensor([[-0.1, -0.2, -0.3]]),
                "action_mask": torch.tensor([[0, 1, 1]])}, tmp_path / "o.pt")
    code, _, err = run(capsys, "convert", tmp_path / "o.pt", "-o", tmp_path / "out", "--from", "torch-dict",
                       "--preset", "openrlhf")
    assert code == 0, err
    got = read_columns(tmp_path / "out")
    assert got["new_logp"] == f32s([[0.0, -0.1, -0.2, -0.3]])
    assert got["loss_mask"] == [[False, False, True, True]]


# -- jsonl ----------------------------------------------------------------------------------------------------------
def test_jsonl(capsys, tmp_path):
    lines = [
        {"new_logp": [-0.1, -0.2], "old_logp": [-0.15, -0.25], "loss_mask": [0, 1], "advantages": 0.5,
         "rewards": 1.0, "step": 0, "group_id": 3},
        {"new_logp": [-0.3], "old_logp": [-0.35], "loss_mask": [1], "advantages": -0.5, "rewards": 0.0,
         "step": 0, "group_id": 3},
        {"new_logp": [-0.4, -0.5, -0.6], "old_logp": [-0.4, -0.5, -0.6], "loss_mask": [1, 1, 0],
         "advantages": 0.0, "rewards": 0.5, "step": 1, "group_id": 4},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "out", "--from", "jsonl")
    assert code == 0, err
    assert "3 sequences" in err and "6 tokens" in err
    got = read_columns(tmp_path / "out")
    assert got["new_logp"] == [line["new_logp"] for line in lines]  # JSON numbers are float64: kept exactly
    assert got["loss_mask"] == [[False, True], [True], [True, True, False]]
    assert got["advantages"] == [[0.5, 0.5], [-0.5], [0.0, 0.0, 0.0]]
    assert got["step"] == [0, 0, 1] and got["group_id"] == [3, 3, 4] and got["rewards"] == [1.0, 0.0, 0.5]


def test_jsonl_errors_name_the_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"new_logp": [-0.1]}\n{not json}\n')
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "o", "--from", "jsonl")
    assert code == 2 and "line 2" in err
    path.write_text('{"new_logp": [-0.1], "old_logp": [-0.2]}\n{"new_logp": [-0.1]}\n')
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "o2", "--from", "jsonl")
    assert code == 2 and "line 2" in err and "old_logp" in err


# -- optimize -------------------------------------------------------------------------------------------------------
def test_optimize_keeps_data_and_sets_fast_settings(capsys, tmp_path):
    seqs = random_sequences(50, seed=11)
    src = tmp_path / "src"
    src.mkdir()
    write_sequences(str(src / "rollouts.parquet"), seqs, row_group_size=7)  # pyarrow defaults, tiny row groups
    table = pq.read_table(src / "rollouts.parquet")
    pq.write_table(table.append_column("input_ids", pa.array([[1] * len(s.new) for s in seqs])),
                   src / "rollouts.parquet", row_group_size=7)
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", src, "-o", out, "--optimize")
    assert code == 0, err
    target = out / "rollouts.parquet"
    assert read_columns(target) == read_columns(src / "rollouts.parquet")
    parquet = pq.ParquetFile(target)
    assert parquet.metadata.num_row_groups == 1  # 7-row groups merged
    assert "input_ids" in parquet.schema_arrow.names  # extra columns kept
    assert not parquet.schema_arrow.field("new_logp").nullable
    chunk = parquet.metadata.row_group(0).column(0)
    assert chunk.compression == "ZSTD" and "BYTE_STREAM_SPLIT" in chunk.encodings
    a = json.loads(run(capsys, "analyze", src, "-f", "json")[1])["metrics"]
    b = json.loads(run(capsys, "analyze", out, "-f", "json")[1])["metrics"]
    assert a.keys() == b.keys()
    for key, value in a.items():  # other row groups → other batches → other summation order only
        assert b[key] == (pytest.approx(value, rel=1e-8) if isinstance(value, float) else value), key
    # a non-empty output directory is refused (stale parts would mix into the dump)
    assert run(capsys, "convert", src, "-o", out, "--optimize")[0] == 2


def test_optimize_validates_like_analyze(capsys, tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"new_logp": pa.array([[-0.1, None]], pa.list_(pa.float32()))}), path)
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "out", "--optimize")
    assert code == 2 and "null" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_usage_errors(capsys, tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"new_logp": [-0.1]}\n')
    other = tmp_path / "x.txt"  # a .jsonl source is recognised by its extension (tests/test_metadata_defaults.py)
    other.write_text('{"new_logp": [-0.1]}\n')
    assert run(capsys, "convert", other, "-o", tmp_path / "o")[0] == 2  # neither --from nor --optimize
    assert run(capsys, "convert", path, "-o", tmp_path / "o", "--from", "pickle")[0] == 2
    assert run(capsys, "convert", path, "-o", tmp_path / "o", "--from", "jsonl", "--join", path)[0] == 2
    assert run(capsys, "convert", tmp_path / "missing.pt", "-o", tmp_path / "o", "--from", "torch-dict")[0] == 2
    (tmp_path / "notorch.pt").write_bytes(b"garbage")
    code, _, err = run(capsys, "convert", tmp_path / "notorch.pt", "-o", tmp_path / "o", "--from", "torch-dict")
    assert code == 2 and "notorch.pt" in err


def test_numpy_rewards_are_allowed(tmp_path):
    # numpy arrays and scalars load through the allow-list (slime payloads may hold them)
    from grpo_cli.io.convert import safe_torch_load

    torch.save({"a": np.arange(3, dtype=np.float32), "b": np.float64(1.5)}, tmp_path / "n.pt")
    loaded = safe_torch_load(tmp_path / "n.pt")
    assert loaded["a"].tolist() == [0.0, 1.0, 2.0] and float(loaded["b"]) == 1.5


def test_converters_check_values_like_analyze(capsys, tmp_path):
    # a positive log-prob at a valid token: refused (nothing left behind) unless --on-invalid skip
    path = tmp_path / "d.jsonl"
    path.write_text('{"new_logp": [-0.1, 0.7], "loss_mask": [1, 1]}\n{"new_logp": [-0.2], "loss_mask": [1]}\n')
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "out", "--from", "jsonl")
    assert code == 2 and "new_logp" in err and "> 0" in err and "nothing written" in err
    assert not list((tmp_path / "out").glob("*.parquet"))
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "out2", "--from", "jsonl", "--on-invalid", "skip")
    assert code == 0 and "1 sequences hold invalid values" in err
    assert read_columns(tmp_path / "out2")["lengths"] == [2, 1]  # kept: analyze --on-invalid skip drops it later
    # --optimize checks the source before writing anything
    code, _, err = run(capsys, "convert", tmp_path / "out2", "-o", tmp_path / "out3", "--optimize")
    assert code == 2 and "new_logp" in err and "> 0" in err
    assert not (tmp_path / "out3").exists()

"""--preset: column maps per framework (docs/schema.md), un-rolling transforms, `grpo-cli schema`, alignment helpers."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dump_columns import f32s, read_columns

from grpo_cli._choices import PRESET_NAMES
from grpo_cli.cli import main
from grpo_cli.io import RolloutWriter
from grpo_cli.io.align import prepend_slot, unroll_next_token
from grpo_cli.io.presets import PRESETS, open_dataset, resolve_column_map

F32 = pa.list_(pa.float32())


def write(path, columns: dict[str, tuple[list, pa.DataType]]) -> str:
    pq.write_table(pa.table({name: pa.array(values, typ) for name, (values, typ) in columns.items()}), path)
    return str(path)


def read_all(dataset) -> dict[str, list]:
    return read_columns(dataset, batch_tokens=3)


def test_cli_preset_names_match_presets():
    assert list(PRESET_NAMES) == list(PRESETS)


# Hand-written from the frameworks' tensor names: which framework tensor becomes which schema column ("old" → prox
# where the framework's old log-prob is its proximal recompute).
MAPS = {
    "areal": (["new_logprobs", "logprobs", "prox_logp", "ref_logp", "loss_mask", "versions", "global_step",
               "task_id"],
              {"new_logp": "new_logprobs", "old_logp": "logprobs", "step": "global_step", "group_id": "task_id"}),
    "verl": (["log_probs", "rollout_log_probs", "old_log_probs", "ref_log_prob", "response_mask", "entropys",
              "global_steps"],
             {"new_logp": "log_probs", "old_logp": "rollout_log_probs", "prox_logp": "old_log_probs",
              "ref_logp": "ref_log_prob", "loss_mask": "response_mask", "entropy": "entropys",
              "step": "global_steps"}),
    "trl": (["per_token_logps", "sampling_per_token_logps", "old_per_token_logps", "ref_per_token_logps",
             "completion_mask", "entropies", "global_step"],
            {"new_logp": "per_token_logps", "old_logp": "sampling_per_token_logps",
             "prox_logp": "old_per_token_logps", "ref_logp": "ref_per_token_logps", "loss_mask": "completion_mask",
             "entropy": "entropies", "step": "global_step"}),
    "slime": (["new_log_probs", "rollout_log_probs", "log_probs", "ref_log_probs", "loss_masks", "raw_reward",
               "rewards", "rollout_id", "group_index", "rollout_position"],
              {"new_logp": "new_log_probs", "old_logp": "rollout_log_probs", "prox_logp": "log_probs",
               "ref_logp": "ref_log_probs", "loss_mask": "loss_masks", "rewards": "raw_reward", "step": "rollout_id",
               "group_id": "group_index", "seq_id": "rollout_position"}),
    "openrlhf": (["new_action_log_probs", "rollout_log_probs", "action_log_probs", "base_action_log_probs",
                  "action_mask", "index"],
                 {"new_logp": "new_action_log_probs", "old_logp": "rollout_log_probs", "prox_logp": "action_log_probs",
                  "ref_logp": "base_action_log_probs", "loss_mask": "action_mask", "seq_id": "index"}),
    "twinkle": (["logps", "old_logps", "ref_logps", "entropies", "mask", "optim_step"],
                {"new_logp": "logps", "old_logp": "old_logps", "ref_logp": "ref_logps", "entropy": "entropies",
                 "loss_mask": "mask", "step": "optim_step"}),
}


@pytest.mark.parametrize("name", list(MAPS))
def test_preset_column_maps(name):
    columns, expected = MAPS[name]
    assert resolve_column_map(name, columns) == expected
    # --map wins over the preset; absent framework columns map to nothing (the schema name is used if present)
    override = resolve_column_map(name, columns, {"ref_logp": "my_ref"})
    assert override["ref_logp"] == "my_ref"
    assert resolve_column_map(name, ["new_logp", "old_logp"]) == {}


def test_token_aligned_preset_renames_without_shifting(tmp_path):
    path = write(tmp_path / "verl.parquet", {
        "log_probs": ([[-0.1, -0.2], [-0.3]], F32),
        "rollout_log_probs": ([[-0.15, -0.25], [-0.35]], F32),
        "old_log_probs": ([[-0.11, -0.21], [-0.31]], F32),
        "response_mask": ([[1, 0], [1]], pa.list_(pa.int8())),
        "advantages": ([0.5, -1.0], pa.float32()),
        "global_steps": ([3, 3], pa.int64()),
    })
    got = read_all(open_dataset([path], preset="verl"))
    assert got["new_logp"] == f32s([[-0.1, -0.2], [-0.3]])
    assert got["old_logp"] == f32s([[-0.15, -0.25], [-0.35]])
    assert got["prox_logp"] == f32s([[-0.11, -0.21], [-0.31]])
    assert got["loss_mask"] == [[True, False], [True]]
    assert got["step"] == [3, 3]
    assert "ref_logp" not in got  # absent stays absent


def areal_file(tmp_path, *, per_token_advantages: bool) -> str:
    # One AReaL sequence of 4 tokens (t0 t1 prompt, t2 t3 generated), tensors as _ppo_update sees them:
    # rolled by -1, so index t holds token t+1's value and the last slot is garbage (9.0);
    # versions are NOT rolled. Loss mask rolled: [0, 1, 1, 0] (positions predicting t2, t3).
    cols = {
        "new_logprobs": ([[-0.5, -0.6, -0.7, 9.0]], F32),
        "logprobs": ([[-0.55, -0.65, -0.75, 9.0]], F32),
        "prox_logp": ([[-0.51, -0.61, -0.71, 9.0]], F32),
        "loss_mask": ([[0, 1, 1, 0]], pa.list_(pa.int8())),
        "versions": ([[-1, -1, 4, 4]], pa.list_(pa.int32())),
    }
    if per_token_advantages:
        cols["advantages"] = ([[0.0, 2.0, 2.0, 0.0]], F32)
    else:
        cols["advantages"] = ([2.0], pa.float32())
    return write(tmp_path / f"areal{int(per_token_advantages)}.parquet", cols)


def test_areal_preset_unrolls_all_but_versions(tmp_path):
    got = read_all(open_dataset([areal_file(tmp_path, per_token_advantages=True)], preset="areal"))
    # token-aligned: token 0 gets the fill (0.0, masked), token t>0 gets the rolled value at t-1
    assert got["new_logp"] == f32s([[0.0, -0.5, -0.6, -0.7]])
    assert got["old_logp"] == f32s([[0.0, -0.55, -0.65, -0.75]])
    assert got["prox_logp"] == f32s([[0.0, -0.51, -0.61, -0.71]])
    assert got["loss_mask"] == [[False, False, True, True]]
    assert got["versions"] == [[-1, -1, 4, 4]]  # not rolled
    assert got["advantages"] == [[0.0, 0.0, 2.0, 2.0]]


def test_areal_preset_keeps_per_sequence_advantages(tmp_path):
    got = read_all(open_dataset([areal_file(tmp_path, per_token_advantages=False)], preset="areal"))
    assert got["advantages"] == [[2.0, 2.0, 2.0, 2.0]]  # one value per sequence: nothing to shift
    assert got["loss_mask"] == [[False, False, True, True]]


def test_twinkle_preset_unrolls_everything(tmp_path):
    # labels rolled -1: the mask [1, 1, 0] at positions 0, 1 means tokens 1, 2 are trained; last slot wraps.
    path = write(tmp_path / "twinkle.parquet", {
        "logps": ([[-1.0, -2.0, 5.0]], F32),
        "old_logps": ([[-1.5, -2.5, 5.0]], F32),
        "mask": ([[1, 1, 0]], pa.list_(pa.int8())),
        "optim_step": ([2], pa.int64()),
    })
    got = read_all(open_dataset([path], preset="twinkle"))
    assert got["new_logp"] == [[0.0, -1.0, -2.0]]
    assert got["old_logp"] == [[0.0, -1.5, -2.5]]
    assert got["loss_mask"] == [[False, True, True]]
    assert got["step"] == [2]


def test_twinkle_labels_are_not_a_mask(tmp_path, capsys):
    path = write(tmp_path / "t.parquet", {"logps": ([[-1.0]], F32), "labels": ([[5]], pa.list_(pa.int64()))})
    assert main(["analyze", path, "--preset", "twinkle", "-q"]) == 2
    assert "labels != -100" in capsys.readouterr().err


def test_openrlhf_preset_prepends_first_slot(tmp_path):
    # [B, T-1] action tensors: index j scores token j+1. Sequence 0 has 4 tokens (3 actions), sequence 1 has 2.
    path = write(tmp_path / "o.parquet", {
        "new_action_log_probs": ([[-0.1, -0.2, -0.3], [-0.4]], F32),
        "action_log_probs": ([[-0.11, -0.21, -0.31], [-0.41]], F32),
        "action_mask": ([[0, 1, 1], [1]], pa.list_(pa.int8())),
        "index": ([10, 11], pa.int64()),
    })
    got = read_all(open_dataset([path], preset="openrlhf"))
    assert got["lengths"] == [4, 2]
    assert got["new_logp"] == f32s([[0.0, -0.1, -0.2, -0.3], [0.0, -0.4]])
    assert got["prox_logp"] == f32s([[0.0, -0.11, -0.21, -0.31], [0.0, -0.41]])
    assert got["loss_mask"] == [[False, False, True, True], [False, True]]
    assert got["seq_id"] == [10, 11]


def test_writer_files_are_not_unrolled_again(tmp_path):
    # RolloutWriter already un-rolled (metadata grpo_cli.alignment = token): --preset areal must leave it alone.
    with RolloutWriter(tmp_path) as w:
        w.add(step=0, new_logp=[torch.tensor([-1.0, -2.0, -3.0])], loss_mask=[torch.tensor([0, 1, 1])])
    got = read_all(open_dataset([tmp_path], preset="areal"))
    assert got["new_logp"] == [[-1.0, -2.0, -3.0]]
    assert got["loss_mask"] == [[False, True, True]]


def test_analyze_preset_equals_canonical_names(tmp_path, capsys):
    values = {
        "new": [[-0.1, -0.9, -0.3], [-1.2, -0.05]],
        "old": [[-0.2, -0.5, -0.6], [-1.0, -0.5]],
        "prox": [[-0.15, -0.7, -0.31], [-1.1, -0.3]],
        "mask": [[0, 1, 1], [1, 1]],
    }
    canonical = write(tmp_path / "canonical.parquet", {
        "new_logp": (values["new"], F32), "old_logp": (values["old"], F32), "prox_logp": (values["prox"], F32),
        "loss_mask": (values["mask"], pa.list_(pa.int8())), "advantages": ([1.0, -1.0], pa.float32())})
    verl = write(tmp_path / "verl.parquet", {
        "log_probs": (values["new"], F32), "rollout_log_probs": (values["old"], F32),
        "old_log_probs": (values["prox"], F32), "response_mask": (values["mask"], pa.list_(pa.int8())),
        "advantages": ([1.0, -1.0], pa.float32())})
    assert main(["analyze", canonical, "-f", "json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main(["analyze", verl, "-f", "json", "--preset", "verl"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["metrics"] == expected["metrics"]
    assert got["preset"] == "verl"
    # without the preset the verl file has no new_logp column: exit 2
    assert main(["analyze", verl, "-q"]) == 2
    assert "new_logp" in capsys.readouterr().err


def test_schema_command(capsys):
    assert main(["schema"]) == 0
    out = capsys.readouterr().out
    for name in ("new_logp", "old_logp", "prox_logp", "loss_mask", "versions", "advantages", "seq_id"):
        assert name in out
    assert main(["schema", "--preset", "slime"]) == 0
    out = capsys.readouterr().out
    assert "prox_logp" in out and "log_probs" in out and "raw_reward" in out
    assert main(["schema", "--preset", "areal", "-f", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["preset"]["name"] == "areal"
    assert doc["preset"]["token_aligned"] == ["versions"]
    assert main(["schema", "--preset", "nope"]) == 2
    assert main(["schema", "-f", "csv"]) == 2


def test_unroll_next_token_by_hand(device):
    # sequences [a b c] [] [d e]: next-token values [1 2 9] [] [4 9] → [f 1 2] [] [f 4]
    cu = torch.tensor([0, 3, 3, 5], device=device)
    values = torch.tensor([1.0, 2.0, 9.0, 4.0, 9.0], device=device)
    out = unroll_next_token(values, cu, -5.0)
    assert out.device.type == torch.device(device).type
    assert out.tolist() == [-5.0, 1.0, 2.0, -5.0, 4.0]
    assert values.tolist() == [1.0, 2.0, 9.0, 4.0, 9.0]  # input untouched
    mask = unroll_next_token(torch.tensor([True, True, False], device=device), torch.tensor([0, 3], device=device),
                             False)
    assert mask.tolist() == [False, True, True]
    with pytest.raises(ValueError):
        unroll_next_token(values, torch.tensor([0, 4], device=device), 0.0)


def test_prepend_slot_by_hand(device):
    # [1 2] [] [3] → [f 1 2] [f] [f 3]
    out, cu = prepend_slot(torch.tensor([1, 2, 3], device=device), torch.tensor([0, 2, 2, 3], device=device), -1)
    assert out.tolist() == [-1, 1, 2, -1, -1, 3]
    assert cu.tolist() == [0, 3, 4, 6]


def test_schema_help_describes_its_own_preset_option():
    # schema reads no dump: its --preset shows a map, it does not read with one (the reading commands' help).
    from typer.testing import CliRunner

    from grpo_cli.cli import app

    schema = " ".join(CliRunner().invoke(app, ["schema", "--help"], env={"COLUMNS": "200"}).output.split())
    analyze = " ".join(CliRunner().invoke(app, ["analyze", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "Read a dump written with a framework's own tensor names" in analyze
    assert "Read a dump written" not in schema
    assert "Also show this framework's column map" in schema

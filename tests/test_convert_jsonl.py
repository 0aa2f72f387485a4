"""convert --from jsonl (numpy, torch-free) against the torch path it replaces.

The converter must write byte for byte what ``RolloutWriter.add`` writes when each line's lists are given as tensors
(float64, ``versions`` int64) and its per-sequence values as lists; :func:`check_part_files` must refuse the same
first offender with the same message and count the same sequences as ``BatchValidator`` (torch) does.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_cli.commands.convert import convert, validate
from grpo_cli.engine.checks import check_part_files
from grpo_cli.errors import InputError
from grpo_cli.io import RolloutDataset, RolloutWriter
from grpo_cli.io._convert_common import _conventions
from grpo_cli.io.convert import ConvertResult
from grpo_cli.io.preset_table import PRESETS

NAN = float("nan")


def _torch_reference(rows, out, preset=None):
    """The torch path: consecutive lines of one step → one ``RolloutWriter.add`` of lists of tensors."""
    chosen = PRESETS[preset] if preset else None
    alignment, overrides, window, pad = _conventions(chosen)
    meta = {"source_format": "jsonl"}
    if chosen is not None:
        meta["framework"] = chosen.framework
    per_sequence = ("rewards", "current_version", "group_id", "seq_id")
    runs: list[list[dict]] = []
    for row in rows:
        if runs and runs[-1][0].get("step", 0) == row.get("step", 0):
            runs[-1].append(row)
        else:
            runs.append([row])
    with RolloutWriter(out, metadata=meta) as writer:
        for run in runs:
            inputs = {}
            for key in run[0]:
                if key == "step":
                    continue
                values = [row[key] for row in run]
                if key in per_sequence or (key == "advantages" and not isinstance(values[0], list)):
                    inputs[key] = values
                    continue
                dtype = torch.int64 if key == "versions" else torch.float64
                tensors = [torch.tensor([math.nan if v is None else v for v in value], dtype=dtype)
                           for value in values]
                if pad:
                    tensors = [torch.cat([t, t.new_full((1,), -1 if key == "versions" else 0)]) for t in tensors]
                inputs[key] = tensors
            writer.add(step=run[0].get("step", 0), alignment=alignment, column_alignment=overrides, window=window,
                       **inputs)
    return writer.files


def _lines(rows, path):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


ROWS = [
    {"new_logp": [-0.5, -1.0, -0.25], "old_logp": [None, -1.1, -0.2], "loss_mask": [0, 1, 1],
     "versions": [-1, 3, 3], "advantages": [0.0, 0.5, 0.5], "entropy": [0.1, 0.2, 0.3], "rewards": 1,
     "group_id": 0, "seq_id": 7, "current_version": 4, "step": 0},
    {"new_logp": [-2.0], "old_logp": [-1.9], "loss_mask": [1], "versions": [4], "advantages": [-1.5],
     "entropy": [0.0], "rewards": 0.25, "group_id": 0, "seq_id": 8, "current_version": 4, "step": 0},
    {"new_logp": [], "old_logp": [], "loss_mask": [], "versions": [], "advantages": [], "entropy": [],
     "rewards": 0, "group_id": 1, "seq_id": 9, "current_version": 4, "step": 2},
    {"new_logp": [-0.1, -0.7], "old_logp": [-0.1, -0.6], "loss_mask": [1, 1], "versions": [2, 4],
     "advantages": [1.0, 1.0], "entropy": [0.5, 0.4], "rewards": 1.0, "group_id": 1, "seq_id": 10,
     "current_version": 4, "step": 0},  # step 0 again: a second part file, part-step000000-rank000-1
]
PER_SEQUENCE_ADVANTAGES = [{**row, "advantages": [0.5, -1.5, 0.0, 1.0][i]} for i, row in enumerate(ROWS)]
NO_MASK = [  # every token counts: no NaN to hide
    {**{k: v for k, v in row.items() if k != "loss_mask"},
     "old_logp": [-0.6 if v is None else v for v in row["old_logp"]]}
    for row in PER_SEQUENCE_ADVANTAGES
]


@pytest.mark.parametrize(("rows", "preset"), [
    (ROWS, None),
    (PER_SEQUENCE_ADVANTAGES, None),
    (ROWS, "areal"),  # next-token aligned, versions token-aligned: un-rolled, first tokens masked
    (NO_MASK, "twinkle"),  # un-rolled without a mask: the writer adds one
    (PER_SEQUENCE_ADVANTAGES, "openrlhf"),  # one slot short: padded, then un-rolled
    (ROWS, "verl"),  # token-aligned, response window
])
def test_jsonl_writes_what_the_torch_writer_writes(tmp_path, rows, preset):
    expected = _torch_reference(rows, tmp_path / "torch", preset)
    result = convert([_lines(rows, tmp_path / "d.jsonl")], tmp_path / "numpy", source_format="jsonl", preset=preset)
    assert [p.name for p in result.files] == [p.name for p in expected]
    assert len(expected) == 3
    for got, want in zip(result.files, expected):
        assert pq.read_schema(got) == pq.read_schema(want)
        assert pq.read_schema(got).metadata == pq.read_schema(want).metadata
        assert got.read_bytes() == want.read_bytes()  # values (NaN included), encodings and row groups
    assert result.n_sequences == 4


@pytest.mark.parametrize(("change", "message"), [
    ({"group_id": 0.5}, "group_id: expected integer values"),
    ({"versions": [-1, 2**40, 3]}, "versions: values outside the int32 range"),
    ({"old_logp": [-1.0]}, "old_logp[0]: has shape (1,), new_logp[0] has 3 tokens"),
    ({"new_logp": [[-1.0, -2.0]]}, "new_logp[0]: expected a 1-D tensor, got shape (1, 2)"),
    ({"rewards": True}, "rewards: expected float values"),
])
def test_jsonl_refuses_what_the_torch_writer_refuses(tmp_path, change, message):
    rows = [{**ROWS[0], **change}]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _torch_reference(rows, tmp_path / "torch")
    with pytest.raises(InputError, match="cannot convert") as info:
        convert([_lines(rows, tmp_path / "d.jsonl")], tmp_path / "numpy", source_format="jsonl")
    assert message in str(info.value)
    assert not list((tmp_path / "numpy").glob("*.parquet"))


def test_jsonl_strings_are_not_numbers(tmp_path):
    rows = [{**ROWS[0], "new_logp": ["-0.5", -1.0, -0.25]}]
    with pytest.raises(InputError, match=r"line 1: 'new_logp' is not numeric"):
        convert([_lines(rows, tmp_path / "d.jsonl")], tmp_path / "o", source_format="jsonl")


# -- the value checks: numpy (part files) against torch (BatchValidator) ------------------------------------------
def _invalid_dump(tmp_path):
    """Two part files; offenders by construction (rows are per file):

    file 0: row 0 clean; row 1 new_logp 0.5 > 0 at token 1 and NaN entropy at token 0; row 2 NaN new_logp at a
    masked token only (valid); row 3 reward inf; row 4 empty.
    file 1: row 0 version 6 > current_version 5 at token 2; row 1 advantage NaN (per sequence, every token);
    row 2 entropy -0.5 at token 0 and reward NaN; row 3 clean.
    """
    writer = RolloutWriter(tmp_path / "d")
    t = torch.tensor
    writer.add(step=0,
               new_logp=[t([-1.0, -2.0]), t([-1.0, 0.5, -0.1]), t([NAN, -1.0]), t([-0.3]), t([])],
               entropy=[t([0.1, 0.2]), t([NAN, 0.1, 0.1]), t([0.1, 0.1]), t([0.2]), t([])],
               loss_mask=[t([1, 1]), t([1, 1, 1]), t([0, 1]), t([1]), t([], dtype=torch.int64)],
               versions=[t([1, 1]), t([1, 1, 1]), t([1, 1]), t([1]), t([], dtype=torch.int64)],
               current_version=5, advantages=[1.0, 1.0, 1.0, 1.0, 1.0],
               rewards=[1.0, 0.0, 1.0, math.inf, 0.0])
    writer.add(step=1,
               new_logp=[t([-1.0, -2.0, -3.0]), t([-1.0]), t([-0.5, -0.5]), t([-0.2])],
               entropy=[t([0.1, 0.2, 0.3]), t([0.1]), t([-0.5, 0.1]), t([0.3])],
               loss_mask=[t([1, 1, 1]), t([1]), t([1, 1]), t([1])],
               versions=[t([5, 5, 6]), t([5]), t([5, 5]), t([5])],
               current_version=5, advantages=[1.0, NAN, 1.0, 1.0],
               rewards=[1.0, 0.0, NAN, 1.0])
    writer.close()
    return writer.files


def _torch_check(files, on_invalid):
    result = ConvertResult()
    validate(RolloutDataset(files), on_invalid, result, "x")
    return result.notes


def test_part_file_checks_count_what_batch_validator_counts(tmp_path):
    files = _invalid_dump(tmp_path)
    counts = check_part_files(files, "skip")
    # by construction (see _invalid_dump): file 0 rows 1 and 3, file 1 rows 0, 1 and 2
    assert counts == {
        "invalid/n_sequences_skipped": 5,
        "invalid/n_tokens_skipped": 3 + 1 + 3 + 1 + 2,
        "invalid/new_logp_positive": 1,
        "invalid/entropy_not_finite": 1,
        "invalid/entropy_negative": 1,
        "invalid/advantages_not_finite": 1,
        "invalid/versions_above_current": 1,
        "invalid/rewards_not_finite": 2,
    }
    reasons = ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in counts.items()
                        if k not in ("invalid/n_sequences_skipped", "invalid/n_tokens_skipped"))
    assert _torch_check(files, "skip") == [
        f"x: 5 sequences hold invalid values ({reasons}); kept — analyze them with --on-invalid skip"]
    assert check_part_files(files[:1], "skip")["invalid/n_sequences_skipped"] == 2


@pytest.mark.parametrize("keep", [None, 1, 0])
def test_part_file_checks_refuse_what_batch_validator_refuses(tmp_path, keep):
    files = _invalid_dump(tmp_path)
    files = files if keep is None else [files[keep]]
    with pytest.raises(InputError) as torch_error:
        _torch_check(files, "error")
    with pytest.raises(InputError) as numpy_error:
        check_part_files(files, "error")
    assert str(numpy_error.value) == str(torch_error.value)
    expected = {  # the first offender in file order, then row, then token (a per-sequence problem first)
        None: ("row 1, token 0", "entropy is nan"),
        0: ("row 1, token 0", "entropy is nan"),
        1: ("row 0, token 2", "version 6 at a valid token is above the sequence's current_version 5"),
    }[keep]
    for part in expected:
        assert part in str(numpy_error.value)


def test_part_file_checks_read_integer_masks_and_flags(tmp_path):
    # a file written by hand: an int8 loss_mask holding 2, an eos flag of 3, a per-row reward that is fine
    path = tmp_path / "hand.parquet"
    table = pa.table({
        "new_logp": pa.array([[-1.0, -0.5], [-0.1]], pa.list_(pa.float32())),
        "loss_mask": pa.array([[1, 1], [2]], pa.list_(pa.int8())),
        "eos": pa.array([3, 1], pa.int64()),
        "rewards": pa.array([0.0, 1.0], pa.float32()),
    })
    pq.write_table(table, path)
    with pytest.raises(InputError) as torch_error:
        _torch_check([path], "error")
    with pytest.raises(InputError) as numpy_error:
        check_part_files([path], "error")
    assert str(numpy_error.value) == str(torch_error.value)
    assert "eos flag 3" in str(numpy_error.value)  # row 0's per-sequence flag comes before row 1's mask
    assert check_part_files([path], "skip") == {
        "invalid/n_sequences_skipped": 2, "invalid/n_tokens_skipped": 3,
        "invalid/loss_mask_not_binary": 1, "invalid/eos_not_binary": 1,
    }
    assert np.isfinite(pq.read_table(path).column("rewards").to_numpy()).all()

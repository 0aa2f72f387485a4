"""RolloutWriter: every input form round-trips through RolloutDataset; alignment, atomicity, metadata, settings."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dump_columns import f32, read_columns
from reference import policy_reference, random_sequences

from grpo_cli.cli import main
from grpo_cli.io import RolloutWriter, read_metadata

TOKEN_ATTRS = {"new_logp": "new", "old_logp": "old", "ref_logp": "ref", "entropy": "entropy"}


def read_back(directory) -> dict[str, list]:
    return read_columns(directory)


@pytest.fixture
def seqs():
    return random_sequences(23, seed=5, max_len=12)


def expected_columns(seqs) -> dict[str, list]:
    exp = {name: [f32(getattr(s, attr)) for s in seqs] for name, attr in TOKEN_ATTRS.items()}
    exp["loss_mask"] = [[bool(m) for m in s.mask] for s in seqs]
    exp["versions"] = [list(s.versions) for s in seqs]
    exp["lengths"] = [len(s.new) for s in seqs]
    return exp


def check_round_trip(directory, seqs, *, per_token_advantages: bool = False) -> None:
    got = read_back(directory)
    exp = expected_columns(seqs)
    for name, values in exp.items():
        assert got[name] == values, name
    # per-sequence advantages are broadcast by the reader over the sequence's tokens
    assert got["advantages"] == [[f32([s.advantage])[0]] * len(s.new) for s in seqs]
    assert got["rewards"] == f32([s.reward for s in seqs])
    assert got["group_id"] == [s.group_id for s in seqs]
    assert got["seq_id"] == list(range(len(seqs)))
    # prox_logp was not passed: absent, not zeros
    assert "prox_logp" not in got["columns"] and "prox_logp" not in got
    assert "current_version" not in got["columns"]


def test_list_form_round_trip(tmp_path, seqs):
    with RolloutWriter(tmp_path, metadata={"framework": "test"}) as w:
        n = w.add(
            step=4,
            new_logp=[torch.tensor(s.new) for s in seqs],
            old_logp=[torch.tensor(s.old) for s in seqs],
            ref_logp=[np.asarray(s.ref, dtype=np.float32) for s in seqs],  # numpy works too
            entropy=[s.entropy for s in seqs],  # and plain lists
            loss_mask=[torch.tensor(s.mask) for s in seqs],
            versions=[torch.tensor(s.versions) for s in seqs],
            advantages=[s.advantage for s in seqs],
            rewards=[s.reward for s in seqs],
            group_id=torch.tensor([s.group_id for s in seqs]),
            seq_id=list(range(len(seqs))),
        )
    assert n == len(seqs)
    assert [p.name for p in w.files] == ["part-step000004-rank000.parquet"]
    check_round_trip(tmp_path, seqs)
    assert read_back(tmp_path)["step"] == [4] * len(seqs)


def packed(seqs, attr):
    return torch.cat([torch.tensor(getattr(s, attr)) for s in seqs])


def test_packed_form_round_trip(tmp_path, seqs):
    lengths = [len(s.new) for s in seqs]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    with RolloutWriter(tmp_path, rank=3) as w:
        w.add(step=0, cu_seqlens=cu, new_logp=packed(seqs, "new"), old_logp=packed(seqs, "old"),
              ref_logp=packed(seqs, "ref"), entropy=packed(seqs, "entropy"), loss_mask=packed(seqs, "mask"),
              versions=packed(seqs, "versions"), advantages=torch.tensor([s.advantage for s in seqs]),
              rewards=torch.tensor([s.reward for s in seqs])[:, None], group_id=[s.group_id for s in seqs],
              seq_id=torch.arange(len(seqs)))
    assert [p.name for p in w.files] == ["part-step000000-rank003.parquet"]
    check_round_trip(tmp_path, seqs)


def padded(seqs, attr, width, *, left: bool = False):
    """[B, width] rows holding each sequence right- (or left-) aligned; padding is garbage (NaN / -7)."""
    is_int = attr in ("mask", "versions")
    dtype = torch.int64 if is_int else torch.float32
    out = torch.full((len(seqs), width), -7 if is_int else float("nan"), dtype=dtype)
    for i, s in enumerate(seqs):
        values = torch.tensor(getattr(s, attr), dtype=dtype)
        if left:
            out[i, width - len(values):] = values
        else:
            out[i, :len(values)] = values
    return out


@pytest.mark.parametrize("how", ["lengths", "attention_mask_left", "attention_mask_right"])
def test_padded_form_round_trip(tmp_path, seqs, how, device):
    width = max(len(s.new) for s in seqs) + 3
    left = how == "attention_mask_left"
    cols = {name: padded(seqs, attr, width, left=left).to(device) for name, attr in TOKEN_ATTRS.items()}
    cols["loss_mask"] = padded(seqs, "mask", width, left=left).to(device)
    cols["versions"] = padded(seqs, "versions", width, left=left).to(device)
    lengths = torch.tensor([len(s.new) for s in seqs])
    if how == "lengths":
        extra = {"lengths": lengths}
    else:
        positions = torch.arange(width)[None, :]
        attention = positions >= (width - lengths)[:, None] if left else positions < lengths[:, None]
        extra = {"attention_mask": attention.to(device)}
    with RolloutWriter(tmp_path) as w:
        w.add(step=1, **cols, **extra, advantages=torch.tensor([s.advantage for s in seqs], device=device),
              rewards=torch.tensor([s.reward for s in seqs], device=device), group_id=[s.group_id for s in seqs],
              seq_id=torch.arange(len(seqs), device=device))
    check_round_trip(tmp_path, seqs)


def test_padded_lengths_from_loss_mask(tmp_path):
    # Without lengths/attention_mask a right-padded row ends at its last loss-mask position:
    # row 0 mask [0,1,1,0,0] → 3 tokens; row 1 [1,1,1,1,1] → 5; row 2 all 0 → 0 tokens.
    new = torch.arange(15, dtype=torch.float32).reshape(3, 5) * -0.1
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    with RolloutWriter(tmp_path) as w:
        w.add(step=0, new_logp=new, loss_mask=mask)
    got = read_back(tmp_path)
    assert got["lengths"] == [3, 5, 0]
    assert got["new_logp"][0] == f32([0.0, -0.1, -0.2])
    assert got["loss_mask"][0] == [False, True, True]


def test_per_token_advantages_and_bf16(tmp_path):
    new = [torch.tensor([-0.5, -1.25], dtype=torch.bfloat16), torch.tensor([-2.0], dtype=torch.bfloat16)]
    adv = [torch.tensor([0.5, 0.25]), torch.tensor([-1.0])]
    with RolloutWriter(tmp_path) as w:
        w.add(step=0, new_logp=new, advantages=adv)
    schema = pq.read_schema(w.files[0])
    assert str(schema.field("new_logp").type.value_type) == "float"  # bfloat16 stored as float32
    assert str(schema.field("advantages").type).startswith("list")
    got = read_back(tmp_path)
    assert got["new_logp"] == [[-0.5, -1.25], [-2.0]]  # exactly representable in bf16
    assert got["advantages"] == [[0.5, 0.25], [-1.0]]
    assert got["columns"] == ["advantages", "new_logp", "step"]


def test_next_token_alignment_is_unrolled_once(tmp_path):
    # AReaL-style: index t holds token t+1's value, last slot garbage (9); versions stay token-aligned.
    # sequence tokens: t0 t1 t2 t3; next-token new = [n1, n2, n3, 9] → token-aligned [fill 0, n1, n2, n3].
    new = torch.tensor([[-0.1, -0.2, -0.3, 9.0]])
    mask = torch.tensor([[0, 1, 1, 0]])  # rolled mask: tokens 2 and 3 enter the loss
    versions = torch.tensor([[-1, -1, 5, 5]])  # token-aligned already
    with RolloutWriter(tmp_path) as w:
        w.add(step=0, new_logp=new, loss_mask=mask, versions=versions, alignment="next_token",
              column_alignment={"versions": "token"}, attention_mask=torch.ones(1, 4))
    got = read_back(tmp_path)
    assert got["new_logp"] == [f32([0.0, -0.1, -0.2, -0.3])]
    assert got["loss_mask"] == [[False, False, True, True]]
    assert got["versions"] == [[-1, -1, 5, 5]]
    meta = read_metadata(w.files[0])
    assert meta["alignment"] == "token"
    assert meta["source_alignment"] == {"default": "next_token", "versions": "token"}


def test_next_token_without_mask_masks_first_token(tmp_path):
    # No loss_mask given: after un-rolling, the first token has no value, so a mask is written that drops it.
    with RolloutWriter(tmp_path) as w:
        w.add(step=0, new_logp=[torch.tensor([-1.0, -2.0, 7.0])], alignment="next_token")
    got = read_back(tmp_path)
    assert got["new_logp"] == [[0.0, -1.0, -2.0]]
    assert got["loss_mask"] == [[False, True, True]]


def test_next_token_mask_trim_keeps_last_token(tmp_path):
    # Padded next-token rows without lengths: the rolled mask's last 1 (index 2) predicts token 3, so 4 tokens.
    new = torch.tensor([[-0.1, -0.2, -0.3, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0, 0]])
    with RolloutWriter(tmp_path) as w:
        w.add(step=0, new_logp=new, loss_mask=mask, alignment="next_token")
    got = read_back(tmp_path)
    assert got["lengths"] == [4]
    assert got["loss_mask"] == [[False, False, True, True]]


def test_bad_arguments(tmp_path):
    w = RolloutWriter(tmp_path)
    one = [torch.tensor([-1.0])]
    with pytest.raises(ValueError, match="window='full'"):
        w.add(step=0, new_logp=one, alignment="next_token", window="response")
    with pytest.raises(ValueError, match="alignment"):
        w.add(step=0, new_logp=one, alignment="previous")
    with pytest.raises(ValueError, match="per-token input"):
        w.add(step=0, new_logp=one, column_alignment={"rewards": "token"})
    with pytest.raises(TypeError, match="unexpected keyword"):
        w.add(step=0, new_logp=one, old_logps=one)
    with pytest.raises(TypeError, match="step"):
        w.add(step=1.5, new_logp=one)
    with pytest.raises(ValueError, match="cu_seqlens"):
        w.add(step=0, new_logp=torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        w.add(step=0, new_logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="tokens"):
        w.add(step=0, new_logp=one, old_logp=[torch.tensor([-1.0, -2.0])])
    w.add(step=0, new_logp=one, old_logp=one)
    with pytest.raises(ValueError, match="differ"):  # a column set that changes would break the dump
        w.add(step=0, new_logp=one)
    with pytest.raises(ValueError, match="per sequence"):  # per-token advantages after none → columns differ
        w.add(step=0, new_logp=one, old_logp=one, rewards=[1.0, 2.0])
    w.close()
    with pytest.raises(ValueError, match="reserved|set by the writer"):
        RolloutWriter(tmp_path / "x", metadata={"alignment": "token"})
    with pytest.raises(ValueError, match="JSON"):
        RolloutWriter(tmp_path / "y", metadata={"temperature": object()})


def test_steps_row_groups_and_revisits(tmp_path):
    one = [torch.tensor([-1.0, -2.0])] * 3  # 6 tokens per call
    with RolloutWriter(tmp_path, row_group_tokens=10) as w:
        for _ in range(4):  # 24 tokens of step 0 → row groups of 12, 12
            w.add(step=0, new_logp=one)
        w.add(step=1, new_logp=one)
        w.add(step=0, new_logp=one)  # step 0 again after step 1: a new part, never an overwrite
    names = [p.name for p in w.files]
    assert names == ["part-step000000-rank000.parquet", "part-step000001-rank000.parquet",
                     "part-step000000-rank000-1.parquet"]
    assert pq.ParquetFile(w.files[0]).metadata.num_row_groups == 2
    assert pq.ParquetFile(w.files[0]).metadata.num_rows == 12
    assert sum(read_back(tmp_path)["lengths"]) == 36


def test_atomic_write_and_no_temp_left(tmp_path, monkeypatch):
    w = RolloutWriter(tmp_path, row_group_tokens=1)
    w.add(step=0, new_logp=[torch.tensor([-1.0])])  # one row group written to the hidden temp file
    names = [p.name for p in tmp_path.iterdir()]
    assert not any(n.endswith(".parquet") for n in names)  # a reader sees nothing yet
    assert len(names) == 1 and names[0].startswith(".") and names[0].endswith(".tmp")
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-step000000-rank000.parquet"]

    # A failure while writing leaves neither a part file nor a temp file behind.
    bad = tmp_path / "bad"
    w = RolloutWriter(bad)
    w.add(step=0, new_logp=[torch.tensor([-1.0])])

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        w.close()
    assert list(bad.iterdir()) == []


def test_metadata_and_fast_settings(tmp_path):
    meta = {"framework": "verl", "framework_version": "0.7", "temperature": 0.8, "top_p": 1.0, "top_k": -1,
            "logprobs_mode": "processed_logprobs", "hook": "_log_rollout_data"}
    with RolloutWriter(tmp_path, rank=2, metadata=meta) as w:
        w.add(step=7, new_logp=[torch.tensor([-1.0, -2.0])], loss_mask=[torch.tensor([0, 1])],
              versions=[torch.tensor([-1, 3])], rewards=1.0, window="response")
    got = read_metadata(w.files[0])
    for key, value in meta.items():
        assert got[key] == value
    assert got["schema_version"] == 1 and got["rank"] == 2 and got["step"] == 7
    assert got["window"] == "response" and got["alignment"] == "token" and got["writer"].startswith("grpo-cli")
    parquet = pq.ParquetFile(w.files[0])
    schema = parquet.schema_arrow
    assert all(not f.nullable for f in schema)
    assert not schema.field("new_logp").type.value_field.nullable
    assert str(schema.field("loss_mask").type.value_type) == "bool"
    assert str(schema.field("versions").type.value_type) == "int32"
    rg = parquet.metadata.row_group(0)
    chunks = {rg.column(i).path_in_schema: rg.column(i) for i in range(rg.num_columns)}
    new = chunks["new_logp.list.element"]
    assert new.compression == "ZSTD"
    assert "BYTE_STREAM_SPLIT" in new.encodings and not new.has_dictionary_page
    assert chunks["rewards"].compression == "ZSTD" and "BYTE_STREAM_SPLIT" in chunks["rewards"].encodings


def test_writer_output_gives_reference_figures(tmp_path, capsys):
    # End to end: a dump written by RolloutWriter gives analyze's figures by their definitions.
    seqs = random_sequences(40, seed=9)
    with RolloutWriter(tmp_path) as w:
        for start in range(0, 40, 16):
            part = seqs[start:start + 16]
            w.add(step=0, new_logp=[s.new for s in part], old_logp=[s.old for s in part],
                  entropy=[s.entropy for s in part], loss_mask=[s.mask for s in part],
                  advantages=[s.advantage for s in part])
    code = main(["analyze", str(tmp_path), "-f", "json"])
    out, _ = capsys.readouterr()
    assert code == 0
    metrics = json.loads(out)["metrics"]
    for key, value in policy_reference(seqs).items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_import_pulls_in_no_cli_code():
    code = (
        "import sys; import grpo_cli.io.writer; from grpo_cli.io import RolloutWriter; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'click')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dedupe_keeps_each_sequences_first_forward(tmp_path):
    # A second PPO epoch sees sequences 0 and 1 again: with dedupe only their first training forward is kept.
    with RolloutWriter(tmp_path, dedupe=True) as w:
        assert w.add(step=0, new_logp=[[-1.0], [-2.0]], seq_id=[0, 1]) == 2
        assert w.add(step=0, new_logp=[[-9.0, -9.0], [-3.0]], seq_id=[1, 2]) == 1
        assert w.add(step=0, new_logp=[[-9.0]], seq_id=[0]) == 0
        assert w.add(step=1, new_logp=[[-4.0]], seq_id=[0]) == 1  # a new step: seq 0 is new again
    got = read_back(tmp_path)
    assert got["new_logp"] == [[-1.0], [-2.0], [-3.0], [-4.0]]
    assert got["seq_id"] == [0, 1, 2, 0] and got["step"] == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="seq_id"):
        RolloutWriter(tmp_path / "x", dedupe=True).add(step=0, new_logp=[[-1.0]])


def test_other_schema_columns_by_keyword(tmp_path):
    with RolloutWriter(tmp_path) as w:
        w.add(step=0, new_logp=[[-1.0, -2.0], [-3.0]], teacher_logp=[[-1.5, -2.5], [-3.5]], eos=[1, 0])
    table = pq.read_table(w.files[0])
    assert table.column("teacher_logp").to_pylist() == [[-1.5, -2.5], [-3.5]]
    assert table.column("eos").to_pylist() == [1, 0]


# -- the shared low-level writer (io/parquet_file.py) -----------------------------------------------------------


def test_parquet_file_out_commits_atomically_and_aborts_cleanly(tmp_path):
    from grpo_cli.io.writer import ParquetFileOut

    table = pa.table({"x": pa.array([1.0, 2.0, 3.0], pa.float32())})
    target = tmp_path / "t.parquet"
    with ParquetFileOut(target, compression="zstd") as out:
        out.write(table, row_group_size=2)
        assert not target.exists() and out.tmp.exists() and out.tmp.name.startswith(".")
    assert pq.read_table(target).equals(table)
    assert pq.ParquetFile(target).metadata.num_row_groups == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]
    # Same bytes as pyarrow's one-shot writer with the same options.
    pq.write_table(table, tmp_path / "ref.parquet", row_group_size=2, compression="zstd")
    assert target.read_bytes() == (tmp_path / "ref.parquet").read_bytes()

    failed = tmp_path / "f.parquet"
    with pytest.raises(RuntimeError), ParquetFileOut(failed) as out:
        out.write(table)
        raise RuntimeError("boom")
    assert not failed.exists() and not out.tmp.exists()
    assert ParquetFileOut(tmp_path / "empty.parquet").commit() is None  # nothing written, nothing created
    assert not (tmp_path / "empty.parquet").exists()


def test_column_rewriter_replaces_one_column_across_files(tmp_path):
    from grpo_cli.io.writer import ColumnRewriter

    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"k": [0, 1, 2], "v": [0.5, 0.5, 0.5], "s": ["x", "y", "z"]}), a, row_group_size=2)
    pq.write_table(pa.table({"k": [3, 4], "v": [0.5, 0.5], "s": ["u", "w"]}), b)
    out = tmp_path / "out.parquet"
    rewriter = ColumnRewriter(out, [a, b], "v", {b"note": b"1"})
    rewriter.write(0, 0, 1, pa.array([10.0]))
    rewriter.write(0, 1, 3, pa.array([11.0, 12.0]))  # spans a row-group boundary
    rewriter.write(1, 0, 2, pa.array([13.0, 14.0]))
    rewriter.close(True)
    table = pq.read_table(out)
    assert table.column("k").to_pylist() == [0, 1, 2, 3, 4]
    assert table.column("v").to_pylist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert table.column("s").to_pylist() == ["x", "y", "z", "u", "w"]
    assert table.schema.metadata[b"note"] == b"1"
    # A column the files lack is appended; close(False) leaves nothing.
    other = tmp_path / "other.parquet"
    rewriter = ColumnRewriter(other, [b], "new", None)
    rewriter.write(0, 0, 2, pa.array([1, 2]))
    rewriter.close(False)
    assert not other.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "b.parquet",
                                                                                "out.parquet"]

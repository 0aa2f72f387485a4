"""Streaming reader: layouts, batching, files/dirs/globs, column maps and input errors."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from reference import random_sequences, write_sequences

from grpo_cli.errors import InputError, UsageError
from grpo_cli.io import RolloutDataset, expand_paths, parse_column_map


def _collect(ds, **kw):
    batches = list(ds.iter_batches(**kw))
    new = torch.cat([b.new_logp for b in batches])
    lengths = torch.cat([b.cu_seqlens[1:] - b.cu_seqlens[:-1] for b in batches])
    return batches, new, lengths


@pytest.mark.parametrize("token_layout", [False, True])
@pytest.mark.parametrize("batch_tokens", [1, 7, 50, 1 << 20])
def test_batches_hold_whole_sequences_in_order(tmp_path, token_layout, batch_tokens):
    seqs = random_sequences(37, seed=1)
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=10, token_layout=token_layout)
    ds = RolloutDataset([path])
    batches, new, lengths = _collect(ds, batch_tokens=batch_tokens)
    assert lengths.tolist() == [len(s.new) for s in seqs]
    assert torch.equal(new, torch.tensor([v for s in seqs for v in s.new]))
    mask = torch.cat([b.loss_mask for b in batches])
    assert mask.tolist() == [bool(m) for s in seqs for m in s.mask]
    adv = torch.cat([b.advantages for b in batches])
    assert adv.tolist() == pytest.approx([s.advantage for s in seqs for _ in s.new])
    rows = torch.cat([b.rows for b in batches])
    if not token_layout:
        assert rows.tolist() == list(range(37))
    if batch_tokens == 1:
        assert len(batches) == 37  # never splits a sequence, never stalls


def test_list_slices_are_zero_copy(tmp_path):
    seqs = random_sequences(20, seed=2)
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=20)
    batch = next(RolloutDataset([path]).iter_batches(batch_tokens=1 << 20))
    assert batch.new_logp.dtype == torch.float32
    assert batch.versions.dtype == torch.int64 and batch.current_version.dtype == torch.int64


def test_paths_dirs_and_globs(tmp_path):
    seqs = random_sequences(5, seed=3)
    (tmp_path / "sub").mkdir()
    for name in ("b.parquet", "a.parquet", "sub/c.parquet"):
        write_sequences(str(tmp_path / name), seqs)
    assert [p.name for p in expand_paths([tmp_path])] == ["a.parquet", "b.parquet", "c.parquet"]
    assert [p.name for p in expand_paths([str(tmp_path / "*.parquet")])] == ["a.parquet", "b.parquet"]
    ds = RolloutDataset([tmp_path / "b.parquet", tmp_path / "a.parquet"])
    assert [p.name for p in ds.files] == ["a.parquet", "b.parquet"]
    assert ds.n_tokens == 2 * sum(len(s.new) for s in seqs)


def test_column_map(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"lp": pa.array([[-1.0, -2.0]], pa.list_(pa.float32()))}), path)
    ds = RolloutDataset([path], parse_column_map(["new_logp=lp"]))
    assert next(ds.iter_batches()).new_logp.tolist() == [-1.0, -2.0]
    with pytest.raises(UsageError, match="unknown column 'nope'"):
        parse_column_map(["nope=lp"])
    with pytest.raises(InputError, match="no column 'zz'"):
        RolloutDataset([path], {"new_logp": "zz"})


def test_input_errors_name_file_and_column(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        RolloutDataset([tmp_path / "missing.parquet"])
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(InputError, match="junk.parquet.*not a readable Parquet"):
        RolloutDataset([junk])
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"old_logp": pa.array([[-1.0]], pa.list_(pa.float32()))}), nocol)
    with pytest.raises(InputError, match="column 'new_logp': required column is missing"):
        RolloutDataset([nocol])
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"new_logp": pa.array([["a"]], pa.list_(pa.string()))}), wrong)
    with pytest.raises(InputError, match="column 'new_logp': wrong type"):
        RolloutDataset([wrong])
    mismatched = tmp_path / "len.parquet"
    pq.write_table(pa.table({"new_logp": pa.array([[-1.0], [-1.0, -2.0]], pa.list_(pa.float32())),
                             "old_logp": pa.array([[-1.0], [-1.0]], pa.list_(pa.float32()))}), mismatched)
    with pytest.raises(InputError, match="column 'old_logp', row 1: has 1 tokens but new_logp has 2"):
        list(RolloutDataset([mismatched]).iter_batches())


def test_token_layout_requires_contiguous_sequences(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"new_logp": pa.array([-1.0, -1.0, -1.0], pa.float32()),
                             "seq_id": pa.array([1, 2, 1], pa.int64())}), path)
    with pytest.raises(InputError, match="seq_id 1 appears again"):
        list(RolloutDataset([path]).iter_batches())

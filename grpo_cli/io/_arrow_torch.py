r"""Arrow record batches → packed torch :class:`~grpo_cli.core.batch.TokenBatch`\ es for
:class:`~grpo_cli.io.reader.RolloutDataset`: zero-copy values and offsets (DLPack), nulls rejected with the file,
column, row (and token), per-sequence values broadcast, token-per-row runs cut into sequences, and ``--group-by``
columns coded as indices."""

from __future__ import annotations

import pyarrow as pa
import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.errors import InputError
from grpo_cli.io._file_schema import _FileInfo, _is_list
from grpo_cli.io.schema import COLUMNS, ColumnKind

__all__: list[str] = []  # private to grpo_cli.io.reader


def _to_tensor(values: pa.Array) -> Tensor:
    """Zero-copy for numeric arrays without nulls (DLPack); bit-packed booleans need one unpacking copy."""
    if pa.types.is_boolean(values.type):
        return torch.from_numpy(values.to_numpy(zero_copy_only=False))
    if pa.types.is_float16(values.type):
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).astype("float32"))
    return torch.from_dlpack(values)


def _first_null_row(array: pa.Array) -> int:
    import pyarrow.compute as pc

    return int(pc.index(array.is_null(), True).as_py())


def _list_parts(info: _FileInfo, canonical: str, array: pa.Array, row0: int) -> tuple[Tensor, Tensor]:
    """A list column → (flat values, int64 offsets starting at 0)."""
    name = info.actual[canonical]
    if array.null_count:
        raise InputError("null list (row has no value)", file=str(info.path), column=name,
                         row=row0 + _first_null_row(array))
    offsets = array.offsets
    start, end = offsets[0].as_py(), offsets[-1].as_py()
    values = array.values.slice(start, end - start)
    if values.null_count:
        parents = array.value_parent_indices()
        import pyarrow.compute as pc

        first = int(pc.index(values.is_null(), True).as_py())
        row = row0 + int(parents[first].as_py())
        token = first - (int(offsets[int(parents[first].as_py())].as_py()) - start)
        raise InputError("null element in list", file=str(info.path), column=name, row=row, token=token)
    offsets_t = torch.from_dlpack(offsets).to(torch.int64)
    if start:
        offsets_t = offsets_t - start
    return _to_tensor(values), offsets_t


def _scalar_column(info: _FileInfo, canonical: str, array: pa.Array, row0: int) -> Tensor:
    if array.null_count:
        raise InputError("null value", file=str(info.path), column=info.actual[canonical],
                         row=row0 + _first_null_row(array))
    return _to_tensor(array)


def _as_float(values: Tensor) -> Tensor:
    return values if values.is_floating_point() else values.to(torch.float64)


def _sequence_batch(
    info: _FileInfo, file_index: int, record_batch: pa.RecordBatch, row0: int, wanted: set[str]
) -> TokenBatch:
    path = str(info.path)
    new_values, cu_seqlens = _list_parts(info, "new_logp", record_batch.column(info.actual["new_logp"]), row0)
    n_seq = record_batch.num_rows
    data: dict[str, Tensor] = {"new_logp": _as_float(new_values)}
    for canonical in wanted - {"new_logp"}:
        array = record_batch.column(info.actual[canonical])
        kind = COLUMNS[canonical].kind
        if _is_list(array.type):
            values, offsets = _list_parts(info, canonical, array, row0)
            if not torch.equal(offsets, cu_seqlens):
                bad = int(torch.nonzero(offsets != cu_seqlens)[0])
                row = row0 + max(bad - 1, 0)
                lengths = (offsets[1:] - offsets[:-1], cu_seqlens[1:] - cu_seqlens[:-1])
                i = row - row0
                raise InputError(
                    f"has {int(lengths[0][i])} tokens but new_logp has {int(lengths[1][i])} "
                    "(per-token columns of a row must have equal lengths)",
                    file=path, column=info.actual[canonical], row=row,
                )
            data[canonical] = values
        else:
            data[canonical] = _scalar_column(info, canonical, array, row0)
            if kind is ColumnKind.SEQUENCE_OR_TOKEN_FLOAT:  # per-sequence advantage → every token of the row
                seq_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
                data[canonical] = torch.repeat_interleave(data[canonical], seq_lengths, output_size=new_values.numel())
    return _make_batch(data, cu_seqlens, file_index, torch.arange(row0, row0 + n_seq, dtype=torch.int64))


def _make_batch(data: dict[str, Tensor], cu_seqlens: Tensor, file_index: int, rows: Tensor) -> TokenBatch:
    n_tokens = data["new_logp"].numel()
    mask = data.pop("loss_mask", None)
    # An integer mask keeps its values (iter_batches converts it, or the validator after checking it is 0/1).
    mask = torch.ones(n_tokens, dtype=torch.bool) if mask is None else mask
    kwargs: dict[str, Tensor] = {}
    for canonical, values in data.items():
        kind = COLUMNS[canonical].kind
        if kind in (ColumnKind.TOKEN_FLOAT, ColumnKind.SEQUENCE_OR_TOKEN_FLOAT, ColumnKind.SEQUENCE_FLOAT):
            kwargs[canonical] = _as_float(values)
        elif kind in (ColumnKind.TOKEN_INT, ColumnKind.SEQUENCE_INT):
            kwargs[canonical] = values.to(torch.int64)
    return TokenBatch(cu_seqlens=cu_seqlens, loss_mask=mask, file_index=file_index, rows=rows, **kwargs)


def _flat_column(info: _FileInfo, canonical: str, array: pa.Array, row0: int) -> Tensor:
    return _scalar_column(info, canonical, array, row0)


def _run_boundaries(ids: Tensor) -> Tensor:
    """Offsets of the runs of equal ids: ``[0, start_1, ..., start_last, len(ids)]``."""
    n = ids.numel()
    if n == 0:
        return torch.zeros(1, dtype=torch.int64)
    change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), change, torch.tensor([n])])


def _token_batch(
    info: _FileInfo,
    file_index: int,
    flat: dict[str, Tensor],
    cu_seqlens: Tensor,
    row0: int,
    wanted: set[str],
    seen_ids: set[int],
) -> TokenBatch:
    """Token-per-row runs of equal ``seq_id`` → a packed batch; per-sequence columns take each run's first row."""
    first = cu_seqlens[:-1]
    ids = flat["seq_id"][first].tolist()
    for i, seq in enumerate(ids):
        if seq in seen_ids:
            raise InputError(
                f"seq_id {seq} appears again after other sequences (rows of a sequence must be contiguous)",
                file=str(info.path), column=info.actual["seq_id"], row=row0 + int(first[i]),
            )
        seen_ids.add(seq)
    data: dict[str, Tensor] = {}
    for canonical in wanted:
        values = flat[canonical]
        per_sequence = COLUMNS[canonical].kind in (ColumnKind.SEQUENCE_FLOAT, ColumnKind.SEQUENCE_INT)
        data[canonical] = values[first] if per_sequence else values
    batch = _make_batch(data, cu_seqlens, file_index, first + row0)
    if _KEY in flat:
        batch.group_key = flat[_KEY][first]  # a sequence's key is its first row's
    return batch


_KEY = "\0group_key"
"""The flat-column slot of the ``group_key`` codes while token-per-row runs are cut into sequences."""

_GroupKey = tuple[str, pa.Array]
"""(file column, its sorted distinct values) of a ``--group-by`` column read as codes."""


def _decoded(array: pa.Array) -> pa.Array:
    return array.dictionary_decode() if pa.types.is_dictionary(array.type) else array


def _group_codes(info: _FileInfo, array: pa.Array, key: _GroupKey, row0: int) -> Tensor:
    """Per-row values → int64 indices into the dump's sorted distinct values."""
    import pyarrow.compute as pc

    if array.null_count:
        raise InputError("null value (a group key must be set on every row)", file=str(info.path), column=key[0],
                         row=row0 + _first_null_row(array))
    codes = pc.index_in(_decoded(array), value_set=key[1])
    return torch.from_numpy(codes.to_numpy(zero_copy_only=False).astype("int64"))

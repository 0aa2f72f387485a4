"""The one place grpo-cli writes Parquet: a file written atomically (:class:`ParquetFileOut`) and a dump copied back
with one column replaced (:class:`ColumnRewriter`).

:class:`~grpo_cli.io.writer.RolloutWriter` writes its part files, ``grpo-cli advantages --write`` its recomputed dump
and ``grpo-cli sample`` the sample through :class:`ParquetFileOut`: row groups go to a hidden temporary file beside
the target, which is renamed into place only when every row group is written (a reader never sees half a file,
and a failure leaves nothing behind).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["ColumnRewriter", "ParquetFileOut"]


class ParquetFileOut:
    """One Parquet file, written to ``tmp`` (default ``.<name>.<pid>.tmp`` beside ``path``) and renamed on commit.

    Args:
        path: the final file.
        schema: the file's schema (with its metadata); default the first written table's.
        tmp: where to write until :meth:`commit`.
        fsync: flush the file to disk before renaming it into place.
        options: keywords of ``pq.ParquetWriter`` (compression, encodings, ...).

    Used as a context manager it commits on success and aborts on an exception.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        schema: pa.Schema | None = None,
        tmp: str | os.PathLike[str] | None = None,
        fsync: bool = False,
        **options: Any,
    ) -> None:
        self.path = Path(path)
        self.tmp = Path(tmp) if tmp is not None else self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.schema = schema
        self.fsync = fsync
        self.options = options
        self._writer: pq.ParquetWriter | None = None

    def __enter__(self) -> ParquetFileOut:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    @property
    def started(self) -> bool:
        """Whether a row group has been written (the temporary file exists)."""
        return self._writer is not None

    def write(self, table: pa.Table, row_group_size: int | None = None) -> None:
        """Append ``table`` (cast to :attr:`schema`) as row groups of at most ``row_group_size`` rows."""
        try:
            if self._writer is None:
                if self.schema is None:
                    self.schema = table.schema
                self._writer = pq.ParquetWriter(self.tmp, self.schema, **self.options)
            self._writer.write_table(table, row_group_size=row_group_size)
        except BaseException:
            self.abort()
            raise

    def commit(self) -> Path | None:
        """Close the file and rename it into place; returns its path (None when nothing was written)."""
        if self._writer is None:
            return None
        try:
            self._writer.close()
            self._writer = None
            if self.fsync:
                fd = os.open(self.tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Drop the unfinished file (nothing half-written is ever renamed into place)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):  # the original error matters more
                self._writer.close()
            self._writer = None
        self.tmp.unlink(missing_ok=True)


class _RowSource:
    """Rows ``[start, stop)`` of one Parquet file, row groups read lazily and dropped once passed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = pq.ParquetFile(path, memory_map=True)
        self.tables: list[tuple[int, pa.Table]] = []  # (first row, row group) still needed
        self.next_group = 0
        self.next_row = 0

    def rows(self, start: int, stop: int) -> pa.Table:
        self.tables = [(first, t) for first, t in self.tables if first + t.num_rows > start]
        while self.next_row < stop:
            table = self.file.read_row_group(self.next_group)
            self.tables.append((self.next_row, table))
            self.next_row += table.num_rows
            self.next_group += 1
        first = self.tables[0][0]
        table = pa.concat_tables([t for _, t in self.tables]) if len(self.tables) > 1 else self.tables[0][1]
        return table.slice(start - first, stop - start)


class ColumnRewriter:
    """Copies the rows of ``files`` (in the order given to :meth:`write`) into one Parquet file, every column as
    stored except ``column``, which is replaced (or appended) with the values given.

    The first written rows fix the schema (with ``metadata`` added to it); later rows are cast to it, and a file
    whose schema cannot be cast raises ``ValueError`` naming it. Rows are read lazily, row group by row group.
    """

    def __init__(self, out: Path, files: list[Path], column: str, metadata: dict[bytes, bytes] | None = None) -> None:
        self.files, self.column = files, column
        self.metadata = dict(metadata or {})
        self.out = ParquetFileOut(out)
        self._sources: dict[int, _RowSource] = {}

    def write(self, file_index: int, start: int, stop: int, values: pa.Array) -> None:
        """Rows ``[start, stop)`` of file ``file_index`` with ``column`` set to ``values`` (one per row)."""
        source = self._sources.get(file_index)
        if source is None:
            source = self._sources[file_index] = _RowSource(self.files[file_index])
        table = source.rows(start, stop)
        index = table.schema.get_field_index(self.column)
        field = pa.field(self.column, values.type)
        table = table.set_column(index, field, values) if index >= 0 else table.append_column(field, values)
        if self.out.schema is None:
            metadata = dict(table.schema.metadata or {})
            metadata.update(self.metadata)
            self.out.schema = table.schema.with_metadata(metadata)
        try:
            table = table.cast(self.out.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ValueError(f"{source.path}: schema differs from the first file's ({exc})") from None
        self.out.write(table)

    def close(self, ok: bool) -> None:
        """Rename the file into place (``ok``) or drop it."""
        if ok:
            self.out.commit()
        else:
            self.out.abort()

"""The one place grpo-cli writes Parquet: a file written atomically (:class:`ParquetFileOut`) and a dump copied back
with one column replaced (:class:`ColumnRewriter`).

:class:`~grpo_cli.io.writer.RolloutWriter` writes its part files, ``grpo-cli advantages --write`` its recomputed dump
and ``grpo-cli sample`` the sample through :class:`ParquetFileOut`: row groups go to a hidden temporary file beside
the target, which is renamed into place only when every row group is written (a reader never sees half a file,
and a failure leaves nothing behind).

In object storage (a :class:`~grpo_cli.io.storage.RemotePath` target) there is no rename and no half-written object
may become visible: the file is streamed to a hidden temporary key beside the target (``.NAME.PID.tmp``, which no
prefix or ``*.parquet`` scan picks up) and committed by the filesystem's move (S3: a server-side ``CopyObject``,
which makes the final key appear complete or not at all, then ``DeleteObject``; HDFS: a rename). A process killed
while streaming leaves at most an uncompleted multipart upload or a hidden temporary key, never a ``.parquet`` one.
"""

from __future__ import annotations

import contextlib
import os
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_cli.io.storage import DumpPath, Location, RemotePath, failed, open_parquet, remove, retrying, to_path

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
        path: Location,
        *,
        schema: pa.Schema | None = None,
        tmp: Location | None = None,
        fsync: bool = False,
        **options: Any,
    ) -> None:
        self.path: DumpPath = to_path(path)
        self.tmp: DumpPath = (to_path(tmp) if tmp is not None
                              else self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp"))
        self.schema = schema
        self.fsync = fsync
        self.options = options
        self._writer: pq.ParquetWriter | None = None
        self._sink: pa.NativeFile | None = None  # the upload stream of a remote temporary object

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
                self._writer = pq.ParquetWriter(self._open_sink(), self.schema, **self.options)
            self._writer.write_table(table, row_group_size=row_group_size)
        except BaseException as exc:
            self.abort()
            if isinstance(self.path, RemotePath) and isinstance(exc, (OSError, pa.ArrowException)):
                raise failed(exc, self.path, "cannot write") from None
            raise

    def _open_sink(self) -> str | pa.NativeFile:
        tmp = self.tmp
        if not isinstance(tmp, RemotePath):
            return str(tmp)
        self._sink = retrying(lambda: tmp.fs.open_output_stream(tmp.path), tmp)
        return self._sink

    def commit(self) -> DumpPath | None:
        """Close the file and rename it into place; returns its path (None when nothing was written)."""
        if self._writer is None:
            return None
        if isinstance(self.tmp, RemotePath):
            return self._commit_remote(self.tmp)
        try:
            self._writer.close()
            self._writer = None
            if self.fsync:
                fd = os.open(self.tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(self.tmp, self.path)  # type: ignore[arg-type]  # local: both are Paths (commit's branch)
        except BaseException:
            self.abort()
            raise
        return self.path

    def _commit_remote(self, tmp: RemotePath) -> DumpPath:
        assert self._writer is not None and self._sink is not None and isinstance(self.path, RemotePath)
        final = self.path
        try:
            self._writer.close()
            self._writer = None
            self._sink.close()  # completes the temporary object's upload
            self._sink = None
            retrying(lambda: _move(tmp, final), final)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, (OSError, pa.ArrowException)):
                raise failed(exc, final, "cannot write") from None
            raise
        return final

    def abort(self) -> None:
        """Drop the unfinished file (nothing half-written is ever renamed into place)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):  # the original error matters more
                self._writer.close()
            self._writer = None
        if self._sink is not None:
            # pyarrow completes an upload when its stream closes, also a half-written one: it lands under the hidden
            # temporary key, removed below.
            with contextlib.suppress(Exception):
                self._sink.close()
            self._sink = None
        remove(self.tmp)


def _move(tmp: RemotePath, final: RemotePath) -> None:
    try:
        tmp.fs.move(tmp.path, final.path)
    except (NotImplementedError, pa.ArrowNotImplementedError):
        # A store whose filesystem has no move (Azure without a hierarchical namespace): a server-side copy, which
        # makes the final object appear whole, then the temporary one deleted.
        tmp.fs.copy_file(tmp.path, final.path)
        tmp.fs.delete_file(tmp.path)


class _RowSource:
    """Rows ``[start, stop)`` of one Parquet file, row groups read lazily and dropped once passed."""

    def __init__(self, path: DumpPath) -> None:
        self.path = path
        self.file = open_parquet(path, memory_map=True)
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

    def __init__(self, out: DumpPath, files: list[DumpPath], column: str,
                 metadata: dict[bytes, bytes] | None = None) -> None:
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

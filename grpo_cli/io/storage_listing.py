"""Object storage, the listing half: a URI → the objects it names (an object, every ``*.parquet`` under a prefix,
what a glob matches), and the checks before writing (the bucket exists, an output prefix is empty). One line naming
the URI and what to do for every failure (:mod:`grpo_cli.io.storage`). Torch-free.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.fs as pafs

from grpo_cli.errors import InputError
from grpo_cli.io.storage import RemotePath, _endpoint, failed, remote_path, retrying

__all__ = ["expand_remote", "holds_parquet", "objects_with_suffix", "require_bucket"]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``glob.glob(recursive=True)``'s rules as a regex over a whole key: ``*``/``?``/``[…]`` stay inside one
    component, ``**`` spans any number of them."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                out.append(re.escape("["))
                i += 1
                continue
            body = pattern[i + 1:end]
            out.append("[^" + re.escape(body[1:]) + "]" if body.startswith("!") else "[" + re.escape(body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _list(base: RemotePath, shown: RemotePath | None = None) -> list[pafs.FileInfo]:
    """Everything under ``base`` (recursive); errors name ``shown`` (what the user wrote), default ``base``."""
    try:
        return retrying(lambda: base.fs.get_file_info(pafs.FileSelector(base.path, recursive=True)), base)
    except FileNotFoundError:
        return []
    except (OSError, pa.ArrowException) as exc:
        raise failed(exc, shown or base) from None


def _info(path: RemotePath) -> pafs.FileInfo:
    try:
        return retrying(lambda: path.fs.get_file_info(path.path), path)
    except (OSError, pa.ArrowException) as exc:
        raise failed(exc, path) from None


def _missing(path: RemotePath) -> InputError:
    """Why ``path`` does not exist: its bucket (S3, GCS) may be missing too."""
    if path.scheme in ("s3", "gs", "gcs"):
        bucket = path.path.split("/", 1)[0]
        root = RemotePath(f"{path.scheme}://{bucket}", bucket, path.fs)
        if _info(root).type == pafs.FileType.NotFound:
            return InputError(f"no such bucket '{bucket}': check the name (and the endpoint: {_endpoint(path)})",
                              file=path.uri)
    return InputError("no such object or prefix: check the path (a prefix must hold .parquet objects)",
                      file=path.uri)


def _parquet_under(prefix: RemotePath, suffixes: tuple[str, ...] = (".parquet",)) -> list[RemotePath]:
    out = []
    for info in _list(prefix):
        if info.type == pafs.FileType.File and info.path.endswith(suffixes):
            relative = info.path[len(prefix.path):].lstrip("/")
            out.append(prefix / relative)
    return out


def objects_with_suffix(text: str, suffixes: tuple[str, ...]) -> list[RemotePath]:
    """A URI → the object itself, or every object under the prefix ending in one of ``suffixes`` (the converters'
    sources: ``.jsonl``, ``.pt``, …), as a local directory is searched.

    Raises:
        InputError: a missing bucket, object or prefix, or a prefix with no such object.
    """
    path = remote_path(text)
    info = _info(path)
    if info.type == pafs.FileType.File:
        return [path]
    if info.type == pafs.FileType.NotFound:
        raise _missing(path)
    found = _parquet_under(path, suffixes)
    if not found:
        raise InputError(f"prefix holds no {'/'.join(suffixes)} objects", file=text)
    return found


def holds_parquet(prefix: RemotePath) -> bool:
    """Whether any ``*.parquet`` object exists under ``prefix`` (an output must not mix into an existing dump)."""
    return bool(_parquet_under(prefix))


def expand_remote(text: str) -> list[RemotePath]:
    """A URI → its objects: an object itself, every ``*.parquet`` under a prefix (recursive), or what a glob
    matches (``*``, ``?``, ``[…]`` within a component, ``**`` across them), as local paths are expanded.

    Raises:
        InputError: a missing bucket, object or prefix; a prefix or pattern without ``.parquet`` objects; refused
            credentials or an unreachable endpoint (one line naming the URI and what to do).
    """
    path = remote_path(text)
    if any(ch in path.path for ch in "*?["):
        # The listing starts at the last "/" before the first wildcard, in the URI and in the filesystem path alike
        # (the key after the bucket is the same in both).
        def before_wildcard(text: str) -> str:
            return text[: min(text.find(ch) for ch in "*?[" if ch in text)].rsplit("/", 1)[0]

        if "/" not in path.path[: min(path.path.find(ch) for ch in "*?[" if ch in path.path)]:
            raise InputError("a pattern cannot match the bucket (or container) name: give it literally", file=text)
        base_path = before_wildcard(path.path)
        base = RemotePath(before_wildcard(path.uri), base_path, path.fs)
        pattern = _glob_regex(path.path)
        found: list[RemotePath] = []
        for info in _list(base, path):
            if pattern.match(info.path):
                relative = info.path[len(base_path):].lstrip("/")
                match = base / relative
                if info.type == pafs.FileType.File:
                    found.append(match)
                elif info.type == pafs.FileType.Directory:
                    found.extend(_parquet_under(match))
        if not found:
            if _info(base).type == pafs.FileType.NotFound:
                missing = _missing(base)
                raise InputError(missing.reason, file=text)
            raise InputError("no object matches this pattern", file=text)
        return found
    info = _info(path)
    if info.type == pafs.FileType.File:
        return [path]
    if info.type == pafs.FileType.NotFound:
        raise _missing(path)
    found = _parquet_under(path)
    if not found:
        raise InputError("prefix holds no .parquet objects", file=text)
    return found


def require_bucket(directory: RemotePath) -> None:
    """Fail now, not at the first commit, when ``directory``'s bucket (S3, GCS) does not exist or cannot be reached.

    Raises:
        InputError: a missing bucket, refused credentials, an unreachable endpoint.
    """
    if directory.scheme in ("hdfs", "viewfs"):
        try:
            retrying(lambda: directory.fs.create_dir(directory.path, recursive=True), directory)
        except (OSError, pa.ArrowException) as exc:
            raise failed(exc, directory, "cannot create") from None
        return
    if directory.scheme in ("s3", "gs", "gcs"):
        bucket = directory.path.split("/", 1)[0]
        if _info(RemotePath(f"{directory.scheme}://{bucket}", bucket, directory.fs)).type == pafs.FileType.NotFound:
            raise InputError(f"no such bucket '{bucket}': create it first, or check the name (and the endpoint: "
                             f"{_endpoint(directory)})", file=directory.uri)

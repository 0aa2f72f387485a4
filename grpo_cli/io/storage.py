"""Object storage: ``s3://``, ``gs://``, ``hdfs://`` and ``abfs://`` paths wherever grpo-cli takes a path.

A URI becomes a :class:`RemotePath`: the path inside a pyarrow filesystem (``pyarrow.fs``; fsspec's, wrapped in
``pyarrow.fs.PyFileSystem``, where the pyarrow build has none) plus that filesystem, so the reader streams a remote
file row group by row group exactly as a local one. Local paths stay :class:`pathlib.Path` and take none of these
code paths. Torch-free.

Credentials and endpoints come from each platform's standard chain (docs/storage.md). For S3 that is the AWS SDK's
chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance roles) plus
``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` for S3-compatible stores, which the AWS CLI and boto3 honour
(https://docs.aws.amazon.com/sdkref/latest/guide/feature-ss-endpoints.html) but pyarrow's ``S3FileSystem`` does not
read by itself, so they are passed as its ``endpoint_override``.

Listing a prefix and matching globs is :mod:`grpo_cli.io.storage_listing`. On S3 every request (listing, a footer,
a ranged read, an uploaded part, a commit) is retried on transient errors by the AWS SDK's standard strategy with
exponential backoff, :func:`retry_attempts` attempts in all; on the other stores grpo-cli's own requests are
retried by :func:`retrying` with bounded exponential backoff. Errors become one :class:`~grpo_cli.errors.InputError`
line naming the URI and what to do.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import io
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from grpo_cli.errors import InputError

__all__ = [
    "REMOTE_READ_BUFFER_BYTES",
    "SCHEMES",
    "DumpPath",
    "Location",
    "RemotePath",
    "describe",
    "failed",
    "is_uri",
    "open_parquet",
    "open_text",
    "read_bytes",
    "read_schema",
    "read_table",
    "remote_path",
    "remove",
    "retry_attempts",
    "retrying",
    "to_path",
]

SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
"""URI schemes read and written through a filesystem (``file://`` is a local path)."""

REMOTE_READ_BUFFER_BYTES = 4 << 20
"""Bytes fetched per request while decoding a remote file: each read is a round trip (tens of ms to S3), so bigger
than the local 1 MiB buffer, yet still a bounded buffer per column being decoded, never the whole column chunk."""

DEFAULT_RETRY_ATTEMPTS = 4
"""Attempts of one request on a transient error (``GRPO_CLI_RETRIES`` overrides it); backoff 0.25 s, doubling, at
most :data:`MAX_BACKOFF_S` between attempts, so an unreachable endpoint fails within seconds."""
MAX_BACKOFF_S = 2.0
GCS_RETRY_TIME_LIMIT_S = 10.0
"""How long Google's client retries one GCS request (its default is 15 minutes)."""

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_T = TypeVar("_T")


def is_uri(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` is a ``scheme://`` URI other than ``file://`` (a local path)."""
    match = _URI.match(str(text))
    return match is not None and match.group(1).lower() != "file"


@dataclass(frozen=True)
class RemotePath:
    """One object (or prefix) in object storage: its URI and where it is in its pyarrow filesystem.

    ``str()`` is the URI, as users wrote it; it pickles with its filesystem (pyarrow's own pickling keeps the
    endpoint and options, never credentials taken from the chain), so a Ray task or a ``--workers`` process opens it
    with its own credentials chain.
    """

    uri: str
    path: str
    """The object's path in :attr:`fs` (``bucket/key`` for S3 and GCS, ``/dir/file`` for HDFS)."""
    fs: pafs.FileSystem = field(compare=False, repr=False)

    def __str__(self) -> str:
        return self.uri

    @property
    def scheme(self) -> str:
        """``s3``, ``gs``, ``hdfs``, … (lower case)."""
        return self.uri.split("://", 1)[0].lower()

    @property
    def name(self) -> str:
        """The last component (``part-step000000-rank000.parquet``)."""
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        """The prefix holding this object."""
        return RemotePath(self.uri.rstrip("/").rsplit("/", 1)[0], self.path.rstrip("/").rsplit("/", 1)[0], self.fs)

    def __truediv__(self, name: str | os.PathLike[str]) -> RemotePath:
        """The object ``name`` (a relative key, ``/``-separated) under this prefix."""
        name = Path(name).as_posix() if not isinstance(name, str) else name
        return RemotePath(f"{self.uri.rstrip('/')}/{name}", f"{self.path.rstrip('/')}/{name}", self.fs)

    def with_name(self, name: str) -> RemotePath:
        """The object ``name`` beside this one."""
        return self.parent / name

    def resolve(self) -> RemotePath:
        """Itself (a URI is already absolute); lets code that compares resolved paths take either kind."""
        return self


DumpPath = Path | RemotePath
"""A dump file: a local path or an object in object storage."""

Location = str | os.PathLike[str] | RemotePath
"""What the functions taking a path accept: a local path, a URI string, or a :class:`RemotePath`."""


def retry_attempts() -> int:
    """Attempts per request: ``GRPO_CLI_RETRIES`` when set to an integer >= 1, else :data:`DEFAULT_RETRY_ATTEMPTS`."""
    try:
        return max(1, int(os.environ.get("GRPO_CLI_RETRIES", DEFAULT_RETRY_ATTEMPTS)))
    except ValueError:
        return DEFAULT_RETRY_ATTEMPTS


# -- filesystems ------------------------------------------------------------------------------------------------------
def _s3_options() -> dict[str, Any]:
    options: dict[str, Any] = {
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=retry_attempts()),
        # A dead endpoint should fail in seconds, not after the SDK's minutes-long defaults.
        "connect_timeout": 5.0,
        "request_timeout": 60.0,
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_override"] = endpoint
        # S3-compatible stores rarely care about the region, but the request signature names one; without AWS_REGION
        # the SDK would probe the instance metadata service for it.
        options["region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return options


@functools.lru_cache(maxsize=32)
def _filesystem(scheme: str, authority: str, env: tuple[tuple[str, str], ...]) -> pafs.FileSystem:
    # ``env`` is the relevant environment, part of the cache key so a changed endpoint or key is picked up.
    del env
    if scheme == "s3":
        return pafs.S3FileSystem(**_s3_options())
    uri = f"{scheme}://{authority}/"
    try:
        if scheme in ("gs", "gcs"):
            # Google's client retries for 15 minutes by default (and so waits that long for a missing credential
            # server); a bounded limit, as for S3, turns a dead endpoint into an error in seconds.
            return pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=GCS_RETRY_TIME_LIMIT_S))
        fs, _ = pafs.FileSystem.from_uri(uri)
        return fs
    except (pa.ArrowException, OSError, ValueError) as native:
        try:  # e.g. abfs:// in a pyarrow built without Azure: fsspec's (adlfs, gcsfs) through pyarrow
            import fsspec

            handler = pafs.FSSpecHandler(fsspec.filesystem(scheme))
            return pafs.PyFileSystem(handler)
        except Exception as exc:  # any driver's failure to start is reported as one line
            hint = (" (HDFS needs libhdfs and a JVM: JAVA_HOME, HADOOP_HOME, CLASSPATH=$(hadoop classpath --glob))"
                    if scheme in ("hdfs", "viewfs") else "")
            raise InputError(
                f"cannot open {scheme}:// ({_first_line(native)}; fsspec: {_first_line(exc)}){hint}; see "
                "docs/storage.md",
                file=uri,
            ) from None


_ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "GRPO_CLI_RETRIES")


def remote_path(uri: str) -> RemotePath:
    """The :class:`RemotePath` of ``uri`` (``s3://bucket/key``, ``gs://…``, ``hdfs://host:port/path``, ``abfs://…``).

    Raises:
        InputError: an unsupported scheme, or a URI without a bucket.
    """
    match = _URI.match(uri)
    if match is None:
        raise InputError("not a URI", file=uri)
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in SCHEMES:
        raise InputError(f"unsupported scheme '{scheme}://' (grpo-cli reads {', '.join(SCHEMES)} and local paths)",
                         file=uri)
    authority, _, key = rest.partition("/")
    if not authority:
        raise InputError("no bucket or host in the URI (expected scheme://bucket/key)", file=uri)
    env = tuple((k, os.environ.get(k, "")) for k in _ENV_KEYS)
    try:
        fs = _filesystem(scheme, authority, env)
    except InputError as exc:
        raise InputError(exc.reason, file=uri) from None  # name what the user wrote
    if scheme in ("hdfs", "viewfs"):
        path = f"/{key}"  # the host names the cluster; the path is absolute in it
    elif isinstance(fs, pafs.PyFileSystem):
        path = rest  # fsspec drivers take the container or bucket as the first component, as pyarrow's do
    elif scheme in ("abfs", "abfss"):
        # abfs://container@account.dfs.core.windows.net/path: pyarrow's AzureFileSystem addresses container/path
        path = f"{authority.split('@', 1)[0]}/{key}"
    else:
        path = rest
    return RemotePath(uri, path.rstrip("/") if key else path, fs)


def to_path(location: Location) -> DumpPath:
    """A URI as a :class:`RemotePath`, anything else as a :class:`~pathlib.Path`."""
    if isinstance(location, RemotePath):
        return location
    text = os.fspath(location) if not isinstance(location, str) else location
    if is_uri(text):
        return remote_path(text)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return Path(text)


# -- errors and retries ------------------------------------------------------------------------------------------------
_TRANSIENT = re.compile(
    r"NETWORK_CONNECTION|curlCode|Could(?: not|n't) connect|timed? ?out|TIMEOUT|SLOW_DOWN|THROTTL|Throttl|"
    r"SERVICE_UNAVAILABLE|Service Unavailable|INTERNAL_FAILURE|InternalError|RequestTimeTooSkewed|"
    r"HTTP status 5\d\d|response code 5\d\d|Connection reset|Broken pipe|temporarily",
)
_DENIED = re.compile(r"ACCESS_DENIED|AccessDenied|SIGNATURE_DOES_NOT_MATCH|INVALID_ACCESS_KEY_ID|"
                     r"InvalidAccessKeyId|Forbidden|\b403\b|UNRECOGNIZED_CLIENT|ExpiredToken|credentials?\b",
                     re.IGNORECASE)
_NO_CREDENTIALS = re.compile(r"OAuth2 access token|Failed to get token|Unable to locate credentials|"
                             r"No credentials|NoCredentialProviders", re.IGNORECASE)
_NO_BUCKET = re.compile(r"NO_SUCH_BUCKET|NoSuchBucket|bucket does not exist", re.IGNORECASE)
_UNREACHABLE = re.compile(r"NETWORK_CONNECTION|curlCode|Could(?: not|n't) (?:connect|resolve)|timed? ?out",
                          re.IGNORECASE)


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, (OSError, pa.ArrowException)) and not isinstance(exc, FileNotFoundError) and bool(
        _TRANSIENT.search(str(exc))
    )


def retrying(call: Callable[[], _T], path: RemotePath | None = None, *, attempts: int | None = None,
             sleep: Callable[[float], None] = time.sleep) -> _T:
    """``call()`` (a request about ``path``), retried on a transient error (network, throttling, 5xx) with bounded
    exponential backoff. Any other error, or the last attempt's, is raised as it is.

    On S3 every request is already retried by the AWS SDK's standard strategy (:func:`_s3_options`), so ``call`` runs
    once: retrying around the SDK's retries would multiply the attempts (and the wait on a dead endpoint).
    """
    if attempts is None:
        attempts = 1 if path is not None and path.scheme == "s3" else retry_attempts()
    tries = max(1, attempts)
    for attempt in range(tries):
        try:
            return call()
        except (OSError, pa.ArrowException) as exc:
            if attempt + 1 >= tries or not _is_transient(exc):
                raise
            sleep(min(MAX_BACKOFF_S, 0.25 * 2**attempt))
    raise AssertionError("unreachable")  # the loop returns or raises


def _endpoint(path: RemotePath) -> str:
    if path.scheme == "s3":
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the AWS S3 endpoint"
    return f"the {path.scheme}:// endpoint"


_CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (or gcloud auth application-default login)",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS (or gcloud auth application-default login)",
    "hdfs": "your Kerberos ticket (kinit) and HADOOP_USER_NAME",
    "viewfs": "your Kerberos ticket (kinit) and HADOOP_USER_NAME",
    "abfs": "AZURE_STORAGE_ACCOUNT_KEY (or az login)",
    "abfss": "AZURE_STORAGE_ACCOUNT_KEY (or az login)",
}


def describe(exc: BaseException, path: RemotePath) -> str:
    """One line saying what went wrong with ``path`` and what to do (the store's own words after it)."""
    text = str(exc)
    detail = _first_line(exc)
    if _NO_BUCKET.search(text):
        bucket = path.path.split("/", 1)[0]
        return f"no such bucket '{bucket}': check the name (and the endpoint: {_endpoint(path)})"
    if _NO_CREDENTIALS.search(text):
        return f"no credentials found: set {_CREDENTIALS.get(path.scheme, 'them')} ({_short(detail)})"
    if _UNREACHABLE.search(text):
        hint = " (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3)" if path.scheme == "s3" else ""
        return f"cannot reach {_endpoint(path)}{hint}: check the address and the network ({_short(detail)})"
    if _DENIED.search(text):
        return (f"access denied: the credentials were refused; check {_CREDENTIALS.get(path.scheme, 'them')} "
                f"({_short(detail)})")
    if isinstance(exc, FileNotFoundError):
        return "no such object or prefix: check the path"
    return _short(detail)


def _short(text: str) -> str:
    # The SDK's messages end in request ids: the user needs the error's name, not the id.
    return re.sub(r"\s*\(Request ID: [^)]*\)", "", text).strip()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def failed(exc: BaseException, path: RemotePath, doing: str = "") -> InputError:
    """The :class:`InputError` for ``exc`` met while ``doing`` something with ``path``."""
    prefix = f"{doing}: " if doing else ""
    return InputError(prefix + describe(exc, path), file=path.uri)


def _remote_or_local(path: Location) -> str | os.PathLike[str] | RemotePath:
    # A URI string becomes a RemotePath; a local path is handed to pyarrow exactly as before.
    return remote_path(path) if isinstance(path, str) and is_uri(path) else path


# -- reading -----------------------------------------------------------------------------------------------------------
def open_parquet(path: Location, **options: Any) -> pq.ParquetFile:
    """``pq.ParquetFile`` of a local path (``options`` as given) or of a remote object (its footer read with
    retries; ``memory_map`` dropped and ``buffer_size`` raised to :data:`REMOTE_READ_BUFFER_BYTES`).

    Raises:
        InputError: for a remote object, what :func:`describe` says; local errors propagate unchanged.
    """
    path = _remote_or_local(path)
    if not isinstance(path, RemotePath):
        return pq.ParquetFile(path, **options)
    options.pop("memory_map", None)
    if options.get("buffer_size"):
        options["buffer_size"] = max(options["buffer_size"], REMOTE_READ_BUFFER_BYTES)
    try:
        return retrying(lambda: pq.ParquetFile(path.path, filesystem=path.fs, **options), path)
    except FileNotFoundError as exc:
        raise failed(exc, path) from None
    except (OSError, pa.ArrowException) as exc:
        if isinstance(exc, pa.ArrowInvalid):
            raise InputError(f"not a readable Parquet file ({_first_line(exc)})", file=path.uri) from None
        raise failed(exc, path) from None


def read_schema(path: Location) -> pa.Schema:
    """``pq.read_schema`` of a local path or a remote object (with its key-value metadata)."""
    path = _remote_or_local(path)
    if not isinstance(path, RemotePath):
        return pq.read_schema(path)
    return open_parquet(path).schema_arrow


def read_table(path: Location, columns: Iterable[str]) -> pa.Table:
    """``pq.read_table(path, columns=…)``: a few whole columns (``--group-by``'s key values)."""
    path = _remote_or_local(path)
    if not isinstance(path, RemotePath):
        return pq.read_table(path, columns=list(columns))
    return open_parquet(path).read(columns=list(columns))


def open_text(path: DumpPath) -> TextIO:
    """A UTF-8 text stream of a local file or a remote object (streamed, not downloaded first).

    Raises:
        OSError: a local file that cannot be opened; InputError: a remote one (:func:`describe`).
    """
    if not isinstance(path, RemotePath):
        return path.open("r", encoding="utf-8")
    try:
        return io.TextIOWrapper(retrying(lambda: path.fs.open_input_stream(path.path), path), encoding="utf-8")
    except (OSError, pa.ArrowException) as exc:
        raise failed(exc, path) from None


def read_bytes(path: RemotePath) -> bytes:
    """A remote object's whole content (for formats that are loaded whole anyway, such as ``torch.save`` files)."""
    try:
        with retrying(lambda: path.fs.open_input_stream(path.path), path) as stream:
            return stream.read()
    except (OSError, pa.ArrowException) as exc:
        raise failed(exc, path) from None


# -- writing -----------------------------------------------------------------------------------------------------------
def remove(path: DumpPath) -> None:
    """Delete ``path`` if it exists, quietly (a temporary file after a failure: the original error matters more)."""
    if not isinstance(path, RemotePath):
        path.unlink(missing_ok=True)
        return
    with contextlib.suppress(OSError, pa.ArrowException):
        retrying(lambda: path.fs.delete_file(path.path), path)

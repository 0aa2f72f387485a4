from __future__ import annotations

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


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Run a test once per available device (CPU always, CUDA where present)."""
    return request.param

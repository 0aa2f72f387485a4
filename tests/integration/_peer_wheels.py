"""Test helper: a framework's pinned wheel, unpacked, and its pure-torch modules imported with heavy imports stubbed.

The wheels share the peers tier's cache (``tests/peers/.wheels``, or ``GRPO_CLI_PEER_WHEELS``), in the same layout
(``<dist>-<version>/`` next to the wheel), so a machine that ran either tier downloads nothing. The stubbing is the
peers tier's (``tests/peers/_peer_import.py``); in addition, ``transformers`` is stubbed even where it is installed
(unless something already imported it) and ``torch.compile`` is the identity while the modules load, because the
recipes never reach either and importing them costs tens of seconds on a small machine.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

PEERS = Path(__file__).resolve().parents[1] / "peers"
sys.path.insert(0, str(PEERS))

from _peer_import import _StubLoader, peer_imports, wheel_cache_lock  # noqa: E402

WHEEL_DIR = Path(os.environ.get("GRPO_CLI_PEER_WHEELS", PEERS / ".wheels"))
# Third-party modules the frameworks' files import at module level (stubbed only when not installed).
STUBS = (
    "accelerate", "aiohttp", "codetiming", "colorlog", "datasets", "deepspeed", "einops", "fastapi", "flash_attn",
    "httpx", "huggingface_hub", "hydra", "jinja2", "kernels", "lark", "liger_kernel", "math_verify", "megatron",
    "mlflow", "modelscope", "numba", "omegaconf", "openai", "orjson", "packaging", "pandas", "peft", "PIL",
    "psutil", "pydantic", "ray", "requests", "rich", "safetensors", "sglang", "swanlab", "tenacity", "tensorboardX",
    "tensordict", "torchdata", "torchvision", "tqdm", "trackio", "transformers", "urllib3", "uvicorn", "uvloop",
    "vllm", "wandb", "yaml", "zmq",
)
FORCED_STUBS = ("transformers",)


def unpacked_wheel(dist: str, version: str) -> Path:
    """The folder holding ``dist==version``'s top-level package; skips the test if the index cannot be reached."""
    stem = dist.replace("-", "_")
    target = WHEEL_DIR / f"{dist}-{version}"
    if (target / ".unpacked").exists():
        return target
    with wheel_cache_lock(WHEEL_DIR):
        return _unpack(dist, version, stem, target)


def _unpack(dist: str, version: str, stem: str, target: Path) -> Path:
    if (target / ".unpacked").exists():  # another test process unpacked it while this one waited
        return target
    wheels = sorted(WHEEL_DIR.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "--retries", "1", "--timeout", "15", "-d", str(WHEEL_DIR), f"{dist}=={version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        except (OSError, subprocess.TimeoutExpired) as exc:
            last = str(exc)
        wheels = sorted(WHEEL_DIR.glob(f"{stem}-{version}-*.whl"))
        if not wheels:
            pytest.skip(f"could not download {dist}=={version} from the package index: {last}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(target)
    (target / ".unpacked").touch()
    return target


class _ForcedStubs(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.names:
            return importlib.util.spec_from_loader(fullname, _StubLoader(), is_package=True)
        return None


@contextlib.contextmanager
def framework_modules(top: str, root: Path, version: str, names: list[str],
                      forced_stubs: tuple[str, ...] = FORCED_STUBS,
                      stubs: tuple[str, ...] = STUBS) -> Iterator[list[ModuleType]]:
    """Import ``names`` from the unpacked wheel at ``root`` (top-level package ``top``) and keep the import machinery
    active inside the block (the recipe's own ``import`` lines run there); on exit every module of ``top`` leaves
    ``sys.modules`` again, so a recipe's monkeypatches never reach another test."""
    forced = {n for n in forced_stubs if n not in sys.modules}
    finder = _ForcedStubs(forced)
    sys.meta_path.insert(0, finder)
    compile_ = torch.compile
    # eager: same functions; ``@torch.compile(dynamic=True)`` (no model) is a decorator factory
    torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda fn: fn)  # type: ignore[assignment]
    try:
        with peer_imports({top: root}, stubs, {top: version}), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield [importlib.import_module(name) for name in names]
    finally:
        torch.compile = compile_
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if name.split(".")[0] in forced or name.split(".")[0] == top:
                del sys.modules[name]

"""The peers tier: run the peers' own released code (verl, TRL, AReaL, twinkle) against grpo-cli's core.

The pinned wheels are fetched once per session with ``pip download --no-deps NAME==VERSION`` into
``tests/peers/.wheels`` (git-ignored; reused by later runs) and unpacked there. Only the peers' pure-torch
functions are executed, from their own files; heavy imports (ray, transformers, vllm, ...) are stubbed by
:mod:`_peer_import`. When the package index cannot be reached every test here is skipped with one reason.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _peer_import import peer_imports, peer_modules_installed, wheel_cache_lock

# The cache folder; GRPO_CLI_PEER_WHEELS points it elsewhere (e.g. a shared CI cache).
WHEEL_DIR = Path(os.environ.get("GRPO_CLI_PEER_WHEELS", Path(__file__).parent / ".wheels"))
PINS: dict[str, tuple[str, str, str]] = {
    # key: (distribution, version, top-level package)
    "verl": ("verl", "0.9.1", "verl"),
    "trl": ("trl", "1.16.0", "trl"),
    "areal": ("areal", "1.0.4", "areal"),
    "twinkle": ("twinkle-kit", "0.5.1", "twinkle"),
}
# Third-party modules the peer files import at module level; stubbed only when not installed.
STUBS = (
    "accelerate",
    "aiohttp",
    "codetiming",
    "colorlog",
    "datasets",
    "deepspeed",
    "einops",
    "fastapi",
    "flash_attn",
    "httpx",
    "huggingface_hub",
    "hydra",
    "jinja2",
    "kernels",
    "liger_kernel",
    "math_verify",
    "megatron",
    "mlflow",
    "modelscope",
    "numba",
    "omegaconf",
    "openai",
    "orjson",
    "packaging",
    "pandas",
    "peft",
    "PIL",
    "psutil",
    "pydantic",
    "ray",
    "requests",
    "rich",
    "safetensors",
    "sglang",
    "swanlab",
    "tenacity",
    "tensorboardX",
    "tensordict",
    "torchdata",
    "torchvision",
    "tqdm",
    "trackio",
    "transformers",
    "urllib3",
    "uvicorn",
    "uvloop",
    "vllm",
    "wandb",
    "yaml",
    "zmq",
)
TIER = Path(__file__).parent
LOADED: dict[str, ModuleType] = {}
"""The modules loaded from the wheels, out of ``sys.modules`` except while a peers test runs."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if TIER in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.peers)


def _wheel(dist: str, version: str) -> Path | None:
    stem = dist.replace("-", "_")
    found = sorted(WHEEL_DIR.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def _fetch() -> dict[str, Path]:
    """Download (once) and unpack the pinned wheels; return ``{key: folder holding the top-level package}``."""
    with wheel_cache_lock(WHEEL_DIR):
        return _fetch_locked()


def _fetch_locked() -> dict[str, Path]:
    missing = [f"{d}=={v}" for d, v, _ in PINS.values() if _wheel(d, v) is None]
    if missing:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "--retries",
            "1",
            "--timeout",
            "15",
            "-d",
            str(WHEEL_DIR),
            *missing,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"pip download failed: {exc}") from exc
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"pip download {' '.join(missing)} failed: {last}")
    roots: dict[str, Path] = {}
    for key, (dist, version, _) in PINS.items():
        wheel = _wheel(dist, version)
        if wheel is None:
            raise RuntimeError(f"{dist}=={version}: no wheel after download")
        target = WHEEL_DIR / f"{dist}-{version}"
        if not (target / ".unpacked").exists():
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(target)
            (target / ".unpacked").touch()
        roots[key] = target
    return roots


@functools.cache
def _fetch_once() -> dict[str, Path] | str:
    """The unpacked wheels, or the reason they could not be had; tried once per test session."""
    try:
        return _fetch()
    except RuntimeError as exc:
        return f"peers tier skipped: the pinned peer wheels could not be fetched from the package index ({exc})"


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Skipping here rather than in the fixture makes pytest fold every skipped peers test into one summary line
    # (a fixture's skip is reported at each test's own location).
    if TIER in Path(str(item.fspath)).parents and isinstance(_fetch_once(), str):
        raise pytest.skip.Exception(_fetch_once())


@pytest.fixture(autouse=True)
def _peer_modules() -> Iterator[None]:
    """Each peers test sees the wheels' modules under their own names, and leaves the installed ones in place."""
    with peer_modules_installed(LOADED):
        yield


@pytest.fixture(scope="session")
def peer_roots() -> dict[str, Path]:
    """The unpacked pinned peer wheels (session-scoped: downloaded at most once), or a skip with the reason."""
    roots = _fetch_once()
    if isinstance(roots, str):
        pytest.skip(roots)
    return roots


def _load(peer_roots: dict[str, Path], modules: list[str]) -> list[ModuleType]:
    import importlib

    roots = {PINS[k][2]: p for k, p in peer_roots.items()}
    versions = {PINS[k][2]: PINS[k][1] for k in PINS}
    with peer_imports(roots, STUBS, versions, LOADED), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # version warnings about the stubs (e.g. TRL on "vLLM 99.0.0")
        return [importlib.import_module(m) for m in modules]


@pytest.fixture(scope="session")
def verl(peer_roots: dict[str, Path]) -> SimpleNamespace:
    """verl 0.9.1: ``core_algos`` (losses, agg_loss, kl_penalty, advantages), ``rollout_corr_helper``,
    ``metric_utils`` and ``utils.debug.metrics`` (the Pearson figure)."""
    core_algos, rollout_corr, metric_utils, debug_metrics = _load(
        peer_roots,
        ["verl.trainer.ppo.core_algos", "verl.trainer.ppo.rollout_corr_helper", "verl.trainer.ppo.metric_utils",
         "verl.utils.debug.metrics"],
    )
    return SimpleNamespace(core_algos=core_algos, rollout_corr=rollout_corr, metric_utils=metric_utils,
                           debug_metrics=debug_metrics)


@pytest.fixture(scope="session")
def trl(peer_roots: dict[str, Path]) -> SimpleNamespace:
    """TRL 1.16.0: ``GRPOTrainer`` (its ``_compute_loss`` runs on a stand-in trainer object)."""
    (grpo_trainer,) = _load(peer_roots, ["trl.trainer.grpo_trainer"])
    return SimpleNamespace(grpo_trainer=grpo_trainer, GRPOTrainer=grpo_trainer.GRPOTrainer)


@pytest.fixture(scope="session")
def areal(peer_roots: dict[str, Path]) -> SimpleNamespace:
    """AReaL 1.0.4: ``functional`` (loss functions, rejection sampling) and ``trainer.ppo.actor`` (logged stats)."""
    functional, actor, cli_args, stats_tracker = _load(
        peer_roots,
        [
            "areal.utils.functional.functional",
            "areal.trainer.ppo.actor",
            "areal.api.cli_args",
            "areal.utils.stats_tracker",
        ],
    )
    return SimpleNamespace(functional=functional, actor=actor, cli_args=cli_args, stats_tracker=stats_tracker)


@pytest.fixture(scope="session")
def twinkle(peer_roots: dict[str, Path]) -> SimpleNamespace:
    """twinkle 0.5.1: ``twinkle.loss.grpo`` (the GRPO-family loss classes)."""
    (loss_grpo,) = _load(peer_roots, ["twinkle.loss.grpo"])
    return SimpleNamespace(loss=loss_grpo)

"""Commands that need no tensor math do not import torch (1.3 s and 650 MB before anything happens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import sys
from grpo_cli.cli import main
code = main(sys.argv[1:])
loaded = ["torch"] if "torch" in sys.modules else []
sys.stderr.write("LOADED:" + ",".join(loaded) + "\\n")
raise SystemExit(code)
"""


@pytest.mark.parametrize("args", [["--version"], ["schema"], ["schema", "--preset", "verl", "--format", "json"]])
def test_command_does_not_import_torch(args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "LOADED:\n" in done.stderr, done.stderr


def test_io_public_names_still_import():
    from grpo_cli.io import COLUMNS, DEFAULT_BATCH_TOKENS, RolloutDataset, RolloutWriter, read_metadata

    assert "new_logp" in COLUMNS and DEFAULT_BATCH_TOKENS > 0 and callable(read_metadata)
    assert RolloutDataset.__name__ == "RolloutDataset" and RolloutWriter.__name__ == "RolloutWriter"


def test_convert_from_jsonl_does_not_import_torch(tmp_path):
    # JSON lines → Parquet needs numpy and pyarrow only: the converter, the part writer and the value checks.
    source = tmp_path / "d.jsonl"
    rows = [{"new_logp": [-0.5, -1.0, -0.25], "loss_mask": [0, 1, 1], "advantages": 0.5, "rewards": 1, "step": 0},
            {"new_logp": [-2.0], "loss_mask": [1], "advantages": -0.5, "rewards": 0.0, "step": 1}]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for i, extra in enumerate(([], ["--preset", "areal"], ["--on-invalid", "skip"])):
        target = out / str(i)
        done = subprocess.run([sys.executable, "-c", _PROBE, "convert", str(source), "-o", str(target), "--from",
                               "jsonl", *extra], capture_output=True, text=True, env=env, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert "LOADED:\n" in done.stderr, done.stderr
        assert "(2 sequences, 4 tokens)" in done.stderr, done.stderr
        assert len(list(target.glob("*.parquet"))) == 2


def test_invalid_jsonl_is_refused_without_torch(tmp_path):
    source = tmp_path / "d.jsonl"
    source.write_text(json.dumps({"new_logp": [-0.5, 0.5], "loss_mask": [1, 1], "step": 0}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _PROBE, "convert", str(source), "-o", str(tmp_path / "o"), "--from",
                           "jsonl"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "LOADED:\n" in done.stderr and "log-prob 0.5 > 0 at a valid token" in done.stderr, done.stderr
    assert not list((tmp_path / "o").glob("*.parquet"))


def test_validation_constants_match_the_core():
    from grpo_cli.core.logp_sanity import LOGP_COLUMNS, POSITIVE_LOGP_TOLERANCE
    from grpo_cli.engine.checks import LOGP_COLUMNS_CHECKED, LOGP_TOLERANCE

    assert LOGP_TOLERANCE == POSITIVE_LOGP_TOLERANCE
    assert (*LOGP_COLUMNS, "teacher_logp") == LOGP_COLUMNS_CHECKED


def test_constants_module_is_torch_free():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = "import sys, grpo_cli._constants; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize(("module", "function", "config"), [
    ("grpo_cli.cli._analyze", "analyze", "grpo_cli.metrics.config:AnalyzeConfig"),
    ("grpo_cli.cli._analyze", "compare_prox", "grpo_cli.metrics.prox:CompareProxConfig"),
    ("grpo_cli.cli._diff", "diff", "grpo_cli.commands.diff:DiffConfig"),
])
def test_cli_defaults_are_the_config_defaults(module, function, config):
    # config_from hands an option to the config field of the same name: their defaults must be one value.
    import dataclasses
    import importlib
    import inspect

    command = getattr(importlib.import_module(module), function)
    config_module, config_name = config.split(":")
    fields = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(config_module), config_name))}
    compared = 0
    for name, parameter in inspect.signature(command).parameters.items():
        field = fields.get(name)
        if field is None or field.default is dataclasses.MISSING or name in ("names",):
            continue  # names: the CLI's "grpo-cli" is the config's None (both mean grpo-cli's own keys)
        assert parameter.default == field.default, f"{function} --{name}: CLI {parameter.default!r}, config " \
                                                   f"{field.default!r}"
        compared += 1
    assert compared >= 5

"""Commands that need no tensor math do not import torch (1.3 s and 650 MB before anything happens)."""

from __future__ import annotations

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

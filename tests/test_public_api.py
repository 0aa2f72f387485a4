"""The names users import from `grpo_cli` (a contract) resolve, and importing the package stays light."""

from __future__ import annotations

import subprocess
import sys

import grpo_cli


def test_every_exported_name_resolves():
    for name in grpo_cli.__all__:
        assert getattr(grpo_cli, name) is not None, name
    assert grpo_cli.GRPOMetric.__module__ == "grpo_cli.core.metric"
    assert grpo_cli.RolloutWriter.__name__ == "RolloutWriter"


def test_import_does_not_load_torch():
    code = "import sys, grpo_cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

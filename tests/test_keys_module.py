"""``grpo_cli/_keys.json`` (the torch-free key and option lists ``check`` validates rules files with) is exactly what
the declarations give, and a rules file with errors is refused before torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_REGENERATE = ("python -c \"from grpo_cli.metrics.registry import keys_json as s; "
               "open('grpo_cli/_keys.json', 'w', encoding='utf-8').write(s())\"")


def test_the_generated_key_module_matches_the_declarations():
    from grpo_cli.metrics.registry import keys_json

    text = (ROOT / "grpo_cli" / "_keys.json").read_text(encoding="utf-8")
    assert text == keys_json(), f"grpo_cli/_keys.json is stale: regenerate it with {_REGENERATE}"


def test_the_generated_lists_equal_the_registry():
    from dataclasses import fields

    from grpo_cli import _keys
    from grpo_cli.commands.compare_prox import CompareProxConfig, expected_keys
    from grpo_cli.engine.config import GROUP_BY_COLUMNS
    from grpo_cli.metrics.config import AnalyzeConfig
    from grpo_cli.metrics.registry import KEYS

    assert {key: str(figure.reduce) for key, figure in KEYS.items()} == _keys.KEYS
    assert "kl/k3" in _keys.KEYS and _keys.KEYS["top_kl"] == "table"
    assert list(_keys.PROX_KEYS) == expected_keys(CompareProxConfig())
    assert {f.name: str(f.type) for f in fields(AnalyzeConfig)} == _keys.ANALYZE_OPTIONS
    assert {f.name: str(f.type) for f in fields(CompareProxConfig)} == _keys.COMPARE_PROX_OPTIONS
    assert _keys.GROUP_BY_COLUMNS == GROUP_BY_COLUMNS


_PROBE = """
import sys
from grpo_cli.cli import main
code = main(sys.argv[1:])
sys.stderr.write("TORCH:" + str("torch" in sys.modules) + "\\n")
raise SystemExit(code)
"""


def test_a_bad_rules_file_is_refused_before_torch_is_imported(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[analyze]\nepsilonn = 0.2\n[[rule]]\nmetric = "kl/k33"\nmaxx = 1\n[[rule]]\nmetric = "top_kl"\n'
                   'max = 1\n[[rule]]\nmetric = "clip/ratio"\nmin = 2\nmax = 1\n', encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _PROBE, "check", str(ROOT / "sample_data" / "rollouts.parquet"),
                           "--rules", str(bad)], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "TORCH:False" in done.stderr, done.stderr
    message = [line for line in done.stderr.splitlines() if line.startswith("grpo-cli: error")]
    assert len(message) == 1, done.stderr  # every problem in one message
    for part in ("unknown key 'maxx'", "unknown metric 'kl/k33'", "did you mean 'kl/k3'", "lists cannot be rules",
                 "min 2 is above max 1", "unknown option 'epsilonn'"):
        assert part in message[0], (part, message[0])


def test_check_help_still_works():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "grpo_cli", "check", "--help"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0 and "--baseline" in done.stdout, done.stderr

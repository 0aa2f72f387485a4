"""The figure keys and option names a rules file may use, without torch: ``check`` validates a rules file before
importing it. The data is ``_keys.json``, generated from the figures' declarations by
:func:`grpo_cli.metrics.registry.keys_json` (``tests/test_keys_module.py`` keeps the two equal).
"""

from __future__ import annotations

import json
from importlib import resources

_DATA = json.loads(resources.files("grpo_cli").joinpath("_keys.json").read_text(encoding="utf-8"))

KEYS: dict[str, str] = _DATA["keys"]
"""Every declared figure key and its reduction (``table`` keys are lists, never a rule's metric)."""
PROX_KEYS: tuple[str, ...] = tuple(_DATA["prox_keys"])
"""The keys compare-prox reports with its default methods."""
ANALYZE_OPTIONS: dict[str, str] = _DATA["analyze_options"]
"""``AnalyzeConfig``'s fields and their declared types."""
COMPARE_PROX_OPTIONS: dict[str, str] = _DATA["compare_prox_options"]
"""``CompareProxConfig``'s fields and their declared types."""
GROUP_BY_COLUMNS: tuple[str, ...] = tuple(_DATA["group_by_columns"])
"""The per-sequence integer columns ``--group-by`` and ``per`` take by name."""

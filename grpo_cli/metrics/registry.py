"""The key registry: every figure grpo-cli can report, gathered from the groups' declarations, and the sections
the tables show them in.

Keys are a public contract (``docs/metrics.md`` has each formula and peer equivalent): add freely; never rename or
drop one without bumping the JSON ``schema_version``.
"""

from __future__ import annotations

from grpo_cli.engine.figures import Figure
from grpo_cli.metrics import default_groups
from grpo_cli.metrics.adv_check import ADV_CHECK_FIGURES
from grpo_cli.metrics.prox import ProxCompareGroup

__all__ = ["CHECK_FIGURES", "KEYS", "SECTIONS", "all_figures", "keys_json", "section_of"]

SECTIONS: dict[str, str] = {
    "dump": "What was read",
    "invalid": "Invalid sequences left out (--on-invalid skip; docs/errors.md)",
    "logp": "Log-probabilities (valid tokens)",
    "kl": "KL between training and behaviour policy (samples from old)",
    "ratio": "PPO importance ratio exp(new − base), base = prox_logp if present else old_logp",
    "clip": "Clipping",
    "kl_ref": "KL between training and reference policy (samples from new)",
    "behave": "Decoupled PPO behaviour weight exp(prox − old) (over tokens rejection sampling keeps)",
    "rs": "Rejection sampling (AReaL, --rs-*)",
    "m2po": "M2PO second-moment masking (AReaL, --m2-threshold)",
    "is": "Importance weight w = exp(new − old) health (verl rollout correction)",
    "ppl": "Perplexities (per sequence, then averaged)",
    "prob": "Token probabilities",
    "abs_diff": "|new − old| distribution",
    "staleness": "Staleness (valid generated tokens)",
    "spikes": "Spikes",
    "adv": "Advantages (valid tokens)",
    "seq": "Sequences",
    "reward": "Rewards (per sequence)",
    "groups": "GRPO groups",
    "loss": "Losses over the whole dump (ratio base = prox_logp if present else old_logp)",
    "sanity": "Sanity (valid tokens; every log-prob column)",
    "prox": "compare-prox: proximal approximation ℓp̂ vs the recomputed prox_logp ℓp* (valid generated tokens)",
    "kd": "Distillation against teacher_logp (AReaL joint KD)",
    "adv_check": "Advantage check: recomputed vs the dump's advantages (grpo-cli advantages)",
    "verl": "verl's own definitions (--names verl): rollout correction, Pearson, critic/score",
    "trl": "TRL's own definitions (--names trl): clip ratios, kl, vLLM importance sampling",
    "areal": "AReaL's own definitions (--names areal): ppo_actor/update statistics",
    "other": "Other",
}
"""Table titles, in the order the tables are shown."""

CHECK_FIGURES: tuple[Figure, ...] = (
    Figure("sanity/n_nonfinite_logp", "sequences dropped for a NaN/±inf log-prob, once per column (check)",
           reduce="count"),
    Figure("sanity/n_positive_logp", "sequences dropped for a log-prob > 1e-4, once per column (check)",
           reduce="count"),
)
"""Figures ``check`` derives from the validation counts (0 unless ``--on-invalid skip`` dropped sequences)."""


def all_figures() -> list[Figure]:
    """Every declared figure: ``analyze``'s groups, validation, ``compare-prox``, ``check`` and ``advantages``."""
    groups = [*default_groups(), ProxCompareGroup()]
    return [f for group in groups for f in group.figures] + [*CHECK_FIGURES, *ADV_CHECK_FIGURES]


def _registry() -> dict[str, Figure]:
    out: dict[str, Figure] = {}
    for figure in all_figures():
        if figure.key in out:
            raise ValueError(f"figure {figure.key!r} is declared twice")
        out[figure.key] = figure
    return out


KEYS: dict[str, Figure] = _registry()
"""``{key: Figure}`` for every figure (its section, meaning, requirements and peer names)."""


def section_of(key: str) -> str:
    """The section of a key: declared, else its prefix before '/', else 'other'."""
    if key in KEYS:
        return KEYS[key].section or "other"
    prefix = key.split("/", 1)[0]
    return prefix if prefix in SECTIONS else "other"


def keys_json() -> str:
    """The text of ``grpo_cli/_keys.json``: the key names (with their reductions), the compare-prox keys, the
    ``[analyze]``/``[compare_prox]`` option types and the ``per`` columns, derived from the declarations here, so
    that ``check`` validates a rules file without importing torch (``grpo_cli._keys`` loads it).
    ``tests/test_keys_module.py`` fails when the file differs from this text and says how to regenerate it.
    """
    import json
    from dataclasses import fields

    from grpo_cli.engine.config import GROUP_BY_COLUMNS
    from grpo_cli.metrics.config import AnalyzeConfig
    from grpo_cli.metrics.prox import CompareProxConfig, expected_keys

    data = {
        "keys": {key: str(figure.reduce) for key, figure in KEYS.items()},
        "prox_keys": expected_keys(CompareProxConfig()),
        "analyze_options": {f.name: str(f.type) for f in fields(AnalyzeConfig)},
        "compare_prox_options": {f.name: str(f.type) for f in fields(CompareProxConfig)},
        "group_by_columns": list(GROUP_BY_COLUMNS),
    }
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"

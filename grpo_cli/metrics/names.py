"""``--names areal|verl|trl|twinkle``: every figure that has an equivalent, under the key that framework logs.

Each figure declares its peers' keys (:class:`~grpo_cli.engine.figures.Figure` ``peers``); one table per framework,
gathered here, maps a grpo-cli key to the framework's key and a transform that converts our value into theirs
(:data:`~grpo_cli.engine.figures.TRANSFORMS`: ``"neg"``, the framework logs the opposite sign, e.g. verl's
``actor/ppo_kl`` = mean(old − new); ``"square"``, AReaL logs ``squared_error`` where we report the rmse). Figures
without an equivalent keep their grpo-cli key. ``docs/metrics.md`` ("Names per framework") has the same tables with
each framework's reduction conventions where they differ from ours; ``tests/test_names.py`` checks the two agree.

Example:
    >>> rename_metrics({"logp/diff_mean": 0.25, "n_sequences": 3}, "areal")
    {'ppo_actor/update/logp_diff/avg': -0.25, 'ppo_actor/n_seqs': 3}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_cli.engine.figures import TRANSFORMS, PeerName
from grpo_cli.metrics.config import PEER_NAMES
from grpo_cli.metrics.registry import KEYS

__all__ = ["FRAMEWORKS", "NAMES", "TRANSFORMS", "PeerName", "rename_keys", "rename_metrics", "rename_result", "sources"]

FRAMEWORKS: tuple[str, ...] = PEER_NAMES
"""Frameworks ``--names`` accepts (besides ``grpo-cli``, the default: no renaming)."""

def _tables() -> dict[str, dict[str, PeerName]]:
    tables: dict[str, dict[str, PeerName]] = {framework: {} for framework in FRAMEWORKS}
    for key, figure in KEYS.items():
        for framework, name in figure.peers.items():
            tables[framework][key] = name  # type: ignore[assignment]  # Figure normalises str to PeerName
    return tables


NAMES: dict[str, dict[str, PeerName]] = _tables()
"""``{framework: {grpo-cli key: PeerName}}``, gathered from the figures' declarations."""


def _table(framework: str | None) -> dict[str, PeerName]:
    if framework is None or framework == "grpo-cli":
        return {}
    if framework not in NAMES:
        raise ValueError(f"unknown framework {framework!r}; choose one of grpo-cli, {', '.join(FRAMEWORKS)}")
    return NAMES[framework]


def rename_metrics(metrics: Mapping[str, Any], framework: str | None) -> dict[str, Any]:
    """``metrics`` with every mapped key renamed and its value converted; order and unmapped keys kept."""
    table = _table(framework)
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        target = table.get(key)
        out[target.key if target else key] = target.convert(value) if target else value
    return out


def rename_keys(mapping: Mapping[str, Any], framework: str | None) -> dict[str, Any]:
    """``mapping`` (e.g. the omitted keys with their reasons) with mapped keys renamed, values untouched."""
    table = _table(framework)
    return {(table[k].key if k in table else k): v for k, v in mapping.items()}


def sources(keys: Mapping[str, Any] | list[str], framework: str | None) -> dict[str, str]:
    """``{framework key: grpo-cli key}`` for the mapped keys among ``keys`` (the grpo-cli names)."""
    table = _table(framework)
    return {table[k].key: k for k in keys if k in table}


def rename_result(result: Any, framework: str | None) -> tuple[Any, dict[str, str]]:
    """An ``AnalysisResult``-like dataclass with ``metrics``, ``omitted`` and per-group metrics renamed.

    Returns ``(renamed result, {framework key: grpo-cli key})``; the JSON ``config`` records ``names``. With
    ``framework`` None or ``"grpo-cli"`` the result is returned unchanged.
    """
    import dataclasses

    if not _table(framework):
        return result, {}
    keys = list(result.metrics) + list(result.omitted)
    groups = [dict(group, metrics=rename_metrics(group["metrics"], framework)) for group in result.groups]
    for group in result.groups:
        keys.extend(group["metrics"])
    renamed = dataclasses.replace(
        result,
        metrics=rename_metrics(result.metrics, framework),
        omitted=rename_keys(result.omitted, framework),
        groups=groups,
        config={**result.config, "names": framework},
    )
    return renamed, sources(keys, framework)

"""Figures are declared once: each group reports exactly the keys it declares, no key comes from two groups, and
the omitted reasons follow the declarations (missing columns first, then options that are off)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_cli.commands.analyze import analyze
from grpo_cli.engine.figures import Figure, PeerName, any_column, column, omitted_reasons, option
from grpo_cli.io import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig, default_groups
from grpo_cli.metrics.policy import PolicyGroup
from grpo_cli.metrics.prox import CompareProxConfig, ProxCompareGroup, compare_prox_groups
from grpo_cli.metrics.registry import KEYS, all_figures

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "rollouts.parquet"


class _Config:
    top_k = 0


def test_omitted_reasons_columns_first_then_options():
    figures = (
        Figure("a/x", "x", needs=(column("old_logp"),)),
        Figure("a/y", "y", needs=(option(lambda c: c.top_k > 0, "off"),)),
        Figure("a/z", "z", needs=(column("old_logp"), option(lambda c: c.top_k > 0, "off"))),
        Figure("a/w", "w", needs=(any_column("old_logp", "prox_logp"),)),
        Figure("a/v", "v", needs=(column("entropy"),), enabled=lambda c: False),
    )
    got = omitted_reasons(figures, frozenset({"new_logp", "prox_logp"}), _Config())
    assert list(got.items()) == [("a/x", "needs an 'old_logp' column"), ("a/z", "needs an 'old_logp' column"),
                                 ("a/y", "off")]
    assert omitted_reasons(figures, frozenset({"old_logp"}), _Config()) == {"a/y": "off", "a/z": "off"}


def test_figure_defaults():
    fig = Figure("staleness/theta_max", "largest lag", peers={"areal": "x/max", "verl": PeerName("y", "neg")})
    assert (fig.section, fig.reduce) == ("staleness", "max")
    assert fig.peers["areal"] == PeerName("x/max") and fig.peers["verl"].convert(2.0) == -2.0
    assert Figure("n_tokens", "n").reduce == "count" and Figure("clip/low_frac", "f").reduce == "fraction"
    with pytest.raises(ValueError, match="transform"):
        PeerName("k", "cube")


def test_every_figure_declared_once_and_every_declared_key_registered():
    keys = [figure.key for figure in all_figures()]
    assert len(keys) == len(set(keys)) == len(KEYS)


@pytest.fixture(scope="module")
def dataset():
    return RolloutDataset([SAMPLE])


def _reported_by(group, dataset, config):
    """What ``group`` reports beside PolicyGroup (which gives n_valid_tokens, without which nothing is shown)."""
    groups = [group] if isinstance(group, PolicyGroup) else [PolicyGroup(), group]
    result = analyze(dataset, config, groups=groups)
    own = set(result.metrics)
    if not isinstance(group, PolicyGroup):
        own -= set(analyze(dataset, config, groups=[PolicyGroup()]).metrics)
    return own


def test_each_group_reports_what_it_declares_and_no_key_twice(dataset):
    config = AnalyzeConfig(c_clip=3, rs_upper=5, m2_threshold=0.01, max_new_tokens=8, kl_clamp=10, beta=0.04)
    seen: dict[str, str] = {}
    for group in default_groups():
        declared = {f.key for f in group.figures}
        reported = _reported_by(group, dataset, config) if group.name != "invalid" else set()
        assert reported <= declared, (group.name, reported - declared)
        for key in reported:
            assert key not in seen, f"{key} reported by {seen.get(key)} and {group.name}"
            seen[key] = group.name


def test_compare_prox_groups_share_their_common_figures_once(dataset):
    config = CompareProxConfig(rs_upper=5)
    groups = [g for g in compare_prox_groups(("loglinear", "linear")) if isinstance(g, ProxCompareGroup)]
    declared = [f.key for g in groups for f in g.figures]
    assert declared.count("prox/n_tokens") == 1 and declared.count("prox/loss_ppo") == 1
    assert groups[0].expected_keys(config)[:3] == ["prox/n_tokens", "prox/loss_ppo", "prox/loglinear/abs_error_mean"]
    assert groups[1].expected_keys(config)[0] == "prox/linear/abs_error_mean"

"""Every command that computes figures takes a dump's recorded options (``RolloutWriter(metadata=…)``) as its
defaults the way ``analyze`` does (tests/test_metadata_defaults.py): the values used are in the JSON config, the
figures equal those of the same data with the option given explicitly, an explicit option (or a rules file's
``[analyze]``) wins, and files that disagree are refused (exit 2, naming both files and the key). ``diff`` reads
each run's own metadata. Also: compare-prox's config names its ratio base as analyze's does."""

from __future__ import annotations

import json
import re

import pytest
import torch

from grpo_cli.cli import main
from grpo_cli.io import RolloutWriter

METADATA = {"temperature": 0.5, "clip_ratio": 0.1, "framework": "verl"}
"""What the dumps record: ``clip_ratio`` is verl's name for ε."""
EXPLICIT = ("--temperature", "0.5", "--epsilon", "0.1")
"""The same options, given on the command line."""
DATA = re.compile(r'<script type="application/json" id="report-data">(.*?)</script>', re.S)


def run(capsys, *args):
    argv = [str(a) for a in args]
    if argv[0] == "check":  # options and baselines are what is tested; the random dumps' findings are beside it
        argv += ["--ignore", "GRP"]
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *args, code=0):
    got, out, err = run(capsys, *args, "-f", "json")
    assert got == code, err
    return json.loads(out)


def _dump(directory, *, seed=0, rank=0, **metadata):
    """Six steps of four sequences with prox_logp, versions (lags 0–2) and advantages: enough for every command
    (compare-prox's lags, diff's step blocks). The same ``seed`` gives the same tokens whatever the metadata."""
    gen = torch.Generator().manual_seed(seed)
    with RolloutWriter(directory, rank=rank, metadata=metadata) as writer:
        for step in range(6):
            new = -torch.rand(4, 8, generator=gen) * 2
            old = (new + 0.3 * torch.randn(4, 8, generator=gen)).clamp(max=0)
            prox = (new + 0.1 * torch.randn(4, 8, generator=gen)).clamp(max=0)
            lag = torch.randint(0, 3, (4, 1), generator=gen)
            writer.add(step=step, new_logp=new, old_logp=old, prox_logp=prox,
                       loss_mask=torch.ones_like(new, dtype=torch.bool), versions=(step + 2 - lag).expand(4, 8),
                       current_version=torch.full((4,), step + 2), advantages=torch.randn(4, generator=gen))
    return directory


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("metadata")
    return {
        "meta": _dump(root / "meta", **METADATA),
        "plain": _dump(root / "plain"),
        "meta_new": _dump(root / "meta_new", seed=1, **METADATA),
        "plain_new": _dump(root / "plain_new", seed=1),
    }


def _disagreeing(tmp_path):
    _dump(tmp_path / "d", rank=0, clip_ratio=0.1)
    _dump(tmp_path / "d", rank=1, clip_ratio=0.3)
    return tmp_path / "d"


def _refused(capsys, *args):
    code, _, err = run(capsys, *args)
    assert code == 2, err
    assert "metadata 'clip_ratio' = 0.3 differs from 0.1" in err
    assert "part-step000000-rank000" in err and "part-step000000-rank001" in err


def test_compare_prox_takes_the_dumps_clip_widths(capsys, dumps, tmp_path):
    doc = run_json(capsys, "compare-prox", dumps["meta"])
    assert doc["config"]["epsilon"] == 0.1 and doc["config"]["epsilon_high"] == 0.1
    # compare-prox has no temperature: it is neither taken nor reported.
    assert doc["config"]["from_metadata"] == {"epsilon": 0.1, "framework": "verl"}
    assert "temperature" not in doc["config"]
    same = run_json(capsys, "compare-prox", dumps["plain"], "--epsilon", "0.1")
    assert "from_metadata" not in same["config"]
    assert same["metrics"] == doc["metrics"]
    default = run_json(capsys, "compare-prox", dumps["plain"])
    assert default["metrics"]["prox/loglinear/loss_ppo"] != doc["metrics"]["prox/loglinear/loss_ppo"]
    explicit = run_json(capsys, "compare-prox", dumps["meta"], "--epsilon", "0.2")
    assert explicit["config"]["epsilon"] == 0.2 and explicit["metrics"] == default["metrics"]
    assert explicit["config"]["from_metadata"] == {"framework": "verl"}
    _refused(capsys, "compare-prox", _disagreeing(tmp_path))
    code, _, err = run(capsys, "compare-prox", tmp_path / "d", "--epsilon", "0.2")
    assert code == 0, err


def test_compare_prox_config_names_the_ratio_base(capsys, dumps):
    doc = run_json(capsys, "compare-prox", dumps["plain"])
    analyzed = run_json(capsys, "analyze", dumps["plain"])
    assert doc["config"]["ratio_base"] == analyzed["config"]["ratio_base"] == "prox"
    code, out, err = run(capsys, "compare-prox", dumps["plain"])
    assert code == 0, err
    assert "ratio_base=prox" in out


RULES = """
[[rule]]
metric = "clip/ratio"
max = 1.0

[[rule]]
metric = "logp/new_mean"
max = 0.0
"""


def test_check_takes_the_dumps_options(capsys, dumps, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    doc = run_json(capsys, "check", dumps["meta"], "-r", rules)
    assert doc["config"]["temperature"] == 0.5 and doc["config"]["epsilon"] == 0.1
    assert doc["config"]["from_metadata"] == {"temperature": 0.5, "epsilon": 0.1, "framework": "verl"}
    same = run_json(capsys, "check", dumps["plain"], "-r", rules, *EXPLICIT)
    assert same["metrics"] == doc["metrics"]
    default = run_json(capsys, "check", dumps["plain"], "-r", rules)
    assert default["metrics"]["logp/new_mean"] != doc["metrics"]["logp/new_mean"]
    # The command line wins, and so does the rules file's [analyze] table.
    explicit = run_json(capsys, "check", dumps["meta"], "-r", rules, "--temperature", "1")
    assert explicit["config"]["temperature"] == 1.0 and explicit["config"]["epsilon"] == 0.1
    assert "temperature" not in explicit["config"]["from_metadata"]
    pinned = tmp_path / "pinned.toml"
    pinned.write_text("[analyze]\nepsilon = 0.3\n" + RULES)
    ruled = run_json(capsys, "check", dumps["meta"], "-r", pinned)
    assert ruled["config"]["epsilon"] == 0.3 and ruled["config"]["temperature"] == 0.5
    _refused(capsys, "check", _disagreeing(tmp_path), "-r", rules)


@pytest.mark.slow
def test_report_takes_the_dumps_options(capsys, dumps, tmp_path):
    def data(*args):
        page = tmp_path / "page.html"
        code, _, err = run(capsys, "report", *args, "-o", page, "-q")
        assert code == 0, err
        return json.loads(DATA.search(page.read_text(encoding="utf-8")).group(1))

    doc = data(dumps["meta"])
    config = doc["analyze"]["config"]
    assert config["temperature"] == 0.5 and config["epsilon"] == 0.1
    assert config["from_metadata"] == {"temperature": 0.5, "epsilon": 0.1, "framework": "verl"}
    assert doc["compare_prox"]["config"]["epsilon"] == 0.1
    same = data(dumps["plain"], *EXPLICIT)
    assert same["analyze"]["metrics"] == doc["analyze"]["metrics"]
    assert same["compare_prox"]["metrics"] == doc["compare_prox"]["metrics"]
    # --compare: the base run is read with its own recorded options; an explicit option wins in both runs.
    compared = data(dumps["plain_new"], "--compare", dumps["meta"], "--epsilon", "0.2")
    assert compared["analyze"]["config"]["temperature"] == 1.0 and compared["analyze"]["config"]["epsilon"] == 0.2
    assert compared["compare_prox"]["config"]["epsilon"] == 0.2
    base = compared["compare"]["analyze"]["config"]
    assert base["temperature"] == 0.5 and base["epsilon"] == 0.2
    assert base["from_metadata"] == {"temperature": 0.5, "framework": "verl"}
    assert compared["compare"]["analyze"]["metrics"]["logp/new_mean"] == doc["analyze"]["metrics"]["logp/new_mean"]
    _refused(capsys, "report", _disagreeing(tmp_path), "-o", tmp_path / "x.html")


def _figures(doc):
    return {f["key"]: (f["base"], f["new"]) for f in doc["figures"]}


def test_diff_reads_each_runs_own_metadata(capsys, dumps, tmp_path):
    doc = run_json(capsys, "diff", dumps["meta"], dumps["meta_new"])
    assert doc["config"]["temperature"] == 0.5 and doc["config"]["epsilon"] == 0.1
    recorded = {"temperature": 0.5, "epsilon": 0.1, "framework": "verl"}
    assert doc["config"]["from_metadata"] == {"base": recorded, "new": recorded}
    same = run_json(capsys, "diff", dumps["plain"], dumps["plain_new"], *EXPLICIT)
    assert _figures(same) == _figures(doc)
    # One run recorded its options, the other did not: each is measured with its own.
    code, out, err = run(capsys, "diff", dumps["meta"], dumps["plain_new"], "-f", "json")
    assert code == 0, err
    assert "temperature differs between the runs (base 0.5, new 1" in err
    mixed = json.loads(out)
    assert mixed["config"]["temperature"] == 1.0  # the runs disagree: the config keeps the command's value
    assert mixed["config"]["from_metadata"] == {"base": recorded, "new": {}}
    at_half, at_one = _figures(same), _figures(run_json(capsys, "diff", dumps["plain"], dumps["plain_new"]))
    assert at_half["logp/new_mean"] != at_one["logp/new_mean"]  # the temperature shows in the figures
    for key, (base, new) in _figures(mixed).items():
        assert base == at_half[key][0] and new == at_one[key][1], key
    explicit = run_json(capsys, "diff", dumps["meta"], dumps["meta_new"], "--temperature", "1")
    assert explicit["config"]["temperature"] == 1.0 and explicit["config"]["epsilon"] == 0.1
    _refused(capsys, "diff", _disagreeing(tmp_path), dumps["plain"])


def test_check_measures_a_dump_baseline_with_its_own_options(capsys, dumps, tmp_path):
    rules = tmp_path / "relative.toml"
    rules.write_text('[[rule]]\nmetric = "logp/new_mean"\nmax_abs_change = 100.0\n')
    # The baseline run recorded temperature 0.5 and clip 0.1; the new run recorded nothing (temperature 1).
    doc = run_json(capsys, "check", dumps["plain_new"], "-r", rules, "--baseline", dumps["meta"])
    rule = next(r for r in doc["rules"] if r["metric"] == "logp/new_mean")
    plain_rules = tmp_path / "rules.toml"
    plain_rules.write_text(RULES)
    at_half = run_json(capsys, "check", dumps["meta"], "-r", plain_rules)["metrics"]["logp/new_mean"]
    at_one = run_json(capsys, "check", dumps["plain"], "-r", plain_rules)["metrics"]["logp/new_mean"]
    assert at_half != at_one  # the same tokens: only the temperature differs
    assert rule["baseline"] == at_half
    assert doc["config"]["temperature"] == 1.0 and "from_metadata" not in doc["config"]

"""`grpo-cli report` — structure, offline, valid HTML, embedded data equal to the commands' JSON,
determinism across processes, size, and lazy imports. The browser tier is in test_report_browser.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from reference import random_sequences, write_sequences

from grpo_cli.cli import main

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data" / "rollouts.parquet"

SECTION_IDS = ("summary", "verdicts", "verdict-sanity", "key-figures", "checks", "check-sanity", "trends",
               "distributions", "staleness", "top-kl", "top-kl-table", "top-ratio",
               "top-ratio-table", "figures", "not-computed", "config",
               "report-data")
CHART_IDS = ("fig-trend-clip", "fig-trend-kl", "fig-trend-is-ess", "fig-trend-is-chi2", "fig-trend-staleness",
             "fig-trend-loss", "fig-trend-entropy", "fig-hist-ratio", "fig-hist-abs-diff", "fig-heat-staleness",
             "fig-prox-lag")
DATA = re.compile(r'<script type="application/json" id="report-data">(.*?)</script>', re.S)

RULES = """
[analyze]
epsilon = 0.25

[[rule]]
metric = "kl/k3"
max = 1.0

[[rule]]
metric = "clip/ratio"
max = 0.01
per = "step"
severity = "warn"

[[rule]]
metric = "n_valid_tokens"
min = 1
per = "group_id"

[[rule]]
metric = "prox/loglinear/abs_error_mean"
max = 10.0
"""


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def data_of(html: str) -> dict:
    match = DATA.search(html)
    assert match is not None
    return json.loads(match.group(1))


class StrictParser(HTMLParser):
    """Every element closed in order (the template closes optional end tags too), ids counted."""

    VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track",
                      "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.ids: Counter[str] = Counter()
        self.tags: Counter[str] = Counter()
        self.decls: list[str] = []

    def _attrs(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        for name, value in attrs:
            if name == "id":
                self.ids[value] += 1

    def handle_decl(self, decl: str) -> None:
        self.decls.append(decl)

    def handle_starttag(self, tag, attrs):
        self._attrs(tag, attrs)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self._attrs(tag, attrs)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}> at {self.getpos()}")
        else:
            self.stack.pop()


def parse(html: str) -> StrictParser:
    parser = StrictParser()
    parser.feed(html)
    parser.close()
    return parser


@pytest.fixture(scope="module")
def other_process(tmp_path_factory, light_analyze):
    """``python -m grpo_cli report SAMPLE`` in another process (fresh hash seeds, fresh matplotlib state), started
    before this process renders the same page (``sample_page``) so that the two run side by side on two cores;
    ``(process, its page)``. test_under_a_megabyte_and_deterministic_across_processes waits for it."""
    out = tmp_path_factory.mktemp("again") / "again.html"
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "report", str(SAMPLE), "-o", str(out), "-q"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc, out
    if proc.poll() is None:  # its test did not run (deselected): do not leave it behind
        proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def sample_page(tmp_path_factory, other_process):
    out = tmp_path_factory.mktemp("report") / "report.html"
    assert main(["report", str(SAMPLE), "-o", str(out), "-q"]) == 0
    return out.read_bytes()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A dump with steps, versions and prox_logp, under a file name HTML must escape, and a rules file."""
    folder = tmp_path_factory.mktemp("small")
    path = folder / "a&<b>.parquet"
    seqs = random_sequences(48, seed=11, with_prox=True, spread=0.4)
    seqs[3].old[-1] = float("nan")  # one invalid sequence: skipped and counted, as check does by default
    write_sequences(str(path), seqs, row_group_size=10)
    rules = folder / "rules.toml"
    rules.write_text(RULES)
    page = folder / "report.html"
    assert main(["report", str(path), "-o", str(page), "--rules", str(rules), "-q", "--top-k", "5"]) == 0
    return path, rules, page.read_text(encoding="utf-8")


# -- structure ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_section_and_chart_is_there(sample_page):
    html = sample_page.decode("utf-8")
    assert len(sample_page) < 1_000_000
    parser = parse(html)
    for element_id in SECTION_IDS:
        assert parser.ids[element_id] == 1, element_id
    for chart in CHART_IDS:
        # Each chart is an inline <svg id=...> with real text (svg.fonttype = none) inside its <figure>.
        svg = re.search(rf'<figure id="{chart}-figure".*?(<svg id="{chart}".*?</svg>)', html, re.S)
        assert svg is not None, chart
        assert "<text" in svg.group(1) and "<path" in svg.group(1), chart
    assert "Not shown" not in html
    assert "<title>grpo-cli report" in html
    # Header: inputs, counts, steps and the sanity verdict.
    assert "sample_data/rollouts.parquet" in html and "8,192" in html and "128 (0–127)" in html
    assert "check --rules-preset sanity" in html and 'class="verdict pass"' in html
    # compare-prox verdicts and the top-k table.
    assert "loglinear: safe up to lag 1" in html
    top_kl = re.search(r'<table id="top-kl-table">.*?</table>', html, re.S)
    assert top_kl is not None
    # The sample repeats prompts with identical samples: its ten highest-KL tokens are five distinct tokens, the
    # repeated ones merged into one line listing their rows (as analyze's table does).
    lines = re.findall(r'<tr><td class="mono">rollouts.parquet</td><td class="num">([^<]*)</td>', top_kl.group(0))
    assert lines == ["3708", "6720", "5817", "5914, 5917–5918", "7514–7516, 7518"]
    assert "Rows with identical values are merged" in html


@pytest.mark.slow
def test_all_figures_lists_the_top_tokens_as_lines_not_json(sample_page):
    html = sample_page.decode("utf-8")
    figures = re.search(r'<h2 id="figures">.*?<h2', html, re.S)
    assert figures is not None
    row = re.search(r'<td class="key">top_kl</td><td colspan="2"><pre class="mono">(.*?)</pre>', figures.group(0), re.S)
    assert row is not None
    lines = row.group(1).splitlines()
    # the five distinct tokens of the sample's top ten (analyze --format json top_kl), duplicates on one line
    assert lines[0] == "rollouts.parquet row 3708, position 5: kl 10.46, ratio 14.1, new_logp -0.8258, old_logp -3.472"
    assert len(lines) == 5 and lines[3].startswith("rollouts.parquet row 5914, 5917–5918, position 5: kl 3.764")
    assert '{&#34;file' not in figures.group(0) and '{"file"' not in figures.group(0)
    assert re.search(r'<td class="key">top_ratio</td><td colspan="2"><pre class="mono">rollouts.parquet row ',
                     figures.group(0))


@pytest.mark.slow
def test_page_is_offline(sample_page):
    html = sample_page.decode("utf-8")
    outside_data = DATA.sub("", html)
    assert not re.search(r"https?://", outside_data, re.I)
    assert not re.search(r"\bsrc\s*=", outside_data, re.I)
    assert "<link" not in outside_data and "@import" not in outside_data
    assert re.findall(r"url\((?!#)", outside_data) == []  # only references to ids within the page
    assert len(re.findall(r"<script\b", html)) == 1  # the data block; no JavaScript at all


@pytest.mark.slow
def test_page_is_valid_html(sample_page):
    html = sample_page.decode("utf-8")
    assert html.startswith("<!DOCTYPE html>\n<html lang=\"en\">")
    parser = parse(html)
    assert parser.errors == [] and parser.stack == []
    assert [decl for decl in parser.decls] == ["DOCTYPE html"]
    duplicates = {i: n for i, n in parser.ids.items() if n > 1}
    assert duplicates == {}  # per-figure id prefixes: matplotlib's figure_1, axes_1, clip ids never collide
    svgs = re.findall(r"<svg\b.*?</svg>", html, re.S)
    assert len(svgs) == len(CHART_IDS)
    for svg in svgs:
        ET.fromstring(svg)  # each is well-formed XML as well


@pytest.mark.slow
def test_under_a_megabyte_and_deterministic_across_processes(sample_page, other_process):
    # Another process (fresh hash seeds, fresh matplotlib state) writes the same bytes.
    proc, out = other_process
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert out.read_bytes() == sample_page
    assert len(sample_page) < 1_000_000


# -- the page is its own data, equal to the commands' JSON ------------------------------------------------------


def test_embedded_data_equals_the_commands_json(capsys, small):
    path, rules, html = small
    data = data_of(html)
    code, out, err = run(capsys, "analyze", path, "--group-by", "step", "--on-invalid", "skip", "--epsilon", "0.25",
                         "--top-k", "5", "-f", "json")
    assert code == 0, err
    analyze_doc = json.loads(out)
    groups = analyze_doc.pop("groups")
    assert data["analyze"] == analyze_doc
    assert analyze_doc["metrics"]["invalid/n_sequences_skipped"] == 1
    # Per-step figures: analyze's groups, scalar figures in columns.
    per_step = data["per_step"]
    assert per_step["group_by"] == "step" and per_step["keys"] == [g["key"] for g in groups]
    for i, group in enumerate(groups):
        for key, value in group["metrics"].items():
            if not isinstance(value, (list, dict)):
                assert per_step["series"][key][i] == value, (key, group["key"])
    assert "ratio/hist" not in per_step["series"] and "kl/k3" in per_step["series"]

    code, out, err = run(capsys, "compare-prox", path, "--on-invalid", "skip", "--epsilon", "0.25", "-f", "json")
    assert code == 0, err
    assert data["compare_prox"] == json.loads(out)
    assert data["compare_prox_unavailable"] is None

    for label, args in (("sanity", ["--rules-preset", "sanity"]), ("rules", ["--rules", rules])):
        code, out, err = run(capsys, "check", path, *args, "--epsilon", "0.25", "-f", "json")  # the page's options
        assert code == 1, err  # both fail "input passes validation" (the NaN sequence)
        check_doc = json.loads(out)
        assert data["checks"][label]["rules"] == check_doc["rules"], label
        assert data["checks"][label]["summary"] == check_doc["summary"], label
    # The verdicts really were evaluated: validation failed, the per-step warning fired.
    assert data["checks"]["sanity"]["summary"]["status"] == "fail"
    statuses = {r["name"]: r["status"] for r in data["checks"]["rules"]["rules"]}
    assert statuses["input passes validation"] == "fail" and statuses["clip/ratio per step"] == "warn"
    assert 'class="verdict fail"' in html


def test_names_are_escaped(small):
    path, _, html = small
    outside_data = DATA.sub("", html)
    assert "a&amp;&lt;b&gt;.parquet" in outside_data and "<b>.parquet" not in outside_data
    assert "\\u003cb\\u003e" in DATA.search(html).group(1)  # the JSON block cannot close the script element
    assert data_of(html)["analyze"]["inputs"] == [str(path)]
    assert parse(html).errors == []


def test_without_steps_or_compare_prox(capsys, tmp_path):
    seqs = random_sequences(30, seed=4)  # no prox_logp: compare-prox cannot run
    for s in seqs:
        s.step = None
    path = tmp_path / "plain.parquet"
    write_sequences(str(path), seqs)
    out = tmp_path / "r.html"
    code, _, err = run(capsys, "report", path, "-o", out)
    assert code == 0, err
    # the random dump's log-probs disagree and its advantages ignore the rewards: the sanity verdict names that
    assert f"wrote {out}" in err and "sanity: FAILED" in err and "GRP301" in err
    html = out.read_text(encoding="utf-8")
    parser = parse(html)
    assert parser.errors == [] and {i for i, n in parser.ids.items() if n > 1} == set()
    for chart in CHART_IDS:
        assert f'id="{chart}-figure"' in html, chart
    assert html.count("Not shown: the dump has no &#39;step&#39; column") == 7  # every trend chart says why
    assert "Not shown: compare-prox cannot run on this dump: compare-prox cannot run without it: the recomputed" in html
    assert '<svg id="fig-hist-ratio"' in html and '<svg id="fig-heat-staleness"' in html
    data = data_of(html)
    assert data["per_step"] is None and data["compare_prox"] is None
    assert "prox_logp" in data["compare_prox_unavailable"]


def test_usage_errors(capsys, tmp_path):
    path = tmp_path / "d.parquet"
    write_sequences(str(path), random_sequences(8, seed=1))
    code, _, err = run(capsys, "report", path)
    assert code == 2 and "--output" in err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nmetric = "kl/k33"\nmax = 1\n')
    code, _, err = run(capsys, "report", path, "-o", tmp_path / "r.html", "--rules", bad)
    assert code == 2 and "unknown metric 'kl/k33'" in err and "kl/k3" in err
    assert not (tmp_path / "r.html").exists()


@pytest.fixture(scope="module")
def light_analyze(tmp_path_factory):
    """A fresh interpreter runs analyze and imports the render packages, reporting which of matplotlib and jinja2
    it loaded. Started with ``other_process`` (before the in-process sample page) so that it runs beside it."""
    folder = tmp_path_factory.mktemp("light")
    path = folder / "d.parquet"
    write_sequences(str(path), random_sequences(8, seed=2))
    args = ["analyze", str(path), "--group-by", "step", "-f", "json", "-o", str(folder / "a.json")]
    script = (
        "import sys\n"
        "from grpo_cli.cli import main\n"
        f"code = main({args!r})\n"
        "heavy = sorted(m for m in ('matplotlib', 'jinja2') if m in sys.modules)\n"
        "print(code, heavy)\n"
        "import grpo_cli.render, grpo_cli.commands.report\n"  # the packages stay light too: their imports are lazy
        "print(sorted(m for m in ('matplotlib', 'jinja2') if m in sys.modules))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    yield proc
    if proc.poll() is None:  # its test did not run
        proc.kill()
    proc.communicate()


@pytest.mark.slow
def test_analyze_does_not_import_matplotlib_or_jinja2(light_analyze):
    stdout, stderr = light_analyze.communicate(timeout=120)
    assert light_analyze.returncode == 0, stderr
    assert stdout.split("\n")[:2] == ["0 []", "[]"]

"""Read the right ratio: ``top_ratio`` locates ``ratio/max``; the config names the ratio base; ``top_kl`` lists the
ratio against both old and prox."""

from __future__ import annotations

import json
import math

import pytest
from reference import random_sequences, write_sequences

from grpo_cli.cli import main


def run_json(capsys, *args):
    code = main([str(a) for a in args] + ["-f", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _location_of_max(seqs, base_attr):
    best = (-math.inf, None)
    for row, s in enumerate(seqs):
        base = getattr(s, base_attr)
        for t in s.valid():
            r = math.exp(float(s.new[t]) - float(base[t]))
            if r > best[0]:
                best = (r, (row, t))
    return best


def test_top_ratio_locates_ratio_max_against_prox(capsys, tmp_path):
    seqs = random_sequences(15, seed=11, max_len=9)
    for s in seqs:
        s.prox = [o - 0.05 * (i % 3) for i, o in enumerate(s.old)]
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs)
    doc = run_json(capsys, "analyze", path, "--batch-tokens", "13")
    assert doc["config"]["ratio_base"] == "prox"
    top = doc["metrics"]["top_ratio"]
    assert len(top) == 10 and top[0]["ratio"] == doc["metrics"]["ratio/max"]
    value, (row, position) = _location_of_max(seqs, "prox")
    assert top[0]["ratio"] == pytest.approx(value, rel=1e-5)
    assert (top[0]["file"], top[0]["row"], top[0]["position"]) == (0, row, position)
    first = doc["metrics"]["top_kl"][0]
    s = seqs[first["row"]]
    t = first["position"]
    assert first["ratio_base"] == pytest.approx(math.exp(s.new[t] - s.prox[t]), rel=1e-5)
    assert first["ratio"] == pytest.approx(math.exp(s.new[t] - s.old[t]), rel=1e-5)


def test_ratio_base_old_without_prox_and_table(capsys, tmp_path):
    seqs = random_sequences(8, seed=2, max_len=6)
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs)
    doc = run_json(capsys, "analyze", path)
    assert doc["config"]["ratio_base"] == "old"
    assert doc["metrics"]["top_ratio"][0]["ratio"] == doc["metrics"]["ratio/max"]
    code = main(["analyze", str(path), "--all"])
    out = capsys.readouterr().out
    assert code == 0 and "Highest-ratio tokens" in out
    doc = run_json(capsys, "analyze", path, "--top-k", "0")
    assert "top_ratio" not in doc["metrics"] and "--top-k 0" in doc["omitted"]["top_ratio"]


def _table(html, table_id):
    import re

    table = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', html, re.S)
    assert table is not None, table_id
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table.group(1))]


@pytest.mark.parametrize("with_prox", [True, False])
def test_report_lists_the_highest_ratio_tokens(tmp_path, with_prox):
    seqs = random_sequences(15, seed=11, max_len=9)
    base_attr = "prox" if with_prox else "old"
    if with_prox:
        for s in seqs:
            s.prox = [o - 0.05 * (i % 3) for i, o in enumerate(s.old)]
    other = random_sequences(4, seed=3, max_len=5, with_prox=with_prox)
    for s in other:  # every ratio 1 here: the largest ones are in the second file
        s.old = list(s.new)
        s.prox = list(s.new) if with_prox else None
    write_sequences(str(tmp_path / "a.parquet"), other)
    write_sequences(str(tmp_path / "b.parquet"), seqs)
    page = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"), "-o", str(page), "-q",
                 "--top-k", "3"]) == 0
    html = page.read_text(encoding="utf-8")
    value, (row, position) = _location_of_max(seqs, base_attr)
    assert value > 1
    rows = _table(html, "top-ratio-table")
    assert len(rows) == 3
    first = rows[0]
    assert first[:3] == ["b.parquet", str(row), str(position)]
    assert float(first[3]) == pytest.approx(value, rel=1e-3)  # shown with 4 significant digits
    s = seqs[row]
    assert float(first[4]) == pytest.approx(s.new[position], rel=1e-3)
    assert float(first[5]) == pytest.approx(getattr(s, base_attr)[position], rel=1e-3)
    assert f"{base_attr}_logp</th>" in html and "Highest-ratio tokens" in html
    # Next to the top-KL table.
    assert html.index('id="top-kl-table"') < html.index('id="top-ratio-table"') < html.index('id="figures"')

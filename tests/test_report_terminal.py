"""Terminal trends (sparklines over steps) and bar histograms, snapshotted from what the console
records (``Console(record=True).export_text()``): key lines and structure, not full-screen goldens."""

from __future__ import annotations

import io
import json

import pytest
from reference import random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.render.console import make_console
from grpo_cli.render.terminal import distribution_rows, downsample, render_distributions, render_trends, trend_sparkline


def recorded(draw, width: int = 100) -> str:
    """What ``draw(console)`` shows on a plain (non-TTY) console of ``width`` columns."""
    console = make_console(file=io.StringIO(), record=True)
    console.width = width
    draw(console)
    return console.export_text()


def cells(line: str) -> list[str]:
    """A table row's cells (between the ``│`` borders), stripped."""
    return [cell.strip() for cell in line.strip().strip("│").split("│")]


# -- downsampling and sparklines, by hand --------------------------------------------------------------------------


def test_downsample_bucket_means_by_hand():
    # n = 6, w = 3: buckets [0:2], [2:4], [4:6] → mean(1, 3) = 2, mean(5, 7) = 6, mean(9) = 9 (None left out).
    assert downsample([1, 3, 5, 7, None, 9], 3) == [2.0, 6.0, 9.0]
    # n = 7, w = 3: bounds ⌊i·7/3⌋ = 0, 2, 4, 7 → mean(1, 2), mean(3, 4), mean(5, 6, 7).
    assert downsample([1, 2, 3, 4, 5, 6, 7], 3) == [1.5, 3.5, 6.0]
    # A bucket with only missing values (None, NaN, inf) stays missing; short series are not stretched.
    assert downsample([None, float("nan"), 4.0, 6.0], 2) == [None, 5.0]
    assert downsample([1, float("inf")], 5) == [1.0, None]
    with pytest.raises(ValueError):
        downsample([1.0], 0)


def test_trend_sparkline_by_hand():
    assert trend_sparkline(list(range(8)), 8) == "▁▂▃▄▅▆▇█"
    # lo 0, hi 10: levels round(7·0/10) = 0, 7, round(3.5) = 4 → ▁ █ ▅
    assert trend_sparkline([0, 10, 5], 3) == "▁█▅"
    # 100 values i in 10 buckets: means 4.5 + 10k, levels round(7k/9) = 0 1 2 2 3 4 5 5 6 7
    assert trend_sparkline(list(range(100)), 10) == "▁▂▃▃▄▅▆▆▇█"
    assert trend_sparkline([2.0, None, 2.0], 3) == "▄ ▄"  # flat: the middle block; missing: a space
    assert trend_sparkline([None, None], 4) == "  "


def test_distribution_rows_by_hand():
    hist = {"scale": "log", "edges": [1, 2, 4, 8, 16], "counts": [1, 2, 3, 4], "zero": 2, "below": 5, "above": 0}
    # Two display rows: bins merged pairwise (1 + 2, 3 + 4); `below` first (with its zeros), no `above` row.
    assert distribution_rows(hist, max_rows=2) == [("< 1 (2 are 0)", 5), ("1 – 4", 3), ("4 – 16", 7)]
    lags = [{"lag": 0, "n_tokens": 3}, {"lag": 2, "n_tokens": 4}, {"lag": 64, "n_tokens": 1, "overflow": True}]
    assert distribution_rows(lags) == [("lag 0", 3), ("lag 1", 0), ("lag 2", 4), ("lag ≥ 64", 1)]
    # 40 lags with one token each, at most 2·8 = 16 rows: ranges of ⌈40/16⌉ = 3 lags, the last one alone.
    many = distribution_rows([{"lag": k, "n_tokens": 1} for k in range(40)], max_rows=8)
    assert many[0] == ("lag 0–2", 3) and many[-1] == ("lag 39", 1) and len(many) == 14
    assert sum(count for _, count in many) == 40


# -- what the console records ----------------------------------------------------------------------------------------


def test_trend_table_snapshot():
    groups = [
        {"key": 1, "metrics": {"kl/k3": 0.1, "clip/ratio": 0.0}},
        {"key": 2, "metrics": {"kl/k3": 0.3}},
        {"key": 3, "metrics": {"kl/k3": 0.2, "clip/ratio": 0.5}},
        {"key": 4, "metrics": {"kl/k3": 0.4, "clip/ratio": 0.25, "top_kl": [1]}},
    ]
    text = recorded(lambda c: render_trends(c, "step", groups, ["kl/k3", "clip/ratio", "top_kl"]))
    lines = text.splitlines()
    assert lines[0].startswith("Trend over step (4 values, ascending)")
    header = next(line for line in lines if "first" in line)
    assert "step 1 → 4" in header and header.index("first") < header.index("last") < header.index("min")
    # kl/k3: lo 0.1, hi 0.4 → levels 0, round(4.67) = 5, round(2.33) = 2, 7; first 0.1, last 0.4, min 0.1, max 0.4.
    row = next(line for line in lines if "kl/k3" in line)
    assert "▁▆▃█" in row and cells(row)[-4:] == ["0.1", "0.4", "0.1", "0.4"]
    # clip/ratio is missing at step 2: a gap; levels 0, 7, round(3.5) = 4.
    row = next(line for line in lines if "clip/ratio" in line)
    assert "▁ █▅" in row and cells(row)[-4:] == ["0", "0.25", "0", "0.5"]
    assert "top_kl" not in text  # not a number: no trend row


def test_trend_is_downsampled_to_the_cell():
    groups = [{"key": k, "metrics": {"kl/k3": float(k)}} for k in range(500)]
    text = recorded(lambda c: render_trends(c, "step", groups, ["kl/k3"]), width=100)
    row = next(line for line in text.splitlines() if "kl/k3" in line)
    spark = max(row.split("│"), key=lambda cell: sum(ch in "▁▂▃▄▅▆▇█" for ch in cell)).strip()
    # reserved = 5 (name) + 44 + 19 = 68 → 100 − 68 = 32 marks for 500 steps, rising from ▁ to █.
    assert len(spark) == 32 and spark[0] == "▁" and spark[-1] == "█"
    assert list(spark) == sorted(spark, key="▁▂▃▄▅▆▇█".index)
    assert "each mark is the mean of ≈15.6" in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_distribution_bars_snapshot():
    metrics = {
        "ratio/hist": {"scale": "log", "edges": [0.5, 1.0, 2.0], "counts": [10, 400], "zero": 0, "below": 1,
                       "above": 0},
        "staleness/hist": [{"lag": 0, "n_tokens": 30}, {"lag": 1, "n_tokens": 15}],
    }
    text = recorded(lambda c: render_distributions(c, metrics))
    lines = text.splitlines()
    assert lines[0].startswith("Distributions")
    # Bars are scaled to the largest count of their own distribution (32 cells): 400 → 32 full blocks,
    # 10 → 0.8 cell = ⌊0.8·8⌋ = 6 eighths (▊).
    row = next(line for line in lines if "1 – 2" in line)
    assert cells(row)[2:] == ["400", "█" * 32]
    row = next(line for line in lines if "0.5 – 1" in line)
    assert cells(row)[2:] == ["10", "▊"]
    # 1 token is 0.08 of a cell, under one eighth: drawn as a sliver, never as an empty bar.
    row = next(line for line in lines if "< 0.5" in line)
    assert cells(row)[2:] == ["1", "▏"]
    assert any("ratio/hist" in line and "all 2 log bins" in line for line in lines)
    row = next(line for line in lines if "lag 1" in line)
    assert cells(row)[2:] == ["15", "█" * 16]  # 15/30 of 32 cells


def test_analyze_group_by_prints_trends_plain(capsys, tmp_path):
    path = tmp_path / "d.parquet"
    write_sequences(str(path), random_sequences(40, seed=3, with_prox=True))
    code = main(["analyze", str(path), "--group-by", "step", "--metrics", "kl/k3,clip/ratio", "--all"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "\x1b[" not in out  # not a terminal: no escape codes
    trend = out.split("Trend over step (4 values")[1]
    assert "kl/k3" in trend and "clip/ratio" in trend
    doc_code = main(["analyze", str(path), "--group-by", "step", "-f", "json"])
    doc = json.loads(capsys.readouterr()[0])
    assert doc_code == 0
    first = doc["groups"][0]["metrics"]["kl/k3"]
    row = next(line for line in trend.splitlines() if "kl/k3" in line)
    assert f"{first:.6g}" in row  # the first step's value, formatted as every table does
    assert "ratio/hist" in out and "staleness/hist" in out and "lag 0" in out


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("no_color", [False, True])
def test_no_color_on_a_terminal(monkeypatch, no_color):
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLORTERM", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    stream = FakeTerminal()
    console = make_console(file=stream)
    render_trends(console, "step", [{"key": k, "metrics": {"kl/k3": k}} for k in range(3)], ["kl/k3"])
    # On a terminal the sparkline is coloured; NO_COLOR keeps the same text without escape codes.
    assert ("\x1b[" in stream.getvalue()) is not no_color
    assert "▁▅█" in stream.getvalue()  # 0, 1, 2: levels 0, round(3.5) = 4, 7

"""Terminal polish: choice errors without typer's "Value error," prefix; check's verdict once on a terminal;
identical top-token rows merged."""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_cli.cli import main


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _duplicated(tmp_path):
    path = tmp_path / "d.parquet"
    new = [[-0.1, -0.2, -3.0]] * 3 + [[-0.1, -0.5, -0.2]]
    old = [[-0.1, -0.2, -0.5]] * 3 + [[-0.1, -0.4, -0.3]]
    f32 = pa.list_(pa.float32())
    pq.write_table(pa.table({"new_logp": pa.array(new, f32), "old_logp": pa.array(old, f32)}), path)
    return path


def test_choice_errors_have_no_value_error_prefix(capsys, tmp_path):
    code, _, err = run(capsys, "analyze", _duplicated(tmp_path), "--on-invalid", "ignore")
    assert code == 2 and "Invalid value for '--on-invalid': 'ignore' is not one of" in err
    assert "Value error" not in err


def test_identical_top_rows_are_merged(capsys, tmp_path):
    code, out, _ = run(capsys, "analyze", _duplicated(tmp_path), "--all")
    assert code == 0 and "0–2" in out and "rows with identical values are merged" in out


def test_check_verdict_once_on_a_terminal(capsys, tmp_path, monkeypatch):
    rules = tmp_path / "r.toml"
    rules.write_text('[[rule]]\nmetric = "kl/k3"\nmax = 0\n')
    path = _duplicated(tmp_path)
    code, out, err = run(capsys, "check", path, "--rules", rules)
    assert code == 1 and "FAILED" in out and "FAILED" in err  # piped: the log keeps the verdict on stderr
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    code, out, err = run(capsys, "check", path, "--rules", rules)
    assert code == 1 and out.count("FAILED") == 1 and "FAILED" not in err


def test_compare_prox_lag_table_fits_100_columns(capsys):
    import io
    import json
    from pathlib import Path

    from rich.console import Console

    from grpo_cli.render.prox import render_compare_prox_table

    sample = Path(__file__).resolve().parents[1] / "sample_data" / "rollouts.parquet"
    code, out, err = run(capsys, "compare-prox", sample, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    methods = ["loglinear", "linear", "rollout"]
    buffer = io.StringIO()
    render_compare_prox_table(Console(file=buffer, width=100, no_color=True), metrics=doc["metrics"], omitted={},
                              inputs=doc["inputs"], config={}, methods=methods, recommendations={}, tolerance=0.01)
    text = buffer.getvalue()
    lag_part = text[text.index("By staleness lag"):]
    assert "…" not in lag_part and all(f"— {m}" in lag_part for m in methods)
    assert max(len(line) for line in lag_part.splitlines()) <= 100


def test_trend_chart_integer_steps_and_symlog_for_a_spike():
    from grpo_cli.render.charts import trend_chart

    calm = trend_chart("fig-a", [0, 1, 2], {"kl/k3": [0.11, 0.13, 0.12]}, ylabel="KL")
    assert ">0.5<" not in calm and ">1.5<" not in calm and "symlog" not in calm
    spiky = trend_chart("fig-b", list(range(8)), {"kl/k3": [0.11, 0.13, 0.12, 0.1, 40.0, 0.12, 0.11, 0.1]},
                        ylabel="KL")
    assert "symlog above 0.12" in spiky
    assert trend_chart("fig-b", list(range(8)), {"kl/k3": [0.11, 0.13, 0.12, 0.1, 40.0, 0.12, 0.11, 0.1]},
                       ylabel="KL") == spiky  # still byte-identical


def test_check_statuses_are_coloured_unless_no_color(capsys, tmp_path):
    import io

    from rich.console import Console

    from grpo_cli.commands.check import CheckReport, Rule, RuleResult, Status
    from grpo_cli.render.check import render_check_table

    results = [RuleResult(Rule("kl/k3", max=1.0), status, bound="≤ 1") for status in (Status.PASS, Status.FAIL)]
    report = CheckReport(results=results, metrics={}, omitted={}, inputs=["d.parquet"], config={})
    coloured = io.StringIO()
    render_check_table(Console(file=coloured, force_terminal=True, color_system="standard", width=100), report)
    assert "\x1b[" in coloured.getvalue() and coloured.getvalue().count("FAILED") == 1
    plain = io.StringIO()
    render_check_table(Console(file=plain, force_terminal=True, no_color=True, width=100), report)
    assert "\x1b[3" not in plain.getvalue()  # NO_COLOR: styles without colours

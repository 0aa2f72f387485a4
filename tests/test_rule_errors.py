"""Errors all at once and for the right reason: a rules file is validated in one pass, list-valued keys are refused
as rules, skipped rules keep their subject, and ``--metrics`` typos get a did-you-mean."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from reference import random_sequences, write_sequences

from grpo_cli.cli import main


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _dump(tmp_path):
    path = tmp_path / "d.parquet"
    write_sequences(str(path), random_sequences(8, seed=3, max_len=6))
    return path


def test_every_problem_of_a_rules_file_in_one_message(capsys, tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text(
        '[analyze]\nepsilonn = 0.2\n'
        '[[rule]]\nmetric = "kl/k33"\nmaxx = 1\nmin = 5\nmax = 1\n'
        '[[rule]]\nmetric = "clip/ratio"\nmin = 2\nmax = 1\n'
    )
    code, _, err = run(capsys, "check", _dump(tmp_path), "--rules", rules)
    assert code == 2 and len(err.strip().splitlines()) == 1
    for part in ("unknown key 'maxx'", "unknown metric 'kl/k33' (did you mean 'kl/k3'", "rule 1 (kl/k33): min 5",
                 "rule 2 (clip/ratio): min 2",
                 "[analyze] unknown option 'epsilonn'"):
        assert part in err, (part, err)


def test_a_list_valued_key_cannot_be_a_rule(capsys, tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text('[[rule]]\nmetric = "top_kl"\nmax = 1\n')
    code, _, err = run(capsys, "check", _dump(tmp_path), "--rules", rules)
    assert code == 2 and "'top_kl' is a list" in err and "lists cannot be rules" in err and "--top-k" not in err


def test_skipped_rule_keeps_its_subject(capsys, tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"new_logp": pa.array([[-0.1, -0.2]] * 3, pa.list_(pa.float32())), "step": [0, 1, 1]}),
                   path)
    rules = tmp_path / "r.toml"
    rules.write_text('[[rule]]\nmetric = "kl/k3"\nmax = 1\noptional = true\nper = "step"\nname = "kl gate"\n')
    code, out, _ = run(capsys, "check", path, "--rules", rules)
    assert code == 0 and "SKIPPED: kl gate: kl/k3 per step not computed: needs an 'old_logp' column" in out


def test_metrics_typo_gets_did_you_mean_not_every_name(capsys, tmp_path):
    code, _, err = run(capsys, "analyze", _dump(tmp_path), "--group-by", "step", "--metrics", "kl/k33")
    assert code == 2 and "'kl/k33' (did you mean 'kl/k3'" in err
    assert "n_valid_tokens" not in err and len(err) < 400

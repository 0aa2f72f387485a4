"""The input-error matrix through the CLI: every case exits 2 with one actionable line, no traceback.

Value problems (NaN/±inf/positive log-probs, masks not 0/1, versions above current_version) are also run with
``--on-invalid skip``: the offending sequence is dropped, counted under ``invalid/*`` in every output format, a
warning line goes to stderr, and every other figure equals the float64 reference over the remaining sequences.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reference import Seq, policy_reference, random_sequences, write_sequences

from grpo_cli.cli import main

F32 = pa.list_(pa.float32())


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("grpo-cli: error: ") and "Traceback" not in err
    return lines[0]


def seqs(n: int = 12) -> list[Seq]:
    return random_sequences(n, seed=7, max_len=12)


def first_valid(s: Seq) -> int:
    return s.valid()[0]


# -- builders: each writes a broken input under tmp and returns the CLI arguments -----------------------------------
def _write(tmp: Path, name: str, data: list[Seq], **kw) -> Path:
    path = tmp / name
    write_sequences(str(path), data, **kw)
    return path


def _table(tmp: Path, name: str, columns: dict[str, pa.Array]) -> Path:
    path = tmp / name
    pq.write_table(pa.table(columns), path)
    return path


def valid_file(tmp: Path) -> list:
    return [_write(tmp, "d.parquet", seqs())]


def missing_path(tmp: Path) -> list:
    return [tmp / "missing.parquet"]


def empty_directory(tmp: Path) -> list:
    (tmp / "empty").mkdir()
    return [tmp / "empty"]


def not_parquet(tmp: Path) -> list:
    path = tmp / "notes.parquet"
    path.write_text("new_logp,old_logp\n-1,-1\n")
    return [path]


def truncated(tmp: Path) -> list:
    path = _write(tmp, "d.parquet", seqs())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the footer is gone
    return [path]


def corrupted_footer(tmp: Path) -> list:
    path = _write(tmp, "d.parquet", seqs())
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    data[start : start + 16] = b"\xff" * 16  # garbage thrift
    path.write_bytes(bytes(data))
    return [path]


def corrupted_page(tmp: Path) -> list:
    # A data page flipped in the middle of the file: the footer is fine, decoding row group 2 fails (page CRC).
    path = tmp / "d.parquet"
    pq.write_table(pq.read_table(_write(tmp, "src.parquet", seqs())), path, row_group_size=4,
                   write_page_checksum=True)
    meta = pq.ParquetFile(path).metadata
    chunk = next(meta.row_group(2).column(i) for i in range(meta.num_columns)
                 if meta.row_group(2).column(i).path_in_schema.startswith("new_logp"))
    data = bytearray(path.read_bytes())
    data[chunk.data_page_offset + chunk.total_compressed_size - 5] ^= 0xFF
    path.write_bytes(bytes(data))
    os.remove(tmp / "src.parquet")
    return [path]


def zero_rows(tmp: Path) -> list:
    path = _write(tmp, "src.parquet", seqs())
    pq.write_table(pq.read_table(path).slice(0, 0), tmp / "empty.parquet")
    os.remove(path)
    return [tmp / "empty.parquet"]


def zero_valid_tokens(tmp: Path) -> list:
    data = seqs()
    for s in data:
        s.mask = [0] * len(s.new)
    return [_write(tmp, "d.parquet", data)]


def missing_required_column(tmp: Path) -> list:
    return [_table(tmp, "d.parquet", {"old_logp": pa.array([[-1.0]], F32)})]


def string_column(tmp: Path) -> list:
    return [_table(tmp, "d.parquet", {"new_logp": pa.array([[-1.0]], F32), "old_logp": pa.array(["-1.0"])})]


def struct_column(tmp: Path) -> list:
    return [_table(tmp, "d.parquet", {"new_logp": pa.array([[-1.0]], F32),
                                      "advantages": pa.array([{"a": 1.0}])})]


def null_row(tmp: Path) -> list:
    return [_table(tmp, "d.parquet", {"new_logp": pa.array([[-1.0], [-1.0], [-2.0]], F32),
                                      "old_logp": pa.array([[-1.0], [-1.0], None], F32)})]


def null_element(tmp: Path) -> list:
    return [_table(tmp, "d.parquet", {"new_logp": pa.array([[-1.0], [-1.0, -2.0, -3.0]], F32),
                                      "old_logp": pa.array([[-1.0], [-1.0, None, -3.0]], F32)})]


def null_scalar(tmp: Path) -> list:
    return [_table(tmp, "d.parquet", {"new_logp": pa.array([[-1.0], [-1.0]], F32),
                                      "advantages": pa.array([1.0, None], pa.float32())})]


def mismatched_lengths(tmp: Path) -> list:
    data = seqs()
    data[4].old = data[4].old[:-1]
    return [_write(tmp, "d.parquet", data)]


def advantages_wrong_length(tmp: Path) -> list:
    data = seqs(4)
    adv = [[0.5] * len(s.new) for s in data]
    adv[3] = adv[3] + [0.5]
    return [_table(tmp, "d.parquet", {"new_logp": pa.array([s.new for s in data], F32),
                                      "advantages": pa.array(adv, F32)})]


def schema_differs(tmp: Path) -> list:
    data = seqs()
    _write(tmp, "a.parquet", data)
    for s in data:
        s.old = None
    _write(tmp, "b.parquet", data)
    return [tmp / "a.parquet", tmp / "b.parquet"]


def type_kind_differs(tmp: Path) -> list:
    data = seqs(3)
    _table(tmp, "a.parquet", {"new_logp": pa.array([s.new for s in data], F32),
                              "advantages": pa.array([1.0, 2.0, 3.0], pa.float64())})
    _table(tmp, "b.parquet", {"new_logp": pa.array([s.new for s in data], F32),
                              "advantages": pa.array([[1.0] * len(s.new) for s in data], F32)})
    return [tmp / "a.parquet", tmp / "b.parquet"]


def token_layout_not_contiguous(tmp: Path) -> list:
    return [_table(tmp, "d.parquet", {"new_logp": pa.array([-1.0, -1.0, -1.0], pa.float32()),
                                      "seq_id": pa.array([1, 2, 1], pa.int64())})]


MATRIX: list[tuple[str, Callable[[Path], list], list[str], str]] = [
    ("missing path", missing_path, [], "missing.parquet: no such file or directory"),
    ("directory without parquet", empty_directory, [], "empty: directory contains no .parquet files"),
    ("not parquet", not_parquet, [], "notes.parquet: not a readable Parquet file"),
    ("truncated", truncated, [], "d.parquet: not a readable Parquet file"),
    ("corrupted footer", corrupted_footer, [], "d.parquet: not a readable Parquet file"),
    ("corrupted page", corrupted_page, [], "d.parquet, row 8: cannot decode (could not verify page integrity"),
    ("zero rows", zero_rows, [], "empty.parquet: the input has no rows"),
    ("zero valid tokens", zero_valid_tokens, [], "d.parquet: no valid tokens: loss_mask is 0 on all"),
    ("missing column", missing_required_column, [], "column 'new_logp': required column is missing"),
    ("string column", string_column, [], "column 'old_logp': wrong type string"),
    ("struct column", struct_column, [], "column 'advantages': wrong type struct<a: double>"),
    ("null row", null_row, [], "column 'old_logp', row 2: null list"),
    ("null element", null_element, [], "column 'old_logp', row 1, token 1: null element in list"),
    ("null scalar", null_scalar, [], "column 'advantages', row 1: null value"),
    ("mismatched lengths", mismatched_lengths, [], "column 'old_logp', row 4: has"),
    ("advantages wrong length", advantages_wrong_length, [], "column 'advantages', row 3: has"),
    ("schema differs", schema_differs, [], "b.parquet: schema differs from"),
    ("type kind differs", type_kind_differs, [], "b.parquet, column 'advantages': type list<element: float> differs"),
    ("token layout", token_layout_not_contiguous, [], "seq_id 1 appears again after other sequences"),
    ("unknown --map target", valid_file, ["--map", "bogus=x"], "--map: unknown column 'bogus'"),
]


@pytest.mark.parametrize("name, build, extra, message", MATRIX, ids=[m[0] for m in MATRIX])
def test_input_error_matrix(capsys, tmp_path, name, build, extra, message):
    paths = build(tmp_path)
    code, out, err = run(capsys, "analyze", *paths, *extra)
    assert code == 2 and out == ""
    assert message in one_error_line(err)


def test_map_to_a_missing_column(capsys, tmp_path):
    path = _write(tmp_path, "d.parquet", seqs())
    code, _, err = run(capsys, "analyze", path, "--map", "old_logp=behaviour_logp")
    assert code == 2 and "--map old_logp=behaviour_logp: the file has no column 'behaviour_logp'" in one_error_line(err)


def test_unwritable_output(capsys, tmp_path):
    path = _write(tmp_path, "d.parquet", seqs())
    code, out, err = run(capsys, "analyze", path, "-f", "json", "-o", tmp_path / "no-such-dir" / "r.json")
    assert code == 2 and out == "" and "cannot write" in one_error_line(err)


# Options the CLI validates itself (one line). --on-invalid is a choice: click reports it (usage + one Error line).
BAD_OPTIONS = [
    (["--epsilon", "-0.1"], "--epsilon must be a finite number >= 0"),
    (["--epsilon", "nan"], "--epsilon must be a finite number >= 0"),
    (["--epsilon-high", "-1"], "--epsilon-high"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--c-clip", "1"], "--c-clip (dual clipping) must be a finite number > 1"),
    (["--tau-pos", "0"], "--tau-pos must be a finite number > 0"),
    (["--tau-neg", "-1"], "--tau-neg must be a finite number > 0"),
    (["--beta", "-1"], "--beta must be a finite number >= 0"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--batch-tokens", "0"], "--batch-tokens must be >= 1"),
    (["--max-completion-length", "0"], "--max-completion-length must be >= 1"),
    (["--importance-level", "word"], "--importance-level must be token or sequence"),
    (["--loss", "nope"], "--loss: unknown nope"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS, ids=[o[0][0] + "=" + o[0][1] for o in BAD_OPTIONS])
def test_invalid_option_values(capsys, tmp_path, options, message):
    path = _write(tmp_path, "d.parquet", seqs(3))
    code, out, err = run(capsys, "analyze", path, *options)
    assert code == 2 and out == "" and message in one_error_line(err)


def test_parser_errors_exit_2_without_traceback(capsys, tmp_path):
    path = _write(tmp_path, "d.parquet", seqs(3))
    for options, message in ((["--on-invalid", "ignore"], "Invalid value for '--on-invalid'"),
                             (["--epsilon", "wide"], "Invalid value for '--epsilon'")):
        code, _, err = run(capsys, "analyze", path, *options)
        assert code == 2 and message in err and "Traceback" not in err


# -- value problems: error (default) and skip ----------------------------------------------------------------------
def _nan_old(s: Seq) -> str:
    s.old[first_valid(s)] = float("nan")
    return "old_logp_not_finite"


def _inf_new(s: Seq) -> str:
    s.new[first_valid(s)] = float("inf")
    return "new_logp_not_finite"


def _neg_inf_new(s: Seq) -> str:
    s.new[s.valid()[-1]] = float("-inf")
    return "new_logp_not_finite"


def _positive_old(s: Seq) -> str:
    s.old[first_valid(s)] = 0.75
    return "old_logp_positive"


def _mask_two(s: Seq) -> str:
    s.mask[0] = 2
    return "loss_mask_not_binary"


def _future_version(s: Seq) -> str:
    s.versions[first_valid(s)] = s.current_version + 1
    return "versions_above_current"


VALUE_CASES = [
    (_nan_old, "column 'old_logp', row 5, token {t}: log-prob is nan at a valid token"),
    (_inf_new, "column 'new_logp', row 5, token {t}: log-prob is inf at a valid token"),
    (_neg_inf_new, "column 'new_logp', row 5, token {last}: log-prob is -inf at a valid token"),
    (_positive_old, "column 'old_logp', row 5, token {t}: log-prob 0.75 > 0 at a valid token"),
    (_mask_two, "column 'loss_mask', row 5, token 0: loss_mask value 2 (must be 0 or 1)"),
    (_future_version, "column 'versions', row 5, token {t}: version {v} at a valid token is above the sequence's "
                      "current_version {c}"),
]


@pytest.fixture
def broken(tmp_path, request):
    data = seqs()
    bad = data[5]
    while len(bad.valid()) < 2:  # make sure the broken sequence has valid tokens to break
        bad.mask[0] = 0
        bad.new, bad.old, bad.mask = [*bad.new, -1.0, -1.0], [*bad.old, -1.0, -1.0], [*bad.mask, 1, 1]
        bad.ref, bad.entropy = [*bad.ref, -1.0, -1.0], [*bad.entropy, 0.5, 0.5]
        bad.versions = [*bad.versions, bad.current_version, bad.current_version]
    clean = [s for i, s in enumerate(data) if i != 5]
    reason = request.param(bad)
    fields = {"t": first_valid(bad), "last": bad.valid()[-1], "v": bad.current_version + 1, "c": bad.current_version}
    return _write(tmp_path, "d.parquet", data, row_group_size=4), clean, reason, fields


@pytest.mark.parametrize("broken, message", VALUE_CASES, indirect=["broken"], ids=[c[0].__name__ for c in VALUE_CASES])
def test_invalid_values_error_by_default(capsys, broken, message):
    path, _, _, fields = broken
    code, out, err = run(capsys, "analyze", path, "-f", "json")
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert f"d.parquet, {message.format(**fields)}" in line, line
    assert "--on-invalid skip" in line


@pytest.mark.parametrize("broken", [c[0] for c in VALUE_CASES], indirect=True, ids=[c[0].__name__ for c in VALUE_CASES])
def test_invalid_values_skip(capsys, broken):
    path, clean, reason, _ = broken
    code, out, err = run(capsys, "analyze", path, "-f", "json", "--on-invalid", "skip")
    assert code == 0
    warning = err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("grpo-cli: warning: skipped 1 of 12 sequences")
    assert f"{reason}: 1" in warning[0]
    doc = json.loads(out)
    metrics = doc["metrics"]
    assert doc["config"]["on_invalid"] == "skip"
    assert metrics["invalid/n_sequences_skipped"] == 1 and metrics[f"invalid/{reason}"] == 1
    assert metrics["n_sequences"] == 11
    assert metrics["n_tokens"] + metrics["invalid/n_tokens_skipped"] == sum(len(s.new) for s in seqs())
    for key, value in policy_reference(clean).items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_skip_counts_appear_in_table_and_csv(capsys, tmp_path):
    data = seqs()
    _nan_old(data[2])
    path = _write(tmp_path, "d.parquet", data)
    code, out, err = run(capsys, "analyze", path, "--on-invalid", "skip", "--all")
    assert code == 0 and "invalid/n_sequences_skipped" in out and "invalid/old_logp_not_finite" in out
    assert "skipped 1 of 12" in err
    code, out, _ = run(capsys, "analyze", path, "--on-invalid", "skip", "-f", "csv")
    values = dict(list(csv.reader(io.StringIO(out)))[1:])
    assert values["invalid/n_sequences_skipped"] == "1" and values["invalid/old_logp_not_finite"] == "1"
    # Under the default policy a clean run reports no invalid/* keys at all.
    code, out, _ = run(capsys, "analyze", _write(tmp_path, "ok.parquet", seqs()), "-f", "json")
    assert code == 0 and not [k for k in json.loads(out)["metrics"] if k.startswith("invalid/")]


def test_everything_skipped_is_an_error(capsys, tmp_path):
    data = seqs(3)
    for s in data:
        _nan_old(s)
    path = _write(tmp_path, "d.parquet", data)
    code, _, err = run(capsys, "analyze", path, "--on-invalid", "skip")
    assert code == 2
    assert "every sequence (3) was skipped as invalid (old_logp_not_finite: 3)" in err.strip().splitlines()[-1]


def test_token_layout_error_names_the_token_row(capsys, tmp_path):
    data = seqs()
    _nan_old(data[5])
    path = _write(tmp_path, "t.parquet", data, token_layout=True, row_group_size=7)
    code, _, err = run(capsys, "analyze", path)
    row = sum(len(s.new) for s in data[:5]) + first_valid(data[5])
    assert code == 2 and f"t.parquet, column 'old_logp', row {row}: log-prob is nan" in one_error_line(err)


def test_internal_error_is_one_line_unless_debug(capsys, tmp_path, monkeypatch):
    import grpo_cli.commands.analyze

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(grpo_cli.commands.analyze, "analyze", boom)
    path = _write(tmp_path, "d.parquet", seqs(3))
    code, out, err = run(capsys, "analyze", path)
    assert code == 2 and out == ""
    assert err.strip() == "grpo-cli: internal error: RuntimeError: boom (rerun with --debug for the traceback)"
    for args in (("--debug", "analyze", path), ("analyze", path, "--debug")):  # --debug is honoured anywhere
        code, _, err = run(capsys, *args)
        assert code == 2 and "Traceback (most recent call last)" in err and "RuntimeError: boom" in err
    code, _, err = run(capsys, "analyze", path)  # and does not stick to the next in-process call
    assert "Traceback" not in err


# An internal error (a bug) inside the entry point `python -m grpo_cli` runs, without and with --debug (one
# interpreter for both, to spare a torch import: each run ends in the SystemExit that would end the process).
_INJECT = (
    "import runpy, sys, grpo_cli.commands.analyze as a\n"
    "a.analyze = lambda *x, **k: 1 / 0\n"
    "path = sys.argv[1]\n"
    "for extra in ([], ['--debug']):\n"
    "    sys.argv = ['grpo-cli', *extra, 'analyze', path]\n"
    "    try:\n"
    "        runpy.run_module('grpo_cli', run_name='__main__')\n"
    "    except SystemExit as exc:\n"
    "        print(exc.code)\n"
    "    print('=====', file=sys.stderr)\n"
)


@pytest.fixture(scope="module", autouse=True)
def entry_point_runs(request, tmp_path_factory):
    """The two interpreters of test_python_m_entry_point_never_shows_a_traceback, started when this module starts
    so that they run (torch imports included) on the second core while the in-process tests run on the first:
    ``(missing path, [missing-file run, internal-error run])``, or None when that test is not selected."""
    name = "test_python_m_entry_point_never_shows_a_traceback"
    if not any(item.name == name and getattr(item, "module", None) is request.module for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("entry_point")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def python(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    missing = str(tmp / "missing.parquet")
    procs = [python("-m", "grpo_cli", "analyze", missing),
             python("-c", _INJECT, str(_write(tmp, "d.parquet", seqs(3))))]
    yield missing, procs
    for proc in procs:
        if proc.poll() is None:  # its test did not run to the end
            proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_python_m_entry_point_never_shows_a_traceback(entry_point_runs):
    """The only subprocess test: the real interpreter exit path of ``python -m grpo_cli``."""
    missing, (missing_run, injected_run) = entry_point_runs
    stdout, stderr = missing_run.communicate(timeout=120)
    assert missing_run.returncode == 2 and stdout == ""
    assert stderr.strip() == f"grpo-cli: error: {missing}: no such file or directory"
    stdout, stderr = injected_run.communicate(timeout=120)
    assert injected_run.returncode == 0 and stdout.split() == ["2", "2"]
    plain, debug, _ = stderr.split("=====\n")
    assert plain.strip() == ("grpo-cli: internal error: ZeroDivisionError: division by zero "
                             "(rerun with --debug for the traceback)")
    assert "Traceback (most recent call last)" in debug and "ZeroDivisionError: division by zero" in debug


def test_random_corruption_is_read_or_refused_never_a_crash(capsys, tmp_path):
    """Damaged bytes anywhere: either the file still decodes (to values the validator then checks) or one error line
    names it; never an internal error. (Without page checksums a flipped value byte can go unnoticed.)"""
    import random

    source = _write(tmp_path, "src.parquet", seqs(), row_group_size=3).read_bytes()
    rng = random.Random(7)
    outcomes = set()
    for trial in range(24):
        data = bytearray(source)
        start = rng.randrange(4, len(data) - 16)
        for k in range(rng.choice((1, 8))):
            data[start + k] ^= rng.randrange(1, 256)
        path = tmp_path / f"c{trial}.parquet"
        path.write_bytes(bytes(data))
        code, _, err = run(capsys, "analyze", path, "-f", "json", "-o", tmp_path / "r.json")
        assert code in (0, 2), err
        if code == 2:
            assert f"c{trial}.parquet" in one_error_line(err)
        outcomes.add(code)
    assert outcomes == {0, 2}  # both happen: the test exercises the refusal path


def test_float32_and_float64_files_may_mix(capsys, tmp_path):
    data = seqs()
    _write(tmp_path, "a.parquet", data[:6])
    table = pq.read_table(_write(tmp_path, "src.parquet", data[6:]))
    wide = table.cast(pa.schema([pa.field(f.name, pa.list_(pa.float64())) if f.type == F32 else f
                                 for f in table.schema]))
    pq.write_table(wide, tmp_path / "b.parquet")
    os.remove(tmp_path / "src.parquet")
    code, out, err = run(capsys, "analyze", tmp_path, "-f", "json")
    assert code == 0 and err == ""
    metrics = json.loads(out)["metrics"]
    assert metrics["n_sequences"] == 12
    assert metrics["kl/k3"] == pytest.approx(policy_reference(data)["kl/k3"], rel=1e-5)


def _truncated_dump(tmp_path: Path) -> tuple[Path, Path]:
    """A directory of two files, the second cut in half (its footer gone); and a copy of the first alone."""
    dump, alone = tmp_path / "dump", tmp_path / "alone"
    dump.mkdir()
    alone.mkdir()
    first = random_sequences(12, seed=7, max_len=12, with_prox=True)  # prox_logp: compare-prox reads it too
    write_sequences(str(dump / "a.parquet"), first)
    write_sequences(str(alone / "a.parquet"), first)
    write_sequences(str(dump / "b.parquet"), random_sequences(8, seed=8, max_len=12, with_prox=True))
    data = (dump / "b.parquet").read_bytes()
    (dump / "b.parquet").write_bytes(data[: len(data) // 2])
    return dump, alone


def test_truncated_file_is_an_input_error_naming_it(capsys, tmp_path):
    dump, _ = _truncated_dump(tmp_path)
    code, out, err = run(capsys, "analyze", dump, "-f", "json")
    assert code == 2 and not out
    assert "b.parquet" in one_error_line(err) and "not a readable Parquet file" in err


@pytest.mark.parametrize("command", [("analyze",), ("compare-prox",)])
def test_truncated_file_is_skipped_with_a_count_under_on_invalid_skip(capsys, tmp_path, command):
    dump, alone = _truncated_dump(tmp_path)
    code, out, err = run(capsys, *command, dump, "-f", "json", "--on-invalid", "skip")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "not readable Parquet" in line]
    assert len(warnings) == 1 and "Traceback" not in err
    assert warnings[0].startswith("grpo-cli: warning: skipped 1 of 2 files as not readable Parquet")
    assert "b.parquet" in warnings[0] and "a.parquet" not in warnings[0]
    # The figures are those of the readable file alone.
    code, expected, _ = run(capsys, *command, alone, "-f", "json", "--on-invalid", "skip")
    assert code == 0
    assert json.loads(out)["metrics"] == json.loads(expected)["metrics"]


def test_only_truncated_files_stay_an_input_error_under_skip(capsys, tmp_path):
    dump, _ = _truncated_dump(tmp_path)
    (dump / "a.parquet").unlink()
    code, out, err = run(capsys, "analyze", dump, "--on-invalid", "skip")
    assert code == 2 and not out and "b.parquet" in one_error_line(err)


def test_check_stays_strict_on_a_truncated_file_unless_skip_is_asked(capsys, tmp_path):
    # check's own default reads invalid rows as skip plus a failing rule; an unreadable file stays exit 2.
    dump, _ = _truncated_dump(tmp_path)
    code, _, err = run(capsys, "check", dump)
    assert code == 2 and "b.parquet" in one_error_line(err)
    # the random dump's findings (mismatch, flipped advantages) are beside the point here
    code, _, err = run(capsys, "check", dump, "--on-invalid", "skip", "--ignore", "GRP")
    assert code == 0 and "skipped 1 of 2 files as not readable Parquet" in err

"""Snapshot every command's output on fixed inputs, and diff two snapshots: the check for refactoring commits.

    python bench/snapshot.py write /tmp/before            # before moving code
    python bench/snapshot.py write /tmp/after             # after
    python bench/snapshot.py diff /tmp/before /tmp/after  # exit 1 and a unified diff when any output changed

Inputs: the bundled sample, a 2 M-token synthetic dump (``bench/run.py``'s writer: about a thousand steps
interleaved), a 1 M-token one with its steps in runs (``--seqs-per-step``), and dumps written by the test helpers
(a response-only dump, a dump with invalid rows for ``--on-invalid skip``).
Each command runs in-process through ``grpo_cli.cli.main`` (stdout, stderr and the exit code are recorded; files
it writes are recorded too). Tables are rendered at the non-terminal width, so the bytes are stable.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = str(ROOT / "sample_data" / "rollouts.parquet")
RULES = str(ROOT / "sample_data" / "rules.toml")


def _inputs(work: Path) -> dict[str, str]:
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from run import STEP_RULES, write_dump  # type: ignore[import-not-found]  # bench/run.py, a script beside this one

    from grpo_cli.io import RolloutWriter

    bench = work / "bench.parquet"
    write_dump(bench, 2_000_000, row_group_tokens=500_000)
    runs = work / "runs.parquet"  # steps in runs, as a trainer writes them
    write_dump(runs, 1_000_000, row_group_tokens=250_000, seqs_per_step=5)
    step_rules = work / "step_rules.toml"
    step_rules.write_text(STEP_RULES, encoding="utf-8")

    rng = np.random.default_rng(7)
    response_only = work / "response_only"
    writer = RolloutWriter(response_only)
    for step in range(3):
        lengths = rng.integers(1, 40, size=24)
        new = [torch.tensor(-rng.exponential(0.7, n), dtype=torch.float32) for n in lengths]
        old = [x + torch.tensor(rng.normal(0, 0.05, x.numel()), dtype=torch.float32).clamp(max=0) for x in new]
        old = [torch.minimum(o, torch.zeros_like(o)) for o in old]
        writer.add(step=step, new_logp=new, old_logp=old, loss_mask=[torch.ones(n, dtype=torch.bool) for n in lengths],
                   advantages=torch.tensor(rng.normal(size=24), dtype=torch.float32),
                   rewards=torch.tensor(rng.integers(0, 2, size=24), dtype=torch.float32),
                   group_id=torch.arange(24) // 4 + 6 * step)
    writer.close()

    invalid = work / "invalid"
    writer = RolloutWriter(invalid)
    new = [torch.tensor([-0.5, -1.0, -0.2]), torch.tensor([-0.1, float("nan"), -0.3]), torch.tensor([-0.4, 0.5])]
    writer.add(step=0, new_logp=new, old_logp=[x - 0.01 for x in new],
               loss_mask=[torch.ones(len(x), dtype=torch.bool) for x in new], advantages=torch.tensor([1.0, -1.0, 0.5]))
    writer.close()
    return {"sample": SAMPLE, "bench": str(bench), "runs": str(runs), "step_rules": str(step_rules),
            "response_only": str(response_only), "invalid": str(invalid)}


def _commands(inputs: dict[str, str], out: Path) -> dict[str, list[str]]:
    s, b, r, v = inputs["sample"], inputs["bench"], inputs["response_only"], inputs["invalid"]
    cmds: dict[str, list[str]] = {
        "analyze_sample_table": ["analyze", s],
        "analyze_sample_json": ["analyze", s, "-f", "json"],
        "analyze_sample_csv": ["analyze", s, "-f", "csv"],
        "analyze_sample_step_table": ["analyze", s, "--group-by", "step"],
        "analyze_sample_step_json": ["analyze", s, "--group-by", "step", "-f", "json"],
        "analyze_sample_step_csv": ["analyze", s, "--group-by", "step", "-f", "csv"],
        "analyze_sample_options_json": ["analyze", s, "-f", "json", "--kl-clamp", "10", "--c-clip", "3",
                                        "--rs-upper", "5", "--m2-threshold", "0.01", "--temperature", "0.9",
                                        "--epsilon-high", "0.28", "--max-new-tokens", "8"],
        "analyze_sample_seqlevel_json": ["analyze", s, "-f", "json", "--importance-level", "sequence",
                                         "--rs-level", "sequence", "--rs-metric", "kl_k3", "--rs-upper", "0.05"],
        "analyze_sample_loss_json": ["analyze", s, "-f", "json", "--loss", "grpo,ppo", "--beta", "0.04"],
        "analyze_bench_json": ["analyze", b, "-f", "json", "--workers", "2"],
        "analyze_bench_step_json": ["analyze", b, "-f", "json", "--group-by", "step", "--workers", "1"],
        "analyze_runs_step_json": ["analyze", inputs["runs"], "-f", "json", "--group-by", "step", "--workers", "2"],
        "check_bench_step_json": ["check", b, "--rules", inputs["step_rules"], "-f", "json"],
        "analyze_response_only_json": ["analyze", r, "-f", "json", "--group-by", "group_id"],
        "analyze_invalid_skip_json": ["analyze", v, "-f", "json", "--on-invalid", "skip"],
        "analyze_invalid_error": ["analyze", v],
        "compare_prox_sample_table": ["compare-prox", s],
        "compare_prox_sample_json": ["compare-prox", s, "-f", "json"],
        "compare_prox_sample_csv": ["compare-prox", s, "-f", "csv", "--rs-upper", "5", "--c-clip", "3"],
        "compare_prox_bench_json": ["compare-prox", b, "-f", "json", "--current-version", "10"],
        "check_sample_table": ["check", s, "--rules", RULES, "--rules-preset", "sanity"],
        "check_sample_json": ["check", s, "--rules", RULES, "--rules-preset", "sanity", "-f", "json",
                              "--junit-xml", str(out / "junit.xml")],
        "check_sample_github": ["check", s, "--rules", RULES, "-f", "github"],
        "check_invalid_json": ["check", v, "--rules-preset", "sanity", "-f", "json"],
        "advantages_sample_table": ["advantages", s, "--estimator", "grpo", "--std-eps", "1e-4"],
        "advantages_sample_json": ["advantages", s, "--estimator", "grpo", "-f", "json"],
        "advantages_sample_gae_json": ["advantages", s, "--estimator", "gae", "-f", "json"],
        "report_sample": ["report", s, "-o", str(out / "report.html"), "-q"],
        "schema_table": ["schema"],
        "schema_verl_json": ["schema", "--preset", "verl", "-f", "json"],
    }
    for names in ("areal", "verl", "trl", "twinkle"):
        cmds[f"analyze_sample_{names}_json"] = ["analyze", s, "-f", "json", "--names", names, "--group-by", "step"]
        cmds[f"analyze_sample_{names}_table"] = ["analyze", s, "--names", names]
    return cmds


def write(directory: Path) -> None:
    from grpo_cli.cli import main

    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = _inputs(Path(tmp))
        files = Path(tmp) / "files"
        for name, args in _commands(inputs, files).items():
            files.mkdir(exist_ok=True)
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = main(args)
            text = stdout.getvalue().replace(tmp, "<tmp>")
            (directory / f"{name}.out").write_text(f"exit {code}\n{text}", encoding="utf-8")
            (directory / f"{name}.err").write_text(stderr.getvalue().replace(tmp, "<tmp>"), encoding="utf-8")
            for produced in sorted(files.iterdir()):
                content = produced.read_text(encoding="utf-8").replace(tmp, "<tmp>")
                content = re.sub(r'time="[0-9.]+"', 'time="<elapsed>"', content)  # JUnit's wall time
                (directory / f"{name}.{produced.name}").write_text(content, encoding="utf-8")
            shutil.rmtree(files)
            print(f"{name}: exit {code}", file=sys.stderr)


def diff(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    changed = 0
    for name in names:
        a = (before / name).read_text(encoding="utf-8").splitlines() if (before / name).exists() else []
        b = (after / name).read_text(encoding="utf-8").splitlines() if (after / name).exists() else []
        if a != b:
            changed += 1
            lines = list(difflib.unified_diff(a, b, name, name, lineterm=""))
            sys.stdout.writelines(line + "\n" for line in lines[:60])
    print(f"{changed} of {len(names)} outputs differ", file=sys.stderr)
    return 1 if changed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("write").add_argument("directory", type=Path)
    d = sub.add_parser("diff")
    d.add_argument("before", type=Path)
    d.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.action == "write":
        write(args.directory)
        return 0
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())

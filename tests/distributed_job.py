"""Run under ``torchrun`` by ``tests/test_distributed.py``: several grpo-cli commands in one launch.

Usage: ``torchrun ... tests/distributed_job.py OUT_DIR COMMANDS_JSON``. Each rank writes ``OUT_DIR/rank<R>.json``:
for every command its exit code, stdout and stderr (the CLI silences ranks other than 0 itself).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

from grpo_cli.cli import main


def run() -> None:
    out_dir, commands = sys.argv[1], json.loads(sys.argv[2])
    results = []
    for args in commands:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
        results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    run()

"""``python -m grpo_cli.findings.catalog > docs/findings.md``: print the findings page generated from the
declarations."""

from __future__ import annotations

import sys
from pathlib import Path

from grpo_cli.findings.catalog import POWER_TABLE, render_docs

if __name__ == "__main__":
    sys.stdout.reconfigure(encoding="utf-8")  # type: ignore[union-attr]  # a redirected stdout may default to ASCII
    power = Path(POWER_TABLE)  # run from the repository root, as the page's regeneration command is
    sys.stdout.write(render_docs(power.read_text(encoding="utf-8") if power.is_file() else None))

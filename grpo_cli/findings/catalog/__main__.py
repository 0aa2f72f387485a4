"""``python -m grpo_cli.findings.catalog > docs/findings.md``: print the findings page generated from the
declarations."""

from __future__ import annotations

import sys

from grpo_cli.findings.catalog import render_docs

if __name__ == "__main__":
    sys.stdout.reconfigure(encoding="utf-8")  # type: ignore[union-attr]  # a redirected stdout may default to ASCII
    sys.stdout.write(render_docs())

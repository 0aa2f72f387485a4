"""``python -m grpo_cli`` (also what ``torchrun -m grpo_cli`` runs)."""

from __future__ import annotations

from grpo_cli.cli import run

if __name__ == "__main__":
    run()

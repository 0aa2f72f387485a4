"""Run under ``torchrun`` by ``tests/test_diagnoser.py``: a corpus dump replayed into a ``Diagnoser`` on two ranks.

Usage: ``torchrun ... tests/diagnoser_job.py OUT_DIR FILES_JSON``. Each part file is a step; rank r feeds the
step's reader batches r, r + world, … (the first step's all on rank 0), and every rank calls ``step_end``. Each
rank writes ``OUT_DIR/rank<R>.json``: what each ``step_end`` returned and the final findings.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from grpo_cli import Diagnoser
from grpo_cli.commands.diagnoser import diagnoser_groups
from grpo_cli.io import RolloutDataset

COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "versions", "advantages", "rewards",
           "group_id", "current_version", "eos", "seq_id", "step")


def run() -> None:
    out_dir, files = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    diagnoser = Diagnoser()
    wanted = {"loss_mask"}.union(*(g.columns() for g in diagnoser_groups()))
    per_step = []
    for i, path in enumerate(files):
        batches = list(RolloutDataset([path]).iter_batches(columns=wanted, raw_mask=True, batch_tokens=200))
        # the first step all on rank 0 (the others bring empty states), then every rank a share
        share = (batches if rank == 0 else []) if i == 0 else batches[rank::world]
        for batch in share:
            given = {name: getattr(batch, name) for name in COLUMNS if getattr(batch, name) is not None}
            diagnoser.update(loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens, **given)
        per_step.append([(f["code"], f["severity"]) for f in diagnoser.step_end(int(batches[0].step[0]))])
    result = {"per_step": per_step, "findings": diagnoser.findings()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    run()

"""``--names trl`` follows TRL's per-micro-batch averaging when the dump has a ``micro_batch`` column.

TRL 1.16 (``trl/trainer/grpo_trainer.py``): ``GRPOTrainer._compute_loss`` appends, once per micro-batch, the masked
token mean of the micro-batch (local ``global_masked_mean``: Σ / ``count.clamp(min=1)``, so a fully masked
micro-batch logs 0), and ``GRPOTrainer.log`` logs the plain mean of the appended values. A small hand-built dump
(no TRL needed) is analysed through the CLI and compared with numbers derived by hand below.

Ratios r = exp(new − prox), ε = 0.2, k3 = e^y − y − 1 with y = ref − new, TRL's kl = k3 · r:

    step 1  mb 0: A (A < 0) r = [0.5, 1, 1]  → 1 low of 3 tokens;  B (A > 0) r = [1.5], y = ln 2 → 1 high
            mb 1: C (A > 0) r = [1.5, 1]     → 1 high of 2 tokens
    step 2  mb 2: D (A > 0) r = [1.5, 1.5]   → 2 high of 2 tokens
            mb 3: E (A > 0) r = [1.5, 1.5], loss_mask 0 everywhere: the fully masked micro-batch

Token entropies, one value per sequence: A 1, B 4, C 2, D 3, E 5 (TRL's ``entropy``, averaged the same way).
"""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from grpo_cli.cli import main
from grpo_cli.io.writer import RolloutWriter

PROX = -2.0
K3_B = (2.0 - math.log(2.0) - 1.0) * 1.5  # seq B's one token: k3(ln 2) · r
ENTROPY = [1.0, 4.0, 2.0, 3.0, 5.0]  # per sequence A..E, the same on each of its tokens


def _tokens(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    prox = torch.full((len(ratios),), PROX, dtype=torch.float64)
    return prox + torch.log(torch.tensor(ratios, dtype=torch.float64)), prox


def write_dump(directory: Path, *, with_micro_batch: bool) -> None:
    # (step, micro_batch, [(ratios, advantage, y per token, loss_mask per token)])
    layout = [
        (1, 0, [([0.5, 1.0, 1.0], -1.0, [0.0, 0.0, 0.0], [1, 1, 1]), ([1.5], 1.0, [math.log(2.0)], [1])]),
        (1, 1, [([1.5, 1.0], 1.0, [0.0, 0.0], [1, 1])]),
        (2, 2, [([1.5, 1.5], 1.0, [0.0, 0.0], [1, 1])]),
        (2, 3, [([1.5, 1.5], 1.0, [0.0, 0.0], [0, 0])]),
    ]
    seq = 0
    with RolloutWriter(str(directory), metadata={"framework": "trl"}) as writer:
        for step, micro_batch, sequences in layout:
            new, prox, ref, mask, adv, ent = [], [], [], [], [], []
            for i, (ratios, advantage, y, loss_mask) in enumerate(sequences):
                ent.append(torch.full((len(ratios),), ENTROPY[seq + i]))
                n, p = _tokens(ratios)
                new.append(n.float())
                prox.append(p.float())
                ref.append((n + torch.tensor(y, dtype=torch.float64)).float())
                mask.append(torch.tensor(loss_mask, dtype=torch.bool))
                adv.append(advantage)
            ids = list(range(seq, seq + len(sequences)))
            seq += len(sequences)
            writer.add(step=step, new_logp=new, old_logp=prox, prox_logp=prox, ref_logp=ref, loss_mask=mask,
                       entropy=ent, advantages=torch.tensor(adv), rewards=torch.tensor(adv), seq_id=ids, group_id=ids,
                       micro_batch=micro_batch if with_micro_batch else None, window="response")


def analyze(directory: Path, *extra: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["analyze", str(directory), "--names", "trl", "--format", "json", *extra])
    assert code == 0
    return json.loads(out.getvalue())


def by_step(result: dict) -> dict[int, dict]:
    return {int(group["key"]): group["metrics"] for group in result["groups"]}


# TRL's per-step values, by hand: mean over the step's micro-batches of each micro-batch's token mean
PER_MICRO_BATCH = {
    1: {"clip_ratio/low_mean": (1 / 4 + 0 / 2) / 2, "clip_ratio/high_mean": (1 / 4 + 1 / 2) / 2,
        "clip_ratio/region_mean": (2 / 4 + 1 / 2) / 2, "kl": (K3_B / 4 + 0.0) / 2,
        "clip_ratio/low_min": (0.0 + 0.0) / 2,  # mb 0: min(1/3, 0); mb 1: 0
        "clip_ratio/high_max": (1.0 + 0.5) / 2,  # mb 0: max(0, 1); mb 1: 1/2
        "entropy": ((3 * 1.0 + 4.0) / 4 + 2.0) / 2},
    # mb 3 has no valid token: TRL logs 0 for it, which halves the step's value; its nanmin/nanmax is NaN (dropped)
    2: {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": (1.0 + 0.0) / 2, "clip_ratio/region_mean": 0.5,
        "kl": 0.0, "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 1.0, "entropy": (3.0 + 0.0) / 2},
}
# Without the column: the step's valid tokens pooled
POOLED = {
    1: {"clip_ratio/low_mean": 1 / 6, "clip_ratio/high_mean": 2 / 6, "clip_ratio/region_mean": 3 / 6,
        "kl": K3_B / 6, "entropy": (3 * 1.0 + 4.0 + 2 * 2.0) / 6},
    2: {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 1.0, "clip_ratio/region_mean": 1.0, "kl": 0.0,
        "entropy": 3.0},
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trl_mb")
    write_dump(root / "mb", with_micro_batch=True)
    write_dump(root / "plain", with_micro_batch=False)
    return {"mb": root / "mb", "plain": root / "plain"}


def test_per_step_follows_trl_micro_batch_averaging(dumps: dict[str, Path]):
    steps = by_step(analyze(dumps["mb"], "--group-by", "step"))
    for step, expected in PER_MICRO_BATCH.items():
        for key, value in expected.items():
            assert steps[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


def test_fully_masked_micro_batch_halves_the_value(dumps: dict[str, Path]):
    with_column = by_step(analyze(dumps["mb"], "--group-by", "step"))[2]["clip_ratio/high_mean"]
    without = by_step(analyze(dumps["plain"], "--group-by", "step"))[2]["clip_ratio/high_mean"]
    assert with_column == pytest.approx(without / 2, rel=1e-6)


def test_whole_dump_is_the_mean_over_all_micro_batches(dumps: dict[str, Path]):
    metrics = analyze(dumps["mb"])["metrics"]
    assert metrics["clip_ratio/high_mean"] == pytest.approx((1 / 4 + 1 / 2 + 1.0 + 0.0) / 4, rel=1e-6)
    assert metrics["clip_ratio/low_mean"] == pytest.approx((1 / 4 + 0 + 0 + 0) / 4, rel=1e-6)
    assert metrics["kl"] == pytest.approx(K3_B / 4 / 4, rel=1e-6)
    assert metrics["entropy"] == pytest.approx((7 / 4 + 2.0 + 3.0 + 0.0) / 4, rel=1e-6)
    # grpo-cli's own pooled entropy/mean keeps its key under --names trl: (3 + 4 + 4 + 6) / 8 valid tokens
    assert metrics["entropy/mean"] == pytest.approx(17 / 8, rel=1e-6)


def test_without_micro_batch_the_step_is_pooled(dumps: dict[str, Path]):
    steps = by_step(analyze(dumps["plain"], "--group-by", "step"))
    for step, expected in POOLED.items():
        for key, value in expected.items():
            assert steps[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)

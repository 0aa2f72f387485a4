"""`analyze`'s loss/* figures: streaming the dump equals one in-memory call of the loss objects (1e-9 relative)."""

from __future__ import annotations

import json

import pytest
import torch
from reference import random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.core.loss_objects import BNPOLoss, CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss, SAPOLoss
from grpo_cli.core.ppo import ppo_actor_loss, ppo_actor_loss_terms
from grpo_cli.core.rejection import RejectionSamplingConfig


def _padded(seqs, attr, fill=0.0):
    width = max(len(s.new) for s in seqs)
    out = torch.full((len(seqs), width), fill, dtype=torch.float32)  # the dump's dtype
    for i, s in enumerate(seqs):
        out[i, : len(s.new)] = torch.tensor(getattr(s, attr), dtype=torch.float32)
    return out


def _labels(seqs):
    width = max(len(s.new) for s in seqs)
    labels = torch.full((len(seqs), width), -100)
    for i, s in enumerate(seqs):
        for t in s.valid():
            labels[i, t] = 1
    return labels


def _analyze(capsys, path, *args):
    code = main(["analyze", str(path), "-f", "json", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["metrics"]


@pytest.fixture
def dump(tmp_path):
    seqs = random_sequences(48, seed=31, with_prox=True)
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=5)
    return path, seqs


@pytest.mark.parametrize("batch_tokens", [7, 1 << 20])
def test_grpo_family_losses_equal_one_in_memory_call(capsys, dump, batch_tokens):
    path, seqs = dump
    metrics = _analyze(capsys, path, "--batch-tokens", batch_tokens, "--beta", 0.05, "--tau-neg", 1.05,
                       "--epsilon-high", 0.28, "--max-completion-length", 64)
    labels = _labels(seqs)
    inputs, outputs = {"labels": labels}, {"logps": _padded(seqs, "new")}
    kwargs = {"old_logps": _padded(seqs, "prox"), "ref_logps": _padded(seqs, "ref"),
              "advantages": torch.tensor([s.advantage for s in seqs], dtype=torch.float32)}
    common = {"clip_range": 0.2, "clip_range_high": 0.28, "beta": 0.05}
    objects = {
        "grpo": GRPOLoss(**common), "gspo": GSPOLoss(**common), "bnpo": BNPOLoss(**common),
        "cispo": CISPOLoss(**common), "sapo": SAPOLoss(**common, tau_pos=1.0, tau_neg=1.05),
        "dr_grpo": DRGRPOLoss(**common, max_completion_length=64),
    }
    for name, loss_fn in objects.items():
        # The terms are the call's float64 numerator and denominator (the scalar itself is rounded to float32).
        num, den = loss_fn.terms(inputs, outputs, **kwargs)
        assert float(loss_fn(inputs, outputs, **kwargs)) == pytest.approx(float(num / den), rel=1e-6)
        want = float(num / den)
        assert metrics[f"loss/{name}"] == pytest.approx(want, rel=1e-9), name


@pytest.mark.parametrize("extra", [[], ["--c-clip", "2.0"], ["--rs-upper", "1.1"], ["--importance-level", "sequence"]])
def test_ppo_loss_equals_one_in_memory_call(capsys, dump, extra):
    path, seqs = dump
    metrics = _analyze(capsys, path, "--batch-tokens", 11, "--loss", "ppo", *extra)
    assert set(k for k in metrics if k.startswith("loss/")) == {"loss/ppo"}
    mask = _labels(seqs) != -100
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)[:, None].expand_as(mask)
    options = dict(zip(extra[::2], extra[1::2]))
    rs = RejectionSamplingConfig(upper=float(options["--rs-upper"])) if "--rs-upper" in options else None
    c_clip = float(options["--c-clip"]) if "--c-clip" in options else None
    level = options.get("--importance-level", "token")
    args = (_padded(seqs, "new"), _padded(seqs, "prox"), _padded(seqs, "old"), adv, 0.2, mask)
    kwargs = {"c_clip": c_clip, "rejection_sampling": rs, "importance_sampling_level": level}
    loss, _ = ppo_actor_loss(*args, **kwargs)
    num, den, stats = ppo_actor_loss_terms(*args, **kwargs)
    assert float(loss) == pytest.approx(float(num / den), rel=1e-6)
    assert metrics["loss/ppo"] == pytest.approx(float(num / den), rel=1e-9)
    if c_clip is not None:
        assert metrics["clip/dual"] == pytest.approx(float(stats["dual_clip_mask"].sum()) / float(mask.sum()))


def test_losses_omitted_without_advantages(capsys, tmp_path):
    seqs = random_sequences(6, seed=2)
    for s in seqs:
        s.advantage = None
    path = tmp_path / "n.parquet"
    write_sequences(str(path), seqs)
    code = main(["analyze", str(path), "-f", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and "loss/grpo" not in doc["metrics"]
    assert "advantages" in doc["omitted"]["loss/ppo"]

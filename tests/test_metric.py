"""GRPOMetric / GSPOMetric / CISPOMetric: the seed's API, its input forms, exact accumulation."""

from __future__ import annotations

import math

import pytest
import torch
from reference import policy_reference, random_sequences

from grpo_cli.core.metric import CISPOMetric, GRPOMetric, GSPOMetric


def _padded(seqs, device="cpu"):
    width = max(len(s.new) for s in seqs)
    labels = torch.full((len(seqs), width), -100)
    logps = torch.zeros(len(seqs), width)
    old = torch.zeros(len(seqs), width)
    ent = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        for t in s.valid():
            labels[i, t] = 1
        n = len(s.new)
        logps[i, :n] = torch.tensor(s.new)
        old[i, :n] = torch.tensor(s.old)
        ent[i, :n] = torch.tensor(s.entropy)
    adv = torch.tensor([s.advantage for s in seqs])
    return labels.to(device), logps.to(device), old.to(device), ent.to(device), adv.to(device)


def test_seed_keys_match_reference(device):
    seqs = random_sequences(40, seed=11)
    labels, logps, old, ent, adv = _padded(seqs, device)
    metric = GRPOMetric(epsilon=0.2, epsilon_high=0.28)
    metric.accumulate({"labels": labels}, {"logps": logps, "entropies": ent}, old_logps=old, advantages=adv)
    out = metric.calculate()
    ref = policy_reference(seqs, eps=0.2, eps_high=0.28)
    pairs = {"train/mean_new_logp": "logp/new_mean", "train/mean_old_logp": "logp/old_mean",
             "train/logp_diff_mean": "logp/diff_mean", "train/approx_kl": "kl/k3",
             "train/token_kl_max": "kl/k3_token_max", "train/token_ratio_max": "ratio/max",
             "train/entropy": "entropy/mean", "train/clip_ratio": "clip/ratio",
             "train/clip_ratio_low": "clip/low", "train/clip_ratio_high": "clip/high",
             "train/policy_confidence": "policy_confidence"}
    for key, ref_key in pairs.items():
        assert out[key] == pytest.approx(ref[ref_key], rel=1e-5, abs=1e-7), key
    assert metric.calculate() == {}  # calculate() resets


def test_variants_use_their_clip_definition():
    seqs = random_sequences(40, seed=12)
    labels, logps, old, _, adv = _padded(seqs)
    ref = policy_reference(seqs)
    for cls, key in ((GSPOMetric, "clip/seq_"), (CISPOMetric, "clip/cispo_")):
        m = cls()
        m.accumulate({"labels": labels}, {"logps": logps}, old_logps=old, advantages=adv)
        out = m.calculate()
        assert out["train/clip_ratio_low"] == pytest.approx(ref[key + "low"])
        assert out["train/clip_ratio_high"] == pytest.approx(ref[key + "high"])


def test_many_accumulate_calls_equal_one():
    seqs = random_sequences(30, seed=13)
    labels, logps, old, ent, adv = _padded(seqs)
    one = GRPOMetric(top_k_kl=3)
    one.accumulate({"labels": labels}, {"logps": logps, "entropies": ent}, old_logps=old, advantages=adv)
    many = GRPOMetric(top_k_kl=3)
    for i in range(0, 30, 7):
        sl = slice(i, i + 7)
        many.accumulate({"labels": labels[sl]}, {"logps": logps[sl], "entropies": ent[sl]},
                        old_logps=old[sl], advantages=adv[sl])
    a, b = one.calculate(), many.calculate()
    assert a.keys() == b.keys()
    for key in a:
        if key == "train/top_kl":
            assert a[key] == b[key]
        else:
            assert b[key] == pytest.approx(a[key], rel=1e-12)


def test_list_inputs_scatter_onto_scored_positions():
    # Row 0 scores positions 1 and 2; row 1 scores position 0 only.
    labels = torch.tensor([[-100, 3, 4], [7, -100, -100]])
    logps = torch.tensor([[0.0, math.log(1.5), math.log(0.5)], [0.0, 0.0, 0.0]])
    metric = GRPOMetric()
    metric.accumulate({"labels": labels}, {"logps": logps}, old_logps=[[0.0, 0.0], [0.0]], advantages=[2.0, -1.0])
    out = metric.calculate()
    # Scored ratios: 1.5 (A=2, high), 0.5 (A=2, not low), 1.0 → clip_ratio = 1/3.
    assert out["train/clip_ratio"] == pytest.approx(1 / 3)
    assert out["train/mean_old_logp"] == 0.0
    assert out["train/mean_new_logp"] == pytest.approx(math.log(0.75) / 3, rel=1e-6)


@pytest.mark.parametrize("adv", [torch.tensor([1.0, -1.0]), torch.tensor([[1.0], [-1.0]]),
                                 torch.tensor([[1.0, 1.0], [-1.0, -1.0]])])
def test_advantage_tensor_shapes_are_honoured(adv):
    labels = torch.tensor([[1, 1], [1, 1]])
    logps = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 0.0]])
    metric = GRPOMetric()
    metric.accumulate({"labels": labels}, {"logps": logps}, old_logps=torch.zeros(2, 2), advantages=adv)
    out = metric.calculate()
    assert out["train/clip_ratio_high"] == pytest.approx(0.25)
    assert out["train/clip_ratio_low"] == pytest.approx(0.25)


def test_temperature_rescales_both_logps():
    labels = torch.tensor([[1]])
    metric = GRPOMetric(temperature=2.0)
    metric.accumulate({"labels": labels}, {"logps": torch.tensor([[-0.5]])}, old_logps=torch.tensor([[-1.0]]))
    out = metric.calculate()
    d = 2.0 * (-0.5) - 2.0 * (-1.0)  # = 1.0
    assert out["train/logp_diff_mean"] == pytest.approx(d)
    assert out["train/approx_kl"] == pytest.approx(math.exp(d) - 1 - d, rel=1e-6)
    assert out["train/mean_new_logp"] == pytest.approx(-1.0)


def test_bad_arguments():
    with pytest.raises(TypeError):
        GRPOMetric(bogus=1)
    with pytest.raises(ValueError):
        GRPOMetric(epsilon=-0.1)
    metric = GRPOMetric()
    with pytest.raises(ValueError, match="old_logps"):
        metric.accumulate({"labels": torch.ones(1, 3)}, {"logps": torch.zeros(1, 3)}, old_logps=[[0.0, 0.0]])

"""AReaL's joint distillation: the core loss (values, gradients, layouts, masking) and `analyze`'s kd/* and loss/kd.

Expected numbers are derived by hand in the comments or by plain float64 Python loops over the dump.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_cli.cli import main
from grpo_cli.core.distill import distill_loss, distill_loss_terms, joint_distill_loss

F64 = torch.float64
NAN = float("nan")


def t(x, device, dtype=F64, grad=False):
    return torch.tensor(x, dtype=dtype, device=device, requires_grad=grad)


# ==============================================================================================================
# core
# ==============================================================================================================


def test_kd_term_value_and_gradient(device):
    # lp = [−1, −2, −0.5], teacher = [−1.5, −1, NaN (masked)], m = [1, 1, 0], N = 2, w_d = 0.5:
    # rkl = [0.5, −1] → mean −0.25 → loss 0.5·(−0.25) = −0.125; ∂/∂lp = w_d·m/N = [0.25, 0.25, 0].
    lp = t([-1.0, -2.0, -0.5], device, grad=True)
    loss, stats = distill_loss(lp, t([-1.5, -1.0, NAN], device), t([1, 1, 0], device, torch.int64),
                               distill_loss_weight=0.5)
    assert loss.item() == pytest.approx(-0.125, abs=1e-15)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.25, 0.25, 0.0], abs=1e-15)
    assert stats["rkl"].tolist() == pytest.approx([0.5, -1.0, 0.0])
    assert stats["rkl_sum"].item() == pytest.approx(-0.5)
    assert "importance_weight" not in stats


def test_importance_sampled_form_value_and_gradient(device):
    # rl_loss_weight = 0, w_d = 0.5, old = [−1.2, −2, NaN]: r = [e^0.2, 1];
    # per token −w_d·r·(T − lp): 0.25·e^0.2 and −0.5 → loss (0.25·e^0.2 − 0.5)/2 = −0.0973246552...
    # ∂/∂lp_t = −w_d·r_t·(T_t − lp_t)/N (the stop-gradient blocks the (T − lp) factor): [0.125·e^0.2, −0.25, 0].
    e = math.exp(0.2)
    lp = t([-1.0, -2.0, -0.5], device, grad=True)
    loss, stats = distill_loss(lp, t([-1.5, -1.0, NAN], device), t([1, 1, 0], device, torch.bool),
                               old_logprobs=t([-1.2, -2.0, NAN], device), rl_loss_weight=0.0, distill_loss_weight=0.5)
    assert loss.item() == pytest.approx((0.25 * e - 0.5) / 2, abs=1e-15)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.125 * e, -0.25, 0.0], abs=1e-15)
    assert stats["importance_weight"].tolist() == pytest.approx([e, 1.0, 0.0])


def test_gradients_on_random_data():
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(7, generator=gen, dtype=F64)).requires_grad_()
    teacher = -torch.rand(7, generator=gen, dtype=F64)
    old = -torch.rand(7, generator=gen, dtype=F64)
    mask = torch.tensor([1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
    # w_rl > 0: a plain function of lp, so finite differences apply.
    assert torch.autograd.gradcheck(lambda x: distill_loss(x, teacher, mask, distill_loss_weight=0.3)[0], (lp,))
    # w_rl = 0: the stop-gradient makes the gradient differ from the value's derivative; check the formula
    # ∂/∂lp_t = −w_d·m_t·exp(lp_t − old_t)·(teacher_t − lp_t)/N with plain Python.
    loss, _ = distill_loss(lp, teacher, mask, old_logprobs=old, rl_loss_weight=0.0, distill_loss_weight=0.3)
    loss.backward()
    n = int(mask.sum())
    expected = [(-0.3 * math.exp(a - c) * (b - a) / n) if m else 0.0
                for a, b, c, m in zip(lp.tolist(), teacher.tolist(), old.tolist(), mask.tolist())]
    assert lp.grad.tolist() == pytest.approx(expected, abs=1e-15)


def test_padded_equals_packed_and_empty_mask(device):
    lp = t([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]], device)
    teacher = t([[-1.5, -1.0, -3.0], [-0.4, -0.4, -0.4]], device)
    mask = t([[1, 1, 0], [0, 1, 1]], device, torch.bool)
    padded, _ = distill_loss(lp, teacher, mask, distill_loss_weight=1.0)
    packed, _ = distill_loss(lp.flatten(), teacher.flatten(), mask.flatten(), distill_loss_weight=1.0)
    # (0.5 − 1 + 0.2 + 0.1)/4 = −0.05
    assert padded.item() == pytest.approx(-0.05) and packed.item() == pytest.approx(-0.05)
    none, _ = distill_loss(lp, teacher, torch.zeros_like(mask), distill_loss_weight=1.0)
    assert none.item() == 0.0  # Σ over nothing / max(0, 1)


def test_float16_goes_through_float32_and_nan_never_leaks(device):
    lp = torch.tensor([-1.0, -2.0, NAN], dtype=torch.float16, device=device, requires_grad=True)
    teacher = torch.tensor([-1.5, -1.0, NAN], dtype=torch.float16, device=device)
    old = torch.tensor([-1.0, -2.0, NAN], dtype=torch.float16, device=device)
    loss, _ = distill_loss(lp, teacher, torch.tensor([1, 1, 0], device=device), old_logprobs=old,
                           rl_loss_weight=0.0, distill_loss_weight=1.0)
    assert loss.dtype == torch.float16
    # r = 1: (−(−0.5) − 1)/2 = −0.25
    assert loss.item() == pytest.approx(-0.25)
    loss.backward()
    assert torch.isfinite(lp.grad).all()


def test_joint_loss(device):
    # w_rl = 2, rl_loss 0.5, w_d = 0.25, rkl mean 2 → 1 + 0.5 = 1.5; ∂/∂lp = w_d·m/N = 0.25; ∂/∂rl_loss = 2.
    lp = t([-1.0], device, grad=True)
    rl = t(0.5, device, grad=True)
    loss, _ = joint_distill_loss(rl, lp, t([-3.0], device), t([1], device), rl_loss_weight=2.0,
                                 distill_loss_weight=0.25)
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    assert (lp.grad.item(), rl.grad.item()) == pytest.approx((0.25, 2.0))
    # w_rl = 0: the RL loss is dropped, only the importance-sampled KD term remains (r = 1: −0.25·(−3 + 1) = 0.5).
    loss, _ = joint_distill_loss(rl, lp, t([-3.0], device), t([1], device), old_logprobs=t([-1.0], device),
                                 rl_loss_weight=0.0, distill_loss_weight=0.25)
    assert loss.item() == pytest.approx(0.5)


def test_argument_errors():
    x = torch.zeros(3)
    m = torch.ones(3)
    with pytest.raises(ValueError, match="old_logprobs is required"):
        distill_loss(x, x, m, rl_loss_weight=0.0)
    with pytest.raises(ValueError, match="distill_loss_weight"):
        distill_loss(x, x, m, distill_loss_weight=-1.0)
    with pytest.raises(ValueError, match="shape"):
        distill_loss(x, torch.zeros(2), m)
    with pytest.raises(ValueError, match="0/1"):
        distill_loss(x, x, torch.tensor([0, 2, 1]))
    with pytest.raises(TypeError):
        distill_loss([0.0], x, m)
    with pytest.raises(TypeError):
        distill_loss(x, x, m, distill_weight=1.0)  # an unknown keyword
    num, den, _ = distill_loss_terms(x, x, m)
    assert den.item() == 3 and num.dtype == F64


# ==============================================================================================================
# analyze
# ==============================================================================================================


def kd_dump(path, n=40, seed=0, with_old=True, row_group_size=7):
    rng = np.random.default_rng(seed)
    rows = {"new": [], "teacher": [], "old": [], "mask": []}
    for _ in range(n):
        length = int(rng.integers(2, 12))
        prompt = int(rng.integers(1, length))
        new = -rng.exponential(1.0, length)
        rows["new"].append(new.astype(np.float32).tolist())
        teacher = np.minimum(new + rng.normal(0, 0.5, length), 0).astype(np.float32)
        teacher[:prompt] = np.nan  # the teacher scored only the response; garbage on the prompt must not leak
        rows["teacher"].append(teacher.tolist())
        rows["old"].append(np.minimum(new + rng.normal(0, 0.2, length), 0).astype(np.float32).tolist())
        rows["mask"].append([0] * prompt + [1] * (length - prompt))
    f32 = pa.list_(pa.float32())
    cols = {"new_logp": pa.array(rows["new"], f32), "teacher_logp": pa.array(rows["teacher"], f32),
            "loss_mask": pa.array(rows["mask"], pa.list_(pa.int8()))}
    if with_old:
        cols["old_logp"] = pa.array(rows["old"], f32)
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return rows


def kd_reference(rows, w_d, w_rl):
    """Float64 loops: mean(new − teacher), and the loss/kd term of AReaL's joint distillation."""
    n = 0
    s_rkl = s_is = 0.0
    for new, teacher, old, mask in zip(rows["new"], rows["teacher"], rows["old"], rows["mask"]):
        for a, b, c, m in zip(new, teacher, old, mask):
            if m:
                n += 1
                s_rkl += a - b
                s_is += math.exp(a - c) * (a - b)  # −r·(teacher − new)
    return s_rkl / n, (w_d * s_rkl / n) if w_rl > 0 else (w_d * s_is / n)


def analyze_json(capsys, *args):
    code = main(["analyze", *map(str, args), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_analyze_kd_figures(capsys, tmp_path):
    path = tmp_path / "kd.parquet"
    rows = kd_dump(path)
    doc = analyze_json(capsys, path)
    rkl, kd = kd_reference(rows, 0.005, 1.0)
    assert doc["metrics"]["kd/rkl_mean"] == pytest.approx(rkl, rel=1e-5)
    assert doc["metrics"]["loss/kd"] == pytest.approx(kd, rel=1e-5)
    assert doc["config"]["distill_weight"] == 0.005 and doc["config"]["rl_weight"] == 1.0
    doc = analyze_json(capsys, path, "--distill-weight", "0.3", "--rl-weight", "0", "--batch-tokens", "5")
    rkl, kd = kd_reference(rows, 0.3, 0.0)
    assert doc["metrics"]["kd/rkl_mean"] == pytest.approx(rkl, rel=1e-5)
    assert doc["metrics"]["loss/kd"] == pytest.approx(kd, rel=1e-5)


def test_analyze_kd_batch_independent(capsys, tmp_path):
    path = tmp_path / "kd.parquet"
    kd_dump(path, n=25, seed=3)
    a = analyze_json(capsys, path, "--batch-tokens", "3")["metrics"]
    b = analyze_json(capsys, path)["metrics"]
    for key in ("kd/rkl_mean", "loss/kd"):
        assert a[key] == pytest.approx(b[key], rel=1e-12)


def test_analyze_kd_omitted(capsys, tmp_path):
    path = tmp_path / "nokd.parquet"
    pq.write_table(pa.table({"new_logp": pa.array([[-1.0, -0.5]], pa.list_(pa.float32()))}), path)
    doc = analyze_json(capsys, path)
    assert "kd/rkl_mean" not in doc["metrics"]
    assert doc["omitted"]["loss/kd"] == "needs a 'teacher_logp' column"
    path = tmp_path / "noold.parquet"
    kd_dump(path, n=5, with_old=False)
    doc = analyze_json(capsys, path, "--rl-weight", "0")
    assert "kd/rkl_mean" in doc["metrics"] and "loss/kd" not in doc["metrics"]
    assert "old_logp" in doc["omitted"]["loss/kd"]


def test_analyze_kd_bad_weight(capsys, tmp_path):
    path = tmp_path / "kd.parquet"
    kd_dump(path, n=3)
    code = main(["analyze", str(path), "--distill-weight", "-1"])
    _, err = capsys.readouterr()
    assert code == 2 and "--distill-weight" in err

"""Tests of the rollout simulator (``tests/simulate.py``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from simulate import EOS, SimConfig, fault_config, healthy_on_policy, healthy_small, simulate


def _read(info_files: list[Path]) -> list[dict[str, list]]:
    return [pq.read_table(f).to_pydict() for f in info_files]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, list[dict[str, list]]]:
    out = tmp_path_factory.mktemp("healthy")
    info = simulate(SimConfig(steps=3, prompts_per_step=6), out)
    return info, _read(info.files)


def test_shapes_versions_and_eos(healthy: tuple[object, list[dict[str, list]]]) -> None:
    info, tables = healthy
    assert info.n_sequences == 3 * 6 * 8
    assert len(tables) == 3
    for step, t in enumerate(tables):
        assert set(t["step"]) == {step}
        for i in range(len(t["new_logp"])):
            mask, versions = t["loss_mask"][i], t["versions"][i]
            assert len(mask) == len(t["new_logp"][i]) == len(t["old_logp"][i]) == len(versions)
            n_resp = sum(mask)
            assert n_resp >= 1
            # prompt first (masked, version -1), then the response (in the loss, behaviour version)
            assert mask == [0] * (len(mask) - n_resp) + [1] * n_resp
            assert versions[: len(mask) - n_resp] == [-1] * (len(mask) - n_resp)
            lag = t["current_version"][i] - versions[-1]
            assert 0 <= lag <= 3 and len(set(versions[len(mask) - n_resp:])) == 1
            assert t["current_version"][i] == step + 3
            if t["eos"][i] == 0:
                assert n_resp == SimConfig().max_new_tokens
            assert t["new_logp"][i][0] == 0.0  # the first token is never predicted
            assert all(x <= 0 for x in t["new_logp"][i])


def test_group_advantages_are_grpo(healthy: tuple[object, list[dict[str, list]]]) -> None:
    _, tables = healthy
    for t in tables:
        r = torch.tensor(t["rewards"], dtype=torch.float64).view(-1, 8)
        expected = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
        got = torch.tensor(t["advantages"], dtype=torch.float64).view(-1, 8)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        gid = torch.tensor(t["group_id"]).view(-1, 8)
        assert bool((gid == gid[:, :1]).all())


def test_bf16_engine_is_close_but_not_equal(healthy: tuple[object, list[dict[str, list]]]) -> None:
    _, tables = healthy
    diffs = []
    for t in tables:
        for i in range(len(t["new_logp"])):
            lag = t["current_version"][i] - t["versions"][i][-1]
            if lag == 0:
                m = torch.tensor(t["loss_mask"][i], dtype=torch.bool)
                diffs.append((torch.tensor(t["new_logp"][i]) - torch.tensor(t["old_logp"][i]))[m].abs())
    d = torch.cat(diffs)
    assert 0.002 < float(d.mean()) < 0.02  # bf16 logits + kernel noise: ~0.008 nats, like published bf16 stacks


def test_on_policy_old_equals_new(tmp_path: Path) -> None:
    info = simulate(healthy_on_policy(steps=2, prompts_per_step=4), tmp_path)
    for t in _read(info.files):
        assert t["old_logp"] == t["new_logp"]
        assert t["prox_logp"] == t["new_logp"]
        assert all(c == v[-1] for c, v in zip(t["current_version"], t["versions"]))


def test_deterministic(tmp_path: Path) -> None:
    a = simulate(healthy_small(), tmp_path / "a")
    b = simulate(healthy_small(), tmp_path / "b")
    assert _read(a.files) == _read(b.files)
    c = simulate(healthy_small(seed=1), tmp_path / "c")
    assert _read(c.files) != _read(a.files)


@pytest.mark.parametrize("shift", [1, -1])
def test_shift_really_shifts(tmp_path: Path, shift: int) -> None:
    cfg = SimConfig(steps=1, prompts_per_step=4)
    base = _read(simulate(cfg, tmp_path / "base").files)[0]
    name = "shift_late" if shift > 0 else "shift_early"
    faulty = _read(simulate(fault_config(name, 1.0, steps=1, prompts_per_step=4), tmp_path / "f").files)[0]
    assert faulty["new_logp"] == base["new_logp"]
    for old, ref in zip(faulty["old_logp"], base["old_logp"]):
        if shift > 0:
            assert old == [0.0, *ref[:-1]]
        else:
            assert old == [*ref[1:], 0.0]


def test_partial_fault_hits_whole_groups(tmp_path: Path) -> None:
    info = simulate(fault_config("adv_sign", 0.3, steps=2, prompts_per_step=10), tmp_path)
    assert len(info.hit) == 2 * 3 * 8  # round(0.3 · 10) groups of 8 per step
    tables = _read(info.files)
    for file_index, t in enumerate(tables):
        r = torch.tensor(t["rewards"], dtype=torch.float64).view(-1, 8)
        a = torch.tensor(t["advantages"], dtype=torch.float64).view(-1, 8)
        cov = ((r - r.mean(1, keepdim=True)) * a).sum(1)
        for g in range(r.shape[0]):
            hit = (file_index, g * 8) in info.hit
            if float(r.std(1)[g]) > 0:
                assert (float(cov[g]) < 0) == hit


def test_faults_change_the_columns_they_name(tmp_path: Path) -> None:
    small = {"steps": 1, "prompts_per_step": 4}
    t = _read(simulate(fault_config("mask_prompt", 1.0, **small), tmp_path / "m").files)[0]
    assert all(m[0] == 1 for m in t["loss_mask"])  # prompt tokens in the loss
    t = _read(simulate(fault_config("ref_old", 1.0, **small), tmp_path / "r").files)[0]
    assert t["ref_logp"] == t["old_logp"]
    t = _read(simulate(fault_config("duplicates", 1.0, **small), tmp_path / "d").files)[0]
    assert len(t["seq_id"]) == 2 * len(set(t["seq_id"]))
    t = _read(simulate(fault_config("truncation", 1.0, **small), tmp_path / "t").files)[0]
    assert set(t["eos"]) == {0}
    t = _read(simulate(fault_config("top_p", 1.0, **small), tmp_path / "p").files)[0]
    above = [o >= n for olds, news, ms in zip(t["old_logp"], t["new_logp"], t["loss_mask"])
             for o, n, m in zip(olds, news, ms) if m]
    assert sum(above) / len(above) > 0.9  # renormalised over the kept mass: old above new


def test_eos_token_ends_responses(healthy: tuple[object, list[dict[str, list]]]) -> None:
    # every response with eos = 1 ends on the EOS token id; the ids are not stored, but its log-prob is finite and
    # the response is shorter than the limit
    _, tables = healthy
    t = tables[0]
    lengths = [sum(m) for m, e in zip(t["loss_mask"], t["eos"]) if e == 1]
    assert lengths and max(lengths) <= SimConfig().max_new_tokens and EOS == 0

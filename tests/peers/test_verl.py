"""verl 0.9.1's own functions against grpo-cli's core: values and gradients on the edge-case batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _batches import close, make_batch

from grpo_cli.core import AGG_MODES, aggregate_loss, kl_estimate, reinforce_pp_advantages
from grpo_cli.core.peer_figures import (
    verl_data_metrics,
    verl_kl_penalty,
    verl_offpolicy_metrics,
    verl_policy_loss,
    verl_rollout_is,
    verl_rollout_rs,
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _grad(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, leaf)
    return g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss(verl: SimpleNamespace, mode: str, dtype: torch.dtype) -> None:
    b = make_batch(1, dtype)
    mat_peer, mat_ours = b.fresh_lp(), b.fresh_lp()
    mask = b.mask.to(dtype)  # verl multiplies by a float mask
    peer = verl.core_algos.agg_loss(mat_peer, mask, mode)
    ours = aggregate_loss(mat_ours, b.mask, mode, convention="verl")
    close(ours, peer, dtype, f"agg_loss {mode}")
    close(_grad(ours, mat_ours), _grad(peer, mat_peer), dtype, f"agg_loss {mode} gradient")


def test_agg_loss_sum_norm_older_release_differs(verl: SimpleNamespace) -> None:
    # grpo-cli's default (verl <= 0.6) is B times verl 0.9's value; B = 9 non-empty rows here.
    b = make_batch(1, torch.float64)
    peer = verl.core_algos.agg_loss(b.lp, b.mask.double(), "seq-mean-token-sum-norm")
    old = aggregate_loss(b.lp, b.mask, "seq-mean-token-sum-norm", convention="verl<=0.6")
    close(old, peer * 9, torch.float64, "verl<=0.6 sum-norm")


def _actor_config(core_algos: object, low: float, high: float, c: float = 3.0) -> object:
    """A verl ``ActorConfig`` holding only the fields the policy losses read (its ``__post_init__`` checks a whole
    trainer setup, so the instance is built without it)."""
    cfg = object.__new__(core_algos.ActorConfig)
    fields = {
        "clip_ratio": 0.2,
        "clip_ratio_low": low,
        "clip_ratio_high": high,
        "clip_ratio_c": c,
        "global_batch_info": {},
    }
    for key, value in fields.items():
        object.__setattr__(cfg, key, value)
    return cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("variant", ["vanilla", "cispo", "gspo"])
def test_policy_loss(verl: SimpleNamespace, variant: str, mode: str, dtype: torch.dtype) -> None:
    b = make_batch(2, dtype)
    cfg = _actor_config(verl.core_algos, 0.2, 0.28)
    fn = verl.core_algos.get_policy_loss_fn(variant)
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    weights = torch.rand(b.lp.shape, generator=torch.Generator().manual_seed(3)).to(dtype) * 2
    peer, peer_metrics = fn(b.old, lp_peer, b.adv, b.mask.to(dtype), mode, cfg, rollout_is_weights=weights)
    ours, metrics = verl_policy_loss(
        variant,
        b.old,
        lp_ours,
        b.adv,
        b.mask,
        mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        rollout_is_weights=weights,
    )
    close(ours, peer, dtype, f"{variant} {mode} loss")
    close(_grad(ours, lp_ours), _grad(peer, lp_peer), dtype, f"{variant} {mode} gradient")
    for key, value in metrics.items():
        close(value, peer_metrics[f"actor/{key}"], dtype, f"{variant} actor/{key}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gspo_at_extreme_ratios(verl: SimpleNamespace, dtype: torch.dtype) -> None:
    # verl's GSPO caps the sequence log-ratio at 10 (from above) and has no per-token ±20 bound: row 7's tokens at
    # +25/+30 give a sequence mean above 10, row 8's at -25/-30 one below -10 (not capped).
    b = make_batch(4, dtype)
    b.old[7] = b.lp[7].detach() - torch.tensor([25.0, 30.0, 25.0, 30.0, 25.0, 30.0, 25.0], dtype=dtype)
    b.old[8] = b.lp[8].detach() + torch.tensor([25.0, 30.0, 25.0, 30.0, 25.0, 30.0, 25.0], dtype=dtype)
    cfg = _actor_config(verl.core_algos, 0.2, 0.28)
    fn = verl.core_algos.get_policy_loss_fn("gspo")
    for mode in AGG_MODES:
        lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
        peer, peer_metrics = fn(b.old, lp_peer, b.adv, b.mask.to(dtype), mode, cfg)
        ours, metrics = verl_policy_loss("gspo", b.old, lp_ours, b.adv, b.mask, mode, clip_ratio_low=0.2,
                                         clip_ratio_high=0.28)
        close(ours, peer, dtype, f"gspo {mode} loss")
        close(_grad(ours, lp_ours), _grad(peer, lp_peer), dtype, f"gspo {mode} gradient")
        for key, value in metrics.items():
            close(value, peer_metrics[f"actor/{key}"], dtype, f"gspo actor/{key}")


KL_NAMES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+", "abs+", "k2+"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", KL_NAMES)
def test_kl_penalty(verl: SimpleNamespace, name: str, dtype: torch.dtype) -> None:
    b = make_batch(3, dtype)
    ref = b.ref.clone()
    ref[6] = b.lp[6].detach() + torch.tensor([25.0, -25.0, 12.0, -12.0, 0.0, 3.0, -3.0], dtype=dtype)  # clamps
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    peer = verl.core_algos.kl_penalty(lp_peer, ref, name)
    ours = verl_kl_penalty(lp_ours, ref, name)
    close(ours, peer, dtype, f"kl_penalty {name}")
    close(_grad(ours.sum(), lp_ours), _grad(peer.sum(), lp_peer), dtype, f"kl_penalty {name} gradient")
    if name.endswith("+") and name[:-1] in ("k3", "k1", "abs"):
        direct = kl_estimate(b.fresh_lp(), ref, name[:-1] + "+", clamp=10.0 if name == "k3+" else None)
        close(direct, peer, dtype, f"kl_estimate {name}")


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(verl: SimpleNamespace, gamma: float) -> None:
    b = make_batch(4, torch.float64)
    rewards = torch.zeros_like(b.adv)
    last = b.mask.long().cumsum(-1).argmax(-1)  # last valid position per row
    rewards[torch.arange(rewards.shape[0]), last] = b.scores
    rewards[3, 2] = 5.0  # a reward inside the masked hole (both ignore it)
    adv_peer, ret_peer = verl.core_algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, b.mask.double(), config=SimpleNamespace(gamma=gamma)
    )
    adv, ret = reinforce_pp_advantages(rewards, b.mask, gamma=gamma, convention="verl")
    close(torch.where(b.mask, ret, 0.0), ret_peer, torch.float64, "reinforce++ returns")
    close(adv, adv_peer, torch.float64, "reinforce++ advantages")
    _, ret_old = reinforce_pp_advantages(rewards, b.mask, gamma=gamma)  # verl <= 0.8: differs across the hole
    assert not torch.allclose(torch.where(b.mask, ret_old, 0.0)[3], ret_peer[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("level", "threshold"), [("token", 2.0), ("sequence", 2.0), ("token", "0.5_2.0"), ("sequence", "0.5_5.0")]
)
def test_rollout_is_weights_and_metrics(
    verl: SimpleNamespace, level: str, threshold: object, dtype: torch.dtype
) -> None:
    b = make_batch(5, dtype)
    log_ratio = b.old - b.roll
    w_peer, m_peer = verl.rollout_corr.compute_rollout_correction_weights(
        log_ratio, b.mask.to(dtype), rollout_is=level, rollout_is_threshold=threshold
    )
    upper, lower = (threshold, None) if isinstance(threshold, float) else map(float, str(threshold).split("_")[::-1])
    w, metrics = verl_rollout_is(b.old, b.roll, b.mask, level=level, threshold=upper, threshold_lower=lower)
    close(torch.where(b.mask, w, 0), torch.where(b.mask, w_peer, 0), dtype, f"IS weights {level}")
    assert set(metrics) == set(m_peer)
    for key, value in metrics.items():
        # verl takes the fractions as float32 means of booleans whatever the input dtype
        key_dtype = torch.float32 if "fraction" in key or "oob" in key else dtype
        close(value, m_peer[key], key_dtype, f"rollout_corr/{key} ({level}, {threshold})")


def test_rollout_is_hand_example_truncates_before_statistics(verl: SimpleNamespace) -> None:
    lr = torch.log(torch.tensor([[4.0, 0.25, 1.0]], dtype=torch.float64))
    _, m_peer = verl.rollout_corr.compute_rollout_correction_weights(lr, torch.ones(1, 3, dtype=torch.float64))
    _, ours = verl_rollout_is(lr, torch.zeros_like(lr), torch.ones(1, 3))
    _, raw = verl_rollout_is(lr, torch.zeros_like(lr), torch.ones(1, 3), truncate=False)
    for key in ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size"):
        close(ours[key], m_peer[key], torch.float64, key)
    assert [round(raw[k], 3) for k in ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size")] == [
        1.75,
        4.0,
        0.778,
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_offpolicy_metrics(verl: SimpleNamespace, dtype: torch.dtype) -> None:
    b = make_batch(6, dtype)
    peer = verl.rollout_corr.compute_offpolicy_metrics(b.old, b.roll, b.mask.to(dtype))
    ours = verl_offpolicy_metrics(b.old, b.roll, b.mask)
    assert set(ours) == set(peer)
    for key, value in ours.items():
        close(value, peer[key], dtype, f"rollout_corr/{key}")
    peer_only = verl.rollout_corr.compute_offpolicy_metrics(b.old, None, b.mask.to(dtype))
    assert verl_offpolicy_metrics(b.old, None, b.mask) == pytest.approx(peer_only, rel=1e-5)


def test_data_metrics(verl: SimpleNamespace) -> None:
    b = make_batch(7, torch.float32)
    n, t = b.mask.shape
    attention = torch.ones(n, t, dtype=torch.long)
    attention[0, 5:] = 0
    attention[1, :] = 0  # an aborted (empty) response
    attention[2, 3:] = 0
    attention[4, 6:] = 0  # row 3's masked hole stays in the attention mask (observation tokens)
    token_scores = torch.zeros(n, t)
    token_scores[:, 0] = b.scores.float()
    prompt = torch.ones(n, 3, dtype=torch.long)
    batch = SimpleNamespace(
        batch={
            "token_level_scores": token_scores,
            "token_level_rewards": token_scores,
            "advantages": b.adv.float(),
            "returns": b.adv.float(),
            "prompts": prompt,
            "responses": torch.zeros(n, t, dtype=torch.long),
            "response_mask": b.mask,
            "attention_mask": torch.cat([prompt, attention], dim=1),
        },
        non_tensor_batch={},
        meta_info={},
    )
    peer = verl.metric_utils.compute_data_metrics(batch, use_critic=False)
    ours = verl_data_metrics(b.scores, attention)
    for key, value in ours.items():
        close(value, peer[key], torch.float32, key)


RS_CASES = [
    ("token_k1", "0.5_2.0"),
    ("token_k1", 2.0),
    ("token_k2", 0.5),
    ("token_k3", 0.3),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2", 1.0),
    ("seq_sum_k3", 2.0),
    ("seq_mean_k1", "0.999_1.001"),
    ("seq_mean_k2", 0.1),
    ("seq_mean_k3", 0.2),
    ("seq_max_k2", 2.0),
    ("seq_max_k3", 1.0),
    ("token_k1,seq_mean_k3", "0.5_2.0,0.5"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("options", "threshold"), RS_CASES)
def test_rollout_rejection_sampling(verl: SimpleNamespace, options: str, threshold: object, dtype: torch.dtype) -> None:
    b = make_batch(8, dtype)
    mask_peer, m_peer = verl.rollout_corr.compute_rollout_rejection_mask(
        b.old - b.roll, b.mask.to(dtype), rollout_rs=options, rollout_rs_threshold=threshold
    )
    mask, metrics = verl_rollout_rs(b.old, b.roll, b.mask, options, threshold)
    assert torch.equal(mask, mask_peer.bool())
    assert set(metrics) == set(m_peer)
    for key, value in metrics.items():
        key_dtype = torch.float32 if "fraction" in key else dtype  # verl's float32 means of booleans
        close(value, m_peer[key], key_dtype, f"rollout_corr/{key}")


def test_pearson_figure_under_names_verl(verl: SimpleNamespace, tmp_path, capsys) -> None:
    # `analyze --names verl` shows training/rollout_actor_probs_pearson_corr from the recompute (prox_logp) against
    # the rollout (old_logp); verl's own verl/utils/debug/metrics.py pearson_correlation_coefficient on the same.
    import json

    from reference import random_sequences, write_sequences

    from grpo_cli.cli import main

    seqs = random_sequences(20, seed=4, with_prox=True)
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=6)
    assert main(["analyze", str(path), "--names", "verl", "-f", "json", "-q", "--batch-tokens", "9"]) == 0
    ours = json.loads(capsys.readouterr().out)["metrics"]["training/rollout_actor_probs_pearson_corr"]
    width = max(len(s.new) for s in seqs)

    def pad(attr: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(getattr(s, attr)) + [0] * (width - len(s.new)) for s in seqs], dtype=dtype)

    mask = pad("mask", torch.int64).bool()
    peer = verl.debug_metrics.pearson_correlation_coefficient(torch.exp(pad("prox", torch.float64)),
                                                 torch.exp(pad("old", torch.float64)), mask)
    assert ours == pytest.approx(peer, rel=1e-9)


# ``analyze --names verl`` with verl's rollout_is / rollout_rs settings against verl's own pipeline
# (compute_rollout_correction_weights, compute_rollout_rejection_mask, compute_offpolicy_metrics: the three calls of
# compute_rollout_correction_and_rejection_mask) on the whole dump as one training batch. Together the cases cover
# all eleven rollout_rs options, both rollout_is levels, TIS and IcePop thresholds.
ANALYZE_CASES = [
    ("sequence", "2.0", "token_k1", "0.5_2.0"),
    ("token", "0.5_5.0", "seq_sum_k3", "2.0"),
    ("sequence", "0.5_5.0", "seq_mean_k1,seq_max_k2,token_k3", "0.9_1.1,0.5,0.3"),
    ("token", "2.0", "seq_mean_k2,seq_sum_k1,token_k2,seq_mean_k3,seq_max_k3,seq_sum_k2",
     "0.05,0.1_10,0.1,0.05,0.5,1.0"),
]


@pytest.mark.parametrize(("level", "is_threshold", "options", "rs_threshold"), ANALYZE_CASES)
def test_rollout_correction_settings_under_names_verl(verl: SimpleNamespace, tmp_path, capsys, level: str,
                                                      is_threshold: str, options: str, rs_threshold: str) -> None:
    import dataclasses
    import json

    from reference import random_sequences, write_sequences

    from grpo_cli.cli import main

    seqs = random_sequences(24, seed=11, with_prox=True)
    seqs[5] = dataclasses.replace(seqs[5], mask=[0] * len(seqs[5].new))  # a sequence without a valid token
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=5)
    args = ["analyze", str(path), "--names", "verl", "-f", "json", "-q", "--batch-tokens", "13", "--rollout-is",
            level, "--rollout-is-threshold", is_threshold, "--rollout-rs", options, "--rollout-rs-threshold",
            rs_threshold]
    assert main(args) == 0
    ours = json.loads(capsys.readouterr().out)["metrics"]
    width = max(len(s.new) for s in seqs)

    def pad(attr: str) -> torch.Tensor:
        return torch.tensor([list(getattr(s, attr)) + [0] * (width - len(s.new)) for s in seqs], dtype=torch.float64)

    mask = pad("mask")
    for train, prefix in (("prox", "rollout_corr/"), ("new", "actor/rollout_corr/")):
        trained, rollout = pad(train), pad("old")
        log_ratio = trained - rollout
        _, peer = verl.rollout_corr.compute_rollout_correction_weights(
            log_ratio, mask, rollout_is=level, rollout_is_threshold=is_threshold)
        _, rs = verl.rollout_corr.compute_rollout_rejection_mask(
            log_ratio, mask, rollout_rs=options, rollout_rs_threshold=rs_threshold)
        peer.update(rs)
        peer.update(verl.rollout_corr.compute_offpolicy_metrics(trained, rollout, mask))
        shown = {k[len(prefix):]: v for k, v in ours.items() if k.startswith(prefix)}
        assert set(shown) == set(peer), set(shown) ^ set(peer)
        for key, value in peer.items():
            assert shown[key] == pytest.approx(float(value), rel=1e-6, abs=1e-9), prefix + key

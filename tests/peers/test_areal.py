"""AReaL 1.0.4's own functions (``functional.py``, ``trainer/ppo/actor.py``) against grpo-cli's core."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _batches import close, make_batch

from grpo_cli.core import RejectionSamplingConfig, apply_rejection_sampling, ppo_actor_loss, sapo_loss
from grpo_cli.core.peer_figures import areal_actor_stats

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
RS = {
    "none": None,
    "token-ratio-mask": {"level": "token", "action": "mask", "metric": "ratio", "upper": 2.0},
    "token-ratio-clamp": {"level": "token", "action": "clamp", "metric": "ratio", "upper": 2.0, "lower": 0.5},
    "seq-ratio-mean-mask": {"level": "sequence", "action": "mask", "metric": "ratio", "agg": "mean", "upper": 1.5},
    "seq-k3-max-mask": {"level": "sequence", "action": "mask", "metric": "kl_k3", "agg": "max", "upper": 0.5},
}


def _rs(areal: SimpleNamespace, spec: dict | None) -> tuple[object, object]:
    if spec is None:
        return None, None
    return areal.cli_args.RejectionSamplingConfig(**spec), RejectionSamplingConfig(**spec)


def _grad(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, leaf)
    return g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rs", list(RS))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("c_clip", [None, 3.0])
def test_ppo_actor_loss(areal: SimpleNamespace, level: str, rs: str, c_clip: float | None, dtype: torch.dtype) -> None:
    b = make_batch(11, dtype)
    rs_peer, rs_ours = _rs(areal, RS[rs])
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    kw = {"eps_clip": 0.2, "eps_clip_higher": 0.28, "c_clip": c_clip, "importance_sampling_level": level}
    peer, st_peer = areal.functional.ppo_actor_loss_fn(
        logprobs=lp_peer,
        proximal_logprobs=b.old,
        old_logprobs=b.roll,
        advantages=b.adv,
        loss_mask=b.mask,
        rejection_sampling=rs_peer,
        **kw,
    )
    ours, st = ppo_actor_loss(
        lp_ours, b.old, b.roll, b.adv, loss_mask=b.mask, rejection_sampling=rs_ours, convention="areal", **kw
    )
    # AReaL computes the behaviour log-ratio of rejection sampling in float32 even for float64 inputs.
    lossy = torch.float32 if rs_ours is not None and dtype == torch.float64 else dtype
    close(ours, peer, lossy, "loss")
    close(_grad(ours, lp_ours), _grad(peer, lp_peer), lossy, "gradient")
    kept = b.mask
    if rs_peer is not None:
        kept = areal.functional.apply_rejection_sampling(
            proximal_logprobs=b.old, old_logprobs=b.roll, loss_mask=b.mask, cu_seqlens=None, config=rs_peer
        ).loss_mask
    for key in ("clip_mask", "dual_clip_mask"):
        assert torch.equal(st[key], st_peer[key]), key
    close(st["importance_weight"], st_peer["importance_weight"], dtype, "importance_weight")
    close(torch.where(b.mask, st["approx_kl"], 0), torch.where(b.mask, st_peer["approx_kl"], 0), dtype, "approx_kl")
    close(torch.where(kept, st["loss"], 0), torch.where(kept, st_peer["loss"], 0), lossy, "per-token loss")
    if rs_ours is not None:
        assert torch.equal(st["behave_mask"], st_peer["behave_mask"])
        for key in ("behave_imp_weight", "behave_approx_kl"):
            close(
                torch.where(st["behave_mask"], st[key], 0),
                torch.where(st_peer["behave_mask"], st_peer[key], 0),
                lossy,
                key,
            )
        close(st["filtered_fraction"], st_peer["filtered_fraction"], torch.float32, "filtered_fraction")


def test_ppo_statistics_mask_default_differs_at_rejected_tokens(areal: SimpleNamespace) -> None:
    # grpo-cli's default keeps the ratio and clip masks on the pre-filter mask (AReaL after 1.0.4); 1.0.4 zeroes
    # them where rejection sampling drops a token. Loss and gradient agree either way.
    b = make_batch(11, torch.float64)
    rs_peer, rs_ours = _rs(areal, RS["token-ratio-mask"])
    _, st_peer = areal.functional.ppo_actor_loss_fn(
        logprobs=b.lp,
        proximal_logprobs=b.old,
        old_logprobs=b.roll,
        advantages=b.adv,
        eps_clip=0.2,
        loss_mask=b.mask,
        rejection_sampling=rs_peer,
    )
    _, st = ppo_actor_loss(b.lp, b.old, b.roll, b.adv, 0.2, b.mask, rejection_sampling=rs_ours)
    rejected = b.mask & ~st["behave_mask"]
    assert bool(rejected.any())
    assert bool((st_peer["importance_weight"][rejected] == 0).all())
    close(st["importance_weight"][rejected], torch.exp(b.lp - b.old)[rejected].detach(), torch.float64, "pre-filter")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_loss(areal: SimpleNamespace, level: str, dtype: torch.dtype) -> None:
    b = make_batch(12, dtype)
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    peer, st_peer = areal.functional.sapo_loss_fn(
        logprobs=lp_peer,
        old_logprobs=b.old,
        advantages=b.adv,
        tau_pos=1.0,
        tau_neg=1.05,
        loss_mask=b.mask,
        importance_sampling_level=level,
    )
    ours, st = sapo_loss(lp_ours, b.old, b.adv, 1.0, 1.05, b.mask, importance_sampling_level=level)
    close(ours, peer, dtype, "sapo loss")
    close(_grad(ours, lp_ours), _grad(peer, lp_peer), dtype, "sapo gradient")
    for key in ("sapo_soft_gate", "sapo_scaled_gate_pos", "sapo_scaled_gate_neg", "importance_weight"):
        close(torch.where(b.mask, st[key], 0), torch.where(b.mask, st_peer[key], 0), dtype, key)


@pytest.mark.parametrize("rs", [k for k in RS if k != "none"])
def test_apply_rejection_sampling(areal: SimpleNamespace, rs: str) -> None:
    b = make_batch(13, torch.float32)
    rs_peer, rs_ours = _rs(areal, RS[rs])
    peer = areal.functional.apply_rejection_sampling(
        proximal_logprobs=b.old, old_logprobs=b.roll, loss_mask=b.mask, cu_seqlens=None, config=rs_peer
    )
    mask, weight, fraction = apply_rejection_sampling(b.old, b.roll, b.mask, None, rs_ours)
    assert torch.equal(mask, peer.loss_mask.bool())
    close(torch.where(mask, weight, 0), torch.where(mask, peer.behave_imp_weight, 0), torch.float32, "weight")
    close(fraction, peer.filtered_fraction, torch.float32, "filtered_fraction")


@pytest.mark.parametrize("dtype", [torch.float32])  # AReaL's stats tracker only takes float32 tensors
@pytest.mark.parametrize("rs", ["none", "token-ratio-mask", "seq-ratio-mean-mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_loss_fn_logged_stats(areal: SimpleNamespace, level: str, rs: str, dtype: torch.dtype) -> None:
    """Run AReaL's ``grpo_loss_fn`` and compare everything its stats tracker exports with areal_actor_stats."""
    b = make_batch(14, dtype)
    rs_peer, rs_ours = _rs(areal, RS[rs])
    versions = torch.randint(-1, 6, b.mask.shape, generator=torch.Generator().manual_seed(1))
    input_data = {
        "logprobs": b.roll,
        "advantages": b.adv,
        "loss_mask": b.mask,
        "prox_logp": b.old,
        "versions": versions,
    }
    areal.stats_tracker.export()  # start from an empty tracker
    areal.actor.grpo_loss_fn(
        b.lp.detach(),
        b.entropy,
        input_data,
        eps_clip=0.2,
        eps_clip_higher=0.28,
        c_clip=3.0,
        rejection_sampling=rs_peer,
        importance_sampling_level=level,
        current_version=6,
    )
    peer = areal.stats_tracker.export()
    ours = areal_actor_stats(
        b.lp,
        b.old,
        b.roll,
        b.adv,
        b.mask,
        eps_clip=0.2,
        eps_clip_higher=0.28,
        c_clip=3.0,
        rejection_sampling=rs_ours,
        importance_sampling_level=level,
        entropy=b.entropy,
        versions=versions,
        current_version=6,
    )
    skipped = {"n_tokens", "version_stats/n_valid_tokens"}
    missing = {k for k in peer if k not in ours and not k.endswith("__count") and k not in skipped}
    assert not missing, f"AReaL logs keys grpo-cli does not compute: {sorted(missing)}"
    extra = set(ours) - set(peer)
    assert not extra, f"grpo-cli computes keys AReaL does not log here: {sorted(extra)}"
    for key, value in ours.items():
        close(value, peer[key], dtype, key)

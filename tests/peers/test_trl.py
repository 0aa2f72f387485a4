"""TRL 1.16.0's ``GRPOTrainer._compute_loss`` (run on a stand-in trainer) against grpo-cli's GRPO-family core.

The stand-in supplies what ``_compute_loss`` reads from ``self``: the per-token log-probs and entropies (instead of
a model forward), the configuration, and a single-process accelerator. The loss, its gradient and every metric
TRL records in ``_metrics`` are compared.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from _batches import close, make_batch

from grpo_cli.core import grpo_family_loss_terms
from grpo_cli.core.peer_figures import (
    trl_cispo_clip_ratio,
    trl_clip_ratio_metrics,
    trl_logged_kl,
    trl_sampling_metrics,
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# TRL loss_type -> (grpo-cli variant, importance_sampling_level)
LOSSES = {
    "grpo": ("grpo", "token"),
    "gspo": ("gspo", "sequence"),
    "bnpo": ("bnpo", "token"),
    "dapo": ("bnpo", "token"),
    "dr_grpo": ("dr_grpo", "token"),
    "sapo": ("sapo", "token"),
    "cispo": ("cispo", "token"),
}


def _run_trl(
    trl: SimpleNamespace,
    loss_type: str,
    level: str,
    b: object,
    lp: torch.Tensor,
    *,
    beta: float,
    bias_kl: bool,
    eps_high: float,
    per_sequence_adv: bool,
) -> tuple[torch.Tensor, dict[str, list]]:
    n, t = b.mask.shape
    metrics: dict[str, dict[str, list]] = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (lp, b.entropy, None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=SimpleNamespace(
            use_bias_correction_kl=bias_kl,
            delta=None,
            sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05,
            steps_per_generation=1,
        ),
        loss_type="grpo" if loss_type == "gspo" else loss_type,
        epsilon_low=0.2,
        epsilon_high=eps_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=t,
        _entropy_bonus_enabled=False,
        accelerator=SimpleNamespace(
            gather=lambda x: x, reduce=lambda x, reduction="sum": x, num_processes=1, gather_for_metrics=lambda x: x
        ),
        _metrics=metrics,
    )
    inputs = {
        "prompt_ids": torch.ones(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.ones(n, t, dtype=torch.long),
        "completion_mask": b.mask.long(),
        "advantages": b.adv[:, 0] if per_sequence_adv else b.adv,
        "old_per_token_logps": b.old,
        "ref_per_token_logps": b.ref,
        "num_items_in_batch": b.mask.sum().float(),
    }
    loss = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, metrics["train"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", list(LOSSES))
def test_compute_loss(trl: SimpleNamespace, loss_type: str, beta: float, dtype: torch.dtype) -> None:
    variant, level = LOSSES[loss_type]
    b = make_batch(21, dtype)
    per_sequence_adv = loss_type in ("gspo", "dr_grpo")  # TRL's (B,) advantages; the others per token
    adv = b.adv[:, :1].expand_as(b.adv) if per_sequence_adv else b.adv
    eps_high = 5.0 if loss_type == "cispo" else 0.28  # TRL's CISPO cap is absolute
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    peer, logged = _run_trl(
        trl, loss_type, level, b, lp_peer, beta=beta, bias_kl=True, eps_high=eps_high, per_sequence_adv=per_sequence_adv
    )
    num, den = grpo_family_loss_terms(
        variant,
        lp_ours,
        b.old,
        b.ref,
        adv,
        b.mask,
        None,
        clip_low=0.2,
        clip_high=eps_high - 1.0 if loss_type == "cispo" else eps_high,
        beta=beta,
        max_completion_length=b.mask.shape[1],
        tau_pos=1.0,
        tau_neg=1.05,
        convention="trl",
    )
    ours = num / den
    # TRL builds SAPO's temperatures with torch.where on Python floats: a float32 tensor, so in float64 its
    # τ₋ is float32(1.05) (a relative 5e-8).
    tol_dtype = torch.float32 if loss_type == "sapo" and dtype == torch.float64 else dtype
    close(ours, peer, tol_dtype, f"{loss_type} loss")
    (g_peer,) = torch.autograd.grad(peer, lp_peer)
    (g_ours,) = torch.autograd.grad(ours, lp_ours)
    close(torch.where(b.mask, g_ours, 0), torch.where(b.mask, g_peer, 0), tol_dtype, f"{loss_type} gradient")
    if beta:
        close(trl_logged_kl(b.lp, b.old, b.ref, b.mask, importance_sampling_level=level), logged["kl"][0], dtype, "kl")
    if loss_type in ("grpo", "gspo", "bnpo", "dapo", "dr_grpo"):
        clip = trl_clip_ratio_metrics(
            b.lp, b.old, b.adv[:, 0] if per_sequence_adv else adv, b.mask, epsilon_low=0.2, epsilon_high=eps_high,
            importance_sampling_level=level,
        )
        for key, value in clip.items():
            close(value, logged[f"clip_ratio/{key}"][0], torch.float32, f"clip_ratio/{key}")
    if loss_type == "cispo":
        close(
            trl_cispo_clip_ratio(b.lp, b.old, adv, b.mask, epsilon_high=eps_high),
            logged["cispo_clip_ratio"][0],
            torch.float32,
            "cispo_clip_ratio",
        )


@pytest.mark.parametrize("per_sequence_adv", [True, False])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_ratios_follow_the_advantages_shape(trl: SimpleNamespace, level: str, per_sequence_adv: bool) -> None:
    # TRL 1.16 averages clip_ratio/* over sequences only when coef_1 and the advantages are both one per sequence
    # ((B, 1) sequence ratio, (B,) advantages); per-token advantages at sequence level give token means.
    b = make_batch(21, torch.float64)
    _, logged = _run_trl(trl, "grpo", level, b, b.fresh_lp(), beta=0.0, bias_kl=True, eps_high=0.28,
                         per_sequence_adv=per_sequence_adv)
    adv = b.adv[:, 0] if per_sequence_adv else b.adv
    clip = trl_clip_ratio_metrics(b.lp, b.old, adv, b.mask, epsilon_low=0.2, epsilon_high=0.28,
                                  importance_sampling_level=level)
    for key, value in clip.items():
        close(value, logged[f"clip_ratio/{key}"][0], torch.float32, f"clip_ratio/{key}")  # TRL logs float32 means


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "sapo"])
def test_extreme_ratios_are_not_clamped_under_the_trl_convention(trl: SimpleNamespace, loss_type: str) -> None:
    # TRL takes exp of the raw log-ratio; grpo-cli's own (twinkle's) loss clamps it to ±20 first.
    variant, level = LOSSES[loss_type]
    b = make_batch(3, torch.float64)
    b.old[7, :3] = b.lp[7, :3].detach() - torch.tensor([25.0, -24.0, 30.0], dtype=torch.float64)
    per_sequence_adv = loss_type == "gspo"
    adv = b.adv[:, :1].expand_as(b.adv) if per_sequence_adv else b.adv
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    peer, _ = _run_trl(trl, loss_type, level, b, lp_peer, beta=0.04, bias_kl=True, eps_high=0.28,
                       per_sequence_adv=per_sequence_adv)
    num, den = grpo_family_loss_terms(variant, lp_ours, b.old, b.ref, adv, b.mask, None, clip_low=0.2, clip_high=0.28,
                                      beta=0.04, max_completion_length=b.mask.shape[1], tau_pos=1.0, tau_neg=1.05,
                                      convention="trl")
    ours = num / den
    close(ours, peer, torch.float64, f"{loss_type} loss")
    (g_peer,) = torch.autograd.grad(peer, lp_peer)
    (g_ours,) = torch.autograd.grad(ours, lp_ours)
    close(torch.where(b.mask, g_ours, 0), torch.where(b.mask, g_peer, 0), torch.float64, f"{loss_type} gradient")
    clamped, _ = grpo_family_loss_terms(variant, b.lp.detach(), b.old, b.ref, adv, b.mask, None, clip_low=0.2,
                                        clip_high=0.28, beta=0.04, max_completion_length=b.mask.shape[1],
                                        tau_pos=1.0, tau_neg=1.05, convention="twinkle",
                                        use_bias_correction_kl=True)
    assert not torch.isclose(clamped / den, peer.detach().to(torch.float64), rtol=1e-6)  # the clamp would differ


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_bias_correction_off_matches_grpo_cli_default(trl: SimpleNamespace, loss_type: str) -> None:
    # TRL with use_bias_correction_kl=False is grpo-cli's (and twinkle's) uncorrected KL term.
    b = make_batch(22, torch.float64)
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    peer, logged = _run_trl(
        trl, loss_type, "token", b, lp_peer, beta=0.1, bias_kl=False, eps_high=0.2, per_sequence_adv=False
    )
    num, den = grpo_family_loss_terms(loss_type, lp_ours, b.old, b.ref, b.adv, b.mask, None, beta=0.1)
    close(num / den, peer, torch.float64, "loss")
    (g_peer,) = torch.autograd.grad(peer, lp_peer)
    (g_ours,) = torch.autograd.grad(num / den, lp_ours)
    close(torch.where(b.mask, g_ours, 0), torch.where(b.mask, g_peer, 0), torch.float64, "gradient")
    close(trl_logged_kl(b.lp, b.old, b.ref, b.mask, use_bias_correction_kl=False), logged["kl"][0], torch.float64, "kl")


# ------------------------------------------------------------------------------------------------------------
# vLLM importance sampling (``_generate_and_score_completions``)
# ------------------------------------------------------------------------------------------------------------

IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _trl_block(trl: SimpleNamespace, start: str, end: str) -> str:
    """The lines of TRL's own ``_generate_and_score_completions`` from ``start`` up to ``end`` (exclusive),
    dedented: the method needs a generation backend, so the tier runs its importance-sampling blocks alone."""
    import inspect
    import textwrap

    source = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    i = source.index(start)
    j = source.index(end, i)
    first_line = source.rfind("\n", 0, i) + 1
    return textwrap.dedent(source[first_line:j])


def _run_trl_sampling(trl: SimpleNamespace, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, *,
                      mode: str, clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, dict]:
    import math

    ratio_code = _trl_block(trl, "if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                            "                mask = completion_mask",
                            "# Compute the per-token log probabilities for the reference model")
    metrics_code = _trl_block(trl, "if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                              "            delta = torch.abs", "output = {")
    metrics: dict[str, dict[str, list]] = {"train": defaultdict(list)}
    trainer = SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max,
        accelerator=SimpleNamespace(gather=lambda x: x.reshape(1)), _metrics=metrics,
    )
    scope = {"self": trainer, "torch": torch, "math": math, "completion_mask": mask.long(), "tool_mask": None,
             "old_per_token_logps": old, "sampling_per_token_logps": sampling, "mode": "train", "device": old.device,
             "nanmin": trl.grpo_trainer.nanmin, "nanmax": trl.grpo_trainer.nanmax}
    # TRL's own released code, read from the pinned wheel
    exec(ratio_code, scope)
    exec(metrics_code, scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[0] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 2.0), (0.9, None)])
@pytest.mark.parametrize("mode", IS_MODES)
def test_vllm_importance_sampling(trl: SimpleNamespace, mode: str, clip: tuple, dtype: torch.dtype) -> None:
    b = make_batch(23, dtype)
    sampling = b.roll.clone()
    sampling[0, 1] = float("nan")  # a token vLLM could not score
    clip_min, clip_max = clip
    ratio_peer, logged = _run_trl_sampling(trl, b.old, sampling, b.mask, mode=mode, clip_min=clip_min,
                                           clip_max=clip_max)
    ratio, ours = trl_sampling_metrics(b.old, sampling, b.mask, mode=mode, clip_min=clip_min, clip_max=clip_max)
    if mode.startswith("token"):
        close(torch.where(b.mask, ratio, 0), torch.where(b.mask, ratio_peer, 0), dtype, f"{mode} ratio")
    else:
        close(ratio, ratio_peer, dtype, f"{mode} ratio")
    assert set(logged) == {f"sampling/{k}" for k in ours}
    for key, value in ours.items():
        close(value, logged[f"sampling/{key}"], dtype, f"sampling/{key} ({mode}, {clip})")

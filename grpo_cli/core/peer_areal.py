"""AReaL's logged actor statistics (``areal/trainer/ppo/actor.py``: ``grpo_loss_fn``,
``_log_proximal_approximation_stats``, ``_log_version_staleness_stats``; ``areal/utils/stats_tracker.py``).
Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.core._loss_common import (
    as_bool_mask,
    check_same_shape,
    compute_dtype,
)
from grpo_cli.core._peer_common import (
    F64,
    masked_max,
    masked_mean,
    masked_min,
    where,
)
from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.ppo import ppo_actor_loss
from grpo_cli.core.rejection import RejectionSamplingConfig

__all__ = [
    "areal_actor_stats",
    "areal_kl_div_stats",
    "areal_kl_div_terms",
    "areal_staleness",
    "areal_token_stats",
    "areal_version_stats",
]


def areal_token_stats(values: Tensor, mask: Tensor) -> dict[str, float]:
    """AReaL ``stats_tracker.stat`` reductions: ``avg`` (Σ over the denominator mask / its count) and the
    ``min``/``max`` companions over the same mask (AReaL's ``<key>/avg``, ``<key>/min``, ``<key>/max``;
    ``actor_loss``, ``approx_kl``, ``new_logp``, ``old_logp``, ``entropy``, ``kl_div_*``, ``behave_approx_kl``,
    ...). An empty mask gives ``{}``: AReaL drops a reduction whose denominator is empty.

    Example:
        >>> areal_token_stats(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([1, 0, 1]))
        {'avg': 2.0, 'min': 1.0, 'max': 3.0}
    """
    m = as_bool_mask(mask, "mask")
    check_same_shape("values", values, mask=m)
    if not bool(m.any()):
        return {}
    v = values.detach()
    v = v.to(compute_dtype(v.dtype)) if v.is_floating_point() else v.to(F64)
    return {"avg": masked_mean(v, m), "min": masked_min(v, m), "max": masked_max(v, m)}


def areal_kl_div_terms(log_ratio: Tensor) -> dict[str, Tensor]:
    """AReaL's per-token ``kl_div_{direct,taylor,dual}`` of ``log ρ = ℓθ − ℓ_behave``: ``−log ρ``, ``(log ρ)²/2``
    and ``ρ − 1 − log ρ`` (``_log_proximal_approximation_stats``). The batch figures (:func:`areal_kl_div_stats`)
    and the streaming ``--names areal`` group both call it.

    Example:
        >>> {k: round(v.item(), 4) for k, v in areal_kl_div_terms(torch.tensor([-1.0])).items()}
        {'kl_div_direct': 1.0, 'kl_div_taylor': 0.5, 'kl_div_dual': 0.3679}
    """
    return {"kl_div_direct": -log_ratio, "kl_div_taylor": log_ratio * log_ratio / 2.0,
            "kl_div_dual": k3_of_log_weight(log_ratio)}


def areal_kl_div_stats(logprobs: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """AReaL's ``compute_logp/kl_div_{direct,taylor,dual}/{avg,min,max}`` (``_log_proximal_approximation_stats``).

    ``log ρ = float32(ℓθ) − float32(ℓ_behave)``: ``direct = −log ρ``, ``taylor = (log ρ)²/2``,
    ``dual = ρ − 1 − log ρ``, reduced by :func:`areal_token_stats` over ``mask`` (AReaL's ``behave_mask``
    when rejection sampling runs, else the loss mask).

    Example:
        >>> s = areal_kl_div_stats(torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([True]))
        >>> s["kl_div_direct/avg"], s["kl_div_taylor/avg"]
        (-1.0, 0.5)
    """
    m = as_bool_mask(mask, "mask")
    check_same_shape("logprobs", logprobs, old_logp=old_logp, mask=m)
    dt = torch.promote_types(torch.promote_types(logprobs.dtype, old_logp.dtype), torch.float32)
    log_ratio = where(m, logprobs.detach().to(dt) - old_logp.detach().to(dt))
    out: dict[str, float] = {}
    for name, v in areal_kl_div_terms(log_ratio).items():
        for k, x in areal_token_stats(v, m).items():
            out[f"{name}/{k}"] = x
    return out


def areal_staleness(versions: Tensor, current_version: Tensor | int, keep: Tensor) -> Tensor:
    """AReaL's ``sample_staleness_theta`` of the generated tokens (``version ≥ 0``) that ``keep`` holds:
    ``current_version − version`` (``_log_version_staleness_stats``; the proximal staleness is one less, its
    ``v_proximal`` being ``current − 1``). ``current_version``: one int, or a tensor broadcastable to ``versions``.
    The batch function :func:`areal_version_stats` and the streaming ``--names areal`` group both call it.

    Example:
        >>> areal_staleness(torch.tensor([3, 5, -1]), 6, torch.tensor([True, True, True])).tolist()
        [3, 1]
    """
    return (current_version - versions)[keep & (versions >= 0)]


def areal_version_stats(versions: Tensor, current_version: int, mask: Tensor) -> dict[str, float]:
    """AReaL's ``version_stats/*`` (``_log_version_staleness_stats``).

    Over tokens with ``mask`` and ``version ≥ 0`` (generated tokens): ``sample_staleness_proximal_{avg,max,min}``
    of ``(v − 1) − version`` and ``sample_staleness_theta_{avg,max,min}`` of ``v − version``,
    ``v_theta = v``, ``v_proximal = v − 1``, ``n_valid_generated_tokens``. AReaL passes its ``behave_mask`` as
    ``mask`` when rejection sampling runs, so only the tokens the filter keeps count (pass the mask after
    rejection sampling to match); without rejection sampling the loss mask. Empty: ``{}`` (AReaL logs nothing).

    Example:
        >>> areal_version_stats(torch.tensor([3, 5, -1]), 6, torch.tensor([1, 1, 1]))["sample_staleness_theta_avg"]
        2.0
    """
    m = as_bool_mask(mask, "mask")
    check_same_shape("versions", versions, mask=m)
    theta = areal_staleness(versions, current_version, m).to(F64)
    n = theta.numel()
    if n == 0:
        return {}
    out: dict[str, float] = {}
    for name, lag in (("proximal", theta - 1.0), ("theta", theta)):
        out[f"sample_staleness_{name}_avg"] = float(lag.mean())
        out[f"sample_staleness_{name}_max"] = float(lag.max())
        out[f"sample_staleness_{name}_min"] = float(lag.min())
    out["v_theta"] = float(current_version)
    out["v_proximal"] = float(current_version - 1)
    out["n_valid_generated_tokens"] = float(n)
    return out


def areal_actor_stats(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    entropy: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    convention: str | None = "areal",
) -> dict[str, float]:
    """Everything AReaL's PPO actor logs for one micro-batch (``grpo_loss_fn`` with the PPO loss), by key.

    Keys are those of AReaL's ``stats_tracker.export()`` inside the ``ppo_actor/update`` scope (prefix left
    out). Denominators (sums): ``n_valid_tokens`` (the loss mask, before rejection sampling),
    ``clipped_tokens``, ``dual_clipped_tokens``, ``unclipped_behave_tokens`` (AReaL's ``behave_mask``, with
    rejection sampling). ``<key>/{avg,min,max}`` (:func:`areal_token_stats`) of ``importance_weight``,
    ``approx_kl`` (ℓθ − ℓp), ``new_logp``, ``old_logp`` (behaviour), ``entropy``, ``actor_loss``,
    ``clip_ratio``, ``dual_clip_ratio`` over ``n_valid_tokens``; ``behave_imp_weight``, ``behave_approx_kl``
    over ``unclipped_behave_tokens``; ``clipped_new_logp``, ``clipped_old_logp`` over ``clipped_tokens``;
    ``rs_filtered_fraction``; ``compute_logp/prox_logp_gt/*`` and ``compute_logp/kl_div_*/*``
    (:func:`areal_kl_div_stats`, θ vs behaviour) over the behave mask (else the loss mask); with ``versions``
    and ``current_version`` the ``version_stats/*`` of :func:`areal_version_stats` over the same mask, so only
    the tokens rejection sampling keeps count.

    Under ``importance_sampling_level="sequence"`` ``importance_weight`` and ``clip_ratio`` come from the
    sequence ratio and the sequence-mean advantage (AReaL's GSPO path), never from token ratios. ``convention``
    goes to :func:`~grpo_cli.core.ppo.ppo_actor_loss` (``"areal"``: AReaL 1.0.4's statistics masks). ``n_tokens``
    and the ``vocab_*_logits`` need model data and are left out.

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 1.0]])); zero = torch.zeros(1, 2)
        >>> s = areal_actor_stats(lp, zero, zero, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
        >>> s["clip_ratio/avg"], s["n_valid_tokens"], s["importance_weight/max"]
        (0.5, 2.0, 1.5)
    """
    m = as_bool_mask(loss_mask, "loss_mask")
    _, st = ppo_actor_loss(
        logprobs.detach(),
        proximal_logprobs,
        old_logprobs,
        advantages,
        eps_clip,
        m,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        rejection_sampling=rejection_sampling,
        importance_sampling_level=importance_sampling_level,
        convention=convention,
    )
    out: dict[str, float] = {
        "n_valid_tokens": float(m.sum()),
        "clipped_tokens": float(st["clip_mask"].sum()),
        "dual_clipped_tokens": float(st["dual_clip_mask"].sum()),
    }

    def put(prefix: str, values: Tensor, mask: Tensor) -> None:
        for k, v in areal_token_stats(values, mask).items():
            out[f"{prefix}/{k}"] = v

    per_token = {
        "importance_weight": st["importance_weight"],
        "approx_kl": st["approx_kl"],
        "new_logp": logprobs.detach(),
        "old_logp": old_logprobs.detach(),
        "entropy": entropy,
        "actor_loss": st["loss"],
        "clip_ratio": st["clip_mask"].to(torch.float32),
        "dual_clip_ratio": st["dual_clip_mask"].to(torch.float32),
    }
    for key, values in per_token.items():
        if values is not None:
            put(key, values, m)
    logp_mask = m
    if "behave_mask" in st:
        logp_mask = st["behave_mask"]
        out["unclipped_behave_tokens"] = float(logp_mask.sum())
        put("behave_imp_weight", st["behave_imp_weight"], logp_mask)
        put("behave_approx_kl", st["behave_approx_kl"], logp_mask)
        out["rs_filtered_fraction"] = float(st["filtered_fraction"])
    put("clipped_new_logp", logprobs.detach(), st["clip_mask"])
    put("clipped_old_logp", old_logprobs.detach(), st["clip_mask"])
    out["compute_logp/n_valid_tokens"] = float(logp_mask.sum())
    put("compute_logp/prox_logp_gt", proximal_logprobs.detach(), logp_mask)
    for k, v in areal_kl_div_stats(logprobs, old_logprobs, logp_mask).items():
        out[f"compute_logp/{k}"] = v
    if versions is not None and current_version is not None:
        for k, v in areal_version_stats(versions, current_version, logp_mask).items():
            out[f"version_stats/{k}"] = v
    return out

"""twinkle 0.5.1's GRPO-family loss classes (``twinkle/loss/grpo.py``) against grpo-cli's GRPO-family core."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _batches import close, make_batch

from grpo_cli.core import grpo_family_loss_terms

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# twinkle class -> grpo-cli variant
CLASSES = {
    "GRPOLoss": "grpo",
    "GSPOLoss": "gspo",
    "SAPOLoss": "sapo",
    "CISPOLoss": "cispo",
    "BNPOLoss": "bnpo",
    "DRGRPOLoss": "dr_grpo",
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("cls", list(CLASSES))
def test_loss_classes(twinkle: SimpleNamespace, cls: str, beta: float, dtype: torch.dtype) -> None:
    variant = CLASSES[cls]
    b = make_batch(31, dtype)
    n, t = b.mask.shape
    labels = torch.where(b.mask, torch.ones(n, t, dtype=torch.long), torch.full((n, t), -100))
    seq_adv = b.adv[:, 0]  # one advantage per sequence, as twinkle's trainers pass it
    kwargs = {"max_completion_length": t} if cls == "DRGRPOLoss" else {}
    loss_fn = getattr(twinkle.loss, cls)(epsilon=0.2, epsilon_high=0.28, beta=beta, **kwargs)
    lp_peer, lp_ours = b.fresh_lp(), b.fresh_lp()
    peer = loss_fn({"labels": labels}, {"logps": lp_peer}, old_logps=b.old, ref_logps=b.ref, advantages=seq_adv)
    peer = peer["loss"] if isinstance(peer, dict) else peer.loss
    # twinkle's CISPOLoss caps the ratio at 1 + epsilon and ignores epsilon_high; grpo-cli's cap is 1 + clip_high.
    clip_high = 0.2 if cls == "CISPOLoss" else 0.28
    num, den = grpo_family_loss_terms(
        variant,
        lp_ours,
        b.old,
        b.ref,
        seq_adv[:, None].expand(n, t),
        b.mask,
        None,
        clip_low=0.2,
        clip_high=clip_high,
        beta=beta,
        max_completion_length=t,
        convention="twinkle",
    )
    ours = num / den
    close(ours, peer, dtype, f"{cls} loss")
    (g_peer,) = torch.autograd.grad(peer, lp_peer)
    (g_ours,) = torch.autograd.grad(ours, lp_ours)
    close(torch.where(b.mask, g_ours, 0), torch.where(b.mask, g_peer, 0), dtype, f"{cls} gradient")

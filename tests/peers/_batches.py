"""Generated padded batches for the peers tier, with the edge cases every comparison must survive.

Rows (``B = 10``, ``T = 7``): ordinary rows, an all-masked row, a one-token row, a row with a masked hole inside
the response (tool/observation tokens), a row whose log-ratios sit exactly on ``log(1 ± 0.2)`` (the clip
bounds) and a row with ratios near ``1e3`` and ``1e-3``. Advantages are per token; groups of two rows, one with
equal scores (zero variance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

B, T = 10, 7


@dataclass
class Batch:
    lp: Tensor  # current policy log-probs (leaf; the gradient target)
    old: Tensor  # old / proximal log-probs
    roll: Tensor  # rollout (behaviour) log-probs
    ref: Tensor  # reference log-probs
    adv: Tensor  # per-token advantages
    mask: Tensor  # bool response / loss mask
    scores: Tensor  # one outcome score per row
    group: Tensor  # group index per row (pairs)
    entropy: Tensor  # per-token entropies

    def fresh_lp(self) -> Tensor:
        """A new leaf copy of ``lp`` so each side gets its own gradient."""
        return self.lp.detach().clone().requires_grad_(True)


def make_batch(seed: int = 0, dtype: torch.dtype = torch.float32) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    roll = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    ref = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False  # padding
    mask[1, :] = False  # all-masked row
    mask[2, 1:] = False  # one-token sequence
    mask[3, 2:4] = False  # masked hole inside the response
    mask[4, 6:] = False
    # Row 5: ratios exactly on the clip bounds (and their advantages of both signs).
    old[5] = lp[5] - torch.tensor([math.log(1.2), math.log(0.8)] * 3 + [0.0], dtype=torch.float64)
    adv[5] = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.5, -0.5, 0.0], dtype=torch.float64)
    # Row 6: ratios near 1e3 and 1e-3 against old and rollout.
    old[6] = lp[6] - torch.tensor([math.log(1e3), -math.log(1e3)] * 3 + [0.0], dtype=torch.float64)
    roll[6] = old[6] + torch.tensor([math.log(1e3), -math.log(1e3), 0.0, 0.1, -6.0, 6.0, 0.0], dtype=torch.float64)
    lp = torch.where(mask, lp, torch.full_like(lp, -1.0))
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0], dtype=torch.float64)  # pair 2: equal
    group = torch.arange(B) // 2
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    cast = lambda x: x.to(dtype)  # noqa: E731
    return Batch(
        lp=cast(lp).requires_grad_(True),
        old=cast(old),
        roll=cast(roll),
        ref=cast(ref),
        adv=cast(adv),
        mask=mask,
        scores=scores,
        group=group,
        entropy=cast(entropy),
    )


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances for comparing a peer's value with grpo-cli's in ``dtype`` (grpo-cli sums in float64)."""
    if dtype == torch.float64:
        # verl divides by Σm + 1e-8 where grpo-cli divides by Σm: a relative 1e-8 / n per mean, which a later
        # difference of means can turn into an absolute 1e-9 on values of order 1.
        return {"rel": 1e-8, "abs": 1e-9}
    if dtype == torch.float32:
        return {"rel": 2e-5, "abs": 1e-6}
    return {"rel": 2e-2, "abs": 2e-2}  # bfloat16: peers sum in bf16


def close(actual: object, expected: object, dtype: torch.dtype, what: str) -> None:
    """Assert two tensors/numbers agree within :func:`tol` (NaN only where both are NaN)."""
    a = torch.as_tensor(actual, dtype=torch.float64).detach().cpu()
    e = torch.as_tensor(expected, dtype=torch.float64).detach().cpu()
    assert a.shape == e.shape or a.numel() == e.numel(), f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    a, e = a.reshape(-1), e.reshape(-1)
    t = tol(dtype)
    ok = torch.isclose(a, e, rtol=t["rel"], atol=t["abs"], equal_nan=True)
    where = (~ok).nonzero().flatten().tolist()
    assert bool(ok.all()), f"{what}: grpo-cli {a[~ok].tolist()} != peer {e[~ok].tolist()} at {where}"

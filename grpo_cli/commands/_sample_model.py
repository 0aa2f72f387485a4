"""A tiny causal transformer used by :mod:`grpo_cli.commands.sample` to produce real GRPO rollouts.

Private module: nothing here is part of the public API. The model is deliberately plain (pre-LayerNorm blocks,
hand-written causal attention, learned absolute positions, tied nothing) so that the same module runs in
float32 (trainer) and in bfloat16 (the "inference engine" copy of a weight snapshot) without any fused kernel
choosing a different code path per dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    """One pre-LN transformer block: x + Attn(LN(x)), then x + MLP(LN(x)) (GPT-2 layout)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        dh = d // self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, dh).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        # Causal mask via where (not an additive -inf) so bfloat16 never sees inf arithmetic.
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        att = scores.softmax(dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyCausalLM(nn.Module):
    """Token ids ``[B, T]`` -> next-token logits ``[B, T, vocab_size]`` in the module's dtype.

    Right padding is harmless: attention is causal, so positions after a sequence's end never influence the
    positions inside it.

    Example:
        >>> m = TinyCausalLM(vocab_size=13, max_len=16)
        >>> m(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 13])
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int = 32,
        n_heads: int = 2,
        n_layers: int = 2,
        d_ff: int = 64,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

"""Independent float64 references in plain Python (loops over sequences and tokens), for tests only.

Nothing here imports grpo_cli: figures are recomputed from their written definitions so that a test compares the
implementation with the definition, never with itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


@dataclass
class Seq:
    new: list[float]
    old: list[float] | None = None
    prox: list[float] | None = None
    ref: list[float] | None = None
    entropy: list[float] | None = None
    mask: list[int] | None = None
    versions: list[int] | None = None
    advantage: float | None = None
    reward: float | None = None
    current_version: int | None = None
    step: int | None = None
    group_id: int | None = None
    extra: dict = field(default_factory=dict)

    def valid(self) -> list[int]:
        mask = self.mask if self.mask is not None else [1] * len(self.new)
        return [t for t, m in enumerate(mask) if m]


def policy_reference(seqs: list[Seq], eps: float = 0.2, eps_high: float | None = None) -> dict[str, float]:
    """The GRPOMetric-family figures (analyze keys) by their definitions; ratio base = prox if given else old."""
    eps_high = eps if eps_high is None else eps_high
    lo, hi = np.float32(1 - eps), np.float32(1 + eps_high)  # float32 data compares against float32 bounds
    n = 0
    s_new = s_old = s_diff = s_k3 = 0.0
    k3_max = ratio_max = -math.inf
    clip_low = clip_high = c_low = c_high = 0
    seqs_used = seq_low = seq_high = 0
    ent_n, ent_s = 0, 0.0
    for s in seqs:
        idx = s.valid()
        log_ratios, advs = [], []
        for t in idx:
            new = float(s.new[t])
            n += 1
            s_new += new
            if s.entropy is not None:
                ent_n += 1
                ent_s += float(s.entropy[t])
            if s.old is not None:
                d = new - float(s.old[t])
                s_old += float(s.old[t])
                s_diff += d
                k3 = math.exp(d) - 1 - d
                s_k3 += k3
                k3_max = max(k3_max, k3)
            base = s.prox if s.prox is not None else s.old
            if base is not None:
                lr = float(np.float32(s.new[t]) - np.float32(base[t]))
                r = np.float32(math.exp(lr))
                ratio_max = max(ratio_max, float(r))
                c_low += r < lo
                c_high += r > hi
                if s.advantage is not None:
                    a = s.advantage
                    clip_low += (r < lo) and a < 0
                    clip_high += (r > hi) and a > 0
                    log_ratios.append(lr)
                    advs.append(a)
        if log_ratios:
            seqs_used += 1
            sr = np.float32(math.exp(sum(log_ratios) / len(log_ratios)))
            a = sum(advs) / len(advs)
            seq_low += (sr < lo) and a < 0
            seq_high += (sr > hi) and a > 0
    out: dict[str, float] = {"n_valid_tokens": n, "logp/new_mean": s_new / n,
                             "policy_confidence": math.exp(s_new / n)}
    if ent_n:
        out["entropy/mean"] = ent_s / ent_n
    if seqs and seqs[0].old is not None:
        out.update({"logp/old_mean": s_old / n, "logp/diff_mean": s_diff / n, "kl/k3": s_k3 / n,
                    "kl/k3_token_max": k3_max})
    if ratio_max > -math.inf:
        out.update({"ratio/max": ratio_max, "clip/cispo_low": c_low / n, "clip/cispo_high": c_high / n,
                    "clip/cispo": (c_low + c_high) / n})
        if seqs[0].advantage is not None:
            out.update({"clip/low": clip_low / n, "clip/high": clip_high / n,
                        "clip/ratio": (clip_low + clip_high) / n, "clip/seq_low": seq_low / seqs_used,
                        "clip/seq_high": seq_high / seqs_used, "clip/seq_ratio": (seq_low + seq_high) / seqs_used})
    return out


def random_sequences(
    n_seq: int = 60, seed: int = 0, *, with_prox: bool = False, max_len: int = 40, spread: float = 0.3
) -> list[Seq]:
    """Random but plausible sequences: log-probs ≤ 0, old/prox near new, prompt tokens masked."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n_seq):
        length = int(rng.integers(1, max_len))
        prompt = int(rng.integers(0, min(5, length)))
        new = -rng.exponential(1.0, length).astype(np.float32)
        old = np.minimum(new + rng.normal(0, spread, length), 0).astype(np.float32)
        prox = np.minimum(new + rng.normal(0, spread, length), 0).astype(np.float32)
        mask = [0] * prompt + [1] * (length - prompt)
        current = int(rng.integers(2, 8))
        versions = [-1] * prompt + [int(current - rng.integers(0, 3)) for _ in range(length - prompt)]
        seqs.append(Seq(
            new=new.tolist(), old=old.tolist(), prox=prox.tolist() if with_prox else None,
            ref=np.minimum(new + rng.normal(0, 0.1, length), 0).astype(np.float32).tolist(),
            entropy=rng.random(length).astype(np.float32).tolist(), mask=mask, versions=versions,
            advantage=float(np.float32(rng.normal())), reward=float(rng.integers(0, 2)), current_version=current,
            step=i // 10, group_id=i // 4,
        ))
    return seqs


def write_sequences(path: str, seqs: list[Seq], *, row_group_size: int = 16, token_layout: bool = False) -> None:
    """Write sequences as a schema-v1 file (sequence-per-row, or token-per-row with ``seq_id``)."""
    f32 = pa.float32()
    cols: dict[str, pa.Array] = {}
    first = seqs[0]
    per_token = {"new_logp": "new", "old_logp": "old", "prox_logp": "prox", "ref_logp": "ref", "entropy": "entropy"}
    if not token_layout:
        for name, attr in per_token.items():
            if getattr(first, attr) is not None:
                cols[name] = pa.array([getattr(s, attr) for s in seqs], pa.list_(f32))
        if first.mask is not None:
            cols["loss_mask"] = pa.array([s.mask for s in seqs], pa.list_(pa.int8()))
        if first.versions is not None:
            cols["versions"] = pa.array([s.versions for s in seqs], pa.list_(pa.int32()))
        seq_cols = {"advantages": ("advantage", f32), "rewards": ("reward", f32),
                    "current_version": ("current_version", pa.int64()), "step": ("step", pa.int64()),
                    "group_id": ("group_id", pa.int64())}
        for name, (attr, typ) in seq_cols.items():
            if getattr(first, attr) is not None:
                cols[name] = pa.array([getattr(s, attr) for s in seqs], typ)
        cols["seq_id"] = pa.array(list(range(len(seqs))), pa.int64())
    else:
        def tok(attr: str) -> list:
            return [v for s in seqs for v in getattr(s, attr)]

        def rep(attr: str) -> list:
            return [getattr(s, attr) for s in seqs for _ in s.new]

        for name, attr in per_token.items():
            if getattr(first, attr) is not None:
                cols[name] = pa.array(tok(attr), f32)
        if first.mask is not None:
            cols["loss_mask"] = pa.array(tok("mask"), pa.int8())
        if first.versions is not None:
            cols["versions"] = pa.array(tok("versions"), pa.int32())
        if first.advantage is not None:
            cols["advantages"] = pa.array(rep("advantage"), f32)
        if first.current_version is not None:
            cols["current_version"] = pa.array(rep("current_version"), pa.int64())
        if first.group_id is not None:
            cols["group_id"] = pa.array(rep("group_id"), pa.int64())
        cols["seq_id"] = pa.array([i for i, s in enumerate(seqs) for _ in s.new], pa.int64())
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)

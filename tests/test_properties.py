"""Property tests over every metric group ``analyze`` runs (``default_groups()``).

- merging states is commutative (bitwise) and associative (bitwise for counts, minima, maxima and top-k tables;
  float64 sums to 1e-12 relative, since float addition is not associative);
- splitting the sequences into batches anywhere and merging equals one pass;
- permuting the sequences changes no figure (``top_kl`` rows name other rows then: its values are compared);
- masked-out tokens may hold any garbage, NaN and ±inf included, without changing any figure (bitwise).

The batches go through the same path as ``analyze`` (validator → ``TokenBatch.valid`` → every group's update).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.state import MetricState, Reduce
from grpo_cli.engine.validate import BatchValidator, ValidationGroup
from grpo_cli.metrics import AnalyzeConfig, default_groups

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CONFIG = AnalyzeConfig(top_k=4, on_invalid="error")
REL = 1e-12


# -- data ------------------------------------------------------------------------------------------------------
def make_sequences(seed: int, n_seq: int) -> list[dict[str, Any]]:
    """Plausible sequences with every column: log-probs ≤ 0, versions within [−1, current], a few groups."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_seq):
        length = int(rng.integers(0, 13))
        new = -rng.exponential(1.0, length)
        current = int(rng.integers(0, 5))
        out.append({
            "new_logp": new,
            "old_logp": np.minimum(new + rng.normal(0, 0.4, length), 0),
            "prox_logp": np.minimum(new + rng.normal(0, 0.2, length), 0),
            "ref_logp": np.minimum(new + rng.normal(0, 0.3, length), 0),
            "teacher_logp": np.minimum(new + rng.normal(0, 0.3, length), 0),
            "entropy": rng.random(length) * 2,
            "loss_mask": rng.random(length) < 0.7,
            "versions": rng.integers(-1, current + 1, length),
            "advantages": np.full(length, rng.normal()),
            "rewards": float(rng.integers(0, 2)),
            "current_version": current,
            "step": i // 3,
            "group_id": int(rng.integers(0, 3)),
            "seq_id": i,
            "eos": int(rng.integers(0, 2)),
        })
    return out


PER_TOKEN = ("new_logp", "old_logp", "prox_logp", "ref_logp", "teacher_logp", "entropy", "advantages")
PER_SEQUENCE_INT = ("current_version", "step", "group_id", "seq_id", "eos")


def pack(seqs: list[dict[str, Any]], rows: list[int] | None = None) -> TokenBatch:
    """Sequences → one packed batch as the reader makes it (float32 values, int8 raw mask, int64 ints)."""
    lengths = [len(s["new_logp"]) for s in seqs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)

    def cat(name: str, dtype: torch.dtype) -> torch.Tensor:
        values = np.concatenate([np.asarray(s[name]) for s in seqs]) if seqs else np.zeros(0)
        return torch.tensor(values, dtype=dtype)

    kwargs = {name: cat(name, torch.float32) for name in PER_TOKEN}
    kwargs.update({name: torch.tensor([s[name] for s in seqs], dtype=torch.int64) for name in PER_SEQUENCE_INT})
    return TokenBatch(
        cu_seqlens=cu,
        loss_mask=cat("loss_mask", torch.int8),
        versions=cat("versions", torch.int64),
        rewards=torch.tensor([s["rewards"] for s in seqs], dtype=torch.float32),
        rows=torch.tensor(list(range(len(seqs))) if rows is None else rows, dtype=torch.int64),
        **kwargs,
    )


def accumulate(batches: list[TokenBatch]) -> tuple[list, list[MetricState]]:
    groups = default_groups()
    states = [group.init_state(CONFIG, "cpu") for group in groups]
    skip_counts = next(s for g, s in zip(groups, states) if isinstance(g, ValidationGroup))
    validator = BatchValidator(CONFIG.on_invalid)
    for batch in batches:
        batch = validator(batch, skip_counts)
        valid = batch.valid()
        for group, state in zip(groups, states):
            group.update(state, batch, valid, CONFIG)
    return groups, states


def figures(groups: list, states: list[MetricState]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group, state in zip(groups, states):
        out.update(group.compute(state, CONFIG))
    return out


def batches_of(seqs: list[dict[str, Any]], cuts: list[int]) -> list[TokenBatch]:
    """Split at sequence indices ``cuts``; rows stay the sequences' positions in the one 'file'."""
    bounds = [0, *sorted(set(cuts)), len(seqs)]
    return [pack(seqs[a:b], list(range(a, b))) for a, b in itertools.pairwise(bounds) if b > a]


# -- comparisons -----------------------------------------------------------------------------------------------
def same(a: Any, b: Any, rel: float, path: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, sorted(set(a) ^ set(b)))
        for key in a:
            same(a[key], b[key], rel, f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, rel, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), path
        else:
            assert b == pytest.approx(a, rel=rel, abs=1e-14 if rel else 0.0), (path, a, b)
    else:
        assert a == b, (path, a, b)


def same_states(a: list[MetricState], b: list[MetricState], *, float_sums_rel: float) -> None:
    for x, y in zip(a, b):
        for name, spec in x.specs.items():
            exact = not (spec.reduce is Reduce.SUM and spec.dtype.is_floating_point)
            tol = 0.0 if exact else float_sums_rel
            torch.testing.assert_close(x[name], y[name], rtol=tol, atol=tol * 1e-2, equal_nan=True,
                                       msg=lambda m, n=name: f"{n}: {m}")


def without_top_rows(metrics: dict[str, Any]) -> tuple[dict[str, Any], list]:
    """``top_kl`` and ``top_ratio`` name rows, which a permutation renames: compare their values as sorted multisets
    instead."""
    rest = {k: v for k, v in metrics.items() if k not in ("top_kl", "top_ratio")}
    table = sorted(tuple(r[c] for c in ("kl", "position", "ratio", "new_logp", "old_logp", "ratio_base"))
                   for r in metrics.get("top_kl", []))
    table += sorted(tuple(r[c] for c in ("ratio", "position", "new_logp", "base_logp"))
                    for r in metrics.get("top_ratio", []))
    return rest, table


# -- properties ------------------------------------------------------------------------------------------------
sizes = st.integers(min_value=1, max_value=12)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@SETTINGS
@given(seed=seeds, n=st.tuples(sizes, sizes, sizes))
def test_merge_is_commutative_and_associative(seed, n):
    seqs = make_sequences(seed, sum(n))
    parts = [accumulate([pack(seqs[a:b], list(range(a, b)))])[1]
             for a, b in ((0, n[0]), (n[0], n[0] + n[1]), (n[0] + n[1], sum(n)))]
    a, b, c = parts

    def merge(x, y):
        return [s.merge(t) for s, t in zip(x, y)]

    same_states(merge(a, b), merge(b, a), float_sums_rel=0.0)
    same_states(merge(merge(a, b), c), merge(a, merge(b, c)), float_sums_rel=REL)


@SETTINGS
@given(seed=seeds, n=st.integers(2, 30), cuts=st.lists(st.integers(1, 29), min_size=1, max_size=3))
def test_any_split_into_batches_equals_one_pass(seed, n, cuts):
    seqs = make_sequences(seed, n)
    one = figures(*accumulate([pack(seqs)]))
    split = figures(*accumulate(batches_of(seqs, [c for c in cuts if c < n])))
    same(one, split, REL)


@SETTINGS
@given(seed=seeds, n=st.integers(1, 30), data=st.data())
def test_permuting_sequences_changes_nothing(seed, n, data):
    seqs = make_sequences(seed, n)
    order = data.draw(st.permutations(range(n)))
    base, base_top = without_top_rows(figures(*accumulate([pack(seqs)])))
    # The permuted dump is a different file: its rows are numbered afresh.
    perm, perm_top = without_top_rows(figures(*accumulate([pack([seqs[i] for i in order])])))
    same(base, perm, REL)
    same(base_top, perm_top, 0.0)


GARBAGE = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 3.5, 0.0, -7.0])


@SETTINGS
@given(seed=seeds, n=st.integers(1, 20), data=st.data())
def test_masked_tokens_may_hold_any_garbage(seed, n, data):
    seqs = make_sequences(seed, n)
    dirty = []
    for s in seqs:
        s = dict(s)
        masked = ~s["loss_mask"]
        for name in PER_TOKEN:
            values = s[name].astype(np.float64).copy()
            values[masked] = [data.draw(GARBAGE) for _ in range(int(masked.sum()))]
            s[name] = values
        versions = s["versions"].copy()
        versions[masked] = data.draw(st.sampled_from([-1000, -2, 10**6]))
        s["versions"] = versions
        dirty.append(s)
    clean = figures(*accumulate([pack(seqs)]))
    garbage = figures(*accumulate([pack(dirty)]))
    same(clean, garbage, 0.0)  # bitwise: masked values must never enter any arithmetic that reaches a figure

"""The fast paths of the streaming pass (docs/performance.md) give the figures of the plain definitions.

Each optimisation is checked against a reference written here: the generic per-variant loss function, a plain
Python float64 loop, the ``torch.where`` formula of the histogram layout, or the slow path it replaces. Where the
fast path keeps the same floating-point operations in the same order, the comparison is bitwise.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import replace

import pytest
import torch

from grpo_cli.core import histogram as H
from grpo_cli.core.actor_stats import actor_stats_state, actor_stats_update
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.diagnosis._common import key_sums
from grpo_cli.core.grpo_family import GRPO_VARIANTS, grpo_family_loss_terms, grpo_family_valid_terms
from grpo_cli.core.packing import cu_seqlens_from_lengths, segment_ids, segment_span, segment_sum
from grpo_cli.core.staleness import lag_bin_sums
from grpo_cli.engine.parallel import one_torch_thread
from grpo_cli.engine.stream import prefetch, streamed
from grpo_cli.engine.validate import BatchValidator
from grpo_cli.metrics.actor import _first_valid_positions


def packed(lengths: list[int], *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    new = -torch.rand(n, generator=g) * 3
    old = (new + torch.randn(n, generator=g) * 0.3).clamp(max=0)
    ref = (new + torch.randn(n, generator=g) * 0.2).clamp(max=0)
    adv = torch.randn(len(lengths), generator=g).repeat_interleave(torch.tensor(lengths))
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    return [t.to(device=device, dtype=dtype) for t in (new, old, ref, adv)] + [cu.to(device)]


# -- the GRPO-family losses, all variants at once --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize(
    "options",
    [{}, {"beta": 0.05, "tau_pos": 1.5, "tau_neg": 0.7, "clip_high": 0.28, "max_completion_length": 64}],
)
def test_valid_terms_are_the_generic_terms_bit_for_bit(device, dtype, options):
    # Empty sequences included: they count in grpo/gspo/sapo's denominator with a zero numerator.
    new, old, ref, adv, cu = packed([5, 0, 9, 1, 0, 13], seed=3, dtype=dtype, device=device)
    fast = grpo_family_valid_terms(GRPO_VARIANTS, new, old, ref, adv, cu, **options)
    assert list(fast) == list(GRPO_VARIANTS)
    ones = torch.ones_like(new, dtype=torch.bool)
    for variant in GRPO_VARIANTS:
        num, den = grpo_family_loss_terms(variant, new, old, ref, adv, ones, cu, **options)
        assert torch.equal(fast[variant][0], num), variant
        assert torch.equal(fast[variant][1], den), variant


def test_valid_terms_with_no_tokens():
    new, old, ref, adv, cu = packed([0, 0], seed=1)
    terms = grpo_family_valid_terms(GRPO_VARIANTS, new, old, ref, adv, cu)
    # No token: every numerator is 0; bnpo/cispo divide by 0 tokens, the others by 2 sequences (dr_grpo: 2·1024).
    assert {v: (float(n), float(d)) for v, (n, d) in terms.items()} == {
        "grpo": (0.0, 2.0), "gspo": (0.0, 2.0), "sapo": (0.0, 2.0), "cispo": (0.0, 0.0), "bnpo": (0.0, 0.0),
        "dr_grpo": (0.0, 2048.0),
    }


# -- segmented sums and memoised segment ids ------------------------------------------------------------------------
def test_segment_sum_is_the_sequential_float64_sum(device):
    rng = random.Random(5)
    lengths = [rng.choice([0, 1, 7, 300, 2000]) for _ in range(40)]
    values = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(5), dtype=torch.float32) * 100
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    got = segment_sum(values.to(device), cu.to(device), torch.float64).cpu().tolist()
    start = 0
    for i, length in enumerate(lengths):
        total = 0.0
        for v in values[start:start + length].tolist():  # in token order, in float64 (Python floats)
            total += v
        assert got[i] == pytest.approx(total, rel=1e-13, abs=1e-12), i
        start += length
    if device == "cpu":
        # The segmented reduction runs through each sequence in token order, as the index_add_ it replaced did.
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        old = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, ids, values.to(torch.float64))
        assert torch.equal(torch.tensor(got, dtype=torch.float64), old)


@pytest.mark.parametrize("seed", range(3))
def test_segment_span_counts_and_finds_the_first_and_last_true_token(device, seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 5, 40]) for _ in range(60)]
    mask = [rng.random() < rng.choice([0.0, 0.1, 0.5, 1.0]) for _ in range(sum(lengths))]
    cu = cu_seqlens_from_lengths(torch.tensor(lengths)) + 3  # offsets need not start at 0
    count, first, last = (t.cpu().tolist() for t in segment_span(torch.tensor(mask, device=device), cu.to(device)))
    start = 0
    for i, length in enumerate(lengths):
        hits = [start + j for j in range(length) if mask[start + j]]
        assert count[i] == len(hits)
        assert first[i] == (hits[0] if hits else torch.iinfo(torch.int64).max)
        assert last[i] == (hits[-1] if hits else -1)
        start += length


@pytest.mark.parametrize("sorted_keys", [True, False])
def test_key_sums_add_each_keys_tokens_in_token_order(device, sorted_keys):
    rng = random.Random(11)
    lengths = [rng.choice([0, 1, 9, 200]) for _ in range(50)]
    keys = sorted(rng.randrange(7) for _ in lengths) if sorted_keys else [rng.randrange(7) for _ in lengths]
    values = torch.randn(3, sum(lengths), generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1e3
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    got = key_sums(values.to(device), torch.tensor(keys, device=device), cu.to(device), 7).cpu()
    want = [[0.0] * 7 for _ in range(3)]
    start = 0
    for key, length in zip(keys, lengths):
        for row in range(3):
            for v in values[row, start:start + length].tolist():  # Python floats: sequential float64 additions
                want[row][key] += v
        start += length
    if device == "cpu":
        assert got.tolist() == want  # the same additions in the same order: equal bits
    else:
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-9)


def test_a_run_of_sequences_is_the_masked_selection_as_views():
    new, old, _, _, cu = packed([3, 0, 5, 2, 4], seed=4)
    mask = torch.rand(new.numel(), generator=torch.Generator().manual_seed(1)) > 0.3
    batch = TokenBatch(cu_seqlens=cu, new_logp=new, old_logp=old, loss_mask=mask,
                       step=torch.tensor([1, 1, 2, 2, 3]))
    batch.valid()
    part = batch.sequence_range(1, 4)
    want = batch.select_sequences(torch.tensor([False, True, True, True, False]))
    for name in ("cu_seqlens", "new_logp", "old_logp", "loss_mask", "step"):
        assert torch.equal(getattr(part, name), getattr(want, name)), name
    assert part.new_logp.data_ptr() == batch.new_logp[3:].data_ptr()  # a view: nothing gathered
    for name in ("cu_seqlens", "new_logp", "positions"):
        assert torch.equal(getattr(part.valid(), name), getattr(want.valid(), name)), name
    # an index selection takes the sequences in the order given
    reordered = batch.select_sequences(torch.tensor([3, 0, 2]))
    assert reordered.cu_seqlens.tolist() == [0, 2, 5, 10]
    assert torch.equal(reordered.new_logp, torch.cat([new[8:10], new[0:3], new[3:8]]))
    assert reordered.step.tolist() == [2, 1, 2]


def test_segment_ids_are_memoised_and_never_stale():
    cu = torch.tensor([0, 2, 2, 5])
    first = segment_ids(cu, 5)
    assert first.tolist() == [0, 0, 2, 2, 2]
    assert segment_ids(cu, 5) is first  # the same tensor object: reused
    first[0] = 7  # a caller modifying the ids in place must not poison the memo
    assert segment_ids(cu, 5).tolist() == [0, 0, 2, 2, 2]
    cu[1] = 1  # nor may an in-place change of cu_seqlens be missed
    assert segment_ids(cu, 5).tolist() == [0, 1, 2, 2, 2]
    equal_values = torch.tensor([0, 1, 2, 5])
    assert segment_ids(equal_values, 5).tolist() == [0, 1, 2, 2, 2]


# -- torch.where skipped for all-true masks ---------------------------------------------------------------------------
@pytest.mark.parametrize("all_true", [True, False])
def test_fill_outside_equals_where_in_values_and_gradients(device, all_true):
    from grpo_cli.core._loss_common import fill_outside

    g = torch.Generator().manual_seed(4)
    values = torch.randn(1000, generator=g).to(device).requires_grad_()
    mask = torch.ones(1000, dtype=torch.bool, device=device)
    if not all_true:
        mask[::7] = False
    garbage = torch.where(mask, values, torch.tensor(float("nan"), device=device))  # NaN off the mask
    zero = torch.zeros((), device=device)
    got = fill_outside(mask, garbage, zero)
    want = torch.where(mask, garbage, zero)
    assert torch.equal(got, want) and got.dtype == want.dtype
    (grad_got,) = torch.autograd.grad((got * torch.arange(1000.0, device=device)).sum(), values, retain_graph=True)
    (grad_want,) = torch.autograd.grad((want * torch.arange(1000.0, device=device)).sum(), values)
    assert torch.equal(grad_got, grad_want)
    # Broadcasting or a promoting fill take the plain where: the same result as torch.where in every case.
    row = torch.ones(1, 1000, dtype=torch.bool, device=device)
    assert torch.equal(fill_outside(row.expand(3, 1000), values.detach(), 0.0), values.detach().expand(3, 1000))
    half = values.detach().to(torch.float16)
    out = fill_outside(mask, half, torch.zeros((), dtype=torch.float64, device=device))
    assert out.dtype == torch.where(mask, half, torch.zeros((), dtype=torch.float64, device=device)).dtype


# -- histogram bins without torch.where -----------------------------------------------------------------------------
def where_bins(values: torch.Tensor) -> torch.Tensor:
    """The layout's definition, one rule at a time (the formula before the in-place rewrite)."""
    x = values.to(torch.float32)
    key = x.view(torch.int32).to(torch.int64) >> (23 - H.MANTISSA_BITS)
    first = (127 + H.MIN_EXPONENT) << H.MANTISSA_BITS
    idx = torch.where(key >= first + H.N_MAIN, H.OVERFLOW, key - first + 2)
    idx = torch.where(key < first, H.UNDERFLOW, idx)
    idx = torch.where(x == 0, H.ZERO, idx)
    return torch.where(torch.isnan(x) | (x < 0), H.INVALID, idx)


def test_histogram_bins_match_the_layout_on_every_kind_of_value(device):
    special = [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 2.0**-64, 2.0**-64 * 0.999, 2.0**64,
               2.0**64 * 0.999, 1e-45, 3.4e38, -1e-30, -5.0, 1.0, 1.5]
    g = torch.Generator().manual_seed(2)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=g, dtype=torch.int32).view(torch.float32)
    values = torch.cat([torch.tensor(special), torch.exp(torch.randn(20000, generator=g) * 40), random_bits])
    positive = torch.exp(torch.randn(5000, generator=g) * 40)
    with_zeros = torch.cat([positive, torch.tensor([0.0, -0.0, 0.0])])  # ±0.0 but nothing below: the zero mask only
    only_negative_zero = torch.cat([positive, torch.tensor([-0.0])])
    with_nan = torch.cat([positive, torch.tensor([math.nan])])
    tiny_float64 = torch.tensor([1e-50, 2.0, 1e-300], dtype=torch.float64)  # positive, but 0 once in float32
    cases = (values, values.to(torch.float64), values[:9000].reshape(30, 300), positive, with_zeros,
             only_negative_zero, with_nan, tiny_float64, torch.empty(0))
    for v in cases:
        v = v.to(device)
        assert torch.equal(H.histogram_bins(v), where_bins(v))
        assert H.histogram_bins(v).dtype == torch.int64
        assert torch.equal(H.histogram_counts(v), torch.bincount(where_bins(v).reshape(-1), minlength=H.N_BINS))


# -- per-lag sums over runs ------------------------------------------------------------------------------------------
def test_lag_bin_sums_equal_float64_sums_per_bin(device):
    rng = random.Random(9)
    bins, values = [], []
    for _ in range(60):  # runs of one lag (a sequence), sometimes a token of another lag inside
        lag = rng.choice([0, 1, 2, 5, 64, 65])
        for _ in range(rng.randint(1, 30)):
            bins.append(lag if rng.random() > 0.1 else rng.choice([0, 3]))
            values.append(rng.uniform(-2, 2))
    present = sorted(set(bins))
    t_bins = torch.tensor(bins, device=device)
    t_values = torch.tensor(values, dtype=torch.float32, device=device)
    got = lag_bin_sums(t_bins, present, [t_values, t_values * 2])
    for b in range(66):
        expected = math.fsum(float(torch.tensor(v, dtype=torch.float32)) for v, k in zip(values, bins) if k == b)
        assert float(got[0][b]) == pytest.approx(expected, rel=1e-12, abs=1e-12), b
        assert float(got[1][b]) == pytest.approx(2 * expected, rel=1e-12, abs=1e-12), b
    # A single bin: the plain sum.
    one = lag_bin_sums(torch.full((5,), 3, device=device), [3], [torch.ones(5, device=device)])[0]
    assert float(one[3]) == 5.0 and float(one.sum()) == 5.0


# -- one compaction per batch, shared -------------------------------------------------------------------------------
def batch_with_masks() -> TokenBatch:
    lengths = [4, 3, 0, 5]
    n = sum(lengths)
    mask = torch.tensor([0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1, 1], dtype=torch.int8)  # sequence 1 has no valid token
    return TokenBatch(
        cu_seqlens=cu_seqlens_from_lengths(torch.tensor(lengths)),
        new_logp=-torch.arange(1, n + 1, dtype=torch.float32) / 10,
        loss_mask=mask,
        versions=torch.tensor([-1, 3, 3, -1, -1, -1, -1, 2, 2, -1, 2, 2]),
        current_version=torch.tensor([3, 3, 3, 4]),
        rows=torch.arange(4),
    )


def test_valid_view_is_built_once_and_shared_by_the_validator():
    batch = batch_with_masks()
    clean = BatchValidator("error")(batch)
    view = clean.valid()
    assert clean.valid() is view  # memoised
    fresh = replace(clean)._compact()  # what it must equal
    for name in ("cu_seqlens", "new_logp", "versions", "positions", "loss_mask"):
        assert torch.equal(getattr(view, name), getattr(fresh, name)), name
    assert view.positions.tolist() == [1, 2, 0, 1, 3, 4]
    assert replace(clean).memo() == {}  # a copy starts with an empty memo


def test_valid_views_and_key_runs_are_freed_without_the_cycle_collector():
    # A batch's valid view (and a key run's) must not refer to itself: a reference cycle keeps every batch's
    # tensors alive until the cyclic collector runs, which raised the peak RSS of a 20 M-token analyze by 400 MiB.
    import gc
    import weakref

    batch = BatchValidator("error")(batch_with_masks())
    view = batch.valid()
    assert view.valid() is view  # a valid view is its own valid view
    part = batch.sequence_range(2, 4)  # builds nothing new for the batch: slices its valid view
    assert part.valid().positions.tolist() == [0, 1, 3, 4]  # the last two sequences' valid tokens
    assert part.valid().new_logp.data_ptr() == view.new_logp[2:].data_ptr()
    assert part.valid().valid() is part.valid()
    refs = [weakref.ref(obj) for obj in (batch, view, part, part.valid())]
    enabled = gc.isenabled()
    gc.disable()
    try:
        del batch, view, part
        assert [ref() is None for ref in refs] == [True] * len(refs)
    finally:
        if enabled:
            gc.enable()


def test_valid_view_of_an_all_true_mask_equals_the_general_compaction():
    # Response-only dumps have no masked token: the view then gathers nothing, but must equal the gather's result
    # (an int8 mask of ones takes the general path on the same data).
    batch = batch_with_masks()
    fast = replace(batch, loss_mask=torch.ones(batch.n_tokens, dtype=torch.bool))._compact()
    general = replace(batch, loss_mask=torch.ones(batch.n_tokens, dtype=torch.int8))._compact()
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    assert fast.positions.tolist() == [p for n in lengths for p in range(n)]
    for name in ("cu_seqlens", "positions", "loss_mask", "new_logp", "versions", "current_version", "rows"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_memoised_computes_once_across_threads():
    # Metric threads ask for the same per-batch intermediate at once: one computes, the others wait for it.
    batch = batch_with_masks()
    calls: list[int] = []
    started = threading.Barrier(4)

    def compute() -> list[int]:
        calls.append(1)
        time.sleep(0.05)  # long enough for every other thread to arrive meanwhile
        return calls

    def ask(out: list) -> None:
        started.wait()
        out.append(batch.memoised("terms", compute))

    results: list = []
    threads = [threading.Thread(target=ask, args=(results,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 4 and all(r is calls for r in results)
    assert replace(batch).memoised("terms", lambda: "fresh") == "fresh"  # a copy has its own memo


def test_validator_fast_path_still_finds_every_problem():
    batch = batch_with_masks()
    bad = replace(batch, new_logp=batch.new_logp.clone())
    bad.new_logp[8] = float("nan")  # a valid token (sequence 3, position 1)
    with pytest.raises(Exception, match="row 3, token 1"):
        BatchValidator("error")(bad)
    masked = replace(batch, new_logp=batch.new_logp.clone())
    masked.new_logp[0] = float("nan")  # a masked token: not a problem
    BatchValidator("error")(masked)
    future = replace(batch, versions=batch.versions.clone())
    future.versions[1] = 4  # above sequence 0's current version 3
    with pytest.raises(Exception, match="above the sequence's current_version"):
        BatchValidator("error")(future)


def test_prompt_lengths_from_the_valid_view_equal_the_mask_scan():
    batch = BatchValidator("error")(batch_with_masks())
    view = batch.valid()
    prompt = _first_valid_positions(batch, view)
    # First valid positions 1, none (whole length 3), none (length 0), 0.
    assert prompt.tolist() == [1, 3, 0, 0]
    scanned, fast = actor_stats_state(), actor_stats_state()
    actor_stats_update(scanned, cu_seqlens=batch.cu_seqlens, loss_mask=batch.loss_mask)
    actor_stats_update(fast, cu_seqlens=batch.cu_seqlens, loss_mask=batch.loss_mask, prompt_lengths=prompt)
    for name in scanned:
        assert torch.equal(scanned[name].to(torch.float64), fast[name].to(torch.float64)), name


# -- decoding ahead -------------------------------------------------------------------------------------------------
def tiny(i: int) -> TokenBatch:
    return TokenBatch(cu_seqlens=torch.tensor([0, 1]), new_logp=torch.tensor([-float(i)]),
                      loss_mask=torch.ones(1, dtype=torch.bool))


def test_prefetch_keeps_order_and_raises_where_the_error_was():
    def source():
        for i in range(5):
            yield tiny(i)
        raise ValueError("broken row group")

    seen = []
    with pytest.raises(ValueError, match="broken row group"):
        for batch in prefetch(source(), depth=2):
            seen.append(float(batch.new_logp))
    assert seen == [0.0, -1.0, -2.0, -3.0, -4.0]


def test_closing_early_stops_the_thread():
    before = threading.active_count()
    stream = prefetch((tiny(i) for i in range(1000)), depth=2)
    assert float(next(stream).new_logp) == 0.0
    stream.close()
    assert threading.active_count() == before
    with pytest.raises(ValueError):
        next(prefetch([], depth=0))


def test_streamed_batches_land_on_the_device(device):
    batches = [tiny(i) for i in range(3)]
    out = list(streamed(iter(batches), torch.device(device)))
    assert [b.new_logp.device.type for b in out] == [device] * 3
    assert [float(b.new_logp) for b in out] == [0.0, -1.0, -2.0]
    assert not torch.are_deterministic_algorithms_enabled()  # restored after a CUDA pass


def test_one_torch_thread_is_scoped():
    before = torch.get_num_threads()
    with one_torch_thread(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before

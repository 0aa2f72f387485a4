"""The streaming pass's plumbing: decode ahead in a thread, pinned host memory and deterministic kernels on CUDA.

:func:`streamed` wraps the reader's batch iterator for :func:`grpo_cli.engine.runner.accumulate_states`:

- a background thread decodes up to ``depth`` batches ahead (pyarrow releases the GIL while it decodes, and torch
  while it computes), so decoding the next batch overlaps the metric updates on the current one;
- for a CUDA device the thread also copies each batch into page-locked (pinned) memory, so the host-to-device
  copy in the consumer is a true ``non_blocking`` DMA (the caching host allocator keeps a pinned block alive until
  its copy has finished);
- on CUDA, ``torch.use_deterministic_algorithms(True, warn_only=True)`` holds for the whole pass: float
  ``index_add_`` / ``scatter_add_`` (per-sequence sums) then run without atomics, so a GPU report is the same bytes
  run after run, as on CPU. Histograms need nothing: they count with an unweighted integer ``bincount``.

Batches come out in the reader's order, so no figure depends on the prefetching.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch

__all__ = ["PREFETCH_DEPTH", "pinned", "prefetch", "streamed"]

PREFETCH_DEPTH = {"cpu": 1, "cuda": 2}
"""Batches decoded ahead of the one being computed, per device type (memory: ``depth + 1`` batches of
``--batch-tokens``). On a CPU one batch ahead already keeps decoding and computing overlapped; a GPU computes
faster than a batch decodes, so two are buffered."""

_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def pinned(batch: TokenBatch) -> TokenBatch:
    """``batch`` with every tensor copied into page-locked host memory (for non-blocking copies to a GPU)."""
    changes: dict[str, Any] = {}  # field → Tensor (Any: dataclasses.replace types each field)
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, Tensor):
            changes[f.name] = value.pin_memory()
    return replace(batch, **changes)


def prefetch(batches: Iterable[TokenBatch], *, depth: int = 1, pin: bool = False) -> Iterator[TokenBatch]:
    """Iterate ``batches`` in a background thread, ``depth`` items ahead; errors are re-raised in the consumer.

    Closing the returned generator early (an error while computing) stops the thread after its current batch.

    Example:
        >>> batch = TokenBatch(cu_seqlens=torch.tensor([0, 1]), new_logp=torch.zeros(1), loss_mask=torch.ones(1) > 0)
        >>> [b.n_tokens for b in prefetch([batch, batch])]
        [1, 1]
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    items: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not put(pinned(batch) if pin else batch):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it where the batch was expected
            put(_Failure(exc))
            return
        put(_END)

    thread = threading.Thread(target=produce, name="grpo-cli-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            assert isinstance(item, TokenBatch)
            yield item
    finally:
        stop.set()
        thread.join()


def streamed(batches: Iterable[TokenBatch], device: torch.device, *, depth: int | None = None) -> Iterator[TokenBatch]:
    """``batches`` decoded ahead (``depth`` 0: in the caller's thread; default :data:`PREFETCH_DEPTH`), on
    ``device``; see the module docstring."""
    cuda = device.type == "cuda"
    depth = PREFETCH_DEPTH.get(device.type, 1) if depth is None else depth
    source: Iterable[TokenBatch] = prefetch(batches, depth=depth, pin=cuda) if depth > 0 else batches
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for batch in source:
            yield batch.to(device, non_blocking=True) if batch.device != device else batch
    finally:
        if cuda:
            torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        close = getattr(source, "close", None)
        if close is not None:
            close()

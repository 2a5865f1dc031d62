"""Stand-ins for SGLang 0.5.23's ``UnifiedCacheLinker`` and ``LayerWiseLoadCounter``.

`linker` imports these only where SGLang cannot be imported (the GPU test machine carries torch
and hicache-gds but not SGLang's dependency tree), so `GDSLinker` stays usable and testable
there. They copy the behaviour `GDSLinker` relies on from
``sglang/srt/mem_cache/unified_cache/unified_cache_linker.py``: the counter's producer/consumer
indices and per-layer futures, and ``record_offload_ready``. Under SGLang the real classes are
used; tests/test_linker_cpu.py checks the two counters behave alike.
"""

from __future__ import annotations

from abc import ABC
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch

__all__ = ["LayerWiseLoadCounter", "UnifiedCacheLinker"]


class LayerWiseLoadCounter:
    """CPU completion counter: ``wait_until(layer)`` blocks until the load thread completes it."""

    def __init__(self, num_layers: int, on_layer_ready: Optional[Callable[[int, int], None]] = None) -> None:
        self.num_layers = num_layers
        self.on_layer_ready = on_layer_ready
        self.producer_index = -1
        self.consumer_index = -1
        self.futures: dict[int, list[Future]] = {}

    def update_producer(self) -> int:
        self.producer_index += 1
        self.futures[self.producer_index] = [Future() for _ in range(self.num_layers)]
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int, layer: int) -> None:
        self.futures[index][layer].set_result(None)

    def fail(self, index: int, error: BaseException) -> None:
        for future in self.futures.get(index, ()):
            if not future.done():
                future.set_exception(error)

    def wait_until(self, threshold: int) -> None:
        futures = self.futures.get(self.consumer_index)
        if futures is None:
            return
        futures[threshold].exception()  # a failure is reported by finish()
        if self.on_layer_ready is not None:
            self.on_layer_ready(self.consumer_index, threshold)

    def finish(self, index: int) -> bool:
        """Wait for every layer of batch `index`; True when all of them landed."""
        futures = self.futures.get(index)
        if futures is None:
            return True
        landed = all(future.exception() is None for future in futures)
        del self.futures[index]
        return landed

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
        self.futures.clear()


class UnifiedCacheLinker(ABC):
    """The base's concrete part: ``forward_stream`` and ``record_offload_ready``."""

    layer_done_counter: Any
    pools: dict
    forward_stream: Any = None

    def record_offload_ready(self) -> list:
        """Events an offload waits on: the current stream, and the forward stream that writes the KV."""
        ready = torch.cuda.Event()
        ready.record()
        events = [ready]
        if self.forward_stream is not None:
            written = torch.cuda.Event()
            written.record(self.forward_stream)
            events.append(written)
        return events

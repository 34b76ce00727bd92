"""CPython's cyclic garbage collector on the host's hot path: how it is set, and the time it takes.

A worker at 1,024 sequences makes a few container objects a token every step (the step's outputs, their token
lists, the writer's messages); most live a few milliseconds, until the writer has folded and sent them. With
CPython's default young-generation threshold (700 allocations) one step triggers several young collections while
those objects are still alive: each survivor is promoted, and the older collections then walk every live
request's token and text lists. Raising the young threshold lets a step's objects die before any collection
looks at them (reference counting frees them; the collector is only for cycles, which the hot path does not
make). The older generations keep their defaults, so cycles are still collected.
"""

from __future__ import annotations

import gc
import time

# allocations (minus deallocations) between young collections: about a 1,024-sequence step's worth of objects
# (CPython's default 700 collects several times a step)
YOUNG_THRESHOLD = 50_000


def settle_heap(young_threshold: int = YOUNG_THRESHOLD) -> None:
    """Once loaded: collect, move what is loaded (torch, the model, the tokenizer) out of the collector's sight
    for good (a full collection over a loaded worker takes ~0.2 s, a stalled step), and raise the young
    generation's threshold."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)


class GcClock:
    """Seconds spent in collections and their count by generation, in every thread of the process (from
    ``gc.callbacks``; a collection runs in the thread that triggered it, holding the GIL)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

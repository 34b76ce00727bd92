"""CUDA graphs for the decode step, one per batch-size bucket (nano-vllm style).

Buckets ``[1, 2, 4, 8] + range(16, 256, 16) + range(256, max_bs + 1, 64)``: a
padded row costs about what a real one does, so the steps are finer where a step
is short; 32 graphs up to 1,024 rows, not 68 (each capture is seconds of warm-up).
Captured largest first into one shared memory pool; a batch is padded to the next
bucket, padding rows decode a dummy token into the scratch slot.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Callable

import torch

log = logging.getLogger(__name__)


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, min(max_bs + 1, 256), 16))
    sizes += list(range(256, max_bs + 1, 64))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """``torch.cuda.graph`` with the garbage collector held off: a collection in the middle of a capture can run a
    finalizer that calls CUDA (freeing a pinned buffer or an event of an earlier object), which invalidates the
    capture (seen on an H200 when captures followed other work in one process). Other threads' CUDA calls do
    not invalidate it (thread-local capture mode). No collection before each capture either: with fla and torch
    loaded one takes ~0.25 s, most of a warm start's 100 captures (BENCHMARKS.md, cold start)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphs:
    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], max_bs: int,
                 scratch_slot: int, device: torch.device):
        self.step = step
        self.sizes = bucket_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.scratch_slot = scratch_slot
        self.tokens = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.slots = torch.full((self.max_bs,), scratch_slot, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self._pool = None

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_bs

    @torch.inference_mode()
    def capture(self, bs: int, compiled: bool = False) -> None:
        """Capture one bucket (lazily, on its first use); all buckets share one memory pool. An eager step first
        compiles and autotunes, unless ``compiled`` (the warm-up ran one of this size already)."""
        t0 = time.perf_counter()
        if not compiled:
            self.run_eager(bs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            self.outputs[bs] = self.step(self.tokens[:bs], self.slots[:bs])
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0
        log.info("captured decode graph", extra={"batch": bs, "seconds": round(time.perf_counter() - t0, 3)})

    @torch.inference_mode()
    def run_eager(self, bs: int) -> None:
        """An uncaptured step of bucket ``bs`` on the scratch slot: Triton compiles, cuBLAS picks kernels."""
        self.slots[:bs].fill_(self.scratch_slot)
        self.step(self.tokens[:bs], self.slots[:bs])

    def run(self, token_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        n = len(token_ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        if bs not in self.graphs:
            self.capture(bs)
        self.tokens[:n].copy_(token_ids, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        if bs > n:
            self.slots[n:bs].fill_(self.scratch_slot)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

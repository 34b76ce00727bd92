"""Timing helpers every GPU benchmark shares: a CUDA-event median, a CUDA graph's replay, a preset shape's
random weights. No benchmark imports another for these."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from engine.demo import PRESETS, random_state_dict
from engine.weights import Rwkv7Weights, weights_from_state_dict


def cuda_time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """The median of ``iters`` timed calls (CUDA events), after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_copy_ms(nbytes: int) -> float:
    """A device-to-device copy of ``nbytes`` (it reads and writes them): what memory-bound kernels are held to."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters=20, warmup=3)
    del src, dst
    return ms


def graph_replay_ms(fn: Callable[[], object]) -> float:
    """``fn`` captured in a CUDA graph (after a run on a side stream, as capture wants), then its replay timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, iters=20)


def preset_weights(name: str, dtype: torch.dtype | None = torch.bfloat16) -> Rwkv7Weights:
    """A preset shape's seeded random weights on the GPU (``dtype`` None: the generator's fp32)."""
    p = PRESETS[name]
    kwargs = {} if dtype is None else {"dtype": dtype}
    return weights_from_state_dict(random_state_dict(layers=p["layers"], width=p["width"], vocab=65536, seed=0,
                                                     device="cuda", **kwargs))

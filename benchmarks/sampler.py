"""The sampler's tables (``python -m benchmarks.engine --sampler-only``, and the CPU and host rows of the engine
tables): one sampling step by parameter mix, and admitting sequences into the sampler's slot tables."""

from __future__ import annotations

import time

import torch

from benchmarks.report import table
from benchmarks.timing import cuda_time_ms, graph_replay_ms

DECODE_BATCHES = (1, 64, 256, 1024)


def bench_sampler_cpu(batch: int = 32, vocab: int = 65536) -> str:
    """One sampling step over [batch, vocab] logits on one core, by parameter mix. Gaussian logits with σ=6
    make a peaked distribution (a trained LM's is; its top_p nucleus fits the 1,024 candidates), σ=1 a wide one."""
    from engine.params import SamplingParams
    from engine.sampler import Sampler

    cases = (("temperature 1, top_p 0.9, peaked (σ=6)", SamplingParams(temperature=1.0, top_p=0.9), 6.0),
             ("temperature 1, top_p 0.9, wide (σ=1): full-sort fallback", SamplingParams(temperature=1.0, top_p=0.9),
              1.0),
             ("temperature 0.8, top_k 50", SamplingParams(temperature=0.8, top_k=50), 3.0),
             ("temperature 1, no top_k/top_p", SamplingParams(temperature=1.0), 3.0),
             ("greedy", SamplingParams(temperature=0.0), 3.0))
    rows = []
    for name, params, scale in cases:
        sampler = Sampler(batch, vocab, "cpu")
        for slot in range(batch):
            sampler.reset_slot(slot, params, slot, [1])
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * scale
        slots = torch.arange(batch)
        sampler.sample(logits, slots)
        t0 = time.perf_counter()
        for _ in range(5):
            sampler.sample(logits, slots)
        rows.append([name, f"{(time.perf_counter() - t0) / 5 * 1e3:.1f}"])
    return table(f"Sampler, batch {batch} × vocab {vocab:,}, one core", ["parameters", "ms per step"], rows)


def sampler_mixes() -> list[tuple[str, dict]]:
    """The parameter mixes the sampler is timed on (the target: each within 0.5 ms at batch 1,024)."""
    bias = {i: 1.0 - 0.25 * (i % 9) for i in range(7, 65536, 8191)}
    return [("greedy", dict(temperature=0.0)), ("T=1", dict(temperature=1.0)),
            ("T=1 top_p 0.9", dict(temperature=1.0, top_p=0.9)), ("T=0.8 top_k 50", dict(temperature=0.8, top_k=50)),
            ("min_p 0.05", dict(temperature=1.0, min_p=0.05)),
            ("penalties + logit_bias", dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                            logit_bias=bias)),
            ("logprobs 5", dict(temperature=1.0, logprobs=5))]


def bench_sampler_cuda(vocab: int = 65536, batches: tuple[int, ...] = DECODE_BATCHES, graphed: bool = False) -> str:
    """``Sampler.sample_device`` (the fused kernel, the counters' update; no transfer) per mix, on flat
    (Gaussian σ=1: random weights, a nucleus over most of the vocabulary) and peaked (σ=6) logits. ``graphed``:
    also the same call captured in a CUDA graph and replayed (the device's time without the host's launches:
    what the launches from Python cost is the difference)."""
    from engine.params import SamplingParams
    from engine.sampler import Sampler

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = {sigma: torch.randn(max(batches), vocab, device="cuda", generator=gen) * sigma for sigma in (1.0, 6.0)}
    prompt = list(range(1, 257))
    rows = []
    for name, kw in sampler_mixes():
        sampler = Sampler(max(batches), vocab, "cuda")
        for slot in range(max(batches)):
            sampler.reset_slot(slot, SamplingParams(**kw), slot, prompt)
        sampler.warm_up(batches)
        for sigma, x in logits.items():
            times = []
            for b in batches:
                slots = torch.arange(b, device="cuda")
                times.append(cuda_time_ms(lambda: sampler.sample_device(x[:b], slots), iters=20))
                if graphed:
                    times.append(graph_replay_ms(lambda: sampler.sample_device(x[:b], slots)))
            rows.append([name, f"σ={sigma:g}"] + [f"{ms:.3f}" for ms in times])
    columns = [f"batch {b}{kind}" for b in batches for kind in ((", launched", ", graph replay") if graphed else ("",))]
    return table(f"Sampler (fused kernel, sample_device), vocab {vocab:,}: ms per step",
                 ["parameters", "logits"] + columns, rows)


def bench_admission(device: str, num_slots: int = 1024, admitted: int = 64, repeats: int = 20) -> str:
    """Host time to admit a step's new sequences into the sampler's slot tables (``Sampler.reset_slots``, what
    ``ModelRunner.admit`` does beside zeroing their states): on CUDA small launches and pinned copies that queue
    behind the running step. Synchronised only after all repeats: the host's cost, as the loop pays it."""
    from engine.params import SamplingParams
    from engine.sampler import Admission, Sampler
    sampler = Sampler(num_slots, 65536, device)
    params = SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True)
    batch = [Admission(i, params, i, [1] * 128) for i in range(admitted)]
    sampler.reset_slots(batch)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(repeats):
            sampler.reset_slots(batch)
        best = min(best, (time.perf_counter() - t) / repeats)
    sync()
    return table(f"Admitting {admitted} sequences into {num_slots} sampler slots ({device})",
                 ["ms a step", "µs a sequence"], [[f"{best * 1e3:.3f}", f"{best / admitted * 1e6:.1f}"]])

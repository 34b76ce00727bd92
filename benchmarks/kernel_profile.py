"""Per-kernel profile of the CUDA path: where a decode step and a prefill spend GPU time.

    python -m benchmarks.kernel_profile --shape 1.5b --decode 1,1024 --prefill 4096

Eager runs under ``torch.profiler`` give each kernel's device time (graphs replay the
same kernels; their step time is also printed, the difference is launch gaps).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.timing import cuda_time_ms, preset_weights
from engine.state import StatePool


def build(shape: str, slots: int):
    from engine.cuda.model import CudaRwkv7

    weights = preset_weights(shape).to("cuda", torch.bfloat16)
    pool = StatePool(weights.shape, slots, "cuda", torch.bfloat16, torch.float32)
    return CudaRwkv7(weights, pool)


def kernel_table(fn, repeats: int = 3) -> list[tuple[str, int, float]]:
    """(kernel, launches per call, µs per call) sorted by time, from CUDA kernel events."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    calls: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:90]
            calls[name] += 1
            us[name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    rows = [(n, calls[n] // repeats, us[n] / repeats) for n in us]
    return sorted(rows, key=lambda r: -r[2])


def print_table(title: str, rows, wall_ms: float) -> None:
    total = sum(r[2] for r in rows)
    print(f"\n### {title}: kernels sum {total / 1e3:.3f} ms, measured step {wall_ms:.3f} ms, "
          f"{sum(r[1] for r in rows)} launches\n")
    print("| kernel | launches | µs | % |\n|---|---|---|---|")
    for name, n, t in rows[:25]:
        print(f"| `{name}` | {n} | {t:.1f} | {100 * t / total:.1f} |")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--decode", default="1,1024")
    ap.add_argument("--prefill", default="4096")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.decode.split(",") if b]
    model = build(args.shape, max(batches + [1]) + 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in batches:
        tokens = torch.randint(1, 65536, (b,), device="cuda", generator=gen)
        slots = torch.arange(b, device="cuda")
        graph_ms = cuda_time_ms(lambda: model.decode(tokens, slots))
        rows = kernel_table(lambda: model._decode_eager(tokens, slots))
        print_table(f"{args.shape} decode batch {b} (eager kernels; CUDA-graph step)", rows, graph_ms)
    for b in batches:  # sampling (T=1, top_p 0.9): device kernels, and its wall time with the host's share
        from engine.params import SamplingParams
        from engine.sampler import Sampler

        sampler = Sampler(b, model.shape.vocab_size, "cuda")
        for slot in range(b):
            sampler.reset_slot(slot, SamplingParams(temperature=1.0, top_p=0.9), slot, [1])
        slots = torch.arange(b, device="cuda")
        logits = model.decode(torch.randint(1, 65536, (b,), device="cuda", generator=gen), slots)
        wall_ms = cuda_time_ms(lambda: sampler.sample(logits, slots), iters=10)
        print_table(f"sampler batch {b}, T=1 top_p=0.9 (wall includes host time)",
                    kernel_table(lambda: sampler.sample(logits, slots)), wall_ms)
    for t in (int(x) for x in args.prefill.split(",") if x):
        prompt = torch.randint(1, 65536, (t,), generator=torch.Generator().manual_seed(1)).tolist()
        ms = cuda_time_ms(lambda: model.prefill([prompt], [0]), iters=5, warmup=2)
        print_table(f"{args.shape} prefill 1×{t}", kernel_table(lambda: model.prefill([prompt], [0])), ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine benchmarks: print tables and put them in BENCHMARKS.md (each mode its own area). Never asserts.

    python -m benchmarks.engine --device cpu
    python -m benchmarks.engine --device cuda --shapes 0.1b,1.5b,7.2b [--out BENCHMARKS.md]
    python -m benchmarks.engine --device cuda --sampler-only --out -
    python -m benchmarks.engine --device cuda --sampler-only --sampler-graphed --out -
    python -m benchmarks.engine --device cuda --prefill-only --shapes 1.5b --out -
    python -m benchmarks.engine --device cuda --serve --shapes 1.5b        (benchmarks/serve_loop.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.report import command_line, publish, table
from benchmarks.sampler import DECODE_BATCHES, bench_admission, bench_sampler_cpu, bench_sampler_cuda
from benchmarks.timing import cuda_time_ms, preset_weights
from engine.demo import random_state_dict
from engine.weights import weights_from_state_dict


# -- CPU ----------------------------------------------------------------------------------

def bench_cpu() -> str:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.params import SamplingParams
    from engine.sequence import Request
    from engine.tokenizer import measure_throughput

    torch.set_num_threads(1)
    tok = measure_throughput(2.0)
    out = table("Tokenizer (one core)", ["MB/s", "tokens/s"], [[f"{tok['MB/s']:.2f}", f"{tok['tokens/s']:,.0f}"]])
    rows = []
    for batch in (1, 8, 32):
        weights = weights_from_state_dict(random_state_dict(layers=2, width=128, vocab=65536, seed=0))
        engine = LLMEngine(EngineConfig(device="cpu", max_num_seqs=batch, max_num_batched_tokens=max(64, batch)),
                           weights=weights)
        for i in range(batch):
            engine.add(Request(f"r{i}", list(range(1, 17)), SamplingParams(max_tokens=64, ignore_eos=True)))
        engine.step()  # prefill
        t0, steps = time.perf_counter(), 0
        while engine.has_work():
            engine.step()
            steps += 1
        dt = time.perf_counter() - t0
        rows.append([batch, f"{steps / dt:.1f}", f"{steps * batch / dt:,.0f}"])
    out += "\n" + table("Tiny model (2 × 128, vocab 65,536), reference engine on one core, sampling included",
                        ["batch", "steps/s", "tokens/s"], rows)
    return out + "\n" + bench_sampler_cpu()


# -- CUDA ---------------------------------------------------------------------------------

def bench_shape(name: str, max_batch: int, state_dtype: torch.dtype = torch.float32, prefill: bool = True) -> dict:
    from engine.cuda.model import CudaRwkv7
    from engine.sampler import Sampler
    from engine.params import SamplingParams
    from engine.state import StatePool

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = preset_weights(name).to("cuda", torch.bfloat16)
    shape = weights.shape
    pool = StatePool(shape, max_batch + 1, "cuda", torch.bfloat16, state_dtype)
    model = CudaRwkv7(weights, pool)
    del weights
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"shape": name, "layers": shape.n_layer, "width": shape.n_embd,
           "state_MiB": StatePool.bytes_per_slot(shape, torch.bfloat16, state_dtype) / 2**20, "decode": {}}
    if prefill:  # states with content (the decode's speed does not depend on it)
        model.prefill([list(range(1, 65))] * min(max_batch, 64), list(range(min(max_batch, 64))))
    sampler = Sampler(max_batch, shape.vocab_size, "cuda")
    for slot in range(max_batch):
        sampler.reset_slot(slot, SamplingParams(temperature=1.0, top_p=0.9), slot, [1])
    for b in (x for x in DECODE_BATCHES if x <= max_batch):
        tokens = torch.randint(1, 65536, (b,), device="cuda", generator=gen)
        slots = torch.arange(b, device="cuda")
        ms = cuda_time_ms(lambda: model.decode(tokens, slots))
        logits = model.decode(tokens, slots)
        sample_ms = cuda_time_ms(lambda: sampler.sample(logits, slots), iters=10)
        # what a serving step costs: the sampler's launches queue behind the model's, one transfer at the end
        both_ms = cuda_time_ms(lambda: sampler.sample(model.decode(tokens, slots), slots), iters=10)
        res["decode"][b] = (ms, sample_ms, both_ms)
    res["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    if not prefill:
        return res
    prompt = torch.randint(1, 65536, (4096,), generator=torch.Generator().manual_seed(1)).tolist()
    ms = cuda_time_ms(lambda: model.prefill([prompt], [0]), iters=5, warmup=2)
    res["prefill_4096"] = 4096 / ms * 1e3
    prompts = [prompt[i * 8:i * 8 + 512] for i in range(64)]
    ms = cuda_time_ms(lambda: model.prefill(prompts, list(range(64))), iters=5, warmup=2)
    res["prefill_64x512"] = 64 * 512 / ms * 1e3
    if max_batch >= 512:
        tokens, slots = torch.randint(1, 65536, (512,), device="cuda"), torch.arange(512, device="cuda")
        decode_ms = cuda_time_ms(lambda: model.decode(tokens, slots))
        new = [prompt[i * 512:(i + 1) * 512] for i in range(8)]
        mixed_ms = cuda_time_ms(lambda: (model.prefill(new, list(range(512, 520))), model.decode(tokens, slots)),
                                iters=5, warmup=2)
        res["mixed"] = (decode_ms, mixed_ms)
    res["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def bench_wkv_kernels(batch: int = 256, heads: int = 32, n: int = 64) -> tuple[float, float]:
    """One layer's state update: our fused slot-indexed kernel vs fla's fused recurrent (gather/scatter)."""
    from fla.ops.rwkv7 import fused_recurrent_rwkv7

    from engine.cuda.kernels import wkv7_decode
    C = heads * n
    state = torch.randn(batch + 1, heads, n, n, device="cuda") * 0.1
    slots = torch.randperm(batch, device="cuda")
    vec = lambda: torch.randn(batch, C, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    r, k, v, wl, al, vl, g, vf = (vec() for _ in range(8))
    p = {x: torch.randn(C, device="cuda") for x in ("w0", "a0", "v0", "k_k", "k_a", "ln_x.weight", "ln_x.bias")}
    p["r_k"] = torch.randn(heads, n, device="cuda")
    out = torch.empty_like(r)
    ours = cuda_time_ms(lambda: wkv7_decode(state, slots, r, k, v, wl, al, vl, g, vf, p, 1, 64e-5, out), iters=50)
    h = lambda: torch.randn(batch, 1, heads, n, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    rr, ww, kk, vv, aa, bb = (h() for _ in range(6))
    ww = -torch.rand_like(ww) * 0.6

    def fla_step():
        h0 = state[slots].transpose(-1, -2).contiguous()
        _, ht = fused_recurrent_rwkv7(rr, ww, kk, vv, aa, bb, scale=1.0, initial_state=h0, output_final_state=True)
        state[slots] = ht.transpose(-1, -2)

    return ours, cuda_time_ms(fla_step, iters=50)


def bench_state_drift(name: str = "1.5b", prompt_len: int = 1024, steps: int = 256) -> list[list]:
    """Per-step logits error against the fp32 reference (same random weights, same sampled tokens) for each
    weight/state dtype: the first and last 32 decode steps' mean, to show drift that grows with steps."""
    from engine.cuda.model import CudaRwkv7
    from engine.model import ReferenceRwkv7
    from engine.state import StatePool

    base = preset_weights(name, dtype=None)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 65536, (prompt_len,), generator=gen).tolist()
    w32 = base.to("cuda", torch.float32)
    ref = ReferenceRwkv7(w32, StatePool(w32.shape, 2, "cuda"))
    ref_logits, tokens = [ref.prefill([prompt], [0])[0]], []
    slot = torch.tensor([0], device="cuda")
    for _ in range(steps):
        tokens.append(int(torch.multinomial(torch.softmax(ref_logits[-1], -1).cpu(), 1, generator=gen)))
        ref_logits.append(ref.decode(torch.tensor(tokens[-1:], device="cuda"), slot)[0])
    del ref, w32
    rows = []
    for wdt, sdt in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        w = base.to("cuda", wdt)
        model = CudaRwkv7(w, StatePool(w.shape, 2, "cuda", wdt, sdt))
        errs = [_rel(model.prefill([prompt], [0])[0], ref_logits[0])]
        for i, t in enumerate(tokens):
            errs.append(_rel(model.decode(torch.tensor([t], device="cuda"), slot)[0], ref_logits[i + 1]))
        rows.append([name, str(wdt).split(".")[1], str(sdt).split(".")[1], f"{errs[0]:.2e}",
                     f"{statistics.mean(errs[1:33]):.2e}", f"{statistics.mean(errs[-32:]):.2e}", f"{max(errs):.2e}"])
        del model, w
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench_cuda(shapes: list[str], max_batch: int, decode_only: bool = False) -> str:
    rows, prefill_rows, mixed_rows = [], [], []
    for name in shapes:
        res = bench_shape(name, max_batch, prefill=not decode_only)
        print(f"{name}: {res}", file=sys.stderr, flush=True)  # partial results survive a killed run
        for b, (ms, sample_ms, both_ms) in res["decode"].items():
            rows.append([name, b, f"{ms:.3f}", f"{b / ms * 1e3:,.0f}", f"{sample_ms:.2f}", f"{both_ms:.3f}",
                         f"{b / both_ms * 1e3:,.0f}"])
        if not decode_only:
            prefill_rows.append([name, f"{res['prefill_4096']:,.0f}", f"{res['prefill_64x512']:,.0f}",
                                 f"{res['state_MiB']:.2f}", f"{res['peak_GiB']:.1f}"])
        if "mixed" in res:
            d, m = res["mixed"]
            mixed_rows.append([name, f"{d:.2f}", f"{m:.2f}", f"{m - d:.2f}"])
    out = table("Decode (bf16 weights, fp32 state, CUDA graphs)",
                ["shape", "batch", "step ms", "tok/s (model)", "sample ms alone (T=1, top_p)", "step + sample ms",
                  "tok/s incl. sampling"], rows)
    if decode_only:
        return out
    out += "\n" + table("Prefill and memory", ["shape", "1×4096 tok/s", "64×512 packed tok/s",
                                               "state MiB/seq", "peak GiB (incl. 1,024+1 slots)"], prefill_rows)
    if mixed_rows:
        out += "\n" + table("Mixed step: 512 decoding + 8×512 prompt tokens admitted",
                            ["shape", "decode-only ms", "mixed step ms", "decode latency cost ms"], mixed_rows)
    res = bench_shape(shapes[0], max_batch, torch.bfloat16)
    out += "\n" + table(f"bf16 wkv state ({shapes[0]}): decode speed",
                        ["batch", "step ms", "tok/s (model)", "state MiB/seq"],
                        [[b, f"{ms:.3f}", f"{b / ms * 1e3:,.0f}", f"{res['state_MiB']:.2f}"]
                         for b, (ms, *_) in res["decode"].items()])
    out += "\n" + table(f"Drift vs the fp32 reference: {shapes[0]}, 1,024-token prefill then 256 sampled decode steps",
                        ["shape", "weights", "state", "prefill rel err", "steps 1–32 mean", "steps 225–256 mean",
                         "max"], bench_state_drift(shapes[0]))
    ours, fla = bench_wkv_kernels()
    out += "\n" + table("One layer's wkv state update, batch 256, 32 heads × 64 (1.5B layer)",
                        ["kernel", "ms"], [["ours: fused, slot-indexed, in place", f"{ours:.3f}"],
                                           ["fla fused_recurrent_rwkv7 + gather/scatter", f"{fla:.3f}"]])
    return out


PREFILL_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)


def bench_prefill_sizes(name: str, prompt_len: int = 128) -> str:
    """GPU time of one packed prefill step by its size (``prompt_len``-token prompts), replayed from its captured
    graph and run eagerly: what a step admitting a few prompts costs the decoding sequences beside it."""
    from engine.cuda.model import CudaRwkv7
    from engine.state import StatePool

    weights = preset_weights(name)
    model = CudaRwkv7(weights.to("cuda", torch.bfloat16), StatePool(weights.shape, 129, "cuda", torch.bfloat16,
                                                                     torch.float32))
    gen = torch.Generator().manual_seed(2)
    rows = []
    for size in PREFILL_SIZES:
        n = max(1, size // prompt_len)
        prompts = [torch.randint(1, 65536, (min(size, prompt_len),), generator=gen).tolist() for _ in range(n)]
        graph_ms = cuda_time_ms(lambda: model.prefill(prompts, list(range(n))), iters=10, warmup=3)
        eager_ms = cuda_time_ms(lambda: model.prefill_with_scores(prompts, list(range(n)), {}, eager=True),
                                iters=5, warmup=2)
        tokens = n * len(prompts[0])
        rows.append([f"{n} × {len(prompts[0])}", f"{graph_ms:.2f}", f"{tokens / graph_ms * 1e3:,.0f}",
                     f"{eager_ms:.2f}", f"{tokens / eager_ms * 1e3:,.0f}"])
    return table(f"One prefill step by size ({name}, bf16, fp32 state; wall ms over repeated steps)",
                 ["prompts × tokens", "graph ms", "graph tok/s", "eager ms", "eager tok/s"], rows)


def bench_host(batches: tuple[int, ...] = (64, 256, 1024), steps: int = 60) -> str:
    """The engine loop's own host time per generated token (schedule, launch bookkeeping, post-processing:
    detokenize, stops, outputs) over a synthetic runner that takes no time: what the host adds to every token
    whatever the device. Best of 5 runs of ``steps`` steps."""
    import gc

    from engine.config import EngineConfig
    from engine.params import SamplingParams
    from engine.sequence import Request
    from engine.synthetic import synthetic_engine
    rows = []
    for b in batches:
        engine = synthetic_engine(EngineConfig(device="cpu", max_num_seqs=b, max_num_batched_tokens=8192), 1e12, 1e12)
        for i in range(b):
            engine.add(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1 << 19, ignore_eos=True, seed=i)))
        for _ in range(10):
            engine.step()
        gc.collect()
        best = float("inf")
        for _ in range(5):
            t, n = time.perf_counter(), 0
            for _ in range(steps):
                n += len(engine.step())
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        rows.append([b, f"{best:.2f}", f"{1e6 / best:,.0f}"])
    return table("Engine loop host time (synthetic runner, no device time)", ["sequences", "µs per token",
                                                                                "tok/s one core allows"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="0.1b,1.5b,7.2b")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode table (minutes less: no prefill, mixed step, bf16 state, drift)")
    ap.add_argument("--sampler-only", action="store_true", help="only the CUDA sampler table (a minute)")
    ap.add_argument("--sampler-graphed", action="store_true",
                    help="with --sampler-only: also each step replayed from a CUDA graph (the device's time alone)")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only a prefill step's time by size, graph and eager (the first of --shapes)")
    ap.add_argument("--host", action="store_true",
                    help="only the engine loop's host time per token (no device) and a step's admissions (--device)")
    ap.add_argument("--out", default="BENCHMARKS.md", help="put the tables here ('-' = print only)")
    ap.add_argument("--serve", action="store_true", help="the engine loop on serving workloads (benchmarks/serve_loop.py)")
    ap.add_argument("--concurrency", type=int, default=None, help="--serve: sequences in flight (1,024 on a GPU)")
    ap.add_argument("--workload", action="append", default=[],
                    help="--serve: only the workloads whose name contains this (repeatable), e.g. '1 stream'")
    ap.add_argument("--eager-prefill", action="store_true", help="--serve: no prefill graphs (the A/B of them)")
    ap.add_argument("--prefill-hold-tokens", type=int, default=0,
                    help="--serve: new prompts beside decodes wait to share a prefill step (EngineConfig)")
    ap.add_argument("--constrained", action="store_true",
                    help="--serve: half the requests JSON-schema constrained vs all free (256 streams on a GPU)")
    ap.add_argument("--area", help="the BENCHMARKS.md block to replace (default: by mode: engine, engine-cpu, "
                                   "sampler, prefill, engine-host, serving-loop, constrained)")
    args = ap.parse_args(argv)
    area, body = run(args)
    if args.device == "cpu" and not area.startswith("engine"):
        area += "-cpu"  # a CPU's serving-loop table never replaces a GPU's
    publish(args.area or area, command_line("benchmarks.engine", argv), body, args.out,
            title=TITLES.get(area, f"Engine: {area}"))
    return 0


TITLES = {"engine": "Engine: decode, prefill, memory (one GPU)", "engine-cpu": "Engine on one CPU core",
          "sampler": "Sampler (one GPU)", "prefill": "A prefill step by size (one GPU)",
          "engine-host": "Engine loop host time", "serving-loop": "Serving loop in-process (one GPU)",
          "constrained": "Constrained decoding in the serving loop (one GPU)"}


def run(args: argparse.Namespace) -> tuple[str, str]:
    """The mode's area and tables."""
    if args.host:
        return "engine-host", bench_host() + "\n" + bench_admission(args.device)
    if args.serve:
        from benchmarks.serve_loop import bench_serve_cmd
        body = bench_serve_cmd(args.device, args.shapes.split(",")[0], args.concurrency, args.constrained,
                               not args.eager_prefill, args.prefill_hold_tokens, args.workload)
        return "constrained" if args.constrained else "serving-loop", body
    if args.device == "cpu":
        return "engine-cpu", bench_cpu()
    if args.sampler_only:
        return "sampler", bench_sampler_cuda(graphed=args.sampler_graphed)
    if args.prefill_only:
        return "prefill", bench_prefill_sizes(args.shapes.split(",")[0])
    return "engine", bench_cuda(args.shapes.split(","), args.max_batch, args.decode_only) + "\n" + bench_sampler_cuda()


if __name__ == "__main__":
    sys.exit(main())

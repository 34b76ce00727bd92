"""``python -m engine.bench --serve``: the engine loop in-process (no Redis, no HTTP) on serving workloads.

Closed loop: ``concurrency`` sequences in flight, each replaced by a new request when it finishes, until
``num_requests`` finished (or, ``burst``: every request queued at once). Reports output tok/s, the GPU's busy
fraction (CUDA events around each launched step), ITL and TTFT percentiles, and the bound the model alone
allows: output tokens at the model-only decode rate of this batch plus prompt tokens at the packed-prefill rate.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

import torch

from engine.params import SamplingParams
from engine.sequence import Request


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    num_requests: int
    prompt_len: int
    output_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    burst: bool = False  # every request queued at once (a prefill-heavy burst)


def standard_workloads(concurrency: int) -> list[Workload]:
    """The issue's workloads: 1,024 concurrent (T=1 and greedy), one stream, a prefill-heavy burst."""
    n = 2 * concurrency
    return [Workload(f"{concurrency} concurrent, T=1", concurrency, n, 128, 256),
            Workload(f"{concurrency} concurrent, greedy", concurrency, n, 128, 256, temperature=0.0),
            Workload("1 stream, T=1", 1, 4, 128, 512),
            Workload(f"burst: {concurrency} × 750-token prompts, 16 out", concurrency, concurrency, 750, 16,
                     burst=True)]


def prompt_of(i: int, length: int, vocab: int) -> list[int]:
    return [1 + (i * 7919 + k * 104729) % (vocab - 1) for k in range(length)]


def run_workload(engine, w: Workload) -> dict:
    """Drive the engine through ``w``; timings are host times at which step() handed outputs over."""
    vocab = engine.vocab_size
    events: list[tuple] = []
    engine.runner.step_events = events
    submitted, finished, out_tokens = 0, 0, 0
    sent: dict[str, float] = {}
    last: dict[tuple, float] = {}
    ttft, itl = [], []

    def submit() -> None:
        nonlocal submitted
        rid = f"{w.name}-{submitted}"
        params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=w.temperature, top_p=w.top_p,
                                seed=submitted)
        engine.add(Request(rid, prompt_of(submitted, w.prompt_len, vocab), params))
        sent[rid] = time.perf_counter()
        submitted += 1

    start = time.perf_counter()
    for _ in range(w.num_requests if w.burst else min(w.concurrency, w.num_requests)):
        submit()
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            key = (out.request_id, out.index)
            (itl.append(now - last[key]) if key in last else ttft.append(now - sent[out.request_id]))
            last[key] = now
            out_tokens += len(out.token_ids)
            if out.finished:
                finished += 1
                if submitted < w.num_requests:
                    submit()
    wall = time.perf_counter() - start
    engine.runner.step_events = None
    return {"wall_s": wall, "output_tokens": out_tokens, "prompt_tokens": w.num_requests * w.prompt_len,
            "busy": _busy_s(events) / wall, "ttft": ttft, "itl": itl}


def _busy_s(events: list[tuple]) -> float:
    if not events or events[0][0] is None:  # CPU: no events
        return float("nan")
    torch.cuda.synchronize()
    return sum(start.elapsed_time(end) for start, end in events) / 1e3


def model_rates(engine, batch: int, prompt_len: int) -> tuple[float, float]:
    """Model-only decode seconds per step at ``batch`` (the graphs the loop uses) and packed-prefill tokens/s."""
    from engine.bench import cuda_time_ms
    model, vocab = engine.runner.model, engine.vocab_size
    slots = torch.arange(batch, device="cuda")
    tokens = torch.randint(1, vocab, (batch,), device="cuda")
    decode_s = cuda_time_ms(lambda: model.decode(tokens, slots)) / 1e3
    chunks = [prompt_of(i, prompt_len, vocab) for i in range(max(1, min(64, 32768 // prompt_len)))]
    prefill_s = cuda_time_ms(lambda: model.prefill(chunks, list(range(len(chunks)))), iters=5, warmup=2) / 1e3
    return decode_s, sum(map(len, chunks)) / prefill_s


def bound_tok_s(w: Workload, decode_s: float, prefill_tok_s: float) -> float:
    """Output tok/s if every step ran at the model-only decode rate and prompts at the packed-prefill rate."""
    out = w.num_requests * w.output_len
    seconds = out / min(w.concurrency, w.num_requests) * decode_s + w.num_requests * w.prompt_len / prefill_tok_s
    return out / seconds


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


def bench_serve(engine, workloads: list[Workload]) -> list[list]:
    engine.warm_up()
    gc.collect()
    gc.freeze()  # as the worker does: a full collection over the loaded engine stalls a step by ~0.2 s
    rows = []
    for w in workloads:
        run_workload(engine, replace(w, num_requests=min(w.num_requests, max(4, w.concurrency // 4)),
                                     name=w.name + " warm-up"))
        res = run_workload(engine, w)
        row = [w.name, f"{res['output_tokens'] / res['wall_s']:,.0f}"]
        if engine.runner.device.type == "cuda":
            decode_s, prefill_rate = model_rates(engine, min(w.concurrency, engine.num_slots), w.prompt_len)
            bound = bound_tok_s(w, decode_s, prefill_rate)
            row += [f"{bound:,.0f}", f"{res['output_tokens'] / res['wall_s'] / bound:.2f}", f"{res['busy']:.2f}"]
        else:
            row += ["–", "–", "–"]
        row += [f"{pct(res['itl'], 0.5):.1f}", f"{pct(res['itl'], 0.99):.1f}", f"{pct(res['ttft'], 0.5):.0f}",
                f"{pct(res['ttft'], 0.99):.0f}", f"{res['prompt_tokens'] / res['wall_s']:,.0f}"]
        rows.append(row)
    return rows


SERVE_HEADER = ["workload", "output tok/s", "model bound tok/s", "of bound", "GPU busy", "ITL p50 ms",
                "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms", "prompt tok/s"]

"""``python -m benchmarks.engine --serve``: the engine loop in-process (no Redis, no HTTP) on serving workloads.

Closed loop: ``concurrency`` sequences in flight, each replaced by a new request when it finishes, until
``num_requests`` finished (or, ``burst``: every request queued at once). Reports output tok/s, the GPU's busy
fraction (CUDA events around each launched step), ITL and TTFT percentiles, and the bound the model alone
allows: output tokens at the model-only decode rate of this batch plus prompt tokens at the packed-prefill rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from benchmarks.report import table
from benchmarks.timing import cuda_time_ms, preset_weights
from engine.demo import random_state_dict
from engine.gc_policy import settle_heap
from engine.params import SamplingParams
from engine.phases import PHASES
from engine.sequence import Request
from engine.weights import weights_from_state_dict


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
    make_params: Callable[[int], SamplingParams] | None = None  # request i's params (default: from the fields)


def standard_workloads(concurrency: int) -> list[Workload]:
    """The serving workloads: 1,024 concurrent (T=1 with equal and with spread lengths, greedy), one stream, a
    prefill-heavy burst."""
    n = 2 * concurrency
    return [Workload(f"{concurrency} concurrent, T=1", concurrency, n, 128, 256),
            Workload(f"{concurrency} concurrent, T=1, 128–384 out (arrivals spread)", concurrency, n, 128, 256,
                     make_params=spread_lengths(256)),
            Workload(f"{concurrency} concurrent, greedy", concurrency, n, 128, 256, temperature=0.0),
            Workload("1 stream, T=1", 1, 4, 128, 512),
            Workload(f"burst: {concurrency} × 750-token prompts, 16 out", concurrency, concurrency, 750, 16,
                     burst=True)]


def spread_lengths(mean: int) -> Callable[[int], SamplingParams]:
    """Request i's params with an output length in [mean/2, 3·mean/2] (mean ``mean``, spread by i): finishes,
    hence arrivals, stop coming in waves — the continuous arrivals the ITL p99 target is about."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=mean // 2 + (i * 7919) % (mean + 1), ignore_eos=True, temperature=1.0,
                              seed=i)
    return params


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
    # the phases of the steps each request waited through before its first token (windows overlap: a mean
    # a request, not a share of the wall)
    before_first: dict[str, tuple[dict[str, float], int]] = {}
    first_steps, first_phases = 0, dict.fromkeys(PHASES, 0.0)

    lengths: dict[int, int] = {}  # output tokens of request i

    def submit() -> None:
        nonlocal submitted
        rid = f"{w.name}-{submitted}"
        params = w.make_params(submitted) if w.make_params else SamplingParams(
            max_tokens=w.output_len, ignore_eos=True, temperature=w.temperature, top_p=w.top_p, seed=submitted)
        engine.add(Request(rid, prompt_of(submitted, w.prompt_len, vocab), params))
        sent[rid] = time.perf_counter()
        before_first[rid] = (dict(engine.clock.seconds), engine.clock.steps)
        submitted += 1

    engine.clock.reset()
    start = time.perf_counter()
    for _ in range(w.num_requests if w.burst else min(w.concurrency, w.num_requests)):
        submit()
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            key = (out.request_id, out.index)
            (itl.append(now - last[key]) if key in last else ttft.append(now - sent[out.request_id]))
            if out.request_id in before_first:
                seconds, steps = before_first.pop(out.request_id)
                first_steps += engine.clock.steps - steps
                for p in PHASES:
                    first_phases[p] += engine.clock.seconds[p] - seconds[p]
            last[key] = now
            out_tokens += len(out.token_ids)
            number = int(out.request_id.rsplit("-", 1)[1])
            lengths[number] = lengths.get(number, 0) + len(out.token_ids)
            if out.finished:
                finished += 1
                if submitted < w.num_requests:
                    submit()
    wall = time.perf_counter() - start
    engine.runner.step_events = None
    return {"wall_s": wall, "output_tokens": out_tokens, "prompt_tokens": w.num_requests * w.prompt_len,
            "busy": _busy_s(events) / wall, "ttft": ttft, "itl": itl, "lengths": lengths,
            "host_ms": engine.clock.per_step_ms(), "steps": engine.clock.steps,
            "first_steps": first_steps / max(1, len(ttft)),
            "first_ms": {p: v / max(1, len(ttft)) * 1e3 for p, v in first_phases.items()}}


PHASES_HEADER = (["workload", "steps", "step ms (wall)"] + [f"{p} ms" for p in PHASES]
                 + ["steps to a first token", "of its TTFT: launch / wait ms"])


def phase_row(name: str, res: dict) -> list:
    """Host milliseconds per step by phase (engine.phases): where a host-bound step's time goes."""
    return ([name, res["steps"], f"{res['wall_s'] / max(1, res['steps']) * 1e3:.2f}"]
            + [f"{res['host_ms'][p]:.2f}" for p in PHASES]
            + [f"{res['first_steps']:.1f}", f"{res['first_ms']['launch']:.1f} / {res['first_ms']['wait']:.1f}"])


def _busy_s(events: list[tuple]) -> float:
    if not events or events[0][0] is None:  # CPU: no events
        return float("nan")
    torch.cuda.synchronize()
    return sum(start.elapsed_time(end) for start, end in events) / 1e3


def model_rates(engine, batch: int, prompt_len: int) -> tuple[float, float]:
    """Model-only decode seconds per step at ``batch`` (the graphs the loop uses) and packed-prefill tokens/s."""
    model, vocab = engine.runner.model, engine.vocab_size
    slots = torch.arange(batch, device="cuda")
    tokens = torch.randint(1, vocab, (batch,), device="cuda")
    decode_s = cuda_time_ms(lambda: model.decode(tokens, slots)) / 1e3
    n = max(1, min(64, 32768 // prompt_len, engine.num_slots))  # packed as the loop can: no more than its slots
    chunks = [prompt_of(i, prompt_len, vocab) for i in range(n)]
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


def bench_serve(engine, workloads: list[Workload]) -> tuple[list[list], list[list]]:
    """A row of the serving table and one of host time per phase, per workload."""
    engine.warm_up()
    settle_heap()  # as the worker does
    rows, phases = [], []
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
        phases.append(phase_row(w.name, res))
    return rows, phases


SERVE_HEADER = ["workload", "output tok/s", "model bound tok/s", "of bound", "GPU busy", "ITL p50 ms",
                "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms", "prompt tok/s"]


# A 10-field schema, every field bounded (a random model's strings end at their maxLength)
TEN_FIELDS = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 24}, "active": {"type": "boolean"},
    "score": {"type": "integer", "minimum": -1000, "maximum": 1000}, "city": {"type": "string", "maxLength": 12},
    "kind": {"enum": ["person", "company", "goose"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "id": {"type": "integer", "minimum": 0, "maximum": 99999}, "note": {"type": "string", "maxLength": 20}}}
TEN_FIELDS["required"] = list(TEN_FIELDS["properties"])
CONSTRAINED_HEADER = ["workload", "output tok/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "mean output tokens",
                      "vs all free"]


def bench_constrained(engine, concurrency: int, num_requests: int, prompt_len: int = 128,
                      free_len: int = 256) -> tuple[list[list], list[list]]:
    """Half the requests constrained by TEN_FIELDS (ending when their JSON does), half free; then the same
    workload all free, each request generating as many tokens as it did constrained: the grammar's cost alone."""
    spec = {"type": "json_schema", "value": TEN_FIELDS}

    def mixed_params(i: int) -> SamplingParams:
        if i % 2 == 0:
            return SamplingParams(max_tokens=free_len, seed=i, structured=spec)
        return SamplingParams(max_tokens=free_len, ignore_eos=True, seed=i)
    mixed = Workload(f"{concurrency} streams, half constrained (10-field schema)", concurrency, num_requests,
                     prompt_len, free_len, make_params=mixed_params)
    engine.warm_up()
    settle_heap()
    run_workload(engine, replace(mixed, num_requests=max(4, concurrency // 4), name="warm-up"))
    constrained = run_workload(engine, mixed)
    lengths = constrained["lengths"]
    free = replace(mixed, name=f"{concurrency} streams, all free (the same lengths)", make_params=lambda i:
                   SamplingParams(max_tokens=max(1, lengths.get(i, free_len)), ignore_eos=True, seed=i))
    baseline = run_workload(engine, free)
    rows, phases = [], []
    for w, res in ((free, baseline), (mixed, constrained)):
        phases.append(phase_row(w.name, res))
        rate = res["output_tokens"] / res["wall_s"]
        rows.append([w.name, f"{rate:,.0f}", f"{pct(res['itl'], 0.5):.1f}", f"{pct(res['itl'], 0.99):.1f}",
                     f"{pct(res['ttft'], 0.5):.0f}", f"{res['output_tokens'] / max(1, len(res['lengths'])):.0f}",
                     f"{rate / (baseline['output_tokens'] / baseline['wall_s']):.2f}"])
    return rows, phases


def bench_serve_cmd(device: str, shape: str, concurrency: int | None, constrained: bool = False,
                    prefill_graphs: bool = True, prefill_hold_tokens: int = 0, only: list[str] | None = None) -> str:
    """The tables of ``python -m benchmarks.engine --serve``: a tiny model on one core, or a preset shape's random
    weights on the GPU, through the serving workloads (or, ``constrained``, half of them JSON-constrained)."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    cpu = device == "cpu"
    c = concurrency or (8 if cpu else 256 if constrained else 1024)
    if cpu:
        torch.set_num_threads(1)
        weights = weights_from_state_dict(random_state_dict(layers=2, width=128, vocab=65536, seed=0))
        title = "Serving loop in-process, tiny model (2 × 128) on one core"
    else:
        weights = preset_weights(shape)
        title = f"Serving loop in-process ({shape}, bf16 weights, fp32 state), {c} slots"
    engine = LLMEngine(EngineConfig(device=device, max_num_seqs=c, max_num_batched_tokens=max(8192, c),
                                    prefill_graphs=prefill_graphs, prefill_hold_tokens=prefill_hold_tokens),
                       weights=weights)
    if not prefill_graphs:
        title += ", eager prefill"
    if prefill_hold_tokens:
        title += f", new prompts held for {prefill_hold_tokens} tokens"
    if constrained:
        rows, phases = bench_constrained(engine, c, 4 * c, prompt_len=16 if cpu else 128,
                                         free_len=120 if cpu else 256)
        return (table(title + ": constrained decoding", CONSTRAINED_HEADER, rows) + "\n"
                + table("Host time per step by phase (ms)", PHASES_HEADER, phases))
    if cpu:
        workloads = [Workload(f"{c} concurrent, T=1", c, 2 * c, 16, 32), Workload("1 stream, T=1", 1, 2, 16, 64),
                     Workload(f"burst: {c} × 64-token prompts", c, c, 64, 4, burst=True)]
    else:
        workloads = standard_workloads(c)
    if only:
        workloads = [w for w in workloads if any(name in w.name for name in only)]
        if not workloads:
            raise SystemExit(f"no workload matches {only}")
    rows, phases = bench_serve(engine, workloads)
    return table(title, SERVE_HEADER, rows) + "\n" + table("Host time per step by phase (ms)", PHASES_HEADER, phases)

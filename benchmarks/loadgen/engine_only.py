"""``--engine-only``: the served workload through ``LLMEngine`` in this process (no Redis, no HTTP).

Same prompts, output lengths, sampling parameters, arrival times and concurrency limit; a request is
"sent" when it is added to the engine and its tokens "arrive" when the step that made them returns.
What the served run measures beyond this is the cost of the service around the engine.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.loadgen.dataset import BenchRequest
from benchmarks.loadgen.metrics import RequestRecord
from benchmarks.loadgen.occupancy import StepOccupancy


def prompt_ids(tokenizer, req: BenchRequest) -> list[int]:
    """What the API would queue for this prompt. Chat is rendered with the API's default template (its modules
    imported only for chat runs)."""
    if req.is_chat:
        from api.prompts import render_chat
        from api.schemas import ChatMessage
        from api.settings import Settings
        messages = [ChatMessage.model_validate(m) for m in req.prompt]
        return tokenizer.encode(render_chat(messages, Settings(), add_generation_prompt=True))
    if isinstance(req.prompt, str):
        return tokenizer.encode(req.prompt)
    return list(req.prompt)


def chat_default_stop() -> list[str]:
    from api.settings import Settings
    return list(Settings().chat_default_stop)


def run_engine_only(args: argparse.Namespace, requests: list[BenchRequest], arrivals: list[float],
                    max_concurrency: int | None, sampling: dict) -> tuple[list[RequestRecord], float, float | None]:
    """Records of every request, the run's duration and its mean slot occupancy, after the engine's warm-up and
    one untimed request."""
    from engine.args import build_engine, worker_engine_config
    from engine.gc_policy import settle_heap
    from engine.params import SamplingParams
    from engine.sequence import Request
    from engine.synthetic import parse_engine_spec

    synthetic = parse_engine_spec(args.engine)
    engine = build_engine(worker_engine_config(args, synthetic), synthetic)  # as `gaggle worker` builds it
    engine.warm_up()  # as the worker does before its first heartbeat: no compilation or capture in the timed run
    prompts = [prompt_ids(engine.tokenizer, r) for r in requests]
    stop = chat_default_stop() if requests and requests[0].is_chat else []

    def request(rid: str, i: int) -> Request:
        return Request(rid, list(prompts[i]), SamplingParams(max_tokens=requests[i].max_tokens, stop=stop, **sampling))

    engine.add(request("warmup", 0))  # as vLLM's initial test request: compile, allocate, then time
    while engine.has_work():
        engine.step()
    settle_heap()  # as the worker does before it serves
    return _timed_run(engine, request, prompts, arrivals, max_concurrency)


def _timed_run(engine, request, prompts: list[list[int]], arrivals: list[float],
               max_concurrency: int | None) -> tuple[list[RequestRecord], float, float | None]:
    n = len(prompts)
    occupancy = StepOccupancy()
    records = [RequestRecord(i, prompt_tokens=len(p)) for i, p in enumerate(prompts)]
    last: dict[int, float] = {}
    next_i, num_running, num_done = 0, 0, 0
    t0 = time.monotonic()
    while num_done < n:
        now = time.monotonic() - t0
        while next_i < n and arrivals[next_i] <= now and (not max_concurrency or num_running < max_concurrency):
            rec = records[next_i]
            rec.start = time.monotonic() - t0
            try:
                engine.add(request(str(next_i), next_i))
                num_running += 1
            except ValueError as e:
                rec.error, rec.end = str(e), rec.start
                num_done += 1
            next_i += 1
        if not engine.has_work():
            if next_i < n:
                time.sleep(max(0.0, t0 + arrivals[next_i] - time.monotonic()))
            continue
        running = engine.num_running
        outputs = engine.step()
        occupancy.observe(running, engine.num_slots, time.monotonic() - t0 - now)
        now = time.monotonic() - t0
        for out in outputs:
            i = int(out.request_id)
            rec = records[i]
            if i in last:
                rec.itl.append(now - last[i])
            else:
                rec.ttft = now - rec.start
                rec.cached_tokens = out.num_cached_tokens
            last[i] = now
            if out.finished:
                rec.is_success, rec.output_tokens = True, out.num_output_tokens
                rec.e2e, rec.end = now - rec.start, now
                num_running -= 1
                num_done += 1
    return records, max((r.end for r in records), default=0.0), occupancy.mean

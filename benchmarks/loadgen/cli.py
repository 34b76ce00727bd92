"""``gaggle bench``: flags and the command (registered by ``cli/main.py``).

    gaggle bench --base-url http://127.0.0.1:8000 --num-prompts 200 --input-len 512 --output-len 128 \\
                 --request-rate 20 --save-result served.json
    gaggle bench --engine-only --model m.pth --num-prompts 200 --input-len 512 --output-len 128 \\
                 --request-rate 20 --compare served.json
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time

import orjson

from api.base_url import add_base_url_arg
from benchmarks.loadgen import metrics as m
from benchmarks.loadgen.dataset import BenchRequest, arrival_times, file_requests, random_requests

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def default_client_processes() -> int:
    """A quarter of the cores, 1 to 16. One process costs ~30 µs of CPU per SSE arrival (measured on a 2-core
    VM against a scripted server: 20k separately arriving chunks/s took 0.65 CPU s/s), so it keeps up with
    ~25k token chunks a second; its CPU use is printed with the results (near 1.0 CPU s/s: the bottleneck)."""
    return max(1, min(16, (os.cpu_count() or 1) // 4))


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The bench flags plus the worker's engine flags (for --engine-only); ``p`` resolves the one clash,
    --model, in favour of the bench's meaning (``conflict_handler="resolve"``)."""
    from engine.args import add_engine_args, add_engine_kind_arg
    add_engine_args(p)
    add_engine_kind_arg(p)  # --engine-only with a synthetic engine: the served path's cost on machines without a GPU
    g = p.add_argument_group("target")
    add_base_url_arg(g)
    g.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    g.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY if set)")
    g.add_argument("--model", default=None,
                   help="served model name (default: the first id of GET /v1/models); with --engine-only the "
                        "RWKV-7 weights as for `gaggle worker --model` (default: the demo model)")
    g.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds a request may take in all")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-path", help="JSONL of {\"prompt\": ...} or {\"messages\": [...]}, optional "
                                          "\"max_tokens\" (default: random token ids)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--input-len", type=int, default=1024)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len·(1−r), len·(1+r)]")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="random prompts all start with the same this many tokens (a shared instruction) before "
                        "their own --input-len")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, or inf: all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1: Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("sampling (sent only when given)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream (TTFT and ITL need it)")
    g = p.add_argument_group("run and results")
    g.add_argument("--client-processes", type=int, default=None,
                   help=f"client processes (default here: {default_client_processes()}, a quarter of the cores)")
    g.add_argument("--engine-only", action="store_true",
                   help="the same workload through the engine in this process (no Redis, no HTTP)")
    g.add_argument("--save-result", help="write every metric and the configuration to this JSON file")
    g.add_argument("--save-detailed", action="store_true", help="with per-request ttft/itl/e2el arrays")
    g.add_argument("--compare", help="a saved result of the other mode: print served / engine-only")


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    is_chat = args.endpoint == CHAT
    if args.dataset_path:
        return file_requests(args.dataset_path, args.num_prompts, args.output_len, is_chat)
    return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                           as_text=is_chat, shared_prefix_len=getattr(args, "shared_prefix_len", 0))


def sampling_fields(args: argparse.Namespace) -> dict:
    fields = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None}
    if args.ignore_eos:
        fields["ignore_eos"] = True
    return fields


def config_of(args: argparse.Namespace, model: str | None) -> dict:
    keys = ("base_url", "endpoint", "dataset_path", "num_prompts", "input_len", "shared_prefix_len", "output_len",
            "range_ratio", "burstiness", "max_concurrency", "seed", "temperature", "top_p", "top_k", "ignore_eos",
            "stream", "engine_only", "timeout")
    config = {k: getattr(args, k) for k in keys}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    config["model"] = model
    if args.engine_only:
        config["engine"] = {k: getattr(args, k) for k in ("engine", "device", "dtype", "state_dtype", "backend",
                                                          "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                          "prefill_per_decode", "min_prefill_chunk",
                                                          "prefill_hold_tokens", "prefill_hold_steps")}
    return config


def run_served(args: argparse.Namespace, requests: list[BenchRequest], arrivals: list[float],
               sampling: dict) -> tuple[str, list[m.RequestRecord], float, dict, float | None]:
    """(model, records, duration, the client's own costs, the server's mean slot occupancy or None)."""
    from benchmarks.loadgen.client import auth_headers, build_body, first_model, run_clients, send_one
    from benchmarks.loadgen.http import Endpoint, Pool
    from benchmarks.loadgen.occupancy import OccupancySampler
    model = args.model or asyncio.run(first_model(args.base_url, args.api_key))
    url = args.base_url.rstrip("/") + args.endpoint
    endpoint = Endpoint.parse(url)
    head = endpoint.request_head("POST", {"Content-Type": "application/json", **auth_headers(args.api_key)})
    bodies = [build_body(r, model, args.endpoint == CHAT, sampling, args.stream) for r in requests]

    async def initial_request() -> m.RequestRecord:  # as vLLM: one request before the clock starts
        pool, record = Pool(endpoint), m.RequestRecord(-1)
        await send_one(pool, head, bodies[0], args.stream, record, time.monotonic(), args.timeout)
        pool.close()
        return record
    first = asyncio.run(initial_request())
    if not first.is_success:
        print(f"gaggle bench: the initial test request failed: {first.error}", file=sys.stderr)
    with OccupancySampler(args.base_url, args.api_key) as occupancy:
        run = run_clients(url, head, bodies, [r.prompt_len for r in requests], arrivals, args.stream, args.timeout,
                          args.client_processes or default_client_processes(), args.max_concurrency)
    return model, run.records, run.duration_s, run.client, occupancy.mean


def cmd_bench(args: argparse.Namespace) -> int:
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        requests = build_requests(args)
        arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
        sampling = sampling_fields(args)
        if args.engine_only:
            from benchmarks.loadgen.engine_only import run_engine_only
            records, duration, occupancy = run_engine_only(args, requests, arrivals, args.max_concurrency, sampling)
            model, client, title = args.model, None, "Engine-only Benchmark Result"
        else:
            model, records, duration, client, occupancy = run_served(args, requests, arrivals, sampling)
            title = "Serving Benchmark Result"
    except (ValueError, RuntimeError, OSError) as e:
        print(f"gaggle bench: {e}", file=sys.stderr)
        return 2
    config = config_of(args, model)
    metrics = m.compute_metrics(records, duration)
    metrics["slot_occupancy"] = occupancy
    print(m.format_table(metrics, title, config, client))
    result = {"mode": "engine-only" if args.engine_only else "served",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config, "metrics": metrics, "client": client}
    if args.save_detailed:
        result["details"] = m.details(records)
    if args.compare:
        with open(args.compare, "rb") as f:
            other = orjson.loads(f.read())
        if other.get("mode") == result["mode"]:
            print(f"gaggle bench: {args.compare} is also a {result['mode']} result; no ratio", file=sys.stderr)
        else:
            served, engine = (other, result) if args.engine_only else (result, other)
            result["compare"] = {"file": args.compare, "served_over_engine_only": m.compare(served, engine)}
            print(m.format_comparison(result["compare"]["served_over_engine_only"]))
    if args.save_result:
        with open(args.save_result, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if not metrics["completed"]:
        print("gaggle bench: every request failed", file=sys.stderr)
        return 1
    return 0

"""``python -m benchmarks.loadgen.batch_bench``: how fast the OpenAI Batch API runs a big batch.

The target: a 10,000-line batch (128-token prompts, 256 output tokens, ignore_eos) completes in ≤ 1.1 × the
engine-only time of the same requests, while a trickle of synchronous streaming requests keeps TTFT p50 ≤ 100 ms.

    gaggle bench --engine-only --num-prompts 10000 --input-len 128 --output-len 256 --ignore-eos \\
                 --temperature 1.0 --save-result engine.json
    python -m benchmarks.loadgen.batch_bench --engine-only-result engine.json

The lines are the requests ``gaggle bench`` builds for the same flags (same seed → same prompts).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import numpy as np
import orjson

from api.base_url import add_base_url_arg
from benchmarks.loadgen.cli import CHAT, COMPLETIONS, build_requests, sampling_fields
from benchmarks.loadgen.client import build_body, cached_tokens
from benchmarks.loadgen.dataset import random_requests
from benchmarks.report import command_line, publish, table

TERMINAL = ("completed", "failed", "expired", "cancelled")
TITLE = "Batch API benchmark"
TRICKLE_PROMPT_LEN = 32
PROGRESS_EVERY_S = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_url_arg(p)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or "none")
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    p.add_argument("--num-lines", type=int, default=10_000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every line's prompt starts with the same this many tokens (a shared instruction)")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--trickle-rate", type=float, default=2.0,
                   help="synchronous streaming requests a second while the batch runs (0: none)")
    p.add_argument("--trickle-output-len", type=int, default=16)
    p.add_argument("--engine-only-result", help="JSON of `gaggle bench --engine-only --save-result` (same workload)")
    p.add_argument("--cache-off-result",
                   help="JSON of this program's --save-result for the same lines on a service with the prefix cache "
                        "off (`--prefix-cache-gib 0`): the table adds cache off / on")
    p.add_argument("--save-result", help="write every number here (JSON)")
    p.add_argument("--out", default="BENCHMARKS.md", help="put the table here ('-': print only)")
    p.add_argument("--area", default="batch", help="the BENCHMARKS.md block to replace")
    p.add_argument("--poll-s", type=float, default=0.5, help="seconds between batch status polls")
    p.add_argument("--keep-files", action="store_true", help="keep the uploaded input and the output files")
    return p.parse_args(argv)


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The `gaggle bench` flags of the same workload: its own functions then build the same requests and bodies."""
    return argparse.Namespace(endpoint=args.endpoint, dataset_path=None, num_prompts=args.num_lines,
                              input_len=args.input_len, shared_prefix_len=args.shared_prefix_len,
                              output_len=args.output_len, range_ratio=0.0, seed=args.seed,
                              temperature=args.temperature, top_p=None, top_k=None, ignore_eos=True)


def batch_lines(args: argparse.Namespace, model: str, requests: list) -> bytes:
    """The JSONL input: line i is the body gaggle bench sends as request i (not streamed)."""
    sampling = sampling_fields(bench_args(args))
    out = []
    for i, req in enumerate(requests):
        body = orjson.Fragment(build_body(req, model, args.endpoint == CHAT, sampling, False))
        out.append(orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": args.endpoint, "body": body}))
    return b"\n".join(out) + b"\n"


class Trickle:
    """Streaming completions at a fixed spacing, each sent from a pool thread so a slow one never delays the
    next send; records TTFT (send → first chunk with text) or the error."""

    def __init__(self, client, model: str, args: argparse.Namespace):
        self.client, self.model, self.args = client, model, args
        # another seed than the batch's: these prompts share no prefix with its lines
        self.prompts = [r.prompt for r in random_requests(1024, TRICKLE_PROMPT_LEN, 1, 0.0, args.seed + 1, False)]
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="trickle")
        self.futures: list[Future] = []
        self.timeline: list[tuple[float, float | None]] = []  # (seconds after the first send, TTFT ms)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._schedule, name="trickle-clock", daemon=True)

    def start(self) -> None:
        if self.args.trickle_rate > 0:
            self.thread.start()

    def _schedule(self) -> None:
        start, i = time.monotonic(), 0
        while not self.stopped.wait(max(0.0, start + i / self.args.trickle_rate - time.monotonic())):
            self.futures.append(self.pool.submit(self._one, self.prompts[i % len(self.prompts)],
                                                 round(i / self.args.trickle_rate, 2)))
            i += 1

    def _one(self, prompt: list[int], offset: float) -> tuple[float | None, str | None]:
        """One request, sent ``offset`` seconds after the first (its place in the timeline)."""
        sent = time.perf_counter()
        ttft = None
        try:
            stream = self.client.completions.create(model=self.model, prompt=prompt, stream=True,
                                                    max_tokens=self.args.trickle_output_len,
                                                    temperature=self.args.temperature,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:  # read to the end: a failure mid-stream counts as a failure
                if ttft is None and chunk.choices and chunk.choices[0].text:
                    ttft = time.perf_counter() - sent
        except Exception as e:  # noqa: BLE001 — any failure is a data point, not a crash
            return None, f"{type(e).__name__}: {e}"[:300]
        self.timeline.append((offset, None if ttft is None else round(ttft * 1e3, 1)))
        return (ttft, None) if ttft is not None else (None, "no chunk with text")

    def stop(self) -> dict:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        results = [f.result() for f in self.futures]
        self.pool.shutdown()
        ttfts = [t * 1000.0 for t, err in results if err is None]
        errors = [err for _, err in results if err is not None]
        pct = (lambda q: float(np.percentile(ttfts, q))) if ttfts else (lambda q: None)
        return {"requests": len(results), "failed": len(errors), "ttft_p50_ms": pct(50), "ttft_p99_ms": pct(99),
                "errors": errors[:5], "timeline": sorted(self.timeline, key=lambda x: x[0])}


def progress(batch, elapsed: float) -> str:
    counts, usage = batch.request_counts, batch.usage
    done, failed, total = (counts.completed, counts.failed, counts.total) if counts else (0, 0, 0)
    tokens = usage.output_tokens if usage else 0  # the server's running sum over finished lines
    return (f"batch_bench: {batch.status:<11} {done:,} done, {failed:,} failed of {total:,}  {tokens:,} output "
            f"tokens  {tokens / max(elapsed, 1e-9):,.0f} tok/s  {elapsed:.0f} s")


def run_batch(client, input_file_id: str, args: argparse.Namespace, trickle: Trickle):
    """Create the batch and poll it to its end: the last batch object and the client's wall seconds."""
    started = time.perf_counter()  # just before create: the batch's whole life as a client sees it
    batch = client.batches.create(input_file_id=input_file_id, endpoint=args.endpoint, completion_window="24h")
    trickle.start()
    last_print = started
    while batch.status not in TERMINAL:
        time.sleep(args.poll_s)
        batch = client.batches.retrieve(batch.id)
        now = time.perf_counter()
        if now - last_print >= PROGRESS_EVERY_S:
            print(progress(batch, now - started), file=sys.stderr, flush=True)
            last_print = now
    wall = time.perf_counter() - started
    print(progress(batch, wall), file=sys.stderr, flush=True)
    return batch, wall


def file_records(client, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    return [orjson.loads(raw) for raw in client.files.content(file_id).content.splitlines() if raw.strip()]


def check_outputs(client, batch, num_lines: int) -> dict:
    """Every custom_id exactly once across the output and error files; successes and their output tokens."""
    out, err = file_records(client, batch.output_file_id), file_records(client, batch.error_file_id)
    seen = Counter(r.get("custom_id") for r in out + err)
    expected = {f"line-{i}" for i in range(num_lines)}
    ok, bad = [], list(err)
    for r in out:
        (ok if (r.get("response") or {}).get("status_code") == 200 else bad).append(r)
    usages = [r["response"]["body"].get("usage") or {} for r in ok]
    tokens = sum(u.get("completion_tokens", 0) for u in usages)
    errors = [r.get("error") or ((r.get("response") or {}).get("body") or {}).get("error") for r in bad[:5]]
    return {"succeeded": len(ok), "failed": len(bad), "output_tokens": tokens,
            "prompt_tokens": sum(u.get("prompt_tokens", 0) for u in usages),
            "cached_prompt_tokens": sum(cached_tokens(u) for u in usages),
            "missing": len(expected - set(seen)), "duplicated": sum(1 for n in seen.values() if n > 1),
            "unexpected": len(set(seen) - expected), "errors": errors}


def read_result(path: str) -> dict:
    with open(path, "rb") as f:
        return orjson.loads(f.read())


def engine_only_seconds(path: str | None, args: argparse.Namespace) -> float | None:
    """The reference duration; warns when the saved run's workload is not this one."""
    if not path:
        return None
    saved = read_result(path)
    config = saved.get("config") or {}
    ours = {"num_prompts": args.num_lines, "input_len": args.input_len, "output_len": args.output_len,
            "shared_prefix_len": args.shared_prefix_len,
            "seed": args.seed, "ignore_eos": True, "range_ratio": 0.0, "dataset_path": None,
            "endpoint": args.endpoint, "temperature": args.temperature}  # the endpoint picks ids or text prompts
    unset = ("temperature",)  # gaggle bench sends it only when given: None is the server's default (1.0)
    differ = [k for k, v in ours.items() if k in config and config[k] != v and not (k in unset and config[k] is None)]
    if differ:
        print(f"batch_bench: {path} ran another workload ({', '.join(differ)} differ); the ratio compares unlike "
              "runs", file=sys.stderr)
    return float((saved.get("metrics") or saved)["duration_s"])


def cache_off_seconds(path: str | None, args: argparse.Namespace) -> float | None:
    """The same batch's wall seconds on a service with the prefix cache off (this program's saved result)."""
    if not path:
        return None
    saved = read_result(path)
    config = saved.get("config") or {}
    keys = ("num_lines", "input_len", "shared_prefix_len", "output_len", "seed", "endpoint", "temperature")
    differ = [k for k in keys if config.get(k) != getattr(args, k)]
    if differ:
        print(f"batch_bench: {path} ran other lines ({', '.join(differ)} differ); cache off / on compares unlike "
              "runs", file=sys.stderr)
    return float(saved["batch_wall_s"])


def unique_prompt_tokens(args: argparse.Namespace, requests: list) -> int | None:
    """Prompt tokens a perfect prefix cache computes: the shared prefix once, then each line's own (token-id
    prompts; None for chat, whose template adds tokens the client does not count)."""
    if args.endpoint == CHAT:
        return None
    return args.shared_prefix_len + sum(r.prompt_len - args.shared_prefix_len for r in requests)


def render(r: dict) -> str:
    def num(v, fmt: str = ",.2f") -> str:
        return "–" if v is None else format(v, fmt)
    t = r["trickle"]
    rows = [["Lines", f"{r['lines']:,}"], ["Status", r["status"]],
            ["Succeeded / failed", f"{r['succeeded']:,} / {r['failed']:,}"],
            ["Missing / duplicated custom_id", f"{r['missing']} / {r['duplicated']}"],
            ["Output tokens", f"{r['output_tokens']:,}"],
            ["Batch wall s (client: create → the poll that saw it end)", num(r["batch_wall_s"])],
            ["Server s (completed_at − in_progress_at, whole seconds)", num(r["server_s"], ",d")],
            ["Output tok/s (over the wall time)", num(r["output_throughput"], ",.1f")],
            ["Engine-only s (same workload)", num(r["engine_only_s"])],
            ["Batch / engine-only (target ≤ 1.1)", num(r["ratio"], ".3f")],
            ["Prompt tokens sent / taken from the prefix cache",
             f"{r['prompt_tokens']:,} / {r['cached_prompt_tokens']:,}"],
            ["Prompt tokens computed / unique (shared prefix once, then each line's own)",
             f"{r['prompt_tokens'] - r['cached_prompt_tokens']:,} / {num(r['unique_prompt_tokens'], ',d')}"
             f" = {num(r['computed_over_unique'], '.3f')}"],
            *([["Cache off s (same lines, `--prefix-cache-gib 0`)", num(r["cache_off_s"])],
               ["Cache off / on", num(r["cache_speedup"], ".2f")]] if r.get("cache_off_s") else []),
            ["Trickle requests (sync, streamed)", f"{t['requests']:,} at {r['config']['trickle_rate']}/s"],
            ["Trickle TTFT p50 / p99 ms (target p50 ≤ 100)", f"{num(t['ttft_p50_ms'], '.1f')} / "
                                                               f"{num(t['ttft_p99_ms'], '.1f')}"],
            ["Trickle failures", f"{t['failed']:,}"]]
    c = r["config"]
    shared = f"{c['shared_prefix_len']:,} shared + " if c.get("shared_prefix_len") else ""
    sub = (f"{c['num_lines']:,} lines × {shared}{c['input_len']} prompt / {c['output_len']} output tokens, ignore_eos, "
           f"{c['endpoint']}, model {c['model']}")
    return table(sub, ["Metric", "Value"], rows)


def redacted(argv: list[str]) -> list[str]:
    """The command line as published: the API key's value hidden (BENCHMARKS.md is committed)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--api-key="):
            out[i] = "--api-key=…"
        elif arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "…"
    return out


def main(argv: list[str] | None = None) -> int:
    import openai  # here: --help needs no SDK import

    args = parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key, timeout=600)
    model = args.model or client.models.list().data[0].id
    engine_s = engine_only_seconds(args.engine_only_result, args)
    cache_off_s = cache_off_seconds(args.cache_off_result, args)
    requests = build_requests(bench_args(args))  # the lines' requests, as gaggle bench builds them
    unique = unique_prompt_tokens(args, requests)
    with tempfile.NamedTemporaryFile(prefix="batch-bench-", suffix=".jsonl") as f:
        f.write(batch_lines(args, model, requests))
        f.flush()
        uploaded = client.files.create(file=Path(f.name), purpose="batch")  # the SDK reads a path, names the part
    trickle_client = openai.OpenAI(base_url=client.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    trickle = Trickle(trickle_client, model, args)
    try:
        batch, wall = run_batch(client, uploaded.id, args, trickle)
    finally:
        trickle_stats = trickle.stop()
    checked = check_outputs(client, batch, args.num_lines)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}  # no secret in a results file
    server_s = batch.completed_at - batch.in_progress_at if batch.completed_at and batch.in_progress_at else None
    result = {"date": datetime.now().astimezone().isoformat(timespec="seconds"),
              "config": {**config, "model": model}, "batch_id": batch.id, "status": batch.status,
              "lines": args.num_lines, **checked, "batch_wall_s": wall, "server_s": server_s,
              "output_throughput": checked["output_tokens"] / wall, "engine_only_s": engine_s,
              "ratio": wall / engine_s if engine_s else None, "trickle": trickle_stats,
              "unique_prompt_tokens": unique,
              "computed_over_unique": (checked["prompt_tokens"] - checked["cached_prompt_tokens"]) / unique
              if unique else None,
              "cache_off_s": cache_off_s, "cache_speedup": cache_off_s / wall if cache_off_s else None,
              "batch_errors": [e.model_dump() for e in batch.errors.data] if batch.errors else None}
    if not args.keep_files:  # a 10k-line upload and its outputs are megabytes each in the file store
        for file_id in (uploaded.id, batch.output_file_id, batch.error_file_id):
            if file_id:
                client.files.delete(file_id)
    publish(args.area, command_line("benchmarks.loadgen.batch_bench", redacted(sys.argv[1:] if argv is None else argv)),
            render(result), args.out, title=TITLE)
    if args.save_result:
        with open(args.save_result, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    for problem in (result["batch_errors"] or []) + checked["errors"] + trickle_stats["errors"]:
        print(f"batch_bench: error: {problem}", file=sys.stderr)
    if batch.status != "completed" or checked["missing"] or checked["duplicated"] or checked["unexpected"]:
        print(f"batch_bench: batch {batch.status}; custom_id missing {checked['missing']}, duplicated "
              f"{checked['duplicated']}, unexpected {checked['unexpected']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a served request's time to first token goes: a `gaggle bench --save-detailed` result joined, by request
id, with the JSON logs of the API and the workers (`gaggle up` writes them under DATA_DIR/logs).

    python -m benchmarks.loadgen.breakdown served.json .gaggle/logs [--out BENCHMARKS.md]
    python -m benchmarks.loadgen.breakdown engine-only.json     (a closed loop's waves only)

Each streamed request's client TTFT splits into five consecutive parts (all wall clock, one host):
client sent → the API built the request (HTTP, parsing, tokenizing) → a worker took it (admission, enqueue, the
stream, the worker's reader, and its step loop coming round to the inbox after the device's step in flight) → the
worker had its first token (the engine: waiting, prefill, the step) → the API had it (the worker's writer, pub/sub,
the API's dispatch) → the client read it (SSE). The API's log stamps are rounded to the millisecond. The worker's
part splits further (a second table): → the engine had it (the entry accepted: "request queued") → its last prompt
chunk was launched ("prefill done": waiting for prefill budget) → its first token was folded for the writer (the
device's steps and the loop's read-back). A last table says, per worker, how many steps its freed slots waited
for their next request (benchmarks/loadgen/refill.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from benchmarks.loadgen.refill import percentile, read_slot_log, refill_table
from benchmarks.report import command_line, publish, table

PARTS = ("client → API built the request", "→ a worker took it", "→ first token on the worker",
         "→ first token at the API", "→ first token at the client")
INTAKE_PARTS = ("API built the request → in its Redis stream (the API's enqueue; the entry id's millisecond)",
                "→ the worker's reader had it (Redis, the reader's round trips)",
                "→ the worker's loop took it (its inbox)")
WORKER_PARTS = ("took it → in the engine (accepted)", "→ last prompt chunk launched",
                "→ first token on the worker")
# the worker-side stamps the inner split reads, by (logger, message): the API logs a "request queued" too
STAMPS = {("engine.engine", "request queued"): "queued", ("engine.engine", "prefill done"): "prefilled"}


def read_logs(paths: list[Path]) -> tuple[dict[str, dict], dict[str, float]]:
    """From JSON log lines: each request's worker-side times ("request finished": created, queued_s, ttft_s,
    and the stamps of ``STAMPS`` when logged before it) and the API's first-token stamps."""
    worker, api_first, stamps = {}, {}, {}
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                if not line.startswith(b"{"):
                    continue
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                rid, msg = entry.get("request_id"), entry.get("msg")
                if rid is None:
                    continue
                if msg == "request finished" and "ttft_s" in entry:
                    worker[rid] = {**entry, **stamps.pop(rid, {})}
                elif (entry.get("logger"), msg) in STAMPS:
                    stamps.setdefault(rid, {}).setdefault(STAMPS[entry["logger"], msg], entry["ts"])
                elif msg == "first token":
                    api_first.setdefault(rid, entry["ts"])
    return worker, api_first


def took_and_first(w: dict) -> tuple[float, float]:
    """When the worker's loop took a request and when it had its first token, from its "request finished" line."""
    return w["request_created"] + w["queued_s"], w["request_created"] + w["ttft_s"]


def split(details: dict, worker: dict[str, dict], api_first: dict[str, float]) -> list[tuple[float, ...]]:
    """Per joined request: the five parts in seconds (they add up to its client TTFT)."""
    rows = []
    for rid, sent, ttft in zip(details["request_id"], details["sent_wall"], details["ttft"]):
        w = worker.get(rid)
        if rid is None or ttft is None or w is None or rid not in api_first:
            continue
        created, (took, first) = w["request_created"], took_and_first(w)
        rows.append((created - sent, took - created, first - took, api_first[rid] - first,
                     sent + ttft - api_first[rid]))
    return rows


def intake_split(details: dict, worker: dict[str, dict]) -> list[tuple[float, ...]]:
    """Per request whose result has the stream entry's and the reader's stamps: ``INTAKE_PARTS`` in seconds (they
    add up to the second part of ``split``; the entry's time has a millisecond's resolution)."""
    rows = []
    for rid in details["request_id"]:
        w = worker.get(rid)
        if w is not None and "read_s" in w and "added_s" in w:
            rows.append((w["added_s"], w["read_s"] - w["added_s"], w["queued_s"] - w["read_s"]))
    return rows


def worker_split(details: dict, worker: dict[str, dict]) -> dict[str, tuple[float, ...]]:
    """By id, each request of the result with both inner stamps: ``WORKER_PARTS`` in seconds (they add up to
    the worker's part of its TTFT)."""
    rows = {}
    for rid in details["request_id"]:
        w = worker.get(rid)
        if w is None or "queued" not in w or "prefilled" not in w:
            continue
        took, first = took_and_first(w)
        rows[rid] = (w["queued"] - took, w["prefilled"] - w["queued"], first - w["prefilled"])
    return rows


def breakdown_table(rows: list[tuple[float, ...]], parts: tuple[str, ...] = PARTS,
                    title: str = "Time to first token, part by part", total: str = "client TTFT") -> str:
    body = []
    for i, name in enumerate(parts):
        part = [r[i] for r in rows]
        body.append([name] + [f"{1e3 * percentile(part, q):.1f}" for q in (0.5, 0.9, 0.99)]
                    + [f"{1e3 * sum(part) / len(part):.1f}"])
    totals = [sum(r) for r in rows]
    body.append([total] + [f"{1e3 * percentile(totals, q):.1f}" for q in (0.5, 0.9, 0.99)]
                + [f"{1e3 * sum(totals) / len(totals):.1f}"])
    return table(f"{title} ({len(rows)} requests joined)",
                 ["part", "p50 ms", "p90 ms", "p99 ms", "mean ms"], body)


def waves_table(details: dict, concurrency: int) -> str:
    """A closed loop's time to first token by wave: requests in the order they were sent, ``concurrency`` at a
    time. The first wave arrives at once (its prompts queue for prefill); later ones replace finished requests,
    which is what a steady closed loop sees."""
    order = sorted((start, ttft) for start, ttft in zip(details["start"], details["ttft"]) if ttft is not None)
    body = []
    for first in range(0, len(order), concurrency):
        ttfts = [1e3 * ttft for _, ttft in order[first:first + concurrency]]
        body.append([f"{first // concurrency + 1}", str(len(ttfts))]
                    + [f"{percentile(ttfts, q):.1f}" for q in (0.5, 0.9, 0.99)] + [f"{sum(ttfts) / len(ttfts):.1f}"])
    return table(f"Time to first token by wave of {concurrency} (requests in the order sent)",
                 ["wave", "requests", "p50 ms", "p90 ms", "p99 ms", "mean ms"], body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a `gaggle bench --save-detailed --save-result` file of a served run")
    ap.add_argument("logs", nargs="*", help="log files, or folders of *.log (the API's and the workers'); without "
                                            "them only the closed loop's waves")
    ap.add_argument("--out", default="-", help="put the tables here ('-' = print only)")
    ap.add_argument("--area", default="ttft-breakdown", help="the BENCHMARKS.md block to replace")
    args = ap.parse_args(argv)
    result = orjson.loads(Path(args.result).read_bytes())
    if "details" not in result or "request_id" not in result["details"]:
        print("breakdown: the result has no per-request ids: run gaggle bench with --save-detailed", file=sys.stderr)
        return 2
    tables = []
    concurrency = result.get("config", {}).get("max_concurrency")
    if concurrency and result["config"].get("request_rate") in ("inf", None):
        tables.append(waves_table(result["details"], concurrency))
    if args.logs:
        paths = [p for arg in map(Path, args.logs) for p in (sorted(arg.glob("*.log")) if arg.is_dir() else [arg])]
        worker, api_first = read_logs(paths)
        rows = split(result["details"], worker, api_first)
        if not rows:
            print("breakdown: no request of the result is in those logs (INFO, JSON format needed)", file=sys.stderr)
            return 2
        inner = worker_split(result["details"], worker)
        if inner:
            tables.insert(0, breakdown_table(list(inner.values()), WORKER_PARTS, "Inside the worker",
                                             "the worker's part"))
        intake = intake_split(result["details"], worker)
        if intake:
            tables.insert(0, breakdown_table(intake, INTAKE_PARTS, "Into the worker", "→ a worker took it"))
        tables.insert(0, breakdown_table(rows))
        slot_logs = [log for log in map(read_slot_log, paths) if log is not None and log.admitted]
        if slot_logs:
            tables.append(refill_table(slot_logs))
    if not tables:
        print("breakdown: no logs given and the run was no closed loop: nothing to show", file=sys.stderr)
        return 2
    publish(args.area, command_line("benchmarks.loadgen.breakdown", argv), "\n".join(tables), args.out,
            title="TTFT breakdown")
    return 0


if __name__ == "__main__":
    sys.exit(main())

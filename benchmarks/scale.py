"""Where one Redis stops: ``python -m benchmarks.scale``.

N synthetic workers (``gaggle worker --engine synthetic:RATE``: the real engine loop, scheduler, detokenizer and
worker I/O, tokens at a fixed rate, no model) share one redis-server. Load comes from driver processes that do
what an API process does on Redis and nothing else: each subscribes to a request's channel (and waits for the
confirmation) before it enqueues the request, keeps a fixed number of streaming requests in flight (closed loop),
reads every delta and final from its one pub/sub connection, and unsubscribes when the final came. The HTTP tier
is left out on purpose: this measures the queue, the pub/sub fan-out and Redis itself (``gaggle bench`` against
``gaggle up`` measures the whole path).

Per row, over a measured window after a warm-up:
- produced tok/s: the workers' generated-token counters (their ``/metrics``), delivered tok/s: tokens that
  reached the drivers as stream deltas; delivered / produced;
- Redis: CPU (cores, from INFO), µs of Redis CPU per delivered token, commands per produced token (INFO
  commandstats, the largest named), a PING probe's round trip p50 / p99;
- latency through the queue: time to the first delta (p50 / p99) and the gap between a request's deltas;
- CPU of the workers and the drivers (cores, from /proc).

The capacity column is ``1 / (Redis CPU per token)``: the token rate at which this Redis would be 100% busy on
one core if everything else kept up. On a machine with few cores the workers and drivers saturate first, so the
delivered rate says little about Redis; its cost per token and commands per token are what carry over.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence

import redis

from benchmarks.report import command_line, publish
from worker import contract as c
from benchmarks.loadgen.scale_load import accept_client, drive
from worker.procs import cpu_seconds, serving_processes, tree_cpu_seconds
from worker.redis_server import RedisServer, free_port



# -- the run ---------------------------------------------------------------------------------------------------

def _worker_counters(port: int) -> tuple[float, float]:
    """A worker's generated tokens and its seconds in garbage collections so far (its ``/metrics``)."""
    values = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            for name in ("gaggle_worker_generated_tokens_total", "gaggle_worker_gc_seconds_total"):
                if line.startswith(name):
                    values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("gaggle_worker_generated_tokens_total", 0.0), values.get("gaggle_worker_gc_seconds_total", 0.0)


def _redis_snapshot(r: redis.Redis) -> dict:
    cpu = r.info("cpu")
    stats = r.info("commandstats")
    return {"cpu": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
            "commands": {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}}


def _probe(r: redis.Redis, until: float, out: list[float]) -> None:
    while time.time() < until:
        t = time.perf_counter()
        r.ping()
        out.append(time.perf_counter() - t)
        time.sleep(0.01)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_workers(url: str, n: int, rate: float, seqs: int, logs: str,
                  extra: Sequence[str] = ()) -> list[tuple[subprocess.Popen, int]]:
    """``extra``: more ``gaggle worker`` flags (an A/B of a worker setting)."""
    workers = []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "worker", "--redis-url", url,
               "--engine", f"synthetic:{rate:g}", "--max-num-seqs", str(seqs), "--name", f"scale-w{i}",
               "--metrics-port", str(port), *extra]
        with open(os.path.join(logs, f"worker-{i}.log"), "w") as log:
            workers.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log), port))
    return workers


def wait_workers(r: redis.Redis, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = [m.decode() for m in r.zrange(c.WORKER_REGISTRY, 0, -1)]
        if sum(r.exists(c.heartbeat_key(name)) for name in names) >= n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{n} workers did not all start within {timeout_s:g} s")


def run(num_workers: int, rate: float, seqs: int, drivers: int, output_len: int, warm_s: float,
        measure_s: float, shared: bool = True, worker_args: Sequence[str] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="gaggle-scale-") as tmp:
        server = RedisServer(tmp).start()
        r = redis.Redis(port=server.port)
        workers = start_workers(server.url, num_workers, rate, seqs, tmp, worker_args)
        procs: list[multiprocessing.Process] = []
        try:
            wait_workers(r, num_workers)
            concurrency = num_workers * seqs
            t_from = time.time() + warm_s
            t_to = t_from + measure_s
            report = multiprocessing.Queue()
            for d in range(drivers):
                share = concurrency // drivers + (d < concurrency % drivers)
                p = multiprocessing.Process(target=drive, args=(server.port, f"d{d}", share, output_len,
                                                                (t_from, t_to), t_to + 0.5, shared, report),
                                            daemon=True)
                p.start()
                procs.append(p)
            time.sleep(max(0.0, t_from - time.time()))
            before = _redis_snapshot(r), [_worker_counters(p) for _, p in workers]
            cpu_before = [cpu_seconds(w.pid) for w, _ in workers], [cpu_seconds(p.pid) for p in procs]
            pings: list[float] = []
            _probe(redis.Redis(port=server.port), t_to, pings)
            after = _redis_snapshot(r), [_worker_counters(p) for _, p in workers]
            cpu_after = [cpu_seconds(w.pid) for w, _ in workers], [cpu_seconds(p.pid) for p in procs]
            reports = [report.get(timeout=60) for _ in procs]
        finally:
            for p in procs:
                p.kill()
            for w, _ in workers:
                w.kill()
                w.wait()
            server.stop()
    produced = sum(t for t, _ in after[1]) - sum(t for t, _ in before[1])
    gc_seconds = sum(g for _, g in after[1]) - sum(g for _, g in before[1])
    delivered = sum(rep["tokens"] for rep in reports)
    commands = {k: after[0]["commands"].get(k, 0) - before[0]["commands"].get(k, 0) for k in after[0]["commands"]}
    total_commands = sum(commands.values())
    redis_cpu = after[0]["cpu"] - before[0]["cpu"]
    top = sorted(((v, k) for k, v in commands.items() if v), reverse=True)[:4]
    return {
        "channels": "reply" if shared else "per request", "workers": num_workers, "rate": rate, "seqs": seqs, "drivers": drivers, "window_s": measure_s,
        "produced_tok_s": produced / measure_s, "delivered_tok_s": delivered / measure_s,
        "delivered_ratio": delivered / produced if produced else float("nan"),
        "redis_cores": redis_cpu / measure_s,
        "redis_us_per_token": 1e6 * redis_cpu / delivered if delivered else float("nan"),
        "commands_per_token": total_commands / produced if produced else float("nan"),
        "top_commands": ", ".join(f"{k} {v / produced:.3f}" for v, k in top) if produced else "",
        "ping_ms_p50": 1e3 * _pct(pings, 0.5), "ping_ms_p99": 1e3 * _pct(pings, 0.99),
        "ttft_ms_p50": 1e3 * _pct([x for rep in reports for x in rep["ttft"]], 0.5),
        "ttft_ms_p99": 1e3 * _pct([x for rep in reports for x in rep["ttft"]], 0.99),
        "gap_ms_p50": 1e3 * _pct([x for rep in reports for x in rep["gaps"]], 0.5),
        "gap_ms_p99": 1e3 * _pct([x for rep in reports for x in rep["gaps"]], 0.99),
        "tokens_per_delta": delivered / max(1, sum(rep["deltas"] for rep in reports)),
        "tokens_per_publish": delivered / max(1, sum(rep["publishes"] for rep in reports)),
        "worker_cores": (sum(cpu_after[0]) - sum(cpu_before[0])) / measure_s,
        "driver_cores": (sum(cpu_after[1]) - sum(cpu_before[1])) / measure_s,
        "worker_gc_ms_per_s": 1e3 * gc_seconds / measure_s / num_workers,
    }


def _wait_ready(url: str, workers: int, timeout_s: float = 120.0) -> None:
    import json
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if json.loads(resp.read()).get("workers", 0) >= workers:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the API at {url} did not see {workers} workers within {timeout_s:g} s")


@contextlib.contextmanager
def api_server(redis_url: str, logs: str, processes: int, *extra: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``gaggle api`` with ``processes`` processes, once it answers /health: (process, base URL). Stopped on
    exit; its log is kept as gaggle-scale-api.log in the temp directory."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(logs, "api.log")
    with open(log_path, "w") as log:
        api = subprocess.Popen([sys.executable, "-m", "cli.main", "--log-level", "WARNING", "api", "--redis-url",
                                redis_url, "--port", str(port), "--workers", str(processes), *extra],
                               stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                # every process listening: connections opened before one is would all stay on the others
                if processes == 1 or len(serving_processes(api.pid, port)) >= processes:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or api.poll() is not None:
                raise RuntimeError(f"the API did not start (log: {log_path})")
            time.sleep(0.3)
        yield api, url
    finally:
        api.terminate()
        try:
            api.wait(timeout=30)
        except subprocess.TimeoutExpired:
            api.kill()
        shutil.copy(log_path, os.path.join(tempfile.gettempdir(), "gaggle-scale-api.log"))


def run_api_tier(num_workers: int, rate: float, seqs: int, api_procs: int, client_procs: int, output_len: int,
                 rounds: int, worker_args: Sequence[str] = ()) -> dict:
    """The whole served path: the workers behind ``gaggle api`` (``api_procs`` processes), loaded by
    ``gaggle bench`` (closed loop, one stream per slot, ``rounds`` requests per slot)."""
    import json
    with tempfile.TemporaryDirectory(prefix="gaggle-scale-") as tmp:
        server = RedisServer(tmp).start()
        r = redis.Redis(port=server.port)
        workers = start_workers(server.url, num_workers, rate, seqs, tmp, worker_args)
        try:
            with api_server(server.url, tmp, api_procs) as (api, url):
                wait_workers(r, num_workers)
                _wait_ready(url, num_workers)
                concurrency = num_workers * seqs
                saved = os.path.join(tmp, "bench.json")
                before = _redis_snapshot(r), [_worker_counters(p)[0] for _, p in workers]
                cpu_before = tree_cpu_seconds(api.pid), sum(cpu_seconds(w.pid) for w, _ in workers)
                t0 = time.time()
                subprocess.run([sys.executable, "-m", "cli.main", "bench", "--base-url", url, "--num-prompts",
                                str(concurrency * rounds), "--max-concurrency", str(concurrency), "--input-len", "16",
                                "--output-len", str(output_len), "--ignore-eos", "--client-processes",
                                str(client_procs), "--save-result", saved], check=True, stdout=subprocess.DEVNULL)
                wall = time.time() - t0
                after = _redis_snapshot(r), [_worker_counters(p)[0] for _, p in workers]
                cpu_after = tree_cpu_seconds(api.pid), sum(cpu_seconds(w.pid) for w, _ in workers)
                with open(saved) as f:
                    result = json.load(f)
        finally:
            for w, _ in workers:
                w.kill()
                w.wait()
            server.stop()
    m = result["metrics"]
    produced = sum(after[1]) - sum(before[1])
    delivered = m["total_output_tokens"]
    commands = sum(after[0]["commands"].get(k, 0) - before[0]["commands"].get(k, 0) for k in after[0]["commands"])
    client = result.get("client") or {}
    return {"workers": num_workers, "rate": rate, "seqs": seqs, "api_procs": api_procs, "clients": client_procs,
            "delivered_tok_s": m["output_throughput"], "failed": m["failed"], "produced_tokens": produced,
            "delivered_tokens": delivered,
            "api_cores": (cpu_after[0] - cpu_before[0]) / wall, "api_us_per_token": 1e6 * (cpu_after[0] - cpu_before[0]) / delivered,
            "worker_cores": (cpu_after[1] - cpu_before[1]) / wall,
            "redis_us_per_token": 1e6 * (after[0]["cpu"] - before[0]["cpu"]) / delivered,
            "commands_per_token": commands / max(1, produced),
            "client_cpu": client.get("cpu_per_wall", float("nan")),
            "ttft_ms_p50": m["median_ttft_ms"], "ttft_ms_p99": m["p99_ttft_ms"],
            "itl_ms_p50": m["median_itl_ms"], "itl_ms_p99": m["p99_itl_ms"], "errors": m["errors"][:3]}


def api_table(rows: list[dict]) -> str:
    head = ("| workers × rate (slots) | API processes | client processes | delivered tok/s | failed | API cores | "
            "API µs / token | worker cores | Redis µs / token | commands / token | client CPU s/s | TTFT ms p50 / p99 | "
            "ITL ms p50 / p99 |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['workers']} × {r['rate']:,.0f} ({r['seqs']}) | {r['api_procs']} | {r['clients']} "
        f"| {r['delivered_tok_s']:,.0f} | {r['failed']} | {r['api_cores']:.2f} | {r['api_us_per_token']:.1f} "
        f"| {r['worker_cores']:.2f} | {r['redis_us_per_token']:.2f} | {r['commands_per_token']:.3f} "
        f"| {r['client_cpu']:.2f} | {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p99']:.1f} "
        f"| {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} |\n" for r in rows)


def run_accept(api_procs: int, client_procs: int, concurrency: int, seconds: float, tenants: int = 1) -> dict:
    """How many async requests per second ``api_procs`` API processes accept (queued in Redis, 202), with no
    worker: nothing competes with the API for the CPU but Redis and the clients. ``tenants``: that many tenants
    known to Redis (the others with empty streams), as admission sees them."""
    with tempfile.TemporaryDirectory(prefix="gaggle-scale-") as tmp:
        server = RedisServer(tmp).start()
        r = redis.Redis(port=server.port)
        if tenants > 1:
            r.zadd(c.TENANTS, {f"tenant-{i}": time.time() for i in range(tenants - 1)})
        procs = []
        try:
            with api_server(server.url, tmp, api_procs, "--max-queue", "100000000") as (api, url):
                report = multiprocessing.Queue()
                start = time.time() + 1.0
                until = start + seconds
                for k in range(client_procs):
                    share = concurrency // client_procs + (k < concurrency % client_procs)
                    p = multiprocessing.Process(target=accept_client, args=(url, share, until, report), daemon=True)
                    p.start()
                    procs.append(p)
                time.sleep(max(0.0, start - time.time()))
                redis_before, api_before = _redis_snapshot(r), tree_cpu_seconds(api.pid)
                time.sleep(max(0.0, until - time.time()))
                redis_after, api_after = _redis_snapshot(r), tree_cpu_seconds(api.pid)
                wall = time.time() - start
                reports = [report.get(timeout=120) for _ in procs]
                queued = sum(r.xlen(s) for s in r.scan_iter(match=c.request_stream("*", "*")))
        finally:
            for p in procs:
                p.kill()
            server.stop()
    statuses: dict[int, int] = {}
    for rep in reports:
        for code, n in rep["statuses"].items():
            statuses[code] = statuses.get(code, 0) + n
    latencies = [x for rep in reports for x in rep["latencies"]]
    accepted = statuses.get(202, 0)
    return {"api_procs": api_procs, "clients": client_procs, "concurrency": concurrency, "tenants": tenants,
            "accepted_per_s": accepted / seconds, "statuses": statuses, "queued": queued,
            "latency_ms_p50": 1e3 * _pct(latencies, 0.5), "latency_ms_p99": 1e3 * _pct(latencies, 0.99),
            "api_cores": (api_after - api_before) / wall,
            "api_us_per_request": 1e6 * (api_after - api_before) / max(1, accepted),
            "redis_us_per_request": 1e6 * (redis_after["cpu"] - redis_before["cpu"]) / max(1, accepted),
            "client_cores": sum(rep["cpu_s"] for rep in reports) / seconds}


def accept_table(rows: list[dict]) -> str:
    head = ("| API processes | tenants | client processes × connections | accepted / s | answers | queued | latency ms p50 / p99 | "
            "API cores | API µs / request | Redis µs / request | client cores |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['api_procs']} | {r['tenants']} | {r['clients']} × {r['concurrency'] // r['clients']} | {r['accepted_per_s']:,.0f} "
        f"| {', '.join(f'{k}: {v:,}' for k, v in sorted(r['statuses'].items()))} | {r['queued']:,} "
        f"| {r['latency_ms_p50']:.1f} / {r['latency_ms_p99']:.1f} | {r['api_cores']:.2f} "
        f"| {r['api_us_per_request']:.0f} | {r['redis_us_per_request']:.1f} | {r['client_cores']:.2f} |\n"
        for r in rows)


def table(rows: list[dict]) -> str:
    head = ("| channels | workers × rate (slots) | produced tok/s | delivered tok/s | delivered / produced | "
            "Redis cores | Redis µs / token | capacity at 1 core, tok/s | commands / token (largest) | "
            "PING ms p50 / p99 | first delta ms p50 / p99 | delta gap ms p50 / p99 | tokens / PUBLISH | "
            "worker / driver cores | GC ms / s a worker |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['channels']} | {r['workers']} × {r['rate']:,.0f} ({r['seqs']}) | {r['produced_tok_s']:,.0f} "
        f"| {r['delivered_tok_s']:,.0f} | {r['delivered_ratio']:.3f} | {r['redis_cores']:.2f} "
        f"| {r['redis_us_per_token']:.2f} | {1e6 / r['redis_us_per_token']:,.0f} "
        f"| {r['commands_per_token']:.3f} ({r['top_commands']}) | {r['ping_ms_p50']:.2f} / {r['ping_ms_p99']:.2f} "
        f"| {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p99']:.1f} | {r['gap_ms_p50']:.1f} / {r['gap_ms_p99']:.1f} "
        f"| {r['tokens_per_publish']:.1f} | {r['worker_cores']:.2f} / {r['driver_cores']:.2f} "
        f"| {r['worker_gc_ms_per_s']:.0f} |\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4,8,16", help="comma-separated worker counts, one row each")
    ap.add_argument("--rate", type=float, default=80_000, help="tokens/s of each synthetic worker")
    ap.add_argument("--seqs", type=int, default=1024, help="slots per worker; that many streams each, in flight")
    ap.add_argument("--drivers", type=int, default=0, help="driver processes (default: one per 2 workers, ≥ 1)")
    ap.add_argument("--channels", default="reply", help="reply (the API's way), per-request (before), or both")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--warm-up", type=float, default=5.0, help="seconds before the window")
    ap.add_argument("--window", type=float, default=15.0, help="seconds measured")
    ap.add_argument("--tier", default="redis", choices=["redis", "api", "accept"],
                    help="redis: drivers in place of the API; api: gaggle api + gaggle bench (the whole path); "
                         "accept: async requests accepted per second, no worker")
    ap.add_argument("--connections", type=int, default=64, help="--tier accept: concurrent connections in all")
    ap.add_argument("--seconds", type=float, default=10.0, help="--tier accept: how long")
    ap.add_argument("--tenants", default="1", help="--tier accept: comma-separated tenant counts, one row each")
    ap.add_argument("--api-procs", type=int, default=1, help="--tier api: API processes")
    ap.add_argument("--clients", type=int, default=1, help="--tier api: gaggle bench client processes")
    ap.add_argument("--rounds", type=int, default=4, help="--tier api: requests per slot")
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="a further `gaggle worker` flag, e.g. --worker-arg=--gc-young-threshold=700 (repeatable)")
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    ap.add_argument("--area", help="the BENCHMARKS.md block to replace (default: by tier: redis, scale-api, "
                                   "accept-rate)")
    args = ap.parse_args(argv)
    command = command_line("benchmarks.scale", argv)
    if args.tier == "accept":
        rows = [run_accept(args.api_procs, args.clients, args.connections, args.seconds, int(t))
                for t in args.tenants.split(",")]
        print(rows, file=sys.stderr)
        publish(args.area or "accept-rate", command, accept_table(rows) + "\n" + ACCEPT_NOTES, args.out,
                title="Async requests accepted per second")
        return 0
    if args.tier == "api":
        rows = []
        for n in map(int, args.workers.split(",")):
            rows.append(run_api_tier(n, args.rate, args.seqs, args.api_procs, args.clients, args.output_len,
                                     args.rounds, args.worker_arg))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, file=sys.stderr)
        publish(args.area or "scale-api", command, api_table(rows) + "\n" + API_NOTES, args.out,
                title="The served path under N synthetic workers")
        return 0
    modes = {"reply": [True], "per-request": [False], "both": [False, True]}[args.channels]
    rows = []
    for n in map(int, args.workers.split(",")):
        for shared in modes:
            drivers = args.drivers or max(1, n // 2)
            rows.append(run(n, args.rate, args.seqs, drivers, args.output_len, args.warm_up, args.window, shared,
                            args.worker_arg))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, file=sys.stderr)
    body = table(rows) + "\n" + NOTES
    publish(args.area or "redis", command, body, args.out, title="One Redis under N synthetic workers")
    return 0


NOTES = (
    "Each worker runs the real engine loop and worker I/O over a synthetic runner (tokens at the given rate); "
    "drivers stand in for API processes on Redis (subscribe first, then enqueue; one pub/sub connection each; "
    "closed loop at one request per slot). *Redis µs / token* is redis-server's CPU over the window per "
    "delivered token; *capacity* is one core divided by it. *commands / token* counts every command Redis ran "
    "(workers' reads, PUBLISHes, results, acks, heartbeats; drivers' SUBSCRIBE, XADD, UNSUBSCRIBE) per produced "
    "token. Where workers and drivers need more cores than the machine has, produced falls short of "
    "workers × rate: read the Redis columns, not the throughput. *GC ms / s*: a worker's time in garbage "
    "collections (any thread) a second of the window.\n")

API_NOTES = (
    "`gaggle api` (its processes and their uvicorn children, CPU from /proc) in front of the synthetic workers, "
    "loaded by `gaggle bench` with 16-token prompts, ignore_eos, one stream per slot until every slot ran "
    "`--rounds` requests. *API µs / token*: the API processes' CPU per delivered token; *client CPU*: what the "
    "bench reports for its own processes (near 1.0 per process: it is the bottleneck).\n")

ACCEPT_NOTES = (
    "`POST /v1/requests` (a 20-token completion prompt, max_tokens 8) from keep-alive connections in a closed loop, "
    "no worker running: each accepted request is tokenized, admitted (queue depth), and queued in one MULTI "
    "(tenant, record, stream entry). *API µs / request*: the API processes' CPU (from /proc) per 202.\n")


if __name__ == "__main__":
    sys.exit(main())

"""``gaggle bench``: the arrival schedule and the metrics on hand-made numbers, the hand-written HTTP/SSE client
against a scripted server, and the command end to end against `gaggle api` + a worker (and ``--engine-only``).

The worker and the engine-only run get one torch thread: on a small shared machine OpenMP threads that spin
against other processes make a tiny model's step take seconds.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.queue_helpers import ONE_THREAD, REPO, log_of, start_worker
from tests.test_api_support import ApiServer, flushed, wait_heartbeat
from benchmarks.loadgen import metrics as m
from benchmarks.loadgen.client import _has_choices, send_one
from benchmarks.loadgen.dataset import arrival_times, length_range, random_requests
from benchmarks.loadgen.http import Endpoint, Pool

KEY = "sk-bench-0123456789"
WORKER = "loadgen-test-worker"
WORKLOAD = ["--num-prompts", "8", "--input-len", "16", "--output-len", "8", "--ignore-eos"]


# -- the arrival schedule ---------------------------------------------------------------------

def _gaps(times: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    times = arrival_times(4000, request_rate=50.0, burstiness=1.0, seed=7)
    assert times == sorted(times) and times[-1] == pytest.approx(4000 / 50.0)  # vLLM rescales the total
    first_half = times[1999]
    assert 2000 / first_half == pytest.approx(50.0, rel=0.1)  # the rate holds along the way, not only at the end
    gaps = _gaps(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)  # exponential: coefficient of variation 1
    assert arrival_times(4000, 50.0, 1.0, seed=7) == times
    assert arrival_times(4000, 50.0, 1.0, seed=8) != times


def test_burstiness_changes_the_variance_not_the_rate():
    cv = {}
    for burstiness in (0.25, 1.0, 4.0):
        gaps = _gaps(arrival_times(4000, 20.0, burstiness, seed=1))
        assert gaps.sum() == pytest.approx(200.0)
        cv[burstiness] = gaps.std() / gaps.mean()
    assert cv[0.25] == pytest.approx(2.0, rel=0.15)  # gamma(k): CV = 1/sqrt(k)
    assert cv[4.0] == pytest.approx(0.5, rel=0.15)
    assert np.allclose(_gaps(arrival_times(10, 5.0, math.inf, seed=0)), 0.2)  # infinite burstiness: even
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(5, 1.0, 0.0, seed=0)


def test_random_dataset_lengths():
    assert length_range(100, 0.25) == (75, 125)
    reqs = random_requests(200, input_len=40, output_len=10, range_ratio=0.5, seed=3, as_text=False)
    assert all(20 <= len(r.prompt) <= 60 and 5 <= r.max_tokens <= 15 for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 10
    again = random_requests(200, 40, 10, 0.5, seed=3, as_text=False)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    chat = random_requests(3, 16, 4, 0.0, seed=3, as_text=True)
    assert all(r.is_chat and isinstance(r.prompt[0]["content"], str) for r in chat)


def test_a_shared_prefix_starts_every_prompt_and_leaves_their_own_tokens_as_they_were():
    plain = random_requests(20, 30, 4, 0.0, seed=5, as_text=False)
    shared = random_requests(20, 30, 4, 0.0, seed=5, as_text=False, shared_prefix_len=50)
    prefix = shared[0].prompt[:50]
    assert all(r.prompt[:50] == prefix and r.prompt_len == 80 for r in shared)
    assert [r.prompt[50:] for r in shared] == [r.prompt for r in plain]  # the same seed's own tokens
    assert len({tuple(r.prompt[50:]) for r in shared}) == 20
    assert random_requests(2, 30, 4, 0.0, seed=6, as_text=False, shared_prefix_len=50)[0].prompt[:50] != prefix
    chat = random_requests(3, 16, 4, 0.0, seed=5, as_text=True, shared_prefix_len=40)
    texts = [r.prompt[0]["content"] for r in chat]
    common = os.path.commonprefix(texts)
    assert len(common) >= 40 and len(set(texts)) == 3  # 40 whole-UTF-8 tokens are at least 40 characters
    with pytest.raises(ValueError, match="shared-prefix-len"):
        random_requests(2, 30, 4, 0.0, seed=5, as_text=False, shared_prefix_len=-1)


# -- metrics on hand-made timings -------------------------------------------------------------

def test_metrics_from_hand_made_timings():
    records = [
        m.RequestRecord(0, True, ttft=0.1, itl=[0.02, 0.03, 0.05], e2e=0.2, output_tokens=4, prompt_tokens=10),
        m.RequestRecord(1, True, ttft=0.3, itl=[0.1], e2e=0.4, output_tokens=2, prompt_tokens=10),
        m.RequestRecord(2, True, ttft=0.05, e2e=0.05, output_tokens=1, prompt_tokens=10),  # no TPOT
        m.RequestRecord(3, False, error="HTTP 500: boom", prompt_tokens=10),
    ]
    got = m.compute_metrics(records, duration_s=2.0)
    assert (got["completed"], got["failed"], got["errors"]) == (3, 1, ["HTTP 500: boom"])
    assert (got["total_input_tokens"], got["total_output_tokens"]) == (30, 7)
    assert got["request_throughput"] == pytest.approx(1.5)
    assert got["output_throughput"] == pytest.approx(3.5)
    assert got["total_token_throughput"] == pytest.approx(18.5)
    assert got["mean_ttft_ms"] == pytest.approx(150.0) and got["median_ttft_ms"] == pytest.approx(100.0)
    # TPOT = (E2E - TTFT) / (tokens - 1): 100/3 and 100 ms
    assert got["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    # ITL pools every gap: [20, 30, 50, 100] ms; numpy's linear percentiles
    assert got["mean_itl_ms"] == pytest.approx(50.0) and got["median_itl_ms"] == pytest.approx(40.0)
    assert got["p90_itl_ms"] == pytest.approx(85.0) and got["p99_itl_ms"] == pytest.approx(98.5)
    assert got["mean_e2el_ms"] == pytest.approx(650 / 3)
    assert all(v is None for k, v in m.compute_metrics(records[3:], 1.0).items() if k.endswith("_ms"))
    table = m.format_table(got, "Serving Benchmark Result", {"request_rate": "inf"}, None)
    assert "Mean TTFT (ms):" in table and "150.00" in table and "error 0: HTTP 500: boom" in table


# -- the HTTP/SSE client against a scripted server ----------------------------------------------

def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
TOKEN = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}], "usage": null}\r\n\r\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n'
ERROR = b'data: {"error":{"message":"worker died","type":"server_error"}}\n\n'


async def _scripted_server(responses: list[bytes]) -> tuple[asyncio.AbstractServer, list[int]]:
    """Answers requests in order with ``responses``, each written in small pieces with pauses, on keep-alive."""
    connections = []

    async def handle(reader, writer):
        connections.append(1)
        while responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            data = responses.pop(0)
            for i in range(0, len(data), 7):  # framing and events split at awkward places
                writer.write(data[i:i + 7])
                await writer.drain()
                await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, connections


def test_client_parses_sse_by_hand_and_keeps_the_connection():
    assert _has_choices(TOKEN[6:]) and not _has_choices(USAGE[6:]) and not _has_choices(b'{"choices" : [ ]}')

    async def scenario():
        ok = SSE_HEAD + _chunked(b": keep-alive\n\n", TOKEN, TOKEN + TOKEN, TOKEN, USAGE, b"data: [DONE]\n\n")
        failed = SSE_HEAD + _chunked(TOKEN, ERROR, b"data: [DONE]\n\n")
        body = b'{"error":{"message":"no"}}'
        refused = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        server, connections = await _scripted_server([ok, failed, refused])
        port = server.sockets[0].getsockname()[1]
        endpoint = Endpoint.parse(f"http://127.0.0.1:{port}/v1/completions")
        pool, head = Pool(endpoint), endpoint.request_head("POST", {})
        records = [m.RequestRecord(i, prompt_tokens=3) for i in range(3)]
        for record in records:
            await send_one(pool, head, b"{}", True, record, time.monotonic(), 10.0)
        pool.close()
        server.close()
        return records, len(connections)

    (good, bad, refused), num_connections = asyncio.run(scenario())
    assert good.is_success and good.error is None
    assert good.output_tokens == 7 and good.prompt_tokens == 5  # from usage, not the 4 token chunks
    assert good.ttft is not None and len(good.itl) <= 3 and good.e2e >= good.ttft
    assert not bad.is_success and "worker died" in bad.error
    assert not refused.is_success and refused.error.startswith("HTTP 400")
    assert num_connections == 1  # three requests on one keep-alive connection


# -- end to end ---------------------------------------------------------------------------------

SERVICE_LOGS: list[str] = []  # the API's and the worker's JSON logs, for the TTFT breakdown


@pytest.fixture(scope="module")
def api_url(redis_server, tiny_model_path, tmp_path_factory):
    r = flushed(redis_server.url)
    keys = tmp_path_factory.mktemp("bench-keys") / "keys.txt"
    keys.write_text(f"{KEY} bench\n")
    worker = start_worker(redis_server.url, str(tiny_model_path), WORKER, "--max-num-seqs", "8",
                          "--max-model-len", "256")
    api = ApiServer(redis_server.url, "--api-keys-file", str(keys), "--model-name", "tiny-bench")
    SERVICE_LOGS[:] = [api.log_path, worker.log_path]
    try:
        api.wait_healthy()
        wait_heartbeat(r, WORKER)
        yield api.url
    finally:
        api.stop()
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            print(log_of(worker))
        r.flushdb()


def bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def _assert_all_metrics(metrics: dict) -> None:
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        assert math.isfinite(metrics[key]) and metrics[key] > 0, key
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "std", "median", "p90", "p99"):
            value = metrics[f"{stat}_{name}_ms"]
            assert value is not None and math.isfinite(value) and value >= 0, (stat, name)


@pytest.fixture(scope="module")
def served(api_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "served.json"
    proc = bench("--base-url", api_url, "--api-key", KEY, *WORKLOAD, "--client-processes", "2",
                 "--save-result", str(out), "--save-detailed")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc, out, orjson.loads(out.read_bytes())


def test_served_run_measures_every_request(served):
    proc, _, result = served
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (8, 0)
    assert metrics["total_output_tokens"] == 8 * 8  # ignore_eos: every request runs to --output-len
    assert metrics["total_input_tokens"] == 8 * 16
    _assert_all_metrics(metrics)
    assert result["config"]["model"] == "tiny-bench"  # the first id of /v1/models
    assert 0 <= metrics["slot_occupancy"] <= 1 and "Slot occupancy (running / slots):" in proc.stdout
    per_process = result["client"]["per_process"]
    assert len(per_process) == 2 and result["client"]["cpu_s"] > 0
    assert 2 <= sum(p["connections"] for p in per_process) <= 8
    details = result["details"]
    for ttft, itl, e2e in zip(details["ttft"], details["itl"], details["e2el"]):
        assert len(itl) <= 7 and sum(itl) == pytest.approx(e2e - ttft)  # a chunk may carry several tokens


def test_ttft_breakdown_joins_the_client_and_the_server_logs(served, tmp_path):
    """Every request of the run is found in the API's and the worker's logs, and its five parts follow one
    another in time (each ≥ 0 but for the API's millisecond stamps; a request joined with another's log lines,
    or a worker time taken from the wrong origin, breaks the order)."""
    from benchmarks.loadgen.breakdown import intake_split, main, read_logs, split, worker_split
    _, path, result = served
    details = result["details"]
    assert all(rid and rid.startswith("cmpl-") for rid in details["request_id"])
    rows = split(details, *read_logs([Path(p) for p in SERVICE_LOGS]))
    assert len(rows) == 8
    for parts in rows:
        assert all(p > -0.002 for p in parts), parts
        assert parts[2] > 0  # the engine took some time to prefill and step
    worker, _ = read_logs([Path(p) for p in SERVICE_LOGS])
    inner = worker_split(details, worker)
    assert len(inner) == 8
    for rid, (to_engine, to_launch, to_first) in inner.items():
        # in time order (the logs' millisecond stamps aside), and the three make up the worker's part
        assert min(to_engine, to_launch, to_first) > -0.002, (to_engine, to_launch, to_first)
        w = worker[rid]
        assert to_engine + to_launch + to_first == pytest.approx(w["ttft_s"] - w["queued_s"], abs=1e-6)
    # in Redis, then with the reader, then taken by the loop: the three make up the second part
    intake = intake_split(details, worker)
    assert len(intake) == 8
    for (to_redis, to_reader, to_loop), parts in zip(intake, rows):
        # the entry id's time is whole milliseconds, from Redis's clock (this host's)
        assert to_redis > -0.002 and to_reader > -0.002 and to_loop >= 0, (to_redis, to_reader, to_loop)
        assert to_redis + to_reader + to_loop == pytest.approx(parts[1], abs=1e-5)
    assert main([str(path), *SERVICE_LOGS, "--out", str(tmp_path / "b.md")]) == 0
    text = (tmp_path / "b.md").read_text()
    assert "→ first token on the worker" in text and "→ last prompt chunk launched" in text
    assert "the worker's reader had it" in text
    assert "Slot refill: steps from a slot freeing to its next request's admission" in text


def test_chat_with_a_rate_and_a_concurrency_limit(api_url):
    proc = bench("--base-url", api_url, "--api-key", KEY, *WORKLOAD, "--endpoint", "/v1/chat/completions",
                 "--request-rate", "40", "--max-concurrency", "3", "--client-processes", "2")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "Maximum request concurrency:             3" in proc.stdout
    assert "Successful requests:                     8" in proc.stdout
    assert "Total generated tokens:                  64" in proc.stdout


@pytest.mark.parametrize("case", ["bad key", "over the length limit"])
def test_failures_are_counted_with_their_message(api_url, tmp_path, case):
    out = tmp_path / "failed.json"
    if case == "bad key":
        args = ["--api-key", "sk-wrong", "--model", "tiny-bench", *WORKLOAD]
        expected = "HTTP 401"
    else:
        args = ["--api-key", KEY, "--num-prompts", "4", "--input-len", "16", "--output-len", "1000"]
        expected = "HTTP 400"
    proc = bench("--base-url", api_url, *args, "--save-result", str(out))
    assert proc.returncode == 1, proc.stderr + proc.stdout  # nothing succeeded: a benchmark that measured nothing
    metrics = orjson.loads(out.read_bytes())["metrics"]
    num_prompts = int(args[args.index("--num-prompts") + 1])
    assert (metrics["completed"], metrics["failed"]) == (0, num_prompts)
    assert metrics["errors"] and all(expected in e for e in metrics["errors"])
    assert expected in proc.stdout


def test_engine_only_runs_the_same_workload(served, tiny_model_path, tmp_path):
    _, served_path, served_result = served
    out = tmp_path / "engine.json"
    proc = bench("--engine-only", "--model", str(tiny_model_path), "--device", "cpu", *WORKLOAD,
                 "--save-result", str(out), "--compare", str(served_path), env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "Engine-only Benchmark Result" in proc.stdout and "Served / engine-only" in proc.stdout
    result = orjson.loads(out.read_bytes())
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (8, 0)
    assert metrics["total_output_tokens"] == served_result["metrics"]["total_output_tokens"] == 64
    assert metrics["total_input_tokens"] == served_result["metrics"]["total_input_tokens"]
    _assert_all_metrics(metrics)
    assert 0 < metrics["slot_occupancy"] <= 1  # 8 requests on 8 slots: every step runs some
    ratios = result["compare"]["served_over_engine_only"]
    assert ratios["output_throughput"] == pytest.approx(
        served_result["metrics"]["output_throughput"] / metrics["output_throughput"])


def test_engine_only_with_a_synthetic_engine(tmp_path):
    """``--engine synthetic:RATE``: the engine-only side of a served run against ``gaggle worker --engine
    synthetic:RATE`` (both without a model); every token counted, the engine kind saved; a bad spec is refused."""
    out = tmp_path / "synthetic.json"
    proc = bench("--engine-only", "--engine", "synthetic:4000", "--max-num-seqs", "8", *WORKLOAD,
                 "--save-result", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = orjson.loads(out.read_bytes())
    assert (result["metrics"]["completed"], result["metrics"]["total_output_tokens"]) == (8, 64)
    assert result["config"]["engine"]["engine"] == "synthetic:4000"
    _assert_all_metrics(result["metrics"])
    bad = bench("--engine-only", "--engine", "synthetic:fast", *WORKLOAD)
    assert bad.returncode != 0 and "synthetic" in bad.stderr


# -- the Batch API benchmark (python -m benchmarks.loadgen.batch_bench) ------------------------------

BATCH_BENCH_TITLE = "Batch API benchmark"


@pytest.fixture(scope="module")
def batch_api(api_url, redis_server):
    """The module's service with a ``gaggle batch-worker`` on the same Redis and the same file store: the API runs in
    the repository with no GAGGLE_* set, so its store is the default .gaggle/files there (the benchmark deletes
    what it uploads and the outputs)."""
    import tempfile

    from tests.queue_helpers import kill_group
    log = tempfile.NamedTemporaryFile(prefix="gaggle-bench-batch-worker-", suffix=".log", delete=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GAGGLE_")}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "--log-level", "INFO", "batch-worker",
                             "--redis-url", redis_server.url, "--files-dir", os.path.join(REPO, ".gaggle", "files"),
                             "--model-name", "tiny-bench"],  # the API's: lines name the served model
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    proc.log_path = log.name
    try:
        yield api_url
    finally:
        if proc.poll() is None:
            kill_group(proc)


def batch_bench(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.loadgen.batch_bench", "--base-url", url, "--api-key", KEY,
                           "--poll-s", "0.2", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_batch_bench_checks_every_line_while_a_trickle_streams(batch_api, tmp_path):
    out = tmp_path / "batch.json"
    proc = batch_bench(batch_api, "--num-lines", "12", "--input-len", "8", "--output-len", "6", "--trickle-rate", "4",
                       "--trickle-output-len", "3", "--save-result", str(out), "--out", "-")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "Command: `python -m benchmarks.loadgen.batch_bench" in proc.stdout
    assert "| Batch / engine-only (target ≤ 1.1) | – |" in proc.stdout
    result = orjson.loads(out.read_bytes())
    assert result["status"] == "completed" and result["config"]["model"] == "tiny-bench"
    assert (result["lines"], result["succeeded"], result["failed"]) == (12, 12, 0)
    assert (result["missing"], result["duplicated"], result["unexpected"]) == (0, 0, 0)
    assert result["output_tokens"] == 12 * 6  # ignore_eos: every line runs to --output-len
    assert result["batch_wall_s"] > 0 and result["output_throughput"] == pytest.approx(72 / result["batch_wall_s"])
    assert result["server_s"] is not None and result["server_s"] <= result["batch_wall_s"] + 1  # whole seconds
    assert result["engine_only_s"] is None and result["ratio"] is None
    trickle = result["trickle"]
    assert trickle["requests"] > 0 and trickle["failed"] == 0, trickle
    assert isinstance(trickle["ttft_p50_ms"], float) and 0 < trickle["ttft_p50_ms"] <= trickle["ttft_p99_ms"]
    assert "api_key" not in result["config"]


def test_batch_bench_ratio_to_the_engine_only_run(batch_api, tmp_path):
    engine = tmp_path / "engine.json"  # the shape `gaggle bench --engine-only --save-result` writes
    engine.write_bytes(orjson.dumps({"mode": "engine-only", "metrics": {"duration_s": 2.0, "completed": 4},
                                     "config": {"num_prompts": 9, "input_len": 8, "output_len": 6, "seed": 0,
                                                "ignore_eos": True}}))
    out, report = tmp_path / "batch.json", tmp_path / "BENCHMARKS.md"
    proc = batch_bench(batch_api, "--num-lines", "4", "--input-len", "8", "--output-len", "6", "--trickle-rate", "0",
                       "--engine-only-result", str(engine), "--save-result", str(out), "--out", str(report))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "ran another workload (num_prompts differ)" in proc.stderr
    result = orjson.loads(out.read_bytes())
    assert result["succeeded"] == 4 and result["engine_only_s"] == 2.0
    assert result["ratio"] == pytest.approx(result["batch_wall_s"] / 2.0)
    assert result["trickle"] == {"requests": 0, "failed": 0, "ttft_p50_ms": None, "ttft_p99_ms": None, "errors": [],
                                 "timeline": []}
    published = report.read_text()
    assert published.startswith(f"## {BATCH_BENCH_TITLE}\n\n<!-- bench:batch -->\n### ")  # the table, then its command
    assert re.search(r"\nCommand: `python -m benchmarks.loadgen.batch_bench --base-url [^\n]*\n<!-- /bench:batch -->\n$",
                     published)
    assert "--api-key …" in published and KEY not in published  # the file is committed
    assert f"| Batch / engine-only (target ≤ 1.1) | {result['ratio']:.3f} |" in published


def test_batch_bench_counts_the_prompt_tokens_a_shared_instruction_saves(batch_api, tmp_path):
    """Lines that share a 64-token instruction: the server reports most of it as cached; the table says computed
    against unique tokens and, given the cache-off run's result, cache off / on."""
    cache_off = tmp_path / "cache-off.json"  # the shape this program's --save-result writes
    cache_off.write_bytes(orjson.dumps({"batch_wall_s": 50.0, "config": {
        "num_lines": 6, "input_len": 8, "shared_prefix_len": 64, "output_len": 4, "seed": 0,
        "endpoint": "/v1/completions", "temperature": 1.0}}))
    out = tmp_path / "batch.json"
    proc = batch_bench(batch_api, "--num-lines", "6", "--input-len", "8", "--shared-prefix-len", "64",
                       "--output-len", "4", "--trickle-rate", "0", "--cache-off-result", str(cache_off),
                       "--save-result", str(out), "--out", "-")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "cache off / on compares unlike" not in proc.stderr
    result = orjson.loads(out.read_bytes())
    assert result["succeeded"] == 6 and result["prompt_tokens"] == 6 * 72
    assert result["unique_prompt_tokens"] == 64 + 6 * 8
    # the first line (or the first few, taken at once) computes the instruction; later ones take it from the cache
    assert 32 <= result["cached_prompt_tokens"] <= 5 * 64, result["cached_prompt_tokens"]
    computed = result["prompt_tokens"] - result["cached_prompt_tokens"]
    assert result["computed_over_unique"] == pytest.approx(computed / (64 + 48))
    assert result["cache_speedup"] == pytest.approx(50.0 / result["batch_wall_s"])
    assert "6 lines × 64 shared + 8 prompt / 4 output tokens" in proc.stdout
    assert f"| Cache off / on | {result['cache_speedup']:.2f} |" in proc.stdout


def test_waves_of_a_closed_loop_are_taken_in_the_order_sent():
    """Requests are grouped by when they were sent, not by their place in the result: a slow first wave and
    quick replacements show as two rows with their own numbers."""
    from benchmarks.loadgen.breakdown import waves_table
    starts = [0.5, 0.0, 0.6, 0.1, 0.7, 0.2]  # wave 1 = the three sent first, interleaved in the lists
    ttfts = [0.01, 1.0, 0.02, 2.0, 0.03, 3.0]
    text = waves_table({"start": starts, "ttft": ttfts}, 3)
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["1", "3", "2000.0", "3000.0", "3000.0", "2000.0"], ["2", "3", "20.0", "30.0", "30.0", "20.0"]]


def test_occupancy_reads_the_gauges_of_a_prometheus_page():
    from benchmarks.loadgen.occupancy import FREE, RUNNING, StepOccupancy, gauges
    page = (f"# HELP {RUNNING} x\n# TYPE {RUNNING} gauge\n{RUNNING} 750.0\n{FREE} 250.0\n"
            f'gaggle_queue_depth{{priority="interactive",tenant="*"}} 3.0\n')
    assert gauges(page) == {RUNNING: 750.0, FREE: 250.0}
    steps = StepOccupancy()
    steps.observe(4, 8, 1.0)  # half full for a second, full for three
    steps.observe(8, 8, 3.0)
    assert steps.mean == pytest.approx(0.875)

"""The synthetic engine (no model, tokens at a fixed rate) runs the real scheduler, loop and worker I/O: it keeps
its rate, and two synthetic workers on one real Redis serve every request exactly once."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.sequence import Request
from engine.synthetic import parse_engine_spec, synthetic_engine
from tests.queue_helpers import (
    log_of,
    pending_count,
    start_worker,
    submit,
    wait_results,
)
from tests.test_api_support import wait_heartbeat


def test_engine_spec():
    assert parse_engine_spec("real") is None and parse_engine_spec("synthetic:80000") == (80000.0, None)
    assert parse_engine_spec("synthetic:10000:160000") == (10000.0, 160000.0)
    for bad in ("synthetic", "synthetic:0", "gpu:3", "synthetic:fast", "synthetic:1:0", "synthetic:1:2:3"):
        with pytest.raises(ValueError, match="synthetic"):
            parse_engine_spec(bad)


def test_synthetic_engine_keeps_its_rate_and_the_engine_semantics():
    engine = synthetic_engine(EngineConfig(model="synthetic", device="cpu", max_num_seqs=32), tokens_per_s=4000)
    for i in range(20):
        engine.add(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True, seed=i)))
    engine.add(Request("stop", [1, 2], SamplingParams(max_tokens=100, stop=["river"], seed=0)))
    t0, tokens, texts, finish = time.perf_counter(), 0, {}, {}
    while engine.has_work():
        for out in engine.step():
            tokens += len(out.token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                finish[out.request_id] = out.finish_reason
    wall = time.perf_counter() - t0
    assert tokens >= 2000 and finish["r0"] == "length"
    assert 2000 / 4000 <= wall < 3 * (tokens / 4000 + 0.2)  # never faster than its rate; not much slower here
    assert finish["stop"] == "stop" and "river" not in texts["stop"]  # a real engine's stop handling
    assert "goose" in texts["r3"]


def test_two_synthetic_workers_serve_every_request_once(redis_url):
    """Both workers are up (heartbeats) before the 200 requests arrive: each takes a share, none runs twice."""
    r = redis.Redis.from_url(redis_url)
    workers = [start_worker(redis_url, "unused", f"syn{k}", "--engine", "synthetic:1000", "--max-num-seqs", "64")
               for k in range(2)]
    for k, w in enumerate(workers):
        wait_heartbeat(r, f"syn{k}")
    rids = [f"syn-{i}" for i in range(200)]
    for i, rid in enumerate(rids):
        submit(r, rid, [1, 2, 3], max_tokens=16 + i % 5, ignore_eos=True)
    results = wait_results(r, rids, 60)
    for w in workers:
        w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=60) == 0, log_of(w)
    assert all(res.completion_tokens == 16 + i % 5 and res.status == "completed"
               for i, res in enumerate(results[rid] for rid in rids))
    assert {res.worker for res in results.values()} == {"syn0", "syn1"}
    assert pending_count(r) == 0


@pytest.mark.slow
def test_scale_bench_counts_every_token_and_reply_channels_cut_redis_commands():
    """benchmarks.scale with 2 synthetic workers on one Redis: what the drivers receive is what the workers
    produced, and reply channels need a fraction of a per-request channel's commands per token (one PUBLISH per
    write for all requests instead of one per request per step). The workers run with CPython's default young
    threshold (a flag passed through): their collections show in the GC column, read from their /metrics."""
    from benchmarks.scale import run
    rows = {shared: run(2, rate=4000, seqs=32, drivers=1, output_len=32, warm_s=2.0, measure_s=3.0, shared=shared,
                        worker_args=["--gc-young-threshold=700"])
            for shared in (False, True)}
    for row in rows.values():
        assert row["produced_tok_s"] > 2000, row  # both workers busy
        assert 0.9 < row["delivered_ratio"] < 1.1, row
        assert row["worker_gc_ms_per_s"] > 0, row
    assert rows[False]["commands_per_token"] > 0.8, rows[False]  # ~1 PUBLISH a token
    assert rows[True]["commands_per_token"] < 0.5 * rows[False]["commands_per_token"], rows[True]
    assert rows[True]["tokens_per_publish"] > 5 * rows[False]["tokens_per_publish"]

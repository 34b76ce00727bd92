"""Results that finish while a restarted Redis loads its data: the worker's writes are refused with LOADING, and
retried until Redis serves; every result arrives, equal to a same-seed run, and nothing stays pending."""

from __future__ import annotations

import time

import pytest
import redis

from tests.conftest import same_seed_tokens
from tests.queue_helpers import pending_count, start_worker, submit, wait_results, wait_running
from tests.test_engine import tokens
from worker.redis_server import RedisServer

pytestmark = pytest.mark.slow
# ~8 s of loading (microseconds a key: a Redis test setting); a loading Redis answers clients (LOADING) every 2 MB
# it loaded, so the keys are large: a reply every ~2 s
SLOW_LOAD = ("--key-load-delay", "4000")


def test_results_finished_while_redis_loads_are_all_delivered(tmp_path, tiny_model_path, tiny_weights):
    server = RedisServer(tmp_path / "redis", extra_args=SLOW_LOAD).start()
    r = redis.Redis.from_url(server.url)
    pipe = r.pipeline(transaction=False)
    for i in range(2_000):  # 8 MB, ~8 s of loading after a restart: the worker writes while it loads
        pipe.set(f"ballast:{i}", "x" * 4096)
    pipe.execute()
    r.bgrewriteaof()
    while r.info("persistence")["aof_rewrite_in_progress"]:
        time.sleep(0.05)
    worker = start_worker(server.url, str(tiny_model_path), "loading-w", "--max-num-seqs", "16")
    rids = [f"l{i}" for i in range(12)]
    prompts = [tokens(12, seed=700 + i) for i in range(12)]
    for rid, prompt, seed in zip(rids, prompts, range(12)):
        submit(r, rid, prompt, max_tokens=100, temperature=1.0, seed=seed, ignore_eos=True)
    assert wait_running(r, rids)
    server.stop()
    deadline = time.monotonic() + 120  # every request finishes while Redis is down: its writes wait
    while open(worker.log_path).read().count('"sequence finished"') < len(rids) and time.monotonic() < deadline:
        time.sleep(0.1)
    server = RedisServer(tmp_path / "redis", port=server.port, extra_args=SLOW_LOAD)
    server.start(timeout_s=60)  # returns once loaded: the writes came while it loaded
    r = redis.Redis.from_url(server.url)
    try:
        got = wait_results(r, rids, timeout_s=120)
        expected = same_seed_tokens(tiny_weights, dict(zip(rids, prompts)), 100)
        for rid in rids:
            assert got[rid].choices[0].token_ids == expected[rid], rid
        deadline = time.monotonic() + 20
        while pending_count(r) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pending_count(r) == 0
    finally:
        worker.kill()
        server.stop()


def test_results_finished_while_redis_is_busy_are_all_delivered(tmp_path, tiny_model_path, tiny_weights):
    """A script holding Redis past lua-time-limit: every other command gets BUSY, as during a load every command
    gets LOADING. Requests that finish meanwhile are written once it is over."""
    import threading
    server = RedisServer(tmp_path / "redis", extra_args=("--lua-time-limit", "50")).start()
    r = redis.Redis.from_url(server.url)
    worker = start_worker(server.url, str(tiny_model_path), "busy-w", "--max-num-seqs", "16")
    rids = [f"b{i}" for i in range(8)]
    prompts = [tokens(12, seed=800 + i) for i in range(8)]
    try:
        for rid, prompt, seed in zip(rids, prompts, range(8)):
            submit(r, rid, prompt, max_tokens=100, temperature=1.0, seed=seed, ignore_eos=True)
        assert wait_running(r, rids)
        busy = threading.Thread(target=lambda: _quietly(redis.Redis.from_url(server.url).eval,
                                                        "while true do end", 0), daemon=True)
        busy.start()
        deadline = time.monotonic() + 60  # every request finishes while Redis answers BUSY
        while open(worker.log_path).read().count('"sequence finished"') < len(rids) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        redis.Redis.from_url(server.url).script_kill()
        _until_not_busy(r)  # the script stops at its next check, a moment after SCRIPT KILL answers
        got = wait_results(r, rids, timeout_s=60)
        expected = same_seed_tokens(tiny_weights, dict(zip(rids, prompts)), 100)
        assert all(got[rid].choices[0].token_ids == expected[rid] for rid in rids)
        assert "redis is not ready; retrying the write" in open(worker.log_path).read()
    finally:
        worker.kill()
        server.stop()


def _until_not_busy(r: redis.Redis, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r.ping()
            return
        except redis.ResponseError:  # BUSY
            assert time.monotonic() < deadline, "redis stayed busy after SCRIPT KILL"
            time.sleep(0.05)


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except redis.RedisError:  # SCRIPT KILL ends it with an error reply
        pass

"""A worker paused past its heartbeat's TTL: its requests are taken over by another worker, and when it resumes it
drops them and writes nothing for them (its finals are fenced by entry ownership). Each request is generated to
the end once, with a same-seed run's tokens. Real Redis and worker processes."""

from __future__ import annotations

import signal
import time

import orjson
import pytest

from tests.conftest import same_seed_tokens
from tests.queue_helpers import pending_count, start_worker, submit, wait_results, wait_running
from tests.test_api_support import wait_heartbeat
from tests.test_engine import tokens
from worker import contract as c

pytestmark = pytest.mark.slow


def finished_sequences(log_path: str) -> list[str]:
    """Request ids of the sequences the worker's engine generated to their end."""
    return [orjson.loads(line)["request_id"] for line in open(log_path)
            if '"sequence finished"' in line and line.startswith("{")]


def test_a_paused_worker_resumes_without_generating_what_was_taken_over(redis_url, r, tiny_model_path,
                                                                        tiny_weights):
    a = start_worker(redis_url, str(tiny_model_path), "paused-a", "--max-num-seqs", "8")
    wait_heartbeat(r, "paused-a")
    rids = [f"p{i}" for i in range(6)]
    prompts = [tokens(10, seed=900 + i) for i in range(6)]
    for rid, prompt, seed in zip(rids, prompts, range(6)):
        submit(r, rid, prompt, max_tokens=1200, temperature=1.0, seed=seed, ignore_eos=True)
    assert wait_running(r, rids)
    b = start_worker(redis_url, str(tiny_model_path), "paused-b", "--max-num-seqs", "8")
    wait_heartbeat(r, "paused-b")
    a.send_signal(signal.SIGSTOP)
    time.sleep(c.HEARTBEAT_TTL_S + 3.0)  # A's heartbeat expires; B takes its entries
    a.send_signal(signal.SIGCONT)
    try:
        got = wait_results(r, rids, timeout_s=180)
        expected = same_seed_tokens(tiny_weights, dict(zip(rids, prompts)), 1200)
        for rid in rids:
            assert got[rid].choices[0].token_ids == expected[rid], rid
            assert got[rid].worker == "paused-b", rid
        time.sleep(1.0)
        done = finished_sequences(a.log_path) + finished_sequences(b.log_path)
        assert sorted(done) == sorted(rids), done  # each generated to the end once
        assert "heartbeat had lapsed" in open(a.log_path).read()
        assert pending_count(r) == 0
    finally:
        a.kill()
        b.kill()

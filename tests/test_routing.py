"""Prefix-aware routing: a prompt that extends a prefix one worker holds runs on that worker (the API marks the
entry, whichever worker reads it hands it over), a handed-over entry its worker cannot take goes back to the stream,
and a killed holder loses nothing. Real Redis, API and worker processes (tiny model, shared tier off: a prompt
that runs elsewhere is prefilled from token 0, so cached_tokens says where it ran)."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import make_engine
from tests.queue_helpers import pending_count, start_worker, submit, wait_results
from tests.test_api_support import ApiServer, flushed, wait_heartbeat
from engine.params import SamplingParams
from engine.sequence import Request
from tests.test_engine import generated, run_all, tokens
from worker import contract as c
from worker.prefix_digests import block_digest

pytestmark = pytest.mark.slow
NO_SHARED_TIER = ("--shared-prefix-gib", "0")


def complete(api: ApiServer, prompt: list[int], **kw) -> dict:
    reply = httpx.post(api.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw})
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_held(r, prefix: list[int], timeout_s: float = 20.0) -> str:
    """The worker that advertises ``prefix`` (its state), once it does."""
    key = c.held_key(block_digest(prefix))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        holder = r.get(key)
        if holder:
            return holder.decode()
        time.sleep(0.05)
    raise AssertionError("no worker advertised the prefix")


def test_prompts_on_a_held_prefix_run_on_its_worker(redis_server, tiny_model_path):
    r = flushed(redis_server.url)
    a = start_worker(redis_server.url, str(tiny_model_path), "route-a", *NO_SHARED_TIER)
    api = ApiServer(redis_server.url).wait_healthy()
    try:
        wait_heartbeat(r, "route-a")
        firsts = [tokens(300, seed=200 + i) for i in range(4)]
        for prompt in firsts:  # only A runs: it holds every first turn
            complete(api, prompt)
            assert wait_held(r, prompt) == "route-a"
        start_worker(redis_server.url, str(tiny_model_path), "route-b", *NO_SHARED_TIER)
        wait_heartbeat(r, "route-b")
        time.sleep(1.2)  # the API's view of the live workers (cached for a second) has both
        seconds = [p + tokens(40, seed=300 + i) for i, p in enumerate(firsts)]
        others = [tokens(300, seed=400 + i) for i in range(8)]  # nobody holds these: either worker runs them
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda p: complete(api, p), seconds + others))
        ran_on = [r.hget(c.request_key(reply["id"]), "worker").decode() for reply in replies]
        assert ran_on[:4] == ["route-a"] * 4, ran_on
        assert [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in replies[:4]] == [300] * 4
        assert "route-b" in ran_on[4:], ran_on  # the others spread: B was there to take them
    finally:
        api.stop()
        a.kill()


def test_an_entry_handed_to_a_full_worker_goes_back_to_the_stream(redis_url, r, tiny_model_path):
    """Handed to a worker with no free slot (one slot, busy with a long request), an entry is put back in its
    stream after the wait, and another worker runs it."""
    a = start_worker(redis_url, str(tiny_model_path), "full-a", *NO_SHARED_TIER, "--max-num-seqs", "1")
    b = start_worker(redis_url, str(tiny_model_path), "full-b", *NO_SHARED_TIER, "--max-num-seqs", "1")
    wait_heartbeat(r, "full-a")
    wait_heartbeat(r, "full-b")
    submit(r, "long", tokens(20, seed=1), max_tokens=3000, ignore_eos=True)
    deadline = time.monotonic() + 30
    while not r.hget(c.request_key("long"), "worker") and time.monotonic() < deadline:
        time.sleep(0.05)
    busy = r.hget(c.request_key("long"), "worker").decode()
    req = c.QueuedRequest(id="routed", prompt_token_ids=tokens(30, seed=2), params={"max_tokens": 4})
    pipe = r.pipeline()
    req.enqueue(pipe, prefer=busy)
    pipe.execute()
    got = wait_results(r, ["routed"], timeout_s=60)["routed"]
    assert got.status == c.STATUS_COMPLETED
    assert r.hget(c.request_key("routed"), "worker").decode() != busy
    r.publish(c.CHANNEL_ABORTS, "long")
    a.kill()
    b.kill()


def test_a_killed_holder_loses_no_request(redis_server, tiny_model_path, tiny_weights):
    """Twelve prompts on A's prefix, A SIGKILLed while they run: each one completes once, with a cold engine's
    tokens, and nothing stays pending."""
    r = flushed(redis_server.url)
    a = start_worker(redis_server.url, str(tiny_model_path), "kill-a", *NO_SHARED_TIER, "--max-num-seqs", "4")
    b = start_worker(redis_server.url, str(tiny_model_path), "kill-b", *NO_SHARED_TIER, "--max-num-seqs", "4")
    api = ApiServer(redis_server.url).wait_healthy()
    try:
        wait_heartbeat(r, "kill-a")
        wait_heartbeat(r, "kill-b")
        prefix = tokens(300, seed=7)
        first = complete(api, prefix)
        holder = wait_held(r, prefix)
        victim = a if holder == "kill-a" else b
        time.sleep(1.2)
        prompts = [prefix + tokens(20, seed=500 + i) for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(complete, api, p, max_tokens=24, ignore_eos=True) for p in prompts]
            time.sleep(0.5)  # some handed over and running on the holder
            victim.send_signal(signal.SIGKILL)
            replies = [f.result(timeout=120) for f in futures]
        assert first["choices"]
        cold = make_engine(tiny_weights, prefix_cache_gib=0)
        for i, (prompt, reply) in enumerate(zip(prompts, replies)):
            cold.add(Request(f"c{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
            expected = generated(run_all(cold), f"c{i}")
            assert reply["usage"]["completion_tokens"] == 24
            assert reply["choices"][0]["text"] == cold.tokenizer.decode(expected), i
        assert pending_count(r) == 0
    finally:
        api.stop()
        a.kill()
        b.kill()

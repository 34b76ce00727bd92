"""The prefix cache's shared tier (Redis): a state one engine made, fetched by another engine that never saw the
prefix, gives the tokens and logprobs of a cold run; a state of another model, or one evicted, is never served;
the byte cap holds. Then the same through two real worker processes."""

from __future__ import annotations

import hashlib
import time
from array import array

import pytest

from engine.demo import write_demo_model
from engine.weights import load_model
from tests.conftest import make_engine
from tests.queue_helpers import start_worker, submit, wait_results
from tests.test_engine import tokens
from tests.test_prefix_cache import PARAMS, run_one
from worker import contract as c
from worker.prefix_digests import PrefixDigests
from worker.shared_states import SharedStates, SharedStatesConfig


def test_prefix_digests_are_the_digests_of_the_prefixes():
    toks = tokens(300, seed=9)
    d = PrefixDigests(toks)
    for n in (0, 1, 63, 64, 65, 128, 200, 300):
        assert d.at(n) == hashlib.sha256(array("I", toks[:n]).tobytes()).hexdigest()[:32], n
    assert d.block(2) == d.at(2 * c.STATE_BLOCK)


ATTACHED: list[SharedStates] = []


@pytest.fixture(autouse=True)
def _close_shared_states():
    """Each test's shared tiers closed after it (a live writer thread would keep its engine, and the engine's
    checkpoint slab, alive for the rest of the session)."""
    yield
    while ATTACHED:
        ATTACHED.pop().close()


def attach(engine, redis_url: str, cap: int = 1 << 30, rate: float = 0.0, min_tokens: int = 32) -> SharedStates:
    """The shared tier wired to an engine as a worker wires it; ``rate``: the prefill rate it assumes (0: unknown,
    so a state found is fetched)."""
    shared = SharedStates.for_engine(engine, SharedStatesConfig(redis_url, cap, ttl_s=600, min_tokens=min_tokens))
    shared.prefill_tokens_per_s = lambda: rate
    ATTACHED.append(shared)
    return shared


def fetch_then_run(engine, shared: SharedStates, rid: str, prompt: list[int], **params):
    """A worker's path for one request: look the prompt up, take a fetched state, run; the run and the prompt
    tokens the shared tier gave (0: none)."""
    future = shared.lookup_request(prompt, None)
    taken = shared.take(prompt, None, future.result(timeout=10) if future is not None else None)
    return run_one(engine, rid, prompt, **params), taken


@pytest.mark.parametrize("kind", PARAMS)
def test_a_state_made_by_one_engine_starts_another_and_gives_a_cold_runs_output(tiny_weights, redis_url, kind):
    instruction = tokens(100, seed=1)
    a, b = make_engine(tiny_weights, prefix_min_tokens=16), make_engine(tiny_weights, prefix_min_tokens=16)
    cold = make_engine(tiny_weights, prefix_cache_gib=0)
    shared_a, shared_b = attach(a, redis_url), attach(b, redis_url)
    for i in range(2):  # the second prompt diverges from the first after the instruction: a checkpoint, shared
        run_one(a, f"a{i}", instruction + tokens(10, seed=20 + i), **PARAMS[kind])
    assert shared_a.flush() and shared_a.stats.published == 1
    prompt = instruction + tokens(12, seed=30)
    (got, fetched) = fetch_then_run(b, shared_b, "b", prompt, **PARAMS[kind])
    assert fetched == len(instruction) and got[2] == len(instruction)
    assert got[:2] == run_one(cold, "b", prompt, **PARAMS[kind])[:2]
    assert shared_b.stats.hits == 1 and shared_b.stats.bytes_fetched > 0


def test_a_whole_prompt_from_the_shared_tier_needs_no_prefill(tiny_weights, redis_url):
    prompt = tokens(90, seed=2)
    a, b = make_engine(tiny_weights, prefix_min_tokens=16), make_engine(tiny_weights, prefix_min_tokens=16)
    cold = make_engine(tiny_weights, prefix_cache_gib=0)
    shared_a, shared_b = attach(a, redis_url), attach(b, redis_url)
    run_one(a, "first", prompt, temperature=0.0)
    run_one(a, "again", prompt, temperature=0.0)  # a hit: the prompt's checkpoint (with its logits) is shared
    assert shared_a.flush() and shared_a.stats.published == 1
    got, fetched = fetch_then_run(b, shared_b, "b", prompt, temperature=0.0)
    assert fetched == len(prompt) and got[2] == len(prompt)
    assert got[:2] == run_one(cold, "b", prompt, temperature=0.0)[:2]


def test_another_model_never_takes_a_state_and_a_tampered_one_is_refused(tiny_weights, redis_url, r, tmp_path):
    instruction = tokens(80, seed=3)
    a = make_engine(tiny_weights, prefix_min_tokens=16)
    shared_a = attach(a, redis_url)
    for i in range(2):
        run_one(a, f"a{i}", instruction + tokens(8, seed=40 + i), temperature=0.0)
    assert shared_a.flush() and shared_a.stats.published == 1
    prompt = instruction + tokens(8, seed=50)
    other = make_engine(load_model(write_demo_model(tmp_path / "other.pth", layers=2, width=128, vocab=65536,
                                                    seed=1)), prefix_min_tokens=16)
    assert other.runner.state_namespace(None) != a.runner.state_namespace(None)
    shared_other = attach(other, redis_url)
    assert fetch_then_run(other, shared_other, "o", prompt, temperature=0.0)[1] == 0
    bf16 = make_engine(tiny_weights, prefix_min_tokens=16, state_dtype="bfloat16")
    assert bf16.runner.state_namespace(None) != a.runner.state_namespace(None)
    # the bytes under the key changed behind the index's back: refused, a prefill instead
    key = next(k for k in r.scan_iter(c.PREFIX + "pstate:*"))
    r.set(key, r.get(key)[:-4])
    b = make_engine(tiny_weights, prefix_min_tokens=16)
    shared_b = attach(b, redis_url)
    cold = make_engine(tiny_weights, prefix_cache_gib=0)
    got, fetched = fetch_then_run(b, shared_b, "b", prompt, temperature=0.0)
    assert fetched == 0 and shared_b.stats.errors == 1
    assert got[:2] == run_one(cold, "b", prompt, temperature=0.0)[:2]


def test_the_byte_cap_evicts_the_least_recent_and_an_evicted_state_is_a_miss(tiny_weights, redis_url, r):
    a = make_engine(tiny_weights, prefix_min_tokens=16)
    one = a.runner.prefix_cache_row_bytes
    shared_a = attach(a, redis_url, cap=int(2.5 * one))  # room for two states
    heads = [tokens(70, seed=60 + h) for h in range(3)]
    for h, head in enumerate(heads):
        for i in range(2):
            run_one(a, f"a{h}-{i}", head + tokens(6, seed=70 + 2 * h + i), temperature=0.0)
        assert shared_a.flush()
    assert shared_a.stats.published == 3 and shared_a.stats.evicted == 1
    assert int(r.get(c.STATE_BYTES)) <= 2.5 * one and r.zcard(c.STATE_LRU) == 2
    b = make_engine(tiny_weights, prefix_min_tokens=16)
    shared_b = attach(b, redis_url)
    cold = make_engine(tiny_weights, prefix_cache_gib=0)
    for h, head in enumerate(heads):
        prompt = head + tokens(6, seed=90 + h)
        got, fetched = fetch_then_run(b, shared_b, f"b{h}", prompt, temperature=0.0)
        assert fetched == (0 if h == 0 else len(head)), h  # the first was evicted
        assert got[:2] == run_one(cold, f"b{h}", prompt, temperature=0.0)[:2]


def test_prefilling_is_chosen_where_it_is_cheaper_than_fetching(tiny_weights, redis_url):
    instruction = tokens(100, seed=4)
    a = make_engine(tiny_weights, prefix_min_tokens=16)
    shared_a = attach(a, redis_url)
    for i in range(2):
        run_one(a, f"a{i}", instruction + tokens(5, seed=80 + i), temperature=0.0)
    assert shared_a.flush()
    b = make_engine(tiny_weights, prefix_min_tokens=16)
    shared_b = attach(b, redis_url, rate=1e12)  # an engine that prefills 100 tokens faster than any fetch
    assert fetch_then_run(b, shared_b, "b", instruction + tokens(5, seed=85), temperature=0.0)[1] == 0
    assert shared_b.stats.recomputed == 1 and shared_b.stats.hits == 0


# -- two worker processes ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_starts_from_a_prefix_another_worker_computed(tiny_weights, tiny_model_path, redis_url, r):
    """Worker A serves two prompts that share an instruction and is stopped; worker B, which never saw it, starts a
    third prompt after the instruction (a state from Redis) and generates what a cold engine does."""
    instruction = tokens(300, seed=5)
    shared_flags = ("--shared-prefix-min-tokens", "64", "--prefix-min-tokens", "32")
    a = start_worker(redis_url, str(tiny_model_path), "wa", *shared_flags)
    for i in range(2):
        submit(r, f"a{i}", instruction + tokens(10, seed=100 + i), temperature=0.0)
        wait_results(r, [f"a{i}"])
    deadline = time.monotonic() + 30
    while not list(r.scan_iter(c.PREFIX + "pstate:*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    a.terminate()
    a.wait(timeout=30)
    start_worker(redis_url, str(tiny_model_path), "wb", *shared_flags)
    prompt = instruction + tokens(10, seed=110)
    submit(r, "b", prompt, temperature=0.9, seed=3, logprobs=2, ignore_eos=True)
    got = wait_results(r, ["b"])["b"]
    assert got.cached_tokens == len(instruction)
    cold = make_engine(tiny_weights, prefix_cache_gib=0)
    expected = run_one(cold, "b", prompt, temperature=0.9, seed=3)
    assert got.choices[0].token_ids == expected[0] and \
        [round(e["logprob"], 4) for e in got.choices[0].logprobs] == expected[1]

"""The prompt-prefix state cache: the tree's plans and tiers, and an engine that starts prompts from checkpoints
giving the tokens (and logprobs) of one that prefills every prompt from token 0."""

from __future__ import annotations

import pytest
import torch

from engine.params import SamplingParams
from engine.prefix_cache import PrefixCache, _common_prefix
from engine.sequence import Request
from tests.conftest import make_engine
from tests.test_engine import generated, run_all, tokens

# -- the tree -----------------------------------------------------------------------------------------


def cache(**kw) -> PrefixCache:
    kw.setdefault("device_bytes", 1000)
    kw.setdefault("host_bytes", 0)
    return PrefixCache(min_tokens=4, **kw)


def test_the_common_prefix_of_an_edge_and_a_prompt_is_where_they_first_differ():
    import random
    rng = random.Random(0)
    for _ in range(2000):
        edge = [rng.randrange(3) for _ in range(rng.randrange(1, 300))]
        at = rng.randrange(0, 50)
        tokens = [rng.randrange(3) for _ in range(at)] + edge[:rng.randrange(len(edge) + 1)]
        tokens += [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        expected = 0
        while expected < len(edge) and at + expected < len(tokens) and edge[expected] == tokens[at + expected]:
            expected += 1
        assert _common_prefix(edge, tokens, at) == expected


def test_a_prompt_starts_from_the_longest_checkpoint_on_its_path():
    c = cache()
    shared = list(range(10, 30))
    c.add(shared[:8], 10, True, lambda: "s8")
    c.add(shared, 10, True, lambda: "s20")
    plan = c.plan(shared + [1, 2, 3])
    assert (plan.tokens, plan.checkpoint.payload, plan.split_at) == (20, "s20", None)
    plan = c.plan(shared[:12] + [99, 98])  # leaves the path at 12: starts at 8, makes a checkpoint at 12
    assert (plan.tokens, plan.checkpoint.payload, plan.split_at) == (8, "s8", 12)
    assert c.plan([5, 6, 7, 8, 9]).checkpoint is None


def test_a_whole_prompt_is_a_hit_only_with_its_logits():
    c = cache()
    c.add([1, 2, 3, 4, 5], 10, True, lambda: "with")
    c.add([1, 2, 3, 4, 5, 6], 10, False, lambda: "without")
    assert c.plan([1, 2, 3, 4, 5]).tokens == 5
    plan = c.plan([1, 2, 3, 4, 5, 6])
    assert (plan.tokens, plan.checkpoint.payload) == (5, "with")  # the last token is prefilled for its logits


def test_short_divergences_make_no_checkpoint_and_prompt_logprobs_start_at_zero():
    c = cache()
    c.add([1, 2, 3, 9, 9, 9], 10, True, lambda: "x")
    assert c.plan([1, 2, 3, 7, 7]).split_at is None  # 3 < min_tokens
    c.add([1, 2, 3, 4, 5, 6], 10, True, lambda: "y")
    plan = c.plan([1, 2, 3, 4, 5, 6, 7], use_checkpoints=False)
    assert plan.tokens == 0 and plan.checkpoint is None


def test_a_prompt_waits_for_a_checkpoint_being_made_this_step():
    c = cache()
    c.expect([1, 2, 3, 4, 5, 6])
    assert c.plan([1, 2, 3, 4, 5, 6, 7, 8]).wait
    c.step_done()
    assert not c.plan([1, 2, 3, 4, 5, 6, 7, 8]).wait


def test_the_device_tier_pushes_its_least_recent_to_the_host_tier_then_out():
    moved, released = [], []
    c = cache(device_bytes=20, host_bytes=10, demote=lambda p: moved.append(p) or f"host:{p}", release=released.append)
    c.add([1, 1, 1, 1], 10, True, lambda: "a")
    c.add([2, 2, 2, 2], 10, True, lambda: "b")
    c.plan([1, 1, 1, 1, 5])  # a used: b is now the least recent
    c.add([3, 3, 3, 3], 10, True, lambda: "c")
    assert moved == ["b"] and c.plan([2, 2, 2, 2, 5]).checkpoint.payload == "host:b"
    c.add([4, 4, 4, 4], 10, True, lambda: "d")  # a goes to the host, b out of it
    assert c.plan([2, 2, 2, 2, 5]).checkpoint is None
    assert (c.bytes_used(True), c.bytes_used(False)) == (20, 10) and released == ["host:b"]
    assert c.add([5] * 4, 21, True, lambda: "too big") is None  # larger than the device tier: not kept


def test_the_paths_are_bounded():
    c = cache(max_path_tokens=100)
    for i in range(50):
        c.add([i] * 10, 1, True, lambda: f"p{i}")
    assert c._path_tokens <= 100
    assert c.plan([49] * 10).checkpoint is not None  # the most recent stay


# -- the engine ---------------------------------------------------------------------------------------

PARAMS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.9, top_p=0.95, seed=11)}


def run_one(engine, rid: str, prompt: list[int], **params):
    engine.add(Request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, **params)))
    outs = run_all(engine)
    lps = [round(e.logprob, 4) for o in outs[(rid, 0)] for e in o.logprobs]
    return generated(outs, rid), lps, outs[(rid, 0)][0].num_cached_tokens


@pytest.mark.parametrize("kind", PARAMS)
def test_prompts_on_a_shared_prefix_start_after_it_and_generate_what_a_cold_engine_does(tiny_weights, kind):
    instruction = tokens(60, seed=1)
    prompts = [instruction + tokens(9 + i, seed=20 + i) for i in range(4)]
    cold = make_engine(tiny_weights, prefix_cache_gib=0)
    warm = make_engine(tiny_weights, prefix_min_tokens=16)
    for i, prompt in enumerate(prompts):
        expected = run_one(cold, f"r{i}", prompt, **PARAMS[kind])
        got = run_one(warm, f"r{i}", prompt, **PARAMS[kind])
        assert got[:2] == expected[:2], i
        # the first two prefill from 0 (the second in two chunks: the instruction is kept), later ones start after it
        assert got[2] == (0 if i < 2 else len(instruction)), i
    # the same prompt again: no prefill at all, its first token from the stored logits
    assert run_one(warm, "again", prompts[3], **PARAMS[kind]) == (*run_one(cold, "again", prompts[3],
                                                                           **PARAMS[kind])[:2], len(prompts[3]))


def test_interval_checkpoints_inside_long_prompts(tiny_weights):
    long = tokens(150, seed=3)
    warm = make_engine(tiny_weights, prefix_min_tokens=16, prefix_interval=64, max_num_batched_tokens=256)
    cold = make_engine(tiny_weights, prefix_cache_gib=0, max_num_batched_tokens=256)
    run_one(warm, "long", long, temperature=0.0)
    other = long[:140] + tokens(5, seed=4)
    got = run_one(warm, "other", other, temperature=0.0)
    assert got[2] == 128 and got[:2] == run_one(cold, "other", other, temperature=0.0)[:2]


def test_a_tiny_cache_evicts_and_never_serves_a_wrong_state(tiny_weights):
    warm = make_engine(tiny_weights, prefix_min_tokens=8)
    one = warm.runner.state_bytes_per_seq + warm.runner.vocab_size * 4
    warm.prefix_cache.device_bytes = one + 1  # room for one checkpoint
    cold = make_engine(tiny_weights, prefix_cache_gib=0)
    heads = [tokens(20, seed=s) for s in (5, 6, 7)]
    for round_ in range(2):
        for h, head in enumerate(heads):
            prompt = head + tokens(4, seed=100 + round_ * 10 + h)
            rid = f"{round_}-{h}"
            assert run_one(warm, rid, prompt, temperature=0.0)[:2] == run_one(cold, rid, prompt, temperature=0.0)[:2]
    assert warm.prefix_cache.checkpoints(True) == 1 and warm.prefix_cache.stats.dropped > 0


def test_siblings_fork_from_a_cached_prompt(tiny_weights):
    prompt = tokens(40, seed=8)
    params = dict(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    warm, cold = make_engine(tiny_weights, prefix_min_tokens=16), make_engine(tiny_weights, prefix_cache_gib=0)
    for engine in (warm, cold):
        engine.add(Request("first", prompt, SamplingParams(**params)))
        run_all(engine)
        engine.add(Request("n3", prompt, SamplingParams(**params), n=3))
    w, c = run_all(warm), run_all(cold)
    assert [generated(w, "n3", i) for i in range(3)] == [generated(c, "n3", i) for i in range(3)]
    assert w[("n3", 0)][0].num_cached_tokens == len(prompt)


def test_the_cache_off_changes_nothing(tiny_weights):
    engine = make_engine(tiny_weights, prefix_cache_gib=0)
    assert engine.prefix_cache is None and engine.scheduler.prefix_cache is None
    assert torch.is_tensor(engine.runner.pool.wkv)


@pytest.mark.parametrize("kind", PARAMS)
def test_the_next_chat_turn_starts_where_the_last_one_ended(tiny_weights, kind):
    turn1 = tokens(40, seed=30)
    cold, warm = make_engine(tiny_weights, prefix_cache_gib=0), make_engine(tiny_weights, prefix_min_tokens=16)
    out1, _, _ = run_one(warm, "t1", turn1, **PARAMS[kind])
    assert out1 == run_one(cold, "t1", turn1, **PARAMS[kind])[0]
    turn2 = turn1 + out1 + tokens(7, seed=31)  # the history re-sent, then the new message
    got = run_one(warm, "t2", turn2, **PARAMS[kind])
    assert got[:2] == run_one(cold, "t2", turn2, **PARAMS[kind])[:2]
    # every output token but the last was fed back by a decode (8 tokens, max_tokens: no decode after the last)
    assert got[2] == len(turn1) + len(out1) - 1


def test_the_default_chat_template_puts_each_turn_inside_the_next():
    from api.prompts import render_chat
    from api.schemas import ChatMessage
    from api.settings import Settings
    from engine.tokenizer import WorldTokenizer
    tok, settings = WorldTokenizer.default(), Settings()
    history = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi there")]
    before = tok.encode(render_chat(history, settings, True))
    history += [ChatMessage(role="assistant", content="Hello! How can I help?"),
                ChatMessage(role="user", content="Tell me more.")]
    after = tok.encode(render_chat(history, settings, True))
    assert after[:len(before)] == before and len(after) > len(before)


def test_a_superseded_checkpoint_is_dropped_from_the_device_tier_not_moved_to_the_host():
    """A prompt's end once its answer's state is kept (a longer checkpoint on its path) is dropped when pushed out
    of the device tier; the answer's state and a divergence point (where two prompts part) move to the host."""
    moved, released = [], []
    c = cache(device_bytes=30, host_bytes=100, demote=lambda p: moved.append(p) or f"host:{p}",
              release=released.append)
    c.add([1] * 4, 10, True, lambda: "prompt")  # a prompt's end
    c.add([1] * 4 + [7] * 4, 10, False, lambda: "answer")  # its answer's: the prompt's end is superseded
    c.add([2] * 4, 10, True, lambda: "split", shared=True)  # a divergence point ...
    c.add([2] * 4 + [8] * 4, 10, True, lambda: "after split")  # ... superseded, still worth keeping
    c.add([3] * 4, 10, True, lambda: "x")
    c.add([4] * 4, 10, True, lambda: "y")
    assert moved == ["answer", "split"] and released == ["prompt"]
    assert c.plan([1] * 4 + [7] * 4 + [9]).checkpoint.payload == "host:answer"
    assert c.plan([2] * 4 + [5]).checkpoint.payload == "host:split"
    assert c.plan([1] * 4 + [6]).checkpoint is None  # only the longer path's state was worth a copy


def test_a_checkpoint_pushed_out_while_the_copies_to_the_host_are_behind_is_dropped_not_moved():
    """The runner says whether a copy to the host can start without waiting for earlier ones; where it cannot,
    the least recent checkpoint is dropped (its storage given back at once) and the next push moves again."""
    moved, released, copies_free = [], [], [True]
    c = cache(device_bytes=20, host_bytes=100, demote=lambda p: moved.append(p) or f"host:{p}",
              release=released.append, can_demote=lambda: copies_free[0])
    c.add([1] * 4, 10, True, lambda: "a")
    c.add([2] * 4, 10, True, lambda: "b")
    copies_free[0] = False
    c.add([3] * 4, 10, True, lambda: "c")  # a pushed out: dropped
    copies_free[0] = True
    c.add([4] * 4, 10, True, lambda: "d")  # b pushed out: moved
    assert moved == ["b"] and released == ["a"]
    assert c.plan([1] * 4 + [5]).checkpoint is None
    assert c.plan([2] * 4 + [5]).checkpoint.payload == "host:b"
    assert c.stats.demoted == 1 and c.stats.dropped == 1


def test_an_answer_that_pushes_out_its_own_prompt_end_drops_it_rather_than_copying_it_to_the_host():
    moved, released = [], []
    c = cache(device_bytes=20, host_bytes=100, demote=lambda p: moved.append(p) or f"host:{p}",
              release=released.append)
    c.add([1] * 4, 10, True, lambda: "prompt")
    c.add([2] * 4, 10, True, lambda: "other")
    c.plan([2] * 4 + [5])  # the prompt's end is now the least recent
    c.add([1] * 4 + [7] * 4, 10, False, lambda: "answer")
    assert moved == [] and released == ["prompt"]

"""Engine behaviour on CPU: prefill/decode equivalence, batch invariance, scheduling, aborts, n > 1."""

from __future__ import annotations

import pytest
import torch

from engine.model import ReferenceRwkv7
from engine.params import SamplingParams
from engine.sequence import Request
from engine.state import StatePool
from tests.conftest import make_engine


def tokens(n: int, seed: int = 0, vocab: int = 65536) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(engine) -> dict[tuple[str, int], list]:
    """Step until idle; collect each choice's outputs in order."""
    outs: dict[tuple[str, int], list] = {}
    for _ in range(10_000):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).append(o)
    raise AssertionError("engine did not finish")


def generated(outs, rid, index=0) -> list[int]:
    return [t for o in outs[(rid, index)] for t in o.token_ids]


@pytest.fixture()
def model(tiny_weights):
    return ReferenceRwkv7(tiny_weights, StatePool(tiny_weights.shape, 6, "cpu"))


def test_full_prefill_equals_chunked_prefill_and_decode(model):
    prompt = tokens(50, seed=1)
    full = model.prefill([prompt], [0])[0]
    chunked = None
    for start, end in [(0, 17), (17, 37), (37, 50)]:
        chunked = model.prefill([prompt[start:end]], [1])[0]
    model.prefill([prompt[:40]], [2])
    for t in prompt[40:]:
        stepped = model.decode(torch.tensor([t]), torch.tensor([2]))[0]
    for other in (chunked, stepped):
        assert torch.allclose(full, other, rtol=1e-5, atol=1e-5)
    for a, b, c in zip(model.pool.snapshot(0), model.pool.snapshot(1), model.pool.snapshot(2)):
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-5)


def test_batch_invariance_of_decode(model):
    for slot in range(6):  # every slot gets a different history
        model.prefill([tokens(10 + slot, seed=slot)], [slot])
    saved = [t.clone() for t in (model.pool.att_shift, model.pool.ffn_shift, model.pool.wkv)]

    def restore():
        for t, s in zip((model.pool.att_shift, model.pool.ffn_shift, model.pool.wkv), saved):
            t.copy_(s)

    alone = model.decode(torch.tensor([123]), torch.tensor([3]))[0]
    for slots in ([3, 0, 5], [1, 2, 3, 4, 5, 0], [5, 3]):
        restore()
        batch_tokens = torch.tensor([123 if s == 3 else 77 + s for s in slots])
        logits = model.decode(batch_tokens, torch.tensor(slots))
        assert torch.allclose(logits[slots.index(3)], alone, rtol=1e-5, atol=1e-5)


def test_output_does_not_depend_on_neighbours(tiny_weights):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    alone = make_engine(tiny_weights)
    alone.add(Request("a", tokens(20, seed=2), params))
    expected = generated(run_all(alone), "a")

    busy = make_engine(tiny_weights, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(5):  # neighbours arrive first, so "a" lands in another slot and another batch
        busy.add(Request(f"n{i}", tokens(30 + i, seed=10 + i), SamplingParams(max_tokens=5 + i)))
    busy.add(Request("a", tokens(20, seed=2), params))
    assert generated(run_all(busy), "a") == expected


def test_scheduler_respects_token_budget_and_chunks_long_prompts(tiny_weights):
    engine = make_engine(tiny_weights, max_num_seqs=4, max_num_batched_tokens=16)
    engine.add(Request("long", tokens(70, seed=3), SamplingParams(max_tokens=3)))
    engine.add(Request("short", tokens(5, seed=4), SamplingParams(max_tokens=30)))
    steps = 0
    while engine.has_work():
        batch = engine.scheduler.schedule()
        assert batch.num_tokens <= 16
        running_before = list(engine.scheduler.running)
        assert set(map(id, batch.decodes)) == set(map(id, running_before))  # every running seq decodes
        engine.runner.admit(batch.admitted)
        launched = engine.runner.launch(batch)
        engine._complete_prefills(batch)
        if launched is not None:  # serially: every running sequence decodes in the next step
            engine._finish_step(launched)
        steps += 1
    assert steps >= 70 // 16  # the long prompt was chunked


def test_abort_frees_the_slot_at_once(tiny_weights):
    engine = make_engine(tiny_weights, max_num_seqs=2, max_num_batched_tokens=64)
    for rid in ("a", "b", "c"):
        engine.add(Request(rid, tokens(8, seed=ord(rid)), SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    assert engine.num_free_slots == 0 and engine.num_running == 2
    assert engine.abort("a")
    assert engine.num_free_slots == 1 and not engine.has_request("a")
    outs = engine.step()  # overlapped: "c" is launched into the freed slot; the step before it finishes
    assert engine.has_request("c") and engine.num_running == 2
    outs += engine.step()
    assert {o.request_id for o in outs} == {"b", "c"}  # nothing more of "a": its token in flight was dropped
    assert not engine.abort("a")


def test_n_choices_share_one_prefill(tiny_weights):
    engine = make_engine(tiny_weights)
    prompt = tokens(30, seed=5)
    engine.add(Request("g", prompt, SamplingParams(max_tokens=6, temperature=0.0), n=3))
    engine.add(Request("s", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=1), n=3))
    prefill_tokens = []
    real_prefill = engine.runner.model.prefill_with_scores
    engine.runner.model.prefill_with_scores = lambda chunks, slots, score: (
        prefill_tokens.append(sum(map(len, chunks))), real_prefill(chunks, slots, score))[1]
    outs = run_all(engine)
    assert sum(prefill_tokens) == 2 * len(prompt)  # once per request, not once per choice
    greedy = [generated(outs, "g", i) for i in range(3)]
    assert greedy[0] == greedy[1] == greedy[2]
    sampled = [tuple(generated(outs, "s", i)) for i in range(3)]
    assert len(set(sampled)) == 3


def test_greedy_matches_official_package(tiny_model_path, tiny_weights):
    from rwkv.model import RWKV
    official = RWKV(model=str(tiny_model_path)[:-4], strategy="cpu fp32")
    prompt = tokens(40, seed=6)
    logits, state = official.forward(prompt, None)
    expected = []
    for _ in range(20):
        expected.append(int(logits.argmax()))
        logits, state = official.forward(expected[-1], state)
    engine = make_engine(tiny_weights)
    engine.add(Request("x", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    assert generated(run_all(engine), "x") == expected


def test_finish_reasons_and_text(tiny_weights):
    engine = make_engine(tiny_weights)
    engine.add(Request("len", tokens(10, seed=7), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    outs = run_all(engine)["len", 0]
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 4
    assert all(not o.finished for o in outs[:-1])

    # a stop string taken from the model's own greedy output ends it there
    engine.add(Request("probe", tokens(10, seed=8), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
    text = "".join(o.text for o in run_all(engine)["probe", 0])
    stop = text[10:13]
    assert len(stop) == 3
    engine.add(Request("stop", tokens(10, seed=8), SamplingParams(max_tokens=40, temperature=0.0,
                                                                   ignore_eos=True, stop=[stop])))
    outs = run_all(engine)["stop", 0]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert "".join(o.text for o in outs) == text[:text.index(stop)]


def test_empty_prompt_and_bad_requests(tiny_weights):
    engine = make_engine(tiny_weights, max_model_len=100)
    engine.add(Request("empty", [], SamplingParams(max_tokens=3)))
    assert len(generated(run_all(engine), "empty")) >= 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add(Request("bad", [1, 70000], SamplingParams()))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(Request("long", tokens(90), SamplingParams(max_tokens=20)))
    with pytest.raises(ValueError, match="n must be"):
        engine.add(Request("n", [1], SamplingParams(), n=100))
    assert not engine.has_work()


def test_prompt_logprobs_match_official_package(tiny_model_path, tiny_weights):
    """Each prompt token's logprob (and the top 3 there) against the official package's per-position logits,
    through chunked prefill (chunks of 16) and n = 2: the first token has none, every choice gets the list
    with its first token only."""
    from rwkv.model import RWKV
    official = RWKV(model=str(tiny_model_path)[:-4], strategy="cpu fp32")
    prompt = tokens(37, seed=9)
    expected, state = [], None
    for t in prompt[:-1]:
        logits, state = official.forward([t], state)
        expected.append(torch.log_softmax(logits.double(), -1))
    engine = make_engine(tiny_weights, max_num_batched_tokens=16)
    engine.add(Request("p", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                  prompt_logprobs=3), n=2))
    outs = run_all(engine)
    for index in (0, 1):
        first, *rest = outs["p", index]
        assert all(o.prompt_logprobs is None for o in rest)
        entries = first.prompt_logprobs
        assert [e.token_id for e in entries] == prompt
        assert entries[0].logprob is None and entries[0].top == []
        for pos, (entry, ref) in enumerate(zip(entries[1:], expected)):
            assert abs(entry.logprob - ref[prompt[pos + 1]].item()) < 1e-4, pos
            assert [i for i, _ in entry.top] == ref.topk(3).indices.tolist(), pos
            assert all(abs(lp - ref[i].item()) < 1e-4 for i, lp in entry.top), pos
    plain = make_engine(tiny_weights, max_num_batched_tokens=16)
    plain.add(Request("q", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    q = run_all(plain)["q", 0]
    assert all(o.prompt_logprobs is None for o in q)
    assert [t for o in q for t in o.token_ids] == generated(outs, "p", 0)  # scoring changes nothing generated


def test_prefill_beside_decodes_is_bounded_by_the_number_decoding():
    """A step's prompt tokens: the whole budget with nothing decoding; beside decodes, 2 per decoding sequence
    (at least the minimum chunk): a mixed step stays within a few decode steps' time."""
    from engine.scheduler import Scheduler
    sched = Scheduler(num_slots=2048, max_num_batched_tokens=8192, prefill_per_decode=2.0, min_prefill_chunk=1024)
    assert sched.prefill_budget(0) == 8192
    assert sched.prefill_budget(10) == 1024
    assert sched.prefill_budget(1024) == 2048
    assert sched.prefill_budget(3000) == 5192  # never more than what the token budget leaves
    assert Scheduler(16, 64, prefill_per_decode=0).prefill_budget(8) == 56  # 0: no cap


def test_new_prompts_beside_decodes_wait_to_share_a_prefill_step(tiny_weights):
    """prefill_hold_tokens: beside decodes, a lone prompt waits up to prefill_hold_steps steps; enough waiting
    prompt tokens are admitted at once; with nothing decoding nothing waits. Same text as without holding."""
    def prefill_steps(hold: int) -> tuple[list[int], dict]:
        engine = make_engine(tiny_weights, max_num_seqs=8, max_num_batched_tokens=512, prefill_hold_tokens=hold,
                             prefill_hold_steps=3)
        engine.add(Request("decoding", tokens(4, seed=1), SamplingParams(max_tokens=40, ignore_eos=True, seed=1)))
        steps, admitted = 0, []
        real_launch = engine.runner.launch
        engine.runner.launch = lambda batch, *rest: (admitted.append((steps, [c.seq.request_id for c in batch.prefills])),
                                                     real_launch(batch, *rest))[1]
        outputs = {}
        for steps in range(30):
            if steps == 2:
                engine.add(Request("lone", tokens(10, seed=2), SamplingParams(max_tokens=3, seed=2)))
            if steps == 10:
                for i in range(3):  # 3 × 10 ≥ 24 waiting tokens: no wait
                    engine.add(Request(f"many{i}", tokens(10, seed=3 + i), SamplingParams(max_tokens=3, seed=3 + i)))
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
        first = {rid: step for step, rids in admitted for rid in rids}
        return [first["lone"] - 2, first["many0"] - 10, first["many2"] - 10], outputs

    delays, held = prefill_steps(hold=24)
    assert delays == [3, 0, 0]  # the lone prompt waited 3 steps; the three together went at once
    no_delays, plain = prefill_steps(hold=0)
    assert no_delays == [0, 0, 0] and held == plain
    engine = make_engine(tiny_weights, max_num_seqs=8, max_num_batched_tokens=512, prefill_hold_tokens=1000)
    engine.add(Request("alone", tokens(10, seed=9), SamplingParams(max_tokens=2)))
    assert engine.scheduler.schedule().prefills  # nothing decodes: nothing to gather for


def test_long_prompts_beside_decodes_are_chunked_to_the_bound(tiny_weights):
    engine = make_engine(tiny_weights, max_num_seqs=8, max_num_batched_tokens=512, prefill_per_decode=2.0,
                         min_prefill_chunk=16)
    engine.add(Request("decoding", tokens(4, seed=1), SamplingParams(max_tokens=200, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.add(Request("long", tokens(300, seed=2), SamplingParams(max_tokens=2)))
    chunks = []
    real_launch = engine.runner.launch
    engine.runner.launch = lambda batch, *rest: (chunks.append(sum(c.end - c.start for c in batch.prefills)),
                                                 real_launch(batch, *rest))[1]
    while engine.has_request("long"):
        engine.step()
    assert max(chunks) == 16 and sum(chunks) == 300  # 1 decoding sequence: the minimum chunk per step


def test_a_higher_priority_request_passes_the_waiting_ones_of_lower_priority(tiny_weights):
    """Batch lines (priority 1) waiting for their prefill do not delay a chat request (priority 0): it is
    admitted in the first step that has room, ahead of them; equal priorities keep their arrival order."""
    engine = make_engine(tiny_weights, max_num_seqs=8, max_num_batched_tokens=16)
    for i in range(6):
        engine.add(Request(f"line-{i}", tokens(16, seed=i), SamplingParams(max_tokens=4), priority=1))
    engine.add(Request("chat-0", tokens(16, seed=9), SamplingParams(max_tokens=4)))
    engine.add(Request("chat-1", tokens(16, seed=10), SamplingParams(max_tokens=4)))
    order = [s.request_id for s in engine.scheduler.waiting]
    assert order == ["chat-0", "chat-1"] + [f"line-{i}" for i in range(6)]
    batch = engine.scheduler.schedule()  # 16 tokens: one whole prompt this step
    assert [c.seq.request_id for c in batch.prefills] == ["chat-0"]


def test_serve_bench_runs_only_the_workloads_asked_for(tmp_path):
    """``benchmarks.engine --serve --workload NAME``: the table holds that workload alone (a GPU bisect of one
    workload costs seconds, not the whole set); a name that matches nothing is an error."""
    from benchmarks.engine import main
    out = tmp_path / "b.md"
    assert main(["--device", "cpu", "--serve", "--workload", "1 stream", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "workload" not in line]
    assert rows and all(row.startswith("| 1 stream") for row in rows), rows
    assert "steps to a first token" in out.read_text()  # the TTFT window by phase
    with pytest.raises(SystemExit, match="no workload"):
        main(["--device", "cpu", "--serve", "--workload", "nothing like it", "--out", str(out)])

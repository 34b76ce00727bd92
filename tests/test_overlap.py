"""The overlapped step loop (step t+1 launched before step t is finished on the host) against the serial one:
the same tokens, text, logprobs and finish reasons for any mix of parameters; the token a stopped sequence gets
one step late is never emitted or counted; aborts between steps lose nothing else."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine.params import SamplingParams
from engine.sequence import Request
from tests.conftest import make_engine


def tokens(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7919 + i * 104729) % 65000 for i in range(n)]


def mixed_requests() -> list[Request]:
    """Greedy and sampled, n > 1, min_tokens, penalties, logit_bias, logprobs, prompt logprobs, a chunked long
    prompt, lengths from 1 to 40 (stop strings are added by ``run``)."""
    return [
        Request("greedy", tokens(9, 1), SamplingParams(max_tokens=30, temperature=0.0)),
        Request("sampled", tokens(5, 2), SamplingParams(max_tokens=40, temperature=1.0, top_p=0.8, seed=3)),
        Request("topk", tokens(70, 3), SamplingParams(max_tokens=25, temperature=0.7, top_k=20, seed=4)),
        Request("n3", tokens(12, 4), SamplingParams(max_tokens=18, temperature=1.0, seed=5), n=3),
        Request("penalties", tokens(6, 5), SamplingParams(max_tokens=30, temperature=0.9, seed=6,
                                                          presence_penalty=0.8, frequency_penalty=0.5,
                                                          repetition_penalty=1.3)),
        Request("minimum", tokens(4, 6), SamplingParams(max_tokens=20, min_tokens=15, temperature=1.0, seed=7,
                                                        stop_token_ids=[11, 12, 13])),
        Request("bias", tokens(8, 7), SamplingParams(max_tokens=12, temperature=1.0, seed=8,
                                                     logit_bias={5: 8.0, 6: -100.0})),
        Request("logprobs", tokens(7, 8), SamplingParams(max_tokens=15, temperature=1.0, seed=9, logprobs=3,
                                                         prompt_logprobs=2)),
        Request("one", tokens(3, 9), SamplingParams(max_tokens=1, temperature=0.0)),
    ]


def same(a: dict, b: dict) -> bool:
    """Equal outputs: tokens, text, counts, finish reasons exactly; logprobs to float rounding (a batch of other
    rows may order a row's sums differently), their top-k ids exactly."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if {k: v for k, v in x.items() if k != "logprobs"} != {k: v for k, v in y.items() if k != "logprobs"}:
            return False
        if len(x["logprobs"]) != len(y["logprobs"]) or any(
                (t1, top1) != (t2, top2) or abs(l1 - l2) > 1e-4
                for (t1, l1, top1), (t2, l2, top2) in zip(x["logprobs"], y["logprobs"])):
            return False
    return True


def run(engine, requests: list[Request], stops: dict[str, list[str]] | None = None,
        abort_after: dict[str, int] | None = None) -> dict:
    """Every output, per (request, index): token ids, text, logprobs, finish reason, reported counts."""
    for req in requests:
        if stops and req.request_id in stops:
            req.params.stop = stops[req.request_id]
        engine.add(req)
    got: dict = defaultdict(lambda: {"tokens": [], "text": "", "logprobs": [], "finish": None, "counts": []})
    while engine.has_work():
        for out in engine.step():
            g = got[(out.request_id, out.index)]
            assert g["finish"] is None, f"{out.request_id}#{out.index}: an output after its last"
            g["tokens"] += out.token_ids
            g["text"] += out.text
            g["logprobs"] += [(lp.token_id, lp.logprob, [t for t, _ in lp.top]) for lp in out.logprobs or []]
            g["counts"].append(out.num_output_tokens)
            if out.finished:
                g["finish"] = (out.finish_reason, out.stop_reason)
        for rid, after in (abort_after or {}).items():
            if engine.has_request(rid) and len(got[(rid, 0)]["tokens"]) >= after:
                engine.abort(rid)
    return dict(got)


@pytest.fixture(scope="module")
def stop_strings(tiny_weights) -> dict[str, list[str]]:
    """Stop strings that occur in the greedy and sampled texts, spanning token boundaries."""
    texts = run(make_engine(tiny_weights, async_scheduling=False), mixed_requests()[:2])
    return {rid: [texts[(rid, 0)]["text"][10:13]] for rid in ("greedy", "sampled")}


def test_overlapped_and_serial_loops_produce_the_same_outputs(tiny_weights, stop_strings):
    serial = run(make_engine(tiny_weights, async_scheduling=False), mixed_requests(), stop_strings)
    overlapped = run(make_engine(tiny_weights, async_scheduling=True), mixed_requests(), stop_strings)
    assert same(overlapped, serial)
    assert serial[("greedy", 0)]["finish"][0] == "stop"  # the stop strings did end those two
    assert serial[("sampled", 0)]["finish"][0] == "stop"
    assert len(serial[("minimum", 0)]["tokens"]) >= 15
    for g in overlapped.values():  # counted tokens are emitted tokens: the late one is neither
        assert g["counts"] == list(range(1, len(g["tokens"]) + 1)) and g["finish"] is not None


def test_a_stopped_sequences_late_token_is_dropped(tiny_weights, stop_strings):
    """Overlapped, the step after a stop samples one more token for the sequence on the device: it is not
    emitted, counted, or part of the text; the outputs end exactly where the serial loop's do."""
    engine = make_engine(tiny_weights, async_scheduling=True)
    launched = []
    real_launch = engine.runner.launch
    engine.runner.launch = lambda batch, *rest: (launched.append([s.request_id for s in batch.decodes]),
                                                 real_launch(batch, *rest))[1]
    got = run(engine, mixed_requests()[:1], stop_strings)
    emitted = len(got[("greedy", 0)]["tokens"])
    decoded = sum(ids.count("greedy") for ids in launched)
    assert got[("greedy", 0)]["finish"][0] == "stop"
    assert decoded == emitted  # one decode more than the serial loop's emitted - 1: the late token
    assert got[("greedy", 0)]["counts"][-1] == emitted


def test_aborts_between_steps_cut_the_same_place_in_both_loops(tiny_weights):
    aborts = {"sampled": 7, "n3": 5}
    serial = run(make_engine(tiny_weights, async_scheduling=False), mixed_requests(), abort_after=aborts)
    overlapped = run(make_engine(tiny_weights, async_scheduling=True), mixed_requests(), abort_after=aborts)
    for rid, after in aborts.items():
        assert len(serial[(rid, 0)]["tokens"]) == len(overlapped[(rid, 0)]["tokens"]) == after
        assert serial[(rid, 0)]["tokens"] == overlapped[(rid, 0)]["tokens"]
    rest = {k: v for k, v in serial.items() if k[0] not in aborts}
    assert same(rest, {k: v for k, v in overlapped.items() if k[0] not in aborts})  # neighbours unaffected


def test_after_launch_runs_between_the_launch_and_the_wait_once_a_step(tiny_weights):
    """``step(after_launch=f)``: f runs once per step, after the next step is launched and before the previous
    one is collected (the worker hands the writer its outputs there); the outputs are those of a plain loop."""
    plain = run(make_engine(tiny_weights, async_scheduling=True), mixed_requests())
    engine = make_engine(tiny_weights, async_scheduling=True)
    for req in mixed_requests():
        engine.add(req)
    calls, outputs, seen = [], [], []

    def after_launch() -> None:
        launched, previous = engine._launched, calls[-1] if calls else None
        calls.append(launched)
        # the step just launched is new; the previous one has not been collected yet
        seen.append((launched is None or launched is not previous, previous is None or previous.output is None))

    steps = 0
    while engine.has_work():
        outputs += engine.step(after_launch=after_launch)
        steps += 1
    assert len(calls) == steps and all(new and uncollected for new, uncollected in seen)
    got = defaultdict(list)
    for out in outputs:
        got[(out.request_id, out.index)] += out.token_ids
    assert dict(got) == {key: value["tokens"] for key, value in plain.items()}

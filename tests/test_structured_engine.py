"""Constrained decoding in the engine (CPU, the tiny random model): every finished output is in its grammar's
language, constrained and free sequences share steps, the overlapped loop equals the serial one, a bad spec is a
ValueError naming it, and compiled grammars are shared."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.params import SamplingParams
from engine.sequence import Request
from tests.conftest import make_engine
from tests.test_engine import generated, run_all

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["cat", "dog", "goose"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
          "required": ["name", "age", "ok", "kind", "tags"]}


def structured(kind: str, value=None, **params) -> SamplingParams:
    return SamplingParams(max_tokens=params.pop("max_tokens", 200), seed=params.pop("seed", 0),
                          structured={"type": kind, "value": value}, **params)


def finished(engine, outs, rid: str, index: int = 0) -> tuple[str, str]:
    text = "".join(o.text for o in outs[(rid, index)])
    return text, outs[(rid, index)][-1].finish_reason


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_json_schema_outputs_validate_and_share_steps_with_free_sequences(tiny_weights, async_scheduling):
    engine = make_engine(tiny_weights, async_scheduling=async_scheduling)
    for i in range(6):
        engine.add(Request(f"j{i}", [1, 2, 3 + i], structured("json_schema", SCHEMA, seed=i, temperature=1.0)))
        engine.add(Request(f"f{i}", [4, 5, 6 + i], SamplingParams(max_tokens=30, seed=i, ignore_eos=True)))
    outs = run_all(engine)
    for i in range(6):
        text, reason = finished(engine, outs, f"j{i}")
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert len(generated(outs, f"f{i}")) == 30  # the free ones ran alongside, unconstrained


def test_overlapped_loop_equals_serial_loop_for_constrained_requests(tiny_weights):
    runs = []
    for async_scheduling in (True, False):
        engine = make_engine(tiny_weights, async_scheduling=async_scheduling)
        for i in range(4):
            engine.add(Request(f"r{i}", [7, 8, i], structured("json_schema", SCHEMA, seed=10 + i, temperature=0.9,
                                                             top_p=0.9), n=2))
        outs = run_all(engine)
        runs.append({k: generated(outs, *k) for k in outs})
    assert runs[0] == runs[1]


def test_regex_choice_grammar_and_json_object(tiny_weights):
    engine = make_engine(tiny_weights)
    engine.add(Request("re", [1], structured("regex", r"[a-c]{2,5}-\d{3}", temperature=1.0)))
    engine.add(Request("ch", [2], structured("choice", ["yes", "no", "maybe so"], temperature=1.0)))
    engine.add(Request("gr", [3], structured("grammar", 'root ::= "(" [0-9]+ ("," [0-9]+){0,2} ")"',
                                             temperature=1.0, max_tokens=60)))
    engine.add(Request("ob", [4], structured("json_object", None, temperature=0.0, max_tokens=400)))
    outs = run_all(engine)
    assert re.fullmatch(r"[a-c]{2,5}-\d{3}", finished(engine, outs, "re")[0])
    assert finished(engine, outs, "ch")[0] in ("yes", "no", "maybe so")
    text, reason = finished(engine, outs, "gr")
    assert reason == "length" or re.fullmatch(r"\(\d+(,\d+){0,2}\)", text), text
    text, reason = finished(engine, outs, "ob")
    assert reason == "length" or isinstance(json.loads(text), dict), text


def test_a_bad_spec_is_a_value_error_and_nothing_is_queued(tiny_weights):
    engine = make_engine(tiny_weights)
    for kind, value, word in (("regex", "(unclosed", "regex"), ("grammar", "root ::= nothing_defined", "grammar"),
                              ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                               "json_schema")):
        with pytest.raises(ValueError, match=word):
            engine.add(Request(f"bad-{kind}", [1], structured(kind, value)))
    assert not engine.has_work()
    with pytest.raises(ValueError, match="structured"):
        SamplingParams(structured={"type": "json_schema"})


def test_compiled_grammars_are_cached_and_prepare_says_when_to_wait(tiny_weights):
    engine = make_engine(tiny_weights)
    request = Request("a", [1], structured("json_schema", SCHEMA))
    future = engine.prepare(request)
    if future is not None:
        future.result()
    assert engine.prepare(request) is None  # compiled: add at once
    assert engine.grammars.submit(request.params.structured) is engine.grammars.submit(dict(request.params.structured))
    assert engine.prepare(Request("b", [1], SamplingParams())) is None


def test_matchers_split_over_threads_fill_and_accept_as_one_thread_does():
    """A step's matcher work split over threads (70 matchers: 2 parts) gives the masks and the acceptances
    of one thread doing it all, including a refused token."""
    import random

    import numpy as np
    import torch

    from engine.grammar import Grammars
    from benchmarks.serve_loop import TEN_FIELDS
    from engine.tokenizer import WorldTokenizer
    tok = WorldTokenizer.default()
    spec = {"type": "json_schema", "value": TEN_FIELDS}
    one, split = (Grammars(tok.id_to_token_bytes, 65536, [0], threads=t) for t in (1, 4))
    n = 70
    a = [one.matcher(one.compile(spec)) for _ in range(n)]
    b = [split.matcher(split.compile(spec)) for _ in range(n)]
    rows_a, rows_b = (torch.zeros((n, one.words), dtype=torch.int32) for _ in range(2))
    rng = random.Random(0)
    for step in range(8):
        one.fill(a, rows_a, list(range(n)))
        split.fill(b, rows_b, list(range(n)))
        assert torch.equal(rows_a, rows_b)
        tokens = []
        for i in range(n):
            allowed = np.flatnonzero(np.unpackbits(rows_a[i].numpy().view(np.uint8), bitorder="little")[:65536])
            tokens.append(int(allowed[rng.randrange(len(allowed))]))
        if step == 5:
            tokens[40] = tok.encode("@")[0]  # never allowed inside this JSON: refused
        assert one.accept(a, tokens) == split.accept(b, tokens) == [not (step == 5 and i == 40) for i in range(n)]

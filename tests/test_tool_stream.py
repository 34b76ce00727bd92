"""Tool calls read back out of generated text: a stream of it, however it is chunked, assembles to exactly the
split of the whole text (no separator text between calls, no markup when max_tokens cuts a call)."""

from __future__ import annotations

import json
import random

import pytest

from api.prompts import CLOSE, OPEN, call_block
from api.tools import CallStream, split_calls, split_pieces

ADD = call_block("add", json.dumps({"a": 2, "b": 3}))
WEATHER = call_block("get_weather", json.dumps({"city": "Paris"}))

TEXTS = [
    ADD,
    ADD + "\n" + WEATHER,  # parallel calls, as the constraint separates them
    ADD + "\n" + WEATHER + "\n",
    "\n " + ADD + "\n\n" + WEATHER + "\n",
    "Let me add.\n" + ADD,
    "Sure.\n" + ADD + "\nDone: see above.",
    "No tools needed, 2 < 3 and x <tool is not a tag.",
    "a <tool_call> that is not JSON </tool_call> stays text",
    "Ends inside a block " + OPEN + '\n{"name": "add", "argu',
    "Ends inside the opening marker <tool_c",
]


def streamed(text: str, cuts: list[int], cut: bool) -> tuple[str, list]:
    stream, content, calls = CallStream(), "", []
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece_content, piece_calls = stream.feed(text[a:b], final=i == len(bounds) - 2, cut=cut)
        content += piece_content
        calls += piece_calls
    return content, calls


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("cut", [False, True])
def test_any_chunking_assembles_to_the_whole_split(text, cut):
    whole_content, whole_calls = split_calls(text, cut=cut)
    rng = random.Random(text)
    chunkings = [list(range(1, len(text)))]  # one character at a time
    chunkings += [sorted(rng.sample(range(1, len(text)), k=rng.randint(1, max(1, len(text) // 4))))
                  for _ in range(30)]
    for cuts in chunkings:
        content, calls = streamed(text, cuts, cut)
        assert (content or None, calls) == (whole_content, whole_calls), cuts


def test_parallel_calls_have_no_content_between_them():
    assert split_calls(ADD + "\n" + WEATHER + "\n") == (None, [("add", '{"a": 2, "b": 3}'),
                                                              ("get_weather", '{"city": "Paris"}')])
    assert split_calls("Sure.\n" + ADD + "\nDone.") == ("Sure.\nDone.", [("add", '{"a": 2, "b": 3}')])


def test_a_call_cut_by_max_tokens_leaves_no_markup():
    for tail in (OPEN + '\n{"name": "add", "argu', "<tool_c", OPEN):
        content, calls = split_calls(ADD + "\n" + tail, cut=True)
        assert (content, calls) == (None, [("add", '{"a": 2, "b": 3}')])
        content, calls = split_calls("Let me see. " + tail, cut=True)
        assert (content, calls) == ("Let me see.", [])
    # ended by the model itself (a stop string), an unclosed block is text: it was never a call
    assert split_calls("x " + OPEN + " y")[0] == "x " + OPEN + " y"


def test_pieces_keep_the_order_of_text_and_calls():
    assert split_pieces("Sure.\n" + ADD + "\nDone.\n" + WEATHER) == [
        "Sure.", ("add", '{"a": 2, "b": 3}'), "\nDone.", ("get_weather", '{"city": "Paris"}')]
    assert CLOSE not in "".join(p for p in split_pieces(ADD + "\n" + OPEN, cut=True) if isinstance(p, str))

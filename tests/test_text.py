"""engine.text.TextStream: incremental UTF-8 detokenization and stop strings.

The oracles here are written independently of the implementation:
* ``safe_prefix(data)``: the text of ``data`` that no future bytes can change,
  i.e. the common prefix of its decodings followed by every possible way the
  tail could continue (a complete char, or each valid UTF-8 continuation).
* ``expected_stop(text, stops)``: the stop string that ends earliest in the
  whole decoded text (ties: the longer one), found with plain ``str.find``.
"""

from __future__ import annotations

import random
from os.path import commonprefix

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text import TextStream
from engine.tokenizer import WorldTokenizer

HYPOTHESIS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# Ways the bytes after a cut could continue: a new char, or the continuation
# bytes each kind of lead byte needs (E0 needs A0.., F0 needs 90..).
PROBES = [b"\x00", b"\x80", b"\x80\x80", b"\x80\x80\x80", b"\xa0\x80", b"\x90\x80\x80"]
ALPHABET = ["a", "b", "c", " ", "\n", "é", "世", "界", "😀", "👨‍👩‍👧", "\u0301"]


@pytest.fixture(scope="module")
def tok() -> WorldTokenizer:
    return WorldTokenizer.default()


# ---------------------------------------------------------------- oracles and helpers

def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def safe_prefix(data: bytes) -> str:
    return commonprefix([decode(data + p) for p in PROBES])


def expected_stop(text: str, stops, include: bool = False) -> tuple[str, str | None]:
    best = None
    for s in filter(None, stops):
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0], -len(best[1]))):
            best = (i + len(s), s)
    if best is None:
        return text, None
    end, s = best
    return (text[:end] if include else text[: end - len(s)]), s


def held_suffix(text: str, stops) -> int:
    """Length of the longest suffix of ``text`` that could still grow into a stop."""
    longest = max((len(s) for s in stops if s), default=0)
    for h in range(min(len(text), longest), 0, -1):
        if any(s.startswith(text[-h:]) for s in stops if s):
            return h
    return 0


def byte_ids(tok: WorldTokenizer, data: bytes) -> list[int]:
    """One token per byte: every multi-byte character is split."""
    return [tok.encode_bytes(bytes([b]))[0] for b in data]


def chunk_ids(tok: WorldTokenizer, data: bytes, rng: random.Random) -> list[int]:
    """Encode random byte chunks separately: tokens end at arbitrary byte offsets."""
    ids, i = [], 0
    while i < len(data):
        j = i + rng.randint(1, 6)
        ids += tok.encode_bytes(data[i:j])
        i = j
    return ids


def tokenizations(tok: WorldTokenizer, text: str, rng: random.Random) -> list[list[int]]:
    data = text.encode()
    chars = [i for ch in text for i in tok.encode(ch)]
    return [tok.encode(text), byte_ids(tok, data), chars, chunk_ids(tok, data, rng)]


def run(tok, ids, stop=(), include=False) -> tuple[TextStream, list[str]]:
    ts = TextStream(tok, stop, include_stop_str_in_output=include)
    deltas = [ts.push(i) for i in ids]
    deltas.append(ts.finish())
    return ts, deltas


def check_stream(tok, ids, stops=(), include=False) -> TextStream:
    """Push ``ids`` one by one, checking every delta against the oracles."""
    data = tok.decode_bytes(ids)
    full = decode(data)
    want, want_stop = expected_stop(full, stops, include)
    ts = TextStream(tok, stops, include_stop_str_in_output=include)
    emitted = ""
    for k, i in enumerate(ids):
        delta = ts.push(i)
        assert isinstance(delta, str)
        assert want[len(emitted): len(emitted) + len(delta)] == delta  # in place, no early U+FFFD
        emitted += delta
        if ts.stopped:
            break
        safe = safe_prefix(tok.decode_bytes(ids[: k + 1]))
        assert emitted == safe[: len(safe) - held_suffix(safe, stops)], (k, ids)
    emitted += ts.finish()
    assert ts.finish() == "" and ts.push(ids[0] if ids else 1) == ""
    assert emitted == want == ts.text
    assert ts.stop_str == want_stop and ts.stopped == (want_stop is not None)
    return ts


# ---------------------------------------------------------------- decoding without stops

def test_random_token_ids(tok):
    rng = random.Random("ids")
    high_bytes = byte_ids(tok, bytes(range(0x80, 0x100)))
    for _ in range(1500):
        pool = high_bytes if rng.random() < 0.5 else range(tok.vocab_size)
        ids = [rng.choice(pool) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(0, 30))]
        check_stream(tok, ids)


def test_split_multibyte_text(tok):
    rng = random.Random("split")
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30)))
        for ids in tokenizations(tok, text, rng):
            ts, deltas = run(tok, ids)
            assert "".join(deltas) == text
            assert all("\ufffd" not in d for d in deltas)


@HYPOTHESIS
@given(st.binary(max_size=60), st.randoms(use_true_random=False))
def test_hypothesis_bytes_deltas(tok, data, rng):
    check_stream(tok, chunk_ids(tok, data, rng))


def test_incomplete_tail_becomes_replacement_char_at_finish(tok):
    ids = byte_ids(tok, "ab世".encode()[:-1])
    ts, deltas = run(tok, ids)
    assert deltas == ["a", "b", "", "", "\ufffd"]  # 2 of 3 bytes: one U+FFFD


def test_invalid_bytes_are_replaced_immediately(tok):
    ts, deltas = run(tok, byte_ids(tok, b"a\xffb\xe0\x80c"))
    assert deltas == ["a", "\ufffd", "b", "", "\ufffd\ufffd", "c", ""]


def test_text_attribute_tracks_output(tok):
    ts = TextStream(tok)
    for i in tok.encode("hello world"):
        ts.push(i)
        assert "hello world".startswith(ts.text)
    assert ts.finish() == "" and ts.text == "hello world"


# ---------------------------------------------------------------- stop strings

def test_stop_string_split_across_tokens(tok):
    text = "Hello there. User: hi"
    for ids in tokenizations(tok, text, random.Random(1)):
        ts, deltas = run(tok, ids, ["User:"])
        assert "".join(deltas) == "Hello there. " and ts.stopped and ts.stop_str == "User:"
        ts, deltas = run(tok, ids, ["User:"], include=True)
        assert "".join(deltas) == "Hello there. User:"


def test_held_prefix_released_when_match_fails(tok):
    ts = TextStream(tok, ["User:"])
    deltas = [ts.push(i) for i in byte_ids(tok, b"Use the")]
    assert deltas == ["", "", "", "Use ", "t", "h", "e"]
    assert ts.finish() == "" and not ts.stopped


def test_finish_releases_held_prefix(tok):
    ts, deltas = run(tok, byte_ids(tok, b"x Us"), ["User:"])
    assert deltas == ["x", " ", "", "", "Us"] and not ts.stopped and ts.stop_str is None


def test_stop_at_very_start(tok):
    for include, want in [(False, ""), (True, "STOP")]:
        ts, deltas = run(tok, tok.encode("STOP and more"), ["STOP"], include)
        assert "".join(deltas) == want and ts.stopped


def test_text_after_stop_in_same_token_is_dropped(tok):
    ids = tok.encode("Hello world")
    assert tok.decode(ids[:1]) == "Hello"
    ts = TextStream(tok, ["ll"])
    assert ts.push(ids[0]) == "He" and ts.stopped
    assert ts.push(ids[1]) == "" and ts.finish() == "" and ts.text == "He"


def test_earliest_ending_stop_wins(tok):
    text = "xabcd"
    for ids in tokenizations(tok, text, random.Random(2)):
        ts, deltas = run(tok, ids, ["abcd", "c"])
        assert "".join(deltas) == "xab" and ts.stop_str == "c"
        ts, deltas = run(tok, ids, ["b", "xab"])  # same end: the longer one
        assert "".join(deltas) == "" and ts.stop_str == "xab"


def test_multibyte_stop_split_into_bytes(tok):
    ts, deltas = run(tok, byte_ids(tok, "你好世界！".encode()), ["世界"])
    assert "".join(deltas) == "你好" and ts.stop_str == "世界"
    assert all(d in ("", "你", "好") for d in deltas)


def test_stop_longer_than_any_token(tok):
    rng = random.Random(3)
    stop = "".join(rng.choice(["ab", "世", " ", "😀", "x"]) for _ in range(300))[:256]
    assert len(stop) == 256 > max(map(len, tok.id_to_token_bytes))
    near_miss = stop[:-1] + "#"
    text = "start " + near_miss + " mid " + stop + " end"
    for ids in tokenizations(tok, text, rng):
        ts = check_stream(tok, ids, [stop])
        assert ts.text == "start " + near_miss + " mid "


def test_many_stops_and_empty_or_str_stop(tok):
    stops = [f"stop{i}" for i in range(16)] + ["", "b\n"]
    ts = check_stream(tok, tok.encode("a stop1 b stop13\n"), stops)
    assert ts.stop_str == "stop1"
    ts, deltas = run(tok, tok.encode("x\n\ny"), "\n\n")  # a bare str is one stop
    assert "".join(deltas) == "x" and ts.stop_str == "\n\n"
    ts, deltas = run(tok, tok.encode("x y"), [""])  # empty stop strings are ignored
    assert "".join(deltas) == "x y" and not ts.stopped


def test_stop_matches_replacement_char_from_finish(tok):
    ts, deltas = run(tok, byte_ids(tok, b"ab\xe4"), ["b\ufffd"])
    assert deltas == ["a", "", "", ""] and ts.stopped and ts.text == "a"


def test_random_stop_strings(tok):
    rng = random.Random("stops")
    for _ in range(400):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 25)))
        stops = ["".join(rng.choice(ALPHABET[:6]) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 4))]
        include = rng.random() < 0.5
        for ids in tokenizations(tok, text, rng):
            check_stream(tok, ids, stops, include)


@HYPOTHESIS
@given(
    st.lists(st.sampled_from(ALPHABET), max_size=30).map("".join),
    st.lists(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=5).map("".join),
             min_size=1, max_size=5),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_hypothesis_stops(tok, text, stops, include, rng):
    data = text.encode()
    if rng.random() < 0.3:  # sprinkle bytes that never complete a char
        data = data.replace(b"b", b"b\xff")
    check_stream(tok, chunk_ids(tok, data, rng), stops, include)


@pytest.mark.timeout(60)  # O(total text) work per token would hang here
def test_long_stream_with_stops_is_not_quadratic(tok):
    ids = tok.encode("User said: no. " * 20_000)
    ts, deltas = run(tok, ids, ["User:", "Assistant:", "x" * 256])
    assert "".join(deltas) == "User said: no. " * 20_000 and not ts.stopped


def test_stop_strings_armed_only_from_min_tokens(tok):
    """Before min_tokens a stop string passes through as text; the first one that ends in the text of token
    min_tokens or later stops (vLLM). Oracle: str.find over the whole text, by where each occurrence ends."""
    rng = random.Random("armed")
    alphabet = ["a", "b", "ab", " ", "ba", "c"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        ids = tok.encode(text)
        min_tokens = rng.randint(0, len(ids) + 1)
        armed_from = len(tok.decode(ids[:max(min_tokens - 1, 0)]))  # chars before the first armed token
        ends = [(i + len(s), -len(s), s) for s in stops for i in range(len(text)) if text.startswith(s, i)
                and i + len(s) > armed_from]
        stream, out = TextStream(tok, stops), []
        for n, token in enumerate(ids, start=1):
            out.append(stream.push(token, armed=n >= min_tokens))
            if stream.stopped:
                break
        out.append(stream.finish())
        if ends:
            end, _, stop = min(ends)
            assert stream.stopped and stream.stop_str == stop, (text, stops, min_tokens)
            assert "".join(out) == text[:end - len(stop)], (text, stops, min_tokens)
        else:
            assert not stream.stopped and "".join(out) == text, (text, stops, min_tokens)

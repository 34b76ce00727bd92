"""engine.tokenizer.WorldTokenizer against the official rwkv TRIE_TOKENIZER."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import rwkv.rwkv_tokenizer as official
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tokenizer import VOCAB_SIZE, WorldTokenizer, measure_throughput

OFFICIAL_VOCAB = Path(official.__file__).parent / "rwkv_vocab_v20230424.txt"
HYPOTHESIS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# st.text() drops surrogates even from an explicit alphabet, hence lists + join.
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
# Emoji with modifiers, variation selectors, ZWJ sequences, flags, keycaps.
EMOJI = [
    "😀", "👍🏽", "❤️", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏿‍💻", "🧑‍🤝‍🧑", "🇯🇵", "🇺🇸", "1️⃣",
    "🐈‍⬛", "👁️‍🗨️", "😶‍🌫️", "🫠", "✨", "\u200d", "\ufe0f",
]
WORDS = ["the", " the", "The", "ing", "tion", "hello", "world", " ", "  ", "\n",
         "\n\n", "\t", ".", ",", "!", "?", "'s", "def", "return", "http://", "://",
         "1234567890", "3.14", "—", "…", "«", "»", "ß", "naïve", "café"]


@pytest.fixture(scope="module")
def tok() -> WorldTokenizer:
    return WorldTokenizer.default()


@pytest.fixture(scope="module")
def oracle() -> official.TRIE_TOKENIZER:
    return official.TRIE_TOKENIZER(str(OFFICIAL_VOCAB))


@pytest.fixture(scope="module")
def vocab_tokens(oracle) -> list[bytes]:
    return [oracle.idx2token[i] for i in sorted(oracle.idx2token)]


# ---------------------------------------------------------------- generators

def _cjk(rng: random.Random) -> str:
    lo, hi = rng.choice([(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3),
                         (0x3000, 0x303F), (0xFF00, 0xFFEF), (0x20000, 0x2A6DF)])
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 40)))


def _emoji(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 12)):
        if rng.random() < 0.7:
            out.append(rng.choice(EMOJI))
        else:
            out.append(chr(rng.randint(0x1F300, 0x1FAFF)))
    return "".join(out)


def _combining(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 20)):
        out.append(rng.choice("aeiouAEIOUnxyzабв"))
        out.extend(chr(rng.randint(0x300, 0x36F)) for _ in range(rng.randint(0, 4)))
    return "".join(out)


def _whitespace(rng: random.Random) -> str:
    runs = [rng.choice(" \t\n\r\u3000\u00a0") * rng.choice([1, 2, 3, 4, 7, 8, 16, 33, 300])
            for _ in range(rng.randint(1, 6))]
    return rng.choice(["", "x", "def f():"]).join(runs)


def _ascii(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
    return "".join(chr(rng.randint(0, 127)) for _ in range(rng.randint(1, 80)))


def _mixed(rng: random.Random) -> str:
    parts = [_cjk, _emoji, _combining, _whitespace, _ascii]
    return "".join(rng.choice(parts)(rng) for _ in range(rng.randint(2, 6)))


def _any_codepoints(rng: random.Random) -> str:
    # Whole Unicode range except surrogates, which str.encode("utf-8") refuses.
    cps = (rng.randint(0, 0x10FFFF) for _ in range(rng.randint(1, 30)))
    return "".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF)


GENERATORS = [_ascii, _cjk, _emoji, _combining, _whitespace, _mixed, _any_codepoints]


def _token_soup(rng: random.Random, vocab: list[bytes]) -> bytes:
    """Concatenated (and truncated) vocab tokens: stresses longest-match choices."""
    out = []
    for _ in range(rng.randint(1, 12)):
        t = rng.choice(vocab)
        out.append(t[: rng.randint(1, len(t))] if rng.random() < 0.3 else t)
    return b"".join(out)


# ---------------------------------------------------------------- equality with the oracle

@pytest.mark.parametrize("gen", GENERATORS, ids=lambda g: g.__name__)
def test_generated_texts_match_official(tok, oracle, gen):
    rng = random.Random(f"tok-{gen.__name__}")
    for _ in range(800):
        text = gen(rng)
        assert tok.encode(text) == oracle.encode(text), repr(text)
        assert tok.decode(tok.encode(text)) == text


def test_token_soup_matches_official(tok, oracle, vocab_tokens):
    rng = random.Random("soup")
    for _ in range(2000):
        data = _token_soup(rng, vocab_tokens)
        assert tok.encode_bytes(data) == oracle.encodeBytes(data), data
        assert tok.decode_bytes(tok.encode_bytes(data)) == data


def test_random_bytes_match_official(tok, oracle):
    rng = random.Random("bytes")
    for _ in range(500):
        data = rng.randbytes(rng.randint(1, 100))
        assert tok.encode_bytes(data) == oracle.encodeBytes(data), data


@pytest.mark.parametrize("n", [1, 20_000])
def test_long_single_words(tok, oracle, n):
    rng = random.Random(n)
    words = [
        "a" * n,
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)),
        "".join(rng.choice("人工智能世界") for _ in range(n)),
        "#" * n + "-",
        " " * n,
        "ab" * (n // 2),
    ]
    for w in words:
        assert tok.encode(w) == oracle.encode(w)


@HYPOTHESIS
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_hypothesis_text(tok, oracle, text):
    ids = tok.encode(text)
    assert ids == oracle.encode(text)
    assert tok.decode(ids) == text


@HYPOTHESIS
@given(st.binary(max_size=200))
def test_hypothesis_bytes(tok, oracle, data):
    assert tok.encode_bytes(data) == oracle.encodeBytes(data)


@HYPOTHESIS
@given(st.data())
def test_hypothesis_token_soup(tok, oracle, vocab_tokens, data):
    picks = data.draw(st.lists(st.integers(0, len(vocab_tokens) - 1), max_size=10))
    parts = [vocab_tokens[i] for i in picks]
    cut = data.draw(st.integers(0, 3))  # drop a few bytes to land mid-token
    blob = b"".join(parts)[: max(0, sum(map(len, parts)) - cut)]
    assert tok.encode_bytes(blob) == oracle.encodeBytes(blob)


# ---------------------------------------------------------------- linear time (tokens, not timings)

@pytest.mark.timeout(60)  # a super-linear encoder would hang here, not fail an assert
def test_200k_char_single_words(tok, oracle):
    rng = random.Random("200k")
    n = 200_000
    for word in (
        "x" * n,
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)),
        "".join(rng.choice("的一是不了人我在有他这为之大来以个中上们") for _ in range(n)),
        "#" * (n - 1) + "x",
    ):
        assert tok.encode(word) == oracle.encode(word)


# ---------------------------------------------------------------- surrogates

@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", "\ud83d\ude00", "x\udc80\ud800y 😀"])
def test_lone_surrogates_become_replacement_char(tok, oracle, text):
    fixed = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    assert tok.encode(text) == oracle.encode(fixed)


@HYPOTHESIS
@given(st.lists(st.characters() | SURROGATES, max_size=50).map("".join))
def test_hypothesis_surrogates_never_raise(tok, oracle, text):
    fixed = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    assert tok.encode(text) == oracle.encode(fixed)


# ---------------------------------------------------------------- API surface

def test_tables_match_official(tok, oracle):
    assert tok.vocab_size == VOCAB_SIZE == 65536
    assert len(tok.id_to_token_bytes) == 65536
    assert tok.eos_token_id == 0
    for i in range(65536):
        assert tok.token_bytes(i) == oracle.idx2token.get(i, b"")


def test_special_and_unused_ids_decode_empty(tok):
    assert tok.decode_bytes([0, 65530, 65535]) == b""
    assert tok.decode([0]) == ""
    assert tok.encode("") == [] and tok.encode_bytes(b"") == []


def test_bad_ids_raise(tok):
    with pytest.raises(ValueError):
        tok.token_bytes(65536)
    with pytest.raises(ValueError):
        tok.token_bytes(-1)
    with pytest.raises(ValueError):
        tok.decode_bytes([5, -1])
    with pytest.raises(IndexError):
        tok.decode_bytes([65536])


def test_decode_replaces_invalid_utf8(tok):
    ids = tok.encode_bytes(b"ok \xff \xe4\xb8")
    assert tok.decode(ids) == "ok \ufffd \ufffd"


def test_encode_bytes_accepts_bytes_like(tok):
    data = "héllo 世界".encode()
    want = tok.encode_bytes(data)
    assert tok.encode_bytes(bytearray(data)) == tok.encode_bytes(memoryview(data)) == want


def test_default_is_cached(tok):
    assert WorldTokenizer.default() is tok


def test_measure_throughput_reports_rates():
    r = measure_throughput(0.05)
    assert set(r) == {"MB/s", "tokens/s"}
    assert r["MB/s"] > 0 and r["tokens/s"] > 0

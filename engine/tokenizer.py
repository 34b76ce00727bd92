"""RWKV World tokenizer (``rwkv_vocab_v20230424``), pure Python.

Encoding is the official greedy longest-match over UTF-8 bytes (the same output
as ``rwkv.rwkv_tokenizer.TRIE_TOKENIZER.encodeBytes`` on every input), run by
the C regex engine instead of a Python loop:

The vocabulary trie is written out as one regex made only of literal bytes and
nested alternations, e.g. tokens ``a``, ``ab``, ``abc``, ``b`` give
``(?:a(?:b(?:c|)|)|b)``.  At every trie node the branches for the child bytes
come first and the empty branch (present only where the node ends a token) comes
last.  Python's ``re`` tries alternatives in order and backtracks, so the first
match it finds at a position is the longest token that starts there: exactly the
greedy choice.  Branches of one node start with distinct bytes, so at most one
of them can get past its first byte.  Every byte value is a token, so
``findall`` matches back to back from position 0 with no gaps.  The pattern has
no repetition operators, so the work per match is bounded by the trie
(tokens are at most 128 bytes): encoding is linear in the input length.
Children are ordered by subtree size (bigger first) because ``re`` scans a
node's branches one by one; this makes frequent paths cheap without changing
the result.

The one-off cost is compiling that regex (~1-2 s), paid once per process by
``WorldTokenizer.default()``.
"""

from __future__ import annotations

import ast
import functools
import re
import time
from bisect import bisect_left
from collections.abc import Iterable
from pathlib import Path

VOCAB_PATH = Path(__file__).resolve().parent / "data" / "rwkv_vocab_v20230424.txt"
EOS_TOKEN_ID = 0
VOCAB_SIZE = 65536  # the model's embedding rows; ids past the file decode to b""
MAX_TOKEN_BYTES = 128

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED = tuple(re.escape(bytes([b])) for b in range(256))


def read_vocab(path: str | Path) -> dict[int, bytes]:
    """Parse ``idx repr(token) nbytes`` lines into {id: token bytes}."""
    vocab: dict[int, bytes] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            first, last = line.index(" "), line.rindex(" ")
            idx = int(line[:first])
            tok = ast.literal_eval(line[first:last].strip())
            if isinstance(tok, str):
                tok = tok.encode("utf-8")
            if not isinstance(tok, bytes) or len(tok) != int(line[last:]):
                raise ValueError(f"bad vocab line {idx}: {line!r}")
            vocab[idx] = tok
    return vocab


def _trie_regex(toks: list[bytes], lo: int, hi: int, depth: int) -> bytes:
    """Regex for the longest token in sorted ``toks[lo:hi]`` (see module doc).

    All of ``toks[lo:hi]`` share their first ``depth`` bytes: they are the
    subtree of one trie node, and sorting makes each child a contiguous run.
    """
    ends_here = len(toks[lo]) == depth  # sorting puts the node's own token first
    if ends_here:
        lo += 1
    runs = []  # (-subtree size, byte, lo, hi) per child
    i = lo
    while i < hi:
        b = toks[i][depth]
        j = hi if b == 255 else bisect_left(toks, toks[i][:depth] + bytes([b + 1]), i, hi)
        runs.append((i - j, b, i, j))
        i = j
    runs.sort()  # bigger subtrees first: re scans a node's branches in order
    alts = [_ESCAPED[b] + _trie_regex(toks, i, j, depth + 1) for _, b, i, j in runs]
    if ends_here:
        if not alts:
            return b""
        alts.append(b"")  # the shorter token is tried only after all longer ones
    if len(alts) == 1:
        return alts[0]
    return b"(?:" + b"|".join(alts) + b")"


def compile_longest_match(tokens: Iterable[bytes]) -> re.Pattern[bytes]:
    """Compile the greedy longest-match regex for a set of tokens.

    ``findall`` on it tokenizes only if every single byte is a token (else it
    would silently skip bytes); ``WorldTokenizer`` checks that.
    """
    toks = sorted(set(tokens))
    return re.compile(_trie_regex(toks, 0, len(toks), 0))


class WorldTokenizer:
    """The RWKV World tokenizer: bytes-level greedy longest match."""

    eos_token_id: int = EOS_TOKEN_ID

    def __init__(self, vocab_path: str | Path) -> None:
        vocab = read_vocab(vocab_path)
        _check_vocab(vocab)
        table = [b""] * VOCAB_SIZE
        for idx, tok in vocab.items():
            table[idx] = tok
        self.id_to_token_bytes: list[bytes] = table
        # Text of each token that is complete UTF-8 on its own, else None; lets
        # incremental detokenization skip the codec for most tokens.
        self.id_to_token_str: list[str | None] = [_try_utf8(t) for t in table]
        self._token_to_id: dict[bytes, int] = {t: i for i, t in vocab.items()}

    def compile_encoder(self) -> WorldTokenizer:
        """Compile the encoder now (a server that encodes, before its first request); returns self."""
        self._findall  # noqa: B018 (the cached property's first read compiles it)
        return self

    @functools.cached_property
    def _findall(self):
        """The longest-match regex, compiled on the first encode (~2 s: a worker that only decodes never pays)."""
        return compile_longest_match(self._token_to_id).findall

    @classmethod
    def default(cls) -> WorldTokenizer:
        """The bundled vocabulary, loaded once per process."""
        return _load_default()

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``.

        Never raises: a lone surrogate (which JSON can carry, but UTF-8 cannot)
        is replaced by U+FFFD before encoding, one U+FFFD per surrogate code
        point (surrogate pairs left in a ``str`` are not joined).
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            data = _SURROGATE.sub("\ufffd", text).encode("utf-8")
        return self.encode_bytes(data)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids for raw bytes (greedy longest match)."""
        if type(data) is not bytes:
            data = bytes(data)
        return list(map(self._token_to_id.__getitem__, self._findall(data)))

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token; ids without a token (0, 65530..) give b""."""
        if not 0 <= token_id < VOCAB_SIZE:
            raise ValueError(f"token id {token_id} out of range")
        return self.id_to_token_bytes[token_id]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = ids if isinstance(ids, list) else list(ids)
        if ids and min(ids) < 0:  # a negative index would silently wrap
            raise ValueError(f"token id {min(ids)} out of range")
        return b"".join([self.id_to_token_bytes[i] for i in ids])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _check_vocab(vocab: dict[int, bytes]) -> None:
    if min(vocab) < 1 or max(vocab) >= VOCAB_SIZE:
        raise ValueError("vocab ids must lie in 1..65535")
    known = set(vocab.values())
    if len(known) != len(vocab):
        raise ValueError("duplicate tokens in vocab")
    missing = [b for b in range(256) if bytes([b]) not in known]
    if missing:  # greedy matching needs a fallback token for every byte
        raise ValueError(f"vocab lacks single-byte tokens {missing[:8]}")
    if max(map(len, known)) > MAX_TOKEN_BYTES:  # bounds the work per token
        raise ValueError("token longer than MAX_TOKEN_BYTES")


def _try_utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@functools.lru_cache(maxsize=1)
def _load_default() -> WorldTokenizer:
    return WorldTokenizer(VOCAB_PATH)


def _bench_corpus() -> str:
    """Fixed mixed text: English, code, CJK, emoji (with ZWJ), accents, spaces."""
    parts = [
        "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?\n",
        "def add(x: int, y: int) -> int:\n    return x + y  # sum\n\n",
        "人工智能正在改变世界，我们需要认真理解它的影响。",
        "日本語のテキストも少し入れておきます。",
        "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ ",
        "Ça va? Naïve café — déjà vu. Привет, мир! Γειά σου κόσμε.\n",
        "\t\t" + " " * 12 + "indented\n",
    ]
    return "".join(parts) * 64


def measure_throughput(seconds: float = 1.0) -> dict:
    """Encode a fixed mixed corpus repeatedly for ``seconds`` on one core.

    Returns {"MB/s": UTF-8 megabytes encoded per second, "tokens/s": ...};
    the one-off vocabulary load / regex compile is not counted.
    """
    tok = WorldTokenizer.default()
    text = _bench_corpus()
    nbytes = len(text.encode("utf-8"))
    done_bytes = done_tokens = 0
    start = time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds or done_bytes == 0:
        done_tokens += len(tok.encode(text))
        done_bytes += nbytes
        elapsed = time.perf_counter() - start
    return {"MB/s": done_bytes / elapsed / 1e6, "tokens/s": done_tokens / elapsed}

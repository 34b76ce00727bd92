"""Constrained decoding with xgrammar: a request's ``structured`` spec → a compiled grammar (cached by spec) →
one matcher per sequence → each step, the sequence's allowed tokens as a bitmask for the sampler.

xgrammar matches over the raw vocabulary: the 65,536 byte strings of the RWKV World vocabulary (ids past the
vocabulary file are empty: never allowed), end of text (token 0) the stop token. A spec (``params.structured``)
is ``{"type": …, "value": …}``:

    json_schema       value: a JSON schema (object, or a JSON string)
    json_object       any JSON object
    regex             value: a regular expression
    choice            value: a list of strings, exactly one of them
    grammar           value: EBNF (GBNF, ``root ::= …``) or, without ``::=``, Lark
    structural_tag    value: an xgrammar structural tag (tool calls, ``api.tools``)

JSON is always compact (no free whitespace between tokens): a model cannot run out its length on spaces, and
``json.loads`` reads every finished output.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.params import spec_key

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (least recently used go first)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of ``choices`` (JSON string literals are valid EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


MIN_SPLIT = 32  # matchers per thread below which a thread hand-off costs more than it saves


class Grammars:
    """Compiles specs (in a thread pool, cached) and makes matchers; one per engine."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int, stop_token_ids: Sequence[int],
                 threads: int = 4):
        import xgrammar as xgr
        self._xgr = xgr
        vocab = [token_bytes[i] if i < len(token_bytes) else b"" for i in range(vocab_size)]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=min(threads, os.cpu_count() or 1))
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 bitmask words per row
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        # the matcher work of a step is split over our own threads (xgrammar releases the GIL): its batch
        # matcher with max_threads > 1 starts threads per call (~0.15 ms, as much as filling 30 rows)
        self._threads = max(1, min(threads, os.cpu_count() or 1))
        self._step_pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="matchers")
        self._local = threading.local()  # a batch matcher per thread

    def submit(self, spec: dict) -> Future:
        """The compiled grammar of ``spec``, compiled once (a failure: ValueError from ``result()``)."""
        key = spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def compile(self, spec: dict):
        return self.submit(spec).result()

    def _compile(self, spec: dict):
        kind, value = spec["type"], spec.get("value")
        c = self.compiler
        try:
            if kind == "json_schema":
                schema = value if isinstance(value, str) else json.dumps(value)
                return c.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(value)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(value))
            if kind == "grammar":
                return c.compile_grammar(value) if "::=" in value else c.compile_lark(value)
            tag = json.loads(value) if isinstance(value, str) else value
            return c.compile_structural_tag(json.dumps(self._compact(tag)))
        except Exception as e:  # xgrammar raises RuntimeError / its own errors for a bad spec
            raise ValueError(f"structured {kind} could not be compiled: {_first_line(e)}") from None

    def _compact(self, node):
        """A structural tag with each JSON schema part as the compact JSON grammar (a structural tag's own JSON
        allows any whitespace, and a model can spend its length on it)."""
        if isinstance(node, list):
            return [self._compact(x) for x in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            schema = node["json_schema"]
            grammar = self._xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                         any_whitespace=False, strict_mode=True)
            return {"type": "grammar", "grammar": str(grammar)}
        return {k: self._compact(v) for k, v in node.items()}

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, out: torch.Tensor, rows: list[int]) -> None:
        """Each matcher's allowed next tokens into its row of ``out`` (int32 [*, words], CPU). A matcher that
        accepted its stop token has no next token: not here."""
        self._run_split(len(matchers), lambda a, b: self._batch_matcher().batch_fill_next_token_bitmask(
            matchers[a:b], out, rows[a:b]))

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token; False where the grammar refused it."""
        accepted: list[bool] = [True] * len(matchers)

        def part(a: int, b: int) -> None:
            accepted[a:b] = self._xgr.BatchGrammarMatcher.batch_accept_token(matchers[a:b], tokens[a:b])
        self._run_split(len(matchers), part)
        return accepted

    def _batch_matcher(self):
        batch = getattr(self._local, "batch", None)
        if batch is None:
            batch = self._local.batch = self._xgr.BatchGrammarMatcher(max_threads=1)
        return batch

    def _run_split(self, n: int, work) -> None:
        """``work(a, b)`` over [0, n) in up to ``threads`` parts of at least MIN_SPLIT, the first on this thread."""
        parts = max(1, min(self._threads, n // MIN_SPLIT))
        if parts == 1:
            if n:
                work(0, n)
            return
        bounds = [n * i // parts for i in range(parts + 1)]
        futures = [self._step_pool.submit(work, bounds[i], bounds[i + 1]) for i in range(1, parts)]
        work(bounds[0], bounds[1])
        for f in futures:
            f.result()


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]

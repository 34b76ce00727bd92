"""Incremental detokenization with stop strings, one ``TextStream`` per sequence.

Bytes -> text: a token may end in the middle of a UTF-8 character.  Undecoded
tail bytes are kept until the character completes; bytes that can never form a
character become U+FFFD right away.  Both follow the stdlib incremental UTF-8
decoder, so the concatenated deltas equal
``decode_bytes(all tokens).decode("utf-8", "replace")``.

Stop strings: an Aho-Corasick automaton over the stop strings is fed the
decoded text one character at a time (jumping over characters that cannot start
a stop string with one regex search).  Its state is the longest suffix of the
text that is still a prefix of some stop string, which is exactly the text that
must be held back.  Work per token is O(len(delta)), never O(total text), and
does not grow with the number of stop strings.

Which stop string wins: the match that *ends* first in the text; on a tie (one
stop string is a suffix of the other) the longer one, i.e. the one that starts
earlier.  This is what a character-by-character stream would see first, so the
result does not depend on how the text happens to be split into tokens.
(vLLM instead takes the first stop string in list order that occurs anywhere
in the newly decoded text.)
"""

from __future__ import annotations

import functools
import re
from codecs import utf_8_decode
from collections.abc import Iterable

from engine.tokenizer import WorldTokenizer


class StopMatcher:
    """Aho-Corasick automaton over a fixed set of stop strings (immutable).

    State 0 is the empty string.  For each state: ``goto`` (char -> state),
    ``fail`` (longest proper suffix that is also a state), ``depth`` (its
    length) and ``match`` (the longest stop string that is a suffix of it, or
    None).  ``first_char`` finds the next character that can start a stop
    string, so runs of irrelevant text are skipped in C.
    """

    __slots__ = ("goto", "fail", "depth", "match", "first_char")

    def __init__(self, stops: Iterable[str]) -> None:
        stops = [s for s in dict.fromkeys(stops) if s]
        if not stops:
            raise ValueError("no non-empty stop strings")
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        own: list[str | None] = [None]
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = goto[state][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[state] + 1)
                    own.append(None)
                state = nxt
            own[state] = stop
        self.goto = goto
        self.depth = depth
        self.fail, self.match = _fail_links(goto, own)
        chars = "".join(sorted({s[0] for s in stops}))
        self.first_char = re.compile("[" + re.escape(chars) + "]")

    def scan(self, state: int, text: str) -> tuple[int, int]:
        """Feed ``text`` from ``state``.

        Returns (state, end): ``end`` is the index in ``text`` just past the
        first completed stop string (``match[state]`` names it), or -1 if none
        completed, in which case ``state`` is where the text left off.
        """
        goto, fail, match = self.goto, self.fail, self.match
        search = self.first_char.search
        i, n = 0, len(text)
        while i < n:
            if state == 0:  # skip text that cannot start a stop string
                hit = search(text, i)
                if hit is None:
                    return 0, -1
                i = hit.start()
            ch = text[i]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            i += 1
            if match[state] is not None:
                return state, i
        return state, -1


def _fail_links(
    goto: list[dict[str, int]], own: list[str | None]
) -> tuple[list[int], list[str | None]]:
    """Breadth-first fail links and the longest stop string ending at each state."""
    fail = [0] * len(goto)
    match = list(own)
    queue = list(goto[0].values())
    for parent in queue:  # the list grows while we walk it: BFS order
        for ch, child in goto[parent].items():
            f = fail[parent]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[child] = goto[f].get(ch, 0)
            if match[child] is None:  # own stop (if any) is the longest suffix
                match[child] = match[fail[child]]
            queue.append(child)
    return fail, match


@functools.lru_cache(maxsize=256)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher | None:
    """Shared automaton for a stop list (requests with n > 1 reuse it)."""
    return StopMatcher(stops) if any(stops) else None


class TextStream:
    """Turns one sequence's token ids into safe text deltas.

    ``push(id)`` returns text that can be shown now; ``finish()`` returns what
    was held back when generation ends without a stop string.  ``text`` is all
    text emitted so far.  After a stop string matched, ``stopped`` is True,
    ``stop_str`` names it and further pushes return "".  Token ids must be in
    ``range(tokenizer.vocab_size)`` (not checked: this is the hot path).
    """

    __slots__ = (
        "_tok_str", "_tok_bytes", "_matcher", "_first_char", "_include_stop", "_tail",
        "_state", "_held", "_pieces", "_done", "stopped", "stop_str",
    )

    def __init__(
        self,
        tokenizer: WorldTokenizer,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tok_str = tokenizer.id_to_token_str
        self._tok_bytes = tokenizer.id_to_token_bytes
        if isinstance(stop, str):  # one stop string, not its characters
            stop = (stop,)
        self._matcher = stop_matcher(tuple(stop))
        self._first_char = self._matcher.first_char.search if self._matcher else None
        self._include_stop = include_stop_str_in_output
        self._tail = b""  # undecoded bytes of an unfinished UTF-8 character
        self._state = 0  # automaton state; its depth == len(self._held)
        self._held = ""  # decoded text that may be the start of a stop string
        self._pieces: list[str] = []
        self._done = False
        self.stopped = False
        self.stop_str: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (joins the deltas: read it at the end, not per token)."""
        pieces = self._pieces
        if len(pieces) > 1:  # join once, so repeated reads stay cheap
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    def push(self, token_id: int, armed: bool = True) -> str:
        """Add one token; return the newly safe text (may be ""). ``armed=False``: a stop string that
        completes in this token's text does not stop (before ``min_tokens``, as vLLM)."""
        if self._done:
            return ""
        tail = self._tail
        if not tail:
            s = self._tok_str[token_id]
            if s is None:  # token is not whole UTF-8 by itself
                s = self._decode(self._tok_bytes[token_id])
        else:
            s = self._decode(tail + self._tok_bytes[token_id])
        if not s:
            return ""
        if self._matcher is None or (self._state == 0 and self._first_char(s) is None):
            # Common case: nothing held back and no character that could start
            # a stop string.
            self._pieces.append(s)
            return s
        return self._feed(s, armed)

    def finish(self) -> str:
        """End of generation: flush the tail (as U+FFFD) and any held text."""
        if self._done:
            return ""
        out = ""
        if self._tail:
            s = self._tail.decode("utf-8", errors="replace")
            self._tail = b""
            if self._matcher is None:
                self._pieces.append(s)
                out = s
            else:
                out = self._feed(s)
        self._done = True
        if self._held and not self.stopped:  # can no longer become a stop string
            out += self._held
            self._pieces.append(self._held)
            self._held = ""
        return out

    def _decode(self, data: bytes) -> str:
        s, used = utf_8_decode(data, "replace", False)
        tail = data[used:]
        if len(tail) == 2 and tail[0] == 0xED and tail[1] >= 0xA0:
            # CPython holds back ED A0..BF (a UTF-8-encoded surrogate, kept for
            # the surrogatepass handler) although it can never become a valid
            # character; both bytes are U+FFFD whatever follows.
            self._tail = b""
            return s + "\ufffd\ufffd"
        self._tail = tail
        return s

    def _feed(self, s: str, armed: bool = True) -> str:
        """Run new text through the stop matcher; return what is safe to emit."""
        matcher = self._matcher
        state, end = matcher.scan(self._state, s)
        if end >= 0 and not armed:  # a match that may not stop yet: pass it on, scan on from there
            delta = self._emit_unmatched(s[:end], state)
            return delta + (self._feed(s[end:], armed) if end < len(s) else "")
        held = self._held
        if end >= 0:
            stop = matcher.match[state]
            window = held + s[:end]  # the stop string ends the window
            delta = window if self._include_stop else window[: len(window) - len(stop)]
            self.stopped, self.stop_str, self._done = True, stop, True
            self._held, self._tail = "", b""
        else:
            return self._emit_unmatched(s, state)
        if delta:
            self._pieces.append(delta)
        return delta

    def _emit_unmatched(self, s: str, state: int) -> str:
        """``s`` scanned to ``state`` without stopping: emit all but what may still begin a stop string."""
        keep = self._matcher.depth[state]
        self._state = state
        window = self._held + s if self._held else s
        if keep:
            delta, self._held = window[:-keep], window[-keep:]
        else:
            delta, self._held = window, ""
        if delta:
            self._pieces.append(delta)
        return delta

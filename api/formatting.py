"""OpenAI response objects from worker results and deltas.

Completions: ``text_completion`` (also for stream chunks); chat: ``chat.completion`` and
``chat.completion.chunk``. Choice ``p * n + j`` is choice ``j`` of prompt ``p``, as OpenAI numbers them.
Worker logprobs arrive as ``[{"token_id", "logprob", "top": [[id, lp], ...]}]`` per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from api.tools import CallStream, call_id, split_calls
from engine.tokenizer import WorldTokenizer
from worker import contract as c

FINISH_ABORT = "abort"  # vLLM's reason for a sequence that was cancelled


@dataclass
class Shape:
    """What formatting needs; all of it is recoverable from stored records for async requests."""
    id: str
    endpoint: str  # completions | chat
    created: int
    model: str
    n: int = 1
    echo_texts: list[str] | None = None  # per prompt, when echo was asked
    include_usage: bool = False
    score_only: bool = False  # completions with max_tokens 0: the echoed prompt and its logprobs, nothing generated
    tools: bool = False  # chat with tools: tool calls are read out of the text (api.tools)

    @property
    def object(self) -> str:
        return "text_completion" if self.endpoint == "completions" else "chat.completion"

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self.endpoint == "completions" else "chat.completion.chunk"


class Formatter:
    def __init__(self, shape: Shape, tokenizer: WorldTokenizer):
        self.shape = shape
        self.tokenizer = tokenizer
        self._offsets: dict[int, int] = {}  # completions text_offset per choice, across chunks
        self._calls: dict[int, CallStream] = {}  # chat with tools: each choice's text split as it streams
        self._num_calls: dict[int, int] = {}

    # -- tokens ------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        table = self.tokenizer.id_to_token_bytes
        return table[token_id] if 0 <= token_id < len(table) else b""

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def logprobs(self, index: int, entries: list[dict] | None, prompt: list[dict] | None = None) -> dict | None:
        """``prompt``: the echoed prompt's entries (completions), placed before the generated ones."""
        if entries is None and prompt is None:
            return None
        if self.shape.endpoint == "chat":
            return {"content": [self._chat_logprob(e) for e in entries or []]}
        return self._completion_logprobs(index, entries or [], prompt)

    def _chat_logprob(self, e: dict) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            data = self.token_bytes(token_id)
            return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}
        return {**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e.get("top") or []]}

    def _completion_logprobs(self, index: int, entries: list[dict], prompt: list[dict] | None) -> dict:
        tokens, offsets, tops = [], [], []

        def add(run: list[dict], offset: int) -> int:
            for e in run:
                token = self.token_str(e["token_id"])
                top = None  # a prompt's first token: nothing predicts it (OpenAI: null)
                if e["logprob"] is not None:
                    top = {self.token_str(t): lp for t, lp in e.get("top") or []}
                    top.setdefault(token, e["logprob"])  # OpenAI: up to logprobs + 1 entries, the chosen included
                tokens.append(token)
                offsets.append(offset)
                tops.append(top)
                offset += len(token)
            return offset

        if prompt is not None:
            add(prompt, 0)
            self._offsets.setdefault(index, self._echo_len(index))  # generated text starts after the echo
        self._offsets[index] = add(entries, self._offsets.get(index, self._echo_len(index)))
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in (prompt or []) + entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _echo_len(self, index: int) -> int:
        echo = self.shape.echo_texts
        return len(echo[index // self.shape.n]) if echo else 0

    # -- whole responses -----------------------------------------------------------------------

    def response(self, results: list[c.Result], prompt_tokens: int) -> dict:
        """The non-streaming object; ``results`` in prompt order."""
        choices = []
        for p, result in enumerate(results):
            for ch in result.choices:
                index = p * self.shape.n + ch.index
                if self.shape.score_only:
                    ch = scored_only(ch)
                text = ch.text
                if self.shape.echo_texts and self.shape.endpoint == "completions":
                    text = self.shape.echo_texts[p] + text
                choices.append(self._final_choice(index, text, ch))
        return {"id": self.shape.id, "object": self.shape.object, "created": self.shape.created,
                "model": self.shape.model, "system_fingerprint": None,
                "choices": sorted(choices, key=lambda x: x["index"]),
                "usage": usage(results, prompt_tokens, self.shape.score_only)}

    def _final_choice(self, index: int, text: str, ch: c.Choice) -> dict:
        out: dict = {"index": index}
        finish = ch.finish_reason or FINISH_ABORT
        if self.shape.endpoint == "chat":
            out["message"] = {"role": "assistant", "content": text}
            if self.shape.tools:  # as the stream of it assembles (chunk): no call markup left in the content
                content, calls = split_calls(text, cut=finish == "length")
                out["message"]["content"] = content if calls else content or ""
                if calls:
                    out["message"]["tool_calls"] = [self._tool_call(index, k, call) for k, call in enumerate(calls)]
                    finish = "tool_calls" if finish == "stop" else finish
        else:
            out["text"] = text
        prompt = ch.prompt_logprobs if self.shape.echo_texts else None
        out["logprobs"] = self.logprobs(index, ch.logprobs, prompt)
        out["finish_reason"] = finish
        out["stop_reason"] = ch.stop_reason
        return out

    def _tool_call(self, index: int, number: int, call: tuple[str, str]) -> dict:
        name, arguments = call
        return {"id": call_id(self.shape.id, index, number), "type": "function",
                "function": {"name": name, "arguments": arguments}}

    # -- stream chunks -----------------------------------------------------------------------

    @staticmethod
    def chunks_of(response: dict, shape: Shape) -> list[dict]:
        """A whole (completions) response as the chunks a stream of it would have sent: one per choice, then
        the usage chunk when asked for."""
        head = {k: response[k] for k in ("id", "created", "model", "system_fingerprint")}
        chunks = [{**head, "object": shape.chunk_object, "choices": [
            {k: ch[k] for k in ("index", "text", "logprobs", "finish_reason")}]} for ch in response["choices"]]
        if shape.include_usage:
            for chunk in chunks:
                chunk["usage"] = None
            chunks.append({**head, "object": shape.chunk_object, "choices": [], "usage": response["usage"]})
        return chunks

    def chunk(self, index: int, text: str, *, logprobs: list[dict] | None = None, finish_reason: str | None = None,
              role: bool = False, prompt_logprobs: list[dict] | None = None) -> dict | None:
        """One choice's chunk; None where it would say nothing (a chat choice with tools while a call's block is
        being written: its text is held back until the call is whole)."""
        choice: dict = {"index": index}
        if self.shape.endpoint == "chat":
            calls: list = []
            if self.shape.tools:
                text, calls = self._calls.setdefault(index, CallStream()).feed(
                    text, final=finish_reason is not None, cut=finish_reason == "length")
                if not (text or calls or role or finish_reason or logprobs):
                    return None
            delta: dict = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            if calls:
                first = self._num_calls.get(index, 0)
                self._num_calls[index] = first + len(calls)
                delta["tool_calls"] = [{"index": first + k, **self._tool_call(index, first + k, call)}
                                       for k, call in enumerate(calls)]
            if finish_reason == "stop" and self._num_calls.get(index):
                finish_reason = "tool_calls"
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(index, logprobs, prompt_logprobs)
        choice["finish_reason"] = finish_reason
        return self._chunk([choice])

    def usage_chunk(self, results: list[c.Result], prompt_tokens: int) -> dict:
        out = self._chunk([])
        out["usage"] = usage(results, prompt_tokens)
        return out

    def _chunk(self, choices: list[dict]) -> dict:
        out = {"id": self.shape.id, "object": self.shape.chunk_object, "created": self.shape.created,
               "model": self.shape.model, "system_fingerprint": None, "choices": choices}
        if self.shape.include_usage:
            out["usage"] = None
        return out


def scored_only(ch: c.Choice) -> c.Choice:
    """A score-only choice: the one token generated to get the prompt scored is dropped."""
    return replace(ch, text="", token_ids=[], finish_reason="length", stop_reason=None,
                   logprobs=[] if ch.logprobs is not None else None)


def usage(results: list[c.Result], prompt_tokens: int, score_only: bool = False) -> dict:
    completion = 0 if score_only else sum(len(ch.token_ids) for r in results for ch in r.choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)}}

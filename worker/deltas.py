"""A request's outputs of one write as its delta message (the queue contract's "delta"; see worker/contract.py).

One message per request per write: the outputs of every step the write covers, merged per choice, with where
each choice's entry starts (``offset`` in tokens, ``text_offset`` in characters) so readers can detect gaps and
skip repeats. The common case (one choice, no logprobs) is formatted without building dicts.
"""

from __future__ import annotations

from worker import contract as c
from worker.results import logprob_dicts


def delta_choice(flight, out) -> dict:
    """One engine SequenceOutput of ``flight`` as a delta message's choice entry."""
    choice = {"index": out.index, "text": out.text, "token_ids": out.token_ids}
    if flight.wants_logprobs and out.logprobs:
        choice["logprobs"] = logprob_dicts(out.logprobs)
    if out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = logprob_dicts(out.prompt_logprobs)
    if out.finished:
        choice["finish_reason"], choice["stop_reason"] = out.finish_reason, out.stop_reason
    return choice


def merged_delta(flight, outs: list) -> bytes:
    """The delta message of ``flight``'s outputs ``outs`` (in step order): one entry per choice."""
    if flight.simple:
        last = outs[-1]
        tail = (b',"finish_reason":%s,"stop_reason":%s' % (c.dumps(last.finish_reason), c.dumps(last.stop_reason))
                if last.finished else b"")
        text = "".join([out.text for out in outs])
        tokens = [t for out in outs for t in out.token_ids]
        return simple_delta(flight, text, tokens, tail)
    by_index: dict[int, dict] = {}
    for out in outs:
        merge_choice(by_index, delta_choice(flight, out))
    for i, choice in by_index.items():  # where this delta starts in the choice's tokens and text
        choice["offset"] = len(flight.choices[i].token_ids) - len(choice["token_ids"])
        choice["text_offset"] = flight.text_len[i] - len(choice["text"])
    return c.delta_message(flight.id, list(by_index.values()), flight.delta_head)


def simple_delta(flight, text: str, tokens: list[int], tail: bytes = b"") -> bytes:
    """The delta message of a one-choice request without logprobs whose outputs so far end with these."""
    return b'%s[{"index":0,"text":%s,"token_ids":%s,"offset":%d,"text_offset":%d%s}]}' % (
        flight.delta_head, c.dumps(text), c.dumps(tokens), len(flight.choices[0].token_ids) - len(tokens),
        flight.text_len[0] - len(text), tail)


def merge_choice(by_index: dict[int, dict], choice: dict) -> None:
    """Append ``choice`` to the same index's earlier delta: text and token_ids concatenated, logprobs
    concatenated (one entry per token), finish_reason and stop_reason of the last."""
    prev = by_index.get(choice["index"])
    if prev is None:
        by_index[choice["index"]] = choice
        return
    prev["text"] += choice["text"]
    prev["token_ids"] = prev["token_ids"] + choice["token_ids"]
    if "logprobs" in choice:
        prev["logprobs"] = prev.get("logprobs", []) + choice["logprobs"]
    if "prompt_logprobs" in choice:
        prev["prompt_logprobs"] = choice["prompt_logprobs"]
    if "finish_reason" in choice:
        prev["finish_reason"], prev["stop_reason"] = choice["finish_reason"], choice["stop_reason"]

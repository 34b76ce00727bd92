"""Per-request accumulation of engine outputs into stream deltas and the final result."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from worker import contract as c
from worker.contract import STATUS_COMPLETED, Choice, QueuedRequest, Result


@dataclass(eq=False)  # identity semantics: compared and hashed per object
class InFlight:
    """A request this worker owns: where its stream entry is, and what it produced so far."""
    request: QueuedRequest
    stream: str
    entry_id: bytes
    received: float = field(default_factory=time.time)
    read_at: float | None = None  # when the reader had its entry (the loop took it at ``received``)
    first_token: float | None = None
    last_token: float | None = None  # when the engine ended its last choice (the step's time, not the writer's)
    choices: list[Choice] = field(init=False)
    text_parts: list[list[str]] = field(init=False)
    num_prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache
    suppress_tokens: int = 0  # after a retry: tokens already published once
    # Threads: the step thread creates it and counts ``unfinished`` down; once handed to the writer thread
    # (a "start" op) only the writer folds outputs in and reads them (see RedisIO), until it ends the request.

    def __post_init__(self) -> None:
        req = self.request
        self.choices = [Choice(index=i) for i in range(req.n)]
        self.text_parts = [[] for _ in range(req.n)]
        self.text_len = [0] * req.n  # characters generated per choice: deltas carry offsets from these
        self.num_prompt_tokens = len(req.prompt_token_ids) or 1
        self.wants_logprobs = req.params.get("logprobs") is not None
        self.wants_prompt_logprobs = req.params.get("prompt_logprobs") is not None
        self.unfinished = req.n  # choices the engine has not finished (step thread only)
        self.publishes = req.stream or req.record_text  # its outputs are published or appended
        self.watched = False  # async (record_text) requests: an /events stream watches it (reader thread sets it)
        self.simple = (req.stream and req.n == 1 and not self.wants_logprobs and not self.wants_prompt_logprobs
                       and not req.record_text)
        # read by the writer thread, made once here
        self.channel = c.channel_of(req)
        self.delta_head = c.delta_head(req.id)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def is_done(self) -> bool:
        return all(ch.finish_reason is not None for ch in self.choices)

    def add(self, out, now: float) -> bool:
        """Fold one engine SequenceOutput of the step at ``now`` in; False if it must not be published (it
        already was, before a retry). Hot path (once per sequence per step): keep it lean."""
        choice = self.choices[out.index]
        if self.first_token is None:
            self.first_token = now
        position = len(choice.token_ids)
        if position == 0 and out.num_cached_tokens > self.cached_tokens:  # n > 1: the lead's (forks report 0)
            self.cached_tokens = out.num_cached_tokens
        choice.token_ids += out.token_ids
        self.text_parts[out.index].append(out.text)
        self.text_len[out.index] += len(out.text)
        if self.wants_logprobs and out.logprobs:
            choice.logprobs = (choice.logprobs or []) + logprob_dicts(out.logprobs)
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = logprob_dicts(out.prompt_logprobs)
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            self.last_token = now
            return True
        return position >= self.suppress_tokens

    def result(self, worker: str) -> Result:
        for choice, parts in zip(self.choices, self.text_parts):
            choice.text = "".join(parts)
        # finished when the engine ended it: the writer folds a step's outputs later (after the next launch)
        now = self.last_token if self.is_done and self.last_token is not None else time.time()
        req = self.request
        timings = {"queued_s": round(self.received - req.created, 6),
                   "ttft_s": round((self.first_token or now) - req.created, 6), "e2e_s": round(now - req.created, 6)}
        added = c.entry_time(self.entry_id)
        if added is not None:
            timings["added_s"] = round(added - req.created, 6)
        if self.read_at is not None:
            timings["read_s"] = round(self.read_at - req.created, 6)
        return Result(
            id=req.id, status=STATUS_COMPLETED, endpoint=req.endpoint, model=req.model, tenant=req.tenant,
            created=req.created, finished=now, choices=self.choices, prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.cached_tokens, completion_tokens=sum(len(ch.token_ids) for ch in self.choices), worker=worker, meta=req.meta,
            timings=timings)


def logprob_dicts(logprobs) -> list[dict]:
    """engine TokenLogprob entries -> the contract's [{"token_id", "logprob", "top"}]."""
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in logprobs]

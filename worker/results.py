"""Per-request accumulation of engine outputs into stream deltas and the final result."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from worker.contract import STATUS_COMPLETED, Choice, QueuedRequest, Result


@dataclass(eq=False)  # identity semantics: compared and hashed per object
class InFlight:
    """A request this worker owns: where its stream entry is, and what it produced so far."""
    request: QueuedRequest
    stream: str
    entry_id: bytes
    received: float = field(default_factory=time.time)
    first_token: float | None = None
    choices: list[Choice] = field(init=False)
    text_parts: list[list[str]] = field(init=False)
    num_prompt_tokens: int = 0
    suppress_tokens: int = 0  # after a retry: tokens already published once

    def __post_init__(self) -> None:
        self.choices = [Choice(index=i) for i in range(self.request.n)]
        self.text_parts = [[] for _ in range(self.request.n)]
        self.num_prompt_tokens = len(self.request.prompt_token_ids) or 1
        self.wants_logprobs = self.request.params.get("logprobs") is not None

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def is_done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def add(self, out) -> dict | None:
        """Fold one engine SequenceOutput in; returns the delta to publish (or None). Hot path: keep it lean."""
        choice = self.choices[out.index]
        if self.first_token is None:
            self.first_token = time.time()
        position = len(choice.token_ids)
        choice.token_ids += out.token_ids
        self.text_parts[out.index].append(out.text)
        delta = {"index": out.index, "text": out.text, "token_ids": out.token_ids}
        if self.wants_logprobs and out.logprobs:
            logprobs = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in out.logprobs]
            choice.logprobs = (choice.logprobs or []) + logprobs
            delta["logprobs"] = logprobs
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            delta["finish_reason"], delta["stop_reason"] = out.finish_reason, out.stop_reason
        elif position < self.suppress_tokens:
            return None  # already published before the retry
        return delta

    def result(self, worker: str) -> Result:
        for choice, parts in zip(self.choices, self.text_parts):
            choice.text = "".join(parts)
        now = time.time()
        req = self.request
        return Result(
            id=req.id, status=STATUS_COMPLETED, endpoint=req.endpoint, model=req.model, tenant=req.tenant,
            created=req.created, finished=now, choices=self.choices, prompt_tokens=self.num_prompt_tokens,
            completion_tokens=sum(len(c.token_ids) for c in self.choices), worker=worker, meta=req.meta,
            timings={"queued_s": round(self.received - req.created, 6),
                     "ttft_s": round((self.first_token or now) - req.created, 6),
                     "e2e_s": round(now - req.created, 6)})

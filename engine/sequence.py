"""Requests, sequences and per-step outputs (plain Python, no torch)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.params import SamplingParams


@dataclass
class Request:
    """What the engine is asked to do: one prompt, ``n`` independent continuations."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # lower first among the waiting (the worker: 0 interactive, 1 batch lines)


class Status(Enum):
    WAITING = "waiting"  # queued, holds no slot
    PREFILLING = "prefilling"  # holds a slot, prompt partly consumed
    FORK_PENDING = "fork_pending"  # n > 1 sibling: holds a slot, waits for the shared prefill
    RUNNING = "running"  # decoding
    FINISHED = "finished"


_FINISHED = Status.FINISHED


class FinishReason(str, Enum):
    STOP = "stop"  # end-of-text, stop string or stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing before it predicts it)
    top: list[tuple[int, float]]


@dataclass(slots=True)  # one a token a step: slots make it ~25% cheaper to build
class SequenceOutput:
    """What one step produced for one sequence (a choice of a request)."""
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # with a sequence's first token, when asked for
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache, not a prefill


class Sequence:
    """One continuation: owns a state slot while it holds one."""

    def __init__(self, request: Request, index: int, text_stream):
        self.request = request
        self.request_id = request.request_id
        self.index = index
        self.params = request.params
        self.prompt_token_ids = request.prompt_token_ids
        self.num_prefilled = 0
        self.output_token_ids: list[int] = []
        self.text_stream = text_stream
        self.status = Status.WAITING
        self.slot: int | None = None
        self.seed: int = 0
        self.siblings: list[Sequence] = []  # n > 1: the sequences that fork off this one's prefill
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list[TokenLogprob] = []  # filled chunk by chunk when params.prompt_logprobs is set
        self.num_launched = 0  # tokens sampled on the device (ahead of output_token_ids by a step when overlapped)
        self.max_output_tokens = request.params.max_tokens  # the engine caps it by max_model_len
        self.matcher = None  # constrained decoding: its xgrammar matcher (engine.grammar), fed each token
        self.grammar_rejected = False  # a token the matcher refused (a bug if it happens): the sequence ends
        # the prefix cache (engine.prefix_cache): prompt tokens taken from a checkpoint instead of prefilled, the
        # checkpoint (restored into the slot on admission), and where the first chunk ends to make one
        self.num_cached_tokens = 0
        self.checkpoint = None
        self.split_at: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_remaining_prompt(self) -> int:
        return self.num_prompt_tokens - self.num_prefilled

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED  # a module constant: Status.FINISHED is a ~0.2 µs lookup, 2× a token

    @property
    def wants_decode(self) -> bool:
        """Running and not yet at its length limit counting the tokens already launched (an overlapped step's
        results arrive a step late: without this, a sequence at max_tokens would be decoded once more)."""
        return self.num_launched < self.max_output_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, {self.status.value}, slot={self.slot}, "
                f"prefilled={self.num_prefilled}/{self.num_prompt_tokens}, out={len(self.output_token_ids)})")

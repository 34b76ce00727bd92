"""A validated API call ("job"): its queued requests (one per prompt) and the shape of its response."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from api.errors import bad_request, model_not_found
from api.formatting import Shape
from api.limits import Limits
from api.prompts import Prompt, completion_prompts, encode, fit_lengths, render_chat
from api.sampling import Draft, chat_draft, completion_draft, final_params
from api.schemas import ChatCompletionRequest, CompletionRequest
from api import tools
from api.settings import Settings
from api.structured import Constraint, constraint_of
from api.unsupported import CHAT_RULES, COMPLETION_RULES, MESSAGE_RULES, check_fields
from engine.params import SamplingParams
from engine.tokenizer import WorldTokenizer
from worker import contract as c

DEADLINE_GRACE_S = 5.0  # sync requests: workers drop them a little after the API stopped waiting


@dataclass
class Job:
    shape: Shape
    tenant: str
    prompts: list[Prompt]
    requests: list[c.QueuedRequest]
    stream: bool
    started: float = field(default_factory=time.monotonic)
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._index = {r.id: i for i, r in enumerate(self.requests)}

    @property
    def id(self) -> str:
        return self.shape.id

    @property
    def endpoint(self) -> str:
        return self.shape.endpoint

    @property
    def request_ids(self) -> list[str]:
        return [r.id for r in self.requests]

    @property
    def prompt_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prompts)

    def prompt_index(self, request_id: str) -> int:
        return self._index[request_id]


async def completion_job(body: CompletionRequest, tenant: str, settings: Settings, tokenizer: WorldTokenizer,
                         limits: Limits, is_async: bool = False) -> Job:
    check_model(body.model, settings)
    check_fields(body, COMPLETION_RULES, "completions")
    n = _check_n(body.n, limits)
    if body.best_of is not None and body.best_of != n:
        raise bad_request(f"best_of is not supported: it must equal n ({n}), got {body.best_of}", "best_of",
                          "unsupported_field")
    _check_sequences(_num_prompts(body.prompt) * n, settings)
    prompts = await completion_prompts(body.prompt, tokenizer, limits.vocab_size)
    if is_async and len(prompts) > 1:
        raise bad_request("an async request takes one prompt; submit one request per prompt", "prompt")
    score_only = body.max_tokens == 0
    if score_only and not body.echo:
        raise bad_request("max_tokens 0 scores the prompt alone: it needs echo true (and logprobs for the "
                          "scores)", "max_tokens")
    draft = completion_draft(body)
    _constrain(draft, constraint_of(body))
    max_tokens = fit_lengths(prompts, draft.max_tokens, limits, explicit=body.max_tokens is not None)
    params = final_params(draft, max_tokens, limits)
    shape = Shape(id=c.new_request_id("cmpl"), endpoint="completions", created=int(time.time()),
                  model=settings.model_name, n=n, echo_texts=[p.text for p in prompts] if body.echo else None,
                  include_usage=_include_usage(body), score_only=score_only)
    return _job(shape, tenant, prompts, params, bool(body.stream), is_async, settings)


async def chat_job(body: ChatCompletionRequest, tenant: str, settings: Settings, tokenizer: WorldTokenizer,
                   limits: Limits, is_async: bool = False) -> Job:
    check_model(body.model, settings)
    check_fields(body, CHAT_RULES, "chat")
    for i, message in enumerate(body.messages):
        check_fields(message, MESSAGE_RULES, "chat", f"messages[{i}].")
    n = _check_n(body.n, limits)
    _check_sequences(n, settings)
    add_generation_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
    # the tools' and response_format's schema checks run off the event loop (128 tools' schemas take a while)
    tool_plan = await asyncio.to_thread(tools.plan, body.tools, body.tool_choice, body.parallel_tool_calls) \
        if body.tools else tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = await asyncio.to_thread(constraint_of, body) if body.response_format is not None \
        else constraint_of(body)
    if tool_plan.constraint is not None and constraint is not None:
        raise bad_request("response_format or structured_outputs together with tools is not supported: use "
                          "tool_choice none, or a tool for the structured answer", "response_format",
                          "unsupported_field")
    text = render_chat(body.messages, settings, add_generation_prompt, tool_plan.prompt)
    prompts = [Prompt(await encode(tokenizer, text), text)]
    draft = chat_draft(body, settings.default_chat_max_tokens, settings.chat_default_stop)
    if tool_plan.constraint is not None:
        constraint = Constraint(tool_plan.constraint, "tools")
    _constrain(draft, constraint)
    explicit = body.max_completion_tokens is not None or body.max_tokens is not None
    max_tokens = fit_lengths(prompts, draft.max_tokens, limits, explicit)
    params = final_params(draft, max_tokens, limits)
    shape = Shape(id=c.new_request_id("chatcmpl"), endpoint="chat", created=int(time.time()),
                  model=settings.model_name, n=n, include_usage=_include_usage(body), tools=tool_plan.parse)
    return _job(shape, tenant, prompts, params, bool(body.stream), is_async, settings)


def check_model(model: str | None, settings: Settings) -> None:
    if not settings.serves(model):
        raise model_not_found(model)


def _constrain(draft: Draft, constraint: Constraint | None) -> None:
    if constraint is not None:
        draft.set("structured", constraint.spec, constraint.param)


def _check_n(n: int | None, limits: Limits) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= limits.max_n:
        raise bad_request(f"n must be between 1 and {limits.max_n}, got {n}", "n")
    return n


def _num_prompts(prompt) -> int:
    """A string or a token list is one prompt; a list of strings or of token lists is one each."""
    return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)


def _check_sequences(count: int, settings: Settings) -> None:
    """One call may not queue more than max_sequences_per_call sequences (prompts × n): a bound on what a single
    call can put ahead of everyone else's."""
    if count > settings.max_sequences_per_call:
        raise bad_request(f"this call asks for {count} sequences (prompts × n); the limit per call is "
                          f"{settings.max_sequences_per_call}: split it into several calls or use the Batch API",
                          "prompt", code="too_many_sequences")


def _meta(shape: Shape, prompt: Prompt) -> dict:
    """What formatting needs back with the result (async requests and batch lines are formatted from it)."""
    meta: dict = {"echo": prompt.text} if shape.echo_texts else {}
    if shape.score_only:
        meta["score_only"] = True
    if shape.tools:
        meta["tools"] = True
    return meta


def _include_usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _job(shape: Shape, tenant: str, prompts: list[Prompt], params: list[SamplingParams], stream: bool,
         is_async: bool, settings: Settings) -> Job:
    """The queued requests, one per prompt, each with its final (checked) parameters."""
    created = time.time()
    ids = [shape.id] if len(prompts) == 1 else [f"{shape.id}-{i}" for i in range(len(prompts))]
    deadline = 0.0 if is_async else created + settings.request_timeout_s + DEADLINE_GRACE_S
    requests = [
        c.QueuedRequest(id=rid, prompt_token_ids=p.token_ids, params=sp.to_wire(), n=shape.n,
                        endpoint=shape.endpoint, model=shape.model, tenant=tenant,
                        stream=stream or is_async, record_text=is_async, created=created, deadline=deadline,
                        meta=_meta(shape, p))
        for rid, p, sp in zip(ids, prompts, params)]
    return Job(shape, tenant, prompts, requests, stream=stream and not is_async)

"""Request fields -> the request's SamplingParams, built once the request is final and checked there.

The body's fields are gathered first (a ``Draft``, unchecked); once max_tokens is fitted to the context and the
constraint set, ``final_params`` builds the SamplingParams, which checks every limit (``engine.params``: each
written once, the same check a worker runs on the queue entry). A limit broken is a 400 naming the field as the
client wrote it, before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api.errors import OpenAIError, bad_request
from api.limits import Limits
from api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.params import ParamError, SamplingParams, token_id_of
from worker import contract as c

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's


@dataclass
class Draft:
    """A request's sampling fields before max_tokens is fitted: SamplingParams' arguments, not checked yet."""
    fields: dict
    params: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> the request's, where they differ

    @property
    def max_tokens(self) -> int:
        return self.fields["max_tokens"]

    def set(self, name: str, value: object, param: str) -> None:
        """Set a field that came from the request's ``param``."""
        self.fields[name] = value
        self.params[name] = param


def completion_draft(body: CompletionRequest) -> Draft:
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens or 1  # 0: score only
    draft = _common(body, max_tokens)
    draft.fields["logprobs"] = body.logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt comes with its logprobs (OpenAI)
        draft.set("prompt_logprobs", body.logprobs, "logprobs")
    return draft


def chat_draft(body: ChatCompletionRequest, default_max_tokens: int, default_stop: list[str]) -> Draft:
    given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    draft = _common(body, default_max_tokens if given is None else given)
    if body.max_completion_tokens is not None:
        draft.params["max_tokens"] = "max_completion_tokens"
    draft.fields["stop"] = list(dict.fromkeys(draft.fields["stop"] + default_stop))
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    if body.logprobs:
        draft.set("logprobs", body.top_logprobs or 0, "top_logprobs")
    else:
        draft.fields["logprobs"] = None
    return draft


def _common(body: SamplingFields, max_tokens: int) -> Draft:
    return Draft({
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens or 0,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0,
        "min_p": body.min_p or 0.0,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": _logit_bias(body.logit_bias or {}),
        "seed": body.seed,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        "stop_token_ids": list(body.stop_token_ids or []),
        "include_stop_str_in_output": bool(body.include_stop_str_in_output),
        "ignore_eos": bool(body.ignore_eos),
        "state": body.state,
    })


def _logit_bias(given: dict[str, float]) -> dict[int, float]:
    """JSON keys are strings: the token ids they write (their range and vocabulary are checked with the rest)."""
    out = {}
    for key, bias in given.items():
        token_id = token_id_of(key.strip())
        if token_id is None:
            raise bad_request(f"logit_bias keys must be token ids written in digits, got {key!r}", "logit_bias")
        out[token_id] = bias
    return out


def final_params(draft: Draft, max_tokens: list[int], limits: Limits) -> list[SamplingParams]:
    """Each prompt's SamplingParams with its fitted max_tokens, built (so checked) once per distinct value, token
    ids against the live workers' smallest vocabulary and an initial state against those every live worker
    holds; a 400 naming the field otherwise."""
    built: dict[int, SamplingParams] = {}
    for m in max_tokens:
        if m not in built:
            built[m] = _built(draft, m, limits.vocab_size)
    state = draft.fields.get("state")
    uploaded = isinstance(state, str) and state.startswith(c.UPLOADED_STATE_PREFIX)  # its worker checks it
    if state is not None and not uploaded and limits.states is not None and state not in limits.states:
        held = ", ".join(sorted(limits.states)) or "none (start workers with --state NAME=FILE, or upload one)"
        raise bad_request(f"state {state!r} is not an initial state the workers hold; they hold: {held}", "state",
                          "unknown_state")
    return [built[m] for m in max_tokens]


def _built(draft: Draft, max_tokens: int, vocab_size: int) -> SamplingParams:
    try:
        params = SamplingParams(**{**draft.fields, "max_tokens": max_tokens})
        params.check_vocabulary(vocab_size)
    except ParamError as e:
        raise _refusal(e, draft, max_tokens) from None
    return params


def _refusal(e: ParamError, draft: Draft, max_tokens: int) -> OpenAIError:
    """The 400 for a broken limit, naming the request's field (and where max_tokens came from if it was fitted)."""
    param = draft.params.get(e.field, e.field)
    message = str(e) if param == e.field else f"{param}: {e}"
    if e.field == "min_tokens" and max_tokens < draft.max_tokens:
        message += f"; without max_tokens a request gets what the context leaves after its prompt: {max_tokens}"
    return bad_request(message, param)

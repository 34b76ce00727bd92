"""Request fields -> the ``params`` dict of a queued request, validated by the engine's own rules."""

from __future__ import annotations

import re

from api.errors import bad_request
from api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.params import SamplingParams

_FIELD = re.compile(r"^(?:each )?([a-z_]+)")


def completion_params(body: CompletionRequest, vocab_size: int) -> dict:
    max_tokens = 16 if body.max_tokens is None else max(body.max_tokens, 1)  # 0 (score only) runs 1, dropped
    params = _common(body, max_tokens, vocab_size)
    params["logprobs"] = body.logprobs
    return _validated(params, vocab_size)


def chat_params(body: ChatCompletionRequest, default_max_tokens: int, default_stop: list[str],
                vocab_size: int) -> dict:
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    params = _common(body, max_tokens, vocab_size)
    params["stop"] = list(dict.fromkeys(params["stop"] + default_stop))
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    params["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    return _validated(params, vocab_size, logprobs_param="top_logprobs" if body.logprobs else "logprobs")


def _common(body: SamplingFields, max_tokens: int, vocab_size: int) -> dict:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    logit_bias = {}
    for key, bias in (body.logit_bias or {}).items():
        token = key.strip()
        if not (token.isascii() and token.isdigit()) or int(token) >= vocab_size:  # "²".isdigit() too
            raise bad_request(f"logit_bias keys must be token ids 0..{vocab_size - 1} as strings, got {key!r}",
                              "logit_bias")
        logit_bias[str(int(token))] = bias  # str keys: the params travel as JSON
    out = {
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens or 0,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0,
        "min_p": body.min_p or 0.0,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": logit_bias,
        "seed": body.seed,
        "stop": stop,
        "stop_token_ids": list(body.stop_token_ids or []),
        "include_stop_str_in_output": bool(body.include_stop_str_in_output),
        "ignore_eos": bool(body.ignore_eos),
    }
    if out["top_k"] == -1:
        out["top_k"] = 0
    return out


def _validated(params: dict, vocab_size: int, logprobs_param: str = "logprobs") -> dict:
    try:
        SamplingParams(**params).validate(vocab_size=vocab_size)
    except ValueError as e:
        message = str(e)
        match = _FIELD.match(message)
        param = match.group(1) if match and match.group(1) in SamplingParams.__dataclass_fields__ else None
        if param == "logprobs":
            param = logprobs_param
        raise bad_request(message, param) from None
    return params

"""Request bodies (OpenAI fields plus vLLM's extensions). Unknown fields are ignored; types are strict.

Ranges here keep values sane and JSON-safe and document them in the OpenAPI schema; the engine's
``SamplingParams.validate`` then has the last word (cross-field rules, vocabulary).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.params import MAX_LOGPROBS

_SURROGATE = re.compile("[\ud800-\udfff]")
INT32 = 2**31 - 1


def _scrub(text: str) -> str:
    """JSON can carry lone surrogates, UTF-8 cannot: make them U+FFFD once, here."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


Text = Annotated[str, AfterValidator(_scrub)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]  # vocabulary bound checked with the tokenizer
Count = Annotated[int, Field(ge=0, le=INT32)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # accepted, not implemented


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""
    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    user: Text | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1, le=INT32)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    stop_token_ids: list[TokenId] | None = None


class CompletionRequest(SamplingFields):
    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool | None = True


class AsyncCompletionRequest(CompletionRequest):
    endpoint: Literal["completions"]


class AsyncChatRequest(ChatCompletionRequest):
    endpoint: Literal["chat"]


AsyncRequest = Annotated[AsyncCompletionRequest | AsyncChatRequest, Field(discriminator="endpoint")]

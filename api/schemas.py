"""Request bodies (OpenAI fields plus vLLM's extensions). Types are strict. Fields OpenAI defines and Gaggle
does not implement are declared loosely (``Any``) so that ``api.unsupported`` can answer them with a 400 naming
them; unknown fields are kept aside (``model_extra``) to be logged once, then ignored.

Types are checked here; the sampling fields' ranges only documented (``documented``): they are checked once, with
every other limit, when the request's SamplingParams is built (``api.sampling``, limits in ``engine.params``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from engine.params import LOGIT_BIAS, MAX_TOKEN_ID, RANGES, TOKEN_IDS, Range

_SURROGATE = re.compile("[\ud800-\udfff]")
INT32 = MAX_TOKEN_ID


def _scrub(text: str) -> str:
    """JSON can carry lone surrogates, UTF-8 cannot: make them U+FFFD once, here."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


Text = Annotated[str, AfterValidator(_scrub)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]  # a prompt's: vocabulary bound checked with the tokenizer


def documented(limit: Range) -> FieldInfo:
    """The OpenAPI schema's bounds of a field that SamplingParams checks (not checked here: once, there)."""
    return Field(json_schema_extra=limit.json_schema())


def ranged(name: str) -> FieldInfo:
    return documented(RANGES[name])


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # always compact here: see README


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # accepted, not implemented


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""
    model: Text | None = None
    n: int | None = 1  # up to the live workers' slots (api.limits)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, ranged("max_tokens")] | None = None
    temperature: Annotated[float, ranged("temperature")] | None = None
    top_p: Annotated[float, ranged("top_p")] | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: Annotated[float, ranged("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, ranged("frequency_penalty")] | None = None
    logit_bias: dict[str, Annotated[float, documented(LOGIT_BIAS)]] | None = None
    seed: Annotated[int, ranged("seed")] | None = None
    user: Text | None = None
    # vLLM extensions
    top_k: Annotated[int, ranged("top_k")] | None = None
    min_p: Annotated[float, ranged("min_p")] | None = None
    repetition_penalty: Annotated[float, ranged("repetition_penalty")] | None = None
    min_tokens: Annotated[int, ranged("min_tokens")] | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    stop_token_ids: list[Annotated[int, documented(TOKEN_IDS)]] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    state: Text | None = None  # Gaggle: start from this named initial state (a worker's --state NAME=FILE)
    # hints that cannot change an answer: accepted (README, "Fields")
    metadata: dict[str, Text] | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    # defined by OpenAI, not implemented: refused by api.unsupported when they carry a value
    store: Any = None
    service_tier: Any = None


class CompletionRequest(SamplingFields):
    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: score the prompt (echo) only; else as ranged
    logprobs: Annotated[int, ranged("logprobs")] | None = None
    echo: bool | None = False
    best_of: int | None = None  # must equal n
    suffix: Any = None


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Text
    arguments: Text


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # required but for the assistant's (a turn of tool calls has none): checked below, as OpenAI does
    content: Annotated[Text | list[TextPart] | None, Field(validate_default=True)] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: Text | None = None  # tool
    # defined by OpenAI, not implemented (api.unsupported)
    audio: Any = None
    refusal: Any = None
    function_call: Any = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing", "Field required (a {role} message needs content)", {"role": role})
        return content


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, ranged("max_tokens")] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, ranged("logprobs")] | None = None
    add_generation_prompt: bool | None = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # defined by OpenAI, not implemented (api.unsupported)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None


class AsyncCompletionRequest(CompletionRequest):
    endpoint: Literal["completions"]


class AsyncChatRequest(ChatCompletionRequest):
    endpoint: Literal["chat"]


AsyncRequest = Annotated[AsyncCompletionRequest | AsyncChatRequest, Field(discriminator="endpoint")]

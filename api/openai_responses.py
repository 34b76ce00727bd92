"""The Responses API, core (``POST /v1/responses``): a request is turned into a chat completion (same prompt
format, constraints and tool calls), and its answer into a ``response`` object or, streamed, into the
``response.*`` events the OpenAI SDK's ``responses.stream`` accumulates.

A response is stored (``store``, true by default as in OpenAI's API; ``api.response_store``) for ``GET
/v1/responses/{id}`` and for a later request's ``previous_response_id``, which continues its conversation.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import Field

from api.errors import OpenAIError, bad_request
from api.formatting import FINISH_ABORT
from api.responses import sse_event
from api.schemas import ChatCompletionRequest, FunctionDefinition, Text, _Body, ranged
from api.streaming import StreamSession
from api.tools import split_pieces
from api.unsupported import Rule, check_fields, only, refuse
from worker import contract as c


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(_Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text


InputItem = InputMessage | FunctionCallItem | FunctionCallOutput


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: Any = None


class FunctionTool(FunctionDefinition):
    """A function tool as the Responses API lists it: the chat function's fields and its type, side by side."""
    type: Literal["function"]


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: Text


class ResponsesRequest(_Body):
    model: Text | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, ranged("max_tokens")] | None = None  # ranges: checked as a chat's
    temperature: Annotated[float, ranged("temperature")] | None = None
    top_p: Annotated[float, ranged("top_p")] | None = None
    stream: bool | None = False
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    seed: Annotated[int, ranged("seed")] | None = None  # vLLM's extension, as in chat
    state: Text | None = None  # Gaggle's extension, as in chat: a named initial state
    store: bool | None = None  # None: true
    previous_response_id: Text | None = None
    # defined by OpenAI, not implemented (api.unsupported)
    conversation: Any = None
    background: Any = None
    include: Any = None
    reasoning: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None


RESPONSES_RULES: dict[str, Rule] = {
    "conversation": refuse("conversation objects are not implemented: continue with previous_response_id, or "
                           "send the conversation's items as input"),
    "background": refuse("background responses are not implemented: use the Batch API"),
    "include": refuse("no extra output data is available"),
    "reasoning": lambda v: None if v is None or v == {} or (isinstance(v, dict) and v.get("effort") is None)
    else "the model does not reason before answering",
    "prompt": refuse("stored prompts are not implemented"),
    "top_logprobs": refuse("logprobs are not implemented on responses: use chat completions"),
    "truncation": only(("disabled",), "truncation is not implemented: only disabled"),
    "max_tool_calls": refuse("max_tool_calls is not implemented"),
    "service_tier": only(("auto", "default"), "one service tier: auto (or default)"),
}


def as_chat_request(body: ResponsesRequest, history: list[dict] | None = None) -> ChatCompletionRequest:
    """The chat completion that answers ``body`` after the stored conversation ``history`` (chat messages); 400
    naming the field for what it cannot express."""
    check_fields(body, RESPONSES_RULES, "responses")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise bad_request("text.verbosity is not supported: verbosity is not implemented", "text.verbosity",
                          "unsupported_field")
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body, history or []), "stream": body.stream,
                            "max_tokens": body.max_output_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "seed": body.seed, "parallel_tool_calls": body.parallel_tool_calls,
                            "state": body.state}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, by_alias=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValueError as e:
        raise bad_request(f"the request cannot be answered as a chat: {e}", "input") from None


RESPONSES_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format",
                    "response_format.json_schema": "text.format",
                    "response_format.json_schema.schema": "text.format.schema"}


def named_for_responses(error: OpenAIError) -> OpenAIError:
    """A refusal of the chat request that answers a response (its limits are checked there) names the field the
    client wrote."""
    error.param = RESPONSES_PARAMS.get(error.param, error.param)
    return error


def _messages(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The instructions (this request's: they are not carried over), the conversation so far, the new input."""
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return instructions + history + input_messages(body)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's input items as chat messages."""
    messages: list[dict] = []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


# -- the response object ------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseView:
    """The ``response`` object of one request, built up as it streams or at once from its result."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, model: str):
        self.body, self.chat, self.model = body, chat, model
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.final: dict | None = None  # the finished response object (render, or the stream's last event)

    def obj(self, status: str, output: list[dict], usage: dict | None = None, incomplete: str | None = None,
            error: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {
            "type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": b.store is not False,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "top_p": 1.0 if b.top_p is None else b.top_p, "text": {"format": fmt},
                "tool_choice": (b.tool_choice if isinstance(b.tool_choice, str)
                                else b.tool_choice.model_dump() if b.tool_choice else "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or []], "truncation": "disabled",
                "usage": usage, "user": b.user, "metadata": b.metadata or {}}

    def render(self, results: list[c.Result], prompt_tokens: int) -> dict:
        """The whole response of a finished request (``n`` is 1: one choice)."""
        choice = results[0].choices[0]
        pieces = (split_pieces(choice.text, cut=choice.finish_reason == "length")
                  if self.chat.tools and self.chat.tool_choice != "none" else [choice.text] if choice.text else [])
        output, calls = [], 0
        for piece in pieces:  # in the order the stream sends them as items
            if isinstance(piece, str):
                output.append(message_item(new_id("msg"), piece, "completed"))
            else:
                name, arguments = piece
                output.append(call_item(new_id("fc"), call_id_of(self.id, calls), name, arguments, "completed"))
                calls += 1
        status, incomplete = self._status(choice.finish_reason)
        self.final = self.obj(status, output, usage_of(results, prompt_tokens), incomplete)
        return self.final

    @staticmethod
    def _status(finish_reason: str | None) -> tuple[str, str | None]:
        if finish_reason == "length":
            return "incomplete", "max_output_tokens"
        return "completed", None


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def call_id_of(response_id: str, number: int) -> str:
    return f"call_{response_id.removeprefix('resp_')[:16]}{number:04d}"


def usage_of(results: list[c.Result], prompt_tokens: int) -> dict:
    output = sum(len(ch.token_ids) for r in results for ch in r.choices)
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_tokens + output}


# -- the stream --------------------------------------------------------------------------------------------

class ResponseStream(StreamSession):
    """The chat stream's chunks, framed as ``response.*`` events: created and in_progress first, the message's
    text as output_text deltas, each tool call as a function_call item, completed (or incomplete) last."""

    def __init__(self, replies, job, inbox, tokenizer, metrics, view: ResponseView, on_final=None):
        super().__init__(replies, job, inbox, tokenizer, metrics)
        self.view = view
        self.on_final = on_final  # async (response object): called once, before the final event is sent
        self.sequence = 0
        self.output: list[dict] = []  # finished items
        self.message: dict | None = None  # the open message item
        self.text = ""
        self.finish: str | None = None
        self.started = False

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse_event(data)

    async def events(self):
        for frame in self.opening():  # at once: the client knows its response id before the first token
            yield frame
        async for frame in super().events():
            if self.view.final is not None and self.on_final is not None:  # stored before the client reads it
                on_final, self.on_final = self.on_final, None
                await on_final(self.view.final)
            yield frame

    def opening(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        pending = self.view.obj("in_progress", [])
        return [self.event("response.created", response=pending), self.event("response.in_progress",
                                                                                response=pending)]

    def frame(self, chunk: dict) -> list[bytes]:
        frames = self.opening()
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("content"):
                frames += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                frames += self._close_message() + self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                frames += self._close_message()
        return frames

    def _text(self, text: str) -> list[bytes]:
        frames = []
        index = len(self.output)
        if self.message is None:
            self.message = message_item(new_id("msg"), "", "in_progress")
            frames += [self.event("response.output_item.added", output_index=index, item=self.message),
                       self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                  content_index=0, part=text_part(""))]
        self.text += text
        frames.append(self.event("response.output_text.delta", item_id=self.message["id"], output_index=index,
                                 content_index=0, delta=text, logprobs=[]))
        return frames

    def _close_message(self) -> list[bytes]:
        if self.message is None:
            return []
        index, item_id = len(self.output), self.message["id"]
        done = message_item(item_id, self.text, "completed")
        self.output.append(done)
        self.message, self.text = None, ""
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=done["content"][0]["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=done["content"][0]),
                self.event("response.output_item.done", output_index=index, item=done)]

    def _call(self, call: dict) -> list[bytes]:
        index, item_id = len(self.output), new_id("fc")
        fn = call["function"]
        cid = call_id_of(self.view.id, sum(1 for o in self.output if o["type"] == "function_call"))
        added = call_item(item_id, cid, fn["name"], "", "in_progress")
        done = call_item(item_id, cid, fn["name"], fn["arguments"], "completed")
        self.output.append(done)
        return [self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                           delta=fn["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                           name=fn["name"], arguments=fn["arguments"]),
                self.event("response.output_item.done", output_index=index, item=done)]

    def completed(self, results: list[c.Result]) -> list[bytes]:
        frames = self.opening() + self._close_message()
        status, incomplete = ResponseView._status(self.finish or FINISH_ABORT)
        final = self.view.obj(status, self.output, usage_of(results, self.job.prompt_tokens), incomplete)
        self.view.final = final
        return frames + [self.event(f"response.{status}", response=final)]

    def failed(self, error: dict) -> list[bytes]:
        err = error.get("error", {})
        failed = self.view.obj("failed", self.output, error={"code": err.get("code") or "server_error",
                                                             "message": err.get("message", "")})
        return self.opening() + [self.event("response.failed", response=failed)]


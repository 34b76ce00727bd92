"""Prompts: completion prompt forms, the RWKV chat format (tool calls and results included), tokenization and
the length limits."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from api.errors import bad_request
from api.limits import Limits
from api.schemas import ChatMessage
from api.settings import Settings
from engine.tokenizer import WorldTokenizer

THREAD_ENCODE_CHARS = 20_000  # longer texts are tokenized off the event loop
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # a tool call's block (api.tools)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str  # for echo

    @property
    def num_tokens(self) -> int:
        return max(1, len(self.token_ids))  # an empty prompt runs as one end-of-text token


async def encode(tokenizer: WorldTokenizer, text: str) -> list[int]:
    if len(text) > THREAD_ENCODE_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text)
    return tokenizer.encode(text)


async def completion_prompts(prompt: str | list, tokenizer: WorldTokenizer, vocab_size: int) -> list[Prompt]:
    """str, [str], [id] or [[id]] -> one Prompt per prompt (choice indices follow this order); token ids
    must lie below ``vocab_size``."""
    if isinstance(prompt, str):
        return [Prompt(await encode(tokenizer, prompt), prompt)]
    if isinstance(prompt[0], str):
        return [Prompt(await encode(tokenizer, p), p) for p in prompt]
    token_lists = [prompt] if isinstance(prompt[0], int) else prompt
    for i, ids in enumerate(token_lists):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            where = "prompt" if token_lists is not prompt else f"prompt[{i}]"
            raise bad_request(f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
    return [Prompt(list(ids), tokenizer.decode(ids)) for ids in token_lists]


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def call_block(name: str, arguments: str) -> str:
    """A tool call as the model writes it: a block holding ``{"name", "arguments"}`` (compact JSON)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        args = arguments
    return f"{OPEN}\n{{\"name\": {json.dumps(name, ensure_ascii=False)}, \"arguments\": {args}}}\n{CLOSE}"


def chat_turns(messages: list[ChatMessage], tools_prompt: str | None = None) -> list[tuple[str, str]]:
    """(role, text) turns: an assistant's tool calls written as blocks after its text, a tool's result as its
    text; ``tools_prompt`` (the functions on offer) as a system turn after the leading system turns."""
    turns = []
    for m in messages:
        text = message_text(m)
        if m.role == "assistant" and m.tool_calls:
            blocks = "\n".join(call_block(c.function.name, c.function.arguments) for c in m.tool_calls)
            text = f"{text}\n{blocks}" if text else blocks
        turns.append((m.role, text))
    if tools_prompt is not None:
        lead = 0
        while lead < len(turns) and turns[lead][0] in ("system", "developer"):
            lead += 1
        turns.insert(lead, ("system", tools_prompt))
    return turns


def render_chat(messages: list[ChatMessage], settings: Settings, add_generation_prompt: bool,
                tools_prompt: str | None = None) -> str:
    """RWKV chat format by default: ``System: …\\n\\nUser: …\\n\\nAssistant:``; a tool's result is a ``Tool:``
    turn."""
    templates = {"system": settings.chat_system_template, "developer": settings.chat_system_template,
                 "user": settings.chat_user_template, "assistant": settings.chat_assistant_template,
                 "tool": settings.chat_tool_template}
    parts = [templates[role].replace("{content}", text) for role, text in chat_turns(messages, tools_prompt)]
    if add_generation_prompt:
        parts.append(settings.chat_generation_prompt)
    return "".join(parts)


def fit_lengths(prompts: list[Prompt], max_tokens: int, limits: Limits, explicit: bool) -> list[int]:
    """Each prompt's max_tokens; 400 naming both numbers when a prompt is over the limits. Without an
    ``explicit`` max_tokens a prompt gets what the model's length leaves it, up to the default (as vLLM)."""
    fitted = []
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt {i}"
        if len(p.token_ids) > limits.max_prompt_tokens:
            raise bad_request(f"{where} has {len(p.token_ids)} tokens, more than the limit of "
                              f"{limits.max_prompt_tokens} tokens", "prompt", "prompt_too_long")
        room = limits.max_model_len - p.num_tokens
        if not explicit and room >= 1:
            fitted.append(min(max_tokens, room))
            continue
        total = p.num_tokens + max_tokens
        if total > limits.max_model_len:
            raise bad_request(f"{where} ({p.num_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens, "
                              f"more than the model's limit of {limits.max_model_len} tokens",
                              "max_tokens" if explicit else "prompt", "context_length_exceeded")
        fitted.append(max_tokens)
    return fitted

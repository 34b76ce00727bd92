"""Prompts: completion prompt forms, the RWKV chat format, tokenization and the length limits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from api.errors import bad_request
from api.limits import Limits
from api.schemas import ChatMessage
from api.settings import Settings
from engine.tokenizer import WorldTokenizer

THREAD_ENCODE_CHARS = 20_000  # longer texts are tokenized off the event loop


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


def render_chat(messages: list[ChatMessage], settings: Settings, add_generation_prompt: bool) -> str:
    """RWKV chat format by default: ``System: …\\n\\nUser: …\\n\\nAssistant:``."""
    templates = {"system": settings.chat_system_template, "developer": settings.chat_system_template,
                 "user": settings.chat_user_template, "assistant": settings.chat_assistant_template}
    parts = [templates[m.role].replace("{content}", message_text(m)) for m in messages]
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

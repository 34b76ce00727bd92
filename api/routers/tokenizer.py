"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info (what lm-eval's
``tokenizer_backend=remote`` and other clients count and score with)."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from api.auth import get_tenant
from api.errors import bad_request
from api.limits import current_limits
from api.prompts import encode, render_chat
from api.routers.common import errors
from api.schemas import INT32, ChatMessage, Text, _Body
from api.settings import Settings, get_settings
from api.unsupported import log_unknown

router = APIRouter(tags=["tokenizer"])


class TokenizeRequest(_Body):
    """A text (``prompt``) or a chat (``messages``, rendered as chat completions render it)."""
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None  # the RWKV vocabulary has none: nothing to add either way
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32)]]


@router.post("/tokenize", responses=errors(400, 401))
async def tokenize(body: TokenizeRequest, request: Request, tenant: str = Depends(get_tenant),
                   settings: Settings = Depends(get_settings)) -> dict:
    log_unknown(body, "tokenize")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    tokenizer = request.app.state.tokenizer
    if body.messages is not None:
        add = True if body.add_generation_prompt is None else body.add_generation_prompt
        text = render_chat(body.messages, settings, add)
    else:
        text = body.prompt
    ids = await encode(tokenizer, text)
    limits = await current_limits(request.app.state.generation.broker, settings)
    strs = None
    if body.return_token_strs:
        strs = [tokenizer.id_to_token_bytes[t].decode("utf-8", errors="replace") for t in ids]
    return {"count": len(ids), "max_model_len": limits.max_model_len, "max_prompt_tokens": limits.max_prompt_tokens,
            "tokens": ids, "token_strs": strs}


@router.post("/detokenize", responses=errors(400, 401))
async def detokenize(body: DetokenizeRequest, request: Request, tenant: str = Depends(get_tenant),
                     settings: Settings = Depends(get_settings)) -> dict:
    log_unknown(body, "detokenize")
    limits = await current_limits(request.app.state.generation.broker, settings)
    bad = next((t for t in body.tokens if t >= limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})", "tokens")
    return {"prompt": request.app.state.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info", responses=errors(401))
async def tokenizer_info(request: Request, tenant: str = Depends(get_tenant),
                         settings: Settings = Depends(get_settings)) -> dict:
    """The tokenizer's configuration as vLLM reports it. RWKV's end of text is token 0, which is no text:
    ``eos_token`` is null and ``eos_token_id`` 0; the chat template renders what chat completions do."""
    limits = await current_limits(request.app.state.generation.broker, settings)
    tokenizer = request.app.state.tokenizer
    return {"tokenizer_class": "RwkvWorldTokenizer", "vocab_size": limits.vocab_size,
            "model_max_length": limits.max_model_len, "eos_token": None, "eos_token_id": tokenizer.eos_token_id,
            "bos_token": None, "pad_token": None, "unk_token": None, "add_bos_token": False,
            "add_eos_token": False, "chat_template": chat_template(settings)}


def chat_template(settings: Settings) -> str:
    """The chat format as a Jinja template (``messages``, ``add_generation_prompt``), for clients that render
    prompts themselves; tool calls and results are rendered as ``api.tools`` renders them."""
    def literal(template: str) -> str:
        before, _, after = template.partition("{content}")
        return "{{ " + json.dumps(before) + " }}{{ message['content'] }}{{ " + json.dumps(after) + " }}"
    by_role = {"system": settings.chat_system_template, "developer": settings.chat_system_template,
               "user": settings.chat_user_template, "assistant": settings.chat_assistant_template,
               "tool": settings.chat_tool_template}
    branches = "".join(f"{{%- {'if' if i == 0 else 'elif'} message['role'] == {json.dumps(role)} -%}}"
                       f"{literal(template)}" for i, (role, template) in enumerate(by_role.items()))
    return ("{%- for message in messages -%}" + branches + "{%- endif -%}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{ " + json.dumps(settings.chat_generation_prompt) + " }}{%- endif -%}")

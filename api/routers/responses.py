"""POST /v1/responses: the Responses API's core, answered as a chat completion (api.openai_responses)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from api.auth import get_tenant
from api.errors import OpenAIError
from api.generation import GenerationService
from api.jobs import chat_job
from api.limits import current_limits
from api.openai_responses import ResponsesRequest, ResponseStream, ResponseView, as_chat_request, named_for_responses
from api.routers.common import GENERATION_ERRORS
from api.settings import Settings, get_settings

router = APIRouter(tags=["responses"])


@router.post("/v1/responses", responses=GENERATION_ERRORS)
async def create_response(body: ResponsesRequest, request: Request, tenant: str = Depends(get_tenant),
                          settings: Settings = Depends(get_settings)) -> Response:
    service: GenerationService = request.app.state.generation
    chat = as_chat_request(body)
    limits = await current_limits(service.broker, settings)
    try:
        job = await chat_job(chat, tenant, settings, service.tokenizer, limits)
    except OpenAIError as e:
        raise named_for_responses(e) from None
    view = ResponseView(body, chat, settings.model_name)
    return await service.respond(job, request, session=lambda *args: ResponseStream(*args, view=view),
                                 render=lambda results: view.render(results, job.prompt_tokens))

"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from api.auth import get_tenant
from api.generation import GenerationService
from api.jobs import chat_job
from api.limits import current_limits
from api.routers.common import GENERATION_ERRORS
from api.schemas import ChatCompletionRequest
from api.settings import Settings, get_settings

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", responses=GENERATION_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, tenant: str = Depends(get_tenant),
                                 settings: Settings = Depends(get_settings)) -> Response:
    service: GenerationService = request.app.state.generation
    limits = await current_limits(service.broker, settings)
    job = await chat_job(body, tenant, settings, service.tokenizer, limits)
    return await service.respond(job, request)

"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from api.auth import get_tenant
from api.generation import GenerationService
from api.jobs import completion_job
from api.limits import current_limits
from api.routers.common import GENERATION_ERRORS
from api.schemas import CompletionRequest
from api.settings import Settings, get_settings

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", responses=GENERATION_ERRORS)
async def create_completion(body: CompletionRequest, request: Request, tenant: str = Depends(get_tenant),
                            settings: Settings = Depends(get_settings)) -> Response:
    service: GenerationService = request.app.state.generation
    limits = await current_limits(service.broker, settings)
    job = await completion_job(body, tenant, settings, service.tokenizer, limits)
    return await service.respond(job, request)

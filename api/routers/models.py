"""GET /v1/models, GET /v1/models/{model_id}: the one model the workers serve, under its name and aliases."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api.auth import get_tenant
from api.errors import model_not_found
from api.limits import current_limits
from api.routers.common import errors
from api.settings import Settings, get_settings

router = APIRouter(tags=["models"])


async def model_cards(request: Request, settings: Settings, ids: list[str]) -> list[dict]:
    """``root``: the served name an alias stands for. ``max_model_len``: the tightest of the API's setting and
    every live worker's (prompt + output); ``max_prompt_tokens``: the longest prompt the API takes
    (``--max-prompt-tokens``), which may be less."""
    limits = await current_limits(request.app.state.generation.broker, settings)
    return [{"id": model_id, "object": "model", "created": request.app.state.started, "owned_by": "gaggle",
             "root": settings.model_name, "max_model_len": limits.max_model_len,
             "max_prompt_tokens": limits.max_prompt_tokens} for model_id in ids]


@router.get("/v1/models", responses=errors(401))
async def list_models(request: Request, tenant: str = Depends(get_tenant),
                      settings: Settings = Depends(get_settings)) -> dict:
    return {"object": "list", "data": await model_cards(request, settings, settings.model_ids())}


@router.get("/v1/models/{model_id:path}", responses=errors(401, 404))
async def retrieve_model(model_id: str, request: Request, tenant: str = Depends(get_tenant),
                         settings: Settings = Depends(get_settings)) -> dict:
    if model_id not in settings.model_ids():
        raise model_not_found(model_id)
    return (await model_cards(request, settings, [model_id]))[0]

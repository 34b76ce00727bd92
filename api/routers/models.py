"""GET /v1/models, GET /v1/models/{model_id}: the one model the workers serve."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api.auth import get_tenant
from api.errors import not_found
from api.routers.common import errors
from api.settings import Settings, get_settings

router = APIRouter(tags=["models"])


def model_card(settings: Settings, created: int) -> dict:
    return {"id": settings.model_name, "object": "model", "created": created, "owned_by": "gaggle",
            "max_model_len": settings.max_model_len}


@router.get("/v1/models", responses=errors(401))
async def list_models(request: Request, tenant: str = Depends(get_tenant),
                      settings: Settings = Depends(get_settings)) -> dict:
    return {"object": "list", "data": [model_card(settings, request.app.state.started)]}


@router.get("/v1/models/{model_id:path}", responses=errors(401, 404))
async def retrieve_model(model_id: str, request: Request, tenant: str = Depends(get_tenant),
                         settings: Settings = Depends(get_settings)) -> dict:
    if model_id != settings.model_name:
        raise not_found("model", model_id)
    return model_card(settings, request.app.state.started)

"""The Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field
from starlette.responses import Response

from api.auth import get_tenant
from api.batch.files import MAX_EXPIRY_S, MIN_EXPIRY_S
from api.batch.service import BatchService
from api.responses import JSONBytesResponse
from api.routers.common import errors
from api.schemas import _Body

router = APIRouter(tags=["batches"])


class ExpiresAfter(_Body):
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)]


class BatchCreateRequest(_Body):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


def _service(request: Request) -> BatchService:
    return request.app.state.batches


@router.post("/v1/batches", responses=errors(400, 401))
async def create_batch(body: BatchCreateRequest, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    expires = body.output_expires_after.seconds if body.output_expires_after else None
    batch = await _service(request).create(tenant, body.input_file_id, body.endpoint, body.completion_window,
                                           body.metadata, expires)
    return JSONBytesResponse(batch.openai())


@router.get("/v1/batches", responses=errors(401))
async def list_batches(request: Request, tenant: str = Depends(get_tenant), after: str | None = None,
                       limit: int = Query(20, ge=1, le=100)) -> Response:
    return JSONBytesResponse(await _service(request).list(tenant, after, limit))


@router.get("/v1/batches/{batch_id}", responses=errors(401, 404))
async def get_batch(batch_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    return JSONBytesResponse((await _service(request).get(tenant, batch_id)).openai())


@router.post("/v1/batches/{batch_id}/cancel", responses=errors(401, 404))
async def cancel_batch(batch_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    return JSONBytesResponse((await _service(request).cancel(tenant, batch_id)).openai())

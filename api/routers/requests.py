"""Async requests: POST /v1/requests, GET /v1/requests/{id}, GET .../events, DELETE /v1/requests/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from api.async_requests import AsyncRequests
from api.auth import get_tenant
from api.jobs import chat_job, completion_job
from api.limits import current_limits
from api.responses import JSONBytesResponse
from api.routers.common import errors
from api.schemas import AsyncChatRequest, AsyncRequest
from api.settings import Settings, get_settings
from api.streaming import EventStream

router = APIRouter(tags=["requests"])


def _service(request: Request) -> AsyncRequests:
    return request.app.state.async_requests


@router.post("/v1/requests", status_code=202, responses=errors(400, 401, 429, 503))
async def create_request(body: AsyncRequest, request: Request, tenant: str = Depends(get_tenant),
                         settings: Settings = Depends(get_settings)) -> Response:
    service = _service(request)
    build = chat_job if isinstance(body, AsyncChatRequest) else completion_job
    job = await build(body, tenant, settings, service.tokenizer, await current_limits(service.broker, settings),
                      is_async=True)
    obj = await service.submit(job)
    return JSONBytesResponse(obj, status_code=202, headers={"Location": f"/v1/requests/{obj['id']}"})


@router.get("/v1/requests/{request_id}", responses=errors(401, 404))
async def get_request(request_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    obj, _ = await _service(request).get(request_id, tenant)
    return JSONBytesResponse(obj)


@router.get("/v1/requests/{request_id}/events", response_class=Response, responses=errors(401, 404))
async def stream_request(request_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    return EventStream(await _service(request).watch(request_id, tenant))


@router.delete("/v1/requests/{request_id}", responses=errors(401, 404))
async def cancel_request(request_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    return JSONBytesResponse(await _service(request).cancel(request_id, tenant))

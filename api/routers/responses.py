"""The Responses API: ``POST /v1/responses`` answered as a chat completion (api.openai_responses), stored
responses read and deleted (api.response_store)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from api import response_store
from api.auth import get_tenant
from api.errors import OpenAIError
from api.generation import GenerationService
from api.jobs import chat_job
from api.limits import current_limits
from api.openai_responses import (ResponsesRequest, ResponseStream, ResponseView, as_chat_request, input_messages,
                                  named_for_responses)
from api.routers.common import GENERATION_ERRORS
from api.settings import Settings, get_settings

router = APIRouter(tags=["responses"])


@router.post("/v1/responses", responses=GENERATION_ERRORS)
async def create_response(body: ResponsesRequest, request: Request, tenant: str = Depends(get_tenant),
                          settings: Settings = Depends(get_settings)) -> Response:
    service: GenerationService = request.app.state.generation
    redis = service.broker.redis
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = await response_store.load(redis, tenant, body.previous_response_id, "previous_response_id")
        history = previous["messages"]
    chat = as_chat_request(body, history)
    limits = await current_limits(service.broker, settings)
    try:
        job = await chat_job(chat, tenant, settings, service.tokenizer, limits)
    except OpenAIError as e:
        raise named_for_responses(e) from None
    view = ResponseView(body, chat, settings.model_name)
    conversation = history + input_messages(body)

    async def store(response: dict) -> None:
        if body.store is not False and response["status"] in ("completed", "incomplete"):
            await response_store.save(redis, tenant, response,
                                      conversation + response_store.output_messages(response["output"]),
                                      settings.response_ttl_s)

    answer = await service.respond(job, request,
                                   session=lambda *args: ResponseStream(*args, view=view, on_final=store),
                                   render=lambda results: view.render(results, job.prompt_tokens))
    if not body.stream and view.final is not None:
        await store(view.final)  # before the client has the id it may continue from
    return answer


@router.get("/v1/responses/{response_id}", responses=GENERATION_ERRORS)
async def get_response(response_id: str, request: Request, tenant: str = Depends(get_tenant)) -> dict:
    record = await response_store.load(request.app.state.generation.broker.redis, tenant, response_id)
    return record["response"]


@router.delete("/v1/responses/{response_id}", responses=GENERATION_ERRORS)
async def delete_response(response_id: str, request: Request, tenant: str = Depends(get_tenant)) -> dict:
    await response_store.delete(request.app.state.generation.broker.redis, tenant, response_id)
    return {"id": response_id, "object": "response", "deleted": True}

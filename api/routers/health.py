"""GET /health (liveness, no Redis) and GET /ready (Redis reachable and a live worker; else why not: a worker
warming up says its stage and count). Both name the service and its instance, so that ``gaggle up`` knows its
own API from another one answering on the same port."""

from __future__ import annotations

from fastapi import APIRouter, Request
from redis.exceptions import RedisError

from api.broker import Broker
from api.errors import OpenAIError
from api.routers.common import errors

router = APIRouter(tags=["health"])


SERVICE = "gaggle"


@router.get("/health")
async def health(request: Request) -> dict:
    return {"status": "ok", "service": SERVICE, "instance": request.app.state.settings.instance_id}


@router.get("/ready", responses=errors(503))
async def ready(request: Request) -> dict:
    broker: Broker = request.app.state.broker
    if not await broker.ping():
        raise OpenAIError(503, "not ready: redis is unreachable", code="redis_unreachable")
    try:
        workers = await broker.live_workers()
    except (RedisError, OSError):
        raise OpenAIError(503, "not ready: redis is unreachable", code="redis_unreachable") from None
    live = [w for w in workers if not w.draining]
    if not live:
        try:
            warming = await broker.warming_workers()
        except (RedisError, OSError):
            warming = []
        if warming:
            raise OpenAIError(503, "not ready: warming up (" + "; ".join(f"{w.name}: {w.describe()}" for w in warming)
                              + ")", code="warming_up")
        raise OpenAIError(503, "not ready: no live worker heartbeat", code="no_workers")
    return {"status": "ready", "workers": len(live), "service": SERVICE,
            "instance": request.app.state.settings.instance_id}

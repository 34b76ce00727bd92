"""GET /metrics (Prometheus text format)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.responses import Response

from api.broker import Broker
from api.metrics import Metrics
from worker import contract as c

router = APIRouter(tags=["metrics"])
ALL_TENANTS = "*"  # the tenant label of queue depths with API keys configured: all tenants summed
log = logging.getLogger(__name__)


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    broker: Broker = request.app.state.broker
    app_metrics: Metrics = request.app.state.metrics
    cluster: dict = {}
    try:
        depths = await broker.queue_depth()
        if request.app.state.keys.enabled:  # /metrics takes no key: no tenant names, one series per priority
            depths = _summed_over_tenants(depths)
        cluster = {"queues": depths, "workers": await broker.live_workers(),
                   "batches": await broker.active_batches(), "restarts": await broker.restarts()}
    except (RedisError, OSError) as e:
        log.warning("metrics without the cluster view: redis unavailable", extra={"error": str(e)})
    return Response(app_metrics.exposition(cluster), media_type=CONTENT_TYPE_LATEST)


def _summed_over_tenants(depths: dict[str, int]) -> dict[str, int]:
    summed: dict[str, int] = {}
    for stream, depth in depths.items():
        key = c.request_stream(c.stream_priority_tenant(stream)[0], ALL_TENANTS)
        summed[key] = summed.get(key, 0) + depth
    return summed

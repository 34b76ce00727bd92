"""GET /metrics (Prometheus text format)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.responses import Response

from api.broker import Broker
from api.metrics import Metrics

router = APIRouter(tags=["metrics"])
log = logging.getLogger(__name__)


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    broker: Broker = request.app.state.broker
    app_metrics: Metrics = request.app.state.metrics
    cluster: dict = {}
    try:
        cluster = {"queues": await broker.queue_depth(), "workers": await broker.live_workers(),
                   "batches": await broker.active_batches(), "restarts": await broker.restarts()}
    except (RedisError, OSError) as e:
        log.warning("metrics without the cluster view: redis unavailable", extra={"error": str(e)})
    return Response(app_metrics.exposition(cluster), media_type=CONTENT_TYPE_LATEST)

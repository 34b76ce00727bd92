"""The live status page: GET /dashboard (a static page from dashboards/, no build step) and the JSON it polls,
GET /dashboard/status.json: workers, queues, batches, recent errors. With API keys configured, tenant names, batch
and request ids, file ids and error messages stay out of it (the page needs no key)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import orjson
from fastapi import APIRouter, Request
from redis.exceptions import RedisError
from starlette.responses import FileResponse, Response

from api.broker import Broker
from api.errors import OpenAIError
from api.responses import JSONBytesResponse
from worker import contract as c

router = APIRouter(tags=["dashboard"], include_in_schema=False)
PAGE = Path(__file__).resolve().parents[2] / "dashboards" / "status.html"
RECENT = 15


@router.get("/dashboard")
async def dashboard_page() -> Response:
    return FileResponse(PAGE, media_type="text/html")


@router.get("/dashboard/status.json")
async def dashboard_status(request: Request) -> Response:
    broker: Broker = request.app.state.broker
    private = request.app.state.keys.enabled
    try:
        return JSONBytesResponse(await status(broker, private))
    except (RedisError, OSError) as e:
        raise OpenAIError(503, f"redis is unavailable: {e}", code="redis_unreachable") from None


async def status(broker: Broker, private: bool) -> dict:
    now = time.time()
    workers = await broker.live_workers()
    warming = await broker.warming_workers()
    depths = await broker.queue_depth()
    r = broker.redis
    pipe = r.pipeline(transaction=False)
    pipe.lrange(c.RECENT_ERRORS, 0, RECENT - 1)
    pipe.xrevrange(c.STREAM_DEAD, count=RECENT)
    errors, dead = await pipe.execute()
    batches = await broker.active_batches()
    if private:
        batches = [{**b, "id": f"batch {i}"} for i, b in enumerate(batches, 1)]
    queues = []
    for stream, depth in depths.items():
        priority, tenant = c.stream_priority_tenant(stream)
        queues.append({"priority": priority, "tenant": None if private else tenant, "depth": depth})
    return {
        "time": now,
        "workers": [{"name": w.name, "device": w.device, "model": w.model, "age_s": round(now - w.ts, 2),
                     "running": w.running, "free_slots": w.free_slots, "num_slots": w.num_slots,
                     "tokens_per_s": w.tokens_per_s, "draining": w.draining,
                     "prefix_hit_rate": round(w.prefix_hits / w.prefix_lookups, 3) if w.prefix_lookups else None,
                     "prefix_tokens_saved": w.prefix_tokens_saved, "prefix_bytes": w.prefix_bytes,
                     "shared_hits": w.shared_hits, "shared_published": w.shared_published}
                    for w in workers],
        "warming": [{"name": w.name, "device": w.device, "model": w.model, "stages": w.stages,
                     "elapsed_s": w.elapsed_s, "status": w.describe()} for w in warming],
        "totals": {"tokens_per_s": sum(w.tokens_per_s for w in workers), "running": sum(w.running for w in workers),
                   "in_streams": sum(depths.values()), "workers": len(workers)},
        "queues": queues,
        "batches": batches,
        "errors": [_private_error(orjson.loads(e)) if private else orjson.loads(e) for e in errors],
        "dead_letters": [{"id": eid.decode()} if private else
                         {"id": eid.decode(), "request_id": f.get(b"request_id", b"").decode(),
                          "reason": f.get(b"reason", b"").decode()[:300]} for eid, f in dead],
    }


_IDS = re.compile(r"(file|batch|cmpl|chatcmpl|resp|req|msg)[-_][A-Za-z0-9_-]+")


def _private_error(error: dict) -> dict:
    """A recent error without what could belong to a tenant: ids out of its path, no message."""
    return {"time": error.get("time"), "status": error.get("status"), "path": _IDS.sub("{id}", str(error.get("path")))}


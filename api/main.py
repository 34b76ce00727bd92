"""The FastAPI app: wiring only. ``create_app(settings)``; uvicorn runs it as a factory (``gaggle api``)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.async_requests import AsyncRequests
from api.auth import KeyStore
from api.broker import Broker
from api.errors import install_error_handlers
from api.generation import GenerationService
from api.metrics import Metrics, MetricsMiddleware
from api.middleware import BodySizeLimit, CatchAll
from api.batch.files import MAX_UPLOAD_BYTES, DirectoryStore
from api.batch.service import BatchService, FileService
from api.routers import (batches, chat, completions, dashboard, files, health, metrics, models, requests,
                         responses, tokenizer)
from api.settings import Settings
from engine.gc_policy import settle_heap
from engine.tokenizer import WorldTokenizer

log = logging.getLogger(__name__)

UPLOAD_BODY_BYTES = MAX_UPLOAD_BYTES + (1 << 20)  # a file upload's limit, multipart framing included


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings: Settings = app.state.settings
    app.state.keys = KeyStore.load(settings)
    # ~3 s: the vocabulary regex compiled before the first request, not in it
    tokenizer = await asyncio.to_thread(lambda: WorldTokenizer.default().compile_encoder())
    broker = Broker(settings.redis_url, settings.worker_cache_s)
    await broker.start()
    generation = GenerationService(broker, tokenizer, settings, app.state.metrics)
    app.state.broker, app.state.tokenizer, app.state.generation = broker, tokenizer, generation
    app.state.async_requests = AsyncRequests(generation)
    app.state.files = FileService(broker.redis, DirectoryStore(settings.files_dir))
    app.state.batches = BatchService(broker.redis, app.state.files, settings)
    settle_heap(settings.gc_young_threshold)  # what is loaded stays; a streamed chunk's objects die uncollected
    log.info("api started", extra={"model": settings.model_name, "auth": app.state.keys.enabled,
                                   "max_queue": settings.max_queue})
    try:
        yield
    finally:
        await broker.stop()
        log.info("api stopped")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    if settings.log_level:
        from worker.logs import setup_logging
        setup_logging(settings.log_level, settings.log_format)
    app = FastAPI(title="Gaggle", version="0.1.0", lifespan=lifespan, strict_content_type=False,
                  description="OpenAI-compatible generation for RWKV-7 models, queued through Redis")
    app.state.settings = settings
    app.state.started = int(time.time())
    app.state.metrics = Metrics()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, limit_for=lambda path: UPLOAD_BODY_BYTES if path == "/v1/files"
                       else settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(CatchAll)  # outermost of ours: inside it, everything answers
    for module in (completions, chat, models, requests, files, batches, health, metrics, dashboard, tokenizer,
                   responses):
        app.include_router(module.router)
    return app

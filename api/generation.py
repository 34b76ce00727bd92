"""Admission, submission and the answer: the path of a sync completion through Redis.

    admit (queue depth, live workers) → subscribe + wait for the confirmation → record + XADD
    → stream deltas as SSE (``api.streaming``), or wait for the final result (and the client's disconnect)

Waiting itself (messages until a deadline, cancelling, unrouting) is ``api.replies``, which the SSE sessions
share: they are given it, they do not reach back into this service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import Request
from redis.exceptions import RedisError
from starlette.responses import Response, StreamingResponse

from api.broker import Broker
from api.errors import OpenAIError
from api.formatting import Formatter
from api.jobs import Job
from api.metrics import Metrics
from api.pubsub import SubscribeTimeout
from api.replies import Replies
from api.responses import SSE_DONE, JSONBytesResponse, sse_event
from api.settings import Settings
from api.streaming import SSE_HEADERS, EventStream, StreamSession
from engine.tokenizer import WorldTokenizer
from worker import contract as c

log = logging.getLogger(__name__)

STATUS_CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody reads it


class ClientDisconnected(Exception):
    pass


class GenerationService:
    def __init__(self, broker: Broker, tokenizer: WorldTokenizer, settings: Settings, metrics: Metrics):
        self.broker = broker
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        self.replies = Replies(broker, settings)

    # -- admission and submission ------------------------------------------------------------

    async def admit(self, job: Job, require_worker: bool = True) -> None:
        """429 when the queue is over max_queue; 503 when no worker is alive."""
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        try:
            depth, own = await self.broker.admission_depths(job.tenant)
            workers = await self.broker.live_workers() if require_worker else []
        except (RedisError, OSError) as e:
            log.error("redis unavailable at admission", extra={"request_id": job.id, "error": str(e)})
            raise OpenAIError(503, "the request queue is unavailable; try again later", code="queue_unavailable",
                              headers=retry) from None
        if depth + len(job.requests) > self.settings.max_queue:
            log.info("request rejected: queue full", extra={"request_id": job.id, "queue_depth": depth})
            raise OpenAIError(429, f"the queue is full ({depth} requests waiting or running, limit "
                                   f"{self.settings.max_queue}); retry later", code="queue_full", headers=retry)
        per_tenant = self.settings.max_queue_per_tenant
        if per_tenant and own + len(job.requests) > per_tenant:
            log.info("request rejected: tenant's queue full", extra={"request_id": job.id, "tenant": job.tenant,
                                                                      "queue_depth": own})
            raise OpenAIError(429, f"too many requests of yours are queued ({own} waiting or running, limit "
                                   f"{per_tenant}); retry later", code="tenant_queue_full", headers=retry)
        live = [w for w in workers if not w.draining]
        if require_worker and not live:
            log.info("request rejected: no live worker", extra={"request_id": job.id})
            raise OpenAIError(503, "no generation worker is alive; try again later", code="no_workers",
                              headers=retry)

    async def submit(self, job: Job, inbox: asyncio.Queue) -> None:
        """Route the requests' messages on this process's reply channel (confirmed) to ``inbox``, then write the
        records and XADD."""
        for req in job.requests:  # this process waits for them: cancelled if it dies; their messages come here
            req.owner = self.broker.owner
            req.reply_to = self.broker.channels.reply_channel
        try:
            await self.broker.channels.route(job.request_ids, inbox)
        except SubscribeTimeout as e:
            log.error("subscribe failed", extra={"request_id": job.id, "error": str(e)})
            raise OpenAIError(503, "the result channel is unavailable; try again later", code="queue_unavailable",
                              headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        try:
            await self.broker.enqueue(job.requests)
        except (RedisError, OSError) as e:
            self.broker.channels.unroute(job.request_ids, inbox)
            log.error("enqueue failed", extra={"request_id": job.id, "error": str(e)})
            raise OpenAIError(503, "the request queue is unavailable; try again later",
                              code="queue_unavailable") from None
        except BaseException:  # cancelled mid-way: maybe queued, so cancel too
            self.broker.channels.unroute(job.request_ids, inbox)
            self.broker.cancel_soon(job.request_ids, "cancelled while queueing")
            raise
        self.metrics.prompt_tokens.labels(job.endpoint).inc(job.prompt_tokens)
        for req in job.requests:
            log.info("request queued", extra={"request_id": req.id, "tenant": job.tenant, "endpoint": job.endpoint,
                                              "prompt_tokens": len(req.prompt_token_ids), "n": req.n,
                                              "stream": req.stream, "record_text": req.record_text})

    # -- sync requests -----------------------------------------------------------------------

    async def respond(self, job: Job, request: Request, session: Callable[..., StreamSession] = StreamSession,
                      render: Callable[[list[c.Result]], dict] | None = None) -> Response:
        """The answer to a sync request: streamed by ``session`` (its chunks framed as it frames them; made with
        the replies, the job, its inbox, the tokenizer and the metrics), or the whole object (``render`` of the
        results; the endpoint's own object by default)."""
        await self.admit(job)
        inbox: asyncio.Queue = asyncio.Queue()
        await self.submit(job, inbox)
        if job.stream and not job.shape.score_only:
            return EventStream(session(self.replies, job, inbox, self.tokenizer, self.metrics))
        try:
            ordered = await self._complete(job, inbox, request)
        except ClientDisconnected:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        finally:
            await self.replies.release(job, inbox)
        if render is not None:
            return JSONBytesResponse(render(ordered))
        body = Formatter(job.shape, self.tokenizer).response(ordered, job.prompt_tokens)
        if job.stream:  # scoring only: nothing to stream token by token, the whole answer as chunks
            return StreamingResponse(iter([*map(sse_event, Formatter.chunks_of(body, job.shape)), SSE_DONE]),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONBytesResponse(body)

    async def _complete(self, job: Job, inbox: asyncio.Queue, request: Request) -> list[c.Result]:
        """The results in prompt order; raises ClientDisconnected (after cancelling) if the client leaves."""
        pending = set(job.request_ids)
        replies = self.replies
        try:
            results = await until_disconnected(request, replies.collect(inbox, pending, replies.deadline(job)))
        except ClientDisconnected:
            replies.cancel_soon(sorted(pending), "client disconnected")
            raise
        except TimeoutError:
            await replies.cancel(sorted(pending), "request timeout")
            raise OpenAIError(504, f"no result within the request timeout ({replies.timeout_s:g} s); "
                                   "the request was cancelled", code="timeout") from None
        except BaseException:  # server shutdown: do not leave work behind for nobody
            replies.cancel_soon(sorted(pending), "server shutting down")
            raise
        ordered = [results[rid] for rid in job.request_ids]
        for result in ordered:
            log.info("request finished", extra={"request_id": result.id, "status": result.status,
                                                "completion_tokens": result.completion_tokens})
            raise_for_status(result)
            self.metrics.observe_result(job.endpoint, result)
        return ordered


def raise_for_status(result: c.Result) -> None:
    """failed → 500 (400 when a worker refused the request as invalid), expired → 504 (cancelled results are
    answered with what was generated)."""
    err = result.error or {}
    if result.status == c.STATUS_FAILED:
        invalid = err.get("type") == "invalid_request_error"
        raise OpenAIError(400 if invalid else 500, err.get("message", "generation failed"),
                          type="invalid_request_error" if invalid else "server_error", code=err.get("code", "failed"))
    if result.status == c.STATUS_EXPIRED:
        raise OpenAIError(504, err.get("message", "the request expired"), code="expired")


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body was read already, so only http.disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work):
    """Run ``work``; raise ClientDisconnected if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected

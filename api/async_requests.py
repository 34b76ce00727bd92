"""Async requests: submit now, poll / stream / cancel later (``/v1/requests``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from api.broker import Snapshot
from api.errors import OpenAIError, not_found
from api.formatting import Formatter, Shape
from api.generation import GenerationService
from api.jobs import Job
from api.pubsub import SubscribeTimeout
from api.pump import KEEPALIVE
from api.responses import SSE_DONE, SSE_KEEPALIVE, sse_event
from worker import contract as c

log = logging.getLogger(__name__)


class AsyncRequests:
    def __init__(self, service: GenerationService):
        self.service = service
        self.broker = service.broker
        self.tokenizer = service.tokenizer

    async def submit(self, job: Job) -> dict:
        """Queue (no worker needs to be alive: the request waits for one); the 202 body."""
        await self.service.admit(job, require_worker=False)
        try:
            await self.broker.enqueue(job.requests)
        except (RedisError, OSError) as e:
            log.error("enqueue failed", extra={"request_id": job.id, "error": str(e)})
            raise OpenAIError(503, "the request queue is unavailable; try again later",
                              code="queue_unavailable") from None
        self.service.metrics.prompt_tokens.labels(job.endpoint).inc(job.prompt_tokens)
        req = job.requests[0]
        log.info("async request queued", extra={"request_id": req.id, "tenant": job.tenant,
                                                "endpoint": job.endpoint, "prompt_tokens": len(req.prompt_token_ids)})
        return {"id": req.id, "object": "request", "endpoint": job.endpoint, "status": c.STATUS_QUEUED,
                "created": int(req.created), "model": req.model, "n": req.n,
                "choices": [{"index": i, "text": "", "finish_reason": None} for i in range(req.n)],
                "response": None, "error": None}

    async def get(self, request_id: str, tenant: str, mark: bool = False) -> tuple[dict, Snapshot]:
        snap = await self._snapshot(request_id, tenant, mark)
        return self.request_object(request_id, snap), snap

    async def cancel(self, request_id: str, tenant: str) -> dict:
        obj, snap = await self.get(request_id, tenant)
        if obj["status"] in c.TERMINAL_STATUSES and not (obj["status"] == c.STATUS_CANCELLED and not snap.result):
            return obj
        await self.broker.cancel([request_id])
        log.info("request cancelled", extra={"request_id": request_id, "reason": "cancel call", "tenant": tenant})
        obj["status"] = c.STATUS_CANCELLED
        return obj

    async def _snapshot(self, request_id: str, tenant: str, mark: bool) -> Snapshot:
        """The request's state; 404 alike for an unknown id and another tenant's request."""
        try:
            record = await self.broker.record(request_id)
            if not record or record.get("tenant") != tenant:
                raise not_found("request", request_id)
            return await self.broker.snapshot(request_id, int(record.get("n", 1)), mark=mark)
        except (RedisError, OSError) as e:
            log.error("redis unavailable", extra={"request_id": request_id, "error": str(e)})
            raise OpenAIError(503, "the request store is unavailable; try again later",
                              code="queue_unavailable") from None

    # -- objects -------------------------------------------------------------------------------

    def request_object(self, request_id: str, snap: Snapshot) -> dict:
        rec, result = snap.record, snap.result
        n = int(rec.get("n", 1))
        obj = {"id": request_id, "object": "request", "endpoint": rec.get("endpoint", "completions"),
               "status": effective_status(snap), "created": int(float(rec.get("created", 0))),
               "model": rec.get("model", ""), "n": n}
        if result is None:
            obj["choices"] = [{"index": i, "text": snap.texts[i], "finish_reason": None} for i in range(n)]
            obj["response"] = obj["error"] = None
            return obj
        obj["choices"] = [{"index": ch.index, "text": ch.text, "finish_reason": ch.finish_reason}
                          for ch in result.choices]
        if result.status in (c.STATUS_COMPLETED, c.STATUS_CANCELLED):
            obj["response"] = self.formatter(request_id, rec, result).response([result], result.prompt_tokens)
        else:
            obj["response"] = None
        obj["error"] = None if result.status == c.STATUS_COMPLETED else result.error
        return obj

    def formatter(self, request_id: str, rec: dict, result: c.Result | None = None) -> Formatter:
        meta = (result.meta or {}) if result else {}
        echo = meta.get("echo")
        shape = Shape(id=request_id, endpoint=rec.get("endpoint", "completions"),
                      created=int(float(rec.get("created", 0))), model=rec.get("model", ""),
                      n=int(rec.get("n", 1)), echo_texts=[echo] if echo is not None else None,
                      score_only=bool(meta.get("score_only")), tools=bool(meta.get("tools")))
        return Formatter(shape, self.tokenizer)

    # -- events ----------------------------------------------------------------------------------

    async def watch(self, request_id: str, tenant: str) -> RequestEvents:
        """404 before anything is subscribed; then a subscribed session for an EventStream."""
        await self.get(request_id, tenant)
        inbox: asyncio.Queue = asyncio.Queue()
        try:
            await self.broker.channels.subscribe([c.out_channel(request_id)], inbox)
        except SubscribeTimeout:
            raise OpenAIError(503, "the result channel is unavailable; try again later",
                              code="queue_unavailable") from None
        return RequestEvents(self, request_id, tenant, inbox)

    async def _missed_text(self, request_id: str, snap: Snapshot, index: int, chars_sent: int, choice: dict) -> str:
        """Text of choice ``index`` between what this stream sent and where ``choice`` starts: workers publish an
        async request's deltas only once they see its watch (within ~0.5 s), and the text it got meanwhile is
        in the recorded text."""
        start = choice.get("text_offset", chars_sent)
        if start <= chars_sent:
            return ""
        now = await self.broker.snapshot(request_id, int(snap.record.get("n", 1)))
        return now.texts[index][chars_sent:start]

    async def events(self, request_id: str, tenant: str, inbox: asyncio.Queue) -> AsyncIterator[bytes]:
        """What follows (text so far, deltas, then the final object); just the final if already finished.

        The caller subscribed ``inbox`` already; the snapshot is read in one MULTI with a marker
        published on the channel, so messages before the marker are exactly those in the snapshot.
        """
        obj, snap = await self.get(request_id, tenant, mark=True)
        if snap.result is not None or obj["status"] in (c.STATUS_EXPIRED,):
            yield sse_event(obj)
            yield SSE_DONE
            return
        fmt = self.formatter(request_id, snap.record)
        chars_sent = [len(text) for text in snap.texts]  # per choice: a re-run's deltas skip what was sent
        for i, text in enumerate(snap.texts):
            chunk = fmt.chunk(i, text) if text else None
            if chunk is not None:
                yield sse_event(chunk)
        past_mark = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + c.REQUEST_RECORD_TTL_S
        next_touch = loop.time() + c.WATCH_TTL_S / 3
        try:
            async for msg in self.service.replies.pump(inbox, {request_id}, deadline):
                if loop.time() >= next_touch:  # keep workers publishing while this stream is open
                    next_touch = loop.time() + c.WATCH_TTL_S / 3
                    await self.broker.touch_watch(request_id)
                if msg is KEEPALIVE:
                    yield SSE_KEEPALIVE
                elif msg["type"] == "mark":
                    past_mark = past_mark or msg.get("token") == snap.mark
                elif msg["type"] == "final":
                    final, _ = await self.get(request_id, tenant)
                    yield sse_event(final)
                elif msg["type"] == "delta" and past_mark:  # before the marker: already in the snapshot
                    for ch in msg.get("choices", []):
                        i = ch["index"]
                        while len(chars_sent) <= i:
                            chars_sent.append(0)
                        gap = await self._missed_text(request_id, snap, i, chars_sent[i], ch)
                        text, _ = c.skip_seen(ch, chars_sent[i] + len(gap), 0)
                        text = gap + text
                        chars_sent[i] += len(text)
                        chunk = fmt.chunk(i, text, finish_reason=ch.get("finish_reason")) \
                            if text or ch.get("finish_reason") else None
                        if chunk is not None:
                            yield sse_event(chunk)
        except TimeoutError:
            pass  # watched for as long as the record lives
        yield SSE_DONE


class RequestEvents:
    """One watcher of an async request; it does not own the request: leaving only unsubscribes."""

    def __init__(self, requests: AsyncRequests, request_id: str, tenant: str, inbox: asyncio.Queue):
        self.requests, self.request_id, self.tenant, self.inbox = requests, request_id, tenant, inbox

    def events(self) -> AsyncIterator[bytes]:
        return self.requests.events(self.request_id, self.tenant, self.inbox)

    async def close(self) -> None:
        await self.requests.broker.channels.unsubscribe([c.out_channel(self.request_id)], self.inbox)


def effective_status(snap: Snapshot) -> str:
    if snap.result is not None:
        return snap.result.status
    if snap.cancel_requested:
        return c.STATUS_CANCELLED  # the worker writes the cancelled result when it reaches the entry
    deadline = float(snap.record.get("deadline", 0) or 0)
    if deadline and time.time() > deadline:
        return c.STATUS_EXPIRED
    return snap.record.get("status", c.STATUS_QUEUED)

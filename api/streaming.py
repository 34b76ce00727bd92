"""SSE for sync streaming requests: worker deltas → OpenAI chunks; a client that leaves aborts its request.

A session is given what it needs (the job's replies, the tokenizer, the metrics), not the service that made it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.errors import error_body
from api.formatting import FINISH_ABORT, Formatter
from api.jobs import Job
from api.metrics import Metrics
from api.middleware import BODY_SEND
from api.pump import KEEPALIVE
from api.replies import Replies
from api.responses import SSE_DONE, SSE_KEEPALIVE, sse_event
from engine.tokenizer import WorldTokenizer
from worker import contract as c

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """An SSE response whose session is closed however the response ends (done, disconnect, shutdown)."""

    def __init__(self, session):
        super().__init__(session.events(), media_type="text/event-stream", headers=SSE_HEADERS)
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.body_send = scope.get(BODY_SEND, send)
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.session.close()

    async def stream_response(self, send: Send) -> None:
        """Starlette's, with the body chunks sent below our middlewares (``api.middleware.BODY_SEND``)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self.body_send
        async for chunk in self.body_iterator:
            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})


class StreamSession:
    """One streaming request: its inbox of worker messages, what was sent, and how it ends."""

    def __init__(self, replies: Replies, job: Job, inbox: asyncio.Queue, tokenizer: WorldTokenizer,
                 metrics: Metrics):
        self.replies = replies
        self.metrics = metrics
        self.job = job
        self.inbox = inbox
        self.pending = set(job.request_ids)  # no final yet: cancelled if the stream ends early
        self.results: dict[str, c.Result] = {}
        self.formatter = Formatter(job.shape, tokenizer)
        self.sent: dict[int, str] = {}  # text sent per choice index
        self.tokens_sent: dict[int, int] = {}  # tokens passed on per choice index (deltas of a re-run skip them)
        self.finished: set[int] = set()  # choice indices whose finish_reason was sent
        self.gapped: set[int] = set()  # choices that missed deltas: the rest of their text comes from the result
        self._last_delta: dict[str, float] = {}
        self._first_token_seen = False
        self._itl = metrics.itl.labels(job.endpoint)  # observed per delta: the labelled child looked up once
        self._closed = False
        # echo with logprobs: a choice's echo waits for its prompt logprobs (they come with its first delta)
        self.echo_pending: dict[int, str] = {}
        self.echo_logprobs = bool(job.shape.echo_texts) and job.requests[0].params.get("prompt_logprobs") is not None

    async def events(self) -> AsyncIterator[bytes]:
        """The stream's bytes: what arrived together goes to the client in one write."""
        loop = asyncio.get_running_loop()
        for frame in self._echo():
            yield frame
        try:
            async for batch in self.replies.pump_batches(self.inbox, self.pending, self.replies.deadline(self.job)):
                frames, ended = self._on_batch(batch, loop.time())
                if frames:
                    yield b"".join(frames)
                if ended:
                    return
        except TimeoutError:
            await self.replies.cancel(sorted(self.pending), "request timeout")
            self.pending.clear()
            yield b"".join(self.failed(error_body(f"no result within the request timeout "
                                                  f"({self.replies.timeout_s:g} s); the request was cancelled",
                                                  "timeout", code="timeout")))
            return
        closing = self.completed([self.results[rid] for rid in self.job.request_ids])
        if closing:
            yield b"".join(closing)

    def _on_batch(self, batch: list, now: float) -> tuple[list[bytes], bool]:
        """The frames of messages that arrived together, and whether the stream ended with an error."""
        frames: list[bytes] = []
        for msg in batch:
            if msg is KEEPALIVE:
                frames.append(SSE_KEEPALIVE)
            elif msg["type"] == "delta":
                frames += self._on_delta(msg, now)
            elif msg["type"] == "final":
                error = self._on_final(msg)
                finished, mismatch = self._finish_choices(self.results[msg["id"]], msg["id"])
                frames += finished
                error = error or mismatch
                if error is not None:
                    return frames + self.failed(error), True
        return frames, False

    # -- framing (the Responses API's stream frames the same chunks as its events) --------------

    def frame(self, chunk: dict) -> list[bytes]:
        return [sse_event(chunk)]

    def _send(self, chunk: dict | None) -> list[bytes]:
        return [] if chunk is None else self.frame(chunk)

    def completed(self, results: list[c.Result]) -> list[bytes]:
        frames = []
        if self.job.shape.include_usage:
            frames.append(sse_event(self.formatter.usage_chunk(results, self.job.prompt_tokens)))
        return frames + [SSE_DONE]

    def failed(self, error: dict) -> list[bytes]:
        return [sse_event(error), SSE_DONE]

    async def close(self) -> None:
        """Unsubscribe; a request without its final (the client left, timeout, error) is cancelled."""
        if self._closed:
            return
        self._closed = True
        if self.pending:
            self.replies.cancel_soon(sorted(self.pending), "stream ended before the result")
        await self.replies.release(self.job, self.inbox)

    # -- pieces ------------------------------------------------------------------------------

    def _echo(self) -> list[bytes]:
        echo = self.job.shape.echo_texts
        if not echo:
            return []
        n = self.job.shape.n
        frames = []
        for p, text in enumerate(echo):
            for j in range(n):
                if self.echo_logprobs:
                    self.echo_pending[p * n + j] = text
                    continue
                self.sent[p * n + j] = ""
                frames += self._send(self.formatter.chunk(p * n + j, text))
        return frames

    def _pending_echo(self, index: int, prompt_logprobs: list[dict] | None) -> list[bytes]:
        """The echo of a choice that waited for its prompt logprobs: sent before its first tokens."""
        if index not in self.echo_pending:
            return []
        self.sent[index] = ""
        text = self.echo_pending.pop(index)
        return self._send(self.formatter.chunk(index, text, prompt_logprobs=prompt_logprobs or []))

    def _on_delta(self, msg: dict, now: float) -> list[bytes]:
        rid = msg["id"]
        base = self.job.prompt_index(rid) * self.job.shape.n
        self._observe_timing(rid, now)
        frames = []
        for ch in msg.get("choices", []):
            index = base + ch["index"]
            if index in self.finished:
                continue
            frames += self._pending_echo(index, ch.get("prompt_logprobs"))
            sent = self.sent.get(index, "")
            if index in self.gapped or self._is_gap(ch, len(sent), self.tokens_sent.get(index, 0)):
                if index not in self.gapped:
                    log.warning("deltas missed (pub/sub reconnect?); the rest of the text comes with the result",
                                extra={"request_id": rid, "index": index, "chars_sent": len(sent)})
                    self.gapped.add(index)
                continue
            text, logprobs = c.skip_seen(ch, len(sent), self.tokens_sent.get(index, 0))
            finish = ch.get("finish_reason")
            self.tokens_sent[index] = max(self.tokens_sent.get(index, 0),
                                          ch.get("offset", 0) + len(ch.get("token_ids", ())))
            if not (text or logprobs or finish):
                continue
            first = index not in self.sent
            self.sent[index] = sent + text
            if finish:
                self.finished.add(index)
            frames += self._send(self.formatter.chunk(index, text, logprobs=logprobs, finish_reason=finish,
                                                      role=first and self.job.endpoint == "chat"))
        return frames

    def _observe_timing(self, rid: str, now: float) -> None:
        metrics = self.metrics
        if not self._first_token_seen:
            self._first_token_seen = True
            metrics.ttft.labels(self.job.endpoint).observe(now - self.job.started)
            log.info("first token", extra={"request_id": self.job.id})
        last = self._last_delta.get(rid)
        if last is not None:
            self._itl.observe(now - last)
        self._last_delta[rid] = now

    def _on_final(self, msg: dict) -> dict | None:
        """Keep the result; the error object to send if it failed or expired."""
        result = c.Result.from_dict(msg["result"])
        self.results[msg["id"]] = result
        metrics = self.metrics
        metrics.generation_tokens.labels(self.job.endpoint).inc(result.completion_tokens)
        metrics.e2e.labels(self.job.endpoint).observe(asyncio.get_running_loop().time() - self.job.started)
        log.info("request finished", extra={"request_id": result.id, "status": result.status,
                                            "completion_tokens": result.completion_tokens})
        if result.status in (c.STATUS_FAILED, c.STATUS_EXPIRED):
            err = result.error or {}
            kind = err.get("type", "server_error") if result.status == c.STATUS_FAILED else "timeout"
            return error_body(err.get("message", f"the request {result.status}"), kind, code=err.get("code"))
        return None

    @staticmethod
    def _is_gap(choice: dict, chars_sent: int, tokens_sent: int) -> bool:
        """The delta starts past what was passed on: deltas in between were lost."""
        return choice.get("text_offset", chars_sent) > chars_sent or choice.get("offset", tokens_sent) > tokens_sent

    def _finish_choices(self, result: c.Result, rid: str) -> tuple[list[bytes], dict | None]:
        """Close every choice the deltas did not finish (missed messages, cancel): the rest of its text and
        logprobs from the result. The error to send if what was streamed is not where the result starts."""
        base = self.job.prompt_index(rid) * self.job.shape.n
        frames = []
        for ch in result.choices:
            index = base + ch.index
            if index in self.finished:
                continue
            frames += self._pending_echo(index, ch.prompt_logprobs)
            first = index not in self.sent
            sent = self.sent.get(index, "")
            self.finished.add(index)
            if not ch.text.startswith(sent):  # never report a stream complete with wrong or missing text
                log.error("streamed text differs from the result", extra={"request_id": rid, "index": index})
                return frames, error_body("the streamed text could not be reconciled with the final result; "
                                          "retry the request", "server_error", code="stream_inconsistent")
            rest = ch.text[len(sent):]
            logprobs = ch.logprobs[self.tokens_sent.get(index, 0):] if ch.logprobs is not None else None
            self.sent[index] = sent + rest
            frames += self._send(self.formatter.chunk(index, rest, logprobs=logprobs or None,
                                                      finish_reason=ch.finish_reason or FINISH_ABORT,
                                                      role=first and self.job.endpoint == "chat"))
        return frames, None

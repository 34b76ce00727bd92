"""Plain ASGI middlewares that guard the app: a body-size limit (413) and a last-resort 500 that keeps the
connection open (Starlette's own error middleware re-raises, and uvicorn then resets the connection, failing the
client's next request on it too)."""

from __future__ import annotations

import logging
from typing import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import OpenAIError, record_server_error

log = logging.getLogger(__name__)


# The scope key under which CatchAll leaves the ``send`` it was given. The middlewares inside it only look at a
# response's start (its status, whether it began) and pass body messages on unchanged, so a stream may send its
# body chunks straight to this one: one call per token instead of five nested ones. A middleware that rewrites
# bodies (compression) would have to go outside CatchAll.
BODY_SEND = "gaggle.body_send"


class TrackedSend:
    """An ASGI ``send`` that remembers whether the response has started (then no other response can be sent)."""

    def __init__(self, send: Send):
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class BodyTooLarge(HTTPException):
    """Raised from ``receive``: FastAPI passes HTTPExceptions from body reading on (others become a 400)."""

    def __init__(self, limit: int):
        super().__init__(413, too_large(limit).message)


class BodySizeLimit:
    """413 for a body over ``limit_for(path)`` bytes: by Content-Length before reading, or as it streams in."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int]):
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await too_large(limit).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        tracked = TrackedSend(send)
        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            if not tracked.started:
                await too_large(limit).response()(scope, receive, send)


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


class CatchAll:
    """Any exception the app lets through becomes an OpenAI 500 error object, and the connection stays usable."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[BODY_SEND] = send
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("unhandled error", extra={"path": scope.get("path")})
            if tracked.started:  # mid-response: nothing valid can follow; let the server close the connection
                raise
            await OpenAIError(500, "internal server error", type="server_error").response()(scope, receive, send)
            await record_server_error(scope["app"], 500, scope.get("path", ""), "internal server error")

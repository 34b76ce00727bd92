"""JSON via orjson (NaN becomes null, never invalid JSON) and SSE framing."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


class JSONBytesResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"

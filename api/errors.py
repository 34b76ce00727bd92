"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` for every failure."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.responses import JSONBytesResponse

log = logging.getLogger(__name__)

TYPE_BY_STATUS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                  405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                  429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


PROBES = ("/ready", "/health")  # their 503s say "not ready", they are not errors for the status page


class OpenAIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONBytesResponse:
        return JSONBytesResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code or ("invalid_value" if param else None))


def model_not_found(model: str) -> OpenAIError:
    """As OpenAI words it (and vLLM answers): 404, code model_not_found, param model."""
    return OpenAIError(404, f"The model `{model}` does not exist or you do not have access to it.", param="model",
                       code="model_not_found")


def not_found(what: str, ident: str) -> OpenAIError:
    return OpenAIError(404, f"no {what} with id {ident!r}", code="not_found")


# -- request validation errors ---------------------------------------------------------------

def _is_union_tag(part: object) -> bool:
    """Pydantic puts union member names ('str', 'list[int]', 'chat', ...) into error locations."""
    return isinstance(part, str) and (any(ch in part for ch in "[(-") or part in
                                      ("str", "int", "float", "bool", "list", "dict", "completions", "chat"))


def param_of(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts = [p for p in loc[1:] if not _is_union_tag(p)] if loc and loc[0] == "body" else list(loc[1:])
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if any(_is_union_tag(part) for part in first.get("loc", ())):  # a union: the most specific complaint
        field = first["loc"][:2]
        first = max((e for e in errors if e.get("loc", ())[:2] == field), key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    param = param_of(tuple(first.get("loc", ())))
    if first.get("type") in ("union_tag_not_found", "union_tag_invalid"):
        tag = str((first.get("ctx") or {}).get("discriminator", "")).strip("'")
        expected = (first.get("ctx") or {}).get("expected_tags", "")
        return f"{tag}: required, one of {expected}" if expected else f"{tag}: required", tag or None
    if param is None:
        if first.get("type") == "missing":
            return "the request body is missing: send a JSON object", None
        if isinstance(first.get("input"), bytes):  # not parsed: not declared as JSON
            return "the request body must be a JSON object sent with Content-Type: application/json", None
        return f"the request body must be a JSON object ({first.get('msg', 'invalid')})", None
    msg = f"{param}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1 and any(_is_union_tag(p) for p in first.get("loc", ())):
        msg += " (no accepted form of this field matches)"
    return msg, param


# -- handlers ------------------------------------------------------------------------------

async def _on_openai_error(request: Request, exc: OpenAIError) -> JSONBytesResponse:
    if exc.status < 500 and exc.status not in (401, 404, 429):  # those log where they are raised, or are noise
        log.info("request rejected", extra={"path": request.url.path, "status": exc.status, "reason": exc.message})
    if (exc.status >= 500 or exc.status == 429) and request.url.path not in PROBES:
        await record_server_error(request.app, exc.status, request.url.path, exc.message)
    return exc.response()


async def record_server_error(app, status: int, path: str, message: str) -> None:
    broker = getattr(app.state, "broker", None)
    if broker is not None:
        await broker.record_error(status, path, message)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONBytesResponse:
    message, param = validation_message(exc)
    log.info("request rejected", extra={"path": request.url.path, "status": 400, "reason": message})
    return OpenAIError(400, message, param=param, code="invalid_value" if param else "invalid_body").response()


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONBytesResponse:
    status = exc.status_code
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
    if status == 404:
        message = f"no route {request.method} {request.url.path}"
    code = "request_too_large" if status == 413 else None
    return OpenAIError(status, message, code=code, headers=getattr(exc, "headers", None)).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)

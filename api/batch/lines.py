"""A batch's input file, line by line, into queued requests — with the checks of the live API, from its code.

Every line must be a JSON object with a unique ``custom_id``, ``method`` POST, the batch's ``url`` and a ``body``
the endpoint accepts (the same schema, limits and job building as POST /v1/completions or /v1/chat/completions;
one prompt a line). Any bad line fails the batch before anything is queued, with an error naming the line.
A line's request id is ``<batch id>-<line>``: a line enqueued again after a crash is the same request.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.batch.model import MAX_LINES, Batch
from api.errors import OpenAIError, validation_message
from api.formatting import Shape
from api.jobs import chat_job, completion_job
from api.limits import Limits
from api.schemas import ChatCompletionRequest, CompletionRequest
from api.settings import Settings
from engine.tokenizer import WorldTokenizer
from worker import contract as c


@dataclass
class Line:
    number: int  # 1-based, as editors count
    custom_id: str
    request: c.QueuedRequest
    shape: Shape
    prompt_tokens: int


def line_error(number: int | None, code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": number}


log = logging.getLogger(__name__)


async def parse_lines(data: bytes, batch: Batch, settings: Settings, tokenizer: WorldTokenizer,
                      limits: Limits) -> tuple[list[Line], list[dict]]:
    """The batch's lines, or the errors of every bad line (then nothing may be queued)."""
    raw_lines = [(i, raw) for i, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]
    if not raw_lines:
        return [], [line_error(None, "empty_file", "the input file has no requests")]
    if len(raw_lines) > MAX_LINES:
        return [], [line_error(None, "too_many_requests",
                               f"the input file has {len(raw_lines)} requests; a batch takes at most {MAX_LINES}")]
    lines, errors, seen = [], [], set()
    for number, raw in raw_lines:
        try:
            line = await _parse_line(number, raw, batch, settings, tokenizer, limits, seen)
        except LineError as e:
            errors.append(e.error)
            continue
        lines.append(line)
    return lines, errors


class LineError(Exception):
    def __init__(self, number: int, code: str, message: str, param: str | None = None, custom_id: str | None = None):
        super().__init__(message)
        self.error = line_error(number, code, message, param)
        self.error["_custom_id"] = custom_id  # private: a resumed runner writes the line as failed


async def _parse_line(number: int, raw: bytes, batch: Batch, settings: Settings, tokenizer: WorldTokenizer,
                      limits: Limits, seen: set[str]) -> Line:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise LineError(number, "invalid_json", f"line {number} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LineError(number, "invalid_request", f"line {number} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(number, "missing_required_parameter", f"line {number}: custom_id must be a non-empty string",
                        "custom_id")
    if custom_id in seen:
        raise LineError(number, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is used twice",
                        "custom_id")
    seen.add(custom_id)
    if obj.get("method") != "POST":
        raise LineError(number, "invalid_method", f"line {number}: method must be POST", "method")
    if obj.get("url") != batch.endpoint:
        raise LineError(number, "mismatched_url", f"line {number}: url {obj.get('url')!r} is not the batch's "
                                                  f"endpoint {batch.endpoint!r}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(number, "invalid_request", f"line {number}: body must be a JSON object", "body")
    try:
        job = await _job(body, batch, settings, tokenizer, limits)
    except ValidationError as e:
        message, param = validation_message(RequestValidationError(
            [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors()]))
        raise LineError(number, "invalid_value", f"line {number}: {message}", param, custom_id) from None
    except OpenAIError as e:
        raise LineError(number, e.code or "invalid_request", f"line {number}: {e.message}", e.param,
                        custom_id) from None
    except (RecursionError, ValueError, TypeError, OverflowError) as e:  # a check the API's own would 500 on
        log.exception("batch line failed its checks", extra={"batch_id": batch.id, "line": number})
        raise LineError(number, "invalid_request", f"line {number} could not be checked: {type(e).__name__}",
                        None, custom_id) from None
    req = job.requests[0]
    rid = f"{batch.id}-{number}"
    req.id, req.priority, req.stream, req.record_text = rid, c.BATCH, False, False
    req.deadline = float(batch.expires_at)
    req.meta = {**req.meta, "batch_id": batch.id, "custom_id": custom_id, "line": number}
    job.shape.id = f"{job.shape.id.split('-')[0]}-{batch.id.removeprefix('batch_')}-{number}"  # cmpl-…, chatcmpl-…
    return Line(number, custom_id, req, job.shape, job.prompt_tokens)


async def _job(body: dict, batch: Batch, settings: Settings, tokenizer: WorldTokenizer, limits: Limits):
    """The live API's job for this body (its schema — validated as JSON, as FastAPI does —, limits and checks),
    one prompt."""
    if batch.api_endpoint == "chat":
        return await chat_job(ChatCompletionRequest.model_validate_json(orjson.dumps(body)), batch.tenant, settings,
                              tokenizer, limits, is_async=True)
    return await completion_job(CompletionRequest.model_validate_json(orjson.dumps(body)), batch.tenant, settings,
                                tokenizer, limits, is_async=True)

"""What every router shares: the OpenAPI description of error responses."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


GENERATION_ERRORS = errors(400, 401, 429, 503, 504)

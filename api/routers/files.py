"""The Files API (for batches): POST /v1/files, GET /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content,
DELETE /v1/files/{id}."""

from __future__ import annotations

import asyncio
from typing import Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response, StreamingResponse

from api.auth import get_tenant
from api.batch.files import MAX_UPLOAD_BYTES, read_chunks
from api.batch.service import FileService
from api.errors import OpenAIError, bad_request
from api.limits import current_limits
from api.middleware import BodyTooLarge
from api.settings import Settings, get_settings
from api.state_files import MAX_STATE_FILE_BYTES, STATE_PURPOSE, StateFileRefused, state_file_shape
from api.responses import JSONBytesResponse
from api.routers.common import errors

router = APIRouter(tags=["files"])


def _service(request: Request) -> FileService:
    return request.app.state.files


@router.post("/v1/files", responses=errors(400, 401, 413))
async def create_file(request: Request, tenant: str = Depends(get_tenant),
                      settings: Settings = Depends(get_settings)) -> Response:
    """multipart/form-data: ``file``, ``purpose`` (batch; or rwkv_state: an initial state a request names by the
    file's id), optional ``expires_after[anchor]`` (created_at) and ``expires_after[seconds]``, as the openai SDK
    sends them."""
    try:
        form = await request.form(max_files=1, max_fields=16)
    except BodyTooLarge:  # a chunked body over the limit, found as it streamed in
        raise
    except Exception as e:  # not multipart, malformed, too many parts
        raise bad_request(f"the body must be multipart/form-data with a file: {e}", "file") from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("file: required (a multipart file part)", "file")
        purpose = form.get("purpose")
        if not isinstance(purpose, str):
            raise bad_request("purpose: required", "purpose")
        upload.file.seek(0, 2)
        if upload.file.tell() > MAX_UPLOAD_BYTES:
            raise OpenAIError(413, f"the file is larger than {MAX_UPLOAD_BYTES} bytes", code="file_too_large")
        upload.file.seek(0)
        expires = _expires_after(form)
        if purpose == STATE_PURPOSE:
            data = await _checked_state_file(request, upload, settings)
            meta = await _service(request).create(tenant, upload.filename or "state.pth", purpose, iter([data]),
                                                  expires, uploaded_state=data)
        else:
            meta = await _service(request).create(tenant, upload.filename or "upload.jsonl", purpose,
                                                  read_chunks(upload.file), expires)
    finally:
        await form.close()
    return JSONBytesResponse(meta.openai())


async def _checked_state_file(request: Request, upload: UploadFile, settings: Settings) -> bytes:
    """An initial state's bytes, checked (a state-tuning file, of the live workers' model's shape) before
    anything is stored."""
    upload.file.seek(0, 2)
    if upload.file.tell() > MAX_STATE_FILE_BYTES:
        raise OpenAIError(413, f"a state file is at most {MAX_STATE_FILE_BYTES} bytes", code="file_too_large")
    upload.file.seek(0)
    data = await asyncio.to_thread(upload.file.read)
    try:
        shape = await asyncio.to_thread(state_file_shape, data)
    except StateFileRefused as e:
        raise bad_request(f"file: not a usable state file: {e}", "file", "invalid_state_file") from None
    want = (await current_limits(request.app.state.generation.broker, settings)).state_shape
    if want is not None and tuple(shape) != tuple(want):
        raise bad_request(f"file: a state of {shape[0]} layers of {shape[1]} heads of size {shape[2]}; the workers' "
                          f"model needs {want[0]} layers of {want[1]} heads of size {want[2]}", "file",
                          "invalid_state_file")
    return data


def _expires_after(form) -> int | None:
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise bad_request("expires_after[anchor] must be 'created_at'", "expires_after")
    if not isinstance(seconds, str) or not seconds.isdigit():
        raise bad_request("expires_after[seconds] must be a whole number of seconds", "expires_after")
    return int(seconds)


@router.get("/v1/files", responses=errors(401))
async def list_files(request: Request, tenant: str = Depends(get_tenant), after: str | None = None,
                     limit: int = Query(10_000, ge=1, le=10_000), order: Literal["asc", "desc"] = "desc",
                     purpose: str | None = None) -> Response:
    return JSONBytesResponse(await _service(request).list(tenant, after, limit, order, purpose))


@router.get("/v1/files/{file_id}", responses=errors(401, 404))
async def get_file(file_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    return JSONBytesResponse((await _service(request).get(tenant, file_id)).openai())


@router.get("/v1/files/{file_id}/content", response_class=Response, responses=errors(401, 404))
async def file_content(file_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    service = _service(request)
    meta = await service.get(tenant, file_id)
    return StreamingResponse(service.content(meta), media_type="application/octet-stream",
                             headers={"Content-Length": str(meta.bytes),
                                      "Content-Disposition": content_disposition(meta.filename)})


def content_disposition(filename: str) -> str:
    """An attachment header for any file name: an ASCII fallback, and the name itself as RFC 5987 UTF-8."""
    fallback = "".join(ch if 32 <= ord(ch) < 127 and ch not in '"\\' else "_" for ch in filename) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


@router.delete("/v1/files/{file_id}", responses=errors(401, 404))
async def delete_file(file_id: str, request: Request, tenant: str = Depends(get_tenant)) -> Response:
    return JSONBytesResponse(await _service(request).delete(tenant, file_id))

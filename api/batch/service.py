"""The API's side of files and batches: metadata in Redis (async), bytes in the file store (in threads), batch
jobs handed to RQ. Everything is scoped to the caller's tenant: another tenant's id is a 404, as an unknown one."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator

import redis
import redis.asyncio as aioredis
from rq import Queue

from api.batch.files import (MAX_EXPIRY_S, MIN_EXPIRY_S, UPLOAD_PURPOSES, FileMeta, FileStore, new_file_id,
                             read_chunks)
from api.batch.model import (CANCELLING, ENDPOINTS, TERMINAL, TRANSITION, WINDOWS, Batch, new_batch_id,
                             transition_args)
from api.errors import OpenAIError, bad_request, not_found
from api.settings import Settings
from worker import contract as c

log = logging.getLogger(__name__)

JOB_GRACE_S = 3600  # an RQ job may outlive the completion window by this much (finishing, cancelling)


class FileService:
    def __init__(self, client: aioredis.Redis, store: FileStore):
        self.redis = client
        self.store = store

    async def create(self, tenant: str, filename: str, purpose: str, chunks: Iterator[bytes],
                     expires_after_s: int | None, uploaded_state: bytes | None = None) -> FileMeta:
        """``uploaded_state``: the file is an initial state (its bytes): also put where workers read it."""
        if purpose not in UPLOAD_PURPOSES:
            raise bad_request(f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}", "purpose")
        if expires_after_s is not None and not MIN_EXPIRY_S <= expires_after_s <= MAX_EXPIRY_S:
            raise bad_request(f"expires_after[seconds] must be between {MIN_EXPIRY_S} and {MAX_EXPIRY_S}",
                              "expires_after")
        file_id = new_file_id()
        size = await asyncio.to_thread(self.store.write, file_id, chunks)
        now = int(time.time())
        meta = FileMeta(id=file_id, tenant=tenant, filename=filename, bytes=size, created_at=now, purpose=purpose,
                        expires_at=now + (expires_after_s or c.BATCH_TTL_S))
        pipe = self.redis.pipeline(transaction=True)
        meta.record(pipe)
        if uploaded_state is not None:
            key = c.uploaded_state_key(file_id)
            pipe.hset(key, mapping={"tenant": tenant, "data": uploaded_state})
            pipe.expireat(key, meta.expires_at)
        await pipe.execute()
        log.info("file stored", extra={"file_id": file_id, "tenant": tenant, "bytes": size})
        return meta

    async def get(self, tenant: str, file_id: str) -> FileMeta:
        return await owned(self.redis, c.file_key(file_id), FileMeta.decode, tenant, "file", file_id)

    async def list(self, tenant: str, after: str | None, limit: int, order: str, purpose: str | None) -> dict:
        index = c.files_index(tenant)
        ids = [i.decode() for i in await self.redis.zrange(index, 0, -1, desc=order == "desc")]
        metas = await self._metas(ids)
        expired = [file_id for file_id, meta in zip(ids, metas) if meta is None]
        if expired:  # their metadata expired: drop them from the index too
            await self.redis.zrem(index, *expired)
        kept = [m for m in metas if m is not None and (purpose is None or m.purpose == purpose)]
        return page([m.openai() for m in kept], after, limit)

    async def _metas(self, ids: list[str]) -> list[FileMeta | None]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in ids:
            pipe.hgetall(c.file_key(file_id))
        return [FileMeta.decode(raw) if raw else None for raw in await pipe.execute()]

    def content(self, meta: FileMeta) -> Iterator[bytes]:
        f = self.store.open(meta.id)
        try:
            yield from read_chunks(f)
        finally:
            f.close()

    async def delete(self, tenant: str, file_id: str) -> dict:
        meta = await self.get(tenant, file_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(c.file_key(file_id), c.uploaded_state_key(file_id))
        pipe.zrem(c.files_index(tenant), file_id)
        await pipe.execute()
        await asyncio.to_thread(self.store.delete, meta.id)
        log.info("file deleted", extra={"file_id": file_id, "tenant": tenant})
        return {"id": file_id, "object": "file", "deleted": True}


class BatchService:
    def __init__(self, client: aioredis.Redis, files: FileService, settings: Settings):
        self.redis = client
        self.files = files
        self.settings = settings
        self.queue = Queue(c.BATCH_QUEUE, connection=redis.Redis.from_url(settings.redis_url))
        self._transition = client.register_script(TRANSITION)

    async def create(self, tenant: str, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict | None, output_expires_s: int | None) -> Batch:
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        if completion_window not in WINDOWS:
            raise bad_request(f"completion_window must be one of {sorted(WINDOWS)}", "completion_window")
        check_metadata(metadata)
        try:
            meta = await self.files.get(tenant, input_file_id)
        except OpenAIError:
            raise bad_request(f"no file with id {input_file_id!r}", "input_file_id") from None
        if meta.purpose != "batch":
            raise bad_request(f"file {input_file_id!r} was not uploaded with purpose 'batch'", "input_file_id")
        now = int(time.time())
        window = self.settings.batch_completion_window_s or WINDOWS[completion_window]
        batch = Batch(id=new_batch_id(), tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
                      completion_window=completion_window, created_at=now, expires_at=now + window,
                      metadata=metadata, output_expires_s=output_expires_s or 0)
        pipe = self.redis.pipeline(transaction=True)
        batch.create(pipe)
        pipe.sadd(c.BATCHES_ACTIVE, batch.id)
        await pipe.execute()
        await asyncio.to_thread(enqueue_batch, self.queue, self.queue.connection, batch.id, window)
        log.info("batch created", extra={"batch_id": batch.id, "tenant": tenant, "input_file_id": input_file_id})
        return batch

    async def get(self, tenant: str, batch_id: str) -> Batch:
        return await owned(self.redis, c.batch_key(batch_id), Batch.decode, tenant, "batch", batch_id)

    async def cancel(self, tenant: str, batch_id: str) -> Batch:
        batch = await self.get(tenant, batch_id)
        if batch.status not in TERMINAL:
            await self._transition(keys=[c.batch_key(batch_id)], args=transition_args(CANCELLING))
            log.info("batch cancel requested", extra={"batch_id": batch_id, "tenant": tenant})
        return await self.get(tenant, batch_id)

    async def list(self, tenant: str, after: str | None, limit: int) -> dict:
        ids = [i.decode() for i in await self.redis.zrange(c.batches_index(tenant), 0, -1, desc=True)]
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(c.batch_key(batch_id))
        raws = await pipe.execute()
        expired = [batch_id for batch_id, raw in zip(ids, raws) if not raw]
        if expired:  # their records expired: out of the index too (it would grow with every batch ever made)
            await self.redis.zrem(c.batches_index(tenant), *expired)
        batches = [Batch.decode(raw).openai() for raw in raws if raw]
        return page(batches, after, limit)


async def owned(client: aioredis.Redis, key: str, decode, tenant: str, what: str, ident: str):
    """The record at ``key`` if the tenant owns it; a 404 alike for a missing one and another tenant's."""
    raw = await client.hgetall(key)
    record = decode(raw) if raw and b"id" in raw else None
    if record is None or record.tenant != tenant:
        raise not_found(what, ident)
    return record


def enqueue_batch(queue: Queue, client: redis.Redis, batch_id: str, window_s: int) -> None:
    """Queue an RQ job that runs (or resumes) a batch: a job id per attempt, remembered on the batch."""
    job_id = f"run-{batch_id}-{uuid.uuid4().hex[:8]}"
    queue.enqueue("api.batch.runner.run_batch", batch_id, job_id=job_id, job_timeout=window_s + JOB_GRACE_S,
                  result_ttl=3600, failure_ttl=7 * 24 * 3600)
    client.hset(c.batch_key(batch_id), "job_id", job_id)


def page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's cursor page: the items after the one with id ``after``, at most ``limit``."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


def check_metadata(metadata: dict | None) -> None:
    """OpenAI's rule: up to 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > 16 or any(not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512
                                 for k, v in metadata.items()):
        raise bad_request("metadata: at most 16 string keys of up to 64 characters with string values of up to "
                          "512", "metadata")

"""Files of the Batch API: bytes in a file store, metadata in Redis, both scoped to a tenant.

The store is a directory by default (``--files-dir``), shared by the API and the batch workers (one host, or a
shared volume); anything with the ``FileStore`` methods can stand in. Uploads are written under a temporary name
and renamed, so nobody reads half a file; batch outputs are appended in place by their one runner, a line at a
time (see api/batch/runner.py), and registered as files once the batch ends.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol

from worker import contract as c

UPLOAD_PURPOSES = ("batch", "rwkv_state")  # rwkv_state: an initial state (api.state_files)
OUTPUT_PURPOSE = "batch_output"
MAX_UPLOAD_BYTES = 200 * 1024 * 1024
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600  # OpenAI's range for expires_after.seconds
CHUNK = 1 << 20


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


@dataclass
class FileMeta:
    id: str
    tenant: str
    filename: str
    bytes: int
    created_at: int
    purpose: str
    expires_at: int | None = None

    def openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}

    def record(self, pipe) -> None:
        """Queue the metadata's writes on a redis pipeline (sync or asyncio): the hash, its TTL, the index."""
        key = c.file_key(self.id)
        pipe.hset(key, mapping={k: "" if v is None else v for k, v in asdict(self).items()})
        pipe.expire(key, self.ttl_s())
        pipe.zadd(c.files_index(self.tenant), {self.id: self.created_at})

    def ttl_s(self) -> int:
        until = self.expires_at or self.created_at + c.BATCH_TTL_S
        return max(1, until - int(time.time()))

    @classmethod
    def decode(cls, raw: dict) -> FileMeta:
        h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        return cls(id=h["id"], tenant=h["tenant"], filename=h["filename"], bytes=int(h["bytes"]),
                   created_at=int(h["created_at"]), purpose=h["purpose"],
                   expires_at=int(h["expires_at"]) if h.get("expires_at") else None)


class FileStore(Protocol):
    def write(self, file_id: str, chunks: Iterator[bytes]) -> int: ...
    def open(self, file_id: str) -> BinaryIO: ...
    def appender(self, file_id: str) -> BinaryIO: ...
    def size(self, file_id: str) -> int: ...
    def truncate(self, file_id: str, size: int) -> None: ...
    def delete(self, file_id: str) -> None: ...


class DirectoryStore:
    """One file per id under ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():  # ids are ours; refuse anything path-like
            raise ValueError(f"bad file id {file_id!r}")
        return self.root / file_id

    def write(self, file_id: str, chunks: Iterator[bytes]) -> int:
        """Write all of ``chunks`` under a temporary name, then rename: the bytes written."""
        tmp = self._path(file_id).with_suffix(".part")
        size = 0
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(self._path(file_id))
        return size

    def open(self, file_id: str) -> BinaryIO:
        return open(self._path(file_id), "rb")

    def appender(self, file_id: str) -> BinaryIO:
        return open(self._path(file_id), "ab")

    def size(self, file_id: str) -> int:
        path = self._path(file_id)
        return path.stat().st_size if path.exists() else 0

    def truncate(self, file_id: str, size: int) -> None:
        os.truncate(self._path(file_id), size)

    def delete(self, file_id: str) -> None:
        self._path(file_id).unlink(missing_ok=True)


def read_chunks(f: BinaryIO, size: int = CHUNK) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk

"""A batch's record in Redis (one hash, fields written separately so the API and the runner never overwrite each
other's) and the OpenAI batch object made from it. Status changes go through one script that checks the current
status: ``validating → in_progress → finalizing → completed``, or ``failed``, ``expired``,
``cancelling → cancelled``, each with its timestamp."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import orjson

from worker import contract as c

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
TERMINAL = (COMPLETED, FAILED, EXPIRED, CANCELLED)
RUNNABLE = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)  # a runner has work to do
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
WINDOWS = {"24h": 24 * 3600}
MAX_LINES = 50_000

# KEYS[1] batch key. ARGV: new status, now, then the statuses it may come from.
# Sets the status and its "<status>_at" if the current one is allowed; returns the status before.
TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
for i = 3, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return current
  end
end
return current
"""

NEXT = {  # status -> the statuses it may be reached from
    IN_PROGRESS: (VALIDATING,),
    FINALIZING: (IN_PROGRESS, CANCELLING),
    COMPLETED: (FINALIZING,),
    FAILED: (VALIDATING, IN_PROGRESS),
    EXPIRED: (IN_PROGRESS,),
    CANCELLING: (VALIDATING, IN_PROGRESS),
    CANCELLED: (FINALIZING, CANCELLING),
}


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


@dataclass
class Batch:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = VALIDATING
    model: str = ""
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] | None = None  # validation errors: {"code", "message", "param", "line"}
    metadata: dict | None = None
    output_expires_s: int = 0  # the output files' lifetime (0: the default)
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    times: dict[str, int] = field(default_factory=dict)  # "<status>_at" -> unix seconds

    @property
    def api_endpoint(self) -> str:
        return ENDPOINTS[self.endpoint]

    def openai(self) -> dict:
        obj = {"id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model or None,
               "errors": {"object": "list", "data": self.errors} if self.errors else None,
               "input_file_id": self.input_file_id, "completion_window": self.completion_window,
               "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
               "created_at": self.created_at, "expires_at": self.expires_at,
               "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
               "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": self.input_tokens + self.output_tokens},
               "metadata": self.metadata}
        for status in (IN_PROGRESS, FINALIZING, COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED):
            obj[f"{status}_at"] = self.times.get(f"{status}_at")
        return obj

    def create(self, pipe) -> None:
        """Queue the new record's writes on a redis pipeline (sync or asyncio)."""
        key = c.batch_key(self.id)
        pipe.hset(key, mapping={
            "id": self.id, "tenant": self.tenant, "endpoint": self.endpoint, "input_file_id": self.input_file_id,
            "completion_window": self.completion_window, "created_at": self.created_at,
            "expires_at": self.expires_at, "status": self.status, "metadata": orjson.dumps(self.metadata),
            "output_expires_s": self.output_expires_s, "total": 0, "completed": 0, "failed": 0,
            "input_tokens": 0, "output_tokens": 0})
        pipe.expire(key, c.BATCH_TTL_S)
        pipe.zadd(c.batches_index(self.tenant), {self.id: self.created_at})
        # entries whose records have expired (BATCH_TTL_S after creation) leave the index
        pipe.zremrangebyscore(c.batches_index(self.tenant), "-inf", self.created_at - c.BATCH_TTL_S)

    @classmethod
    def decode(cls, raw: dict) -> Batch:
        h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        ints = {k: int(h.get(k) or 0) for k in ("created_at", "expires_at", "output_expires_s", "total",
                                                   "completed", "failed", "input_tokens", "output_tokens")}
        return cls(id=h["id"], tenant=h["tenant"], endpoint=h["endpoint"], input_file_id=h["input_file_id"],
                   completion_window=h["completion_window"], status=h["status"], model=h.get("model", ""),
                   output_file_id=h.get("output_file_id") or None, error_file_id=h.get("error_file_id") or None,
                   errors=orjson.loads(h["errors"]) if h.get("errors") else None,
                   metadata=orjson.loads(h["metadata"]) if h.get("metadata") else None,
                   times={k: int(v) for k, v in h.items() if k.endswith("_at") and k not in ("created_at",
                                                                                             "expires_at")},
                   **ints)


def transition_args(status: str) -> list:
    return [status, int(time.time()), *NEXT[status]]

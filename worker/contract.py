"""The queue contract: every Redis key and channel name, and every message's schema.

Both ``api/`` and ``worker/`` import this module (it imports no torch). A change
to the wire format is one change here; ``SCHEMA_VERSION`` moves with it and a
reader rejects versions it does not know.

Key space (all under ``gaggle:``):

    requests:<priority>:<tenant>
                           stream  API → workers, consumer group "workers"; one per tenant and priority
                                   (interactive, then batch: batch-job lines), read fairly across tenants
    tenants                zset    tenant -> time of its last enqueue: the streams workers read
    dead                   stream  entries delivered too often, or undecodable (capped: DEAD_LETTER_MAXLEN)
    out:<id>               pubsub  worker → API: deltas (streaming only) and the final result, one message a PUBLISH
    reply:<owner>          pubsub  worker → one API process: the same messages for every request that names it
                                   (reply_to), several a PUBLISH, b"\n"-separated (see split_messages)
    aborts                 pubsub  API → all workers: request ids to abort
    cancel:<id>            string  cancel marker with TTL (for requests not yet picked up)
    result:<id>            string  final result with TTL (written once, NX)
    req:<id>               hash    request record: status, tenant, endpoint, created, worker
                                   (+ model, n, deadline written by the API: see request_record)
    text:<id>:<index>      string  text so far of one choice (async requests only), TTL RESULT_TTL_S
    watch:<id>             string  set (TTL) while an /events stream watches an async request: its deltas are
                                   published only then (the API fills the gap from text:<id> by text_offset)
    warming:<name>         string  a starting worker's warm-up progress with TTL (JSON: stages and counts), until its
                                   first heartbeat
    warming                zset    warming worker name -> time of its last progress report
    worker:<name>          string  heartbeat with TTL (JSON: slots, tokens/s, device, model, its limits); a
                                   consumer's pending entries are reclaimed by others once it has expired
    workers                zset    worker name -> last heartbeat time; readers MGET the fresh ones
    response:<id>          string  a stored Responses API response (JSON: tenant, the response object, the
                                   conversation so far as chat messages), TTL the API's response_ttl_s
    pstate:<ns>:<digest>   string  a prompt prefix's recurrent state, shared by workers (engine.state_blob bytes;
                                   TTL, refreshed on use): ns = model, numerics and initial state, digest = the
                                   prefix's tokens (worker.prefix_digests); written and read by worker.shared_states only
    pstate-idx:<ns>:<digest>  hash  the shared states whose prefix starts with a STATE_BLOCK-aligned prefix of
                                   that digest: state digest -> "<tokens>[:l]" (l: its last logits are kept)
    pstate-lru             zset    state key -> last use: the shared states' byte cap evicts the least recent
    pstate-sizes           hash    state key -> bytes;  pstate-bytes  string: their total
    held:<digest>          string  the worker that holds a prefix state at least as long as the STATE_BLOCK-aligned
                                   prefix of that digest (TTL HELD_TTL_S): the API prefers it for prompts on that
                                   path (entry field "prefer")
    handoff:<worker>       list    entries another worker read and handed to this one ("<stream> <entry id> <time>"):
                                   already pending under its name (XCLAIM), taken before its own reads, put back
                                   in their stream as new entries when not taken within ROUTE_WAIT_S
    restarts               hash    child of `gaggle up` -> times its supervisor restarted it (API /metrics)
    istate:<file id>       hash    an initial state uploaded with POST /v1/files (purpose rwkv_state): tenant, data
                                   (the .pth bytes); workers load it when a request of that tenant names it
    api:<owner>            string  an API process's lease (TTL OWNER_TTL_S, refreshed every OWNER_REFRESH_S):
                                   workers cancel the sync requests of an owner whose lease lapsed

Every per-request key (req, result, text, cancel, watch) carries a TTL.

Streams are trimmed with XDEL only after XACK, so XLEN = queued + in flight.
"""

from __future__ import annotations

import hashlib

import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

from engine.params import MAX_TOKEN_ID, SamplingParams

SCHEMA_VERSION = 1
PREFIX = "gaggle:"
GROUP = "workers"
INTERACTIVE, BATCH = "interactive", "batch"  # a request's priority: a client waits on it, or a batch-job line
PRIORITIES = (INTERACTIVE, BATCH)  # read in this order
ENDPOINTS = ("completions", "chat")
DEFAULT_TENANT = "default"
TENANTS = PREFIX + "tenants"
STREAM_DEAD = PREFIX + "dead"
DEAD_LETTER_MAXLEN = 10_000  # approximate (XADD MAXLEN ~): the newest dead letters are kept
CHANNEL_ABORTS = PREFIX + "aborts"
ENTRY_FIELD = b"data"

RESULT_TTL_S = 24 * 3600
REQUEST_RECORD_TTL_S = 24 * 3600
CANCEL_TTL_S = 24 * 3600
# A worker beats every HEARTBEAT_INTERVAL_S; once its key has expired, other workers take its pending entries:
# a stream on a killed worker resumes within about HEARTBEAT_TTL_S.
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TTL_S = 3.0
# An API process refreshes its lease every OWNER_REFRESH_S; workers cancel the sync requests of an owner whose
# lease has been gone for OWNER_GRACE_S (a Redis restart may drop it for a moment).
OWNER_TTL_S = 4.0
OWNER_REFRESH_S = 1.0
OWNER_GRACE_S = 3.0
DEFAULT_DEADLINE_S = {"interactive": 3600.0, "batch": 24 * 3600.0}
# Bounds of a queue entry (the worker checks its own, tighter limits too: slots, vocabulary, max_model_len; the
# params' limits are in engine.params). The API admits no more than MAX_N choices (api.limits).
MAX_ID_CHARS = 256
MAX_N = 1024


def request_stream(priority: str, tenant: str) -> str:
    """The stream of one tenant's requests of one priority."""
    return f"{PREFIX}requests:{priority}:{tenant}"


def stream_priority_tenant(stream: str) -> tuple[str, str]:
    """The (priority, tenant) of a request_stream name."""
    priority, _, tenant = stream.removeprefix(f"{PREFIX}requests:").partition(":")
    return priority, tenant


def owner_key(owner: str) -> str:
    """The lease of an API process (see OWNER_TTL_S)."""
    return f"{PREFIX}api:{owner}"

STATUS_QUEUED, STATUS_RUNNING = "queued", "running"
STATUS_COMPLETED, STATUS_FAILED, STATUS_CANCELLED, STATUS_EXPIRED = "completed", "failed", "cancelled", "expired"
TERMINAL_STATUSES = (STATUS_COMPLETED, STATUS_FAILED, STATUS_CANCELLED, STATUS_EXPIRED)


def out_channel(request_id: str) -> str:
    return f"{PREFIX}out:{request_id}"


REPLY_PREFIX = PREFIX + "reply:"


def reply_channel(owner: str) -> str:
    """An API process's one channel for the requests it waits for: a worker publishes one message per step
    for all of them (not one per request per token: at 1,024 streams per worker that was ~1 PUBLISH a token)."""
    return REPLY_PREFIX + owner


def channel_of(req: "QueuedRequest") -> str:
    """Where a request's messages go: its reply_to channel, else its own."""
    return req.reply_to or out_channel(req.id)


def split_messages(data: bytes) -> list[bytes]:
    """The messages of one PUBLISH on a reply channel (an encoded message never holds a raw newline)."""
    return data.split(b"\n")


def result_key(request_id: str) -> str:
    return f"{PREFIX}result:{request_id}"


def request_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}"


def text_key(request_id: str, index: int) -> str:
    """Text generated so far by choice ``index`` (async requests with record_text)."""
    return f"{PREFIX}text:{request_id}:{index}"


WATCH_TTL_S = 60  # the API refreshes a watch every WATCH_TTL_S / 3 while its event stream is open


def watch_key(request_id: str) -> str:
    """Present while someone streams an async request's events; workers publish its deltas only then."""
    return f"{PREFIX}watch:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}cancel:{request_id}"


def heartbeat_key(worker_name: str) -> str:
    return f"{PREFIX}worker:{worker_name}"


WORKER_REGISTRY = PREFIX + "workers"  # sorted set: worker name -> time of its last heartbeat (no keyspace SCAN)
WORKER_REGISTRY_RETENTION_S = 3600.0  # names silent this long are dropped; liveness is the heartbeat key's TTL


def warming_key(worker_name: str) -> str:
    return f"{PREFIX}warming:{worker_name}"


WARMING_REGISTRY = PREFIX + "warming"  # sorted set: warming worker name -> time of its last progress report
WARMING_TTL_S = 15.0  # a warming worker refreshes its key every WARMING_REFRESH_S, also while a stage is silent
WARMING_REFRESH_S = 2.0


# -- files and batches (the Batch API; api/batch/) ------------------------------------------------
#    file:<id>              hash    a stored file's metadata (its bytes are in the file store); TTL to its expiry
#    files:<tenant>         zset    file id -> created_at, for listing
#    batch:<id>             hash    a batch's fields (status, timestamps, counts, ...); TTL BATCH_TTL_S
#    batches:<tenant>       zset    batch id -> created_at, for listing
#    batches:active         set     batches not yet in a terminal state (batch workers resume those nobody runs)
#    errors                 list    the API's latest 5xx, 429 and 503 answers (the status page), RECENT_ERRORS_KEPT
#    batch-lease:<id>       string  held (TTL) by the one batch runner executing the batch
#    rq:queue:gaggle-batches        RQ's queue of batch jobs (BATCH_QUEUE)

RECENT_ERRORS = PREFIX + "errors"  # list: the API's latest server-side errors (the status page), capped
RECENT_ERRORS_KEPT = 100
BATCH_QUEUE = "gaggle-batches"
BATCH_TTL_S = 30 * 24 * 3600  # batch records, and batch files without an explicit expiry
BATCH_LEASE_TTL_S = 6.0  # renewed every poll (0.2 s); a dead runner is found this long after
BATCHES_ACTIVE = PREFIX + "batches:active"


# Prefix-aware routing: a request whose prompt (at least ROUTE_MIN_TOKENS long) starts with a prefix a live worker
# advertises holding carries that worker's name ("prefer"); the worker that reads it hands it over while it is fresh.
ROUTE_MIN_TOKENS = 256
ROUTE_WAIT_S = 0.5  # a handed-over entry its worker has not taken by then goes back to its stream
HELD_TTL_S = 300
ENTRY_PREFER = b"prefer"


def held_key(block_digest: str) -> str:
    return f"{PREFIX}held:{block_digest}"


def handoff_key(worker_name: str) -> str:
    return f"{PREFIX}handoff:{worker_name}"


def preferred_worker(fields: dict) -> str:
    """The worker an entry prefers ("" for none)."""
    value = fields.get(ENTRY_PREFER) or fields.get(ENTRY_PREFER.decode())
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else ""


STATE_BLOCK = 64  # shared states are indexed under the digest of their prefix rounded down to this many tokens
STATE_LRU = PREFIX + "pstate-lru"
STATE_SIZES = PREFIX + "pstate-sizes"
STATE_BYTES = PREFIX + "pstate-bytes"


def state_key(namespace: str, digest: str) -> str:
    """A shared prefix state (see the key space above)."""
    return f"{PREFIX}pstate:{namespace}:{digest}"


def state_index_key(namespace: str, block_digest: str) -> str:
    return f"{PREFIX}pstate-idx:{namespace}:{block_digest}"


def response_key(response_id: str) -> str:
    return f"{PREFIX}response:{response_id}"


def file_key(file_id: str) -> str:
    return f"{PREFIX}file:{file_id}"


RESTARTS = PREFIX + "restarts"


UPLOADED_STATE_PREFIX = "file-"  # a request's "state" naming an uploaded state file (its file id), not a --state


def uploaded_state_key(file_id: str) -> str:
    """An uploaded initial state (hash: tenant, data = the .pth bytes), TTL the file's."""
    return f"{PREFIX}istate:{file_id}"


def files_index(tenant: str) -> str:
    return f"{PREFIX}files:{tenant}"


def batch_key(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}"


def batches_index(tenant: str) -> str:
    return f"{PREFIX}batches:{tenant}"


def batch_worker_key(name: str) -> str:
    """A named batch worker's liveness (TTL): a restart under its name after it died may take the name over."""
    return f"{PREFIX}batch-worker:{name}"


def batch_lease_key(batch_id: str) -> str:
    return f"{PREFIX}batch-lease:{batch_id}"


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class SchemaError(ValueError):
    """A message that cannot be decoded, or of a schema version this code does not know."""


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def loads_versioned(data: bytes | str) -> dict:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise SchemaError(f"undecodable message: {e}") from e
    if not isinstance(obj, dict):
        raise SchemaError("message is not a JSON object")
    if obj.get("v") != SCHEMA_VERSION:
        raise SchemaError(f"unknown schema version {obj.get('v')!r} (this code speaks {SCHEMA_VERSION})")
    return obj


# -- request: API → worker ----------------------------------------------------------------

@dataclass
class QueuedRequest:
    """One generation request as it travels in a stream entry."""
    id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams.to_wire(): engine.params.SamplingParams fields, as JSON
    n: int = 1
    endpoint: str = "completions"  # completions | chat
    model: str = ""
    tenant: str = DEFAULT_TENANT
    stream: bool = False  # publish per-token deltas
    record_text: bool = False  # keep "text so far" in the request record (async requests)
    priority: str = "interactive"  # interactive | batch
    created: float = field(default_factory=time.time)
    deadline: float = 0.0  # epoch seconds; 0 = created + DEFAULT_DEADLINE_S[priority]
    meta: dict = field(default_factory=dict)  # echoed back in the result (e.g. batch custom_id)
    owner: str = ""  # the API process waiting for it (see owner_key); "" = nobody (async, batch)
    reply_to: str = ""  # a reply channel (reply_channel) shared with other requests; "" = out_channel(id)

    # Not a field: the params, type-checked, set by decode() (a worker's only view of them).
    sampling = None

    def __post_init__(self) -> None:
        if not self.deadline:
            self.deadline = self.created + DEFAULT_DEADLINE_S.get(self.priority, 3600.0)

    @property
    def stream_key(self) -> str:
        return request_stream(self.priority, self.tenant)

    def encode(self) -> dict[bytes, bytes]:
        # shallow: asdict() deep-copies the params and the token list only for orjson to read them (a hot path)
        return {ENTRY_FIELD: dumps({"v": SCHEMA_VERSION, **{f.name: getattr(self, f.name) for f in _QUEUED_FIELDS}})}

    def enqueue(self, pipe, prefer: str = "") -> None:
        """Queue on a redis pipeline (sync or asyncio; MULTI for all-or-nothing) what submits this request: its
        tenant in the registry (workers read the streams listed there), its record with a TTL, its stream entry
        (``prefer``: the worker that holds its prompt's prefix, see ROUTE_MIN_TOKENS)."""
        pipe.zadd(TENANTS, {self.tenant: self.created})
        key = request_key(self.id)
        pipe.hset(key, mapping=request_record(self))
        pipe.expire(key, REQUEST_RECORD_TTL_S)
        entry = self.encode()
        if prefer:
            entry[ENTRY_PREFER] = prefer.encode()
        pipe.xadd(self.stream_key, entry)

    @classmethod
    def decode(cls, fields: dict) -> "QueuedRequest":
        """The entry's request, every field type- and bounds-checked, params as SamplingParams in ``sampling``
        (SamplingParams.from_wire: their types, then the one validation the API ran too: an entry may be
        forged); SchemaError naming the first bad field. Nothing is built before its input passed."""
        raw = fields.get(ENTRY_FIELD) or fields.get(ENTRY_FIELD.decode())
        if raw is None:
            raise SchemaError("stream entry has no 'data' field")
        obj = loads_versioned(raw)
        obj.pop("v")
        unknown = set(obj) - _REQUEST_FIELDS.keys()
        if unknown:
            raise SchemaError(f"bad request message: unknown fields {sorted(unknown)}")
        for name, check in _REQUEST_FIELDS.items():
            if name in obj:
                check(name, obj[name])
        for name in ("id", "prompt_token_ids", "params"):
            if name not in obj:
                raise SchemaError(f"bad request message: {name} is missing")
        try:
            sampling = SamplingParams.from_wire(obj["params"])
        except ValueError as e:
            raise SchemaError(f"bad request message: params: {e}") from None
        req = cls(**obj)
        req.sampling = sampling
        return req


def _expect(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise SchemaError(f"bad request message: {name} must be {what}")


def _wire_str(limit: int, choices: tuple[str, ...] = ()):
    def check(name: str, value: object) -> None:
        _expect(type(value) is str and len(value) <= limit, name, f"a string of at most {limit} characters")
        if choices:
            _expect(value in choices, name, f"one of {list(choices)}")
    return check


def _wire_int(low: int, high: int):
    def check(name: str, value: object) -> None:
        _expect(type(value) is int and low <= value <= high, name, f"an integer between {low} and {high}")
    return check


def _wire_time(name: str, value: object) -> None:
    _expect(type(value) in (int, float) and 0 <= value < 1e11, name, "a time in epoch seconds")


def _wire_bool(name: str, value: object) -> None:
    _expect(type(value) is bool, name, "true or false")


def _wire_dict(name: str, value: object) -> None:
    _expect(type(value) is dict, name, "an object")


def _wire_tokens(name: str, value: object) -> None:
    _expect(type(value) is list, name, "a list of token ids")
    _expect(all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value), name,
            f"a list of integer token ids between 0 and {MAX_TOKEN_ID}")


_REQUEST_FIELDS = {
    "id": lambda name, value: (_wire_str(MAX_ID_CHARS)(name, value), _expect(bool(value), name, "non-empty")),
    "prompt_token_ids": _wire_tokens,
    "params": _wire_dict,
    "n": _wire_int(1, MAX_N),
    "endpoint": _wire_str(32, ENDPOINTS),
    "model": _wire_str(1024),
    "tenant": lambda name, value: (_wire_str(MAX_ID_CHARS)(name, value), _expect(bool(value), name, "non-empty")),
    "stream": _wire_bool,
    "record_text": _wire_bool,
    "priority": _wire_str(32, PRIORITIES),
    "created": _wire_time,
    "deadline": _wire_time,
    "meta": _wire_dict,
    "owner": _wire_str(MAX_ID_CHARS),
    "reply_to": lambda name, value: _expect(value == "" or _is_reply_channel(value), name,
                                            f"'' or a channel starting {REPLY_PREFIX!r}"),
}


_QUEUED_FIELDS = fields(QueuedRequest)


def entry_time(entry_id: bytes | str) -> float | None:
    """When Redis added a stream entry (its id is "<unix ms>-<seq>" unless a client chose it), in seconds."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = raw.partition("-")
    return int(ms) / 1000 if ms.isdigit() and seq.isdigit() else None


def request_id_of(fields: dict) -> str | None:
    """Best-effort request id of an entry that may not decode (for failing it cleanly): only a plausible id."""
    raw = fields.get(ENTRY_FIELD) or fields.get(ENTRY_FIELD.decode())
    try:
        rid = orjson.loads(raw).get("id")
    except Exception:
        return None
    return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else None


def reply_to_of(fields: dict) -> str:
    """Best-effort reply channel of an entry that may not decode (its final goes there): only a valid one."""
    raw = fields.get(ENTRY_FIELD) or fields.get(ENTRY_FIELD.decode())
    try:
        value = orjson.loads(raw).get("reply_to")
    except Exception:
        return ""
    return value if _is_reply_channel(value) else ""


def _is_reply_channel(value: object) -> bool:
    return (type(value) is str and value.startswith(REPLY_PREFIX)
            and len(value) <= len(REPLY_PREFIX) + MAX_ID_CHARS)


# -- outputs: worker → API ----------------------------------------------------------------
# Published on channel_of(request) (its reply_to channel, several messages of any requests per PUBLISH, or
# out_channel(id), one per PUBLISH), in this order per request: status, deltas, final (the final only once
# result_key(id) is set).
#   {"v":1, "type":"delta", "id":..., "choices":[{"index", "text", "token_ids", "offset", "text_offset",
#                                                 "logprobs"?, "prompt_logprobs"?, "finish_reason"?,
#                                                 "stop_reason"?}]}
#       At most one entry per index. An entry carries the next one or more tokens of that choice: a worker
#       publishes one delta per request per Redis write, and a write covers every step since the last one
#       (one step while Redis keeps up). text and token_ids are those tokens' text and ids, in order; logprobs
#       (when asked for) one entry per token; prompt_logprobs (when asked for: params.prompt_logprobs) on the
#       choice's first delta, one entry per prompt token, the first with logprob null; finish_reason and
#       stop_reason are set on the choice's last delta.
#       Concatenating a choice's deltas in order gives the final result's text and token_ids.
#       Deltas are at most once, like pub/sub itself (a worker retries a failed write without them): a reader
#       that missed some takes the rest of the text from the final result.
#       offset / text_offset: how many tokens / characters of the choice came before this entry. A request
#       reclaimed from a dead worker is generated again from its prompt with the same seed (fixed from its id),
#       so its deltas start again at offset 0: readers skip what they already passed on (see skip_seen).
#   {"v":1, "type":"status", "id":..., "status":"running"}
#   {"v":1, "type":"final", "id":..., "result": <Result dict>}
#   {"v":1, "type":"mark", "id":..., "token":...}  API-internal sync point (see mark_message); workers never send it
# Readers skip message types they do not know.

def skip_seen(choice: dict, chars_seen: int, tokens_seen: int) -> tuple[str, list | None]:
    """The text and logprobs of a delta entry a reader has not passed on yet, given how many characters and
    tokens of that choice it passed on: a re-generated prefix (after a reclaim) is dropped."""
    text, logprobs = choice.get("text", ""), choice.get("logprobs")
    skip = chars_seen - choice.get("text_offset", chars_seen)
    if skip > 0:
        text = text[skip:]
    skip = tokens_seen - choice.get("offset", tokens_seen)
    if skip > 0 and logprobs:
        logprobs = logprobs[skip:]
    return text, logprobs


def stable_seed(request_id: str) -> int:
    """The sampling seed of a request that gave none: fixed by its id, so any worker that runs it again
    (after a crash) generates the same tokens."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") >> 1


def delta_head(request_id: str) -> bytes:
    """A delta message up to its choices array (the worker encodes it once per request)."""
    return b'{"v":%d,"type":"delta","id":%s,"choices":' % (SCHEMA_VERSION, dumps(request_id))


def delta_message(request_id: str, choices: list[dict], head: bytes | None = None) -> bytes:
    # Formatted rather than one dumps(): orjson's own bytes objects are slow to keep in bulk (a write holds
    # thousands), a formatted copy is not. Same bytes either way.
    return b"%s%s}" % (head or delta_head(request_id), dumps(choices))


def status_message(request_id: str, status: str) -> bytes:
    return dumps({"v": SCHEMA_VERSION, "type": "status", "id": request_id, "status": status})


def final_message(request_id: str, encoded_result: bytes) -> bytes:
    """The final message embeds the already-encoded result (encoded once)."""
    return b'{"v":%d,"type":"final","id":%s,"result":%s}' % (SCHEMA_VERSION, dumps(request_id), encoded_result)


def mark_message(request_id: str, token: str) -> bytes:
    """A marker the API publishes on out_channel(id) in the same MULTI as a snapshot read (text so far, result):
    messages received before the marker are already in the snapshot, those after it are not."""
    return dumps({"v": SCHEMA_VERSION, "type": "mark", "id": request_id, "token": token})


def request_record(req: QueuedRequest) -> dict:
    """Fields of request_key(id) the API writes before XADD; workers then set status, worker, started, finished."""
    return {"status": STATUS_QUEUED, "tenant": req.tenant, "endpoint": req.endpoint, "model": req.model,
            "n": req.n, "created": req.created, "deadline": req.deadline}


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None  # [{"token_id", "logprob", "top": [[id, lp], ...]}]
    prompt_logprobs: list[dict] | None = None  # the same per prompt token (the first: logprob None), when asked


@dataclass
class Result:
    """The final result of a request, stored under result_key(id)."""
    v: int = SCHEMA_VERSION
    id: str = ""
    status: str = STATUS_COMPLETED
    endpoint: str = "completions"
    model: str = ""
    tenant: str = "default"
    created: float = 0.0
    finished: float = field(default_factory=time.time)
    choices: list[Choice] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those started from a prefix-cache checkpoint (not prefilled)
    error: dict | None = None  # {"message", "type", "code"}
    worker: str = ""
    meta: dict = field(default_factory=dict)
    # queued_s, ttft_s, e2e_s; added_s (its stream entry's time) and read_s (when the worker's reader had it)
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def encode(self) -> bytes:
        return dumps(self)  # orjson serialises dataclasses natively (fast)

    @classmethod
    def from_dict(cls, obj: dict) -> "Result":
        own = {f.name for f in fields(cls)} - {"v"}  # fields a newer worker adds are ignored
        obj = {k: v for k, v in obj.items() if k in own}
        known = {f.name for f in fields(Choice)}
        obj["choices"] = [Choice(**{k: v for k, v in c.items() if k in known}) for c in obj.get("choices", [])]
        return cls(**obj)

    @classmethod
    def decode(cls, data: bytes | str) -> "Result":
        return cls.from_dict(loads_versioned(data))


def error_result(req_id: str, status: str, message: str, code: str, *, worker: str = "",
                 queued: QueuedRequest | None = None, err_type: str | None = None) -> Result:
    """A terminal result that carries no generation: failed, cancelled or expired. ``err_type``: the OpenAI
    error type (default: server_error for failed, invalid_request_error otherwise); a failed request that a
    worker refused as invalid is an invalid_request_error (the API answers it with a 400)."""
    base = dict(endpoint=queued.endpoint, model=queued.model, tenant=queued.tenant, created=queued.created,
                meta=queued.meta) if queued else {}
    err_type = err_type or ("server_error" if status == STATUS_FAILED else "invalid_request_error")
    return Result(id=req_id, status=status, worker=worker,
                  error={"message": message, "type": err_type, "code": code}, **base)


@dataclass
class Heartbeat:
    name: str
    pid: int
    host: str
    device: str
    model: str
    num_slots: int
    running: int
    free_slots: int
    tokens_per_s: float
    started: float
    ts: float = field(default_factory=time.time)
    draining: bool = False
    max_model_len: int = 0  # prompt + output tokens the worker's engine accepts (0: not reported)
    vocab_size: int = 0  # the model's vocabulary (0: not reported)
    prefix_lookups: int = 0  # prompts looked up in the prefix cache since the worker started
    prefix_hits: int = 0  # ... started from a checkpoint
    prefix_tokens_saved: int = 0  # prompt tokens taken from checkpoints instead of prefilled
    prefix_bytes: int = 0  # checkpoints held, device and host tiers
    shared_lookups: int = 0  # prompts looked up in the shared tier (Redis) of the prefix cache
    shared_hits: int = 0  # ... started from a state fetched from it
    shared_tokens: int = 0  # prompt tokens those fetched states saved
    shared_published: int = 0  # states this worker wrote there
    states: list[str] = field(default_factory=list)  # initial states a request may name (--state)
    state_shape: list[int] = field(default_factory=list)  # [layers, heads, head size] of its model's wkv state

    def encode(self) -> bytes:
        return dumps({"v": SCHEMA_VERSION, **asdict(self)})

    def publish(self, pipe) -> None:
        """Queue the heartbeat's commands on a redis pipeline: the key with its TTL (the first reply: the value it
        replaced, None where the last beat had expired), and the registry entry."""
        pipe.set(heartbeat_key(self.name), self.encode(), px=int(HEARTBEAT_TTL_S * 1000), get=True)
        pipe.zadd(WORKER_REGISTRY, {self.name: self.ts})
        pipe.zremrangebyscore(WORKER_REGISTRY, "-inf", self.ts - WORKER_REGISTRY_RETENTION_S)

    @classmethod
    def decode(cls, data: bytes | str) -> "Heartbeat":
        """Fields a newer worker adds are ignored, ones an older worker lacks take their defaults."""
        return _decode_known_fields(cls, data)


@dataclass
class WarmupStatus:
    """A starting worker's progress (``warming:<name>``): what ``/ready`` and the status page show until its
    first heartbeat. ``stages``: the active ones, each {"name", "done", "total"}."""
    name: str
    host: str
    device: str
    model: str
    stages: list[dict]
    elapsed_s: float
    ts: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return dumps({"v": SCHEMA_VERSION, **asdict(self)})

    def publish(self, pipe) -> None:
        pipe.set(warming_key(self.name), self.encode(), px=int(WARMING_TTL_S * 1000))
        pipe.zadd(WARMING_REGISTRY, {self.name: self.ts})
        pipe.zremrangebyscore(WARMING_REGISTRY, "-inf", self.ts - WORKER_REGISTRY_RETENTION_S)

    @staticmethod
    def withdraw(pipe, name: str) -> None:
        pipe.delete(warming_key(name))
        pipe.zrem(WARMING_REGISTRY, name)

    def describe(self) -> str:
        """``prefill graphs 40/85 (47%) · sampler kernels 7/16 (43%) · 38 s``"""
        parts = [f"{s['name']} {s['done']}/{s['total']} ({100 * s['done'] // max(s['total'], 1)}%)"
                 for s in self.stages] or ["starting"]
        return " · ".join(parts + [f"{self.elapsed_s:.0f} s"])

    @classmethod
    def decode(cls, data: bytes | str) -> "WarmupStatus":
        return _decode_known_fields(cls, data)


def _decode_known_fields(cls, data: bytes | str):
    """A versioned message as ``cls``: fields a newer writer adds are ignored, ones an older lacks default."""
    obj = loads_versioned(data)
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in obj.items() if k in known})

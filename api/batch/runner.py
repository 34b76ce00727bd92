"""Executes one batch: validate its lines, feed them to the request streams in a bounded window, collect the
results in bulk, append them to the output and error files, finish. Runs as an RQ job on a batch worker
(``gaggle batch-worker``); one runner a batch at a time (a lease in Redis).

Crash safety: the output and error files are the record of what is done. A runner that starts (first, or after
another died) reads them, drops a half-written last line, and skips every line they hold; a line already queued
or finished (its request id ``<batch>-<line>`` has a record or a result) is collected, never queued again. So no
finished line is generated twice and none is lost; the files never hold a line twice or a truncated line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import orjson
import redis

from api.batch.files import OUTPUT_PURPOSE, DirectoryStore, FileMeta, FileStore
from api.batch.lines import Line, parse_lines
from api.batch.model import (CANCELLED, CANCELLING, COMPLETED, EXPIRED, FAILED, FINALIZING, IN_PROGRESS, NEXT,
                             TERMINAL, TRANSITION, VALIDATING, Batch, transition_args)
from api.formatting import Formatter
from api.limits import Limits
from api.settings import Settings
from engine.tokenizer import WorldTokenizer
from worker import contract as c

log = logging.getLogger(__name__)

POLL_S = 0.2
MGET_CHUNK = 1000
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


MAX_CRASHES = 3  # runs of a batch that raised: then it fails, rather than be resumed forever


def run_batch(batch_id: str) -> str:
    """The RQ job: run (or resume) a batch; its status when this runner stops. It runs in RQ's forked work horse,
    which stops with its batch worker (it resumes from the files), never runs on alone."""
    from worker.lifeline import die_with_parent
    die_with_parent()
    settings = Settings()
    return BatchRunner(batch_id, settings, DirectoryStore(settings.files_dir), tokenizer=shared_tokenizer()).run()


@functools.cache
def shared_tokenizer() -> WorldTokenizer:
    """Loaded once by the batch worker before RQ forks a process per job (~3 s saved a job)."""
    return WorldTokenizer.default()


def output_file_id(batch_id: str, kind: str) -> str:
    return f"file-{batch_id}-{kind}"


@dataclass
class Progress:
    done: set[int] = field(default_factory=set)  # line numbers written to either file
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class LostLease(Exception):
    pass


class BatchRunner:
    def __init__(self, batch_id: str, settings: Settings, store: FileStore, window: int | None = None,
                 tokenizer: WorldTokenizer | None = None):
        self.batch_id = batch_id
        self.settings = settings
        self.store = store
        self.window = window or settings.batch_window
        self.redis = redis.Redis.from_url(settings.redis_url, socket_timeout=30)
        self.tokenizer = tokenizer
        self.token = uuid.uuid4().hex
        self._stopping: tuple[str, str] | None = None  # (code, message) of a cancel or expiry under way
        self._renew = self.redis.register_script(RENEW)
        self._transition = self.redis.register_script(TRANSITION)

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> str:
        if not self.redis.set(c.batch_lease_key(self.batch_id), self.token, nx=True,
                              px=int(c.BATCH_LEASE_TTL_S * 1000)):
            log.info("batch is run elsewhere", extra={"batch_id": self.batch_id})
            return "leased"
        try:
            return self._run()
        except LostLease:
            log.warning("batch lease lost; another runner carries on", extra={"batch_id": self.batch_id})
            return "lost"
        except Exception as e:  # a bug or a poison input: the batch fails after MAX_CRASHES runs, not loops
            log.exception("batch run crashed", extra={"batch_id": self.batch_id})
            if self.redis.hincrby(c.batch_key(self.batch_id), "crashes", 1) >= MAX_CRASHES:
                batch = self.load()
                if batch is not None and batch.status not in TERMINAL:
                    error = {"code": "batch_crashed", "param": None, "line": None,
                             "message": f"the batch failed {MAX_CRASHES} times running: {type(e).__name__}: "
                                        f"{str(e)[:200]}"}
                    self.redis.hset(c.batch_key(batch.id), mapping={"errors": orjson.dumps([error])})
                    return self._end(batch, FAILED)
            raise
        finally:
            self.redis.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end", 1,
                            c.batch_lease_key(self.batch_id), self.token)

    def _run(self) -> str:
        batch = self.load()
        if batch is None or batch.status in TERMINAL:
            self.redis.srem(c.BATCHES_ACTIVE, self.batch_id)
            return batch.status if batch else "missing"
        self.tokenizer = self.tokenizer or WorldTokenizer.default()
        try:
            lines, errors = self._validate(batch)
        except FileNotFoundError:
            # deleted, or this worker's --files-dir is not the API's: failed, saying so (the job would fail the
            # same way wherever RQ retried it on this worker, and the batch would sit in validating)
            where = str(getattr(self.store, "root", type(self.store).__name__))
            log.error("batch input file not in this worker's file store",
                      extra={"batch_id": batch.id, "file_id": batch.input_file_id, "files_dir": where})
            missing = {"code": "file_not_found", "param": "input_file_id", "line": None,
                       "message": f"input file {batch.input_file_id} is not in the batch worker's file store "
                                  f"({where}): it was deleted, or the API and its batch workers do not share "
                                  "one --files-dir"}
            self.redis.hset(c.batch_key(batch.id), mapping={"errors": orjson.dumps([missing])})
            return self._end(batch, FAILED)
        if errors and batch.status == VALIDATING:
            public = [{k: v for k, v in e.items() if not k.startswith("_")} for e in errors[:1000]]
            self.redis.hset(c.batch_key(batch.id), mapping={"errors": orjson.dumps(public)})
            return self._end(batch, FAILED)
        if batch.status == VALIDATING:
            self.redis.hset(c.batch_key(batch.id), mapping={"total": len(lines), "model": self.settings.model_name})
            self._move(batch, IN_PROGRESS)
        log.info("batch running", extra={"batch_id": batch.id, "lines": len(lines), "status": batch.status})
        outcome = self._execute(batch, lines, errors)
        return self._finish(batch, outcome)

    def _validate(self, batch: Batch) -> tuple[list[Line], list[dict]]:
        with self.store.open(batch.input_file_id) as f:
            data = f.read()
        limits = Limits.of(self.settings, self._live_workers())
        return asyncio.run(parse_lines(data, batch, self.settings, self.tokenizer, limits))

    def _live_workers(self) -> list[c.Heartbeat]:
        names = [n.decode() for n in self.redis.zrange(c.WORKER_REGISTRY, 0, -1)]
        beats = self.redis.mget([c.heartbeat_key(n) for n in names]) if names else []
        return [c.Heartbeat.decode(b) for b in beats if b]

    # -- execution ---------------------------------------------------------------------------------

    def _execute(self, batch: Batch, lines: list[Line], rejected: list[dict]) -> str:
        """Until every line is written or the batch is cancelled or expires; which of the three. ``rejected``:
        lines that passed validation when the batch started but not now (the workers' limits changed)."""
        by_id = {line.request.id: line for line in lines}
        progress = self._recover(batch, by_id)
        self._write_rejected(batch, rejected, progress)
        waiting = [line for line in lines if line.number not in progress.done]
        in_flight = self._already_submitted(waiting)
        waiting = [line for line in waiting if line.request.id not in in_flight]
        while True:
            self._keep_lease()
            status = self.redis.hget(c.batch_key(batch.id), "status")
            if status == CANCELLING.encode():
                return self._stop(batch, in_flight, waiting, progress, "batch_cancelled",
                                  "the batch was cancelled before this request ran", CANCELLED)
            if time.time() >= batch.expires_at:
                return self._stop(batch, in_flight, waiting, progress, "batch_expired",
                                  "this request could not be executed before the completion window expired", EXPIRED)
            waiting = self._submit(waiting, in_flight)
            self._collect(batch, in_flight, progress)
            if not in_flight and not waiting:
                return COMPLETED
            time.sleep(POLL_S)

    def _submit(self, waiting: list[Line], in_flight: dict[str, Line]) -> list[Line]:
        room = self.window - len(in_flight)
        if room <= 0 or not waiting:
            return waiting
        take, rest = waiting[:room], waiting[room:]
        pipe = self.redis.pipeline(transaction=False)
        for line in take:
            line.request.created = time.time()
            line.request.enqueue(pipe)
            in_flight[line.request.id] = line
        pipe.execute()
        return rest

    def _collect(self, batch: Batch, in_flight: dict[str, Line], progress: Progress) -> None:
        """Write every finished line (one MGET per thousand in flight), then the counts."""
        ids = list(in_flight)
        ok, bad = [], []
        for i in range(0, len(ids), MGET_CHUNK):
            chunk = ids[i:i + MGET_CHUNK]
            for rid, raw in zip(chunk, self.redis.mget([c.result_key(r) for r in chunk])):
                if raw:
                    line = in_flight.pop(rid)
                    result = c.Result.decode(raw)
                    record, good = self._result_line(line, result)
                    (ok if good else bad).append((line, record, result))
        self._write(batch, ok, bad, progress)

    def _result_line(self, line: Line, result: c.Result) -> tuple[dict, bool]:
        """The file line of a finished request, and whether it goes to the output (not the error) file:
        completed → output; failed → error, with the status code the live API would answer; cancelled or
        expired (the batch's cancel or window) → error, as a batch error."""
        if result.status == c.STATUS_COMPLETED:
            line.shape.created = int(result.created or time.time())
            body = Formatter(line.shape, self.tokenizer).response([result], line.prompt_tokens)
            return response_line(line, 200, body), True
        if result.status == c.STATUS_CANCELLED:  # by the batch's cancel, or its window's end (see _stop)
            code, message = self._stopping or ("batch_cancelled", "the batch was cancelled while this request ran")
            return batch_error_line(line, code, message), False
        if result.status == c.STATUS_EXPIRED:
            return batch_error_line(line, "batch_expired", "the completion window ended while this request ran"), False
        err = result.error or {"message": "the request failed", "type": "server_error"}
        status = 400 if err.get("type") == "invalid_request_error" else 500
        return response_line(line, status, {"error": {"message": err.get("message"), "type": err.get("type"),
                                                      "param": None, "code": err.get("code")}}), False

    def _write(self, batch: Batch, ok: list, bad: list, progress: Progress) -> None:
        for entries, kind in ((ok, "output"), (bad, "errors")):
            if not entries:
                continue
            with self.store.appender(output_file_id(batch.id, kind)) as f:
                f.write(b"".join(orjson.dumps(record) + b"\n" for _, record, _ in entries))
                f.flush()
                os.fsync(f.fileno())
        for line, _, result in ok:
            progress.done.add(line.number)
            progress.completed += 1
            progress.input_tokens += result.prompt_tokens
            progress.output_tokens += result.completion_tokens
        for line, _, _ in bad:
            progress.done.add(line.number)
            progress.failed += 1
        if ok or bad:
            self.redis.hset(c.batch_key(batch.id), mapping={
                "completed": progress.completed, "failed": progress.failed, "input_tokens": progress.input_tokens,
                "output_tokens": progress.output_tokens})

    def _stop(self, batch: Batch, in_flight: dict[str, Line], waiting: list[Line], progress: Progress, code: str,
              message: str, outcome: str) -> str:
        """Cancel what runs (what finishes meanwhile is kept), fail what never ran."""
        self._stopping = (code, message)
        if in_flight:
            pipe = self.redis.pipeline(transaction=False)
            for rid in in_flight:
                pipe.set(c.cancel_key(rid), 1, ex=c.CANCEL_TTL_S)
                pipe.publish(c.CHANNEL_ABORTS, rid)
            pipe.execute()
        deadline = time.monotonic() + 30.0
        while in_flight and time.monotonic() < deadline:  # cancelled requests answer within a step
            self._keep_lease()
            self._collect(batch, in_flight, progress)
            if in_flight:
                time.sleep(POLL_S)
        never = [(line, batch_error_line(line, code, message), None) for line in [*in_flight.values(), *waiting]]
        self._write(batch, [], never, progress)
        log.info("batch stopped", extra={"batch_id": batch.id, "outcome": outcome, "unrun": len(never)})
        return outcome

    def _write_rejected(self, batch: Batch, rejected: list[dict], progress: Progress) -> None:
        entries = []
        for error in rejected:
            custom_id = error.get("_custom_id")
            if custom_id is None or error.get("line") in progress.done:
                continue
            line = Line(error["line"], custom_id, c.QueuedRequest(id=f"{batch.id}-{error['line']}", prompt_token_ids=[],
                                                                  params={}), None, 0)
            entries.append((line, response_line(line, 400, {"error": {"message": error["message"],
                                                                      "type": "invalid_request_error",
                                                                      "param": error.get("param"),
                                                                      "code": error["code"]}}), None))
        self._write(batch, [], entries, progress)

    # -- recovery ------------------------------------------------------------------------------------

    def _recover(self, batch: Batch, by_id: dict[str, Line]) -> Progress:
        """What the files already hold (a half-written last line is dropped)."""
        progress = Progress()
        by_custom = {line.custom_id: line for line in by_id.values()}
        for kind in ("output", "errors"):
            file_id = output_file_id(batch.id, kind)
            for record in self._complete_lines(file_id):
                line = by_custom.get(record.get("custom_id"))
                if line is None or line.number in progress.done:
                    continue
                progress.done.add(line.number)
                if kind == "output":
                    progress.completed += 1
                    usage = ((record.get("response") or {}).get("body") or {}).get("usage") or {}
                    progress.input_tokens += usage.get("prompt_tokens", 0)
                    progress.output_tokens += usage.get("completion_tokens", 0)
                else:
                    progress.failed += 1
        if progress.done:
            log.info("batch resumed", extra={"batch_id": batch.id, "lines_done": len(progress.done)})
        return progress

    def _complete_lines(self, file_id: str) -> list[dict]:
        size = self.store.size(file_id)
        if not size:
            return []
        with self.store.open(file_id) as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a crash mid-line: cut it off before appending more
            self.store.truncate(file_id, end)
        return [orjson.loads(raw) for raw in data[:end].split(b"\n") if raw]

    def _already_submitted(self, lines: list[Line]) -> dict[str, Line]:
        """Lines a previous runner queued (their record exists) or that finished: collected, not queued again."""
        if not lines:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for line in lines:
            pipe.exists(c.request_key(line.request.id))
            pipe.exists(c.result_key(line.request.id))
        found = pipe.execute()
        return {line.request.id: line for i, line in enumerate(lines) if found[2 * i] or found[2 * i + 1]}

    # -- the record ----------------------------------------------------------------------------------

    def load(self) -> Batch | None:
        raw = self.redis.hgetall(c.batch_key(self.batch_id))
        return Batch.decode(raw) if raw and b"id" in raw else None  # gone (expired, or never made)

    def _move(self, batch: Batch, status: str) -> bool:
        before = self._transition(keys=[c.batch_key(batch.id)], args=transition_args(status))
        moved = before is not None and before.decode() in NEXT[status]
        if moved:
            batch.status = status
            log.info("batch status", extra={"batch_id": batch.id, "status": status})
        return moved

    def _keep_lease(self) -> None:
        if not self._renew(keys=[c.batch_lease_key(self.batch_id)],
                           args=[self.token, int(c.BATCH_LEASE_TTL_S * 1000)]):
            raise LostLease

    def _finish(self, batch: Batch, outcome: str) -> str:
        """Register the output files, then the terminal status (completed through finalizing)."""
        if outcome == COMPLETED:
            self._move(batch, FINALIZING)
        fields = {}
        for kind, key in (("output", "output_file_id"), ("errors", "error_file_id")):
            file_id = output_file_id(batch.id, kind)
            size = self.store.size(file_id)
            if size:
                self._register(batch, file_id, size, kind)
                fields[key] = file_id
        if fields:
            self.redis.hset(c.batch_key(batch.id), mapping=fields)
        return self._end(batch, outcome)

    def _register(self, batch: Batch, file_id: str, size: int, kind: str) -> None:
        now = int(time.time())
        expires = now + batch.output_expires_s if batch.output_expires_s else None
        meta = FileMeta(id=file_id, tenant=batch.tenant, filename=f"{batch.id}_{kind}.jsonl", bytes=size,
                        created_at=now, purpose=OUTPUT_PURPOSE, expires_at=expires)
        pipe = self.redis.pipeline(transaction=True)
        meta.record(pipe)
        pipe.execute()

    def _end(self, batch: Batch, status: str) -> str:
        self._move(batch, status)
        self.redis.srem(c.BATCHES_ACTIVE, batch.id)
        log.info("batch ended", extra={"batch_id": batch.id, "status": batch.status})
        return batch.status


def batch_error_line(line: Line, code: str, message: str) -> dict:
    return {"id": f"batch_req_{line.request.id}", "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def response_line(line: Line, status_code: int, body: dict) -> dict:
    return {"id": f"batch_req_{line.request.id}", "custom_id": line.custom_id,
            "response": {"status_code": status_code, "request_id": line.request.id, "body": body}, "error": None}

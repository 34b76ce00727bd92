"""Redis I/O for a worker, off the GPU loop's critical path.

Three daemon threads:
- reader (worker/reader.py): takes entries from the streams up to the engine's free capacity, fairly across
  tenants; reclaims the entries of workers whose heartbeat expired; writes the heartbeat;
- writer: folds each step's outputs into their requests and writes them out: the
  streaming deltas as plain pipelined PUBLISHes, then everything else (results,
  acknowledgements, async requests' text) as one MULTI/EXEC; one round trip,
  coalescing steps when Redis is slower than the GPU (a request's deltas of those
  steps become one message), retrying across restarts. It frames the commands as
  raw RESP and reads the replies with hiredis itself (redis-py spends ~10 µs of
  Python per pipelined command);
- aborts: a pub/sub subscription to the abort channel.
The main loop only touches queues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import hiredis
import redis

from worker import contract as c
from worker.reader import CANCELLED, Incoming, Reader, ReaderConfig
from worker.resp import bulk, command
from worker.results import logprob_dicts

log = logging.getLogger(__name__)

__all__ = ["Incoming", "Op", "RedisIO", "ReaderConfig"]

Op = tuple
"""One command for the writer. A write runs, in submission order, first every ``publish`` and every streaming
delta as plain PUBLISH commands, then everything else in one MULTI/EXEC (a request's status, deltas, final
are published in that order on its channel). Deltas are at most once, like pub/sub itself: a write that
fails is retried without them (their prefix may have run); the final result is what counts.

    ("start", InFlight)                        a request now runs: the writer folds its outputs in from now on
    ("outputs", [SequenceOutput, ...], time)   one engine step's outputs (at wall-clock time): the writer folds
                                               them into their requests, publishes/appends the deltas, and
                                               writes the result of each request they finish (RedisIO.end_ops)
    ("end", InFlight, terminal)                the step thread ended a running request (cancel, deadline):
                                               its terminal result, with what it generated (RedisIO.end_ops);
                                               terminal None: drop it without a result (dead-lettered)
    ("publish", channel, data)                 PUBLISH ahead of the transaction (a request's status)
    ("xack_del", stream, entry_id)             XACK + XDEL, then the entry is no longer ours
    ("HSET", key, field, value, ...)           any other Redis command, verbatim (upper case), in the
                                               transaction: ("PUBLISH", ...) for what must follow a SET

str, bytes, int and float arguments are accepted (floats as repr)."""

# The deltas of async requests (recorded text): PUBLISH and APPEND in one script call inside the transaction,
# so that the API's snapshot (text so far + a marker, in one MULTI) sees both or neither. Single-instance only.
# ARGV: number of (channel, message) pairs, the text keys' TTL, the pairs, then (text key, text) pairs.
PUBLISH_MANY = """
local n = tonumber(ARGV[1])
for i = 3, 2 * n + 1, 2 do redis.call('PUBLISH', ARGV[i], ARGV[i + 1]) end
for i = 2 * n + 3, #ARGV, 2 do
  redis.call('APPEND', ARGV[i], ARGV[i + 1])
  redis.call('EXPIRE', ARGV[i], ARGV[2])
end
return n
"""
PUBLISH_MANY_BYTES = PUBLISH_MANY.encode()
MULTI, EXEC = command("MULTI"), command("EXEC")


def delta_choice(flight, out) -> dict:
    """One engine SequenceOutput of ``flight`` as a delta message's choice entry."""
    choice = {"index": out.index, "text": out.text, "token_ids": out.token_ids}
    if flight.wants_logprobs and out.logprobs:
        choice["logprobs"] = logprob_dicts(out.logprobs)
    if out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = logprob_dicts(out.prompt_logprobs)
    if out.finished:
        choice["finish_reason"], choice["stop_reason"] = out.finish_reason, out.stop_reason
    return choice


class _NotSent(redis.ConnectionError):
    """Redis could not be reached: nothing of the write ran."""


def merged_delta(flight, outs: list) -> bytes:
    """The delta message of ``flight``'s outputs ``outs`` (in step order): one entry per choice."""
    if flight.simple:
        last = outs[-1]
        tail = (b',"finish_reason":%s,"stop_reason":%s' % (c.dumps(last.finish_reason), c.dumps(last.stop_reason))
                if last.finished else b"")
        text = "".join([out.text for out in outs])
        tokens = [t for out in outs for t in out.token_ids]
        return simple_delta(flight, text, tokens, tail)
    by_index: dict[int, dict] = {}
    for out in outs:
        merge_choice(by_index, delta_choice(flight, out))
    for i, choice in by_index.items():  # where this delta starts in the choice's tokens and text
        choice["offset"] = len(flight.choices[i].token_ids) - len(choice["token_ids"])
        choice["text_offset"] = flight.text_len[i] - len(choice["text"])
    return c.delta_message(flight.id, list(by_index.values()), flight.delta_head)


def simple_delta(flight, text: str, tokens: list[int], tail: bytes = b"") -> bytes:
    """The delta message of a one-choice request without logprobs whose outputs so far end with these."""
    return b'%s[{"index":0,"text":%s,"token_ids":%s,"offset":%d,"text_offset":%d%s}]}' % (
        flight.delta_head, c.dumps(text), c.dumps(tokens), len(flight.choices[0].token_ids) - len(tokens),
        flight.text_len[0] - len(text), tail)


def merge_choice(by_index: dict[int, dict], choice: dict) -> None:
    """Append ``choice`` to the same index's earlier delta: text and token_ids concatenated, logprobs
    concatenated (one entry per token), finish_reason and stop_reason of the last."""
    prev = by_index.get(choice["index"])
    if prev is None:
        by_index[choice["index"]] = choice
        return
    prev["text"] += choice["text"]
    prev["token_ids"] = prev["token_ids"] + choice["token_ids"]
    if "logprobs" in choice:
        prev["logprobs"] = prev.get("logprobs", []) + choice["logprobs"]
    if "prompt_logprobs" in choice:
        prev["prompt_logprobs"] = choice["prompt_logprobs"]
    if "finish_reason" in choice:
        prev["finish_reason"], prev["stop_reason"] = choice["finish_reason"], choice["stop_reason"]


class RedisIO:
    def __init__(self, redis_url: str, name: str, cfg: ReaderConfig, heartbeat: Callable[[], c.Heartbeat]):
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=30, health_check_interval=10)
        self.name = name
        self._flights: dict = {}  # request id -> InFlight, running requests (the writer's; the reader copies it)
        self.reader = Reader(self.redis, name, cfg, heartbeat, lambda: list(self._flights.values()))
        self._outbox: queue.Queue[list[Op]] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unflushed = 0
        self._flushed = threading.Condition()
        self._conn = None  # the writer thread's own connection
        # (InFlight, terminal) -> the ops that write its result; set by the Worker; runs on the writer thread
        self.end_ops: Callable[[object, tuple | None], list[Op]] = lambda flight, terminal: []
        self.text_ttl_s = c.RESULT_TTL_S  # recorded text lives as long as a result
        self._last_write_commands = 0
        self.on_write: Callable[[int, int, float], None] | None = None  # (steps, ops, seconds) per pipeline

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Claim the worker's name (NameInUse if a live worker has it), then start the threads."""
        self.reader.claim_name()
        for target in (lambda: self.reader.run(self._stop), self._writer_loop, self._abort_loop):
            t = threading.Thread(target=target, name="gaggle-io", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, flush_timeout_s: float = 10.0) -> None:
        self.flush(flush_timeout_s)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None

    # -- main-loop side ------------------------------------------------------------

    def submit(self, ops: list[Op]) -> None:
        """Queue one step's commands; the writer thread runs them in order, in one write with what piled up."""
        if ops:
            with self._flushed:
                self._unflushed += 1
            self._outbox.put(ops)

    def flush(self, timeout_s: float = 10.0) -> bool:
        with self._flushed:
            return self._flushed.wait_for(lambda: self._unflushed == 0, timeout=timeout_s)

    # -- writer thread -------------------------------------------------------------

    def _writer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                batches = [self._outbox.get(timeout=0.1)]
            except queue.Empty:
                continue
            while True:  # coalesce everything that piled up behind a slow round trip
                try:
                    batches.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            t0 = time.perf_counter()
            try:
                self._write(batches)
            except Exception:  # a bug here must not stop the writer (and with it every request)
                log.exception("redis write failed to encode; dropping this batch", extra={"worker": self.name})
            if self.on_write is not None:
                self.on_write(len(batches), self._last_write_commands, time.perf_counter() - t0)
            with self._flushed:
                self._unflushed -= len(batches)
                self._flushed.notify_all()

    def _write(self, batches: list[list[Op]]) -> None:
        blob, num_plain, num_tx, tx_start, acked = self._encode(batches)
        delay = 0.05
        while True:
            try:
                self._transact(blob, num_plain, num_tx)
                for eid in acked:
                    self.reader.forget(eid)
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("redis write failed; retrying", extra={"worker": self.name, "error": str(e)})
                if num_plain and not isinstance(e, _NotSent):  # some may have run: deltas are at most once
                    blob, num_plain = blob[tx_start:], 0
                    if not blob:
                        return
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except redis.RedisError:
                log.exception("redis write rejected; dropping this batch", extra={"worker": self.name})
                return

    def _transact(self, blob: bytes, num_plain: int, num_tx: int) -> None:
        """Send ``blob``: ``num_plain`` plain commands, then (``num_tx`` > 0) MULTI, ``num_tx`` commands, EXEC.

        Reads every reply. Raises ConnectionError (nothing or not everything is known to have run) or
        the first error reply of the transaction (ResponseError); error replies to plain commands are logged.
        """
        conn = self._conn
        if conn is None:
            conn = self._conn = self.redis.connection_pool.make_connection()
        if conn._sock is None:
            try:
                conn.connect()
            except redis.ConnectionError as e:
                raise _NotSent(str(e)) from e
        try:
            sock = conn._sock
            sock.sendall(blob)
            reader = hiredis.Reader()
            replies: list = []
            expected = num_plain + (num_tx + 2 if num_tx else 0)  # ... +OK, +QUEUED for each command, EXEC's
            while len(replies) < expected:
                reply = reader.gets()
                if reply is False:
                    data = sock.recv(1 << 20)
                    if not data:
                        raise redis.ConnectionError("connection closed by the server")
                    reader.feed(data)
                else:
                    replies.append(reply)
        except BaseException as e:
            conn.disconnect()  # replies may be left unread: start afresh
            if isinstance(e, OSError):
                raise redis.ConnectionError(f"redis write: {e!r}") from e
            raise
        failed = [r for r in replies[:num_plain] if isinstance(r, hiredis.ReplyError)]
        if failed:
            log.error("redis rejected deltas", extra={"worker": self.name, "count": len(failed), "error": str(failed[0])})
        if not num_tx:
            return
        results = replies[-1]
        errors = [r for r in replies[num_plain:-1] if isinstance(r, hiredis.ReplyError)]
        if isinstance(results, hiredis.ReplyError):
            errors.append(results)
        elif isinstance(results, list):
            errors += [r for r in results if isinstance(r, hiredis.ReplyError)]
        if errors:
            raise redis.ResponseError(str(errors[0]))

    def _encode(self, batches: list[list[Op]]) -> tuple[bytes, int, int, int, list[bytes]]:
        """A write as RESP: the plain PUBLISHes, then MULTI, [PUBLISH_MANY for async requests' deltas and text],
        the other commands, EXEC.

        Each request gets one delta message per write, published where its first output was (after
        its status, before its final): the outputs of all the steps the write covers, merged per
        choice. Returns the bytes, the number of plain commands, the number of commands in the
        transaction (0: none), where the transaction starts in the bytes, and the entry ids acknowledged.
        """
        single = sum(op[0] == "outputs" for ops in batches for op in ops) == 1
        pubs: list = []  # plain PUBLISH commands, or an InFlight: the slot of its merged deltas
        tx_pubs: list = []  # (channel, message) arguments of PUBLISH_MANY (async requests' deltas), or slots
        pending: dict = {}  # InFlight -> its outputs in this write (but those formatted at once), in order
        cmds: list[bytes] = []
        acked: list[bytes] = []
        flights = self._flights

        def run(op: Op) -> None:
            name = op[0]
            if name == "publish":
                pubs.append(command("PUBLISH", op[1], op[2]))
            elif name == "xack_del":
                _, stream, eid = op
                cmds.extend((command("XACK", stream, c.GROUP, eid), command("XDEL", stream, eid)))
                acked.append(eid)
            elif name == "start":
                flights[op[1].id] = op[1]
            elif name == "end":
                if flights.get(op[1].id) is op[1]:  # else it finished first: its result is on its way
                    del flights[op[1].id]
                    if op[2] is not None:
                        for final in self.end_ops(op[1], op[2]):
                            run(final)
            else:
                cmds.append(command(*op))

        for ops in batches:
            for op in ops:
                if op[0] != "outputs":
                    run(op)
                    continue
                done = []
                now = op[2]
                for out in op[1]:
                    flight = flights.get(out.request_id)
                    if flight is None:  # ended (cancelled, expired) while this step ran
                        continue
                    if flight.add(out, now) and flight.publishes:
                        if single and flight.simple and not out.finished:
                            # the common case, formatted at once: one token of a plain one-choice stream
                            msg = simple_delta(flight, out.text, out.token_ids)
                            pubs.append(b"%s$%d\r\n%s\r\n" % (flight.publish_head, len(msg), msg))
                        else:
                            outs = pending.get(flight)
                            if outs is not None:
                                outs.append(out)
                            else:
                                pending[flight] = [out]
                                if flight.request.stream:
                                    if not flight.request.record_text:
                                        pubs.append(flight)
                                    elif flight.watched:  # an async request: only while watched
                                        tx_pubs.append(flight)
                    if out.finished and flight.is_done:
                        done.append(flight)
                for flight in done:  # after its deltas
                    del flights[flight.id]
                    for final in self.end_ops(flight, None):
                        run(final)
        for slots, head in ((pubs, "publish_head"), (tx_pubs, "channel_bulk")):
            for i, item in enumerate(slots):
                if type(item) is not bytes:
                    msg = merged_delta(item, pending[item])
                    slots[i] = b"%s$%d\r\n%s\r\n" % (getattr(item, head), len(msg), msg)
        appends = []
        for flight, outs in pending.items():
            if flight.request.record_text:
                texts: dict[int, list[str]] = {}
                for out in outs:
                    texts.setdefault(out.index, []).append(out.text)
                appends += [bulk(c.text_key(flight.id, i)) + bulk("".join(t)) for i, t in texts.items() if any(t)]
        if tx_pubs or appends:
            cmds[:0] = [b"*%d\r\n$4\r\nEVAL\r\n%s$1\r\n0\r\n%s%s" % (
                5 + 2 * (len(tx_pubs) + len(appends)), bulk(PUBLISH_MANY_BYTES), bulk(len(tx_pubs)),
                bulk(self.text_ttl_s)), b"".join(tx_pubs + appends)]
            num_tx = len(cmds) - 1
        else:
            num_tx = len(cmds)
        self._last_write_commands = len(pubs) + len(tx_pubs) + len(appends) + num_tx
        num_plain = len(pubs)
        if num_tx:
            pubs += (MULTI, *cmds, EXEC)
        blob = b"".join(pubs)
        return blob, num_plain, num_tx, len(blob) - sum(map(len, pubs[num_plain:])), acked

    # -- abort subscription --------------------------------------------------------

    def _abort_loop(self) -> None:
        pubsub = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(c.CHANNEL_ABORTS)
                    self.reader.recheck_cancels = True  # aborts sent while unsubscribed: see their markers
                msg = pubsub.get_message(timeout=0.1)
                if msg and msg["type"] == "message":
                    data = msg["data"]
                    self.reader.aborts.put((data.decode() if isinstance(data, bytes) else data, CANCELLED))
            except redis.RedisError:
                pubsub = None
                self._stop.wait(0.5)

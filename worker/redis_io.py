"""Redis I/O for a worker, off the GPU loop's critical path.

Three daemon threads:
- reader: XREADGROUP up to the engine's free capacity (interactive first), replays
  this consumer's own pending entries at start, reclaims (XAUTOCLAIM) entries of
  dead workers, keeps this worker's in-flight entries fresh, writes the heartbeat;
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
from dataclasses import dataclass
from typing import Callable

import hiredis
import redis

from worker import contract as c
from worker.resp import bulk, command
from worker.results import logprob_dicts

log = logging.getLogger(__name__)


@dataclass
class Incoming:
    stream: str
    entry_id: bytes
    fields: dict | None  # None: the entry was deleted from the stream
    deliveries: int
    has_result: bool = False
    cancelled: bool = False


@dataclass
class IOConfig:
    idle_timeout_s: float = 30.0
    read_block_ms: int = 100
    reclaim_interval_s: float = 2.0
    heartbeat_interval_s: float = 1.0


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
PUBLISH_MANY = """
local n = tonumber(ARGV[1])
for i = 2, 2 * n, 2 do redis.call('PUBLISH', ARGV[i], ARGV[i + 1]) end
for i = 2 * n + 2, #ARGV, 2 do redis.call('APPEND', ARGV[i], ARGV[i + 1]) end
return n
"""
PUBLISH_MANY_BYTES = PUBLISH_MANY.encode()
MULTI, EXEC = command("MULTI"), command("EXEC")
WATCH_POLL_S = 0.5  # how soon an /events watcher starts receiving an async request's deltas


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
    def __init__(self, redis_url: str, name: str, cfg: IOConfig, heartbeat: Callable[[], c.Heartbeat]):
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=30, health_check_interval=10)
        self.name = name
        self.cfg = cfg
        self.heartbeat = heartbeat
        self.inbox: queue.Queue[Incoming] = queue.Queue()
        self.aborts: queue.Queue[str] = queue.Queue()
        self._outbox: queue.Queue[list[Op]] = queue.Queue()
        self.capacity = 0  # entries the main loop can take now; written by the main loop only
        self.reading = True  # False while draining
        self.last_read_empty = False  # the last completed read found both streams empty (burst mode)
        self._owned: dict[bytes, str] = {}  # entry id -> stream, read but not yet acknowledged
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unflushed = 0
        self._flushed = threading.Condition()
        self._conn = None  # the writer thread's own connection
        self._flights: dict = {}  # request id -> InFlight, running requests (the writer's; the reader copies it)
        # (InFlight, terminal) -> the ops that write its result; set by the Worker; runs on the writer thread
        self.end_ops: Callable[[object, tuple | None], list[Op]] = lambda flight, terminal: []
        self._last_write_commands = 0
        self.read_lock = threading.Lock()  # held by the reader thread while a read may deliver entries
        self.on_write: Callable[[int, int, float], None] | None = None  # (steps, ops, seconds) per pipeline

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._ensure_groups()
        for target in (self._reader_loop, self._writer_loop, self._abort_loop):
            t = threading.Thread(target=target, name=f"gaggle-{target.__name__}", daemon=True)
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

    def _ensure_groups(self) -> None:
        for stream in c.STREAMS:
            try:
                self.redis.xgroup_create(stream, c.GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

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

    def release(self, entry_ids: list[tuple[str, bytes]]) -> None:
        """Forget entries we will not finish, and make them claimable by others at once."""
        idle_ms = int(self.cfg.idle_timeout_s * 1000) + 1
        by_stream: dict[str, list[bytes]] = {}
        with self._lock:
            for stream, eid in entry_ids:
                self._owned.pop(eid, None)
                by_stream.setdefault(stream, []).append(eid)
        try:
            for stream, ids in by_stream.items():
                self.redis.xclaim(stream, c.GROUP, self.name, 0, ids, idle=idle_ms, justid=True)
        except redis.RedisError:
            log.exception("could not release entries", extra={"worker": self.name})

    def forget(self, entry_id: bytes) -> None:
        with self._lock:
            self._owned.pop(entry_id, None)

    @property
    def num_owned(self) -> int:
        return len(self._owned)

    # -- reader thread -------------------------------------------------------------

    def _reader_loop(self) -> None:
        next_reclaim = next_beat = next_keepalive = next_watch = 0.0
        replayed = False
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + self.cfg.heartbeat_interval_s
                if now >= next_watch:
                    self._poll_watches()
                    next_watch = now + WATCH_POLL_S
                if now >= next_keepalive:
                    self._keep_alive()
                    next_keepalive = now + self.cfg.idle_timeout_s / 4
                with self.read_lock:  # what may deliver entries: see settled()
                    if not replayed:
                        self._replay_own_pending()
                        replayed = True
                    if self.reading and now >= next_reclaim:
                        self._reclaim()
                        next_reclaim = now + self.cfg.reclaim_interval_s
                    self._read_new()
            except redis.RedisError as e:
                log.warning("redis unavailable; retrying", extra={"worker": self.name, "error": str(e)})
                self._stop.wait(0.5)
                self._try(self._ensure_groups)
            except Exception:
                log.exception("reader thread error", extra={"worker": self.name})
                self._stop.wait(0.5)

    def settled(self) -> bool:
        """Burst mode: True, and reading stopped, if the streams were found empty and all we read was handed over.

        Waits for a read in flight (up to read_block_ms): it may be about to deliver entries.
        """
        with self.read_lock:
            if self.last_read_empty and self.inbox.empty() and self.num_owned == 0:
                self.reading = False
                return True
            return False

    def _want(self) -> int:
        return self.capacity - self.inbox.qsize() if self.reading else 0

    def _read_new(self) -> None:
        want = self._want()
        if want <= 0:
            self._stop.wait(0.005)
            return
        got = 0
        for stream in c.STREAMS:  # interactive before batch
            if want - got <= 0:
                break
            got += self._take(self.redis.xreadgroup(c.GROUP, self.name, {stream: ">"}, count=want - got), 1)
        if got == 0:
            got = self._take(self.redis.xreadgroup(c.GROUP, self.name, {s: ">" for s in c.STREAMS},
                                                   count=1, block=self.cfg.read_block_ms), 1)
        self.last_read_empty = got == 0

    def _replay_own_pending(self) -> None:
        """After a restart under the same name, our own pending entries come first."""
        for stream in c.STREAMS:
            reply = self.redis.xreadgroup(c.GROUP, self.name, {stream: "0"}, count=100_000)
            entries = reply[0][1] if reply else []
            if entries:
                log.info("replaying own pending entries", extra={"worker": self.name, "count": len(entries)})
                self._deliver(stream, entries, None)

    def _reclaim(self) -> None:
        want = self._want()
        if want <= 0:
            return
        for stream in c.STREAMS:
            reply = self.redis.xautoclaim(stream, c.GROUP, self.name, int(self.cfg.idle_timeout_s * 1000),
                                          start_id="0-0", count=want)
            entries = reply[1] if len(reply) > 1 else []
            with self._lock:
                entries = [(eid, f) for eid, f in entries if eid not in self._owned]
            if entries:
                log.info("reclaimed entries of an idle consumer", extra={"worker": self.name,
                                                                          "stream": stream, "count": len(entries)})
                self._deliver(stream, entries, None)
                want -= len(entries)

    def _take(self, reply, deliveries: int) -> int:
        n = 0
        for stream, entries in reply or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            self._deliver(stream, entries, deliveries)
            n += len(entries)
        return n

    def _deliver(self, stream: str, entries: list, deliveries: int | None) -> None:
        """Look up delivery counts, existing results and cancel marks in one round trip, then hand over."""
        pipe = self.redis.pipeline(transaction=False)
        rids = []
        for eid, fields in entries:
            rid = c.request_id_of(fields) if fields else None
            rids.append(rid)
            if deliveries is None:
                pipe.xpending_range(stream, c.GROUP, min=eid, max=eid, count=1)
            pipe.exists(c.result_key(rid or "?"))
            pipe.exists(c.cancel_key(rid or "?"))
        replies = iter(pipe.execute())
        with self._lock:
            for eid, _ in entries:
                self._owned[eid] = stream
        for (eid, fields), rid in zip(entries, rids):
            count = deliveries
            if count is None:
                pending = next(replies)
                count = pending[0]["times_delivered"] if pending else 1
            has_result, cancelled = bool(next(replies)), bool(next(replies))
            self.inbox.put(Incoming(stream, eid, fields or None, count, has_result and rid is not None,
                                    cancelled and rid is not None))

    def _poll_watches(self) -> None:
        """Which running async requests an /events stream watches (their deltas are published only then)."""
        flights = [f for f in list(self._flights.values()) if f.request.record_text]  # list(): atomic copy
        if not flights:
            return
        pipe = self.redis.pipeline(transaction=False)
        for flight in flights:
            pipe.exists(c.watch_key(flight.id))
        for flight, watched in zip(flights, pipe.execute()):
            flight.watched = bool(watched)

    def _keep_alive(self) -> None:
        """Reset the idle time of our in-flight entries so nobody reclaims a long generation."""
        with self._lock:
            by_stream: dict[str, list[bytes]] = {}
            for eid, stream in self._owned.items():
                by_stream.setdefault(stream, []).append(eid)
        for stream, ids in by_stream.items():
            for i in range(0, len(ids), 1000):
                self.redis.xclaim(stream, c.GROUP, self.name, 0, ids[i:i + 1000], justid=True)

    def _beat(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self.heartbeat().publish(pipe)
        pipe.execute()

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
                    self.forget(eid)
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
            cmds[:0] = [b"*%d\r\n$4\r\nEVAL\r\n%s$1\r\n0\r\n%s" % (
                4 + 2 * (len(tx_pubs) + len(appends)), bulk(PUBLISH_MANY_BYTES), bulk(len(tx_pubs))),
                b"".join(tx_pubs + appends)]
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
                msg = pubsub.get_message(timeout=0.1)
                if msg and msg["type"] == "message":
                    data = msg["data"]
                    self.aborts.put(data.decode() if isinstance(data, bytes) else data)
            except redis.RedisError:
                pubsub = None
                self._stop.wait(0.5)

    def _try(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except redis.RedisError:
            pass

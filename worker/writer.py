"""The worker's writer thread: each engine step's results into Redis, one round trip per write.

A write takes every batch of operations (worker/ops.py) the step thread submitted since the last one, folds
the engine outputs into their requests (InFlight), and sends, pipelined on its own socket: the streaming deltas
and statuses as plain PUBLISHes (one per reply channel for all of its requests' messages, one per message on a
request's own channel), then MULTI, [one script call for async requests' deltas and recorded text],
the other commands (results, acknowledgements, records), EXEC. When Redis is slower than the GPU, writes cover
several steps and a request's deltas of those steps become one message. A failed write is retried until Redis
answers again, without its plain PUBLISHes (some may have run: deltas are at most once, as pub/sub itself; the
final result is what counts and readers fill gaps from it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import hiredis
import redis

from worker import contract as c
from worker.connection import NotSent, RawConnection
from worker.deltas import merged_delta, simple_delta
from worker.ops import AckDelete, Command, End, FinishIfOwned, Op, Outputs, Publish, Start

log = logging.getLogger(__name__)

# Async requests' deltas: PUBLISH and APPEND in one script call inside the transaction, so the API's snapshot
# (text so far + a marker, in one MULTI) sees both or neither. Single-instance only.
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
# The writer gives the GIL up every this many outputs (a power of two, minus one): folding a 1,024-sequence step
# holds it ~1.5 ms, and a step thread waiting for it would otherwise wait up to the 5 ms switch interval.
YIELD_EVERY_MASK = 255
MULTI, EXEC = hiredis.pack_command(("MULTI",)), hiredis.pack_command(("EXEC",))


@dataclass
class Encoded:
    """One write as RESP: ``plain`` commands, then a transaction of ``tx`` commands (0: none)."""
    blob: bytes
    num_plain: int
    num_tx: int
    tx_start: int  # where the transaction starts in ``blob``
    acked: list[bytes] = field(default_factory=list)  # entry ids the write acknowledges

    @property
    def num_commands(self) -> int:
        return self.num_plain + self.num_tx


class _Build:
    """The commands of one write, as its operations are run in order."""

    def __init__(self, flights: dict, end_ops: Callable, single_step: bool, consumer: str = ""):
        self.flights = flights
        self.consumer = consumer  # this worker's name in the consumer group (FinishIfOwned)
        self.end_ops = end_ops
        self.single_step = single_step  # the write covers one step: plain deltas can be formatted at once
        self.plain: list = []  # (channel, message), or an InFlight: where its merged delta goes
        self.tx_pubs: list = []  # InFlights of async requests whose deltas go into the script call
        self.pending: dict = {}  # InFlight -> its outputs in this write not yet formatted, in order
        self.tx: list[bytes] = []
        self.acked: list[bytes] = []

    def run(self, op: Op) -> None:
        match op:
            case Outputs(outputs, at):
                self._outputs(outputs, at)
            case Publish(channel, data):
                self.plain.append((channel, data))
            case FinishIfOwned(stream, entry_id, commands):
                args = [a for cmd in commands for a in (len(cmd), *cmd)]
                self.tx.append(hiredis.pack_command(("EVAL", FINISH_IF_OWNED, 0, stream, c.GROUP, self.consumer,
                                                     entry_id, *args)))
                self.acked.append(entry_id)
            case AckDelete(stream, entry_id):
                self.tx += [hiredis.pack_command(("XACK", stream, c.GROUP, entry_id)),
                            hiredis.pack_command(("XDEL", stream, entry_id))]
                self.acked.append(entry_id)
            case Start(flight):
                self.flights[flight.id] = flight
            case End(flight, terminal):
                if self.flights.get(flight.id) is flight:  # else it finished first: its result is on its way
                    del self.flights[flight.id]
                    if terminal is not None:
                        for final in self.end_ops(flight, terminal):
                            self.run(final)
            case Command(args=args):
                self.tx.append(hiredis.pack_command(args))
            case _:
                raise TypeError(f"not a writer operation: {op!r}")

    def _outputs(self, outputs: list, at: float) -> None:
        done = []
        for i, out in enumerate(outputs):
            if i & YIELD_EVERY_MASK == YIELD_EVERY_MASK:
                time.sleep(0)  # let the step thread have the GIL: it launches the next step meanwhile
            flight = self.flights.get(out.request_id)
            if flight is None:  # ended (cancelled, expired) while this step ran
                continue
            if flight.add(out, at) and flight.publishes:
                if self.single_step and flight.simple and not out.finished:  # the common case, formatted at once
                    self.plain.append((flight.channel, simple_delta(flight, out.text, out.token_ids)))
                else:
                    self._defer(flight, out)
            if out.finished and flight.is_done:
                done.append(flight)
        for flight in done:  # after its deltas
            del self.flights[flight.id]
            for final in self.end_ops(flight, None):
                self.run(final)

    def _defer(self, flight, out) -> None:
        """Merge into the request's one delta of this write, published where its first output was."""
        outs = self.pending.get(flight)
        if outs is not None:
            outs.append(out)
            return
        self.pending[flight] = [out]
        if flight.request.stream:
            if not flight.request.record_text:
                self.plain.append(flight)
            elif flight.watched:  # an async request: only while an /events stream watches it
                self.tx_pubs.append(flight)

    def encode(self, text_ttl_s: int) -> Encoded:
        plain = _publishes(item if type(item) is tuple else (item.channel, merged_delta(item, self.pending[item]))
                           for item in self.plain)
        script_args = [a for flight in self.tx_pubs for a in (flight.channel, merged_delta(flight, self.pending[flight]))]
        appends = self._appends()
        if script_args or appends:
            self.tx.insert(0, hiredis.pack_command(("EVAL", PUBLISH_MANY, 0, len(self.tx_pubs), text_ttl_s,
                                                    *script_args, *appends)))
        head = b"".join(plain)
        tx = MULTI + b"".join(self.tx) + EXEC if self.tx else b""
        return Encoded(head + tx, len(plain), len(self.tx), len(head), self.acked)

    def _appends(self) -> list:
        """(text key, text) of async requests' outputs in this write, flattened."""
        out = []
        for flight, outs in self.pending.items():
            if flight.request.record_text:
                texts: dict[int, list[str]] = {}
                for o in outs:
                    texts.setdefault(o.index, []).append(o.text)
                for i, parts in texts.items():
                    if any(parts):
                        out += [c.text_key(flight.id, i), "".join(parts)]
        return out


def _publishes(messages) -> list[bytes]:
    """PUBLISH commands for (channel, message) pairs in order: one per message on a request's own channel, one
    per reply channel for all of its messages (newline-joined, in order)."""
    out: list[bytes] = []
    shared: dict[str, list[bytes]] = {}
    for channel, message in messages:
        if channel.startswith(c.REPLY_PREFIX):
            shared.setdefault(channel, []).append(message)
        else:
            out.append(hiredis.pack_command(("PUBLISH", channel, message)))
    out += [hiredis.pack_command(("PUBLISH", channel, b"\n".join(parts))) for channel, parts in shared.items()]
    return out


class Writer:
    def __init__(self, redis_url: str, name: str, forget: Callable[[bytes], None]):
        self.name = name
        self.forget = forget  # an acknowledged entry is no longer ours (the reader's bookkeeping)
        self.conn = RawConnection(redis_url, f"gaggle-writer-{name}")
        self.flights: dict = {}  # request id -> InFlight, running requests (the reader copies it)
        # (InFlight, terminal) -> the ops that write its result; set by the Worker; runs on this thread
        self.end_ops: Callable[[object, tuple | None], list[Op]] = lambda flight, terminal: []
        self.text_ttl_s = c.RESULT_TTL_S  # recorded text lives as long as a result
        self.on_write: Callable[[int, int, float], None] | None = None  # (steps, commands, seconds) per write
        self.num_commands = 0  # sent so far (commands per generated token: benchmarks/queue_overhead.py)
        self._outbox: queue.Queue[list[Op]] = queue.Queue()
        self._unflushed = 0
        self._flushed = threading.Condition()
        self._held: list[list[Op]] = []  # step-thread only: queued at the next release() or submit()

    # -- step-thread side ------------------------------------------------------------------------

    def submit(self, ops: list[Op]) -> None:
        """Queue one step's operations (after any held ones); the writer runs them in order, in one write
        with what piled up."""
        self.release()
        self._queue(ops)

    def hold(self, ops: list[Op]) -> None:
        """Queue ``ops`` at the next ``release()`` (or ``submit()``/``flush()``, which keep the order). The
        step thread holds a step's outputs until it has launched the next step: folded and encoded at once,
        this thread's Python took the GIL from the launch (each torch call releases it) and stretched the
        step; held, it runs while the step thread waits for the device."""
        if ops:
            self._held.append(ops)

    def release(self) -> None:
        """Queue what ``hold()`` kept."""
        if self._held:
            held, self._held = self._held, []
            for ops in held:
                self._queue(ops)

    @property
    def backlog(self) -> int:
        """Steps' operations queued or held, not yet written."""
        return self._unflushed + len(self._held)

    def flush(self, timeout_s: float = 10.0) -> bool:
        self.release()
        with self._flushed:
            return self._flushed.wait_for(lambda: self._unflushed == 0, timeout=timeout_s)

    def _queue(self, ops: list[Op]) -> None:
        if ops:
            with self._flushed:
                self._unflushed += 1
            self._outbox.put(ops)

    # -- writer thread -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
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
            commands = 0
            try:
                commands = self.write(batches)
            except Exception:  # a bug here must not stop the writer (and with it every request)
                log.exception("redis write failed to encode; dropping this batch", extra={"worker": self.name})
            if self.on_write is not None:
                self.on_write(len(batches), commands, time.perf_counter() - t0)
            with self._flushed:
                self._unflushed -= len(batches)
                self._flushed.notify_all()
        self.conn.close()

    def encode(self, batches: list[list[Op]]) -> Encoded:
        single = sum(isinstance(op, Outputs) for ops in batches for op in ops) == 1
        build = _Build(self.flights, self.end_ops, single, self.name)
        for ops in batches:
            for op in ops:
                build.run(op)
        return build.encode(self.text_ttl_s)

    def write(self, batches: list[list[Op]]) -> int:
        """Encode and send one write, retrying until Redis answers; the number of commands sent."""
        enc = self.encode(batches)
        commands = enc.num_commands
        blob, num_plain = enc.blob, enc.num_plain
        delay = 0.05
        while True:
            try:
                self.transact(blob, num_plain, enc.num_tx)
                for eid in enc.acked:
                    self.forget(eid)
                self.num_commands += commands
                return commands
            except (redis.ConnectionError, redis.TimeoutError, OSError, NotReady) as e:
                # NotReady: nothing of what Redis refused ran, the same again once it serves
                not_ready = isinstance(e, NotReady)
                log.warning("redis is not ready; retrying the write" if not_ready else "redis write failed; retrying",
                            extra={"worker": self.name, "error": str(e)})
                deltas_ran = e.deltas_ran if not_ready else not isinstance(e, NotSent)
                if num_plain and deltas_ran:  # some may have run: deltas are at most once
                    blob, num_plain = blob[enc.tx_start:], 0
                    if not blob:
                        return commands
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except redis.RedisError:
                log.exception("redis write rejected; dropping this batch", extra={"worker": self.name})
                return commands

    def transact(self, blob: bytes, num_plain: int, num_tx: int) -> None:
        """Send ``blob``: ``num_plain`` plain commands, then (``num_tx`` > 0) MULTI, ``num_tx`` commands, EXEC.

        Reads every reply. Raises ConnectionError (nothing or not everything is known to have run) or
        the first error reply of the transaction (ResponseError); error replies to plain commands are logged.
        """
        if not self.conn.connected:
            self.conn.connect()
        self.conn.send(blob)
        replies = self.conn.read(num_plain + (num_tx + 2 if num_tx else 0))  # +OK, +QUEUED each, EXEC's
        deltas, tx = replies[:num_plain], replies[num_plain:]
        not_ready = [r for r in replies if _not_ready(r)]
        if not_ready and (not tx or not isinstance(tx[-1], list)):  # the transaction did not run (or none)
            raise NotReady(str(not_ready[0]), deltas_ran=any(not _not_ready(r) for r in deltas))
        failed = [r for r in deltas if isinstance(r, hiredis.ReplyError)]
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


# ARGV: stream, group, consumer, entry id, then commands, each as its length and its arguments. Runs the commands,
# acknowledges and deletes the entry, if the entry is pending under the consumer; else nothing (another worker took
# it over and writes its result). Returns 1 if run.
FINISH_IF_OWNED = """
local owned = redis.pcall('XPENDING', ARGV[1], ARGV[2], ARGV[4], ARGV[4], 1, ARGV[3])
if type(owned) ~= 'table' or owned.err or #owned == 0 then return 0 end
local i = 5
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
redis.call('XACK', ARGV[1], ARGV[2], ARGV[4])
redis.call('XDEL', ARGV[1], ARGV[4])
return 1
"""

# Error replies of a Redis that cannot serve yet (loading its data, a script running, a failover): nothing of the
# command ran, and it will once Redis is ready.
NOT_READY = ("LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN")


class NotReady(redis.ResponseError):
    """Redis refused a write because it is not ready (NOT_READY); ``deltas_ran``: some plain commands ran."""

    def __init__(self, message: str, deltas_ran: bool):
        super().__init__(message)
        self.deltas_ran = deltas_ran


def _not_ready(reply) -> bool:
    return isinstance(reply, hiredis.ReplyError) and str(reply).split(" ", 1)[0] in NOT_READY

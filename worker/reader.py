"""The worker's reader thread: what enters the worker, and whose entries are whose.

One loop, on its own Redis connection:
- beats: the heartbeat key (TTL) is this worker's claim on its pending entries;
- reads: XREADGROUP from every tenant's streams, up to the engine's free capacity, fairly across
  tenants (a COUNT per stream), interactive before batch;
- reclaims: takes the pending entries of consumers whose heartbeat has expired (a Lua script checks the
  owner and its heartbeat and claims in one step, so two live workers never both take an entry, and a live
  worker's entries are never taken, whatever its settings);
- audits: re-delivers entries still pending under this worker's own name that it no longer holds (their
  acknowledgement was lost, e.g. to a Redis restart);
- watches: which async requests an /events stream watches; whose API process (owner) went away.
Handed over through queues: ``inbox`` (entries), ``aborts`` ((request id, reason)), ``lost`` (entries other workers
took over while this one's heartbeat had lapsed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import redis

from worker import contract as c

log = logging.getLogger(__name__)

# KEYS: stream, the owner's heartbeat key. ARGV: group, owner, claimer, count.
# Claims up to ``count`` of the owner's pending entries if its heartbeat is gone, and deletes the consumer once
# it holds none. Returns {ids, delivery counts, entries} (an entry is nil where it was deleted from the stream).
RECLAIM_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {{}, {}, {}} end
local pending = {}
if tonumber(ARGV[4]) > 0 then pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[2]) end
local ids, counts = {}, {}
for i, p in ipairs(pending) do ids[i] = p[1]; counts[i] = p[4] + 1 end
local entries = {}
if #ids > 0 then entries = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, unpack(ids)) end
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return {ids, counts, entries}
"""

# KEYS: stream, the preferred worker's handoff list, its heartbeat key. ARGV: group, preferred worker, entry id, now.
# An entry pending under the reader becomes the preferred worker's (if it is alive), delivered once, and is listed
# for it to take. Returns 1 if handed over.
HANDOFF_SCRIPT = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'RETRYCOUNT', 1, 'JUSTID')
if #claimed == 0 then return 0 end
redis.call('RPUSH', KEYS[2], KEYS[1] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4])
redis.call('EXPIRE', KEYS[2], 3600)
return 1
"""

# KEYS: stream. ARGV: group, consumer, entry id. An entry handed to this consumer that it did not take in time: if
# still pending under it, added again at the stream's end without its preference, acknowledged and deleted, in one
# step (it is in the stream exactly once at every moment). Returns 1 if put back.
REQUEUE_SCRIPT = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #p == 0 then return 0 end
local e = redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
if #e == 0 then return 0 end
local fields, out = e[1][2], {}
for i = 1, #fields, 2 do
  if fields[i] ~= 'prefer' then out[#out + 1] = fields[i]; out[#out + 1] = fields[i + 1] end
end
redis.call('XADD', KEYS[1], '*', unpack(out))
return 1
"""

CANCELLED = "cancelled by the client"
OWNER_GONE = "the API process that was serving this request went away"
LAPSED_MEMORY_S = 600.0


class NameInUse(RuntimeError):
    """Another live worker has this worker's name (two consumers under one name would share entries)."""


@dataclass
class Incoming:
    stream: str
    entry_id: bytes
    fields: dict | None  # None: the entry was deleted from the stream
    deliveries: int
    has_result: bool = False
    cancelled: bool = False
    read_at: float | None = None  # when the reader had it (wall clock): the breakdown splits Redis from the inbox


PEERS_FRESH_S = 0.1  # how old the peers' view may be when it decides whether to read an entry ahead


@dataclass
class ReaderConfig:
    read_block_ms: int = 100
    reclaim_interval_s: float = 0.5
    heartbeat_interval_s: float = c.HEARTBEAT_INTERVAL_S
    tenants_interval_s: float = 0.25
    new_tenant_check_s: float = 0.02  # a ZCARD: a new tenant's first request is read within ~this, not a refresh
    audit_interval_s: float = 5.0
    consumers_gc_interval_s: float = 60.0  # dead consumers holding nothing are deleted (names are unique)
    owners_interval_s: float = 1.0
    watch_interval_s: float = 0.5  # how soon an /events watcher starts receiving an async request's deltas
    route_wait_s: float = c.ROUTE_WAIT_S  # entries handed to this worker and not taken by then are put back
    handoff_check_s: float = 0.05
    peers_interval_s: float = 0.5  # how often the other workers' heartbeats are read (peers_have_room)


@dataclass
class _Every:
    """A periodic task's schedule."""
    interval_s: float
    next_at: float = 0.0

    def due(self, now: float) -> bool:
        if now < self.next_at:
            return False
        self.next_at = now + self.interval_s
        return True


@dataclass
class _Streams:
    """The request streams this worker reads (every tenant's), in read order, with their consumer groups."""
    by_priority: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in c.PRIORITIES})
    known: set[str] = field(default_factory=set)
    turn: int = 0  # rotates the order, so no tenant is always first
    tenants: int = -1  # how many tenants the list had when read

    @property
    def all(self) -> list[str]:
        return [s for p in c.PRIORITIES for s in self.by_priority[p]]

    def rotated(self, priority: str) -> list[str]:
        streams = self.by_priority[priority]
        if not streams:
            return []
        k = self.turn % len(streams)
        return streams[k:] + streams[:k]


class Reader:
    def __init__(self, client: redis.Redis, name: str, cfg: ReaderConfig, heartbeat: Callable[[], c.Heartbeat],
                 flights: Callable[[], list]):
        self.redis = client
        self.name = name
        self.cfg = cfg
        self.heartbeat = heartbeat
        self.flights = flights  # the running requests (InFlight), as a list copy
        self.inbox: queue.Queue[Incoming] = queue.Queue()
        self.aborts: queue.Queue[tuple[str, str]] = queue.Queue()
        self.lost: queue.Queue[bytes] = queue.Queue()  # entries other workers took over while our beat had lapsed
        self._beaten = False
        # what the main loop can take: (free capacity, entries it had taken when it counted it), one tuple
        # so the reader reads a consistent pair; entries delivered since then are on their way (inbox or
        # being added), counted against that capacity. (free capacity − inbox size raced: an entry taken
        # from the inbox but not yet counted in the capacity was read twice over, and batch lines took the
        # interactive reserve.)
        self.budget = (0, 0, 0)  # (free capacity, entries taken when it was counted, of it read ahead: set_capacity)
        self._delivered = 0  # entries put in the inbox (reader thread)
        self._taken = 0  # entries taken from it (main loop)
        self.interactive_reserve = 0  # free slots batch-priority entries leave to interactive ones
        self.peers_have_room = False  # another live worker's last heartbeat had a free slot: read nothing ahead
        self._peers_at = float("-inf")  # when peers_have_room was polled
        self._room = threading.Event()  # set when the main loop has room again: the reader reads at once
        self.reading = True  # False while draining
        self.last_read_empty = False  # the last completed read found every stream empty (burst mode)
        self.lapsed_owners: frozenset[str] = frozenset()  # API processes gone for OWNER_GRACE_S
        self.recheck_cancels = False  # set when abort messages may have been missed: check cancel markers
        self.read_lock = threading.Lock()  # held while a read may deliver entries: see settled()
        self._owned: dict[bytes, str] = {}  # entry id -> stream, read but not yet acknowledged
        self._lock = threading.Lock()
        self._streams = _Streams()
        self._malformed: set[str] = set()  # request stream names holding another type of key (logged once)
        self._reclaim = client.register_script(RECLAIM_SCRIPT)
        self._handoff = client.register_script(HANDOFF_SCRIPT)
        self._requeue = client.register_script(REQUEUE_SCRIPT)
        self._handoffs = c.handoff_key(name)
        self._next_handoff_check = 0.0
        self._owner_missing: dict[str, float] = {}  # owner -> when its lease was first seen missing
        self._lapsed: dict[str, float] = {}  # owner -> when its lease was found lapsed
        self._aborted: set[str] = set()  # request ids already aborted for a lapsed owner

    # -- lifecycle -----------------------------------------------------------------------------

    def claim_name(self) -> None:
        """Wait for an earlier holder of this name to lapse; NameInUse if its heartbeat is being refreshed."""
        held = wait_for_lapse(self.redis, c.heartbeat_key(self.name), c.HEARTBEAT_TTL_S + 1.0)
        if held == REFRESHED:
            raise NameInUse(f"another live worker is named {self.name!r}; give each worker its own --name")
        if held == STUCK:
            raise NameInUse(f"the heartbeat of a worker named {self.name!r} did not expire")
        self.redis.delete(self._handoffs)  # what a predecessor was handed is pending under the name: replayed

    def run(self, stop: threading.Event) -> None:
        beat, tenants = _Every(self.cfg.heartbeat_interval_s), _Every(self.cfg.tenants_interval_s)
        reclaim, audit = _Every(self.cfg.reclaim_interval_s), _Every(self.cfg.audit_interval_s)
        owners, watches = _Every(self.cfg.owners_interval_s), _Every(self.cfg.watch_interval_s)
        tenant_count, peers = _Every(self.cfg.new_tenant_check_s), _Every(self.cfg.peers_interval_s)
        consumers_gc = _Every(self.cfg.consumers_gc_interval_s, time.monotonic() + self.cfg.consumers_gc_interval_s)
        replayed = False
        while not stop.is_set():
            try:
                now = time.monotonic()
                if beat.due(now):
                    self._beat()
                if tenants.due(now) or (tenant_count.due(now) and self._tenants_changed()):
                    self._refresh_streams()
                if watches.due(now):
                    self._poll_watches()
                if owners.due(now):
                    self._poll_owners(now)
                    self._poll_cancels()
                if peers.due(now):
                    self._poll_peers()
                with self.read_lock:
                    if not replayed:
                        self._replay_own_pending()
                        replayed = True
                    if self.reading and reclaim.due(now):
                        self._reclaim_from_dead()
                    if self.reading and audit.due(now):
                        self._audit_own_pending()
                    if consumers_gc.due(now):
                        self._delete_dead_consumers()
                    self._read_new(stop)
            except redis.ResponseError as e:
                if "NOGROUP" in str(e):  # a stream or its group vanished (FLUSHALL, restart without AOF)
                    log.warning("consumer group missing; recreating", extra={"worker": self.name})
                    self._streams = _Streams()
                else:
                    log.exception("redis rejected a read", extra={"worker": self.name})
                stop.wait(0.2)
            except redis.RedisError as e:
                log.warning("redis unavailable; retrying", extra={"worker": self.name, "error": str(e)})
                stop.wait(0.5)
            except Exception:
                log.exception("reader thread error", extra={"worker": self.name})
                stop.wait(0.5)

    def _peer_has_room(self) -> bool:
        """peers_have_room, polled again where it is older than PEERS_FRESH_S (a peer that just started, or just
        freed a slot, is seen before this worker reads an entry ahead that the peer could run at once)."""
        if time.monotonic() - self._peers_at > PEERS_FRESH_S:
            self._poll_peers()
        return self.peers_have_room

    def _poll_peers(self) -> None:
        """Whether another live worker that is not draining has a free slot: entries read ahead here would wait
        for one of this worker's slots while that one idles (set_capacity's ``ahead`` is then not used)."""
        names = [n.decode() for n in self.redis.zrangebyscore(c.WORKER_REGISTRY, time.time() -
                                                               c.WORKER_REGISTRY_RETENTION_S, "+inf")]
        names = [n for n in names if n != self.name]
        room = False
        for data in self.redis.mget([c.heartbeat_key(n) for n in names]) if names else ():
            try:
                beat = c.Heartbeat.decode(data) if data else None
            except (ValueError, TypeError):
                continue
            if beat is not None and not beat.draining and beat.free_slots > 0:
                room = True
                break
        self.peers_have_room = room
        self._peers_at = time.monotonic()

    # -- ownership --------------------------------------------------------------------------------

    def forget(self, entry_id: bytes) -> None:
        with self._lock:
            self._owned.pop(entry_id, None)

    @property
    def num_owned(self) -> int:
        return len(self._owned)

    def settled(self) -> bool:
        """Burst mode: True, and reading stopped, if the streams were found empty and all we read was handed over.

        Waits for a read in flight (up to read_block_ms): it may be about to deliver entries.
        """
        with self.read_lock:
            if self.last_read_empty and self.inbox.empty() and self.num_owned == 0:
                self.reading = False
                return True
            return False

    # -- streams ----------------------------------------------------------------------------------

    def _tenants_changed(self) -> bool:
        return self.redis.zcard(c.TENANTS) != self._streams.tenants

    def _refresh_streams(self) -> None:
        """Every tenant's streams, with the consumer group created (from the start) where it is new."""
        tenants = sorted(t.decode() for t in self.redis.zrange(c.TENANTS, 0, -1))
        streams = _Streams(turn=self._streams.turn + 1, known=self._streams.known, tenants=len(tenants))
        for priority in c.PRIORITIES:
            streams.by_priority[priority] = [c.request_stream(priority, t) for t in tenants]
        for stream in streams.all:
            if stream not in streams.known:
                try:
                    self.redis.xgroup_create(stream, c.GROUP, id="0", mkstream=True)
                except redis.ResponseError as e:
                    if "WRONGTYPE" in str(e):  # not a stream: that tenant's slot is skipped, the others served
                        if stream not in self._malformed:
                            log.error("not a request stream; skipped", extra={"key": stream, "error": str(e)})
                            self._malformed.add(stream)
                        continue
                    if "BUSYGROUP" not in str(e):
                        raise
                streams.known.add(stream)
        for priority in c.PRIORITIES:
            streams.by_priority[priority] = [s for s in streams.by_priority[priority] if s in streams.known]
        self._streams = streams

    def _want(self) -> int:
        return self._room_now()[0]

    def _room_now(self) -> tuple[int, int]:
        """(entries to read now, of them only for waiting in the engine: set_capacity's ``ahead``), from one
        reading of the budget (the main loop replaces it while this thread reads)."""
        free, taken, ahead = self.budget
        return (free - (self._delivered - taken), ahead) if self.reading else (0, 0)

    # -- the main loop's side ---------------------------------------------------------------------

    def take(self, timeout: float | None = None) -> Incoming | None:
        """The next delivered entry (waiting up to ``timeout``; None: none now). Main loop only."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None
        self._taken += 1
        return item

    def set_capacity(self, free: int, ahead: int = 0) -> None:
        """Entries the engine can take, counted after everything taken so far was added, and ``ahead`` more to
        wait in the engine for the slots its next steps free: interactive ones only (a batch line read ahead
        would be counted as started while it waits), and never a handed-over entry (it goes back to its stream
        if no slot is free in time, for a worker that has one). Main loop only."""
        ahead = max(0, ahead)
        self.budget = (max(0, free + ahead), self._taken, ahead)  # entries already waiting count against it
        if self._want() > 0:
            self._room.set()

    def _read_new(self, stop: threading.Event) -> None:
        self._room.clear()  # before the count: room made after it wakes the wait below
        want, ahead = self._room_now()
        if 0 < want <= ahead and self._peer_has_room():  # room only to read ahead, and a peer could run it now
            want = 0
        if want > 0 or time.monotonic() >= self._next_handoff_check:
            self._next_handoff_check = time.monotonic() + self.cfg.handoff_check_s
            want -= self._take_handoffs(max(0, want - ahead))
        if want <= 0:
            self._room.wait(0.005)  # or until the main loop has room (a slot freed)
            return
        if not self._streams.all:
            stop.wait(self.cfg.read_block_ms / 1000)
            return
        got, open_streams = 0, []
        for priority in c.PRIORITIES:  # interactive before batch; each tenant gets a share of what we can take
            streams = self._streams.rotated(priority)
            room = want - got - self._reserved_for(priority, ahead)
            if room <= 0 or not streams:
                continue
            open_streams += streams
            per_stream = max(1, room // len(streams))
            reply = self.redis.xreadgroup(c.GROUP, self.name, {s: ">" for s in streams}, count=per_stream)
            got += self._take(reply)
        self._streams.turn += 1
        if got == 0:
            if not open_streams:  # only the reserve is free and no interactive stream exists yet
                stop.wait(0.005)
                return
            # held back by the reserve, batch lines are still there: wait briefly, the next freed slot takes one
            block = self.cfg.read_block_ms if len(open_streams) == len(self._streams.all) else 5
            reply = self.redis.xreadgroup(c.GROUP, self.name, {s: ">" for s in open_streams}, count=1,
                                          block=block)
            got = self._take(reply)
        self.last_read_empty = got == 0

    def _reserved_for(self, priority: str, ahead: int) -> int:
        """Capacity that ``priority`` may not take: batch lines leave ``interactive_reserve`` slots to
        synchronous requests (otherwise a batch fills every slot and a chat request waits for a whole wave
        of batch lines to finish), and the read-ahead too (set_capacity)."""
        return self.interactive_reserve + ahead if priority != c.INTERACTIVE else 0

    def _take(self, reply) -> int:
        n = 0
        for stream, entries in reply or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            mine = self._hand_over(stream, entries)
            self._deliver(stream, [(eid, f, 1) for eid, f in mine])
            n += len(mine)
        return n

    # -- prefix-aware routing: entries for the worker that holds their prefix -----------------------

    def _hand_over(self, stream: str, entries: list) -> list:
        """Fresh entries that prefer another live worker become its (HANDOFF_SCRIPT, one round trip for all);
        the rest are ours."""
        now_ms = time.time() * 1000
        away = [(eid, prefer) for eid, fields in entries
                if (prefer := c.preferred_worker(fields or {})) and prefer != self.name
                and now_ms - _entry_ms(eid) < self.cfg.route_wait_s * 1000]
        if not away:
            return entries
        pipe = self.redis.pipeline(transaction=False)
        for eid, prefer in away:
            self._handoff(keys=[stream, c.handoff_key(prefer), c.heartbeat_key(prefer)],
                          args=[c.GROUP, prefer, eid, f"{time.time():.3f}"], client=pipe)
        handed = {eid for (eid, prefer), done in zip(away, pipe.execute()) if done == 1}
        if handed:
            log.debug("entries handed to the workers that hold their prefixes",
                      extra={"worker": self.name, "count": len(handed)})
        return [(eid, fields) for eid, fields in entries if eid not in handed]

    def _take_handoffs(self, want: int) -> int:
        """Entries other workers handed to us: up to ``want`` taken (first in), and those we had no room for
        within route_wait_s put back in their streams. How many were taken."""
        pipe = self.redis.pipeline(transaction=False)
        if want > 0:
            pipe.lpop(self._handoffs, want)
        pipe.lindex(self._handoffs, 0)
        *popped, oldest = pipe.execute()
        taken = self._deliver_handoffs([_handoff_item(i) for i in (popped[0] or [])] if popped else [])
        stale_before = time.time() - self.cfg.route_wait_s
        if oldest is not None and _handoff_item(oldest)[2] < stale_before:
            queued = [_handoff_item(i) for i in self.redis.lrange(self._handoffs, 0, 999)]
            stale = sum(1 for _, _, ts in queued if ts < stale_before)
            items = [_handoff_item(i) for i in self.redis.lpop(self._handoffs, stale) or []]
            pipe = self.redis.pipeline(transaction=False)
            for stream, eid, _ in items:
                self._requeue(keys=[stream], args=[c.GROUP, self.name, eid], client=pipe)
            put_back = sum(1 for r in pipe.execute() if r == 1)
            log.info("handed-over entries put back in their streams (no room here in time)",
                     extra={"worker": self.name, "count": put_back})
        return taken

    def _deliver_handoffs(self, items: list[tuple[str, bytes, float]]) -> int:
        if not items:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for stream, eid, _ in items:
            pipe.xrange(stream, eid, eid)
        by_stream: dict[str, list] = {}
        for (stream, eid, _), found in zip(items, pipe.execute()):
            by_stream.setdefault(stream, []).append((eid, found[0][1] if found else None, 1))
        for stream, entries in by_stream.items():
            self._deliver(stream, entries)
        return len(items)

    def _deliver(self, stream: str, entries: list[tuple[bytes, dict | None, int]]) -> None:
        """Look up existing results and cancel marks in one round trip, then hand over."""
        read_at = time.time()
        pipe = self.redis.pipeline(transaction=False)
        rids = []
        for _, fields, _ in entries:
            rid = c.request_id_of(fields) if fields else None
            rids.append(rid)
            pipe.exists(c.result_key(rid or "?"))
            pipe.exists(c.cancel_key(rid or "?"))
        replies = iter(pipe.execute())
        with self._lock:
            for eid, _, _ in entries:
                self._owned[eid] = stream
        for (eid, fields, deliveries), rid in zip(entries, rids):
            has_result, cancelled = bool(next(replies)), bool(next(replies))
            self._delivered += 1
            self.inbox.put(Incoming(stream, eid, fields or None, deliveries, has_result and rid is not None,
                                    cancelled and rid is not None, read_at))

    # -- reclaim and audit ------------------------------------------------------------------------

    def _replay_own_pending(self) -> None:
        """After a restart under the same name, our own pending entries come first."""
        for stream in self._streams.all:
            reply = self.redis.xreadgroup(c.GROUP, self.name, {stream: "0"}, count=100_000)
            entries = reply[0][1] if reply else []
            if entries:
                log.info("replaying own pending entries", extra={"worker": self.name, "count": len(entries)})
                self._deliver(stream, [(eid, f, self._deliveries(stream, eid)) for eid, f in entries])

    def _deliveries(self, stream: str, entry_id: bytes) -> int:
        pending = self.redis.xpending_range(stream, c.GROUP, min=entry_id, max=entry_id, count=1)
        return pending[0]["times_delivered"] if pending else 1

    def _reclaim_from_dead(self) -> None:
        """Take pending entries whose consumer's heartbeat has expired, up to what we can run (two round trips
        when nobody died: every stream's pending summary, then the owners' heartbeats)."""
        streams = self._streams.all
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending(stream, c.GROUP)
        held = [(stream, o["name"].decode()) for stream, summary in zip(streams, pipe.execute())
                for o in summary.get("consumers") or [] if o["name"].decode() != self.name]
        owners = sorted({owner for _, owner in held})
        if not owners:
            return
        pipe = self.redis.pipeline(transaction=False)
        for owner in owners:
            pipe.exists(c.heartbeat_key(owner))
        dead = {owner for owner, alive in zip(owners, pipe.execute()) if not alive}
        for stream, owner in held:
            want = self._want()
            if want <= 0:
                return
            if owner in dead:
                self._claim_from(stream, owner, want)

    def _claim_from(self, stream: str, owner: str, count: int) -> None:
        ids, counts, entries = self._reclaim(keys=[stream, c.heartbeat_key(owner)],
                                             args=[c.GROUP, owner, self.name, count])
        if not ids:
            return
        fields_by_id = {e[0]: _fields(e[1]) for e in entries if e}
        log.info("reclaimed entries of a dead worker", extra={"worker": self.name, "from": owner,
                                                              "stream": stream, "count": len(ids)})
        self._deliver(stream, [(eid, fields_by_id.get(eid), n) for eid, n in zip(ids, counts)])

    def _delete_dead_consumers(self) -> None:
        """Consumers without a heartbeat that hold no entries and were idle a minute: gone for good (the script
        checks both in one step, so a consumer that still holds entries is never deleted)."""
        idle_ms = int(self.cfg.consumers_gc_interval_s * 1000)
        for stream in self._streams.all:
            for info in self.redis.xinfo_consumers(stream, c.GROUP):
                name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
                if name != self.name and info["pending"] == 0 and info["idle"] >= idle_ms:
                    self._reclaim(keys=[stream, c.heartbeat_key(name)], args=[c.GROUP, name, self.name, 0])

    def leave(self) -> None:
        """At exit, after the heartbeat is deleted: drop this consumer from the streams where it holds nothing
        (where it still holds entries, the workers that take them delete it)."""
        for stream in self._streams.all:
            self._reclaim(keys=[stream, c.heartbeat_key(self.name)], args=[c.GROUP, self.name, self.name, 0])

    def _audit_own_pending(self) -> None:
        """Entries pending under our name that we do not hold (their XACK was lost): deliver them again."""
        idle_ms = int(self.cfg.audit_interval_s * 1000)
        for stream in self._streams.all:
            pending = self.redis.xpending_range(stream, c.GROUP, min="-", max="+", count=1000,
                                                consumername=self.name, idle=idle_ms)
            with self._lock:
                lost = [p for p in pending if p["message_id"] not in self._owned]
            if not lost:
                continue
            ids = [p["message_id"] for p in lost]
            claimed = self.redis.xclaim(stream, c.GROUP, self.name, idle_ms, ids)
            fields_by_id = {eid: f for eid, f in claimed if eid is not None}
            log.warning("re-delivering own entries whose acknowledgement was lost",
                        extra={"worker": self.name, "stream": stream, "count": len(ids)})
            self._deliver(stream, [(p["message_id"], fields_by_id.get(p["message_id"]), p["times_delivered"] + 1)
                                   for p in lost])

    # -- heartbeat, watches, owners ---------------------------------------------------------------

    def _beat(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self.heartbeat().publish(pipe)
        previous = pipe.execute()[0]
        if previous is None and self._beaten:
            self._find_lost_entries()
        self._beaten = True

    def _find_lost_entries(self) -> None:
        """Our heartbeat had expired (this process was paused, or Redis restarted without it): other workers may
        have taken entries we hold. Those no longer pending under our name are theirs now: handed to the loop
        (``lost``), which drops their requests without writing anything (the finals are fenced anyway)."""
        with self._lock:
            owned = dict(self._owned)
        ours: set[bytes] = set()
        for stream in set(owned.values()):
            pending = self.redis.xpending_range(stream, c.GROUP, min="-", max="+", count=100_000,
                                                consumername=self.name)
            ours |= {p["message_id"] for p in pending}
        lost = [eid for eid in owned if eid not in ours]
        log.warning("heartbeat had lapsed; entries taken over by other workers are dropped here",
                    extra={"worker": self.name, "held": len(owned), "lost": len(lost)})
        with self._lock:
            for eid in lost:
                self._owned.pop(eid, None)
        for eid in lost:
            self.lost.put(eid)

    def _poll_watches(self) -> None:
        """Which running async requests an /events stream watches (their deltas are published only then)."""
        flights = [f for f in self.flights() if f.request.record_text]
        if not flights:
            return
        pipe = self.redis.pipeline(transaction=False)
        for flight in flights:
            pipe.exists(c.watch_key(flight.id))
        for flight, watched in zip(flights, pipe.execute()):
            flight.watched = bool(watched)

    def _poll_owners(self, now: float) -> None:
        """Abort the running requests of API processes whose lease has been gone for OWNER_GRACE_S.

        A lapsed owner stays lapsed (its queued requests are cancelled as they arrive) until its lease is back
        or LAPSED_MEMORY_S passed."""
        flights = [f for f in self.flights() if f.request.owner]
        owners = sorted({f.request.owner for f in flights} | self._lapsed.keys())
        if owners:
            pipe = self.redis.pipeline(transaction=False)
            for owner in owners:
                pipe.exists(c.owner_key(owner))
            alive = dict(zip(owners, pipe.execute()))
        else:
            alive = {}
        self._owner_missing = {o: self._owner_missing.get(o, now) for o, ok in alive.items() if not ok}
        for owner, since in self._owner_missing.items():
            if now - since >= c.OWNER_GRACE_S and owner not in self._lapsed:
                log.warning("an API process's lease lapsed; cancelling its requests", extra={"owner": owner})
                self._lapsed[owner] = now
        self._lapsed = {o: t for o, t in self._lapsed.items() if not alive.get(o) and now - t < LAPSED_MEMORY_S}
        self.lapsed_owners = frozenset(self._lapsed)
        for flight in flights:
            if flight.request.owner in self._lapsed and flight.id not in self._aborted:
                self._aborted.add(flight.id)
                self.aborts.put((flight.id, OWNER_GONE))
        if len(self._aborted) > 100_000:
            self._aborted.clear()


    def _poll_cancels(self) -> None:
        """After the abort subscription was down: abort running requests whose cancel marker is set."""
        if not self.recheck_cancels:
            return
        self.recheck_cancels = False
        flights = self.flights()
        if not flights:
            return
        pipe = self.redis.pipeline(transaction=False)
        for flight in flights:
            pipe.exists(c.cancel_key(flight.id))
        for flight, cancelled in zip(flights, pipe.execute()):
            if cancelled:
                self.aborts.put((flight.id, CANCELLED))

def _fields(raw) -> dict | None:
    """A script's [k1, v1, k2, v2, ...] as the dict redis-py gives for stream entries."""
    if not raw:
        return None
    return {raw[i]: raw[i + 1] for i in range(0, len(raw), 2)}


LAPSED, REFRESHED, STUCK = "lapsed", "refreshed", "stuck"


def wait_for_lapse(client: redis.Redis, key: str, timeout_s: float) -> str:
    """Until ``key`` (a liveness key with a TTL, rewritten with a new value while its owner lives) is gone:
    LAPSED (or there was none), REFRESHED (its value changed: a live owner), or STUCK (neither within timeout_s)."""
    first = client.get(key)
    deadline = time.monotonic() + timeout_s
    while first is not None and time.monotonic() < deadline:
        time.sleep(0.1)
        now = client.get(key)
        if now is None:
            return LAPSED
        if now != first:
            return REFRESHED
    return LAPSED if first is None else STUCK


def _entry_ms(entry_id: bytes) -> int:
    """When a stream entry was added (its id's milliseconds)."""
    return int(entry_id.split(b"-", 1)[0])


def _handoff_item(raw: bytes) -> tuple[str, bytes, float]:
    stream, eid, ts = raw.decode().split(" ")
    return stream, eid.encode(), float(ts)

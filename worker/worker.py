"""The GPU worker: Redis streams → engine continuous batches → pub/sub deltas and results.

    process input (new entries, aborts, deadlines) → engine.step() → hand outputs to the writer

All Redis round trips happen on RedisIO's threads; this loop only moves items
between queues and the engine.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import redis

from engine.engine import LLMEngine
from engine.gc_policy import YOUNG_THRESHOLD, GcClock, settle_heap
from engine.phases import PhaseClock
from engine.sequence import Request
from worker import contract as c
from worker.loop_stats import LoopStats
from worker.ops import AckDelete, Command, End, FinishIfOwned, Op, Outputs, Publish, Start
from worker.prefix_digests import block_digest
from worker.reader import CANCELLED, OWNER_GONE, Incoming, ReaderConfig
from worker.redis_io import RedisIO
from worker.results import InFlight

log = logging.getLogger(__name__)

DEAD_LETTER_DATA_BYTES = 65536  # of a dead entry's data kept for inspection
IDLE_RATE_S = 2.0  # no token for this long: the heartbeat's tokens/s is 0
# Interactive entries read ahead of the free slots, for the slots the next steps free: they wait in the engine,
# so a slot freed in one step runs one of them at the next launch (read only once it frees, a slot idled a step
# or two while the reader went to Redis). At most an eighth of the slots.
LOOKAHEAD_STEPS = 2


def unique_worker_name(device: str = "") -> str:
    """<host>-<device>-<random>: two workers on one host never share a consumer (they would share entries)."""
    parts = [socket.gethostname(), device.replace(":", ""), secrets.token_hex(3)]
    return "-".join(p for p in parts if p)


@dataclass
class Preparing:
    """A request waiting for ``future`` (run off the loop); then ``then(flight, request, result)``."""
    future: Future
    flight: InFlight
    request: Request
    then: Callable[[InFlight, Request, object], bool]


@dataclass
class WorkerConfig:
    redis_url: str = "redis://localhost:6379/0"
    name: str = ""  # consumer name; default unique (unique_worker_name)
    max_deliveries: int = 3  # then the entry is dead-lettered and its request fails
    drain_timeout_s: float = 30.0
    result_ttl_s: int = c.RESULT_TTL_S
    deadline_check_interval_s: float = 0.5
    interactive_reserve: int | None = None  # slots batch lines leave free for sync requests (None: a 128th, >= 1)
    log_stats_interval_s: float = 10.0  # the "loop stats" log line (worker.loop_stats); 0: never
    gc_young_threshold: int = YOUNG_THRESHOLD  # engine/gc_policy.py
    shared_states_gib: float = 2.0  # the prefix cache's tier in Redis, all workers together (0: none)
    shared_states_ttl_s: int = 3600
    shared_states_redis_url: str | None = None  # None: redis_url
    shared_states_min_tokens: int = 256  # no shorter prefix's state shared, none fetched to save fewer tokens

    def __post_init__(self) -> None:
        if not self.name:
            self.name = unique_worker_name()
        if self.max_deliveries < 1:
            raise ValueError("max_deliveries must be >= 1")
        if self.shared_states_gib < 0 or self.shared_states_ttl_s < 1 or self.shared_states_min_tokens < 1:
            raise ValueError("shared_states_gib must be >= 0, shared_states_ttl_s and shared_states_min_tokens >= 1")
        if self.gc_young_threshold < 1:  # 0 would turn the collector off: cycles would never be freed
            raise ValueError("gc_young_threshold must be >= 1")


class Worker:
    def __init__(self, engine: LLMEngine, cfg: WorkerConfig, device: str = "cpu", model_name: str = ""):
        self.engine = engine
        self.cfg = cfg
        self.device = device
        self.model_name = model_name
        self.io = RedisIO(cfg.redis_url, cfg.name, ReaderConfig(), self._heartbeat)
        self.writer = self.io.writer
        self.writer.end_ops = self._end_ops
        self.reader = self.io.reader
        reserve = cfg.interactive_reserve
        if reserve is None:
            # a 128th of the slots, and at least one where there are two (a CPU worker's 32 slots gave none)
            reserve = (max(1, engine.num_slots // 128) if engine.num_slots > 1 else 0) if engine is not None else 0
        self.reader.interactive_reserve = reserve
        if engine is not None:  # batch lines waiting in the engine leave the reserve to sync requests there too
            engine.reserve_slots(reserve)
        self._finishes_per_step = 0.0  # sequences finished a step, averaged over recent steps (_lookahead)
        self.inflight: dict[str, InFlight] = {}
        # requests waiting for something done off the loop (a shared prefix state's fetch, a grammar's
        # compilation): each goes on once its future is done
        self.preparing: dict[str, Preparing] = {}
        self._lost_entries: set[bytes] = set()  # entries other workers took over (reader.lost)
        self.shared = self._make_shared_states()
        if getattr(engine, "prefix_cache", None) is not None:
            engine.prefix_cache.on_added = self._advertise
        self._background = ThreadPoolExecutor(1, thread_name_prefix="gaggle-worker-io")  # rare reads: state files
        self.started = time.time()
        self.draining = False
        self.stop_now = False
        self._drain_deadline = 0.0
        self._next_deadline_check = 0.0
        self._tokens_per_s = 0.0  # an average over recent steps (see _current_tokens_per_s)
        self._last_tokens_at = 0.0
        self._quarantine: list[InFlight] = []  # requests of a failed step, re-run one at a time
        self.gc_clock = GcClock()
        self.stats = None if engine is None else LoopStats(  # engines without a phase clock report no phases
            cfg.name, cfg.log_stats_interval_s, getattr(engine, "clock", None) or PhaseClock(), self._gauges,
            self.gc_clock)
        self._under_test: str | None = None
        self.metrics = None  # worker.metrics.WorkerMetrics when --metrics-port is given

    def attach_metrics(self, metrics) -> None:
        self.metrics = metrics
        metrics.attach_gc_clock(self.gc_clock)
        self.io.on_write = metrics.on_write

    # -- lifecycle -----------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.draining:
            self.stop_now = True  # second signal: exit now
        else:
            self.draining = True
            self.reader.reading = False  # at once: nothing more is read (not even ahead) from here
            self._drain_deadline = time.monotonic() + self.cfg.drain_timeout_s
        log.warning("signal received", extra={"worker": self.cfg.name, "signal": signum,
                                              "action": "exit now" if self.stop_now else "drain"})

    def run(self, burst: bool = False) -> None:
        """Serve until signalled (or, with ``burst``, until the streams and the engine are empty)."""
        settle_heap(self.cfg.gc_young_threshold)
        self.io.start()
        log.info("worker started", extra={"worker": self.cfg.name, "device": self.device,
                                          "slots": self.engine.num_slots, "burst": burst})
        try:
            while not self.stop_now:
                if self.stats is not None:
                    self.stats.maybe_report()
                if self.draining and self._drain_step_done():
                    break
                self._take_incoming()
                self._apply_aborts()
                self._expire_deadlines()
                self._update_capacity()  # after the intake: the reader reads while the step runs
                if self.engine.has_work():
                    self._step()
                    continue
                self.writer.release()  # no next launch to wait for
                if burst and self._is_idle():
                    break
                self._wait_for_input()
        finally:
            self._shutdown()

    def _drain_step_done(self) -> bool:
        """Draining ends when no interactive request is left: batch lines (hours of them, nobody waiting on a
        connection) stay pending for the next worker, which generates them again."""
        self.reader.reading = False
        if not self.engine.has_work():
            return True
        waiting_on = [*self.inflight.values(), *(p.flight for p in self.preparing.values())]
        if all(flight.request.priority == c.BATCH for flight in waiting_on):
            log.info("drained; leaving batch lines to other workers",
                     extra={"worker": self.cfg.name, "requests": len(self.inflight)})
            return True
        if time.monotonic() > self._drain_deadline:
            log.warning("drain timeout; leaving running requests to other workers",
                        extra={"worker": self.cfg.name, "requests": len(self.inflight)})
            return True
        return False

    def _gauges(self) -> dict[str, int]:
        engine = self.engine
        return {"running": engine.num_running, "waiting": engine.num_unfinished - engine.num_running,
                "free_slots": engine.num_free_slots, "inbox": self.reader.inbox.qsize(),
                "writer_backlog": self.writer.backlog}

    def _shutdown(self) -> None:
        if self.stats is not None and self.stats.interval_s > 0:
            self.stats.report()  # the last stretch, so that the lines add up to the whole run
        self.gc_clock.close()
        self.reader.reading = False
        self.writer.flush(timeout_s=10.0)
        self._release_unfinished()
        if self.shared is not None:
            self.shared.flush(timeout_s=2.0)
            self.shared.close()
        self.io.stop()
        try:
            self.io.redis.delete(c.heartbeat_key(self.cfg.name))
            self.io.redis.zrem(c.WORKER_REGISTRY, self.cfg.name)
            self.reader.leave()
        except redis.RedisError as e:  # our heartbeat expires anyway: others take what we hold
            log.warning("could not sign off from redis", extra={"worker": self.cfg.name, "error": str(e)})
        log.info("worker stopped", extra={"worker": self.cfg.name})

    def _release_unfinished(self) -> None:
        """What we did not finish stays pending under our name: other workers take it once our heartbeat is
        deleted (at the end of the shutdown)."""
        leftovers = len(self.inflight) + self.reader.inbox.qsize()
        if leftovers:
            log.info("leaving unfinished entries to other workers", extra={"worker": self.cfg.name,
                                                                           "count": leftovers})

    def _is_idle(self) -> bool:
        return (self.reader.inbox.empty() and self.reader.last_read_empty and not self.inflight and not self.preparing
                and self.writer.flush(0.0) and self.reader.num_owned == 0 and self.reader.settled())

    def _wait_for_input(self) -> None:
        item = self.reader.take(timeout=0.02)
        if item is not None:
            self._accept(item)

    def _update_capacity(self) -> None:
        if self._quarantine:
            self.reader.set_capacity(0)
            return
        waiting = self.engine.num_unfinished - self.engine.num_running + len(self.preparing)
        self.reader.set_capacity(self.engine.num_free_slots - waiting, self._lookahead())

    def _lookahead(self) -> int:
        """Entries to hold beyond the free slots: the sequences the next LOOKAHEAD_STEPS steps should finish
        (at least one while any runs), at most an eighth of the slots; none while another worker has a free
        slot (the entry is better run there now than here later)."""
        engine = self.engine
        if not engine.num_running or self.reader.peers_have_room:
            return 0
        expected = int(LOOKAHEAD_STEPS * self._finishes_per_step + 0.999)
        return min(max(1, expected), max(1, engine.num_slots // 8))

    # -- input ---------------------------------------------------------------------

    def _take_incoming(self) -> None:
        if not self.reader.lost.empty():
            self._drop_lost()
        if self.preparing:
            self._start_prepared()
        if self._quarantine:
            self._admit_from_quarantine()
            return
        if self.draining:  # a read in flight when the drain began may still deliver: left pending for others
            return
        while (item := self.reader.take()) is not None:
            self._accept(item)

    def _accept(self, item: Incoming) -> None:
        """Start an entry's request, or end it at once; whatever goes wrong, that entry fails, the worker serves on."""
        try:
            self._accept_entry(item)
        except Exception as e:
            rid = c.request_id_of(item.fields or {})
            log.exception("could not accept an entry", extra={"request_id": rid, "stream": item.stream})
            if rid is not None:
                self.inflight.pop(rid, None)
                self.engine.abort(rid)
            self._dead_letter(item, rid, f"the worker could not accept this request: {e!r}")

    def _drop_lost(self) -> None:
        """Requests whose entries other workers took over while our heartbeat had lapsed: dropped here, nothing
        written (they run there; our finals would be refused anyway)."""
        lost = set()
        while not self.reader.lost.empty():
            lost.add(self.reader.lost.get_nowait())
        self._lost_entries |= lost  # entries still in the inbox, read before the lapse
        for rid, flight in list(self.inflight.items()):
            if flight.entry_id in lost:
                self.inflight.pop(rid)
                self.engine.abort(rid)
                self.writer.submit([End(flight, None)])
                log.warning("request taken over by another worker; dropped here", extra={"request_id": rid})
        for rid, p in list(self.preparing.items()):
            if p.flight.entry_id in lost:
                del self.preparing[rid]
                log.warning("request taken over by another worker; dropped here", extra={"request_id": rid})

    def _accept_entry(self, item: Incoming) -> None:
        if item.entry_id in self._lost_entries:
            self._lost_entries.discard(item.entry_id)
            if item.deliveries <= 1:  # read before the lapse: not ours now (a later claim of it is)
                return
        if item.fields is None:  # deleted from the stream: nothing left to do
            self.writer.submit([AckDelete(item.stream, item.entry_id)])
            return
        try:
            req = c.QueuedRequest.decode(item.fields)
        except c.SchemaError as e:
            self._dead_letter(item, c.request_id_of(item.fields), f"invalid request entry: {e}", invalid=True)
            return
        if item.has_result or req.id in self.inflight or req.id in self.preparing:
            log.info("duplicate delivery; already handled", extra={"request_id": req.id})
            if req.id not in self.inflight and req.id not in self.preparing:
                self.writer.submit([AckDelete(item.stream, item.entry_id)])
            return
        if item.deliveries > self.cfg.max_deliveries:
            self._dead_letter(item, req.id, f"delivered {item.deliveries} times without finishing "
                                            f"(max_deliveries={self.cfg.max_deliveries})", req)
            return
        if item.cancelled:
            self._finish_terminal(item.stream, item.entry_id, req, c.STATUS_CANCELLED, CANCELLED, "cancelled")
            return
        if req.owner and req.owner in self.reader.lapsed_owners:
            self._finish_terminal(item.stream, item.entry_id, req, c.STATUS_CANCELLED, OWNER_GONE, "cancelled")
            return
        if req.deadline and time.time() > req.deadline:
            self._finish_terminal(item.stream, item.entry_id, req, c.STATUS_EXPIRED, "deadline passed before it ran", "expired")
            return
        flight = InFlight(req, item.stream, item.entry_id, read_at=item.read_at)
        if item.deliveries > 1 and req.record_text:
            self._clear_recorded_text(req)
        self._start(flight)

    def _clear_recorded_text(self, req: c.QueuedRequest) -> None:
        """A reclaimed request is generated again from its prompt: its recorded text starts again too (readers
        of its deltas skip the repeated prefix by offset). Rare, so done here, before its first append."""
        try:
            self.io.redis.delete(*[c.text_key(req.id, i) for i in range(req.n)])
        except redis.RedisError:
            log.exception("could not clear the recorded text of a reclaimed request", extra={"request_id": req.id})

    def _start(self, flight: InFlight) -> bool:
        req = flight.request
        params = req.sampling
        if params.seed is None:  # fixed by the id: a re-run anywhere reproduces what was published
            params.seed = c.stable_seed(req.id)
        request = Request(req.id, list(req.prompt_token_ids), params, n=req.n,
                          priority=c.PRIORITIES.index(req.priority))
        state = params.state
        if state is not None and state.startswith(c.UPLOADED_STATE_PREFIX):  # its owner checked each time
            read = self._background.submit(self._read_uploaded_state, state, req.tenant,
                                           state not in self.engine.state_names)
            self.preparing[req.id] = Preparing(read, flight, request, self._after_state_read)
            return True
        return self._fetch_then_add(flight, request)

    def _fetch_then_add(self, flight: InFlight, request: Request) -> bool:
        fetch = self._fetch_shared_prefix(request)
        if fetch is not None:  # a longer prefix state than ours is in the shared tier: fetched off the loop
            self.preparing[request.request_id] = Preparing(fetch, flight, request, self._after_fetch)
            return True
        return self._compile_then_add(flight, request)

    # -- uploaded initial states (POST /v1/files, purpose rwkv_state) ----------------------------------

    def _read_uploaded_state(self, file_id: str, tenant: str, load: bool) -> bytes | str | None:
        """(A thread.) The state file's bytes (``load``; else None: it is loaded here already), or why the
        request may not use it: another tenant's file is as unknown as a deleted or expired one."""
        key = c.uploaded_state_key(file_id)
        try:
            tenant_of, data = self.io.redis.hmget(key, "tenant", "data") if load else \
                (self.io.redis.hget(key, "tenant"), None)
        except Exception as e:  # never None here: None means allowed
            return f"could not read state {file_id!r}: {e}"
        if tenant_of is None or tenant_of.decode() != tenant or (load and data is None):
            return (f"state {file_id!r} is not an uploaded state file of this tenant (upload one with POST "
                    "/v1/files, purpose rwkv_state)")
        return data

    def _after_state_read(self, flight: InFlight, request: Request, data) -> bool:
        rid = request.request_id
        error = data if isinstance(data, str) else None
        if data is not None and error is None:
            try:
                self.engine.load_state(request.params.state, data)
                log.info("uploaded state loaded", extra={"request_id": rid, "state": request.params.state})
            except ValueError as e:  # engine.initial_states.StateFileError
                error = str(e)
        if error is not None:
            self._dead_letter(Incoming(flight.stream, flight.entry_id, None, 0), rid, error, flight.request,
                              invalid=True)
            return False
        return self._fetch_then_add(flight, request)

    def _compile_then_add(self, flight: InFlight, request: Request) -> bool:
        future = self.engine.prepare(request)
        if future is not None:  # its grammar compiles off the loop; _start_prepared adds it
            self.preparing[request.request_id] = Preparing(future, flight, request,
                                                           lambda f, r, _: self._add(f, r))
            log.info("request waits for its grammar", extra={"request_id": request.request_id})
            return True
        return self._add(flight, request)

    def _start_prepared(self) -> None:
        for rid, p in list(self.preparing.items()):
            if p.future.done():
                del self.preparing[rid]
                p.then(p.flight, p.request, None if p.future.exception() else p.future.result())

    # -- the shared tier of the prefix cache (worker.shared_states) ----------------------------------

    def _make_shared_states(self):
        cache = getattr(self.engine, "prefix_cache", None)
        cap = int(self.cfg.shared_states_gib * 2**30)
        if cache is None or cap <= 0:
            return None
        from worker.shared_states import SharedStates, SharedStatesConfig
        return SharedStates.for_engine(self.engine, SharedStatesConfig(
            self.cfg.shared_states_redis_url or self.cfg.redis_url, cap, self.cfg.shared_states_ttl_s,
            self.cfg.shared_states_min_tokens))

    def _advertise(self, prefix: list[int], state: str | None) -> None:
        """Tell the API this worker holds a state of ``prefix`` (it routes prompts on that path here)."""
        if state is None and len(prefix) >= c.ROUTE_MIN_TOKENS:
            self.writer.submit([Command("SET", c.held_key(block_digest(prefix)), self.cfg.name, "EX", c.HELD_TTL_S)])

    def _fetch_shared_prefix(self, request: Request) -> Future | None:
        if self.shared is None or request.params.prompt_logprobs is not None:
            return None
        return self.shared.lookup_request(request.prompt_token_ids, request.params.state)

    def _after_fetch(self, flight: InFlight, request: Request, fetched) -> bool:
        self.shared.take(request.prompt_token_ids, request.params.state, fetched)
        return self._compile_then_add(flight, request)

    def _add(self, flight: InFlight, request: Request) -> bool:
        req = flight.request
        try:
            self.engine.add(request)
        except ValueError as e:  # past the API's checks: it knew other limits (no heartbeat yet)
            self._dead_letter(Incoming(flight.stream, flight.entry_id, None, 0), req.id, f"invalid request: {e}", req,
                              invalid=True)
            return False
        self.inflight[req.id] = flight
        if self.stats is not None:
            self.stats.on_started(len(req.prompt_token_ids))
        key = c.request_key(req.id)
        ops: list[Op] = [Start(flight), Command("HSET", key, "status", c.STATUS_RUNNING, "worker", self.cfg.name,
                                                  "started", time.time()),
                         Command("EXPIRE", key, c.REQUEST_RECORD_TTL_S)]
        if req.stream or req.record_text:
            ops.append(Publish(flight.channel, c.status_message(req.id, c.STATUS_RUNNING)))
        self.writer.submit(ops)
        log.info("request running", extra={"request_id": req.id, "worker": self.cfg.name,
                                           "prompt_tokens": len(req.prompt_token_ids), "n": req.n})
        return True

    def _apply_aborts(self) -> None:
        while not self.reader.aborts.empty():
            rid, reason = self.reader.aborts.get_nowait()
            if rid in self.preparing:
                flight = self.preparing.pop(rid).flight
                self._finish_terminal(flight.stream, flight.entry_id, flight.request, c.STATUS_CANCELLED, reason,
                                      "cancelled")
                continue
            flight = self.inflight.pop(rid, None)
            if flight is None:
                continue
            self.engine.abort(rid)
            self._finish_terminal(flight.stream, flight.entry_id, flight.request, c.STATUS_CANCELLED, reason,
                                  "cancelled", flight)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + self.cfg.deadline_check_interval_s
        wall = time.time()
        for rid, flight in list(self.inflight.items()):
            if flight.request.deadline and wall > flight.request.deadline:
                self.inflight.pop(rid)
                self.engine.abort(rid)
                self._finish_terminal(flight.stream, flight.entry_id, flight.request, c.STATUS_EXPIRED,
                                      "deadline passed during generation", "expired", flight)

    # -- step ----------------------------------------------------------------------

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step(after_launch=self.writer.release)
        except Exception as e:
            self._on_step_failure(e)
            return
        self._under_test = None
        # The writer thread folds the outputs into their requests and encodes them, once the next step is
        # launched (Writer.hold); here only what the loop itself needs: which requests the engine finished.
        if outputs:
            self.writer.hold([Outputs(outputs, time.time())])
        inflight, tokens, finished = self.inflight, 0, 0
        for out in outputs:
            tokens += len(out.token_ids)
            if out.finished:
                finished += 1
                flight = inflight.get(out.request_id)
                if flight is not None:
                    flight.unfinished -= 1
                    if flight.unfinished == 0:
                        del inflight[out.request_id]
        self._finishes_per_step = 0.9 * self._finishes_per_step + 0.1 * finished
        dt = time.perf_counter() - t0
        if outputs and dt > 0:
            self._tokens_per_s = 0.9 * self._tokens_per_s + 0.1 * (len(outputs) / dt)
            self._last_tokens_at = time.monotonic()
        if self.stats is not None:
            self.stats.on_step(dt, tokens)
        if self.metrics is not None:
            self.metrics.on_step(dt, len(outputs), self.engine.num_running, self.engine.num_free_slots)

    def _end_ops(self, flight: InFlight, terminal: tuple | None) -> list[Op]:
        """Writer thread: the ops that write a running request's result, once its outputs are all folded in.

        ``terminal``: None when the engine finished it, else (status, message, code) of a cancel or expiry
        (the result keeps what was generated).
        """
        result = flight.result(self.cfg.name)
        if terminal is not None:
            status, message, code = terminal
            partial, result = result, c.error_result(flight.id, status, message, code, worker=self.cfg.name,
                                                     queued=flight.request)
            result.choices, result.completion_tokens = partial.choices, partial.completion_tokens
            result.prompt_tokens = partial.prompt_tokens
        return self._final_ops(flight.stream, flight.entry_id, result, flight.channel)

    def _final_ops(self, stream: str, entry_id: bytes, result: c.Result, channel: str) -> list[Op]:
        data = result.encode()
        if self.metrics is not None:
            self.metrics.on_request_end(result.status)
        key = c.request_key(result.id)
        log.info("request finished", extra={"request_id": result.id, "status": result.status,
                                            "completion_tokens": result.completion_tokens, "worker": self.cfg.name,
                                            "request_created": result.created, **result.timings})
        return [FinishIfOwned(stream, entry_id, [
            ("SET", c.result_key(result.id), data, "EX", self.cfg.result_ttl_s, "NX"),
            ("HSET", key, "status", result.status, "finished", result.finished),
            ("EXPIRE", key, c.REQUEST_RECORD_TTL_S),
            ("PUBLISH", channel, c.final_message(result.id, data))])]  # after the SET

    def _finish_terminal(self, stream: str, entry_id: bytes, req: c.QueuedRequest, status: str, message: str,
                         code: str, flight: InFlight | None = None) -> None:
        log.info("request ended", extra={"request_id": req.id, "status": status, "reason": message})
        if flight is not None:  # running: the writer writes the result once it folded in what was generated
            self.writer.submit([End(flight, (status, message, code))])
            return
        result = c.error_result(req.id, status, message, code, worker=self.cfg.name, queued=req)
        self.writer.submit(self._final_ops(stream, entry_id, result, c.channel_of(req)))

    def _dead_letter(self, item: Incoming, rid: str | None, reason: str, req: c.QueuedRequest | None = None,
                     invalid: bool = False) -> None:
        """Record the entry in the dead-letter stream and fail its request (``invalid``: as the client's error)."""
        log.error("dead-lettering entry", extra={"request_id": rid, "stream": item.stream, "reason": reason})
        data = (item.fields or {}).get(c.ENTRY_FIELD, b"")[:DEAD_LETTER_DATA_BYTES]
        ops: list[Op] = [Command("XADD", c.STREAM_DEAD, "MAXLEN", "~", c.DEAD_LETTER_MAXLEN, "*", "stream", item.stream,
                                 "entry_id", item.entry_id, "request_id", rid or "", "reason", reason, "data", data)]
        self.writer.submit(ops)
        if rid is None:
            self.writer.submit([AckDelete(item.stream, item.entry_id)])
            return
        result = c.error_result(rid, c.STATUS_FAILED, reason, "invalid_request" if invalid else "dead_letter",
                                worker=self.cfg.name, queued=req, err_type="invalid_request_error" if invalid else None)
        channel = c.channel_of(req) if req is not None else c.reply_to_of(item.fields or {}) or c.out_channel(rid)
        self.writer.submit(self._final_ops(item.stream, item.entry_id, result, channel))

    # -- a step that raised ----------------------------------------------------------

    def _on_step_failure(self, error: Exception) -> None:
        """Abort everything in the engine; re-run the requests one at a time to find the culprit."""
        if self._under_test is not None and self._under_test in self.inflight:
            culprit = self.inflight.pop(self._under_test)
            log.exception("request made the engine fail", extra={"request_id": culprit.id})
            self.engine.abort(culprit.id)
            self.writer.submit([End(culprit, None)])
            self._dead_letter(Incoming(culprit.stream, culprit.entry_id, None, 0), culprit.id,
                              f"the engine failed on this request: {error!r}", culprit.request)
        else:
            log.exception("engine step failed; isolating its requests",
                          extra={"worker": self.cfg.name, "requests": len(self.inflight)})
        self._under_test = None
        self.writer.flush()  # the writer has folded in every output so far: what each request has published
        for rid, flight in list(self.inflight.items()):
            self.engine.abort(rid)
            flight.suppress_tokens = max(len(ch.token_ids) for ch in flight.choices)
            self._quarantine.append(self._restart(flight))
        self.inflight.clear()

    @staticmethod
    def _restart(flight: InFlight) -> InFlight:
        fresh = InFlight(flight.request, flight.stream, flight.entry_id, received=flight.received,
                         read_at=flight.read_at)
        fresh.suppress_tokens = flight.suppress_tokens
        return fresh

    def _admit_from_quarantine(self) -> None:
        if self._under_test is not None:
            return  # the previous suspect has not completed a step yet
        flight = self._quarantine.pop(0)
        if self._start(flight):
            self._under_test = flight.id

    # -- heartbeat -----------------------------------------------------------------

    def _heartbeat(self) -> c.Heartbeat:
        if self.metrics is not None:
            self.metrics.sample_gpu_memory()
        return c.Heartbeat(name=self.cfg.name, pid=os.getpid(), host=socket.gethostname(), device=self.device,
                           model=self.model_name, num_slots=self.engine.num_slots, running=self.engine.num_running,
                           free_slots=self.engine.num_free_slots, tokens_per_s=round(self._current_tokens_per_s(), 1),
                           started=self.started, draining=self.draining,
                           max_model_len=self.engine.max_model_len, vocab_size=self.engine.vocab_size,
                           states=[s for s in getattr(self.engine, "state_names", [])
                                   if not s.startswith(c.UPLOADED_STATE_PREFIX)],
                           state_shape=self._state_shape(), **self._prefix_cache_counts())

    def _current_tokens_per_s(self) -> float:
        """The recent steps' rate while tokens come; it falls to 0 within IDLE_RATE_S once none have (the average
        is kept per step, so it would show the last busy rate forever)."""
        idle = time.monotonic() - self._last_tokens_at
        return self._tokens_per_s if idle < IDLE_RATE_S else 0.0

    def _state_shape(self) -> list[int]:
        shape = getattr(getattr(self.engine, "runner", None), "shape", None)
        return [shape.n_layer, shape.n_head, shape.head_size] if shape is not None else []

    def _prefix_cache_counts(self) -> dict:
        cache = getattr(self.engine, "prefix_cache", None)
        if cache is None:
            return {}
        st = cache.stats
        counts = {"prefix_lookups": st.lookups, "prefix_hits": st.hits, "prefix_tokens_saved": st.tokens_saved,
                  "prefix_bytes": cache.bytes_used(True) + cache.bytes_used(False)}
        if self.shared is not None:
            sh = self.shared.stats
            counts.update(shared_lookups=sh.lookups, shared_hits=sh.hits, shared_tokens=sh.tokens,
                          shared_published=sh.published)
        return counts

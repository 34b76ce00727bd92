"""The prefix cache's shared tier: prompt-prefix states in Redis, so that a worker that never saw a prefix starts
from another worker's work.

A checkpoint goes there once it has proved shared on its worker (prompts diverge at it, or a later prompt starts
from it: ``PrefixCache.on_shared``) and is at least ``min_tokens`` long; never a one-off prompt's (a bulk job of
unique prompts would push every state through Redis). Its bytes (``engine.state_blob``) live under a key of its
namespace (weights, numerics, initial state: ``ModelRunner.state_namespace``) and its tokens' digest, with a TTL
refreshed on use, under a byte cap shared by all workers that evicts the least recently used (a Lua script keeps
the count; Redis's own ``maxmemory`` policy is not relied on, since it would evict queue keys too).

A new prompt finds a state through an index: each state is listed under the digest of its prefix rounded down to
``contract.STATE_BLOCK`` tokens, so a lookup reads one hash per block of the prompt (one round trip) and checks
the candidates' full digests. It fetches the longest one only where that is cheaper than prefilling the tokens
it saves (measured: this worker's fetch throughput and its engine's prefill rate). Lookups and fetches run on a
small thread pool; the worker's loop adds the request once its future is done. Everything here is best effort:
a Redis error or a state that does not check out means a prefill, never a wrong state or a failed request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import redis

from engine.state_blob import StateBlob, StateBlobError, pack, unpack
from worker import contract as c
from worker.prefix_digests import PrefixDigests

log = logging.getLogger(__name__)

MAX_CANDIDATES = 4  # fetches tried per lookup before giving up (an evicted state leaves its index entry behind)
ROUND_TRIP_S = 0.0005  # a fetch's fixed cost beside its bytes

# KEYS: state, lru, sizes, total bytes, index.  ARGV: blob, ttl, now, cap, index field, index value.
# Returns {1 written | 0 already there | -1 larger than the cap, states evicted}.
PUBLISH_LUA = """
local key, lru, sizes, total, idx = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local blob, ttl, now, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSET', idx, ARGV[5], ARGV[6])
redis.call('EXPIRE', idx, ttl)
if redis.call('EXPIRE', key, ttl) == 1 then
  redis.call('ZADD', lru, now, key)
  return {0, 0}
end
local n = string.len(blob)
if n > cap then return {-1, 0} end
local used = tonumber(redis.call('GET', total) or '0')
local evicted = 0
while used + n > cap do
  local oldest = redis.call('ZPOPMIN', lru)
  if #oldest == 0 then used = 0 break end
  used = used - tonumber(redis.call('HGET', sizes, oldest[1]) or '0')
  redis.call('HDEL', sizes, oldest[1])
  evicted = evicted + redis.call('DEL', oldest[1])
end
if used < 0 then used = 0 end
redis.call('SET', key, blob, 'EX', ttl)
redis.call('ZADD', lru, now, key)
redis.call('HSET', sizes, key, n)
redis.call('SET', total, used + n)
return {1, evicted}
"""


@dataclass
class SharedStatesConfig:
    redis_url: str
    cap_bytes: int  # all workers' states together
    ttl_s: int = 3600
    min_tokens: int = 256  # no state shared for a shorter prefix; none fetched to save fewer tokens
    fetch_threads: int = 2


@dataclass
class Fetched:
    tokens: int  # the prompt's first ``tokens`` tokens
    blob: StateBlob


@dataclass
class SharedStats:
    lookups: int = 0
    hits: int = 0
    tokens: int = 0  # prompt tokens the fetched states saved
    bytes_fetched: int = 0
    recomputed: int = 0  # a state was there, but prefilling its tokens was cheaper than fetching it
    offered: int = 0
    published: int = 0
    bytes_published: int = 0
    dropped: int = 0  # offers dropped: every staging row or the outbox busy
    evicted: int = 0
    errors: int = 0


class SharedStates:
    """One worker's side of the shared tier: ``lookup`` (a future of a fetched state, or None) and ``offer``
    (a checkpoint exported by the runner, written out by a thread of its own)."""

    def __init__(self, cfg: SharedStatesConfig, layout: dict, checkpoint_bytes: int,
                 prefill_tokens_per_s: Callable[[], float]):
        self.cfg = cfg
        self.layout = layout  # ModelRunner.checkpoint_layout(): what a fetched blob must hold
        self.checkpoint_bytes = checkpoint_bytes
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.redis = redis.Redis.from_url(cfg.redis_url, socket_timeout=10)
        self._publish = self.redis.register_script(PUBLISH_LUA)
        self.stats = SharedStats()
        self.engine = None  # for_engine
        self._fetch_bytes_per_s = 1e9  # until measured
        self._fetchers = ThreadPoolExecutor(cfg.fetch_threads, thread_name_prefix="gaggle-state-fetch")
        self._outbox: queue.Queue = queue.Queue(maxsize=8)
        self._writer = threading.Thread(target=self._write_loop, name="gaggle-state-write", daemon=True)
        self._writer.start()

    # -- lookups (the worker's loop) ---------------------------------------------------------------

    def lookup(self, prompt: list[int], namespace: str, have: int) -> Future | None:
        """A fetch of the longest shared state of ``prompt``'s prefixes that saves at least ``min_tokens``
        beyond the ``have`` this worker holds; None where none could."""
        if len(prompt) < have + self.cfg.min_tokens:
            return None
        self.stats.lookups += 1
        return self._fetchers.submit(self._find, list(prompt), namespace, have)

    def _find(self, prompt: list[int], namespace: str, have: int) -> Fetched | None:
        try:
            return self._find_or_raise(prompt, namespace, have)
        except (redis.RedisError, OSError) as e:
            self.stats.errors += 1
            log.warning("shared prefix states: lookup failed", extra={"error": str(e)})
            return None

    def _find_or_raise(self, prompt: list[int], namespace: str, have: int) -> Fetched | None:
        digests = PrefixDigests(prompt)
        first = have + self.cfg.min_tokens
        blocks = range(first // c.STATE_BLOCK, len(prompt) // c.STATE_BLOCK + 1)
        pipe = self.redis.pipeline(transaction=False)
        for k in blocks:
            pipe.hgetall(c.state_index_key(namespace, digests.block(k)))
        candidates = []
        for k, entries in zip(blocks, pipe.execute()):
            for digest, value in entries.items():
                tokens, _, logits = value.decode().partition(":")
                n = int(tokens)
                usable = n < len(prompt) or logits == "l"  # a whole prompt's state serves only with its logits
                if first <= n <= len(prompt) and n // c.STATE_BLOCK == k and usable:
                    candidates.append((n, digest.decode(), k))
        for n, digest, k in sorted(candidates, reverse=True)[:MAX_CANDIDATES]:
            if digests.at(n) != digest:
                continue
            if not self._worth_fetching(n - have):
                self.stats.recomputed += 1
                return None
            blob = self._fetch(namespace, n, digest, digests.block(k))
            if blob is not None:
                self.stats.hits += 1
                self.stats.tokens += n - have
                log.info("shared prefix state fetched", extra={"tokens": n, "have": have})
                return Fetched(n, blob)
        return None

    def _worth_fetching(self, tokens: int) -> bool:
        """Fetching ``checkpoint_bytes`` at the measured rate beats prefilling ``tokens`` at the engine's."""
        rate = self.prefill_tokens_per_s()
        if rate <= 0:
            return True
        return tokens / rate > self.checkpoint_bytes / self._fetch_bytes_per_s + ROUND_TRIP_S

    def _fetch(self, namespace: str, tokens: int, digest: str, block_digest: str) -> StateBlob | None:
        key = c.state_key(namespace, digest)
        t0 = time.perf_counter()
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(key)
        pipe.expire(key, self.cfg.ttl_s)
        pipe.zadd(c.STATE_LRU, {key: time.time()}, xx=True)
        data = pipe.execute()[0]
        if data is None:  # evicted or expired: its index entry goes too
            self.redis.hdel(c.state_index_key(namespace, block_digest), digest)
            return None
        seconds = time.perf_counter() - t0
        if seconds > 0:
            self._fetch_bytes_per_s = 0.7 * self._fetch_bytes_per_s + 0.3 * len(data) / seconds
        try:
            blob = unpack(data, self.layout, tokens, digest)
        except StateBlobError as e:
            self.stats.errors += 1
            log.warning("shared prefix state refused", extra={"key": key, "error": str(e)})
            return None
        self.stats.bytes_fetched += len(data)
        return blob

    # -- offers (the worker's loop) → writes (a thread) --------------------------------------------

    def offer(self, namespace: str, prefix: list[int], exported) -> bool:
        """Write out ``exported`` (``engine.runner.ExportedState``) as the state of ``prefix``; False where it
        is dropped (too short, or the writes are behind)."""
        if len(prefix) < self.cfg.min_tokens:
            exported.release()
            return False
        self.stats.offered += 1
        try:
            self._outbox.put_nowait((namespace, list(prefix), exported))
            return True
        except queue.Full:
            exported.release()
            self.stats.dropped += 1
            return False

    def _write_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            namespace, prefix, exported = item
            try:
                self._write(namespace, prefix, exported)
            except (redis.RedisError, OSError) as e:
                self.stats.errors += 1
                log.warning("shared prefix states: write failed", extra={"error": str(e), "tokens": len(prefix)})
            except Exception:
                self.stats.errors += 1
                log.exception("shared prefix states: write failed")
            finally:
                self._outbox.task_done()

    def _write(self, namespace: str, prefix: list[int], exported) -> None:
        digests = PrefixDigests(prefix)
        digest = digests.at(len(prefix))
        try:
            exported.wait()
            data = b"".join(pack(exported.blob(len(prefix), digest)))  # a copy: the staging row is free after
        finally:
            exported.release()
        value = f"{len(prefix)}:l" if exported.has_logits else str(len(prefix))
        index = c.state_index_key(namespace, digests.block(len(prefix) // c.STATE_BLOCK))
        key = c.state_key(namespace, digest)
        written, evicted = self._publish(keys=[key, c.STATE_LRU, c.STATE_SIZES, c.STATE_BYTES, index],
                                         args=[data, self.cfg.ttl_s, time.time(), self.cfg.cap_bytes, digest, value])
        self.stats.evicted += evicted
        if written == 1:
            self.stats.published += 1
            self.stats.bytes_published += len(data)
            log.info("shared prefix state written", extra={"tokens": len(prefix), "bytes": len(data),
                                                           "evicted": evicted})

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the offers so far are written (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._outbox.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    # -- an engine's side ------------------------------------------------------------------------------

    @classmethod
    def for_engine(cls, engine, cfg: SharedStatesConfig) -> "SharedStates":
        """The shared tier of ``engine``'s prefix cache: its checkpoints that prove shared are offered here."""
        runner = engine.runner
        shared = cls(cfg, runner.checkpoint_layout(), runner.prefix_cache_row_bytes,
                     lambda: engine.prefill_tokens_per_s)
        shared.engine = engine
        engine.prefix_cache.on_shared = shared._offer_checkpoint
        return shared

    def _offer_checkpoint(self, checkpoint, prefix: list[int], state: str | None) -> None:
        runner = self.engine.runner
        exported = runner.export_checkpoint(checkpoint.payload, checkpoint.has_logits)
        if exported is None:
            self.stats.dropped += 1
            return
        self.offer(runner.state_namespace(state), prefix, exported)

    def lookup_request(self, prompt: list[int], state: str | None) -> Future | None:
        """``lookup`` for a prompt of this engine (from the initial state ``state``): beyond what it holds."""
        engine = self.engine
        return self.lookup(prompt, engine.runner.state_namespace(state), engine.cached_prefix_tokens(prompt, state))

    def take(self, prompt: list[int], state: str | None, fetched: Fetched | None) -> int:
        """A fetched state into the engine's cache, before its request is added: the prompt tokens it covers (0:
        none; the prompt is prefilled)."""
        if fetched is None:
            return 0
        try:
            return fetched.tokens if self.engine.import_prefix(prompt[:fetched.tokens], state, fetched.blob) else 0
        except Exception:  # a prefill instead
            log.exception("could not take a shared prefix state")
            return 0

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        try:
            self._outbox.put(None, timeout=1.0)
            self._writer.join(timeout=2.0)
        except queue.Full:  # the thread is a daemon: it ends with the process
            pass

"""Redis I/O for a worker, off the GPU loop's critical path: three daemon threads, each on its own connection.

- reader (worker/reader.py): takes entries from the streams up to the engine's free capacity, fairly across
  tenants; reclaims the entries of workers whose heartbeat expired; writes the heartbeat;
- writer (worker/writer.py): each step's results, one pipelined round trip per write;
- aborts: a pub/sub subscription to the abort channel.
The step loop only touches their queues.
"""

from __future__ import annotations

import logging
import threading

import redis

from worker import contract as c
from worker.reader import CANCELLED, Reader, ReaderConfig
from worker.writer import Writer

log = logging.getLogger(__name__)


class RedisIO:
    def __init__(self, redis_url: str, name: str, cfg: ReaderConfig, heartbeat):
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=30, health_check_interval=10)
        self.name = name
        self.reader = Reader(self.redis, name, cfg, heartbeat, lambda: list(self.writer.flights.values()))
        self.writer = Writer(redis_url, name, self.reader.forget)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Claim the worker's name (NameInUse if a live worker has it), then start the threads."""
        self.reader.claim_name()
        for name, target in (("reader", self.reader.run), ("writer", self.writer.run), ("aborts", self._abort_loop)):
            t = threading.Thread(target=_named(target, f"gaggle-{name}"), args=(self._stop,), name=f"gaggle-{name}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, flush_timeout_s: float = 10.0) -> None:
        self.writer.flush(flush_timeout_s)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)

    def _abort_loop(self, stop: threading.Event) -> None:
        pubsub = None
        while not stop.is_set():
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
                stop.wait(0.5)


def _named(target, name: str):
    """``target``, run under ``name`` also in the OS (top -H, ps -L show which thread is busy; Python < 3.14
    names its threads for itself only)."""
    def run(*args):
        set_native_thread_name(name)
        return target(*args)
    return run


def set_native_thread_name(name: str) -> None:
    """The calling thread's name as the kernel shows it (Linux: 15 bytes at most); nothing elsewhere."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass

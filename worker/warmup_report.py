"""A starting worker's warm-up, told to people and to Redis.

Prints a line per stage change (and at most one a second between), and keeps ``warming:<name>`` fresh in Redis
(``contract.WarmupStatus``) so that ``/ready``, the status page and ``gaggle up`` say "warming up" with the stage
and its count instead of nothing. Redis being unreachable never stops a warm-up: the key is best effort.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from typing import TextIO

import redis

from engine.warmup import WarmupSnapshot
from worker import contract as c

log = logging.getLogger(__name__)

PRINT_INTERVAL_S = 1.0  # at most a line a second while counts move
QUIET_PRINT_S = 5.0  # and one every 5 s while a long stage (a cold compile) counts nothing


class WarmupReporter:
    """The listener of an engine's ``WarmupProgress``; ``close()`` once the worker is about to beat."""

    def __init__(self, redis_url: str, name: str, device: str, model: str, stream: TextIO | None = None,
                 label: str = "gaggle worker"):
        self.name, self.device, self.model, self.label = name, device, model, label
        self.stream = stream or sys.stderr
        self.host = socket.gethostname()
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._lock = threading.Lock()
        self._latest: WarmupSnapshot | None = None
        self._printed_stages: tuple[str, ...] = ()
        self._printed_at = 0.0
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="warmup-report", daemon=True)
        self._thread.start()

    def __call__(self, snapshot: WarmupSnapshot) -> None:
        self._publish(snapshot)  # first: whoever reads a line can find the status in Redis
        with self._lock:
            self._latest = snapshot
            names = tuple(s.name for s in snapshot.stages)
            if names != self._printed_stages or time.monotonic() - self._printed_at >= PRINT_INTERVAL_S:
                self._print(snapshot)

    def _print(self, snapshot: WarmupSnapshot) -> None:
        self._printed_stages, self._printed_at = tuple(s.name for s in snapshot.stages), time.monotonic()
        print(f"{self.label}: warming up · {snapshot.describe(time.monotonic() - self._t0)}", file=self.stream,
              flush=True)

    def close(self) -> None:
        """Stop refreshing and withdraw the key: the heartbeat says the rest."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            pipe = self._redis.pipeline(transaction=False)
            c.WarmupStatus.withdraw(pipe, self.name)
            pipe.execute()
        except redis.RedisError as e:  # the key expires by itself
            log.warning("could not withdraw the warm-up status", extra={"worker": self.name, "error": str(e)})
        finally:
            self._redis.close()

    def _refresh(self) -> None:
        """Keeps the key alive while one long stage (a cold compile) reports nothing."""
        while not self._stop.wait(c.WARMING_REFRESH_S):
            with self._lock:
                snapshot = self._latest
                if snapshot is not None and time.monotonic() - self._printed_at >= QUIET_PRINT_S:
                    self._print(snapshot)
            if snapshot is not None:
                self._publish(snapshot)

    def _publish(self, snapshot: WarmupSnapshot) -> None:
        status = c.WarmupStatus(name=self.name, host=self.host, device=self.device, model=self.model,
                                stages=[{"name": s.name, "done": s.done, "total": s.total} for s in snapshot.stages],
                                elapsed_s=round(time.monotonic() - self._t0, 1))
        try:
            pipe = self._redis.pipeline(transaction=False)
            status.publish(pipe)
            pipe.execute()
        except redis.RedisError as e:
            log.debug("warm-up status not published", extra={"worker": self.name, "error": str(e)})

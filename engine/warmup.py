"""Warm-up progress: what a starting engine is doing, with counts and elapsed time.

A cold start compiles and captures for tens of seconds; a start that says nothing meanwhile looks hung. The engine
reports each stage here (a name, a count done of a total); whoever started it (the worker) prints the lines and
publishes the snapshot for ``/ready`` and the status page. Stages may run at once (the sampler's kernels compile
in threads while the model's are tuned), so a snapshot lists every active stage. No torch here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageProgress:
    name: str
    done: int
    total: int

    def describe(self) -> str:
        return f"{self.name} {self.done}/{self.total}"


@dataclass(frozen=True)
class WarmupSnapshot:
    stages: tuple[StageProgress, ...]  # the active ones, in the order they started
    elapsed_s: float
    finished: tuple[str, ...] = ()  # stages done so far

    def describe(self, elapsed_s: float | None = None) -> str:
        """``prefill graphs 40/85 · sampler kernels 7/16 · 38 s`` (``elapsed_s``: a later clock's reading, for a
        snapshot repeated while nothing changes)."""
        parts = [s.describe() for s in self.stages] or ["starting"]
        return " · ".join(parts + [f"{self.elapsed_s if elapsed_s is None else elapsed_s:.0f} s"])


Listener = Callable[[WarmupSnapshot], None]


class WarmupProgress:
    """Thread-safe stage counters; ``listener`` is called (from the reporting thread) on every change."""

    def __init__(self, listener: Listener | None = None):
        self._listener = listener
        self._lock = threading.Lock()
        self._active: dict[str, list[int]] = {}  # name -> [done, total]
        self._finished: list[str] = []
        self._t0 = time.monotonic()
        self.stage_seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, total: int) -> Iterator[WarmupProgress]:
        """A stage of ``total`` steps; ``advance()`` counts them. Its duration lands in ``stage_seconds``."""
        t0 = time.monotonic()
        with self._lock:
            self._active[name] = [0, max(total, 0)]
        log.info("warm-up stage started", extra={"stage": name, "total": total})
        self._notify()
        try:
            yield self
        finally:
            seconds = time.monotonic() - t0
            with self._lock:
                self._active.pop(name, None)
                self._finished.append(name)
                self.stage_seconds[name] = round(seconds, 2)
            log.info("warm-up stage done", extra={"stage": name, "total": total, "seconds": round(seconds, 2)})
            self._notify()

    def advance(self, name: str, steps: int = 1) -> None:
        with self._lock:
            counts = self._active.get(name)
            if counts is None:
                return
            counts[0] = min(counts[0] + steps, counts[1]) if counts[1] else counts[0] + steps
        self._notify()

    def snapshot(self) -> WarmupSnapshot:
        with self._lock:
            stages = tuple(StageProgress(n, d, t) for n, (d, t) in self._active.items())
            return WarmupSnapshot(stages, time.monotonic() - self._t0, tuple(self._finished))

    def _notify(self) -> None:
        if self._listener is not None:
            try:
                self._listener(self.snapshot())
            except Exception:  # reporting must never break a warm-up
                log.exception("warm-up progress listener failed")


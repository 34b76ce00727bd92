"""The worker's periodic "loop stats" log line (as vLLM logs its throughput every few seconds): what the main loop
did since the last line — steps, their mean wall time and where the step thread's time went (the engine's phase
clock: schedule, launch, wait for the device, grammar, postprocess), tokens generated and prompt tokens taken a
second, requests started, the time the process spent in garbage collections (every thread's), and what is
waiting where (engine queue, reader inbox, writer backlog). A served run then shows, in the worker's own log, what
``benchmarks.engine --serve`` shows in-process."""

from __future__ import annotations

import logging
import time
from typing import Callable

from engine.gc_policy import GcClock
from engine.phases import PHASES, PhaseClock

log = logging.getLogger(__name__)


class LoopStats:
    def __init__(self, worker_name: str, interval_s: float, clock: PhaseClock,
                 gauges: Callable[[], dict[str, int]], gc_clock: GcClock):
        """``gauges()``: the current queue sizes to report (running, waiting, free slots, inbox, writer backlog);
        ``gc_clock``: the process's time in collections (its owner closes it)."""
        self.worker_name = worker_name
        self.interval_s = interval_s
        self.clock = clock
        self.gauges = gauges
        self.gc = gc_clock
        self._mark(time.monotonic())

    def _reset_counts(self) -> None:
        self.step_s = 0.0
        self.tokens = 0
        self.prompt_tokens = 0
        self.requests = 0

    def on_step(self, seconds: float, tokens: int) -> None:
        self.step_s += seconds
        self.tokens += tokens

    def on_started(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens

    def maybe_report(self, now: float | None = None) -> None:
        """Log a line once ``interval_s`` has passed since the last (never with interval 0); an idle stretch
        (no step, nothing started, nothing queued) logs nothing and starts a new one."""
        if self.interval_s > 0 and (now or time.monotonic()) - self._start >= self.interval_s:
            if self.clock.steps == self._steps and not self.requests and not self._busy():
                self._mark(time.monotonic())
            else:
                self.report()

    def _busy(self) -> bool:
        g = self.gauges()
        return any(g.get(k) for k in ("running", "waiting", "inbox", "writer_backlog"))

    def _mark(self, now: float) -> None:
        self._start, self._phases, self._steps = now, dict(self.clock.seconds), self.clock.steps
        self._gc_seconds, self._gc_collections = self.gc.seconds, list(self.gc.collections)
        self._reset_counts()

    def report(self) -> dict:
        """Log the line now, covering the time since the last one; the values logged."""
        now = time.monotonic()
        elapsed = max(1e-9, now - self._start)
        steps = self.clock.steps - self._steps
        line = {"worker": self.worker_name, "seconds": round(elapsed, 3), "steps": steps,
                "step_ms": round(1e3 * self.step_s / max(1, steps), 3),
                "tokens": self.tokens, "tok_s": round(self.tokens / elapsed, 1),
                "prompt_tokens": self.prompt_tokens, "prompt_tok_s": round(self.prompt_tokens / elapsed, 1),
                "requests": self.requests}
        for phase in PHASES:  # the step thread's time a step, by phase
            spent = self.clock.seconds[phase] - self._phases.get(phase, 0.0)
            line[f"{phase}_ms"] = round(1e3 * spent / max(1, steps), 3)
        # garbage collection, any thread: ms a second of wall time, and collections (young, oldest generation)
        line["gc_ms_per_s"] = round(1e3 * (self.gc.seconds - self._gc_seconds) / elapsed, 3)
        line["gc_young"] = self.gc.collections[0] - self._gc_collections[0]
        line["gc_full"] = self.gc.collections[2] - self._gc_collections[2]
        line.update(self.gauges())
        log.info("loop stats", extra=line)
        self._mark(now)
        return line

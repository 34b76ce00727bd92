"""Where a step's host time goes: exclusive seconds per phase, by laps (each lap charges the time since the
previous lap to one phase). Cheap enough to stay on: a perf_counter call and a dict add per lap."""

from __future__ import annotations

import time

PHASES = ("schedule", "launch", "wait", "grammar", "postprocess")


class PhaseClock:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._last = time.perf_counter()

    def start(self) -> float:
        """A step begins: time until here (the caller's own work) is nobody's phase. Returns the time it began."""
        self._last = time.perf_counter()
        self.steps += 1
        return self._last

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        return {p: s / max(1, self.steps) * 1e3 for p, s in self.seconds.items()}

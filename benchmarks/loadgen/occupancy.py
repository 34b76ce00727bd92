"""Slot occupancy: the mean share of the sequence slots that run, so a reader sees refill gaps directly (a served
run's throughput below engine-only's with occupancy below it says slots idle between requests, not slow steps).

Served: sampled from the server's ``/metrics`` every ``interval_s`` while the load runs (gaggle's
``gaggle_workers_running_sequences`` and ``gaggle_workers_free_slots``, over every live worker); a server without
those gauges gives None. Engine-only: every step's running sequences over the slots, weighted by the step's time.
"""

from __future__ import annotations

import threading
import time
import urllib.request

RUNNING, FREE = "gaggle_workers_running_sequences", "gaggle_workers_free_slots"


def gauges(text: str, names: tuple[str, ...] = (RUNNING, FREE)) -> dict[str, float]:
    """The unlabelled samples of ``names`` in a Prometheus text exposition."""
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[name] = float(value.split()[0])
    return found


class OccupancySampler:
    """``with OccupancySampler(url, key) as s: <run>``; then ``s.mean`` (None: no sample had the gauges)."""

    def __init__(self, base_url: str, api_key: str | None = None, interval_s: float = 0.25):
        self.url = base_url.rstrip("/") + "/metrics"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._unsupported = False  # the server's /metrics lacks the gauges
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gaggle-bench-occupancy", daemon=True)

    def __enter__(self) -> OccupancySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            sample = self._sample()
            if self._unsupported:
                return  # not a gaggle server: nothing to sample
            if sample is not None:
                self.samples.append(sample)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _sample(self) -> float | None:
        try:
            request = urllib.request.Request(self.url, headers=self.headers)
            with urllib.request.urlopen(request, timeout=2) as response:
                values = gauges(response.read().decode(errors="replace"))
        except (OSError, ValueError):
            return None
        if RUNNING not in values or FREE not in values:
            self._unsupported = True
            return None
        slots = values[RUNNING] + values[FREE]
        return values[RUNNING] / slots if slots else None


class StepOccupancy:
    """Engine-only: ``observe(running, slots, seconds)`` per step; ``mean`` weighted by the steps' time."""

    def __init__(self) -> None:
        self._weighted = 0.0
        self._seconds = 0.0

    def observe(self, running: int, slots: int, seconds: float) -> None:
        if slots and seconds > 0:
            self._weighted += running / slots * seconds
            self._seconds += seconds

    @property
    def mean(self) -> float | None:
        return self._weighted / self._seconds if self._seconds else None

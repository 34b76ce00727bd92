"""How fast a worker refills the slots its finished sequences free, from its JSON log (INFO): the engine logs
each sequence's admission ("sequence admitted") and finish ("sequence finished") with the engine step it happened
in, and the worker its slot count ("worker started"). Steps, not seconds: a slot that waits two steps for its next
request costs two steps of one sequence whatever a step takes.

A freed slot is matched with the next admission after it, in order (the first ``slots`` free from the start):
its wait is that admission's step minus the step that freed it. Where requests were waiting all along (a queue
filled before the run) the waits are the worker's refill latency alone; in a closed loop they also hold the
client's round trip to its next request. Slots freed and never taken again before the last admission are counted
apart ("idle slot-steps"); a run's tail (nothing left to start) is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from benchmarks.report import table


@dataclass
class SlotLog:
    name: str
    slots: int
    admitted: list[int]  # the step of each admission
    finished: list[int]  # the step of each finish (its slot free from the next step)


def read_slot_log(path: Path) -> SlotLog | None:
    """A worker log's admissions and finishes; None when it has no "worker started" line (not a worker's log)."""
    slots, admitted, finished = None, [], []
    with open(path, "rb") as f:
        for line in f:
            if not line.startswith(b"{") or (b"sequence " not in line and b"worker started" not in line):
                continue
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            msg = entry.get("msg")
            if msg == "sequence admitted" and "step" in entry:
                admitted.append(entry["step"])
            elif msg == "sequence finished" and "step" in entry:
                finished.append(entry["step"])
            elif msg == "worker started" and "slots" in entry:  # what came before was the warm-up
                slots, admitted, finished = entry["slots"], [], []
    return None if slots is None else SlotLog(Path(path).name, slots, sorted(admitted), sorted(finished))


def refill_waits(log: SlotLog) -> list[int]:
    """Steps each freed slot waited for its next admission (see the module's doc)."""
    free = [0] * log.slots + log.finished
    return [a - f for f, a in zip(free, log.admitted)]


def idle_slot_steps(log: SlotLog) -> int:
    """Freed slots not taken again although admissions came later: each counts its steps until the last one."""
    if not log.admitted:
        return 0
    last = log.admitted[-1]
    free = ([0] * log.slots + log.finished)[len(log.admitted):]
    return sum(last - f for f in free if f < last)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``values``."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def refill_table(logs: list[SlotLog]) -> str:
    body = []
    for log in logs:
        waits = refill_waits(log)
        if not waits:
            continue
        body.append([log.name, str(log.slots), f"{len(log.admitted):,}", f"{len(log.finished):,}",
                     f"{sum(waits) / len(waits):.2f}", *(str(percentile(waits, q)) for q in (0.5, 0.9, 0.99)),
                     str(max(waits)), f"{idle_slot_steps(log):,}"])
    return table("Slot refill: steps from a slot freeing to its next request's admission",
                 ["worker log", "slots", "admitted", "finished", "mean", "p50", "p90", "p99", "max",
                  "idle slot-steps"], body)

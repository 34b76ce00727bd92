"""What the step thread hands the writer thread: one small type per operation (see worker/writer.py).

A write runs them in submission order: every ``Publish`` and streaming delta as plain PUBLISH commands, then
everything else in one MULTI/EXEC (a request's status, deltas, final are published in that order on its channel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from worker.results import InFlight


@dataclass(slots=True)
class Start:
    """A request now runs: the writer folds its outputs in from now on."""
    flight: InFlight


@dataclass(slots=True)
class Outputs:
    """One engine step's outputs, at wall-clock time ``at``: folded into their requests, their deltas published
    (or appended, for async requests), and the result written of each request they finish."""
    outputs: list
    at: float


@dataclass(slots=True)
class End:
    """The step thread ended a running request (cancel, deadline): its terminal result (status, message, code),
    with what it generated; ``terminal`` None: drop it without a result (it was dead-lettered)."""
    flight: InFlight
    terminal: tuple[str, str, str] | None


@dataclass(slots=True)
class Publish:
    """A PUBLISH ahead of the transaction (a request's status)."""
    channel: str
    data: bytes


@dataclass(slots=True)
class AckDelete:
    """XACK + XDEL of a stream entry, inside the transaction; then the entry is no longer ours."""
    stream: str
    entry_id: bytes


@dataclass(slots=True)
class FinishIfOwned:
    """A request's final commands, run (then its entry acknowledged and deleted) only if its stream entry is still
    pending under this worker: a worker whose heartbeat lapsed (paused, Redis restarted) and whose entry another
    worker took over writes nothing (FINISH_IF_OWNED in worker.writer)."""
    stream: str
    entry_id: bytes
    commands: list[tuple]


class Command:
    """Any other command, verbatim, inside the transaction (a PUBLISH here follows the SET before it)."""
    __slots__ = ("args",)

    def __init__(self, *args: str | bytes | int | float):
        self.args = args

    def __repr__(self) -> str:
        return f"Command{self.args!r}"


Op = Union[Start, Outputs, End, Publish, AckDelete, FinishIfOwned, Command]

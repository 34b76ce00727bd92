"""When the device will be done with the step the host launched last: an estimate from what the host sees.

The overlapped loop launches step t+1 as soon as it has finished step t on the host, while the device still runs
step t. A request that arrives a moment later waits for step t+2, a whole step more (in a closed loop the
replacement of a finished request always arrives a moment later: it comes back through the API and Redis). A
launch can wait as long as it still comes before the device runs out of work; the worker takes arrivals until
then (``LLMEngine.launch_slack_s``). The host knows when it queued each step and when a wait for one ended; a wait
that blocked ended when the device finished that step. From those, each step's device time (from the later of
"queued" and "the previous step seen done" to "seen done") is charged to its decode rows and prompt tokens, and
the running step's finish is predicted with a low recent cost of each: a prediction that errs early, so a
launch errs towards idling the host, not the device; where it came late all the same (the step was done before
the host waited for it), the next predictions are trusted less, and trust comes back step by step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

LAUNCHES = ("just-in-time", "early")  # the worker's choice: launch when the device is about to need it, or at once
BLOCKED_S = 2e-4  # a wait at least this long blocked on the device: it ended when the device finished
SAMPLES = 32  # recent steps the costs are taken from
MARGIN = 0.95  # of the predicted device time
TRUST_STEP, MIN_TRUST = 0.05, 1 / 64


@dataclass
class _Step:
    rows: int  # decode rows (and the last prompt chunks' rows that sample)
    prompt_tokens: int
    queued: float  # host time the launch returned


class DeviceTimeline:
    def __init__(self) -> None:
        self._in_flight: deque[_Step] = deque()
        self._seen_done = float("-inf")  # when the host last saw a step finished (a wait returned)
        self._row_costs: deque[float] = deque(maxlen=SAMPLES)  # device seconds per row, decode-only steps
        self._prompt_costs: deque[float] = deque(maxlen=SAMPLES)  # device seconds per prompt token, mixed steps
        self._token_costs: deque[float] = deque(maxlen=SAMPLES)  # per token of any kind, before a decode-only step
        self._launch_costs: deque[float] = deque(maxlen=8)  # host seconds from a step's start to its launch
        self._trust = 1.0  # of a prediction: halved when a step was found done, not waited for; regained slowly

    def launched(self, rows: int, prompt_tokens: int, started: float, queued: float, after_another: bool) -> None:
        """A step was queued: ``started`` when the host began scheduling it, ``queued`` when its launch returned;
        ``after_another``: a step launched before is still to be collected (else none is: the device is idle, or
        a step failed and was never collected)."""
        while len(self._in_flight) > int(after_another):
            self._in_flight.popleft()
        if not after_another:
            self._seen_done = float("-inf")
        self._in_flight.append(_Step(rows, prompt_tokens, queued))
        self._launch_costs.append(queued - started)

    def collected(self, wait_began: float, wait_ended: float) -> None:
        """The oldest launched step's results are on the host; the wait for them ran from ``wait_began``."""
        if not self._in_flight:
            return
        step = self._in_flight.popleft()
        if wait_ended - wait_began >= BLOCKED_S:  # finished at wait_ended: its device time is known
            self._learn(step, wait_ended - max(step.queued, self._seen_done))
            self._trust = min(1.0, self._trust + TRUST_STEP)
        else:  # done before the host came for it: a launch held back may have left the device idle
            self._trust = max(MIN_TRUST, self._trust / 2)
        self._seen_done = wait_ended

    def slack_s(self, now: float) -> float:
        """How long the next launch can wait from ``now`` and still be queued before the device finishes what it
        has (0: launch now, or nothing known yet)."""
        if len(self._in_flight) != 1 or not self._launch_costs or not (self._row_costs or self._token_costs):
            return 0.0
        step = self._in_flight[0]
        begins = max(step.queued, self._seen_done)
        ends = begins + self._device_s(step.rows, step.prompt_tokens)
        lead = 1.25 * sorted(self._launch_costs)[len(self._launch_costs) // 2] + 5e-4  # the launch, and a margin
        return max(0.0, self._trust * (ends - now) - lead)

    def _device_s(self, rows: int, prompt_tokens: int) -> float:
        """A low estimate: each kind of token at a low recent cost, a kind not measured yet at none."""
        if not self._row_costs:  # a mixed step's cost a token is below a row's (prompt tokens are cheaper)
            return MARGIN * rows * _low(self._token_costs)
        prompt = _low(self._prompt_costs) if self._prompt_costs else 0.0
        return MARGIN * (rows * _low(self._row_costs) + prompt_tokens * prompt)

    def _learn(self, step: _Step, device_s: float) -> None:
        if device_s <= 0 or step.rows + step.prompt_tokens == 0:
            return
        if step.prompt_tokens == 0:
            self._row_costs.append(device_s / step.rows)
        elif self._row_costs:  # the rows at their known cost; the rest is the prompt's
            rest = device_s - step.rows * _low(self._row_costs)
            if rest > 0:
                self._prompt_costs.append(rest / step.prompt_tokens)
        else:  # no decode-only step seen yet: a cost a token of any kind
            self._token_costs.append(device_s / (step.rows + step.prompt_tokens))


def _low(costs: deque[float]) -> float:
    """A low quantile (the first quartile) of recent costs: below most, above the odd sample cut short by a wait
    that began late."""
    return sorted(costs)[len(costs) // 4]

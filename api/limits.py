"""What a request may ask for: the API's own settings, tightened by what every live worker can run.

Workers report their engine's limits in their heartbeats. Any worker may take any request from the
stream, so the smallest reported value is the one a request must meet; checking it at admission
turns what would be a worker's refusal (a failed result) into a 400 before anything is queued. Limits on the
sampling parameters do not depend on the workers: they are in ``engine.params``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from redis.exceptions import RedisError

from api.broker import Broker
from api.settings import Settings
from engine.tokenizer import VOCAB_SIZE
from worker import contract as c

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_model_len: int  # prompt + max_tokens
    vocab_size: int  # token ids in prompts lie below this
    max_n: int  # choices per prompt: each takes a slot of one worker (and a queue entry holds at most c.MAX_N)
    states: frozenset[str] | None = None  # initial states every live worker holds (None: no worker to ask)
    state_shape: tuple[int, ...] | None = None  # [layers, heads, head size] the live workers agree on

    @classmethod
    def of(cls, settings: Settings, workers: Iterable[c.Heartbeat] = ()) -> "Limits":
        workers = [w for w in workers if not w.draining]  # a draining worker takes no new requests

        def tightest(own: int, reported: Iterable[int]) -> int:
            return min([own, *(v for v in reported if v > 0)])  # 0: a worker that does not report it

        return cls(max_prompt_tokens=settings.max_prompt_tokens,
                   max_model_len=tightest(settings.max_model_len, (w.max_model_len for w in workers)),
                   vocab_size=tightest(VOCAB_SIZE, (w.vocab_size for w in workers)),
                   max_n=tightest(min(settings.max_n, c.MAX_N), (w.num_slots for w in workers)),
                   states=frozenset.intersection(*(frozenset(w.states) for w in workers)) if workers else None,
                   state_shape=_agreed({tuple(w.state_shape) for w in workers if w.state_shape}))


def _agreed(values: set) -> tuple | None:
    return next(iter(values)) if len(values) == 1 else None


async def current_limits(broker: Broker, settings: Settings) -> Limits:
    """The limits with the live workers' heartbeats (cached by the broker); the settings alone when Redis
    cannot say (admission answers that case with a 503)."""
    try:
        return Limits.of(settings, await broker.live_workers())
    except (RedisError, OSError) as e:
        log.warning("no worker limits: redis unavailable", extra={"error": str(e)})
        return Limits.of(settings)

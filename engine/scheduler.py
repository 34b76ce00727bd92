"""Continuous batching: which sequences decode and which prompt chunks prefill this step.

Plain Python, no tensors. Every step decodes every running sequence; prompt chunks
get the rest of the ``max_num_batched_tokens`` budget, first prompts already being
prefilled, then waiting requests that can get their slots (``n`` slots for a request
with ``n`` choices). While sequences decode, a step's prompt tokens are also held to
``prefill_per_decode`` per decoding sequence (at least ``min_prefill_chunk``): a
prefill token costs about what a decoding sequence's step does at any model size, so
a mixed step stays within ~3× a decode-only step and decoding never stalls for
long. Long prompts are chunked across steps. Optionally (``prefill_hold_tokens``), new prompts
beside decodes wait a few steps until enough of them can share one prefill step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.prefix_cache import PrefixCache
from engine.sequence import Sequence, Status


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int  # == start: the whole prompt came from a checkpoint (its stored logits are sampled)
    checkpoint: bool = False  # the state after it is kept (engine.prefix_cache)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids[self.start:self.end]

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.num_prompt_tokens


@dataclass
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # got slots this step: reset their state

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.end - c.start for c in self.prefills)


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)


class Scheduler:
    def __init__(self, num_slots: int, max_num_batched_tokens: int, prefill_per_decode: float = 3.0,
                 min_prefill_chunk: int = 2048, prefill_hold_tokens: int = 0, prefill_hold_steps: int = 4,
                 prefix_cache: PrefixCache | None = None):
        self.slots = SlotAllocator(num_slots)
        self.prefix_cache = prefix_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_per_decode = prefill_per_decode
        self.min_prefill_chunk = min_prefill_chunk
        self.prefill_hold_tokens = prefill_hold_tokens
        self.prefill_hold_steps = prefill_hold_steps
        self._held = 0  # consecutive steps that held new prompts back
        self.reserve = 0  # free slots only the first priority may take (the worker's interactive reserve)
        self.waiting: deque[Sequence] = deque()  # lead sequences; siblings ride along
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, lead: Sequence) -> None:
        """Queue a request's lead sequence behind the waiting ones of its priority or a higher one (a chat
        request passes the batch lines still waiting for their prefill)."""
        priority = lead.request.priority
        if not self.waiting or self.waiting[-1].request.priority <= priority:
            self.waiting.append(lead)
            return
        at = next(i for i, s in enumerate(self.waiting) if s.request.priority > priority)
        self.waiting.insert(at, lead)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_unfinished(self) -> int:
        return sum(1 + len(s.siblings) for s in (*self.waiting, *self.prefilling)) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(decodes=[s for s in self.running if s.wants_decode])
        budget = self.prefill_budget(len(out.decodes))
        for seq in self.prefilling:
            if budget <= 0:
                break
            budget -= self._add_chunk(out, seq, budget)
        if self.waiting and self._hold(len(out.decodes)):
            return out
        while self.waiting and budget > 0 and self.slots.can_allocate(self._slots_to_admit(self.waiting[0])):
            if not self._plan_start(self.waiting[0]):
                break  # a checkpoint it can start from is being made this step
            seq = self.waiting.popleft()
            self._admit(seq, out)
            budget -= self._add_chunk(out, seq, budget)
        return out

    def _slots_to_admit(self, lead: Sequence) -> int:
        """Free slots admitting ``lead`` needs: its family's, and below the first priority the reserve besides
        (a request of a later priority waits behind it: the queue is in priority order)."""
        return 1 + len(lead.siblings) + (self.reserve if lead.request.priority > 0 else 0)

    def _plan_start(self, seq: Sequence) -> bool:
        """Where a waiting prompt starts (the prefix cache's plan); False: it waits a step."""
        if self.prefix_cache is None:
            return True
        plan = self.prefix_cache.plan(seq.prompt_token_ids, use_checkpoints=seq.params.prompt_logprobs is None,
                                      root=seq.params.state)
        if plan.wait:
            return False
        seq.num_prefilled = seq.num_cached_tokens = plan.tokens
        seq.checkpoint, seq.split_at = plan.checkpoint, plan.split_at
        return True

    def _hold(self, num_decodes: int) -> bool:
        """Whether new prompts wait this step: only beside decodes, while fewer than ``prefill_hold_tokens``
        prompt tokens wait, for at most ``prefill_hold_steps`` steps in a row. A prefill step has a fixed cost
        (hundreds of kernels whatever its size), so a few prompts gathered into one step cost the decoding
        sequences less than one prompt a step."""
        if not self.prefill_hold_tokens or not num_decodes or self.prefill_hold_steps <= self._held:
            self._held = 0
            return False
        waiting = 0
        for lead in self.waiting:
            waiting += lead.num_remaining_prompt
            if waiting >= self.prefill_hold_tokens:
                self._held = 0
                return False
        self._held += 1
        return True

    def prefill_budget(self, num_decodes: int) -> int:
        """Prompt tokens this step may take beside ``num_decodes`` decoding sequences."""
        budget = self.max_num_batched_tokens - num_decodes
        if num_decodes and self.prefill_per_decode > 0:
            budget = min(budget, max(self.min_prefill_chunk, int(self.prefill_per_decode * num_decodes)))
        return budget

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> None:
        for s in (seq, *seq.siblings):
            s.slot = self.slots.allocate()
            s.status = Status.FORK_PENDING
            out.admitted.append(s)
        seq.status = Status.PREFILLING
        self.prefilling.append(seq)

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        start = seq.num_prefilled
        end = start + min(seq.num_remaining_prompt, budget)
        cache, n = self.prefix_cache, seq.num_prompt_tokens
        checkpoint = False
        if cache is not None:
            if seq.split_at is not None and start < seq.split_at < end:
                end = seq.split_at
            end = cache.chunk_end(start, end, n)
            checkpoint = end > start and cache.makes_checkpoint(end, n, seq.split_at)
            if checkpoint:
                cache.expect(seq.prompt_token_ids[:end], root=seq.params.state)
        out.prefills.append(PrefillChunk(seq, start, end, checkpoint))
        return end - start

    def complete_chunk(self, chunk: PrefillChunk) -> None:
        """Record a chunk as launched; a finished prompt starts decoding with its siblings (the last chunk
        samples their first tokens: the next step decodes from them, on the device)."""
        seq = chunk.seq
        seq.num_prefilled = chunk.end
        if chunk.is_last:
            self.prefilling.remove(seq)
            for s in (seq, *seq.siblings):
                s.status = Status.RUNNING
                self.running.append(s)

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's slot."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        self._release(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of a request, wherever it is; returns those removed."""
        removed = [s for s in self.running if s.request_id == request_id]
        self.running = [s for s in self.running if s.request_id != request_id]
        for queue in (self.prefilling, self.waiting):
            for lead in [s for s in queue if s.request_id == request_id]:
                queue.remove(lead)
                removed += [lead, *lead.siblings]
        for s in removed:
            self._release(s)
        return removed

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
        seq.status = Status.FINISHED

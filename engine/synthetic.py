"""A synthetic engine: the real LLMEngine (scheduler, detokenizer, stops, overlapped loop) over a runner that has
no model and produces tokens at a fixed rate. For measuring everything around the GPU — worker I/O, Redis,
the API, clients, many workers on one Redis — on machines without one (``gaggle worker --engine synthetic:RATE[:PROMPT_RATE]``).

A launched step's results are ready once its rows' share of the rate has passed (``rows / tokens_per_s`` after
the previous step's); waiting for them sleeps, releasing the GIL as a CUDA sync does. Prompt tokens are taken
at ``prefill_per_s``. The tokens cycle through a fixed text, from a place given by the sequence's seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.runner import LaunchedStep
from engine.sampler import SampleOutput
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

TEXT = (" The goose walked along the river bank, looking for bread and counting the boats that passed by."
        " Every morning it came back to the same place, and every morning the river was a little different.")


@dataclass
class _Ready:
    """A synthetic step's results, available at ``at`` (perf_counter time)."""
    tokens: list[int]
    at: float

    def result(self) -> SampleOutput:
        delay = self.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return SampleOutput(token_ids=self.tokens)


class _NoSampler:
    def release_slot(self, slot: int) -> None:
        pass


class SyntheticRunner:
    """The ModelRunner surface the engine uses, without tensors."""

    backend = "synthetic"

    def __init__(self, num_slots: int, vocab_size: int, token_ids: list[int], tokens_per_s: float,
                 prefill_per_s: float):
        if tokens_per_s <= 0 or prefill_per_s <= 0:
            raise ValueError("a synthetic engine needs positive token rates")
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.token_ids = token_ids
        self.tokens_per_s = tokens_per_s
        self.prefill_per_s = prefill_per_s
        self.sampler = _NoSampler()
        self.step_events = None
        self._free_at = time.perf_counter()  # when the simulated device finishes what was launched

    def admit(self, seqs: list[Sequence]) -> None:
        pass

    def warm_up(self, max_prefill_tokens: int, progress=None, retune: bool = False) -> None:
        pass

    def launch(self, batch: SchedulerOutput, before_sample=None) -> LaunchedStep | None:
        """``before_sample`` is not called: a synthetic engine takes no constrained requests."""
        seqs: list[Sequence] = []
        for chunk in batch.prefills:
            if chunk.is_last:
                seqs += [chunk.seq, *chunk.seq.siblings]
        seqs += batch.decodes
        prompt_tokens = sum(c.end - c.start for c in batch.prefills)
        busy = len(seqs) / self.tokens_per_s + prompt_tokens / self.prefill_per_s
        self._free_at = max(self._free_at, time.perf_counter()) + busy
        if not seqs:
            return None
        tokens = [self._token(s) for s in seqs]
        for s in seqs:
            s.num_launched += 1
        return LaunchedStep(seqs, _Ready(tokens, self._free_at))

    def collect(self, step: LaunchedStep) -> SampleOutput:
        return step.sample.result()

    def _token(self, seq: Sequence) -> int:
        return self.token_ids[(seq.seed + seq.num_launched) % len(self.token_ids)]


def synthetic_engine(config: EngineConfig, tokens_per_s: float, prefill_per_s: float | None = None):
    """An LLMEngine whose runner is synthetic: ``config.max_num_seqs`` slots, the real vocabulary."""
    from engine.engine import LLMEngine
    from engine.tokenizer import WorldTokenizer
    tokenizer = WorldTokenizer.default()
    runner = SyntheticRunner(config.max_num_seqs, tokenizer.vocab_size, tokenizer.encode(TEXT), tokens_per_s,
                             prefill_per_s or 2 * tokens_per_s)
    return LLMEngine(config, tokenizer=tokenizer, runner=runner)


def parse_engine_spec(spec: str) -> tuple[float, float | None] | None:
    """``real`` → None; ``synthetic:TOKENS_PER_S[:PROMPT_TOKENS_PER_S]`` → (decode rate, prefill rate or None:
    twice the decode rate). ValueError otherwise."""
    if spec == "real":
        return None
    kind, _, rates = spec.partition(":")
    if kind != "synthetic" or not rates or rates.count(":") > 1:
        raise ValueError(f"--engine must be 'real' or 'synthetic:TOKENS_PER_S[:PROMPT_TOKENS_PER_S]', got {spec!r}")
    try:
        values = [float(r) for r in rates.split(":")]
    except ValueError:
        raise ValueError(f"--engine synthetic:TOKENS_PER_S[:PROMPT_TOKENS_PER_S] needs numbers of tokens a second, "
                         f"got {rates!r}") from None
    if min(values) <= 0:
        raise ValueError(f"a synthetic engine's rates must be positive, got {rates!r}")
    return values[0], values[1] if len(values) > 1 else None

"""The engine: tokens in, tokens and text out. No Redis, no HTTP.

    engine.add(Request(...)); while engine.has_work(): outputs = engine.step()

A step reads like the architecture: schedule → admit → launch the model and the
sampler → detokenize, check stops, finish. Overlapped (the default): ``step()``
launches step t+1 on the device, then finishes step t on the host while the GPU
runs t+1, and returns step t's outputs. Sampled tokens stay on the device and
feed the next decode; a sequence that stops at step t is known one step late,
and the token step t+1 sampled for it is dropped (never emitted or counted).
Same seed, same tokens as the serial loop (``async_scheduling=False``).

Constrained sequences (``params.structured``): a step's sampling needs each one's grammar mask, which needs the
previous step's token. So a step queues the model first, then reads the previous step's tokens (the device is
on the model by then), advances the matchers, fills the masks, and queues the sampling; steps without
constrained rows never wait here.
"""

from __future__ import annotations

import io
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.config import EngineConfig
from engine.device import to_device
from engine.initial_states import load_initial_state
from engine.phases import PhaseClock
from engine.runner import LaunchedStep, ModelRunner
from engine.sampler import SampleOutput
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import FinishReason, Request, Sequence, SequenceOutput, Status, TokenLogprob
from engine.text import TextStream
from engine.threads import background
from engine.tokenizer import WorldTokenizer
from engine.warmup import WarmupProgress
from engine.weights import Rwkv7Weights, load_model

log = logging.getLogger(__name__)

SEED_MASK = (1 << 63) - 1
PREFILL_RATE_MIN_TOKENS = 64  # steps that prefilled fewer say little about the prefill rate
MAX_UPLOADED_STATES = 64  # uploaded initial states loaded at once (each one model state on the device)
SIBLING_SEED_STRIDE = 0x9E3779B97F4A7C15  # n > 1: choice i gets seed + i·φ


class LLMEngine:
    def __init__(self, config: EngineConfig, weights: Rwkv7Weights | None = None,
                 tokenizer: WorldTokenizer | None = None, runner=None):
        """``runner``: a ModelRunner stand-in (engine.synthetic) instead of one built from the weights."""
        self.config = config
        # the bundled vocabulary is parsed (~0.5 s of Python) while the weights load and move to the device
        reading = None if tokenizer is not None else background(WorldTokenizer.default)
        self.eos_token_id = WorldTokenizer.eos_token_id
        if runner is None:
            if weights is None:
                if config.model is None:
                    raise ValueError("EngineConfig.model is required (or pass weights)")
                weights = load_model(config.model)
            runner = ModelRunner(config, weights, [self.eos_token_id])
        self.runner = runner
        self.tokenizer = tokenizer or reading.result()
        make_cache = getattr(runner, "make_prefix_cache", None)  # a synthetic runner has no states to keep
        self.prefix_cache = make_cache() if make_cache is not None else None
        self.scheduler = Scheduler(self.runner.num_slots, config.max_num_batched_tokens, config.prefill_per_decode,
                                   config.min_prefill_chunk, config.prefill_hold_tokens, config.prefill_hold_steps,
                                   self.prefix_cache)
        self._seed_rng = random.Random(config.seed)
        self._sequences: dict[str, list[Sequence]] = {}
        self._launched: LaunchedStep | None = None  # on the device; finished by the next step()
        self._grammars = None  # engine.grammar.Grammars, made for the first constrained request
        self._mask_rows: list[torch.Tensor] = []  # two host buffers of bitmask rows, used in turn
        self.clock = PhaseClock()  # host seconds per phase of step()
        self._prefill_rate = 0.0  # prefill_tokens_per_s
        self._last_collect = 0.0
        self._uploaded_states: list[str] = []  # load_state, oldest first

    # -- public API ---------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.runner.num_slots

    @property
    def num_free_slots(self) -> int:
        return self.scheduler.slots.num_free

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None

    def reserve_slots(self, n: int) -> None:
        """Keep ``n`` free slots for first-priority requests: later priorities wait rather than take them."""
        self.scheduler.reserve = n

    def has_request(self, request_id: str) -> bool:
        return request_id in self._sequences

    def validate(self, request: Request) -> None:
        """Raise ValueError, naming the field and the limit, for a request the engine cannot run: its own limits
        (slots, vocabulary, max_model_len); the parameters' ranges were checked when they were built."""
        vocab = self.runner.vocab_size
        if request.request_id in self._sequences:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if not 1 <= request.n <= self.num_slots:
            raise ValueError(f"n must be between 1 and {self.num_slots}, got {request.n}")
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        total = max(1, len(request.prompt_token_ids)) + request.params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                             f"({request.params.max_tokens}) = {total} exceeds max_model_len "
                             f"({self.config.max_model_len})")
        request.params.check_vocabulary(vocab)
        state = request.params.state
        if state is not None and state not in self.state_names:
            raise ValueError(f"state {state!r} is not loaded here (loaded: {', '.join(self.state_names) or 'none'})")

    @property
    def state_names(self) -> list[str]:
        """The initial states a request may name: ``--state`` ones and uploaded ones loaded so far."""
        return sorted(getattr(self.runner, "initial_states", {}))

    def load_state(self, name: str, data: bytes) -> None:
        """An uploaded initial state (a state-tuning file's bytes) under ``name``; StateFileError if it does not
        fit this model. The least recently loaded uploaded state that no request uses goes past
        MAX_UPLOADED_STATES."""
        runner = self.runner
        runner.initial_states[name] = load_initial_state(name, io.BytesIO(data), runner.shape, runner.device,
                                                         runner.pool.att_shift.dtype, runner.state_dtype)
        self._uploaded_states.append(name)
        if len(self._uploaded_states) > MAX_UPLOADED_STATES:
            in_use = {seqs[0].params.state for seqs in self._sequences.values()}
            for old in self._uploaded_states:
                if old not in in_use and old != name:
                    self._uploaded_states.remove(old)
                    del runner.initial_states[old]
                    log.info("uploaded state unloaded", extra={"state": old})
                    break

    # -- the prefix cache's shared tier (worker.shared_states) ------------------------------------

    def cached_prefix_tokens(self, prompt: list[int], state: str | None = None) -> int:
        """How many of ``prompt``'s tokens this engine's prefix cache would start it after, now."""
        return self.prefix_cache.longest(prompt, state) if self.prefix_cache is not None else 0

    def import_prefix(self, prefix: list[int], state: str | None, blob) -> bool:
        """A checkpoint taken from the shared tier (an ``engine.state_blob.StateBlob`` of ``prefix``) into this
        engine's cache, before the request that needs it is added."""
        return self.prefix_cache is not None and self.runner.import_checkpoint(prefix, state, blob)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens a second, measured over recent steps that prefilled (0 until one has)."""
        return self._prefill_rate

    def _measure_prefill(self, step: LaunchedStep) -> None:
        """A finished step's device time is about from when it could start (launched, and the step before it
        read) to now, when its tokens are read."""
        now = time.perf_counter()
        seconds = now - max(self._last_collect, step.launched_at)
        self._last_collect = now
        if step.prefill_tokens >= PREFILL_RATE_MIN_TOKENS and seconds > 0:
            rate = step.prefill_tokens / seconds
            self._prefill_rate = rate if self._prefill_rate == 0 else 0.8 * self._prefill_rate + 0.2 * rate

    @property
    def grammars(self):
        if self._grammars is None:
            from engine.grammar import Grammars
            self._grammars = Grammars(self.tokenizer.id_to_token_bytes, self.vocab_size, [self.eos_token_id])
        return self._grammars

    def prepare(self, request: Request) -> Future | None:
        """Start compiling the request's constraint, if it has one and it is not compiled yet: a caller that
        cannot wait (the worker's loop) adds the request once the future is done. None: add it now."""
        spec = request.params.structured
        if spec is None:
            return None
        future = self.grammars.submit(spec)
        return None if future.done() else future

    def add(self, request: Request) -> None:
        """Queue a request; raises ValueError if it cannot run (nothing is queued then). A constraint not
        compiled yet is compiled first (``prepare`` avoids the wait)."""
        self.validate(request)
        if not request.prompt_token_ids:
            request.prompt_token_ids = [self.eos_token_id]  # an empty prompt starts a new document
        compiled = None
        if request.params.structured is not None:
            if self.runner.backend == "synthetic":
                raise ValueError("a synthetic engine takes no constrained requests")
            compiled = self.grammars.compile(request.params.structured)
        seqs = [Sequence(request, i, self._text_stream(request)) for i in range(request.n)]
        for s in seqs:
            if compiled is not None:
                s.matcher = self.grammars.matcher(compiled)
        base = request.params.seed if request.params.seed is not None else self._seed_rng.getrandbits(63)
        max_output = min(request.params.max_tokens, self.config.max_model_len - len(request.prompt_token_ids))
        for s in seqs:
            s.seed = (base + s.index * SIBLING_SEED_STRIDE) & SEED_MASK
            s.max_output_tokens = max_output
        seqs[0].siblings = seqs[1:]
        self._sequences[request.request_id] = seqs
        self.scheduler.add(seqs[0])
        log.info("request queued", extra={"request_id": request.request_id, "n": request.n,
                                          "prompt_tokens": len(request.prompt_token_ids)})

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its slots at once; False if unknown."""
        if request_id not in self._sequences:
            return False
        self._release_sampler_slots([s.slot for s in self._sequences[request_id]])
        removed = self.scheduler.abort(request_id)
        for s in removed:
            s.finish_reason = FinishReason.ABORT
        del self._sequences[request_id]
        log.info("request aborted", extra={"request_id": request_id, "freed_slots": len(removed)})
        return True

    def warm_up(self, progress: WarmupProgress | None = None, retune: bool = False) -> float:
        """Compile, autotune and capture what serving can need, before the first request, reporting each stage to
        ``progress``; the seconds it took. ``retune``: time every autotune candidate, ignoring the choices
        shipped for this GPU."""
        t0 = time.perf_counter()
        self.runner.warm_up(self.config.max_num_batched_tokens, progress, retune=retune)
        seconds = time.perf_counter() - t0
        log.info("engine warmed up", extra={"seconds": round(seconds, 2), "backend": self.runner.backend})
        return seconds

    def step(self, after_launch: Callable[[], None] | None = None) -> list[SequenceOutput]:
        """Launch the next step; finish the previous one (overlapped) or this one (serial); their outputs.

        ``after_launch``: called once the next step is launched, before waiting for the device — where another
        thread's Python (the worker's writer) costs the loop nothing: started earlier, it takes the GIL from
        the launch, whose every torch call releases it."""
        self.clock.start()
        previous = self._launched
        self._launched = self._launch(previous)
        if after_launch is not None:
            after_launch()
        outputs = self._finish_step(previous) if previous is not None else []
        if not self.config.async_scheduling and self._launched is not None:
            outputs += self._finish_step(self._launched)
            self._launched = None
        return outputs

    def _launch(self, previous: LaunchedStep | None) -> LaunchedStep | None:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self.clock.lap("schedule")
            return None
        self.runner.admit(batch.admitted)
        for seq in batch.admitted:  # the step it got its slot: with "sequence finished", how fast slots refill
            log.info("sequence admitted", extra={"request_id": seq.request_id, "index": seq.index, "slot": seq.slot,
                                                 "step": self.clock.steps})
        self.clock.lap("schedule")
        launched = self.runner.launch(batch, lambda seqs, slots: self._write_masks(seqs, previous))
        if launched is not None:
            launched.prefill_tokens = sum(c.end - c.start for c in batch.prefills)
            launched.launched_at = time.perf_counter()
        self._complete_prefills(batch)
        self.clock.lap("launch")
        return launched

    def _finish_step(self, step: LaunchedStep) -> list[SequenceOutput]:
        sampled = self._collect(step)
        outputs = self._postprocess(step.seqs, sampled)
        self.clock.lap("postprocess")
        return outputs

    def _collect(self, step: LaunchedStep) -> SampleOutput:
        """A step's sampled tokens, read once; they move the constrained sequences' matchers."""
        if step.output is None:
            self.clock.lap("launch")  # what was queued before this wait
            step.output = self.runner.collect(step)
            self._measure_prefill(step)
            self.clock.lap("wait")
            self._advance_matchers(step.seqs, step.output.token_ids)
            self.clock.lap("grammar")
        return step.output

    # -- constrained decoding ------------------------------------------------------------

    def _write_masks(self, seqs: list[Sequence], previous: LaunchedStep | None) -> None:
        """The constrained rows' allowed tokens for the sampling about to be queued (called once the model is)."""
        constrained = [s for s in seqs if s.matcher is not None]
        if not constrained:
            return
        if previous is not None:
            self._collect(previous)  # its tokens first: the masks follow from them
        rows = self._next_mask_rows()[:len(constrained)]
        live = [i for i, s in enumerate(constrained) if not (s.matcher.is_terminated() or s.grammar_rejected)]
        if len(live) < len(constrained):  # ended on their last token (known next step): anything, it is dropped
            rows.fill_(-1)
        self.grammars.fill([constrained[i].matcher for i in live], rows, live)
        slots = to_device([s.slot for s in constrained], torch.long, self.runner.sampler.device)
        self.runner.sampler.write_masks(slots, rows)
        self.clock.lap("grammar")

    def _next_mask_rows(self) -> torch.Tensor:
        """A host buffer for this step's bitmask rows; two in turn, so a copy still in flight (the previous
        step's) never reads a buffer being filled."""
        if not self._mask_rows:
            device = self.runner.sampler.device
            shape = (self.num_slots, self.grammars.words)
            self._mask_rows = [torch.zeros(shape, dtype=torch.int32, pin_memory=device.type == "cuda")
                               for _ in range(2)]
        self._mask_rows.reverse()
        return self._mask_rows[0]

    def _advance_matchers(self, seqs: list[Sequence], tokens: list[int]) -> None:
        moving = [(seq, token) for seq, token in zip(seqs, tokens)
                  if seq.matcher is not None and not seq.is_finished and not seq.grammar_rejected]
        if not moving:
            return
        accepted = self.grammars.accept([seq.matcher for seq, _ in moving], [token for _, token in moving])
        for (seq, token), ok in zip(moving, accepted):
            if not ok:
                seq.grammar_rejected = True
                log.error("grammar refused a sampled token", extra={"request_id": seq.request_id,
                                                                    "index": seq.index, "token": token})

    # -- internals ----------------------------------------------------------------

    def _text_stream(self, request: Request) -> TextStream:
        return TextStream(self.tokenizer, request.params.stop, request.params.include_stop_str_in_output)

    def _complete_prefills(self, batch: SchedulerOutput) -> None:
        for chunk in batch.prefills:
            self.scheduler.complete_chunk(chunk)
            if chunk.is_last:
                chunk.seq.checkpoint = None  # restored at admission; the cache may drop it from now on
                log.info("prefill done", extra={"request_id": chunk.seq.request_id,
                                                "prompt_tokens": chunk.seq.num_prompt_tokens,
                                                "cached_tokens": chunk.seq.num_cached_tokens})
        if self.prefix_cache is not None:
            self.prefix_cache.step_done()

    def _postprocess(self, seqs: list[Sequence], sampled: SampleOutput | None) -> list[SequenceOutput]:
        """Each sequence's token of the step: detokenized, stops checked, as an output. Per token on the host's
        critical path, so written lean (positional fields, locals)."""
        if sampled is None:
            return []
        outputs: list[SequenceOutput] = []
        emit = outputs.append
        tokens = sampled.token_ids
        for row, seq in enumerate(seqs):
            if seq.is_finished:  # stopped (or aborted) while this step ran: its token is dropped
                continue
            token = tokens[row]
            out_ids = seq.output_token_ids
            out_ids.append(token)
            text = self._append_text(seq, token)
            params, reason = seq.params, seq.finish_reason
            emit(SequenceOutput(
                seq.request_id, seq.index, [token], text,
                self._logprob_entry(sampled, row, token) if params.logprobs is not None else None,
                seq.is_finished, reason.value if reason else None, seq.stop_reason, len(seq.prompt_token_ids),
                len(out_ids),
                seq.prompt_logprobs if params.prompt_logprobs is not None and len(out_ids) == 1 else None,
                seq.num_cached_tokens))
        return outputs

    def _append_text(self, seq: Sequence, token: int) -> str:
        """Detokenize one token, then decide whether the sequence ends here."""
        params, stream = seq.params, seq.text_stream
        num_out = len(seq.output_token_ids)
        if token in params.stop_token_ids and num_out > params.min_tokens:
            return self._finish(seq, FinishReason.STOP, token, stream.finish())
        if token == self.eos_token_id and not params.ignore_eos:
            return self._finish(seq, FinishReason.STOP, None, stream.finish())
        if seq.matcher is not None and (seq.matcher.is_terminated() or seq.grammar_rejected):
            reason = FinishReason.ABORT if seq.grammar_rejected else FinishReason.STOP
            return self._finish(seq, reason, None, stream.finish() if token == self.eos_token_id else
                                stream.push(token) + stream.finish())
        text = stream.push(token, armed=num_out >= params.min_tokens)  # stop strings from min_tokens on (vLLM)
        if stream.stopped:
            return self._finish(seq, FinishReason.STOP, stream.stop_str, text)
        if num_out >= seq.max_output_tokens:  # max_tokens, or what max_model_len leaves
            return self._finish(seq, FinishReason.LENGTH, None, text + stream.finish())
        return text

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason, text: str) -> str:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        slot = seq.slot
        self._release_sampler_slots([seq.slot])
        if self.prefix_cache is not None and reason != FinishReason.ABORT:
            self.runner.keep_finished(seq)
        self.scheduler.finish(seq)
        family = self._sequences.get(seq.request_id, [])
        if all(s.status == Status.FINISHED for s in family):
            self._sequences.pop(seq.request_id, None)
        log.info("sequence finished", extra={"request_id": seq.request_id, "index": seq.index,
                                             "finish_reason": reason.value, "output_tokens": len(seq.output_token_ids),
                                             "slot": slot, "step": self.clock.steps})  # its slot is free from here
        return text

    def _release_sampler_slots(self, slots: list[int | None]) -> None:
        """Finished slots stop switching on sampler stages (top_p sort, penalties) for the others."""
        for slot in slots:
            if slot is not None:
                self.runner.sampler.release_slot(slot)

    @staticmethod
    def _logprob_entry(sampled: SampleOutput, row: int, token: int) -> list[TokenLogprob] | None:
        if sampled.logprobs is None or sampled.logprobs[row] is None:
            return None
        top = sampled.top_logprobs[row] if sampled.top_logprobs is not None else []
        return [TokenLogprob(token, sampled.logprobs[row], top)]

"""The model runner: owns every tensor (weights, state pool, sampler) and runs a scheduled step."""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.initial_states import load_initial_state
from engine.model import ReferenceRwkv7
from engine.prefix_cache import PrefixCache
from engine.device import to_device
from engine.sampler import Admission, PendingSample, SampleOutput, Sampler
from engine.scheduler import PrefillChunk, SchedulerOutput
from engine.sequence import Sequence, TokenLogprob
from engine.state import CheckpointSlab, StatePool
from engine.state_blob import StateBlob
from engine.threads import background
from engine.warmup import WarmupProgress
from engine.weights import Rwkv7Weights

log = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step queued on the device: the sequences of its rows, in order, and its results on their way."""
    seqs: list[Sequence]
    sample: PendingSample
    output: SampleOutput | None = None  # once read (LLMEngine reads each step once)
    prefill_tokens: int = 0  # prompt tokens it prefilled (LLMEngine measures the prefill rate)
    launched_at: float = 0.0


STAGING_ROWS = 4  # checkpoints on their way to the shared tier at once


@dataclass
class ExportedState:
    """A checkpoint's copy in a host staging row: ``wait()`` (any thread) until the copy is done, read
    ``blob()``, then ``release()`` the row."""
    slab: CheckpointSlab
    row: int
    event: object  # a CUDA event recorded after the copy (None: the copy was synchronous)
    has_logits: bool

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def blob(self, tokens: int, digest: str) -> StateBlob:
        s, r = self.slab, self.row
        return StateBlob(tokens, digest, s.att_shift[r], s.ffn_shift[r], s.wkv[r],
                         s.logits[r] if self.has_logits else None)

    def release(self) -> None:
        self.slab.give(self.row)


def fingerprint(weights: Rwkv7Weights) -> str:
    """A digest of the weights (their shapes, and the bytes of a few tensors spread through the model): two
    workers with the same fingerprint compute the same states."""
    h = hashlib.sha256(repr(weights.shape).encode())
    names = sorted(weights.tensors)
    for name in names[::max(1, len(names) // 16)] + ["emb.weight", "head.weight"]:
        t = weights.tensors.get(name)
        if t is not None:
            h.update(name.encode())
            h.update(_tensor_bytes(t.reshape(-1)[:1 << 16]))
    return h.hexdigest()[:24]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: EngineConfig, weights: Rwkv7Weights, eos_token_ids: list[int]):
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = TORCH_DTYPES[config.resolved_dtype()]
        self.state_dtype = TORCH_DTYPES[config.state_dtype]
        self.shape = weights.shape
        self.eos_token_ids = eos_token_ids
        self.backend = self._pick_backend()
        weights = weights.to(self.device, self.dtype)
        if config.weights == "fp8":
            weights = weights.quantized_fp8()
        self.model_fingerprint = fingerprint(weights)  # as served: a quantized file and one quantized at load agree
        self.weights_mode = "fp8" if weights.has_fp8 else "dtype"  # states differ between the two: cache keys
        if weights.has_fp8 and self.backend != "cuda":  # no fp8 GEMMs here: the weights' rounding, computed wide
            weights = weights.dequantized(self.dtype)
        self.num_slots = self._size_slots(weights)
        # one extra scratch slot: padding rows of a CUDA-graph batch write there
        self.pool = StatePool(self.shape, self.num_slots + 1, self.device, self.dtype, self.state_dtype)
        self.model = self._make_model(weights)
        self.initial_states = {name: load_initial_state(name, path, self.shape, self.device, self.dtype,
                                                        self.state_dtype)
                               for name, path in config.initial_states.items()}
        self.sampler = Sampler(self.num_slots, self.shape.vocab_size, self.device)
        # each slot's last sampled token: the next decode's input, never through the host
        self.last_tokens = torch.zeros(self.num_slots + 1, dtype=torch.long, device=self.device)
        self.step_events: list | None = None  # set to a list: (start, end) CUDA events of each launched step
        self.prefix_cache: PrefixCache | None = None  # make_prefix_cache
        self._staging: CheckpointSlab | None = None  # host rows checkpoints are written out from (export_checkpoint)
        # demotions to the host tier run on a stream of their own (a PCIe copy of a whole state on the compute
        # stream stalled the steps behind it): each device row goes back once its copy's event has passed, and
        # each host row is read on the compute stream only after its copy's event
        self._copy_stream = None
        self._demoting: collections.deque[tuple[object, int]] = collections.deque()  # (event, device row)
        self._host_ready: dict[int, object] = {}  # host row -> the event of the copy into it
        self.tunings: list = []  # autotune choices made at warm-up (engine.cuda.autotune.Tuning)
        log.info("model runner ready", extra={"backend": self.backend, "device": str(self.device),
                                              "dtype": str(self.dtype), "num_slots": self.num_slots,
                                              "state_bytes_per_seq": self.state_bytes_per_seq})

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def state_bytes_per_seq(self) -> int:
        return StatePool.bytes_per_slot(self.shape, self.dtype, self.state_dtype)

    def _pick_backend(self) -> str:
        backend = self.config.backend
        if backend == "auto":
            backend = "cuda" if self.device.type == "cuda" else "reference"
        if backend == "cuda" and self.device.type != "cuda":
            raise ValueError("backend 'cuda' needs a CUDA device")
        return backend

    def _size_slots(self, weights: Rwkv7Weights) -> int:
        if self.device.type != "cuda":
            return self.config.max_num_seqs
        from engine.cuda.memory import slots_that_fit
        return slots_that_fit(self.config, self.state_bytes_per_seq, self.shape.vocab_size, self.device)

    def _make_model(self, weights: Rwkv7Weights):
        if self.backend == "reference":
            return ReferenceRwkv7(weights, self.pool)
        from engine.cuda.model import CudaRwkv7
        return CudaRwkv7(weights, self.pool, enforce_eager=self.config.enforce_eager,
                         max_prefill_tokens=self.config.max_num_batched_tokens,
                         prefill_graphs=self.config.prefill_graphs)

    def make_prefix_cache(self) -> PrefixCache | None:
        """The prompt-prefix cache for this runner's slots (None where the config turns it off): its device tier a
        slab of checkpoint rows beside the slots, its host tier one in pinned memory (CUDA; allocated in the
        background, ready by the first time a checkpoint moves there)."""
        c = self.config
        row_bytes = CheckpointSlab.row_bytes(self.pool, self.vocab_size, torch.float32)
        device_rows = int(c.prefix_cache_gib * 2**30 // row_bytes)
        if device_rows < 1:
            return None
        host_rows = int(c.prefix_cache_host_gib * 2**30 // row_bytes) if self.device.type == "cuda" else 0
        self._slabs = {True: CheckpointSlab(self.pool, device_rows, self.vocab_size, torch.float32, self.device)}
        self._host_slab = background(lambda: CheckpointSlab(self.pool, host_rows, self.vocab_size, torch.float32,
                                                             "cpu", pinned=True)) if host_rows else None
        self.prefix_cache_row_bytes = row_bytes
        # With a host tier, an eighth of the device rows is not the cache's to fill: rows on their way to the host
        # (an asynchronous copy queued after the step in flight) leave free rows for the checkpoints that follow,
        # and no more copies are started than there are such rows (the cache drops instead of waiting)
        self._spare_rows = max(1, device_rows // 8) if host_rows and device_rows > 1 else 0
        self.prefix_cache = PrefixCache((device_rows - self._spare_rows) * row_bytes, host_rows * row_bytes,
                                        demote=self._demote, release=self._release, min_tokens=c.prefix_min_tokens,
                                        interval=c.prefix_interval, can_demote=self._can_demote)
        log.info("prefix cache", extra={"device_checkpoints": device_rows, "host_checkpoints": host_rows,
                                        "checkpoint_bytes": row_bytes})
        return self.prefix_cache

    def _slab(self, on_device: bool) -> CheckpointSlab:
        if not on_device and False not in self._slabs:
            self._slabs[False] = self._host_slab.result()
        return self._slabs[on_device]

    def _demote(self, payload: tuple[bool, int]) -> tuple[bool, int]:
        """A device checkpoint's row copied to a host row, the device row given back once the copy has read it.
        On CUDA the copy runs on a side stream, after what the compute stream has queued so far (the row's
        state), overlapping the steps that follow."""
        _, row = payload
        host, device = self._slab(False), self._slabs[True]
        host_row = host.take()
        if self.device.type != "cuda":
            device.copy_row(row, host, host_row)
            device.give(row)
            return False, host_row
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            device.copy_row(row, host, host_row)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._demoting.append((done, row))
        self._host_ready[host_row] = done
        return False, host_row

    def _can_demote(self) -> bool:
        """A copy to the host started now finds a free device row for the checkpoint that pushed it out (no
        wait): fewer copies in flight than spare rows. Without a side stream (CPU) copies are synchronous."""
        self._reap_demotions()
        return self._copy_stream is None or len(self._demoting) < self._spare_rows

    def _reap_demotions(self) -> None:
        """Device rows whose copies to the host have passed, given back."""
        slab = self._slabs[True]
        while self._demoting and self._demoting[0][0].query():
            slab.give(self._demoting.popleft()[1])

    def _take_device_row(self) -> int:
        """A free device row: those whose demotion copies have passed are given back first. Where every free row
        is still being copied out, the oldest is taken and the compute stream waits for its copy; the host never
        waits (a host wait here would stall the loop behind the step in flight)."""
        slab = self._slabs[True]
        self._reap_demotions()
        if slab.num_free == 0 and self._demoting:
            done, row = self._demoting.popleft()
            torch.cuda.current_stream(self.device).wait_event(done)
            slab.give(row)
        return slab.take()

    def _host_row_ready(self, row: int) -> None:
        """Reads of host row ``row`` queued on the compute stream from here come after the copy into it."""
        done = self._host_ready.pop(row, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def _release(self, payload: tuple[bool, int]) -> None:
        on_device, row = payload
        if not on_device:
            self._host_ready.pop(row, None)  # a later copy into it is ordered after this one (one side stream)
        self._slab(on_device).give(row)

    def admit(self, seqs: list[Sequence]) -> None:
        """Fresh state (or a prefix checkpoint's) and sampler settings for sequences that just got a slot."""
        if not seqs:
            return
        slots = to_device([s.slot for s in seqs], torch.long, self.device)
        self.pool.reset(slots)
        for s in seqs:
            if s.checkpoint is not None:
                on_device, row = s.checkpoint.payload
                if not on_device:
                    self._host_row_ready(row)
                self._slab(on_device).restore(row, self.pool, s.slot)
            elif s.params.state is not None:
                init = self.initial_states[s.params.state]
                self.pool.write(s.slot, init.att_shift, init.ffn_shift, init.wkv)
        self.sampler.reset_slots([Admission(s.slot, s.params, s.seed, s.prompt_token_ids) for s in seqs],
                                 self.eos_token_ids, slot_index=slots)

    def warm_up(self, max_prefill_tokens: int, progress: WarmupProgress | None = None, retune: bool = False) -> None:
        """Everything a step can compile, autotune or capture, done now, reported stage by stage. Uses free slots
        and leaves them zeroed. On the reference path nothing compiles: one real step checks the model instead.

        On CUDA the stages overlap: the sampler's kernels compile (and run once) in threads of their own while
        the model's kernels compile and tune (eager runs; autotuners take the choices shipped for this GPU, or
        compile their configs at once and time them: ``retune`` ignores the shipped ones), then while the model's
        graphs are captured (thread-local capture mode: other threads' launches do not break it). Each tuning
        made lands in ``self.tunings``."""
        progress = progress or WarmupProgress()
        slots = list(range(min(8, self.num_slots)))
        if self.backend == "reference":
            with progress.stage("checking the model", 1):
                self.model.prefill_with_scores([[0, 1, 2]], slots[:1], {})
                self.pool.reset(to_device(slots[:1], torch.long, self.device))
                progress.advance("checking the model")
            return
        from engine.cuda.autotune import TunedConfigs, current_device_table, parallel_autotuning
        from engine.sampler_compile import compile_in_child
        graphs = getattr(self.model, "graphs", None)
        prefill_graphs = getattr(self.model, "prefill_graphs", None)
        batch_sizes = graphs.sizes if graphs is not None else [1, self.num_slots]
        sampler_warm_up = self.sampler.warm_up_in_background(
            batch_sizes, progress, functools.partial(compile_in_child, self.num_slots, self.vocab_size, self.device,
                                                     batch_sizes))
        shipped = TunedConfigs() if retune else current_device_table()
        with parallel_autotuning(shipped=shipped, record=self.tunings):
            self._compile_model(slots, max_prefill_tokens, graphs, prefill_graphs, progress)
        log.info("autotuning", extra={s: sum(t.source == s for t in self.tunings)
                                      for s in ("shipped", "tuned", "cached")})
        if graphs is not None:
            sizes = [bs for bs in reversed(graphs.sizes) if bs not in graphs.graphs]  # largest first: one pool
            with progress.stage("capturing decode graphs", len(sizes)):
                for bs in sizes:
                    graphs.capture(bs, compiled=True)
                    progress.advance("capturing decode graphs")
        if prefill_graphs is not None:
            buckets = prefill_graphs.uncaptured()
            with progress.stage("capturing prefill graphs", len(buckets)):
                for b in buckets:
                    prefill_graphs.capture(b, compiled=True)
                    progress.advance("capturing prefill graphs")
        sampler_warm_up.result()  # a compile error is raised here
        torch.cuda.synchronize(self.device)
        log.info("warm-up parts", extra=progress.stage_seconds)

    def _compile_model(self, slots: list[int], max_prefill_tokens: int, graphs, prefill_graphs,
                       progress: WarmupProgress) -> None:
        """Eager runs of every shape the model's kernels specialise on: a decode step per graph bucket, a
        prefill per prefill-graph bucket's token count, and eager packings (prompt scoring and prefills no
        bucket holds; Triton specialises on sizes divisible by 16, and on 1)."""
        packings = [[[1]], [[1] * 15], [[1] * 16], [[1] * 7, [2] * 9, [3] * 33],
                    [[1] * max(1, max_prefill_tokens // len(slots))] * len(slots)]
        packings = [p[:len(slots)] for p in packings]  # never more sequences than the engine has slots
        decode_sizes = graphs.sizes if graphs is not None else []
        bucket_tokens = sorted({b.tokens for b in prefill_graphs.buckets}) if prefill_graphs is not None else []
        with progress.stage("compiling model kernels", len(packings) + len(decode_sizes) + len(bucket_tokens)):
            for chunks in packings:
                self.model.prefill_with_scores(chunks, slots[:len(chunks)], {}, eager=True)
                progress.advance("compiling model kernels")
            for bs in decode_sizes:
                graphs.run_eager(bs)
                progress.advance("compiling model kernels")
            for tokens in bucket_tokens:
                prefill_graphs.run_eager(tokens)
                progress.advance("compiling model kernels")
            self.pool.reset(to_device(slots, torch.long, self.device))
            torch.cuda.synchronize(self.device)

    def launch(self, batch: SchedulerOutput,
               before_sample: Callable[[list[Sequence], torch.Tensor], None] | None = None) -> LaunchedStep | None:
        """Queue the step's prefill chunks, decodes and sampling on the device and start the sampled tokens'
        copy to the host; returns without waiting for the GPU. Decodes read their input tokens from
        ``last_tokens`` (what the previous step sampled, still on the device). ``before_sample(seqs, slots)``
        runs once the model is queued and before the sampling is (grammar masks: the host works while the
        device runs the model)."""
        seqs: list[Sequence] = []
        logits: list[torch.Tensor] = []
        timing = self._record_event() if self.step_events is not None else None
        if batch.prefills:
            computed = [c for c in batch.prefills if c.end > c.start]
            score = self._prompt_targets(computed)
            rows, scores = (self.model.prefill_with_scores([c.token_ids for c in computed],
                                                           [c.seq.slot for c in computed], score)
                            if computed else (None, {}))
            i = -1  # computed chunks' index in rows (and scores)
            kept = []
            for chunk in batch.prefills:
                if chunk.end == chunk.start:  # the whole prompt from a checkpoint: its stored logits
                    on_device, stored = chunk.seq.checkpoint.payload
                    if not on_device:
                        self._host_row_ready(stored)
                    row = self._slab(on_device).logits[stored].to(self.device, non_blocking=True)
                else:
                    i += 1
                    row = rows[i]
                    if i in scores:
                        self._record_prompt_logprobs(chunk, scores[i])
                if chunk.checkpoint:
                    kept.append((chunk, row))
                if chunk.is_last:
                    self._fork(chunk.seq)
                    family = [chunk.seq, *chunk.seq.siblings]
                    seqs += family
                    logits.append(row.expand(len(family), -1))
            for chunk, row in kept:  # after every stored row is read: keeping one may push another out
                self._keep_checkpoint(chunk, row)
        if batch.decodes:
            slots = to_device([s.slot for s in batch.decodes], torch.long, self.device)
            seqs += batch.decodes
            logits.append(self.model.decode(self.last_tokens[slots], slots))
        if not seqs:
            return None
        slots = to_device([s.slot for s in seqs], torch.long, self.device)
        rows = logits[0] if len(logits) == 1 else torch.cat(logits)  # a decode-only step copies nothing
        if before_sample is not None:
            before_sample(seqs, slots)
        sample = self.sampler.sample_device(rows.float(), slots)
        self.last_tokens[slots] = sample.tokens
        for s in seqs:
            s.num_launched += 1
        if timing is not None:
            self.step_events.append((timing, self._record_event()))
        return LaunchedStep(seqs, sample.start_transfer())

    def _keep_checkpoint(self, chunk: PrefillChunk, row: torch.Tensor) -> None:
        """The slot's state after ``chunk`` and its last logits, copied (queued after the prefill) into a device
        row of the cache."""
        self._keep(chunk.seq.prompt_token_ids[:chunk.end], chunk.seq, row, shared=chunk.end == chunk.seq.split_at)

    def keep_finished(self, seq: Sequence) -> None:
        """A finished sequence's state, kept under the tokens it has consumed: its prompt and every output token
        a decode fed it (all but the last, or all where the overlapped step decoded once more). The next chat
        turn re-sends them and starts there. No logits: they were not kept."""
        consumed = seq.num_launched - 1
        prefix_len = seq.num_prompt_tokens + consumed
        if seq.slot is None or not 0 <= consumed <= len(seq.output_token_ids) or \
                prefix_len < self.prefix_cache.min_tokens:
            return
        self._keep(seq.prompt_token_ids + seq.output_token_ids[:consumed], seq, None)

    def _keep(self, prefix: list[int], seq: Sequence, logits: torch.Tensor | None, shared: bool = False) -> None:
        """``seq``'s slot state (and ``logits``, where given) into a device row, kept under ``prefix``."""
        slab, slot = self._slabs[True], seq.slot

        def store() -> tuple[bool, int]:
            r = self._take_device_row()
            slab.save(r, self.pool, slot, logits)
            return True, r
        self.prefix_cache.add(prefix, self.prefix_cache_row_bytes, logits is not None, store, root=seq.params.state,
                              shared=shared)

    # -- the shared tier's bytes (worker.shared_states) --------------------------------------------

    def state_namespace(self, root: str | None) -> str:
        """What a checkpoint's bytes depend on besides its tokens: the weights, the numerics (backend, dtypes,
        fp8) and the initial state it grew from. Workers share a checkpoint only within one namespace."""
        h = hashlib.sha256(f"{self.model_fingerprint}|{self.backend}|{self.dtype}|{self.state_dtype}|"
                           f"{self.pool.att_shift.dtype}|float32|{self.weights_mode}|{root or ''}".encode())
        if root is not None:
            init = self.initial_states[root]
            for t in (init.att_shift, init.ffn_shift, init.wkv):
                h.update(_tensor_bytes(t))
        return h.hexdigest()[:24]

    def checkpoint_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Each tensor of a checkpoint's bytes: dtype and shape (engine.state_blob checks blobs against it)."""
        slab = self._slabs[True]
        return {name: (t.dtype, tuple(t.shape[1:])) for name, t in
                (("att_shift", slab.att_shift), ("ffn_shift", slab.ffn_shift), ("wkv", slab.wkv),
                 ("logits", slab.logits))}

    def export_checkpoint(self, payload: tuple[bool, int], has_logits: bool) -> "ExportedState | None":
        """A checkpoint's row copied (queued) into a staging row of host memory, for another thread to write
        out once ``wait()`` returns; None where every staging row is still being written (the offer is dropped),
        or for a host-tier checkpoint (its row may still be arriving from the device: a host copy out of it cannot
        be ordered after that)."""
        on_device, row = payload
        staging = self._staging_slab()
        if staging.num_free == 0 or not on_device:
            return None
        r = staging.take()
        self._slab(on_device).copy_row(row, staging, r)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return ExportedState(staging, r, event, has_logits)

    def import_checkpoint(self, prefix: list[int], root: str | None, blob: StateBlob) -> bool:
        """A checkpoint from the shared tier into a device row, kept under ``prefix`` (never offered back)."""
        slab = self._slabs[True]

        def store() -> tuple[bool, int]:
            r = self._take_device_row()
            for dst, src in ((slab.att_shift, blob.att_shift), (slab.ffn_shift, blob.ffn_shift),
                             (slab.wkv, blob.wkv)):
                dst[r].copy_(src)
            if blob.logits is not None:
                slab.logits[r].copy_(blob.logits)
            return True, r
        return self.prefix_cache.add(prefix, self.prefix_cache_row_bytes, blob.logits is not None, store, root=root,
                                     from_shared_tier=True) is not None

    def _staging_slab(self) -> CheckpointSlab:
        if self._staging is None:
            self._staging = CheckpointSlab(self.pool, STAGING_ROWS, self.vocab_size, torch.float32, "cpu",
                                           pinned=self.device.type == "cuda")
        return self._staging

    def _record_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def collect(self, step: LaunchedStep) -> SampleOutput:
        """The sampled tokens (and logprobs) of a launched step; waits for the GPU only if it is still on it."""
        return step.sample.result()

    @staticmethod
    def _prompt_targets(chunks: list[PrefillChunk]) -> dict[int, tuple[list[int], int]]:
        """For chunks of sequences that asked for prompt logprobs: the prompt tokens their positions predict
        (a prompt's last position predicts the first generated token, not a prompt token) and the top k."""
        score = {}
        for i, chunk in enumerate(chunks):
            k = chunk.seq.params.prompt_logprobs
            if k is not None:
                score[i] = (chunk.seq.prompt_token_ids[chunk.start + 1:chunk.end + 1], k)
        return score

    @staticmethod
    def _record_prompt_logprobs(chunk: PrefillChunk, entries: list[TokenLogprob]) -> None:
        seq = chunk.seq
        if chunk.start == 0:  # nothing predicts a prompt's first token
            seq.prompt_logprobs.append(TokenLogprob(seq.prompt_token_ids[0], None, []))
        seq.prompt_logprobs.extend(entries)

    def _fork(self, lead: Sequence) -> None:
        for s in lead.siblings:  # n > 1: one prompt, one list
            s.prompt_logprobs = lead.prompt_logprobs
        if not lead.siblings:
            return
        dst = to_device([s.slot for s in lead.siblings], torch.long, self.device)
        self.pool.copy(lead.slot, dst)
        for s in lead.siblings:
            self.sampler.copy_slot(lead.slot, s.slot, s.seed)



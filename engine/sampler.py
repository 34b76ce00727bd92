"""Batched, vectorised token sampling for the continuous-batching engine.

The engine owns ``num_slots`` sequence slots.  A sequence's sampling parameters
live in per-slot device tensors (written once, in :meth:`Sampler.reset_slot`),
so one :meth:`Sampler.sample` call handles any mix of slots with tensor ops and
a single device-to-host transfer at the end.

Processing order follows vLLM, penalties follow the OpenAI meanings:

1. ``logit_bias`` (additive, sparse per slot)
2. while fewer than ``min_tokens`` were generated: ban eos / ``stop_token_ids``
3. ``repetition_penalty`` (prompt or output tokens), ``frequency_penalty`` and
   ``presence_penalty`` (output tokens only)
4. ``temperature == 0`` -> argmax; otherwise multiply by 1 / temperature
5. ``min_p``, then ``top_k``, then ``top_p`` (on what is left), then sample.

Constrained rows (``params.structured``) also drop every token their grammar's bitmask forbids, after the
penalties (``engine.grammar`` fills each step's masks before the sampling is launched).

Logprobs are taken from the raw logits (vLLM's default ``raw_logprobs``).

Randomness is counter-based: the uniform for (slot seed, tokens generated so
far, vocabulary id) is an integer hash of those three, so a sequence's tokens
do not depend on its slot, its row, or its neighbours in the batch, and no
``torch.Generator`` state exists to save, copy or keep in step.

On CUDA one fused Triton kernel (``engine.cuda.sampling``) does steps 1-5 and
the logprobs; the torch path (``engine.sample_torch``) is its twin and the CPU
path. Both sample the token the exponential race picks among the kept tokens,
so they agree token for token on the same logits and counters (float rounding
aside).

Layout: ``engine.sample_layout`` (the tables' columns, the hash constants, the step's types), shared with the
kernel; ``engine.sample_torch`` (the torch path and the noise); this module, the per-slot state and the step.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch

from engine.device import to_device
from engine.params import SamplingParams
from engine.sample_layout import (I_SEED_KEY, NUM_F, NUM_I, DeviceSample, Features, PendingSample, SampleOutput,
                                  SlotTables)
from engine.sample_torch import process_logits, seed_key, torch_sample, vocab_keys
from engine.threads import background
from engine.warmup import WarmupProgress

__all__ = ["Admission", "DeviceSample", "Features", "PendingSample", "SampleOutput", "Sampler", "SlotTables"]


class Admission(NamedTuple):
    """A sequence given a slot: what ``Sampler.reset_slots`` writes there."""
    slot: int
    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]


class _SlotRow(NamedTuple):
    """One admission's rows of the slot tables."""
    fparams: list[float]
    iparams: list[int]
    bias: list[tuple[int, float]]
    ban: list[int]


@functools.lru_cache(maxsize=1024)
def rounded_once(temperature: float, min_p: float) -> tuple[float, float]:
    """1 / temperature (greedy rows: 1) and log(min_p) (-inf for 0: no floor), rounded to float32 once for both
    sampling paths; cached, as most requests share a few values (two scalar tensor ops a sequence otherwise)."""
    f32 = dict(dtype=torch.float32)
    inv_t = torch.tensor(1.0, **f32) / torch.tensor(temperature if temperature > 0.0 else 1.0, **f32)
    return float(inv_t), float(torch.log(torch.tensor(min_p, **f32)))


class Sampler:
    """Per-slot sampling state plus one batched ``sample`` step.

    Which optional stages run (bias, ban, penalties, min_p, top_k/top_p, logprobs)
    is decided from a host-side mirror of the occupied slots' params, never from
    tensor values.  Every stage is the identity for rows that do not use it, so
    a stale flag (a finished slot not yet reused) costs time, not correctness;
    ``release_slot`` drops it sooner.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str = "cpu",
                 use_kernel: bool | None = None) -> None:
        """``use_kernel``: sample with the fused Triton kernel (default: on CUDA); False = the torch path."""
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        dev = self.device
        self._fparams = torch.zeros(num_slots, NUM_F, dtype=torch.float32, device=dev)
        self._iparams = torch.zeros(num_slots, NUM_I, dtype=torch.int64, device=dev)
        self._generated = torch.zeros(num_slots, dtype=torch.int64, device=dev)
        self._vocab_keys = vocab_keys(vocab_size, dev)
        # Sparse per-slot tables, widened on demand; padding is (id 0, value 0).
        self._bias_ids = torch.zeros(num_slots, 0, dtype=torch.int64, device=dev)
        self._bias_vals = torch.zeros(num_slots, 0, dtype=torch.float32, device=dev)
        self._ban_ids = torch.zeros(num_slots, 0, dtype=torch.int64, device=dev)
        # [num_slots, V] penalty state, allocated the first time a slot needs penalties.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        # [num_slots, V / 32] allowed-token bits of constrained slots, allocated the first time one is admitted
        self.masks: torch.Tensor | None = None
        # Host mirror of each occupied slot's params: drives which work a step must do.
        self._host: list[SamplingParams | None] = [None] * num_slots
        self._has_ban: list[bool] = [False] * num_slots
        self._flags: Features | None = None
        self._kernel = self._kernel_workspace(use_kernel)

    def _kernel_workspace(self, use_kernel: bool | None):
        if use_kernel is None:
            use_kernel = self.device.type == "cuda"
        if not use_kernel:
            return None
        from engine.cuda.sampling import SamplingWorkspace
        return SamplingWorkspace(self.vocab_size, self.device)

    @property
    def tables(self) -> SlotTables:
        return SlotTables(self._fparams, self._iparams, self._generated, self._bias_ids, self._bias_vals,
                          self._ban_ids, self._vocab_keys, self.output_counts, self.prompt_mask, self.masks)

    # ------------------------------------------------------------------ slots

    def reset_slot(self, slot: int, params: SamplingParams, seed: int,
                   prompt_token_ids: Sequence[int], eos_token_ids: Sequence[int] = (0,)) -> None:
        """Admit a sequence into ``slot``: store its params, zero its counters."""
        self.reset_slots([Admission(slot, params, seed, prompt_token_ids)], eos_token_ids)

    def reset_slots(self, admissions: Sequence[Admission], eos_token_ids: Sequence[int] = (0,),
                    slot_index: torch.Tensor | None = None) -> None:
        """Admit sequences into their slots: every table written by one copy for all of them (on CUDA a
        per-sequence write was ~8 small launches and 2 pinned copies: 64 prompts admitted in a step queued
        ~500 launches behind the running step). Checks everything before writing anything. ``slot_index``:
        the admissions' slots already on the device (the runner's, shared with the state reset)."""
        rows = [self._admission_row(a, eos_token_ids) for a in admissions]
        if not rows:
            return
        slots = [a.slot for a in admissions]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot was admitted twice in one call: {slots}")
        n, idx = len(rows), slot_index if slot_index is not None else to_device(slots, torch.long, self.device)
        self._fparams.index_copy_(0, idx, to_device([v for r in rows for v in r.fparams], torch.float32,
                                                    self.device).view(n, NUM_F))
        self._iparams.index_copy_(0, idx, to_device([v for r in rows for v in r.iparams], torch.int64,
                                                    self.device).view(n, NUM_I))
        self._generated.index_fill_(0, idx, 0)
        self._bias_ids, self._bias_vals = self._widen(self._bias_ids, self._bias_vals,
                                                      max(len(r.bias) for r in rows))
        self._write_rows(self._bias_ids, idx, [[i for i, _ in r.bias] for r in rows], torch.int64)
        self._write_rows(self._bias_vals, idx, [[b for _, b in r.bias] for r in rows], torch.float32)
        self._ban_ids = self._widen(self._ban_ids, None, max(len(r.ban) for r in rows))[0]
        self._write_rows(self._ban_ids, idx, [r.ban for r in rows], torch.int64)
        self._reset_penalty_state(idx, admissions)
        if self.masks is None and any(a.params.structured is not None for a in admissions):
            self.masks = torch.full((self.num_slots, (self.vocab_size + 31) // 32), -1, dtype=torch.int32,
                                    device=self.device)
        for a, r in zip(admissions, rows):
            self._host[a.slot] = a.params
            self._has_ban[a.slot] = bool(r.ban)
        self._flags = None

    def _admission_row(self, a: Admission, eos_token_ids: Sequence[int]) -> _SlotRow:
        """One admission's table rows, checked (nothing is written before every admission passed)."""
        self._check_slot(a.slot)
        params = a.params
        # An out-of-range id would be a device-side assert on CUDA: refuse it here.
        params.validate(self.vocab_size)
        for name, ids in (("prompt_token_ids", a.prompt_token_ids), ("eos_token_ids", eos_token_ids)):
            if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
                raise ValueError(f"{name} must lie in 0..{self.vocab_size - 1}")
        bias = sorted(params.logit_bias.items())
        # vLLM: eos is a stop token unless ignore_eos; all are banned until min_tokens.
        ban = set(params.stop_token_ids)
        if not params.ignore_eos:
            ban.update(eos_token_ids)
        ban_list = sorted(ban) if params.min_tokens > 0 else []
        inv_t, log_min_p = rounded_once(params.temperature, params.min_p)
        fparams = [params.temperature, params.top_p, params.min_p, params.presence_penalty,
                   params.frequency_penalty, params.repetition_penalty, inv_t, log_min_p]
        k = -1 if params.logprobs is None else params.logprobs
        iparams = [max(params.top_k, 0), params.min_tokens, k, seed_key(a.seed), len(bias), len(ban_list),
                   int(params.structured is not None)]
        return _SlotRow(fparams, iparams, bias, ban_list)

    def _write_rows(self, table: torch.Tensor, idx: torch.Tensor, rows: list[list], dtype: torch.dtype) -> None:
        """The admitted slots' whole rows of a padded sparse table (padding 0), in one copy."""
        width = table.shape[1]
        if width == 0:
            return
        flat = [v for row in rows for v in (*row, *[0] * (width - len(row)))]
        table.index_copy_(0, idx, to_device(flat, dtype, self.device).view(len(rows), width))

    def _reset_penalty_state(self, idx: torch.Tensor, admissions: Sequence[Admission]) -> None:
        if self.output_counts is None and any(a.params.needs_penalties for a in admissions):
            v = self.vocab_size
            self.output_counts = torch.zeros(self.num_slots, v, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.num_slots, v, dtype=torch.bool, device=self.device)
        if self.output_counts is None:
            return
        self.output_counts.index_fill_(0, idx, 0)
        self.prompt_mask.index_fill_(0, idx, False)
        marked = [(a.slot, t) for a in admissions if a.params.repetition_penalty != 1.0 for t in a.prompt_token_ids]
        if marked:  # the prompts' tokens, for repetition_penalty: one scatter for all of them
            where = to_device([x for pair in marked for x in pair], torch.int64, self.device).view(-1, 2)
            self.prompt_mask[where[:, 0], where[:, 1]] = True

    def copy_slot(self, src: int, dst: int, seed: int) -> None:
        """Fork ``src`` into ``dst`` (n > 1 after a shared prompt): same state, new seed."""
        self._check_slot(src)
        self._check_slot(dst)
        if self._host[src] is None:
            raise ValueError(f"slot {src} holds no sequence")
        for t in (self._fparams, self._iparams, self._generated, self._bias_ids, self._bias_vals, self._ban_ids):
            t[dst] = t[src]
        if self.output_counts is not None:
            self.output_counts[dst] = self.output_counts[src]
            self.prompt_mask[dst] = self.prompt_mask[src]
        self._iparams[dst, I_SEED_KEY] = seed_key(seed)
        self._host[dst] = self._host[src]
        self._has_ban[dst] = self._has_ban[src]
        self._flags = None

    def write_masks(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The allowed-token bits of constrained ``slots`` [k] for the next sampling: ``rows`` [k, V / 32]
        int32 (pinned host memory: the copy does not wait for the device)."""
        self.masks.index_copy_(0, slots, rows.to(self.device, non_blocking=True))

    def release_slot(self, slot: int) -> None:
        """Optional: forget a finished sequence so its features stop costing work."""
        self._check_slot(slot)
        self._host[slot] = None
        self._has_ban[slot] = False
        self._flags = None

    # ---------------------------------------------------------------- sampling

    def process_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Steps 1-3 (bias, min_tokens ban, penalties) with torch: the logits before temperature."""
        return process_logits(logits, slots, self.tables, self._features())

    def sample_device(self, logits: torch.Tensor, slots: torch.Tensor) -> DeviceSample:
        """One token per row of ``logits`` [B, V] for ``slots`` [B], left on the device; records the tokens
        (counters and penalty counts, on the device). On CUDA: launches only, no transfer, no sync."""
        f = self._features()
        if f.plain_greedy:  # a plain reduction (the kernel's greedy rows also gather the filters' statistics)
            tokens = logits.argmax(dim=-1)
            self._record(slots, tokens)
            return DeviceSample(tokens)
        if self._kernel is not None:
            from engine.cuda.sampling import sample_rows
            return sample_rows(logits, slots, self.tables, f, self._kernel, record=True)
        out = torch_sample(logits, slots, self.tables, f)
        self._record(slots, out.tokens)
        return out

    def sample(self, logits: torch.Tensor, slots: torch.Tensor) -> SampleOutput:
        """``sample_device`` and the step's one device-to-host transfer."""
        return self.sample_device(logits, slots).to_host()

    def warm_up(self, batch_sizes: Sequence[int], threads: int | None = None,
                compiled: Callable[[int, int], None] | None = None) -> None:
        """Compile (and run once) every kernel variant a step can launch, at each batch size, so that no
        request waits for Triton; ``threads`` compiles at once; ``compiled(done, total)`` as each kernel is
        ready. Slot state is left untouched. A no-op on the torch path."""
        if self._kernel is None:
            return
        from engine.cuda.sampling import WARM_UP_THREADS, warm_up
        warm_up(self.tables, self._kernel, batch_sizes, threads=threads or WARM_UP_THREADS, compiled=compiled)

    def warm_up_in_background(self, batch_sizes: Sequence[int], progress: WarmupProgress,
                              compile_apart: Callable[[Callable[[int, int], None]], bool] | None = None) -> Future:
        """``warm_up`` in a thread of its own while the caller warms up the model; the future's ``result()``
        waits for it and raises its error. ``compile_apart(compiled)``, where given, first compiles the kernels
        elsewhere (``engine.sampler_compile``: a child process, no GIL shared with the model's compiles), so the
        thread's own warm-up only loads them; False: it failed, and the thread compiles them itself."""
        from engine.cuda.sampling import compile_jobs
        stage = "compiling sampler kernels"

        def advance(done: int, total: int) -> None:
            progress.advance(stage)

        def run() -> None:
            with progress.stage(stage, len(compile_jobs(self.vocab_size, batch_sizes))):
                apart = self._kernel is not None and compile_apart is not None and compile_apart(advance)
                self.warm_up(batch_sizes, threads=os.cpu_count() or 1, compiled=None if apart else advance)
        return background(run, "sampler-warm-up")

    # ---------------------------------------------------------------- internals

    def _record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        # counts only while a live slot has penalties (a slot's counts are zeroed when it is admitted): once
        # the last such request is gone, steps drop the penalty stage again (and on CUDA its kernel variant)
        if self.output_counts is not None and self._features().penalties:
            ones = torch.ones_like(tokens, dtype=torch.int32)
            self.output_counts.index_put_((slots, tokens), ones, accumulate=True)
        self._generated.index_add_(0, slots, torch.ones_like(slots))

    def _features(self) -> Features:
        """Which optional stages any occupied slot needs (host-side, no device sync)."""
        if self._flags is None:
            self._flags = Features.of([(p, ban) for p, ban in zip(self._host, self._has_ban) if p is not None])
        return self._flags

    def _widen(self, ids: torch.Tensor, vals: torch.Tensor | None,
               need: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Grow a padded [num_slots, L] table to hold ``need`` entries (powers of two)."""
        have = ids.shape[1]
        if need <= have:
            return ids, vals
        width = max(4, 1 << (need - 1).bit_length())
        new_ids = torch.zeros(self.num_slots, width, dtype=ids.dtype, device=self.device)
        new_ids[:, :have] = ids
        if vals is None:
            return new_ids, None
        new_vals = torch.zeros(self.num_slots, width, dtype=vals.dtype, device=self.device)
        new_vals[:, :have] = vals
        return new_ids, new_vals

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")


"""Launching the kernel: ``sample_rows`` (one launch a step, two for the split race, no sync) and its twin
``sample_rows_ref``, and ``warm_up``, which compiles every variant before a request waits for one."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.cuda.sampling.kernel import _sample_kernel
from engine.cuda.sampling.shapes import has_band, shape_of, variant_features
from engine.cuda.sampling.split import sample_split
from engine.cuda.sampling.workspace import SamplingWorkspace
from engine.sample_layout import DeviceSample, Features, SlotTables
from engine.sample_torch import torch_sample

WARM_UP_THREADS = min(8, os.cpu_count() or 1)  # warm_up's compiles at once (each mostly one core)


def sample_rows(logits: torch.Tensor, slots: torch.Tensor, t: SlotTables, f: Features,
                ws: SamplingWorkspace, record: bool = False) -> DeviceSample:
    """Tokens (and raw logprobs when ``f.logprobs``) for ``logits`` [B, V] and distinct ``slots`` [B]: one
    launch (two for the split race), no sync (batch 1's budget is tens of microseconds: no fills, no gathers
    around it). ``record``: advance the counters and penalty counts in the same launch. Logprob entries of rows
    with k = -1 are undefined (``DeviceSample.to_host`` reads k)."""
    b, v = logits.shape
    logits, slots = _aligned(logits.float()), _aligned(slots.long())
    dev = logits.device
    has_pen = t.output_counts is not None and f.penalties  # counts matter to live penalty rows only
    counts = t.output_counts if has_pen else ws.dummy
    has_masks = f.mask and t.masks is not None
    prepare = f.bias or f.ban or has_pen or has_masks
    cfg = shape_of(f, v, b)
    in_prompt = t.prompt_mask.view(torch.uint8) if has_pen else ws.dummy.view(torch.uint8)
    masks = t.masks if has_masks else ws.dummy
    scratch = ws.scratch_rows() if prepare else ws.band_v
    if cfg.segments > 1:
        return sample_split(logits, slots, t, ws, cfg, record, prepare,
                            (counts, in_prompt, has_pen, masks, has_masks, scratch))
    top_w = f.max_logprobs if f.logprobs else 0
    tokens = torch.empty(b, dtype=torch.int64, device=dev)  # apart: a view's alignment is a specialisation
    k = torch.empty(b, dtype=torch.int64, device=dev)
    lp = torch.empty(b, dtype=torch.float32, device=dev)
    top_ids = torch.empty(b, max(top_w, 1), dtype=torch.int64, device=dev)
    top_lp = torch.empty(b, max(top_w, 1), dtype=torch.float32, device=dev)
    if b > 0:
        _sample_kernel[(min(b, ws.sms * cfg.programs_per_sm),)](
            logits, v, logits.stride(0), slots, b, t.fparams, t.iparams, t.generated, ws.vocab_keys,
            t.bias_ids, t.bias_vals, t.bias_ids.shape[1], t.ban_ids, t.ban_ids.shape[1], counts, in_prompt,
            int(has_pen), masks, masks.shape[1] if has_masks else 0, int(has_masks), scratch, int(prepare),
            ws.band_v, ws.band_i, int(record), tokens, k, lp, top_ids, top_lp,
            max(top_w, 1), FILTER=f.filtered, LOGPROBS=f.logprobs, PREPARE=prepare, BAND=has_band(f),
            CAP=cfg.cap, BLOCK=cfg.block, num_warps=cfg.num_warps)
    if not f.logprobs:
        return DeviceSample(tokens)
    return DeviceSample(tokens, k, lp, top_ids[:, :top_w], top_lp[:, :top_w])


def sample_rows_ref(logits: torch.Tensor, slots: torch.Tensor, t: SlotTables, f: Features,
                    ws: SamplingWorkspace | None = None) -> DeviceSample:
    """The twin: the torch path (``engine.sample_torch``), which is also the CPU sampler."""
    return torch_sample(logits.float(), slots, t, f)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned: what the compiled kernel was specialised for (a view or a broadcast
    row would be a new specialisation, compiled mid-serving)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous().clone()


def compile_jobs(vocab_size: int, batch_sizes: Sequence[int]) -> list[tuple[Features, int]]:
    """One (variant, batch size) per kernel that ``warm_up`` compiles: each variant at the smallest batch size of
    each of its launch shapes (the batch size is not specialised on)."""
    jobs = [(f, b) for b in batch_sizes for f in variant_features()]
    return list({(f, shape_of(f, vocab_size, b)): (f, b) for f, b in reversed(jobs)}.values())


def warm_up(t: SlotTables, ws: SamplingWorkspace, batch_sizes: Sequence[int],
            threads: int = WARM_UP_THREADS, compiled: Callable[[int, int], None] | None = None) -> None:
    """Compile every variant of the kernel (``variant_features``) and launch each once per batch size (outputs
    dropped, counters untouched): what differs per row within a variant is branched on at run time.
    ``compiled(done, total)`` is called as each kernel of ``compile_jobs`` is ready.

    A cold compile of a filter variant takes seconds of one core, and Triton's compiler releases the GIL for
    most of its work: so one launch per compiled kernel comes first, the filter variants' in a thread pool,
    then every (variant, batch size) once more, from the compiled kernels."""
    v = ws.vocab_size
    # a new thread starts on the first device; "cuda" (no index) means the calling thread's current one
    index = ws.device.index if ws.device.type != "cuda" or ws.device.index is not None else torch.cuda.current_device()
    firsts = compile_jobs(v, batch_sizes)
    done = itertools.count(1)
    lock = threading.Lock()

    def launch(job: tuple[Features, int]) -> None:
        if ws.device.type == "cuda":
            torch.cuda.set_device(index)
        f, b = job
        logits = torch.zeros(b, v, dtype=torch.float32, device=ws.device)
        sample_rows(logits, torch.arange(b, device=ws.device) % t.fparams.shape[0], t, f, ws)

    def first_launch(job: tuple[Features, int]) -> None:
        launch(job)
        if compiled is not None:
            with lock:
                compiled(next(done), len(firsts))

    slow = [job for job in firsts if job[0].filtered]
    parallel = threads > 1 and len(slow) > 1 and ws.device.type == "cuda"  # (the interpreter compiles nothing)
    # the quick ones here first: each kernel's first launch builds Triton's per-device cache of it, which threads
    # launching it for the first time at once would each build
    for job in firsts:
        if not parallel or job not in slow:
            first_launch(job)
    if parallel:
        with ThreadPoolExecutor(min(threads, len(slow)), thread_name_prefix="sampler-compile") as pool:
            list(pool.map(first_launch, slow))  # list(): a thread's error is raised here
    for job in [(f, b) for b in batch_sizes for f in variant_features()]:
        launch(job)

"""CUDA graphs for the packed prefill, one per (prompt tokens, sequences) bucket.

An eager prefill step launches ~30 kernels a layer from Python (the mixes, the GEMMs, fla's chunked scan): on an
H200 35-45 ms of host time for the 1.5B shape whatever the number of tokens (BENCHMARKS.md), so steps that admit a
few prompts were host-bound and a burst of prompts ran at a third of the packed-prefill rate. A graph replays the
same kernels for ~0.1 ms of host time.

A prefill is laid out in its bucket's fixed shape: tokens padded to the bucket's token count (the extra tokens form
one padding sequence), sequences to its sequence count (empty ones), fla's chunk indices to their bound (the extra
rows name an empty sequence: fla's programs find no rows there and write nothing). Padding sequences all read and
write the scratch slot. Everything a step needs travels in one int64 buffer, one host-to-device copy; the graphs
share one input buffer, one logits buffer and one memory pool (a step at a time, in stream order).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.cuda.graphs import capturing

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MIN_TOKENS_PER_SEQ = 8  # buckets of N sequences start at 8N tokens: shorter prompts in such numbers pack eagerly


@dataclass(frozen=True)
class PrefillBucket:
    tokens: int  # T: prompt tokens, padding included
    seqs: int  # real sequences it holds at most
    chunk_size: int  # fla's chunk length (64 on recent Triton)

    @property
    def num_seqs(self) -> int:
        """Sequences in the graph: the real ones (padded with empty ones), the padding tokens' and a last empty
        one that the padding chunk-index rows name."""
        return self.seqs + 2

    @property
    def num_chunks(self) -> int:
        """fla's chunk-index rows: Σ ceil(len / c) ≤ T / c + one per sequence holding tokens."""
        return self.tokens // self.chunk_size + self.seqs + 1

    @property
    def size(self) -> int:
        """int64 words of the input buffer: tokens, prev_slot, end_seq (T each), cu (S + 1), slots (S), chunk
        indices (2 per row)."""
        return 3 * self.tokens + 2 * self.num_seqs + 1 + 2 * self.num_chunks


@dataclass
class PrefillInputs:
    """Views of one prefill's input buffer (host or device)."""
    tokens: torch.Tensor  # [T]
    prev_slot: torch.Tensor  # [T]: the slot whose shift state precedes a sequence's first token, else -1
    end_seq: torch.Tensor  # [T]: the sequence index at a sequence's last token, else -1
    cu: torch.Tensor  # [S + 1] cumulative sequence lengths
    slots: torch.Tensor  # [S]
    chunk_indices: torch.Tensor  # [NT, 2]: (sequence, chunk within it), fla's layout

    @classmethod
    def view(cls, buf: torch.Tensor, b: PrefillBucket) -> PrefillInputs:
        T, S = b.tokens, b.num_seqs
        cuts = [T, 2 * T, 3 * T, 3 * T + S + 1, 3 * T + 2 * S + 1]
        return cls(buf[:cuts[0]], buf[cuts[0]:cuts[1]], buf[cuts[1]:cuts[2]], buf[cuts[2]:cuts[3]],
                   buf[cuts[3]:cuts[4]], buf[cuts[4]:b.size].view(b.num_chunks, 2))


def bucket_list(max_tokens: int, chunk_size: int, max_seqs: int) -> list[PrefillBucket]:
    """Every (tokens, sequences) bucket up to ``max_tokens`` prompt tokens a step, sorted."""
    top = -(-max_tokens // chunk_size) * chunk_size
    tokens = sorted({t for t in TOKEN_BUCKETS if t < top} | {top})
    return [PrefillBucket(t, n, chunk_size) for t in tokens for n in SEQ_BUCKETS
            if n <= max_seqs and (n == 1 or n * MIN_TOKENS_PER_SEQ <= t)]


def lay_out(b: PrefillBucket, chunks: list[list[int]], slots: list[int], scratch_slot: int) -> torch.Tensor:
    """One prefill in bucket ``b``'s layout: an int64 CPU tensor of ``b.size`` words (``PrefillInputs.view``).

    Built in numpy: on the step thread before each prefill, where ~20 small torch ops cost ~8 µs each and each
    released the GIL to whichever worker thread wanted it."""
    n, lengths = len(chunks), [len(c) for c in chunks]
    real, T, S, c = sum(lengths), b.tokens, b.num_seqs, b.chunk_size
    if n > b.seqs or real > b.tokens or 0 in lengths:
        raise ValueError(f"{n} chunks of {real} tokens do not fit {b}")
    buf = np.empty(b.size, dtype=np.int64)
    tokens, prev_slot, end_seq = buf[:T], buf[T:2 * T], buf[2 * T:3 * T]
    cu, seq_slots = buf[3 * T:3 * T + S + 1], buf[3 * T + S + 1:3 * T + 2 * S + 1]
    chunk_indices = buf[3 * T + 2 * S + 1:b.size].reshape(b.num_chunks, 2)
    lens = np.zeros(S, dtype=np.int64)
    lens[:n] = lengths
    lens[n] = T - real  # the padding tokens' sequence (empty when the prompts fill the bucket)
    cu[0] = 0
    np.cumsum(lens, out=cu[1:])
    seq_slots.fill(scratch_slot)
    seq_slots[:n] = slots
    tokens[:real] = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=real)
    tokens[real:] = 0
    held = np.flatnonzero(lens)
    prev_slot.fill(-1)
    prev_slot[cu[held]] = seq_slots[held]
    end_seq.fill(-1)
    end_seq[cu[held + 1] - 1] = held
    counts = (lens + c - 1) // c
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    chunk_indices[:total, 0] = np.repeat(np.arange(S), counts)
    chunk_indices[:total, 1] = np.arange(total) - np.repeat(first, counts)
    chunk_indices[total:, 0] = S - 1  # the last sequence is always empty
    chunk_indices[total:, 1] = 0
    return torch.from_numpy(buf)


class PrefillGraphs:
    """``forward(inputs, bucket) -> logits [S, vocab]`` (fixed shapes, no host sync) captured per bucket."""

    def __init__(self, forward: Callable[[PrefillInputs, PrefillBucket], torch.Tensor], max_tokens: int,
                 max_seqs: int, chunk_size: int, scratch_slot: int, vocab_size: int, device: torch.device):
        self.forward = forward
        self.buckets = bucket_list(max_tokens, chunk_size, max_seqs)
        self.scratch_slot = scratch_slot
        self.inputs = torch.zeros(max(b.size for b in self.buckets), dtype=torch.long, device=device)
        self.logits = torch.empty(max(b.num_seqs for b in self.buckets), vocab_size, dtype=torch.float32,
                                  device=device)
        self.graphs: dict[PrefillBucket, torch.cuda.CUDAGraph] = {}
        self.eager: set[PrefillBucket] = set()  # captures that failed
        self.capture_s = 0.0
        self._pool = None

    def bucket_for(self, num_tokens: int, num_seqs: int) -> PrefillBucket | None:
        """The smallest bucket that holds the prefill (fewest tokens first), or None: run it eagerly."""
        start = bisect.bisect_left(self.buckets, num_tokens, key=lambda b: b.tokens)
        return next((b for b in self.buckets[start:] if b.seqs >= num_seqs), None)

    @torch.inference_mode()
    def capture(self, b: PrefillBucket, compiled: bool = False) -> bool:
        """Capture one bucket (at warm-up, or lazily on first use): an eager run first compiles and autotunes,
        unless ``compiled`` (the warm-up's eager runs of every token count already did: a capture costs one
        forward's launches instead of two). A capture that fails (a library call that may not be captured)
        leaves the bucket eager; False."""
        t0 = time.perf_counter()
        if not compiled:
            self._run_eager(b)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, self._pool):
                # fresh views each call: fla's identity-keyed tensor cache misses on the first layer, so the
                # graph records the chunk offsets it derives from cu instead of reusing an eager run's
                self.logits[:b.num_seqs].copy_(self.forward(PrefillInputs.view(self.inputs, b), b))
        except RuntimeError as e:
            torch.cuda.synchronize()
            self.eager.add(b)
            log.warning("prefill graph capture failed: the bucket runs eagerly",
                        extra={"tokens": b.tokens, "seqs": b.seqs, "error": str(e).splitlines()[0]})
            return False
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[b] = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.capture_s += seconds
        log.info("captured prefill graph", extra={"tokens": b.tokens, "seqs": b.seqs, "seconds": round(seconds, 3)})
        return True

    def uncaptured(self) -> list[PrefillBucket]:
        """The buckets still to capture, largest first (the memory pool is sized by the first)."""
        return [b for b in reversed(self.buckets) if b not in self.graphs and b not in self.eager]

    @torch.inference_mode()
    def run_eager(self, tokens: int) -> None:
        """An uncaptured prefill in the smallest bucket of ``tokens`` tokens: compiles and tunes its kernels."""
        self._run_eager(min((b for b in self.buckets if b.tokens == tokens), key=lambda b: b.seqs))

    def _run_eager(self, b: PrefillBucket) -> None:
        self._load(lay_out(b, [[0]], [self.scratch_slot], self.scratch_slot), b)
        self.forward(PrefillInputs.view(self.inputs, b), b)

    def run(self, chunks: list[list[int]], slots: list[int]) -> torch.Tensor | None:
        """Each chunk's last logits ``[len(chunks), vocab]``, or None when no bucket holds this prefill. A copy:
        the shared buffer is the next prefill's (a few MB, one kernel)."""
        b = self.bucket_for(sum(len(c) for c in chunks), len(chunks))
        if b is None or b in self.eager or (b not in self.graphs and not self.capture(b)):
            return None
        self._load(lay_out(b, chunks, slots, self.scratch_slot), b)
        self.graphs[b].replay()
        return self.logits[:len(chunks)].clone()

    def _load(self, host: torch.Tensor, b: PrefillBucket) -> None:
        # pinned per call: the caching host allocator keeps a block until its copy is done
        self.inputs[:b.size].copy_(host.pin_memory(), non_blocking=True)

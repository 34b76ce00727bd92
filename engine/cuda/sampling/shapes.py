"""Which compiled variant and which launch shape a step takes: the variants are the stages a step's rows may use
(``variant_features``), the shapes depend on the vocabulary's size and, for exact variants only, on the step's
size (``config_for``). The measurements behind each shape: BENCHMARKS.md, sampler."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from engine.sample_layout import Features

SPLIT_ROWS = 16  # up to this many rows an exact step runs the split race (processed rows too)
FEW_ROWS = 256  # up to this many rows an exact step runs the wide shape
FEW_FILTERED = 16  # up to this many rows a filter or logprobs step runs one wide program an SM


@dataclass(frozen=True)
class KernelConfig:
    """Fixed per vocabulary size, never per batch (a row's sums must not depend on its batch): ``block``
    values a chunk in every pass, ``cap`` the band buffer (sorted at the end of a threshold search), and the
    persistent grid, ``programs_per_sm`` programs of ``num_warps`` warps on each SM. ``segments`` > 1: the
    split race instead (``_race_split_kernel``), each row over that many programs."""
    block: int
    cap: int
    num_warps: int
    programs_per_sm: int = 2
    segments: int = 1


@functools.lru_cache(maxsize=None)
def config_for(vocab_size: int, rows: int = 0, exact: bool = False) -> KernelConfig:
    """The launch shape for a step of ``rows`` rows. ``exact``: the variant has no filters and no logprobs, so
    each row's token is the race's winner or the argmax, the same however the row is chunked and summed: only
    those may switch shape with the batch's size (very few rows: each row split over several programs, each
    processing its own segment first where the row has penalties, bias, a ban or a grammar mask; a few: one wide
    program an SM each, lower latency a row). Every other variant has one block and band per vocabulary size, so
    its rows never depend on their batch (its small steps take more warps a program: the same fixed-point sums)."""
    small_vocab = vocab_size <= 8192
    if exact and 0 < rows <= (2 if small_vocab else SPLIT_ROWS):
        # one row on one SM waits on its 32 chunks one after another: over many SMs each program has a chunk or two
        return KernelConfig(block=256, cap=64, num_warps=4, segments=4) if small_vocab else \
            KernelConfig(block=1024, cap=1024, num_warps=4, segments=32)
    if exact and 0 < rows <= (4 if small_vocab else FEW_ROWS):
        return KernelConfig(block=512, cap=64, num_warps=8, programs_per_sm=1) if small_vocab else \
            KernelConfig(block=2048, cap=1024, num_warps=16, programs_per_sm=1)
    if not exact and 0 < rows <= FEW_FILTERED:
        # the filter and logprobs variants' small steps: the small shape's block and band in one wide program an
        # SM, where a small program streams a row's chunks one after another on one SM
        return KernelConfig(block=256, cap=64, num_warps=8, programs_per_sm=1) if small_vocab else \
            KernelConfig(block=1024, cap=1024, num_warps=16, programs_per_sm=1)
    if small_vocab:  # tests and small models: several chunks and a small band, to exercise both
        return KernelConfig(block=256, cap=64, num_warps=4)
    # small programs, 8 an SM: a row's chunk loop waits on its loads and barriers, and programs that wait
    # independently hide each other's waits; cap 1,024 keeps the band's sort a few microseconds. The filter and
    # logprobs variants keep it too: wider programs (one an SM) were slower for them at large batches
    return KernelConfig(block=1024, cap=1024, num_warps=4, programs_per_sm=8)


def shape_of(f: Features, vocab_size: int, rows: int) -> KernelConfig:
    """The launch shape of a step with these stages."""
    return config_for(vocab_size, rows, exact=not (f.filtered or f.logprobs))


def has_band(f: Features) -> bool:
    """Whether the step's filter variant has top_k's lane band: only where a row has top_k (the band state costs
    a top_p / min_p variant registers and programs an SM; a top_k row in a variant without it searches)."""
    return f.filtered and f.top_k


def variant_features() -> list[Features]:
    """One Features per compiled variant: with or without the filters (and filters with or without top_k's lane
    band), logprobs and the processed row."""
    return [Features(sampled=True, top_p=filtered, top_k=band, logprobs=logprobs, max_logprobs=int(logprobs),
                     bias=prepare)
            for filtered in (False, True) for band in ((False, True) if filtered else (False,))
            for logprobs in (False, True) for prepare in (False, True)]

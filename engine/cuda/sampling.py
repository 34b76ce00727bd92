"""Token sampling in one persistent Triton kernel (``sample_rows``) with its plain-torch twin.

Same semantics as ``engine.sampler`` (its module doc), same counter-hash noise, same token: the exponential
race's winner ``argmax(s_i - log E_i)`` over the kept tokens ``{i : s_i >= tau}``; the kernel finds that set
without sorting the vocabulary. A persistent grid of small programs (``config_for``) loops over the rows, a row
at a time. Per row:

1. rows with logit_bias, an active min_tokens ban or penalties: the processed row times 1 / temperature goes
   to the program's scratch row (penalties read the slot's dense counts; the sparse bias and ban entries are
   then rewritten from their raw logits: nothing matches ids against ids); later passes read it there.
   Rows with no filters and no logprobs need one pass only, and take it with no scratch row: the dense stages
   as the row streams by, the race keeping its best few keys, then the bias and ban entries matched against
   those few (``_processed_exact_token``).
2. the stats pass: max and greedy argmax, count / mean / std / min of the finite values, raw log-sum-exp and
   top-k raw logprobs when asked, and for rows without top_k the race over every token (winner ``w``).
   Greedy and plain-temperature rows end here: one pass. top_k rows also keep each lane's two largest
   values (the lane band): when k of them lie above the largest of the lanes' third values, they are the band
   of step 4 already (about 98% of rows at k = 50, vocabulary 65,536), no search.
3. the threshold: ``kept(t) = #{s > t} < top_k and mass{s > t} < top_p * Z`` holds exactly for the values
   the sorted rule keeps (ties at the threshold kept) and is monotone in t. A probe pass evaluates it at up
   to 8 values at once and narrows a bracket ``(lo, hi]`` (<= lo dropped, > hi kept); probes go around a
   Gaussian guess, then the interpolated crossing, plus even splits, so a bracket always shrinks.
   top_p rows first test ``w`` (2 probes: lo, min_p's floor, gives Z; and w's value): a kept ``w`` is the
   answer (p ~ top_p of rows) and the row is done after 2 passes. min_p alone: ``w`` unless under the floor.
   The race also keeps its next best keys (the runners-up), and the best kept of them answers most of the
   rest without a search (the race over the kept set is its best key).
4. when at most ``cap`` values lie in the bracket (or above lo: then top_k's own mass, the Z top_p needs
   after top_k, is there too), one pass copies them to the program's band buffer and races the values above
   hi; the band is sorted, tau read off its cumulative counts and masses as the sorted rule reads them, and
   its kept tokens join the race.

Passes over a row at vocabulary 65,536, flat (σ=1) / peaked (σ=6) logits, counted under the interpreter:
greedy, T=1 and logprobs 1; penalties 2; min_p 1.6 / 1; top_p 0.9 2.4 / 2; top_k 50 3. A pass reads 256 KB
a row (268 MB at batch 1,024, ~0.07 ms from HBM); what costs more than reading is arithmetic a value: the
race's noise (two 32-bit hashes, and two logs where a chunk can still change the winner: ~5 of 32 chunks),
8 probes (~40 instructions), and barriers: every reduction to a scalar inside a chunk loop is a block-wide
one, so passes accumulate lane by lane and reduce once. Measured numbers belong in BENCHMARKS.md
(``python -m engine.bench --sampler-only``).

A row's arithmetic depends only on its values and on the configuration, which depends only on the vocabulary
size (``config_for``): not on the batch size, its row or its program, so tokens are batch-invariant. (Steps
without filters or logprobs, whose tokens are exact whatever the chunking, may switch shape with their size:
the split race over several programs a row for a few plain rows, a wide program for a few more.) Exact
ties between two race keys go to the lower id, where the twin (torch's argmax over its candidates) may pick
the other: a probability-zero event for continuous noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import sampler as sm
from engine.sampler import DeviceSample, Features, SlotTables

MUL1 = tl.constexpr(sm._MUL1)
MUL2 = tl.constexpr(sm._MUL2)
GOLDEN = tl.constexpr(sm._GOLDEN)
COUNTER_SALT = tl.constexpr(sm._COUNTER_SALT)
VOCAB_SALT = tl.constexpr(sm._VOCAB_SALT)
V_MAX = tl.constexpr(sm._V_MAX)
NUM_F = tl.constexpr(sm.NUM_F)
NUM_I = tl.constexpr(sm.NUM_I)
F_TOP_P = tl.constexpr(sm.F_TOP_P)
F_PRESENCE = tl.constexpr(sm.F_PRESENCE)
F_FREQUENCY = tl.constexpr(sm.F_FREQUENCY)
F_REPETITION = tl.constexpr(sm.F_REPETITION)
F_INV_TEMPERATURE = tl.constexpr(sm.F_INV_TEMPERATURE)
F_LOG_MIN_P = tl.constexpr(sm.F_LOG_MIN_P)
F_TEMPERATURE = tl.constexpr(sm.F_TEMPERATURE)
I_TOP_K = tl.constexpr(sm.I_TOP_K)
I_MIN_TOKENS = tl.constexpr(sm.I_MIN_TOKENS)
I_LOGPROBS = tl.constexpr(sm.I_LOGPROBS)
I_SEED_KEY = tl.constexpr(sm.I_SEED_KEY)
I_NUM_BIAS = tl.constexpr(sm.I_NUM_BIAS)
I_NUM_BAN = tl.constexpr(sm.I_NUM_BAN)
I_MASKED = tl.constexpr(sm.I_MASKED)
NO_LIMIT = tl.constexpr(2 ** 31 - 1)  # top_k off
NUM_PROBES = tl.constexpr(8)
TOP_LOGPROBS = tl.constexpr(32)  # raw top-k buffer: MAX_LOGPROBS (20) rounded up to a power of two
TABLE_BLOCK = tl.constexpr(16)   # bias / ban entries per vector step
# race keys kept beside the winner for top_p / min_p rows: when the winner is not kept, the best of these that is
# is the answer (the race over the kept set is its best key), found with one probe pass instead of a search.
# Session 12 on the H200 (batch 1,024): top_p 0.9 0.92 / 0.84 -> 0.65 / 0.65 ms (flat / peaked); session 14's
# interleaved A/B: without them 0.94, with 0.62-0.69 (BENCHMARKS). The filter variant's registers: 168 -> 218 a
# thread (two 4-warp programs an SM either way; capping them at 168 or 128 measured no better, session 14).
RUNNERS = tl.constexpr(4)
# logprobs rows' raw top-k read off each lane's two largest raw logits at the end of the stats pass
# (``_raw_top_k``), where ``_top_insert`` took a block-wide argmax every chunk (and a loop where a chunk had new
# top values). Exact: the same k ids and values. Session 18 on the H200 (interleaved A/B, logprobs 5): batch 1
# 0.19-0.28 -> 0.17-0.21 ms in both rounds; batch 1,024 0.52-0.64 against 0.59-0.63, no difference that repeated.
# (A min_p race over the floor under the running maximum, the same session, measured no better: not kept.)
LOGPROBS_LANE_BAND = tl.constexpr(True)
# Session 18's candidates, on since session 19's interleaved A/B on the H200 (all six together against none, the
# device's time, ms at batch 1 / 1,024, both rounds: top_p 0.9 0.12 / 0.57 -> 0.093-0.096 / 0.52-0.53, min_p 0.05
# 0.087 / 0.505 -> 0.072 / 0.48, logprobs 5 0.105 / 0.52 -> 0.064 / 0.37, top_k 50 0.041 / 0.31 -> 0.034 / 0.30;
# BENCHMARKS, "Session 19"). Exact either way (tests/sampling_check.py):
# LAZY_MOMENTS: the filter rows' stats pass keeps no sum, sum of squares and minimum (24 registers a thread and ~5
# instructions a value in a variant at ~250 registers); a row whose threshold search needs them (the Gaussian
# guess of its first probes: top_p rows whose runners all fall outside, top_k rows past the lane band) gets them
# from a pass of its own, the same sums in the same order.
LAZY_MOMENTS = tl.constexpr(True)
# ONE_LOAD: logprobs rows of variants without a processed row read each value once (the scaled value and the raw
# logit are the same load there), where the stats pass loaded it twice.
ONE_LOAD = tl.constexpr(True)
# BAND_VARIANTS: the lane band (the stats pass's second and third values a lane, for top_k rows) compiled only
# into the filter variants of steps with top_k rows: a top_p / min_p step's variant keeps no band state (with
# LAZY_MOMENTS: 243 -> 168 registers a thread, three 4-warp programs an SM instead of two; ptxas for sm_90a).
# Four more variants to compile at warm-up. A host-side switch: off, the band is in every filter variant.
BAND_VARIANTS = True
# FIXED_SUMS: every sum across a block's lanes that decides a token or a logprob (the probes' masses, Z, the band's
# prefix masses, the log-sum-exp) and the moments that place the first probes, summed as int64 fixed point (a
# mass, at most 1 a value relative to the row's maximum, in units of 2^-40): a lane's own running sum is the same
# whatever the program's shape (it holds the same positions of the same chunks, in order), and integer sums are
# the same in any order, so a row's token no longer depends on the warps a program has. What lets filtered rows
# of small steps run in a wide program (FILTER_WIDE) and stay batch-invariant.
FIXED_SUMS = tl.constexpr(True)
FIXED_UNIT = tl.constexpr(2.0 ** 40)
# FILTER_WIDE (with FIXED_SUMS): steps of at most FEW_FILTERED rows run the filter and logprobs variants in one
# 16-warp program an SM (same block, same band: the same arithmetic a row), where a 4-warp program streams a
# row's chunks one after another on one SM (batch 1 on the H200, the device's time: top_p 0.9 0.12 ms, logprobs 5
# 0.106; session 18). A host-side switch.
FILTER_WIDE = True
FEW_FILTERED = 16
# RUNNER_MASSES: the top_p rows' runners' probe pass sums masses only (no count a probe: top_p alone never reads
# one); the count above lo the rare search starts from is n_fin without min_p, else a pass of its own.
RUNNER_MASSES = tl.constexpr(True)
# Session 19's second A/B on the H200 (all three together against none, the device's time, ms at batch 1 / 1,024,
# both rounds: top_p 0.9 0.09 / 0.545 -> 0.078 / 0.433, min_p 0.05 0.07 / 0.487 -> 0.066 / 0.435, logprobs 5 0.062 /
# 0.37 -> 0.06 / 0.32, T=1 0.174 -> 0.147 at 1,024; BENCHMARKS, "Session 19"), the same tokens either way:
# FAST_EXP: e^x as ex2.approx.ftz (inline PTX) of x * log2(e), where tl.exp's ex2.approx adds a fix-up for results
# below 2^-126 (three instructions a value: the same bits above 2^-126, 0 below, where a mass is far under the
# 2^-40 FIXED_SUMS keeps); the probe pass also drops its test for -inf values (e^-inf is 0) and adds a mass as
# a 0/1 multiply-add (~33 -> ~25 instructions a value in the runners' probe pass, with WIDE_RUNNER_PROBE; SASS for
# sm_90a). tl.exp under the interpreter.
FAST_EXP = tl.constexpr(True)
# CHEAP_SKIP: the race's skip test v < e^(s - best) * 1.001 as h < 2^32 * 1.002 * e^(s - best), h the value's 32-bit
# hash (v = (h + 0.5) / 2^32): no uniform a value and the slack's multiply in the exponent (~39 -> ~32
# instructions a value in the stats pass). Never stricter than the old test (1.002 covers the rounding), so no
# chunk that could change the race is skipped: the same tokens.
CHEAP_SKIP = tl.constexpr(True)
SKIP_EXPONENT = tl.constexpr(32.0 + math.log2(1.002))
# WIDE_RUNNER_PROBE (with RUNNER_MASSES): the top_p rows' runners' probe pass over a whole block a chunk (its
# [RUNNERS, BLOCK] masses: 32 registers a thread) where passes with counts take half: half the loop's barriers and
# address arithmetic a value. Its lane sums are of other values than before (the same token but where top_p * Z
# falls within rounding of a runner's mass; FIXED_SUMS keeps them batch-invariant).
WIDE_RUNNER_PROBE = tl.constexpr(True)
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
LOG2E = tl.constexpr(1.4426950408889634)
# The lane band (top_k rows): the stats pass keeps each lane's two largest values and the largest of the lanes'
# third ones, b3: every value above b3 is among those candidates, so when at least k of them are, the band is
# written from registers and the row is done in one pass and a sort, where the search took a probe pass and a
# compact pass. Exact either way: too few candidates above b3 (large k) falls back to the search. Session 14 on
# the H200: top_k 50 0.71 -> 0.38-0.53 ms at batch 1,024, 0.20 -> 0.10 at batch 1 (BENCHMARKS).
# Processed rows (penalties, bias, a ban, a grammar mask) with no filters or logprobs in one pass with no scratch
# row (``_processed_exact_token``): the scratch-row path reads the row, the counts and the prompt mask, writes the
# row, and reads it again (~1.1 MB a row at vocabulary 65,536: penalties + logit_bias 0.55 ms at batch 1,024,
# session 14). Costs the exact processed variant registers: 115 -> 160 a thread (4 -> 3 programs an SM; ptxas for
# sm_90a). On until the H200 says otherwise (.gpu/c.sh times it off)
PROCESSED_ONE_PASS = tl.constexpr(True)
# The per-id half of the race's hash read from a table of the vocabulary (256 KB at 65,536: it stays in L2)
# instead of computed for every value of every row (two multiplies, three shifts and xors each). On until the H200
# says otherwise (.gpu/c.sh times it off)
VOCAB_TABLE = tl.constexpr(True)
# chunks in flight per streaming loop (cp.async into shared memory): one 8 KB chunk per SM would leave HBM
# latency-bound at a few TB/s
STAGES = tl.constexpr(3)
FEW_ROWS = 256  # up to this many rows an exact variant runs the wide shape (``config_for``)
SPLIT_ROWS = 16  # up to this many rows a plain exact step runs the split race
# and a step with processed rows (penalties, bias, a ban, a grammar mask) too, each program processing its own
# segment first: penalties + logit_bias at batch 1 took 0.114 ms in the wide shape (two passes on one SM;
# session 14). On until the H200 says otherwise (.gpu/c.sh times it off)
SPLIT_PREPARED = True
WARM_UP_THREADS = min(8, os.cpu_count() or 1)  # warm_up's compiles at once (each mostly one core)
NONE_YET = tl.constexpr(-(2 ** 63))  # the split race's empty slot (below every packed key)


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
def config_for(vocab_size: int, rows: int = 0, exact: bool = False, plain: bool = False) -> KernelConfig:
    """The launch shape for a step of ``rows`` rows. ``exact``: the variant has no filters and no logprobs, so
    each row's token is the race's winner or the argmax, the same however the row is chunked and summed: only
    those may switch shape with the batch's size (few rows: one wide program an SM each, lower latency a row;
    very few: each row split over several programs, ``plain`` — no processed row — or with ``SPLIT_PREPARED``).
    Every other variant has one block and band per vocabulary size, so its rows never depend on their batch (with
    FIXED_SUMS and FILTER_WIDE its small steps take more warps a program: the same sums)."""
    small_vocab = vocab_size <= 8192
    if exact and (plain or SPLIT_PREPARED) and 0 < rows <= (2 if small_vocab else SPLIT_ROWS):
        # one row on one SM waits on its 32 chunks one after another: over many SMs each program has a chunk or
        # two (session 12 on the H200, T=1 at batch 1: 0.156 -> 0.092 ms)
        return KernelConfig(block=256, cap=64, num_warps=4, segments=4) if small_vocab else \
            KernelConfig(block=1024, cap=1024, num_warps=4, segments=32)
    if exact and 0 < rows <= (4 if small_vocab else FEW_ROWS):
        # the wide shape measured before session 11 at batch 1: T=1 0.10-0.12 ms against 0.16 for the small one
        return KernelConfig(block=512, cap=64, num_warps=8, programs_per_sm=1) if small_vocab else \
            KernelConfig(block=2048, cap=1024, num_warps=16, programs_per_sm=1)
    if not exact and FILTER_WIDE and FIXED_SUMS.value and 0 < rows <= FEW_FILTERED:
        # the filter and logprobs variants' small steps: the small shape's block and band in one wide program an
        # SM (the same arithmetic a row: FIXED_SUMS)
        return KernelConfig(block=256, cap=64, num_warps=8, programs_per_sm=1) if small_vocab else \
            KernelConfig(block=1024, cap=1024, num_warps=16, programs_per_sm=1)
    if small_vocab:  # tests and small models: several chunks and a small band, to exercise both
        return KernelConfig(block=256, cap=64, num_warps=4)
    # small programs, 8 an SM: a row's chunk loop waits on its loads and barriers, and programs that wait
    # independently hide each other's waits (session 11 on the H200, against block 2,048 / 16 warps / 1 an SM:
    # T=1 0.36 -> 0.31 ms, top_p 0.9 1.02 -> 0.88, top_k 50 0.95 -> 0.72, logprobs 0.79 -> 0.51 at batch 1,024);
    # cap 1,024 keeps the band's sort a few microseconds. The filter and logprobs variants keep it too: with 8 or
    # 16 warps a program (one an SM) they took top_p 0.9 at batch 1,024 from 0.65-0.80 to 0.90-1.09 ms and
    # logprobs 5 from 0.55-0.58 to 0.78-1.04 (session 17 on the H200, BENCHMARKS)
    return KernelConfig(block=1024, cap=1024, num_warps=4, programs_per_sm=8)


# ----------------------------------------------------------------------------------- noise

@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MUL1
    x = x ^ (x >> 15)
    x = x * MUL2
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed_key, counter):
    """engine.sampler.counter_hash's per-row part, in uint32 arithmetic."""
    return _mix32(seed_key.to(tl.uint32) ^ _mix32(counter.to(tl.uint32) + COUNTER_SALT))


@triton.jit
def _vocab_hash(ids):
    """engine.sampler.vocab_keys: the per-id part of the hash, the same for every row."""
    return _mix32((ids.to(tl.uint32) * GOLDEN) ^ VOCAB_SALT)


@triton.jit
def _element_hash(row_key, ids):
    return _mix32(row_key ^ _vocab_hash(ids))


@triton.jit
def _load_row(ptr, offs, V, other):
    """``ptr[offs]`` where ``offs < V``, else ``other``. (Without the mask where V is a multiple of the chunk:
    top_p 0.433 -> 0.415 ms at batch 1,024 but T=1 0.147 -> 0.183 and logprobs 0.32 -> 0.40, from the
    registers it took; session 19 on the H200. Not kept.)"""
    return tl.load(ptr + offs, mask=offs < V, other=other)


@triton.jit
def _chunk_vocab_keys(vkeys, offs, V):
    """The per-id hashes of a chunk: read from the vocabulary's table with VOCAB_TABLE (one 4-byte load a value
    from L2, for two multiplies and three shifts), else computed."""
    if VOCAB_TABLE:
        return _load_row(vkeys, offs, V, 0).to(tl.uint32, bitcast=True)
    else:
        return _vocab_hash(offs)


@triton.jit
def _uniform(h):
    """v = (h + 0.5) / 2**32 in (0, 1), as engine.sampler.exponential_noise rounds it."""
    return tl.minimum((h.to(tl.float32) + 0.5) * 2.3283064365386963e-10, V_MAX)


@triton.jit
def _exp2(x):
    """2^x: with FAST_EXP on the GPU ex2.approx.ftz (results below 2^-126 flushed to 0), else tl.exp2."""
    if FAST_EXP and not INTERPRETED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _exp(x):
    """e^x: tl.exp's bits (x * log2(e), then ex2.approx) without its fix-up below 2^-126 with FAST_EXP."""
    if FAST_EXP and not INTERPRETED:
        return _exp2(x * LOG2E)
    else:
        return tl.exp(x)


@triton.jit
def _may_beat(h, s, best_key):
    """Whether a value of hash ``h`` (noise v = (h + 0.5) / 2^32) and value ``s`` may beat ``best_key``: its E
    >= v must be < e^(s - best_key), tested as v < e^(s - best) * 1.001 (0.1% to spare for rounding) or, with
    CHEAP_SKIP, h < 2^32 * 1.002 * e^(s - best) (never stricter)."""
    if CHEAP_SKIP:
        return h.to(tl.float32) < _exp2((s - best_key) * LOG2E + SKIP_EXPONENT)
    else:
        return _uniform(h) < _exp(s - best_key) * 1.001


@triton.jit
def _neg_log_noise(v):
    """-log E with E = -log1p(-v); log1p by Goldberg's u = 1 - v trick (no libdevice under the
    interpreter), exact to a few ulps."""
    u = 1.0 - v
    e = tl.where(u == 1.0, v, v * (tl.log(u) / (u - 1.0)))
    return -tl.log(e)


@triton.jit
def _race_chunk(s, start, keep, row_key, vk, best_key, best_id):
    """Fold the chunk at ``start`` into the running race: argmax of s - log E over ``keep``, ties to the
    lower id. A value beats best_key only if E < e^(s - best_key), and E >= v: a chunk where no v passes
    that (0.1% to spare for rounding) cannot change the race and skips the two logs a value (after the
    first few chunks most do). ``vk``: the chunk's per-id hashes (``_chunk_vocab_keys``)."""
    h = _mix32(row_key ^ vk)
    if tl.sum((keep & _may_beat(h, s, best_key)).to(tl.int32), 0) > 0:
        key = tl.where(keep, s + _neg_log_noise(_uniform(h)), float("-inf"))
        c_key, c_pos = tl.max(key, 0, return_indices=True, return_indices_tie_break_left=True)
        better = c_key > best_key
        best_key = tl.where(better, c_key, best_key)
        best_id = tl.where(better, start + c_pos, best_id)
    return best_key, best_id


@triton.jit
def _race_chunk_runners(s, start, keep, row_key, vk, c_key, c_id):
    """``_race_chunk`` keeping the RUNNERS best keys (unsorted; order: key, then the lower id): a chunk is
    skipped when no value can beat the lowest of them."""
    h = _mix32(row_key ^ vk)
    if tl.sum((keep & _may_beat(h, s, tl.min(c_key, 0))).to(tl.int32), 0) > 0:
        c_key, c_id = _top_insert(tl.where(keep, s + _neg_log_noise(_uniform(h)), float("-inf")), start, c_key,
                                  c_id)
    return c_key, c_id


@triton.jit
def _best_ranked(c_key, c_id, ok):
    """The id of the best key among ``ok`` entries (ties: the lower id), -1 when none is."""
    best = tl.max(tl.where(ok, c_key, float("-inf")), 0)
    token = tl.min(tl.where(ok & (c_key == best), c_id, 2 ** 31 - 1), 0)
    return tl.where(best > float("-inf"), token, -1)


@triton.jit
def _hash_kernel(keys, counters, out_h, out_noise, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _element_hash(_row_key(tl.load(keys + row), tl.load(counters + row)), offs)
    tl.store(out_h + row * V + offs, h.to(tl.int64), mask=offs < V)
    tl.store(out_noise + row * V + offs, -_neg_log_noise(_uniform(h)), mask=offs < V)


def counter_hash_rows(keys: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """The kernel's hash [B, V] (int64) and log E [B, V] for seed keys and counters [B]."""
    b = keys.shape[0]
    h = torch.empty(b, vocab_size, dtype=torch.int64, device=keys.device)
    log_e = torch.empty(b, vocab_size, dtype=torch.float32, device=keys.device)
    _hash_kernel[(b, triton.cdiv(vocab_size, 256))](keys, counters, h, log_e, vocab_size, BLOCK=256)
    return h, log_e


def counter_hash_rows_ref(keys: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, ...]:
    vocab = sm.vocab_keys(vocab_size, keys.device)
    return sm.counter_hash(keys, counters, vocab), torch.log(sm.exponential_noise(keys, counters, vocab))


# ------------------------------------------------------------------------------ row passes

@triton.jit
def _load_scaled(src, offs, V, scale):
    return _load_row(src, offs, V, float("-inf")) * scale


@triton.jit
def _penalize(y, counts, in_prompt, mask, rep, freq, pres):
    """Repetition, frequency and presence penalties, as engine.sampler._apply_penalties."""
    c = tl.load(counts, mask=mask, other=0)
    seen_out = c > 0
    seen = seen_out | (tl.load(in_prompt, mask=mask, other=0) != 0)
    y = tl.where(seen, tl.where(y > 0, tl.math.div_rn(y, rep), y * rep), y)
    y = y - freq * c.to(tl.float32)
    return y - pres * seen_out.to(tl.float32)


@triton.jit
def _grammar_allows(y, mask_row, ids, valid):
    """-inf where the row's grammar bitmask (int32 words, bit j of word i: token 32 i + j) has a 0."""
    w = tl.load(mask_row + (ids >> 5), mask=valid, other=0)
    return tl.where(((w >> (ids & 31)) & 1) != 0, y, float("-inf"))


@triton.jit
def _penalize_and_mask(y, ids, valid, pen, counts, in_prompt, rep, freq, pres, masked, mask_row):
    """The dense stages on values ``y`` of tokens ``ids``: penalties, then the grammar's mask."""
    if pen:
        y = _penalize(y, counts + ids, in_prompt + ids, valid, rep, freq, pres)
    if masked:
        y = _grammar_allows(y, mask_row, ids, valid)
    return y


@triton.jit
def _row_processing(fp, ip, counter, has_penalty_state, has_masks):
    """A row's processing: 1 / temperature, its penalties (and whether any applies: the slot's counts are kept),
    its bias entries, its ban entries (while under min_tokens) and whether its grammar masks it."""
    inv_t = tl.load(fp + F_INV_TEMPERATURE)
    rep = tl.load(fp + F_REPETITION)
    freq = tl.load(fp + F_FREQUENCY)
    pres = tl.load(fp + F_PRESENCE)
    pen = (has_penalty_state != 0) & ((rep != 1.0) | (freq != 0.0) | (pres != 0.0))
    n_bias = tl.load(ip + I_NUM_BIAS).to(tl.int32)
    n_ban = tl.where(counter < tl.load(ip + I_MIN_TOKENS), tl.load(ip + I_NUM_BAN), 0).to(tl.int32)
    masked = (has_masks != 0) & (tl.load(ip + I_MASKED) != 0)
    return inv_t, rep, freq, pres, pen, n_bias, n_ban, masked


@triton.jit
def _biased(x_row, ids, vals, ok, inv_t, pen, rep, freq, pres, counts, in_prompt, masked, mask_row):
    """Bias entries' processed values (``ids``, ``vals`` where ``ok``): recomputed from their raw logits, then the
    dense stages, times 1 / temperature."""
    y = tl.load(x_row + ids, mask=ok, other=0.0) + vals
    return _penalize_and_mask(y, ids, ok, pen, counts, in_prompt, rep, freq, pres, masked, mask_row) * inv_t


@triton.jit
def _prepare_row(x_row, lo, hi, dst, inv_t, pen, rep, freq, pres, counts, in_prompt,
                 bias_ids, bias_vals, n_bias, ban_ids, n_ban, masked, mask_row, BLOCK: tl.constexpr):
    """Steps 1-3 times 1 / temperature into ``dst``, for ids in [lo, hi) (a whole row, or the split race's
    segment): dense penalties and the grammar's mask, then the sparse bias entries recomputed from their raw
    logits (masked again), then the ban (-inf) over everything."""
    tl.debug_barrier()  # the previous row's readers are done with dst
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        y = tl.load(x_row + offs, mask=offs < hi, other=float("-inf"))
        y = _penalize_and_mask(y, offs, offs < hi, pen, counts, in_prompt, rep, freq, pres, masked, mask_row)
        tl.store(dst + offs, y * inv_t, mask=offs < hi)
    tl.debug_barrier()
    for j0 in range(0, n_bias, TABLE_BLOCK):
        j = j0 + tl.arange(0, TABLE_BLOCK)
        ids = tl.load(bias_ids + j, mask=j < n_bias, other=-1)
        ok = (ids >= lo) & (ids < hi)
        y = _biased(x_row, ids, tl.load(bias_vals + j, mask=ok, other=0.0), ok, inv_t, pen, rep, freq, pres, counts,
                    in_prompt, masked, mask_row)
        tl.store(dst + ids, y, mask=ok)
    tl.debug_barrier()
    for j0 in range(0, n_ban, TABLE_BLOCK):
        j = j0 + tl.arange(0, TABLE_BLOCK)
        ids = tl.load(ban_ids + j, mask=j < n_ban, other=-1)
        tl.store(dst + ids, tl.full([TABLE_BLOCK], float("-inf"), tl.float32), mask=(ids >= lo) & (ids < hi))
    tl.debug_barrier()


@triton.jit
def _top_insert(x, start, top_v, top_i):
    """Move the chunk's values above the running k-th best into the unsorted top buffer, largest first
    (slots past k hold +inf, never the minimum; later ids rank below equal values, so only a larger one gets
    in). A value must beat the best k seen so far: after the first chunk about k / (chunks so far) of them do,
    so the loop runs ~3k times a row in all. Also the race's runners-up, over its keys."""
    slot_ids = tl.arange(0, top_v.shape[0])
    lanes = tl.arange(0, x.shape[0])
    theta = tl.min(top_v, 0)
    v, pos = tl.max(tl.where(x > theta, x, float("-inf")), 0, return_indices=True,
                    return_indices_tie_break_left=True)
    while v > theta:
        # replace the minimum; among equal minima the highest id (lower ids first, as the first maximum)
        slot = tl.argmax(tl.where(top_v == theta, top_i, -1), 0)
        top_v = tl.where(slot_ids == slot, v, top_v)
        top_i = tl.where(slot_ids == slot, start + pos, top_i)
        x = tl.where(lanes == pos, float("-inf"), x)
        theta = tl.min(top_v, 0)
        v, pos = tl.max(tl.where(x > theta, x, float("-inf")), 0, return_indices=True,
                        return_indices_tie_break_left=True)
    return top_v, top_i


@triton.jit
def _raw_lse_chunk(x, m, z):
    """Lane-wise online log-sum-exp (one exp a value): running max ``m`` and sum ``z`` of e^(x - m)."""
    d = tl.where(x == float("-inf"), 0.0, _exp(-tl.abs(x - m)))
    z = tl.where(x > m, z * d + 1.0, z + d)
    return tl.maximum(m, x), z


@triton.jit
def _stats_pass(src, scale, x_row, V, row_key, vkeys, do_race, lp_k, want_band, band_v, band_i,
                LOGPROBS: tl.constexpr, FILTER: tl.constexpr, BAND: tl.constexpr, RAW_IS_SRC: tl.constexpr,
                CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Max and greedy argmax, finite count / mean / std / min, the race over all (``do_race``; with
    FILTER its RUNNERS best keys too), the raw log-sum-exp and top-``lp_k`` raw logits (``lp_k >= 0``),
    and with FILTER, BAND and ``want_band`` the band of every value above b3 (``_lane_band``; its size, -1 when
    not written). Accumulated lane by lane and reduced once: a reduction inside the loop is a block-wide
    barrier per chunk (only the race's skip test has one). ``RAW_IS_SRC``: ``src`` is ``x_row`` (no processed
    row in this variant). With LAZY_MOMENTS, mean / std / min are placeholders (``_moments`` has them)."""
    lanes = tl.arange(0, BLOCK)
    m_l = tl.full([BLOCK], float("-inf"), tl.float32)
    arg_l = tl.zeros([BLOCK], tl.int32)
    n_l = tl.zeros([BLOCK], tl.int32)
    s1_l = tl.zeros([BLOCK], tl.float32)
    s2_l = tl.zeros([BLOCK], tl.float32)
    min_l = tl.full([BLOCK], float("inf"), tl.float32)
    mr_l = tl.full([BLOCK], float("-inf"), tl.float32)
    zr_l = tl.zeros([BLOCK], tl.float32)
    w_key = float("-inf")
    w_id = 0
    c_key = tl.full([RUNNERS], float("-inf"), tl.float32)
    c_id = tl.zeros([RUNNERS], tl.int32)
    top_v = tl.where(tl.arange(0, TOP_LOGPROBS) < lp_k, float("-inf"), float("inf"))
    top_i = tl.zeros([TOP_LOGPROBS], tl.int32)
    sec_l = tl.full([BLOCK], float("-inf"), tl.float32)  # FILTER: each lane's second value, its id, the third
    sec_i = tl.zeros([BLOCK], tl.int32)
    third_l = tl.full([BLOCK], float("-inf"), tl.float32)
    rarg_l = tl.zeros([BLOCK], tl.int32)  # LOGPROBS_LANE_BAND: each lane's raw maximum's id, second, third
    rsec_l = tl.full([BLOCK], float("-inf"), tl.float32)
    rsec_i = tl.zeros([BLOCK], tl.int32)
    rthird_l = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        if ONE_LOAD and RAW_IS_SRC and LOGPROBS:
            raw = _load_row(src, start + lanes, V, float("-inf"))
            s = raw * scale  # what _load_scaled computes
        else:
            s = _load_scaled(src, start + lanes, V, scale)
        if FILTER and BAND:
            if want_band:
                sec_l, sec_i, third_l = _lane_second(s, start + lanes, m_l, arg_l, sec_l, sec_i, third_l)
        arg_l = tl.where(s > m_l, start + lanes, arg_l)  # a lane keeps its first maximum
        m_l = tl.maximum(m_l, s)
        fin = s > float("-inf")
        n_l += fin.to(tl.int32)
        if not LAZY_MOMENTS:
            s1_l, s2_l, min_l = _moments_chunk(s, fin, s1_l, s2_l, min_l)
        if do_race:
            if FILTER:
                c_key, c_id = _race_chunk_runners(s, start, fin, row_key, _chunk_vocab_keys(vkeys, start + lanes, V),
                                                  c_key, c_id)
            else:
                w_key, w_id = _race_chunk(s, start, fin, row_key, _chunk_vocab_keys(vkeys, start + lanes, V), w_key,
                                          w_id)
        if LOGPROBS and lp_k >= 0:
            if ONE_LOAD and RAW_IS_SRC:
                x = raw
            else:
                x = _load_row(x_row, start + lanes, V, float("-inf"))
            if lp_k > 0:
                if LOGPROBS_LANE_BAND:  # lane by lane, no reduction: the top-k is read off the lanes at the end
                    rsec_l, rsec_i, rthird_l = _lane_second(x, start + lanes, mr_l, rarg_l, rsec_l, rsec_i, rthird_l)
                    rarg_l = tl.where(x > mr_l, start + lanes, rarg_l)
                else:
                    top_v, top_i = _top_insert(x, start, top_v, top_i)
            mr_l, zr_l = _raw_lse_chunk(x, mr_l, zr_l)
    m = tl.max(m_l, 0)
    n_fin = tl.sum(n_l, 0)
    mean, std, s_min = _moments_of(n_fin, s1_l, s2_l, min_l)
    if LOGPROBS and LOGPROBS_LANE_BAND:
        if lp_k > 0:
            top_v, top_i = _raw_top_k(x_row, V, mr_l, rarg_l, rsec_l, rsec_i, rthird_l, lp_k, BLOCK)
    m_raw = tl.max(mr_l, 0)
    z_raw = _mass_sum(tl.where(mr_l > float("-inf"), zr_l * _exp(mr_l - m_raw), 0.0), 0)
    arg = tl.min(tl.where(m_l == m, arg_l, 2 ** 31 - 1), 0)
    if FILTER:  # the winner is the best of the runners (0 when nothing was finite, as above)
        w_id = tl.maximum(_best_ranked(c_key, c_id, c_key > float("-inf")), 0)
    b3 = float("inf")
    nb = -1
    if FILTER and BAND:
        if want_band:
            b3, nb = _lane_band(m_l, arg_l, sec_l, sec_i, third_l, band_v, band_i, CAP)
    return (m, arg, n_fin, mean, std, s_min, w_id, m_raw + tl.log(z_raw), top_v, top_i, c_key, c_id, b3, nb)


@triton.jit
def _mass_sum(x, axis: tl.constexpr):
    """The sum of masses ``x`` (each >= 0 and at most a few thousand) along ``axis``: with FIXED_SUMS, each rounded
    down to 2^-40 and summed as int64, the same in any order and any layout."""
    if FIXED_SUMS:
        return tl.sum((x * FIXED_UNIT).to(tl.int64), axis).to(tl.float32) * (1.0 / FIXED_UNIT)
    else:
        return tl.sum(x, axis)


@triton.jit
def _mass_prefix(e):
    """Each mass's exclusive prefix sum (what comes before it), as ``_mass_sum`` sums."""
    if FIXED_SUMS:
        fixed = (e * FIXED_UNIT).to(tl.int64)
        return (tl.cumsum(fixed, 0) - fixed).to(tl.float32) * (1.0 / FIXED_UNIT)
    else:
        return tl.cumsum(e, 0) - e


@triton.jit
def _moment_sum(x, unit):
    """The sum of lane moments ``x`` (only the first probes' guess reads it): with FIXED_SUMS in units of 1 / unit,
    clamped to +-2^50, so that the guess too is the same in any layout."""
    if FIXED_SUMS:
        return tl.sum(tl.minimum(tl.maximum(x * unit, -1.0e15), 1.0e15).to(tl.int64), 0).to(tl.float32) / unit
    else:
        return tl.sum(x, 0)


@triton.jit
def _moments_chunk(s, fin, s1_l, s2_l, min_l):
    """A chunk's finite values into the lanes' sums, sums of squares and minima."""
    s1_l += tl.where(fin, s, 0.0)
    s2_l += tl.where(fin, s * s, 0.0)
    min_l = tl.minimum(min_l, tl.where(fin, s, float("inf")))
    return s1_l, s2_l, min_l


@triton.jit
def _moments_of(n_fin, s1_l, s2_l, min_l):
    """Mean, standard deviation and minimum of the finite values from the lanes' accumulators."""
    mean = _moment_sum(s1_l, 4096.0) / tl.maximum(n_fin, 1)
    std = tl.sqrt(tl.maximum(_moment_sum(s2_l, 16.0) / tl.maximum(n_fin, 1) - mean * mean, 0.0))
    return mean, std, tl.min(min_l, 0)


@triton.jit
def _moments(src, scale, V, n_fin, BLOCK: tl.constexpr):
    """LAZY_MOMENTS: the stats pass's mean, std and minimum from a pass of their own (same lanes, same order)."""
    lanes = tl.arange(0, BLOCK)
    s1_l = tl.zeros([BLOCK], tl.float32)
    s2_l = tl.zeros([BLOCK], tl.float32)
    min_l = tl.full([BLOCK], float("inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        s = _load_scaled(src, start + lanes, V, scale)
        s1_l, s2_l, min_l = _moments_chunk(s, s > float("-inf"), s1_l, s2_l, min_l)
    return _moments_of(n_fin, s1_l, s2_l, min_l)


@triton.jit
def _lane_second(s, ids, m_l, arg_l, sec_l, sec_i, third_l):
    """Before the lane's maximum takes ``s``: its second value (and id) and its third, so that every value
    a lane has seen is its maximum, its second, or at most its third."""
    above_max = s > m_l
    above_sec = s > sec_l  # implied by above_max
    third_l = tl.where(above_sec, sec_l, tl.maximum(third_l, s))
    sec_i = tl.where(above_max, arg_l, tl.where(above_sec, ids, sec_i))
    sec_l = tl.where(above_max, m_l, tl.where(above_sec, s, sec_l))
    return sec_l, sec_i, third_l


@triton.jit
def _raw_top_k(x_row, V, m_l, arg_l, sec_l, sec_i, third_l, k, BLOCK: tl.constexpr):
    """The k largest raw logits (ties: the lower id) in ``_top_insert``'s buffers, from each lane's largest two
    values: every value above b3, the largest of the lanes' third ones, is one of those, so when k are above it
    the k largest are (and so are their ties). Else (fewer than k finite values, wide ties) ``_top_insert``'s
    pass over the row."""
    j = tl.arange(0, TOP_LOGPROBS)
    top_v = tl.where(j < k, float("-inf"), float("inf"))
    top_i = tl.zeros([TOP_LOGPROBS], tl.int32)
    b3 = tl.max(third_l, 0)
    key_m = tl.where(m_l > b3, _packed(m_l, arg_l), NONE_YET)
    key_s = tl.where(sec_l > b3, _packed(sec_l, sec_i), NONE_YET)
    if tl.sum((m_l > b3).to(tl.int32), 0) + tl.sum((sec_l > b3).to(tl.int32), 0) >= k:
        for t in range(0, k):  # the largest left, k times (ids are distinct: so are the keys)
            best = tl.maximum(tl.max(key_m, 0), tl.max(key_s, 0))
            key_m = tl.where(key_m == best, NONE_YET, key_m)
            key_s = tl.where(key_s == best, NONE_YET, key_s)
            top_v = tl.where(j == t, _from_ordered((best >> 32).to(tl.int32)), top_v)
            top_i = tl.where(j == t, 2147483647 - (best & 0xFFFFFFFF).to(tl.int32), top_i)
    else:
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            x = _load_row(x_row, start + tl.arange(0, BLOCK), V, float("-inf"))
            top_v, top_i = _top_insert(x, start, top_v, top_i)
    return top_v, top_i


@triton.jit
def _lane_band(m_l, arg_l, sec_l, sec_i, third_l, band_v, band_i, CAP: tl.constexpr):
    """b3, the largest of the lanes' third values, and the band of every value above it (each is a lane's
    maximum or second: the rest are at most b3), written when it fits: its size, else -1."""
    b3 = tl.max(third_l, 0)
    in_max = m_l > b3
    in_sec = sec_l > b3
    n_max = tl.sum(in_max.to(tl.int32), 0)
    nb = n_max + tl.sum(in_sec.to(tl.int32), 0)
    if nb <= CAP:
        tl.debug_barrier()  # the band's previous readers are done
        pos = tl.cumsum(in_max.to(tl.int32), 0) - 1
        tl.store(band_v + pos, m_l, mask=in_max)
        tl.store(band_i + pos, arg_l, mask=in_max)
        pos = n_max + tl.cumsum(in_sec.to(tl.int32), 0) - 1
        tl.store(band_v + pos, sec_l, mask=in_sec)
        tl.store(band_i + pos, sec_i, mask=in_sec)
        tl.debug_barrier()
    else:
        nb = -1
    return b3, nb


# ------------------------------------------------------------------------ threshold search

@triton.jit
def _ordered(x):
    """float32 -> int32, monotone, equal floats (+0, -0) to equal ints."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, -(b & 0x7FFFFFFF), b)


@triton.jit
def _from_ordered(o):
    return tl.where(o < 0, (-o) | (-2147483648), o).to(tl.float32, bitcast=True)


@triton.jit
def _prev(x):
    """The largest float32 below x."""
    return _from_ordered(_ordered(x) - 1)


@triton.jit
def _probit(q):
    """Inverse normal CDF to ~5e-4 (Abramowitz & Stegun 26.2.23): only a first guess is made with it."""
    r = tl.minimum(tl.maximum(tl.minimum(q, 1.0 - q), 1e-12), 0.5)
    t = tl.sqrt(-2.0 * tl.log(r))
    x = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(q < 0.5, -x, x)


@triton.jit
def _gaussian_guess(mean, std, n_fin, k, top_p):
    """Where tau would lie were the values Gaussian: the k-th largest, and the point above which the softmax
    holds top_p (e^s-weighted Gaussian values are Gaussian again, the mean moved up by std^2)."""
    t_k = mean + std * _probit(1.0 - k.to(tl.float32) / tl.maximum(n_fin, 1).to(tl.float32))
    t_p = mean + std * std - std * _probit(top_p)
    guess = tl.where(k < n_fin, t_k, float("-inf"))
    return tl.where(top_p < 1.0, tl.maximum(guess, t_p), guess)


@triton.jit
def _interpolate(lo, hi, s_min, cl, ml, ch, mh, k, pz):
    """The count / mass crossing inside (lo, hi], linearly interpolated between the bracket's ends (an
    open lower end starts at the row's smallest finite value)."""
    base = tl.where(lo == float("-inf"), s_min, lo)
    fk = tl.where(cl >= k, (cl - k + 1).to(tl.float32) / tl.maximum(cl - ch, 1).to(tl.float32), 0.0)
    fp = tl.where(ml >= pz, (ml - pz) / tl.maximum(ml - mh, 1e-30), 0.0)
    return base + tl.minimum(tl.maximum(fk, fp), 1.0) * (hi - base)


@triton.jit
def _place_probes(lo, hi, s_min, guess, first):
    """Eight probe values strictly inside (lo, hi): four around the guess (±1/64, ±1/16 of the bracket),
    a quarter, half and three quarters across, and the middle of its float ordering (progress even in a
    bracket a few ulps wide). On the first pass probe 0 is lo itself: what min_p keeps, Z."""
    j = tl.arange(0, NUM_PROBES)
    base = tl.where(lo == float("-inf"), s_min, lo)
    w = hi - base
    d = w * 0.015625
    off = tl.where(j == 2, -4.0 * d, tl.where(j == 3, -d, tl.where(j == 4, d, 4.0 * d)))
    t = tl.where(j < 2, base + w * (0.25 + 0.5 * j), guess + off)
    t = tl.where(j == 6, base + 0.5 * w, t)
    olo = _ordered(lo).to(tl.int64)
    ohi = _ordered(hi).to(tl.int64)
    o = tl.where(j == 7, (olo + ohi) // 2, _ordered(t).to(tl.int64))
    o = tl.minimum(tl.maximum(o, olo + 1), ohi - 1)
    return tl.where(first & (j == 0), lo, _from_ordered(o.to(tl.int32)))


@triton.jit
def _probe_pass(src, scale, V, m, probes, BLOCK: tl.constexpr, COUNT: tl.constexpr = True):
    """#{s > t} and the mass sum(e^(s - m)) over s > t for each probe t: one read of the row, counted lane
    by lane ([probes, BLOCK / 2] accumulators: registers) and reduced once. Not COUNT: the counts are 0."""
    HALF: tl.constexpr = BLOCK // 2
    m_finite = tl.where(m > float("-inf"), m, 0.0)
    cnt = tl.zeros([probes.shape[0], HALF], tl.int32)
    mass = tl.zeros([probes.shape[0], HALF], tl.float32)
    for start in tl.range(0, V, HALF, num_stages=STAGES):
        s = _load_scaled(src, start + tl.arange(0, HALF), V, scale)
        if FAST_EXP:  # e^-inf is 0 (m is finite: a pass over a row with no finite value has no use for e)
            e = _exp(s - m_finite)
        else:
            e = tl.where(s > float("-inf"), tl.exp(s - m), 0.0)
        above = s[None, :] > probes[:, None]
        if COUNT:
            cnt += above.to(tl.int32)
        if FAST_EXP:  # 1.0 * e + mass is mass + e: a set and a fused multiply-add, where a select took two
            mass += above.to(tl.float32) * e[None, :]
        else:
            mass += tl.where(above, e[None, :], 0.0)
    return tl.sum(cnt, 1), _mass_sum(mass, 1)


@triton.jit
def _keeps(cnt, mass, k, pz):
    """Whether a value with ``cnt`` larger values of mass ``mass`` is kept (monotone in the value)."""
    return (cnt < k) & (mass < pz)


@triton.jit
def _narrow(probes, cnt, mass, kept, lo, hi, cl, ml, ch, mh):
    """lo up to the largest dropped probe, hi down to the smallest kept one, with their counts and masses
    (both fall as the value rises: the largest dropped probe has the smallest of the dropped ones)."""
    new_lo = tl.maximum(lo, tl.max(tl.where(kept, float("-inf"), probes), 0))
    new_hi = tl.minimum(hi, tl.min(tl.where(kept, probes, float("inf")), 0))
    cl = tl.min(tl.where(kept, cl, cnt), 0)
    ml = tl.min(tl.where(kept, ml, mass), 0)
    ch = tl.max(tl.where(kept, cnt, ch), 0)
    mh = tl.max(tl.where(kept, mass, mh), 0)
    return new_lo, new_hi, cl, ml, ch, mh


@triton.jit
def _span(lo, hi):
    return _ordered(hi).to(tl.int64) - _ordered(lo).to(tl.int64)


@triton.jit
def _search(src, scale, V, m, s_min, lo, hi, cl, ml, ch, mh, k, pz, guess, CAP: tl.constexpr,
            BLOCK: tl.constexpr):
    """Probe passes until at most CAP values lie in (lo, hi], or the bracket holds a single float. The first
    probes go around ``guess``, later ones around the interpolated crossing."""
    while (cl - ch > CAP) & (_span(lo, hi) > 1):
        probes = _place_probes(lo, hi, s_min, guess, False)
        cnt, mass = _probe_pass(src, scale, V, m, probes, BLOCK)
        lo, hi, cl, ml, ch, mh = _narrow(probes, cnt, mass, _keeps(cnt, mass, k, pz), lo, hi, cl, ml, ch, mh)
        guess = _interpolate(lo, hi, s_min, cl, ml, ch, mh, k, pz)
    return lo, hi, cl, ml, ch, mh


# ------------------------------------------------------------------------------- the band

@triton.jit
def _compact(src, scale, V, lo, hi, row_key, race_sure, band_v, band_i, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Copy the values in (lo, hi] and their ids to the band buffer (at most CAP) and, when ``race_sure``,
    race the values above hi (chunks with none skip the noise). A chunk costs a count (a block-wide
    reduction), and a scan where it has band values."""
    tl.debug_barrier()  # the band's previous readers are done
    nb = 0
    w_key = float("-inf")
    w_id = 0
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        s = _load_scaled(src, offs, V, scale)
        inside = (s > lo) & (s <= hi)
        n = tl.sum(inside.to(tl.int32), 0)
        if n > 0:
            pos = nb + tl.cumsum(inside.to(tl.int32), 0) - 1
            tl.store(band_v + pos, s, mask=inside & (pos < CAP))
            tl.store(band_i + pos, offs, mask=inside & (pos < CAP))
            nb += n
        if race_sure:
            w_key, w_id = _race_chunk(s, start, s > hi, row_key, _vocab_hash(offs), w_key, w_id)
    tl.debug_barrier()
    return tl.minimum(nb, CAP), w_key, w_id


@triton.jit
def _band_sorted(band_v, nb, m, CAP: tl.constexpr):
    j = tl.arange(0, CAP)
    v = tl.sort(tl.load(band_v + j, mask=j < nb, other=float("-inf")), descending=True)
    return v, tl.where(j < nb, _exp(v - m), 0.0)


@triton.jit
def _band_tau(band_v, nb, m, ch, mh, k, top_p, z, CAP: tl.constexpr):
    """tau as the sorted rule reads it: sorted position j follows ch + j larger values of mass
    mh + (its prefix) and is kept while that count < k and that mass < top_p * Z; +inf when the band keeps
    none. ``z`` < 0: Z is top_k's own mass, that of exactly the k largest (all of them are in the band)."""
    j = tl.arange(0, CAP)
    v, e = _band_sorted(band_v, nb, m, CAP)
    before = mh + _mass_prefix(e)
    z = tl.where(z < 0.0, mh + _mass_sum(tl.where(ch + j < k, e, 0.0), 0), z)
    pz = tl.where(top_p >= 1.0, float("inf"), top_p * z)
    n_keep = tl.sum(((j < nb) & (ch + j < k) & (before < pz)).to(tl.int32), 0)
    tau = tl.max(tl.where(j == n_keep - 1, v, float("-inf")), 0)
    return tl.where(n_keep > 0, tau, float("inf"))


@triton.jit
def _band_kth(band_v, nb, m, ch, mh, k, CAP: tl.constexpr):
    """top_k's k-th largest value (it is in the band), the mass of exactly the k largest, and the count
    and mass of what is >= that value."""
    j = tl.arange(0, CAP)
    v, e = _band_sorted(band_v, nb, m, CAP)
    vk = tl.max(tl.where(ch + j == k - 1, v, float("-inf")), 0)
    z = mh + _mass_sum(tl.where(ch + j < k, e, 0.0), 0)
    ge = (j < nb) & (v >= vk)
    return vk, z, ch + tl.sum(ge.to(tl.int32), 0), mh + _mass_sum(tl.where(ge, e, 0.0), 0)


@triton.jit
def _band_race(band_v, band_i, nb, tau, row_key, w_key, w_id, CAP: tl.constexpr):
    """The band's kept values join the race against the sure values' winner (ties to the lower id)."""
    j = tl.arange(0, CAP)
    v = tl.load(band_v + j, mask=j < nb, other=float("-inf"))
    ids = tl.load(band_i + j, mask=j < nb, other=0)
    noise = _neg_log_noise(_uniform(_element_hash(row_key, ids)))
    key = tl.where((j < nb) & (v >= tau), v + noise, float("-inf"))
    return _fold_best(key, ids, w_key, w_id)[1]


@triton.jit
def _fold_best(key, ids, w_key, w_id):
    """The best of ``key`` (ties: the lower id, whatever the order of ``ids``) against the running best
    (``w_key``, ``w_id``): the new running best."""
    b_key = tl.max(key, 0)
    b_id = tl.min(tl.where(key == b_key, ids, 2 ** 31 - 1), 0)
    better = (b_key > w_key) | ((b_key == w_key) & (b_id < w_id) & (b_key > float("-inf")))
    return tl.where(better, b_key, w_key), tl.where(better, b_id, w_id)


# ------------------------------------------------------------------------------ one row

@triton.jit
def _resolve(src, scale, V, m, lo, hi, cl, ml, ch, mh, k, top_p, z, row_key, band_v, band_i,
             CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The race among what is kept, once the bracket is narrow: copy the band, find tau in it."""
    if cl <= CAP:  # all of what lies above lo fits: nothing is sure, top_k's mass is in the band
        hi = m
        ch = 0
        mh = 0.0
    elif _span(lo, hi) <= 1:  # the band is hi's ties, and hi is kept: all of it is sure
        hi = lo
        ch = cl
        mh = ml
    nb, w_key, w_id = _compact(src, scale, V, lo, hi, row_key, ch > 0, band_v, band_i, CAP, BLOCK)
    tau = _band_tau(band_v, nb, m, ch, mh, k, top_p, z, CAP)
    return _band_race(band_v, band_i, nb, tau, row_key, w_key, w_id, CAP)


@triton.jit
def _top_k_mass(src, scale, V, m, lo, hi, cl, ml, ch, mh, k, row_key, band_v, band_i,
                CAP: tl.constexpr, BLOCK: tl.constexpr):
    """top_k with top_p and more than CAP values above the bracket: find the k-th value itself and the mass
    of the k largest (top_p's Z), then restart the bracket just below it."""
    if _span(lo, hi) <= 1:  # the k-th value is hi, in a tie group
        z = mh + (k - ch).to(tl.float32) * _exp(hi - m)
    else:
        nb, w_key, w_id = _compact(src, scale, V, lo, hi, row_key, False, band_v, band_i, CAP, BLOCK)
        vk, z, cl, ml = _band_kth(band_v, nb, m, ch, mh, k, CAP)
        lo = _prev(vk)
    return lo, cl, ml, z


@triton.jit
def _pick(x, i):
    return tl.sum(tl.where(tl.arange(0, x.shape[0]) == i, x, 0), 0)


@triton.jit
def _top_p_token(src, scale, V, m, n_fin, mean, std, s_min, row_key, top_p, lo, c_key, c_id, band_v, band_i,
                 CAP: tl.constexpr, BLOCK: tl.constexpr):
    """top_p without top_k (min_p in lo): one pass over RUNNERS probes measures lo (Z: what min_p keeps) and the
    values of the race's best keys but the last; the best kept of those is the answer: the winner itself in
    most rows, a runner-up in most others (p ~ (1 - top_p)^(RUNNERS - 1) of rows search)."""
    k = tl.full((), NO_LIMIT, tl.int32)
    j = tl.arange(0, RUNNERS)
    s_c = tl.load(src + c_id) * scale
    last = tl.argmax(tl.where(c_key == tl.min(c_key, 0), c_id, -1), 0)  # the lowest ranked: it probes lo
    probes = tl.where(j == last, lo, tl.maximum(s_c, lo))
    if WIDE_RUNNER_PROBE and RUNNER_MASSES:  # a whole block a chunk (_probe_pass takes half of what it is given)
        cnt, mass = _probe_pass(src, scale, V, m, probes, 2 * BLOCK, False)
    else:
        cnt, mass = _probe_pass(src, scale, V, m, probes, BLOCK, not RUNNER_MASSES)
    cl = _pick(cnt, last)
    z = _pick(mass, last)
    pz = top_p * z
    # top_p alone keeps by mass (k is no limit): the counts decide nothing here
    token = _best_ranked(c_key, c_id, (j != last) & (c_key > float("-inf")) & (s_c > lo) & (mass < pz))
    if token < 0:
        if RUNNER_MASSES:  # the count above lo the search starts from
            cl = n_fin
            if lo > float("-inf"):
                cl = _pick(_probe_pass(src, scale, V, m, tl.where(j == 0, lo, float("inf")), BLOCK)[0], 0)
        if LAZY_MOMENTS:
            mean, std, s_min = _moments(src, scale, V, n_fin, BLOCK)
        guess = _gaussian_guess(mean, std, cl, k, top_p)
        lo, hi, cl, ml, ch, mh = _search(src, scale, V, m, s_min, lo, m, cl, z, cl * 0, z * 0.0, k, pz, guess,
                                         CAP, BLOCK)
        token = _resolve(src, scale, V, m, lo, hi, cl, ml, ch, mh, k, top_p, z, row_key, band_v, band_i, CAP, BLOCK)
    return token


@triton.jit
def _top_k_token(src, scale, V, m, n_fin, mean, std, s_min, row_key, k, top_p, lo, band_v, band_i,
                 CAP: tl.constexpr, BLOCK: tl.constexpr):
    """top_k (then top_p; min_p in lo): the first probe pass measures lo itself (what min_p keeps), the rest
    search for the k-th value; with top_p, Z is top_k's own mass, read off the band (or found first when
    more than CAP values lie above the bracket)."""
    probes = _place_probes(lo, m, s_min, _gaussian_guess(mean, std, n_fin, k, top_p), True)
    cnt, mass = _probe_pass(src, scale, V, m, probes, BLOCK)
    cl = _pick(cnt, 0)
    ml = _pick(mass, 0)
    k = tl.where(k < cl, k, NO_LIMIT)  # top_k at or above what min_p leaves: off
    z = tl.where((k == NO_LIMIT) | (top_p >= 1.0), ml, -1.0)  # < 0: top_k's own mass, found below
    pz = tl.where((top_p >= 1.0) | (z < 0.0), float("inf"), top_p * z)
    kept = _keeps(cnt, mass, k, pz)
    lo, hi, cl, ml, ch, mh = _narrow(probes, cnt, mass, kept, lo, m, cl, ml, 0, 0.0)
    guess = _interpolate(lo, hi, s_min, cl, ml, ch, mh, k, pz)
    lo, hi, cl, ml, ch, mh = _search(src, scale, V, m, s_min, lo, hi, cl, ml, ch, mh, k, pz, guess, CAP, BLOCK)
    if (z < 0.0) & (cl > CAP):
        lo, cl, ml, z = _top_k_mass(src, scale, V, m, lo, hi, cl, ml, ch, mh, k, row_key, band_v, band_i,
                                    CAP, BLOCK)
        pz = top_p * z
        guess = _interpolate(lo, m, s_min, cl, ml, 0, 0.0, k, pz)
        lo, hi, cl, ml, ch, mh = _search(src, scale, V, m, s_min, lo, m, cl, ml, cl * 0, ml * 0.0, k, pz, guess,
                                         CAP, BLOCK)
    return _resolve(src, scale, V, m, lo, hi, cl, ml, ch, mh, k, top_p, z, row_key, band_v, band_i, CAP, BLOCK)


@triton.jit
def _lane_band_token(band_v, band_i, nb, b3, m, n_fin, k, top_p, lo, row_key, CAP: tl.constexpr):
    """top_k (then top_p; min_p in lo) from the stats pass's band of every value above b3, when that decides:
    at least k values in the band, and top_k binding — k below the number of values min_p keeps (counted in
    the band when its floor lo is at or above b3, n_fin with no floor; unknown otherwise). Else -1."""
    token = -1
    if nb >= k:
        j = tl.arange(0, CAP)
        above = n_fin
        if lo > float("-inf"):
            v = tl.load(band_v + j, mask=j < nb, other=float("-inf"))
            above = tl.where(lo >= b3, tl.sum(((j < nb) & (v > lo)).to(tl.int32), 0), -1)
        if k < above:  # the k largest lie above the floor: all in the band, and top_k's mass is theirs
            tau = _band_tau(band_v, nb, m, 0, 0.0, k, top_p, -1.0, CAP)
            token = _band_race(band_v, band_i, nb, tau, row_key, float("-inf"), 0, CAP)
    return token


@triton.jit
def _filtered_token(src, scale, V, m, n_fin, mean, std, s_min, w_id, row_key, k, top_p, log_min_p,
                    c_key, c_id, b3, nb, band_v, band_i, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """min_p keeps s >= max + log(min_p): lo, just below that floor. ``w_id`` raced over all and ``c_key`` /
    ``c_id`` its runners-up (k == 0); ``nb`` values above ``b3`` in the band from the stats pass (k > 0)."""
    lo = float("-inf")
    if log_min_p > float("-inf"):
        lo = _prev(m + log_min_p)
    token = w_id
    if k > 0:
        token = _lane_band_token(band_v, band_i, nb, b3, m, n_fin, k, top_p, lo, row_key, CAP)
        if token < 0:
            if LAZY_MOMENTS:
                mean, std, s_min = _moments(src, scale, V, n_fin, BLOCK)
            token = _top_k_token(src, scale, V, m, n_fin, mean, std, s_min, row_key, k, top_p, lo, band_v, band_i,
                                 CAP, BLOCK)
    else:
        if top_p < 1.0:
            token = _top_p_token(src, scale, V, m, n_fin, mean, std, s_min, row_key, top_p, lo, c_key, c_id, band_v,
                                 band_i, CAP, BLOCK)
        elif tl.load(src + w_id) * scale <= lo:  # min_p alone: the winner unless under the floor, then the best
            # runner-up over it
            token = _best_ranked(c_key, c_id, (c_key > float("-inf")) & (tl.load(src + c_id) * scale > lo))
            if token < 0:
                nb, w_key, token = _compact(src, scale, V, lo, lo, row_key, True, band_v, band_i, CAP, BLOCK)
    return token


@triton.jit
def _in_table(ids, table, n):
    """Whether each of ``ids`` is among the first ``n`` entries of ``table`` (a bias or ban table: tens of
    entries, compared TABLE_BLOCK at a time)."""
    found = tl.zeros(ids.shape, tl.int32)
    for j0 in range(0, n, TABLE_BLOCK):
        j = j0 + tl.arange(0, TABLE_BLOCK)
        t = tl.load(table + j, mask=j < n, other=-1)
        found = tl.maximum(found, tl.max((ids[:, None] == t[None, :]).to(tl.int32), 1))
    return found != 0


@triton.jit
def _processed_exact_token(x_row, V, inv_t, pen, rep, freq, pres, counts, in_prompt, bias_ids, bias_vals, n_bias,
                           ban_ids, n_ban, masked, mask_row, sampled, row_key, vkeys, BLOCK: tl.constexpr):
    """A processed row with no filters or logprobs in one pass and no scratch row: the dense stages (penalties,
    the grammar's mask) applied as the row streams by, keeping the RUNNERS best race keys (greedy: values);
    then the sparse entries answer for themselves: the best runner that is no bias or active ban entry against
    each bias entry's own key (ties: the lower id). The token the scratch-row path gives, with one read of the
    row where that path reads it twice and writes it once; -1 when every runner is a bias or ban entry (or
    nothing is finite): the scratch-row path then."""
    lanes = tl.arange(0, BLOCK)
    c_key = tl.full([RUNNERS], float("-inf"), tl.float32)
    c_id = tl.zeros([RUNNERS], tl.int32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        offs = start + lanes
        y = tl.load(x_row + offs, mask=offs < V, other=float("-inf"))
        s = _penalize_and_mask(y, offs, offs < V, pen, counts, in_prompt, rep, freq, pres, masked, mask_row) * inv_t
        if sampled:
            c_key, c_id = _race_chunk_runners(s, start, s > float("-inf"), row_key, _chunk_vocab_keys(vkeys, offs, V),
                                              c_key, c_id)
        else:
            c_key, c_id = _top_insert(s, start, c_key, c_id)
    dense = (c_key > float("-inf")) & ~_in_table(c_id, bias_ids, n_bias) & ~_in_table(c_id, ban_ids, n_ban)
    w_key = tl.max(tl.where(dense, c_key, float("-inf")), 0)
    w_id = _best_ranked(c_key, c_id, dense)
    for j0 in range(0, n_bias, TABLE_BLOCK):  # as _prepare_row writes them: raw + bias, the dense stages, the ban
        j = j0 + tl.arange(0, TABLE_BLOCK)
        ok = j < n_bias
        ids = tl.load(bias_ids + j, mask=ok, other=0).to(tl.int32)
        y = _biased(x_row, ids, tl.load(bias_vals + j, mask=ok, other=0.0), ok, inv_t, pen, rep, freq, pres, counts,
                    in_prompt, masked, mask_row)
        y = tl.where(ok & ~_in_table(ids, ban_ids, n_ban), y, float("-inf"))
        key = y
        if sampled:
            key = y + _neg_log_noise(_uniform(_element_hash(row_key, ids)))
        w_key, w_id = _fold_best(key, ids, w_key, w_id)
    return tl.where(tl.max(dense.to(tl.int32), 0) > 0, w_id, -1)


@triton.jit
def _write_top(top_v, top_i, lp_k, lse, out_id, out_lp, top_w):
    """The raw top-k, value-descending (ties by id), as logprobs."""
    j = tl.arange(0, TOP_LOGPROBS)
    key = (_ordered(top_v).to(tl.int64) << 32) | (top_i.to(tl.int64) ^ 0xFFFFFFFF)
    key = tl.sort(tl.where(j < lp_k, key, -9223372036854775807 - 1), descending=True)
    v = _from_ordered((key >> 32).to(tl.int32))
    tl.store(out_id + j, (key & 0xFFFFFFFF) ^ 0xFFFFFFFF, mask=j < top_w)
    tl.store(out_lp + j, v - lse, mask=j < top_w)


@triton.jit
def _row_token(x_row, V, slot, inv_t, pen, rep, freq, pres, n_bias, n_ban, masked, needs, sampled, lp_k, row_key,
               vkeys, fp, ip, counts, in_prompt, bias_ids, bias_vals, bias_w, ban_ids, ban_w, masks, mask_w, scratch,
               band_v, band_i, out_lp, out_top_id, out_top_lp, top_w, FILTER: tl.constexpr,
               LOGPROBS: tl.constexpr, PREPARE: tl.constexpr, BAND: tl.constexpr, CAP: tl.constexpr,
               BLOCK: tl.constexpr):
    """A row's token by the stats pass (after its processed values are written to the scratch row, where it
    has any), then the filters where it has any; its logprobs written when asked."""
    src = x_row
    scale = inv_t
    if PREPARE and needs:
        _prepare_row(x_row, 0, V, scratch, inv_t, pen, rep, freq, pres, counts + slot * V, in_prompt + slot * V,
                     bias_ids + slot * bias_w, bias_vals + slot * bias_w, n_bias, ban_ids + slot * ban_w, n_ban,
                     masked, masks + slot * mask_w, BLOCK)
        src = scratch
        scale = 1.0
    k = tl.load(ip + I_TOP_K).to(tl.int32)
    top_p = tl.load(fp + F_TOP_P)
    log_min_p = tl.load(fp + F_LOG_MIN_P)
    m, token, n_fin, mean, std, s_min, w_id, lse, top_v, top_i, c_key, c_id, b3, nb = _stats_pass(
        src, scale, x_row, V, row_key, vkeys, sampled & (k == 0), lp_k, sampled & (k > 0), band_v, band_i,
        LOGPROBS, FILTER, BAND, not PREPARE, CAP, BLOCK)
    if sampled:
        if FILTER and (k > 0) | (top_p < 1.0) | (log_min_p > float("-inf")):
            token = _filtered_token(src, scale, V, m, n_fin, mean, std, s_min, w_id, row_key, k, top_p,
                                    log_min_p, c_key, c_id, b3, nb, band_v, band_i, CAP, BLOCK)
        else:
            token = w_id
    if LOGPROBS and lp_k >= 0:
        tl.store(out_lp, tl.load(x_row + token) - lse)
        _write_top(top_v, top_i, lp_k, lse, out_top_id, out_top_lp, top_w)
    return token


@triton.jit(do_not_specialize=["B", "bias_w", "ban_w", "has_penalty_state", "can_prepare", "record", "top_w",
                               "mask_w", "has_masks"])
def _sample_kernel(logits, V: tl.constexpr, stride, slots, B, fparams, iparams, generated, vkeys,
                   bias_ids, bias_vals, bias_w, ban_ids, ban_w, counts, in_prompt, has_penalty_state,
                   masks, mask_w, has_masks,
                   scratch, can_prepare, band_v, band_i, record, out_token, out_k, out_lp, out_top_id, out_top_lp,
                   top_w, FILTER: tl.constexpr, LOGPROBS: tl.constexpr, PREPARE: tl.constexpr, BAND: tl.constexpr,
                   CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Persistent: program p samples rows p, p + P, ... with its own scratch row and band buffer; with
    ``record`` it also advances the slot's counter and its token's count (a step's slots are distinct).
    FILTER, LOGPROBS, PREPARE and BAND compile in the stages the step's rows may use (top_k / top_p / min_p,
    logprobs, the processed row, top_k's lane band): a stage left out is one no row takes (a top_k row in a
    variant without the band searches: the same token), and a row's arithmetic is the same in every
    variant that has its stages. ``V`` is a constant (a compile per vocabulary size): session 19 measured the
    kernel that way; since its unmasked loads were dropped nothing needs it, and whether a run-time ``V`` is
    faster is unmeasured."""
    pid = tl.program_id(0)
    scratch = scratch + pid.to(tl.int64) * V
    band_v = band_v + pid * CAP
    band_i = band_i + pid * CAP
    for row in range(pid, B, tl.num_programs(0)):
        r = tl.cast(row, tl.int64)
        slot = tl.load(slots + r).to(tl.int64)
        fp = fparams + slot * NUM_F
        ip = iparams + slot * NUM_I
        x_row = logits + r * stride
        counter = tl.load(generated + slot)
        inv_t, rep, freq, pres, pen, n_bias, n_ban, masked = _row_processing(fp, ip, counter, has_penalty_state,
                                                                             has_masks)
        needs = (can_prepare != 0) & (pen | (n_bias > 0) | (n_ban > 0) | masked)
        sampled = tl.load(fp + F_TEMPERATURE) != 0.0
        lp_k = tl.load(ip + I_LOGPROBS).to(tl.int32)
        row_key = _row_key(tl.load(ip + I_SEED_KEY), counter)
        token = -1
        if PREPARE and not FILTER and not LOGPROBS and PROCESSED_ONE_PASS:  # exact and processed: one pass
            if needs:
                token = _processed_exact_token(x_row, V, inv_t, pen, rep, freq, pres, counts + slot * V,
                                               in_prompt + slot * V, bias_ids + slot * bias_w,
                                               bias_vals + slot * bias_w, n_bias, ban_ids + slot * ban_w, n_ban,
                                               masked, masks + slot * mask_w, sampled, row_key, vkeys, BLOCK)
        if token < 0:
            token = _row_token(x_row, V, slot, inv_t, pen, rep, freq, pres, n_bias, n_ban, masked, needs, sampled,
                               lp_k, row_key, vkeys, fp, ip, counts, in_prompt, bias_ids, bias_vals, bias_w, ban_ids,
                               ban_w, masks, mask_w, scratch, band_v, band_i, out_lp + r, out_top_id + r * top_w,
                               out_top_lp + r * top_w, top_w, FILTER, LOGPROBS, PREPARE, BAND, CAP, BLOCK)
        tl.store(out_token + r, token.to(tl.int64))
        if record != 0:
            tl.store(generated + slot, counter + 1)
            if has_penalty_state != 0:
                tl.atomic_add(counts + slot * V + token, 1)
        tl.store(out_k + r, lp_k.to(tl.int64))


# ------------------------------------------------------------------------ the split race

@triton.jit
def _packed(key, token):
    """(key, token) as one int64 whose maximum is the largest key, ties to the lowest token."""
    return (_ordered(key).to(tl.int64) << 32) | (2147483647 - token).to(tl.int64)


@triton.jit(do_not_specialize=["bias_w", "ban_w", "has_penalty_state", "mask_w", "has_masks"])
def _race_split_kernel(logits, V: tl.constexpr, stride, slots, fparams, iparams, generated, best, vkeys,
                       bias_ids, bias_vals, bias_w, ban_ids, ban_w, counts, in_prompt, has_penalty_state,
                       masks, mask_w, has_masks, scratch, PREPARE: tl.constexpr, SEGMENT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program (row, g) races (or, greedy, takes the first maximum) over ids [g·SEGMENT, (g+1)·SEGMENT) of a
    row with no filters or logprobs, and folds its best into ``best[row]`` by atomic max: the row's token is the
    same as one program's over the whole row (``_race_chunk`` is exact). With PREPARE a row with penalties, bias,
    a ban or a grammar mask is processed first, its segment into the row's scratch row (the bias and ban
    entries in the segment: each program writes and reads back only its own ids)."""
    r = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * SEGMENT
    hi = tl.minimum(lo + SEGMENT, V)
    slot = tl.load(slots + r).to(tl.int64)
    fp = fparams + slot * NUM_F
    ip = iparams + slot * NUM_I
    x_row = logits + r * stride
    counter = tl.load(generated + slot)
    src = x_row
    scale = tl.load(fp + F_INV_TEMPERATURE)
    if PREPARE:
        inv_t, rep, freq, pres, pen, n_bias, n_ban, masked = _row_processing(fp, ip, counter, has_penalty_state,
                                                                             has_masks)
        if pen | (n_bias > 0) | (n_ban > 0) | masked:
            dst = scratch + r * V
            _prepare_row(x_row, lo, hi, dst, inv_t, pen, rep, freq, pres, counts + slot * V, in_prompt + slot * V,
                         bias_ids + slot * bias_w, bias_vals + slot * bias_w, n_bias, ban_ids + slot * ban_w, n_ban,
                         masked, masks + slot * mask_w, BLOCK)
            src = dst
            scale = 1.0
    sampled = tl.load(fp + F_TEMPERATURE) != 0.0
    row_key = _row_key(tl.load(ip + I_SEED_KEY), counter)
    lanes = tl.arange(0, BLOCK)
    m_l = tl.full([BLOCK], float("-inf"), tl.float32)
    arg_l = tl.zeros([BLOCK], tl.int32)
    w_key = float("-inf")
    w_id = 0
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        s = _load_scaled(src, start + lanes, hi, scale)
        if sampled:
            w_key, w_id = _race_chunk(s, start, s > float("-inf"), row_key, _chunk_vocab_keys(vkeys, start + lanes, V),
                                      w_key, w_id)
        else:
            arg_l = tl.where(s > m_l, start + lanes, arg_l)
            m_l = tl.maximum(m_l, s)
    if not sampled:  # the first maximum; nothing finite: token 0, as the one-program path
        w_key = tl.max(m_l, 0)
        w_id = tl.maximum(_best_ranked(m_l, arg_l, m_l > float("-inf")), 0)
    tl.atomic_max(best + r, _packed(w_key, w_id))


@triton.jit
def _race_finish_kernel(slots, generated, counts, V, best, record, has_penalty_state, out_token):
    """The split race's token per row, the slot recorded as the one-program kernel does, ``best`` emptied."""
    r = tl.program_id(0).to(tl.int64)
    token = 2147483647 - (tl.load(best + r) & 0xFFFFFFFF).to(tl.int32)
    tl.store(best + r, NONE_YET)
    tl.store(out_token + r, token.to(tl.int64))
    if record != 0:
        slot = tl.load(slots + r).to(tl.int64)
        tl.store(generated + slot, tl.load(generated + slot) + 1)
        if has_penalty_state != 0:
            tl.atomic_add(counts + slot * V + token, 1)


def _sample_split(logits: torch.Tensor, slots: torch.Tensor, t: SlotTables, ws: SamplingWorkspace,
                  cfg: KernelConfig, record: bool, prepare: bool, tables: tuple) -> DeviceSample:
    """Two launches, no sync: the split race (each program processing its segment first when ``prepare``),
    then the tokens and the recording."""
    b, v = logits.shape
    counts, in_prompt, has_pen, masks, has_masks, scratch = tables
    segment = triton.cdiv(triton.cdiv(v, cfg.segments), cfg.block) * cfg.block
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    _race_split_kernel[(b, triton.cdiv(v, segment))](
        logits, v, logits.stride(0), slots, t.fparams, t.iparams, t.generated, ws.best, ws.vocab_keys,
        t.bias_ids, t.bias_vals, t.bias_ids.shape[1], t.ban_ids, t.ban_ids.shape[1], counts, in_prompt, int(has_pen),
        masks, masks.shape[1] if has_masks else 0, int(has_masks), scratch, PREPARE=prepare, SEGMENT=segment,
        BLOCK=cfg.block, num_warps=cfg.num_warps)
    _race_finish_kernel[(b,)](slots, t.generated, counts, v, ws.best, int(record), int(has_pen), tokens,
                              num_warps=1)
    return DeviceSample(tokens)


# ---------------------------------------------------------------------------------- launch

class SamplingWorkspace:
    """Device scratch the kernel reuses every step: per program a band buffer and (allocated the first time
    a step has bias, a ban or penalties) a processed row."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        shapes = (config_for(vocab_size), config_for(vocab_size, rows=FEW_ROWS + 1, exact=True))  # many rows
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        self.programs = self.sms * max(c.programs_per_sm for c in shapes)  # the most programs of any shape
        cap = max(c.cap for c in shapes)  # and the largest band
        self.band_v = torch.empty(self.programs, cap, dtype=torch.float32, device=device)
        self.band_i = torch.empty(self.programs, cap, dtype=torch.int32, device=device)
        self.best = torch.full((SPLIT_ROWS,), NONE_YET.value, dtype=torch.int64, device=device)  # split race
        self.rows: torch.Tensor | None = None
        # the per-id hashes as 32-bit words (engine.sampler.vocab_keys, wrapped): read with VOCAB_TABLE
        self.vocab_keys = sm.vocab_keys(vocab_size, device).to(torch.int32)
        self.dummy = torch.zeros(16, dtype=torch.int32, device=device)

    def scratch_rows(self) -> torch.Tensor:
        if self.rows is None:
            self.rows = torch.empty(self.programs, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.rows


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned: what the compiled kernel was specialised for (a view or a broadcast
    row would be a new specialisation, compiled mid-serving)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous().clone()


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
    cfg = _shape_of(f, v, b, prepare)
    in_prompt = t.prompt_mask.view(torch.uint8) if has_pen else ws.dummy.view(torch.uint8)
    masks = t.masks if has_masks else ws.dummy
    scratch = ws.scratch_rows() if prepare else ws.band_v
    if cfg.segments > 1:
        return _sample_split(logits, slots, t, ws, cfg, record, prepare,
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
            max(top_w, 1), FILTER=f.filtered, LOGPROBS=f.logprobs, PREPARE=prepare, BAND=_has_band(f),
            CAP=cfg.cap, BLOCK=cfg.block, num_warps=cfg.num_warps)
    if not f.logprobs:
        return DeviceSample(tokens)
    return DeviceSample(tokens, k, lp, top_ids[:, :top_w], top_lp[:, :top_w])


def sample_rows_ref(logits: torch.Tensor, slots: torch.Tensor, t: SlotTables, f: Features,
                    ws: SamplingWorkspace | None = None) -> DeviceSample:
    """The twin: the torch path (engine.sampler), which is also the CPU sampler."""
    return sm.torch_sample(logits.float(), slots, t, f)


def _has_band(f: Features) -> bool:
    """Whether the step's filter variant has the lane band (``BAND_VARIANTS``: only where a row has top_k)."""
    return f.filtered and (f.top_k or not BAND_VARIANTS)


def _shape_of(f: Features, vocab_size: int, rows: int, prepare: bool) -> KernelConfig:
    """The launch shape of a step with these stages (``prepare``: the processed row is written)."""
    return config_for(vocab_size, rows, exact=not (f.filtered or f.logprobs), plain=not prepare)


def warm_up(t: SlotTables, ws: SamplingWorkspace, batch_sizes: Sequence[int],
            threads: int = WARM_UP_THREADS) -> None:
    """Compile every variant of the kernel (``variant_features``) and launch each once per batch size (outputs
    dropped, counters untouched): what differs per row within a variant is branched on at run time.

    A cold compile of a filter variant takes tens of seconds of one core, and Triton's compiler releases the GIL
    while it works (the 8 variants for sm_90 on this project's 2-core VM: 153 s one after another, 80 s in two
    threads): so one launch per compiled kernel (variant and launch shape; the batch size is not specialised
    on) comes first, the filter variants' in a thread pool, then every (variant, batch size) once more, from
    the compiled kernels."""
    v = ws.vocab_size
    jobs = [(f, b) for b in batch_sizes for f in variant_features()]
    # a new thread starts on the first device; "cuda" (no index) means the calling thread's current one
    index = ws.device.index if ws.device.type != "cuda" or ws.device.index is not None else torch.cuda.current_device()

    def launch(job: tuple[Features, int]) -> None:
        if ws.device.type == "cuda":
            torch.cuda.set_device(index)
        f, b = job
        logits = torch.zeros(b, v, dtype=torch.float32, device=ws.device)
        sample_rows(logits, torch.arange(b, device=ws.device) % t.fparams.shape[0], t, f, ws)

    firsts = {(f, _shape_of(f, v, b, f.bias or f.ban)): (f, b) for f, b in reversed(jobs)}  # the smallest b each
    slow = [(f, b) for f, b in firsts.values() if f.filtered]
    if threads > 1 and len(slow) > 1 and ws.device.type == "cuda":  # (the interpreter compiles nothing)
        # the quick ones here first: each kernel's first launch builds Triton's per-device cache of it, which
        # threads launching it for the first time at once would each build
        for job in firsts.values():
            if job not in slow:
                launch(job)
        with ThreadPoolExecutor(min(threads, len(slow)), thread_name_prefix="sampler-compile") as pool:
            list(pool.map(launch, slow))  # list(): a thread's error is raised here
    for job in jobs:
        launch(job)


def variant_features() -> list[Features]:
    """One Features per compiled variant: with or without the filters, logprobs and the processed row (and with
    ``BAND_VARIANTS``, filters with or without top_k's lane band)."""
    return [Features(sampled=True, top_p=filtered, top_k=band, logprobs=logprobs, max_logprobs=int(logprobs),
                     bias=prepare)
            for filtered in (False, True) for band in ((False, True) if filtered and BAND_VARIANTS else (False,))
            for logprobs in (False, True) for prepare in (False, True)]

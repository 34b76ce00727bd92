"""The sampling kernel's constants and the small Triton helpers every pass uses: masked loads, exponentials, the
float ordering, fixed-point sums, the running best keys."""

from __future__ import annotations

import math
import os

import triton
import triton.language as tl

from engine import sample_layout as layout

# the parameter tables' columns (engine.sample_layout)
NUM_F = tl.constexpr(layout.NUM_F)
NUM_I = tl.constexpr(layout.NUM_I)
F_TOP_P = tl.constexpr(layout.F_TOP_P)
F_PRESENCE = tl.constexpr(layout.F_PRESENCE)
F_FREQUENCY = tl.constexpr(layout.F_FREQUENCY)
F_REPETITION = tl.constexpr(layout.F_REPETITION)
F_INV_TEMPERATURE = tl.constexpr(layout.F_INV_TEMPERATURE)
F_LOG_MIN_P = tl.constexpr(layout.F_LOG_MIN_P)
F_TEMPERATURE = tl.constexpr(layout.F_TEMPERATURE)
I_TOP_K = tl.constexpr(layout.I_TOP_K)
I_MIN_TOKENS = tl.constexpr(layout.I_MIN_TOKENS)
I_LOGPROBS = tl.constexpr(layout.I_LOGPROBS)
I_SEED_KEY = tl.constexpr(layout.I_SEED_KEY)
I_NUM_BIAS = tl.constexpr(layout.I_NUM_BIAS)
I_NUM_BAN = tl.constexpr(layout.I_NUM_BAN)
I_MASKED = tl.constexpr(layout.I_MASKED)

NO_LIMIT = tl.constexpr(2 ** 31 - 1)  # top_k off
NUM_PROBES = tl.constexpr(8)
TOP_LOGPROBS = tl.constexpr(32)  # raw top-k buffer: MAX_LOGPROBS (20) rounded up to a power of two
TABLE_BLOCK = tl.constexpr(16)   # bias / ban entries per vector step
# race keys kept beside the winner for top_p / min_p rows: when the winner is not kept, the best of these that is
# is the answer (the race over the kept set is its best key), found with one probe pass instead of a search
RUNNERS = tl.constexpr(4)
# every sum across a block's lanes that decides a token or a logprob (the probes' masses, Z, the band's prefix
# masses, the log-sum-exp) and the moments that place the first probes are summed as int64 fixed point (a mass,
# at most 1 a value relative to the row's maximum, in units of 2^-40): a lane's own running sum is the same
# whatever the program's shape, and integer sums are the same in any order, so a row's token does not depend on
# the warps a program has (what lets a small step's filtered rows run in a wide program, batch-invariant)
FIXED_UNIT = tl.constexpr(2.0 ** 40)
# the race's skip test, h < 2^32 * 1.002 * e^(s - best), as one exponent (``_may_beat``)
SKIP_EXPONENT = tl.constexpr(32.0 + math.log2(1.002))
# the interpreter has no inline PTX: ``_exp2`` takes tl.exp2 there
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
LOG2E = tl.constexpr(1.4426950408889634)
# chunks in flight per streaming loop (cp.async into shared memory): one 8 KB chunk per SM would leave HBM
# latency-bound at a few TB/s
STAGES = tl.constexpr(3)
NONE_YET = tl.constexpr(-(2 ** 63))  # an empty packed key (below every ``_packed`` one)


@triton.jit
def _load_row(ptr, offs, V, other):
    """``ptr[offs]`` where ``offs < V``, else ``other`` (masked even where V is a multiple of the chunk: the
    unmasked loads cost registers and were slower; BENCHMARKS.md, sampler)."""
    return tl.load(ptr + offs, mask=offs < V, other=other)


@triton.jit
def _load_scaled(src, offs, V, scale):
    return _load_row(src, offs, V, float("-inf")) * scale


@triton.jit
def _exp2(x):
    """2^x: on the GPU ex2.approx.ftz (inline PTX; results below 2^-126 flushed to 0, where a mass is far under
    the 2^-40 of the fixed-point sums), under the interpreter tl.exp2."""
    if not INTERPRETED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _exp(x):
    """e^x: tl.exp's bits (x * log2(e), then ex2.approx) without its fix-up below 2^-126 (three instructions a
    value: the same bits above 2^-126, 0 below)."""
    if not INTERPRETED:
        return _exp2(x * LOG2E)
    else:
        return tl.exp(x)


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
def _packed(key, token):
    """(key, token) as one int64 whose maximum is the largest key, ties to the lowest token."""
    return (_ordered(key).to(tl.int64) << 32) | (2147483647 - token).to(tl.int64)


@triton.jit
def _pick(x, i):
    return tl.sum(tl.where(tl.arange(0, x.shape[0]) == i, x, 0), 0)


@triton.jit
def _best_ranked(c_key, c_id, ok):
    """The id of the best key among ``ok`` entries (ties: the lower id), -1 when none is."""
    best = tl.max(tl.where(ok, c_key, float("-inf")), 0)
    token = tl.min(tl.where(ok & (c_key == best), c_id, 2 ** 31 - 1), 0)
    return tl.where(best > float("-inf"), token, -1)


@triton.jit
def _fold_best(key, ids, w_key, w_id):
    """The best of ``key`` (ties: the lower id, whatever the order of ``ids``) against the running best
    (``w_key``, ``w_id``): the new running best."""
    b_key = tl.max(key, 0)
    b_id = tl.min(tl.where(key == b_key, ids, 2 ** 31 - 1), 0)
    better = (b_key > w_key) | ((b_key == w_key) & (b_id < w_id) & (b_key > float("-inf")))
    return tl.where(better, b_key, w_key), tl.where(better, b_id, w_id)


@triton.jit
def _mass_sum(x, axis: tl.constexpr):
    """The sum of masses ``x`` (each >= 0 and at most a few thousand) along ``axis``: each rounded down to 2^-40
    and summed as int64, the same in any order and any layout."""
    return tl.sum((x * FIXED_UNIT).to(tl.int64), axis).to(tl.float32) * (1.0 / FIXED_UNIT)


@triton.jit
def _mass_prefix(e):
    """Each mass's exclusive prefix sum (what comes before it), as ``_mass_sum`` sums."""
    fixed = (e * FIXED_UNIT).to(tl.int64)
    return (tl.cumsum(fixed, 0) - fixed).to(tl.float32) * (1.0 / FIXED_UNIT)


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

"""The race's noise: the counter hash of ``engine.sample_torch`` in uint32 arithmetic, -log E from it, and the
exponential race over a chunk (``argmax s - log E``) that skips chunks which cannot change its winner. With its
twin, ``counter_hash_rows`` / ``counter_hash_rows_ref``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import sample_layout as layout
from engine.cuda.sampling.common import LOG2E, SKIP_EXPONENT, _exp2, _load_row, _top_insert
from engine.sample_torch import counter_hash, exponential_noise, vocab_keys

MUL1 = tl.constexpr(layout.MUL1)
MUL2 = tl.constexpr(layout.MUL2)
GOLDEN = tl.constexpr(layout.GOLDEN)
COUNTER_SALT = tl.constexpr(layout.COUNTER_SALT)
VOCAB_SALT = tl.constexpr(layout.VOCAB_SALT)
V_MAX = tl.constexpr(layout.V_MAX)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MUL1
    x = x ^ (x >> 15)
    x = x * MUL2
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed_key, counter):
    """engine.sample_torch.counter_hash's per-row part, in uint32 arithmetic."""
    return _mix32(seed_key.to(tl.uint32) ^ _mix32(counter.to(tl.uint32) + COUNTER_SALT))


@triton.jit
def _vocab_hash(ids):
    """engine.sample_torch.vocab_keys: the per-id part of the hash, the same for every row."""
    return _mix32((ids.to(tl.uint32) * GOLDEN) ^ VOCAB_SALT)


@triton.jit
def _element_hash(row_key, ids):
    return _mix32(row_key ^ _vocab_hash(ids))


@triton.jit
def _chunk_vocab_keys(vkeys, offs, V):
    """The per-id hashes of a chunk, read from the vocabulary's table (``engine.sample_torch.vocab_keys``; 256 KB
    at 65,536, it stays in L2): one 4-byte load a value where ``_vocab_hash`` takes two multiplies and three
    shifts."""
    return _load_row(vkeys, offs, V, 0).to(tl.uint32, bitcast=True)


@triton.jit
def _uniform(h):
    """v = (h + 0.5) / 2**32 in (0, 1), as engine.sample_torch.exponential_noise rounds it."""
    return tl.minimum((h.to(tl.float32) + 0.5) * 2.3283064365386963e-10, V_MAX)


@triton.jit
def _may_beat(h, s, best_key):
    """Whether a value of hash ``h`` (noise v = (h + 0.5) / 2^32) and value ``s`` may beat ``best_key``: its E
    >= v must be < e^(s - best_key), tested as h < 2^32 * 1.002 * e^(s - best) (0.2% to spare for rounding:
    never stricter than the exact test, so no chunk that could change the race is skipped) with no uniform a
    value."""
    return h.to(tl.float32) < _exp2((s - best_key) * LOG2E + SKIP_EXPONENT)


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
    that (``_may_beat``) cannot change the race and skips the two logs a value (after the
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
    """The twin: the torch path's hash and log E."""
    vocab = vocab_keys(vocab_size, keys.device)
    return counter_hash(keys, counters, vocab), torch.log(exponential_noise(keys, counters, vocab))

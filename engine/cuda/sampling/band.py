"""Step 4, the band: once at most ``cap`` values lie in the bracket (or above lo: then top_k's own mass, the Z
top_p needs after top_k, is there too), one pass copies them to the program's band buffer and races the values
above hi; the band is sorted, tau read off its cumulative counts and masses as the sorted rule reads them, and its
kept tokens join the race."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.cuda.sampling.common import (STAGES, _exp, _fold_best, _load_scaled, _mass_prefix, _mass_sum, _prev)
from engine.cuda.sampling.race import _element_hash, _neg_log_noise, _race_chunk, _uniform, _vocab_hash
from engine.cuda.sampling.search import _span


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


@triton.jit(noinline=True)
def _sort_band(band_v, nb, CAP: tl.constexpr):
    """The band's values sorted (descending) into the program's second band row, ``band_v + CAP``. One function
    in the module instead of a copy at each of its four call sites: tl.sort of 1,024 values unrolls into ~2,700
    ops, and Triton's layout passes spent ~2/3 of a filter variant's 40-65 s compile on four copies of it. (It
    writes to memory rather than returning the tensor: Triton 3.6 cannot return a tensor from a non-inlined
    function.)"""
    j = tl.arange(0, CAP)
    tl.debug_barrier()  # the sorted row's previous readers are done
    tl.store(band_v + CAP + j, tl.sort(tl.load(band_v + j, mask=j < nb, other=float("-inf")), descending=True))


@triton.jit
def _band_sorted(band_v, nb, m, CAP: tl.constexpr):
    j = tl.arange(0, CAP)
    _sort_band(band_v, nb, CAP)
    tl.debug_barrier()  # every thread's part of the sorted row is written
    v = tl.load(band_v + CAP + j)
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

"""Step 2, the stats pass: one read of the row for its maximum and greedy argmax, its finite count, the race over
every token (with the filters, its runners-up), the raw log-sum-exp and top-k raw logprobs, and for top_k rows the
lane band: each lane's two largest values, from which the k largest are read when they lie above every lane's
third (``_lane_band``). Passes accumulate lane by lane and reduce once: every reduction to a scalar inside a chunk
loop is a block-wide barrier."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.cuda.sampling.common import (NONE_YET, RUNNERS, STAGES, TOP_LOGPROBS, _best_ranked, _exp, _from_ordered,
                                         _load_row, _load_scaled, _mass_sum, _ordered, _packed, _top_insert)
from engine.cuda.sampling.race import _chunk_vocab_keys, _race_chunk, _race_chunk_runners


@triton.jit
def _stats_pass(src, scale, x_row, V, row_key, vkeys, do_race, lp_k, want_band, band_v, band_i,
                LOGPROBS: tl.constexpr, FILTER: tl.constexpr, BAND: tl.constexpr, RAW_IS_SRC: tl.constexpr,
                CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Max and greedy argmax, the finite count, the race over all (``do_race``; with FILTER its RUNNERS best keys
    too), the raw log-sum-exp and top-``lp_k`` raw logits (``lp_k >= 0``), and with FILTER, BAND and ``want_band``
    the band of every value above b3 (``_lane_band``; its size, -1 when not written). Accumulated lane by lane
    and reduced once (only the race's skip test reduces a chunk). ``RAW_IS_SRC``: ``src`` is ``x_row`` (no
    processed row in this variant): a logprobs row reads each value once. The mean, std and minimum that place a
    search's first probes are a pass of their own (``_moments``), for the few rows that search: here they cost
    every filter row registers and instructions."""
    lanes = tl.arange(0, BLOCK)
    m_l = tl.full([BLOCK], float("-inf"), tl.float32)
    arg_l = tl.zeros([BLOCK], tl.int32)
    n_l = tl.zeros([BLOCK], tl.int32)
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
    rarg_l = tl.zeros([BLOCK], tl.int32)  # LOGPROBS: each lane's raw maximum's id, second, third
    rsec_l = tl.full([BLOCK], float("-inf"), tl.float32)
    rsec_i = tl.zeros([BLOCK], tl.int32)
    rthird_l = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        if RAW_IS_SRC and LOGPROBS:
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
        if do_race:
            if FILTER:
                c_key, c_id = _race_chunk_runners(s, start, fin, row_key, _chunk_vocab_keys(vkeys, start + lanes, V),
                                                  c_key, c_id)
            else:
                w_key, w_id = _race_chunk(s, start, fin, row_key, _chunk_vocab_keys(vkeys, start + lanes, V), w_key,
                                          w_id)
        if LOGPROBS and lp_k >= 0:
            if RAW_IS_SRC:
                x = raw
            else:
                x = _load_row(x_row, start + lanes, V, float("-inf"))
            if lp_k > 0:  # lane by lane, no reduction: the top-k is read off the lanes at the end (_raw_top_k)
                rsec_l, rsec_i, rthird_l = _lane_second(x, start + lanes, mr_l, rarg_l, rsec_l, rsec_i, rthird_l)
                rarg_l = tl.where(x > mr_l, start + lanes, rarg_l)
            mr_l, zr_l = _raw_lse_chunk(x, mr_l, zr_l)
    m = tl.max(m_l, 0)
    n_fin = tl.sum(n_l, 0)
    if LOGPROBS:
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
    return (m, arg, n_fin, w_id, m_raw + tl.log(z_raw), top_v, top_i, c_key, c_id, b3, nb)


@triton.jit
def _raw_lse_chunk(x, m, z):
    """Lane-wise online log-sum-exp (one exp a value): running max ``m`` and sum ``z`` of e^(x - m)."""
    d = tl.where(x == float("-inf"), 0.0, _exp(-tl.abs(x - m)))
    z = tl.where(x > m, z * d + 1.0, z + d)
    return tl.maximum(m, x), z


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
def _write_top(top_v, top_i, lp_k, lse, out_id, out_lp, top_w):
    """The raw top-k, value-descending (ties by id), as logprobs."""
    j = tl.arange(0, TOP_LOGPROBS)
    key = (_ordered(top_v).to(tl.int64) << 32) | (top_i.to(tl.int64) ^ 0xFFFFFFFF)
    key = tl.sort(tl.where(j < lp_k, key, -9223372036854775807 - 1), descending=True)
    v = _from_ordered((key >> 32).to(tl.int32))
    tl.store(out_id + j, (key & 0xFFFFFFFF) ^ 0xFFFFFFFF, mask=j < top_w)
    tl.store(out_lp + j, v - lse, mask=j < top_w)

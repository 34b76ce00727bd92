"""The filters of a row (top_k, top_p, min_p) once the stats pass is done. top_p rows first test the race's
winner and its runners-up (one probe pass over them: lo, min_p's floor, gives Z): the best kept of them is the
answer, the winner itself in p ~ top_p of rows; min_p alone: the winner unless under the floor. top_k rows take
the stats pass's lane band when it decides (most rows at k = 50), else search. The rest search (``search``) and
race in the band (``band``)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.cuda.sampling.band import _band_race, _band_tau, _compact, _resolve, _top_k_mass
from engine.cuda.sampling.common import NO_LIMIT, RUNNERS, _best_ranked, _pick, _prev
from engine.cuda.sampling.search import (_gaussian_guess, _interpolate, _keeps, _moments, _narrow, _place_probes,
                                         _probe_pass, _search)


@triton.jit
def _filtered_token(src, scale, V, m, n_fin, w_id, row_key, k, top_p, log_min_p, c_key, c_id, b3, nb, band_v,
                    band_i, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """min_p keeps s >= max + log(min_p): lo, just below that floor. ``w_id`` raced over all and ``c_key`` /
    ``c_id`` its runners-up (k == 0); ``nb`` values above ``b3`` in the band from the stats pass (k > 0)."""
    lo = float("-inf")
    if log_min_p > float("-inf"):
        lo = _prev(m + log_min_p)
    token = w_id
    if k > 0:
        token = _lane_band_token(band_v, band_i, nb, b3, m, n_fin, k, top_p, lo, row_key, CAP)
        if token < 0:
            mean, std, s_min = _moments(src, scale, V, n_fin, BLOCK)
            token = _top_k_token(src, scale, V, m, n_fin, mean, std, s_min, row_key, k, top_p, lo, band_v, band_i,
                                 CAP, BLOCK)
    else:
        if top_p < 1.0:
            token = _top_p_token(src, scale, V, m, n_fin, row_key, top_p, lo, c_key, c_id, band_v, band_i, CAP,
                                 BLOCK)
        elif tl.load(src + w_id) * scale <= lo:  # min_p alone: the winner unless under the floor, then the best
            # runner-up over it
            token = _best_ranked(c_key, c_id, (c_key > float("-inf")) & (tl.load(src + c_id) * scale > lo))
            if token < 0:
                nb, w_key, token = _compact(src, scale, V, lo, lo, row_key, True, band_v, band_i, CAP, BLOCK)
    return token


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
def _top_p_token(src, scale, V, m, n_fin, row_key, top_p, lo, c_key, c_id, band_v, band_i, CAP: tl.constexpr,
                 BLOCK: tl.constexpr):
    """top_p without top_k (min_p in lo): one pass over RUNNERS probes measures lo (Z: what min_p keeps) and the
    values of the race's best keys but the last; the best kept of those is the answer: the winner itself in
    most rows, a runner-up in most others (p ~ (1 - top_p)^(RUNNERS - 1) of rows search). top_p alone keeps by
    mass, so that pass sums masses only, over a whole block a chunk (half the barriers and address arithmetic of
    a pass with counts); the count above lo a search starts from is n_fin without min_p, else a pass of its
    own."""
    k = tl.full((), NO_LIMIT, tl.int32)
    j = tl.arange(0, RUNNERS)
    s_c = tl.load(src + c_id) * scale
    last = tl.argmax(tl.where(c_key == tl.min(c_key, 0), c_id, -1), 0)  # the lowest ranked: it probes lo
    probes = tl.where(j == last, lo, tl.maximum(s_c, lo))
    mass = _probe_pass(src, scale, V, m, probes, 2 * BLOCK, False)[1]  # (a pass takes half of what it is given)
    z = _pick(mass, last)
    pz = top_p * z
    # top_p alone keeps by mass (k is no limit): the counts decide nothing here
    token = _best_ranked(c_key, c_id, (j != last) & (c_key > float("-inf")) & (s_c > lo) & (mass < pz))
    if token < 0:
        cl = n_fin  # the count above lo the search starts from
        if lo > float("-inf"):
            cl = _pick(_probe_pass(src, scale, V, m, tl.where(j == 0, lo, float("inf")), BLOCK)[0], 0)
        mean, std, s_min = _moments(src, scale, V, n_fin, BLOCK)
        guess = _gaussian_guess(mean, std, cl, k, top_p)
        lo, hi, cl, ml, ch, mh = _search(src, scale, V, m, s_min, lo, m, cl, z, cl * 0, z * 0.0, k, pz, guess,
                                         CAP, BLOCK)
        token = _resolve(src, scale, V, m, lo, hi, cl, ml, ch, mh, k, top_p, z, row_key, band_v, band_i, CAP, BLOCK)
    return token

"""Step 3, the threshold search: ``kept(t) = #{s > t} < top_k and mass{s > t} < top_p * Z`` holds exactly for
the values the sorted rule keeps (ties at the threshold kept) and is monotone in t. A probe pass evaluates it at
up to 8 values at once and narrows a bracket ``(lo, hi]`` (<= lo dropped, > hi kept); probes go around a Gaussian
guess (from ``_moments``), then the interpolated crossing, plus even splits, so a bracket always shrinks."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.cuda.sampling.common import (NUM_PROBES, STAGES, _exp, _from_ordered, _load_scaled, _mass_sum,
                                         _ordered)


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
        e = _exp(s - m_finite)  # e^-inf is 0 (a pass over a row with no finite value has no use for e)
        above = s[None, :] > probes[:, None]
        if COUNT:
            cnt += above.to(tl.int32)
        mass += above.to(tl.float32) * e[None, :]  # a set and a fused multiply-add, where a select takes two
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


@triton.jit
def _moment_sum(x, unit):
    """The sum of lane moments ``x`` (only the first probes' guess reads it) in fixed point, units of 1 / unit,
    clamped to +-2^50, so that the guess too is the same in any layout."""
    return tl.sum(tl.minimum(tl.maximum(x * unit, -1.0e15), 1.0e15).to(tl.int64), 0).to(tl.float32) / unit


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
    """Mean, std and minimum of the finite values, for the Gaussian guess of a search's first probes: a pass of
    their own, taken only by rows that search (top_p rows whose runners all fall outside, top_k rows past the
    lane band)."""
    lanes = tl.arange(0, BLOCK)
    s1_l = tl.zeros([BLOCK], tl.float32)
    s2_l = tl.zeros([BLOCK], tl.float32)
    min_l = tl.full([BLOCK], float("inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        s = _load_scaled(src, start + lanes, V, scale)
        s1_l, s2_l, min_l = _moments_chunk(s, s > float("-inf"), s1_l, s2_l, min_l)
    return _moments_of(n_fin, s1_l, s2_l, min_l)

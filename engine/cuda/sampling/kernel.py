"""The persistent sampling kernel: a grid of programs (``shapes.config_for``) loops over the rows, a row at a
time, each row through the passes of the modules beside this one: the processed row (``process``), the stats pass
(``stats``), the filters (``filters``: the threshold search and the band) and the logprobs."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.cuda.sampling.common import (F_LOG_MIN_P, F_TEMPERATURE, F_TOP_P, I_LOGPROBS, I_SEED_KEY, I_TOP_K, NUM_F,
                                         NUM_I)
from engine.cuda.sampling.filters import _filtered_token
from engine.cuda.sampling.process import _prepare_row, _processed_exact_token, _row_processing
from engine.cuda.sampling.race import _row_key
from engine.cuda.sampling.stats import _stats_pass, _write_top


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
    variant that has its stages. PREPARE without FILTER or LOGPROBS (exact and processed) tries the one pass
    with no scratch row first. ``V`` is a constant (a compile per vocabulary size), as the kernel was measured
    (BENCHMARKS.md, sampler)."""
    pid = tl.program_id(0)
    scratch = scratch + pid.to(tl.int64) * V
    band_v = band_v + pid * (2 * CAP)  # the band, then its values sorted (band._sort_band)
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
        if PREPARE and not FILTER and not LOGPROBS:  # exact and processed: one pass
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
    m, token, n_fin, w_id, lse, top_v, top_i, c_key, c_id, b3, nb = _stats_pass(
        src, scale, x_row, V, row_key, vkeys, sampled & (k == 0), lp_k, sampled & (k > 0), band_v, band_i,
        LOGPROBS, FILTER, BAND, not PREPARE, CAP, BLOCK)
    if sampled:
        if FILTER and (k > 0) | (top_p < 1.0) | (log_min_p > float("-inf")):
            token = _filtered_token(src, scale, V, m, n_fin, w_id, row_key, k, top_p, log_min_p, c_key, c_id, b3,
                                    nb, band_v, band_i, CAP, BLOCK)
        else:
            token = w_id
    if LOGPROBS and lp_k >= 0:
        tl.store(out_lp, tl.load(x_row + token) - lse)
        _write_top(top_v, top_i, lp_k, lse, out_top_id, out_top_lp, top_w)
    return token

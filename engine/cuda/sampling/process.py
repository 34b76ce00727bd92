"""Step 1, the processed row: penalties, the grammar's mask, logit_bias and the min_tokens ban, times
1 / temperature. Written to a scratch row (``_prepare_row``) that later passes read; or, for rows with no filters
and no logprobs, applied as the row streams by, the sparse entries matched against the race's best few keys
(``_processed_exact_token``: one read of the row where the scratch row takes two and a write)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.cuda.sampling.common import (F_FREQUENCY, F_INV_TEMPERATURE, F_PRESENCE, F_REPETITION, I_MASKED,
                                         I_MIN_TOKENS, I_NUM_BAN, I_NUM_BIAS, RUNNERS, STAGES, TABLE_BLOCK,
                                         _best_ranked, _fold_best, _top_insert)
from engine.cuda.sampling.race import (_chunk_vocab_keys, _element_hash, _neg_log_noise, _race_chunk_runners,
                                       _uniform)


@triton.jit
def _penalize(y, counts, in_prompt, mask, rep, freq, pres):
    """Repetition, frequency and presence penalties, as engine.sample_torch._apply_penalties."""
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

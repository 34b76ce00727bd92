"""The split race, for steps of very few exact rows (no filters, no logprobs): each row over many programs, each
racing (or, greedy, taking the first maximum) over its own segment and folding its best into the row's slot by
atomic max, then one small launch for the tokens and the recording. One row on one SM waits on its chunks one
after another; over many SMs each program has a chunk or two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.cuda.sampling.common import (F_INV_TEMPERATURE, F_TEMPERATURE, I_SEED_KEY, NONE_YET, NUM_F, NUM_I, STAGES,
                                         _best_ranked, _load_scaled, _packed)
from engine.cuda.sampling.process import _prepare_row, _row_processing
from engine.cuda.sampling.race import _chunk_vocab_keys, _race_chunk, _row_key
from engine.cuda.sampling.shapes import KernelConfig
from engine.cuda.sampling.workspace import SamplingWorkspace
from engine.sample_layout import DeviceSample, SlotTables


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


def sample_split(logits: torch.Tensor, slots: torch.Tensor, t: SlotTables, ws: SamplingWorkspace,
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

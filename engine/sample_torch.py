"""The torch sampling path: steps 1-5 and the logprobs of ``engine.sampler`` (its module doc) with torch ops, and
the counter-hash noise. The CPU sampler, and the twin the CUDA kernel (``engine.cuda.sampling``) is checked
against token for token; it imports without Triton."""

from __future__ import annotations

import math

import torch

from engine.sample_layout import (COUNTER_SALT, F_FREQUENCY, F_INV_TEMPERATURE, F_LOG_MIN_P, F_PRESENCE,
                                  F_REPETITION, F_TEMPERATURE, F_TOP_P, GOLDEN, I_LOGPROBS, I_MASKED, I_MIN_TOKENS,
                                  I_NUM_BAN, I_SEED_KEY, I_TOP_K, MUL1, MUL2, SEED_SALT, V_MAX, VOCAB_SALT,
                                  DeviceSample, Features, SlotTables)

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# top_k/top_p look at this many largest logits per row first (a full sort of the vocabulary only where the
# nucleus is wider): the CPU path's shortcut; the CUDA kernel needs no sort (engine.cuda.sampling).
TOP_CANDIDATES = 1024


# ------------------------------------------------------------------------------------- the noise

def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """Bijective 32-bit integer finaliser; int64 tensors (or ints) holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & _MASK32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """Fold an arbitrary Python int seed into a 32-bit key (host side, once per slot)."""
    s = seed & _MASK64
    return mix32(mix32((s & _MASK32) ^ SEED_SALT) ^ (s >> 32))


def vocab_keys(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-vocabulary-id hash, computed once: [V] int64 in [0, 2**32)."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix32(((ids * GOLDEN) & _MASK32) ^ VOCAB_SALT)


def counter_hash(keys: torch.Tensor, counters: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """32-bit hash of (seed key, counter, vocab id): keys, counters [B]; vocab keys [V] (or per row [B, K])
    -> [B, V] (or [B, K])."""
    row = mix32(keys ^ mix32((counters + COUNTER_SALT) & _MASK32))
    return mix32(row.unsqueeze(1) ^ (vocab if vocab.dim() == 2 else vocab.unsqueeze(0)))


def exponential_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Exp(1) variates [B, V] float32 from the counter hash.

    v = (h + 0.5) / 2**32 lies in (0, 1); -log1p(-v) is exact where it matters
    (small E, the race winners) since float32 keeps v's relative precision near 0.
    """
    h = counter_hash(keys, counters, vocab)
    v = h.to(torch.float32).add_(0.5).mul_(2.0 ** -32).clamp_(max=V_MAX)
    return v.neg_().log1p_().neg_()


# ------------------------------------------------------------------------------------- the path


def torch_sample(logits: torch.Tensor, slots: torch.Tensor, t: SlotTables, f: Features) -> DeviceSample:
    """Steps 1-5 and the logprobs with torch ops. On CPU the rows whose nucleus is wider than the candidates
    are found by reading a tensor (free there); on a GPU that read would be a sync: CUDA uses the kernel."""
    processed = process_logits(logits, slots, t, f)
    tokens = choose_tokens(processed, slots, t, f)
    if not f.logprobs:
        return DeviceSample(tokens)
    return DeviceSample(tokens, *raw_logprobs(logits, slots, tokens, t, f.max_logprobs))


def process_logits(logits: torch.Tensor, slots: torch.Tensor, t: SlotTables, f: Features) -> torch.Tensor:
    """Steps 1-3 (bias, min_tokens ban, penalties): the logits before temperature.

    Never modifies ``logits`` (the raw values are still needed for logprobs).
    """
    masked = f.mask and t.masks is not None
    if not (f.bias or f.ban or f.penalties or masked):
        return logits
    out = logits.clone()
    if f.bias:
        out.scatter_add_(1, t.bias_ids[slots], t.bias_vals[slots])
    if f.ban:
        ip = t.iparams[slots]
        active = (t.generated[slots] < ip[:, I_MIN_TOKENS]).unsqueeze(1)
        valid = torch.arange(t.ban_ids.shape[1], device=out.device) < ip[:, I_NUM_BAN:I_NUM_BAN + 1]
        ban = torch.where(valid & active, -math.inf, 0.0).to(out.dtype)
        out.scatter_add_(1, t.ban_ids[slots], ban)
    if f.penalties and t.output_counts is not None:
        out = _apply_penalties(out, slots, t)
    if masked:
        out = _apply_masks(out, slots, t)
    return out


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask rows [B, W] -> bool [B, V] (bit j of word i: token 32 i + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(2) >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def _apply_masks(out: torch.Tensor, slots: torch.Tensor, t: SlotTables) -> torch.Tensor:
    constrained = (t.iparams[slots, I_MASKED] != 0).unsqueeze(1)
    forbidden = constrained & ~allowed_tokens(t.masks[slots], out.shape[1])
    return out.masked_fill(forbidden, -math.inf)


def _apply_penalties(out: torch.Tensor, slots: torch.Tensor, t: SlotTables) -> torch.Tensor:
    fp = t.fparams[slots]
    counts = t.output_counts[slots]
    seen_out = counts > 0
    rep = fp[:, F_REPETITION:F_REPETITION + 1]
    seen = seen_out | t.prompt_mask[slots]
    penalised = torch.where(out > 0, out / rep, out * rep)
    out = torch.where(seen, penalised, out)
    out = out - fp[:, F_FREQUENCY:F_FREQUENCY + 1] * counts.to(out.dtype)
    return out - fp[:, F_PRESENCE:F_PRESENCE + 1] * seen_out.to(out.dtype)


def choose_tokens(processed: torch.Tensor, slots: torch.Tensor, t: SlotTables, f: Features) -> torch.Tensor:
    """Step 4-5: argmax for greedy rows, the exponential race over the kept tokens for the others."""
    if not f.sampled:
        return processed.argmax(dim=1)
    greedy_rows = t.fparams[slots, F_TEMPERATURE] == 0.0
    scaled = scaled_logits(processed, slots, t, f.min_p)
    if f.top_p or f.top_k:
        tokens, complete = sample_candidates(scaled, slots, t, min(scaled.shape[1], TOP_CANDIDATES))
        wide = ~(complete | greedy_rows)
        if bool(wide.any()):  # the same counters, so the same noise: the full sort picks its token
            idx = wide.nonzero().squeeze(1)
            tokens[idx] = sample_candidates(scaled[idx], slots[idx], t, scaled.shape[1])[0]
    else:
        tokens = race(scaled, slots, t)
    if f.greedy:
        tokens = torch.where(greedy_rows, processed.argmax(dim=1), tokens)
    return tokens


def scaled_logits(processed: torch.Tensor, slots: torch.Tensor, t: SlotTables, min_p: bool) -> torch.Tensor:
    """Logits times 1 / temperature (greedy rows: 1), min_p applied. The kernel multiplies by the same stored
    reciprocal and adds the same stored log(min_p), so both round alike."""
    fp = t.fparams[slots]
    scaled = processed * fp[:, F_INV_TEMPERATURE:F_INV_TEMPERATURE + 1]
    if min_p:
        # p < min_p * p_max  <=>  logit < logit_max + log(min_p)  (no softmax needed)
        floor = scaled.amax(dim=1, keepdim=True) + fp[:, F_LOG_MIN_P:F_LOG_MIN_P + 1]
        scaled = scaled.masked_fill(scaled < floor, -math.inf)
    return scaled


def _noise(slots: torch.Tensor, t: SlotTables, vocab: torch.Tensor) -> torch.Tensor:
    return exponential_noise(t.iparams[slots, I_SEED_KEY], t.generated[slots], vocab)


def race(scaled: torch.Tensor, slots: torch.Tensor, t: SlotTables) -> torch.Tensor:
    # argmax p_i / E_i  ==  argmax (logit_i / T - log E_i); masked tokens stay -inf.
    return (scaled - torch.log(_noise(slots, t, t.vocab_keys))).argmax(dim=1)


def sample_candidates(scaled: torch.Tensor, slots: torch.Tensor, t: SlotTables,
                      n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k (then top_p on what is left, as vLLM) on the row's ``n`` largest logits, and the race run on
    those candidates only (the counter hash gives each vocabulary id the same noise either way); ``n`` =
    the vocabulary size is the full sort. Returns (tokens, complete): a row is complete when every token
    its top_k/top_p keep — ties at the threshold included — is a candidate; the caller re-samples the
    others with the full sort."""
    v = scaled.shape[1]
    raw, ids = scaled.sort(dim=1, descending=True) if n == v else scaled.topk(n, dim=1)
    k = t.iparams[slots, I_TOP_K]
    k = torch.where(k > 0, k.clamp(max=v), v)
    pos = torch.arange(n, device=scaled.device).unsqueeze(0)
    vals = raw.masked_fill(pos >= k.unsqueeze(1), -math.inf)
    # probabilities over what top_k allows: the candidates when k <= n, else the whole row
    log_z = torch.where(k <= n, torch.logsumexp(vals, dim=1), torch.logsumexp(scaled, dim=1))
    probs = torch.exp(vals - log_z.unsqueeze(1))
    before = probs.cumsum(dim=1) - probs  # mass strictly ahead of each position
    top_p = t.fparams[slots, F_TOP_P].unsqueeze(1)
    # Keep while the mass before a token is < top_p: the smallest set with mass >= top_p, never empty.
    # top_p == 1 keeps all, whatever the float error of the cumsum.
    keep = ((before < top_p) | (top_p >= 1.0)) & (vals > -math.inf)
    n_keep = keep.sum(dim=1, keepdim=True).clamp(min=1)
    threshold = vals.gather(1, n_keep - 1)
    complete = (raw[:, -1:] < threshold).squeeze(1) & ((k <= n) | (k == v))
    if n == v:
        complete = torch.ones_like(complete)
    noise = _noise(slots, t, t.vocab_keys[ids])
    race_keys = raw.masked_fill(raw < threshold, -math.inf) - torch.log(noise)
    return ids.gather(1, race_keys.argmax(dim=1, keepdim=True)).squeeze(1), complete


def raw_logprobs(logits: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, t: SlotTables,
                 max_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k per row, the chosen token's logprob, top-``max_k`` ids and logprobs), from the raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top = logprobs.topk(min(max_k, logits.shape[1]), dim=1)
    return t.iparams[slots, I_LOGPROBS], chosen, top.indices, top.values


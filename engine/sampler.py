"""Batched, vectorised token sampling for the continuous-batching engine.

The engine owns ``num_slots`` sequence slots.  A sequence's sampling parameters
live in per-slot device tensors (written once, in :meth:`Sampler.reset_slot`),
so one :meth:`Sampler.sample` call handles any mix of slots with tensor ops and
a single device-to-host transfer at the end.

Processing order follows vLLM, penalties follow the OpenAI meanings:

1. ``logit_bias`` (additive, sparse per slot)
2. while fewer than ``min_tokens`` were generated: ban eos / ``stop_token_ids``
3. ``repetition_penalty`` (prompt or output tokens), ``frequency_penalty`` and
   ``presence_penalty`` (output tokens only)
4. ``temperature == 0`` -> argmax; otherwise multiply by 1 / temperature
5. ``min_p``, then ``top_k``, then ``top_p`` (on what is left), then sample.

Constrained rows (``params.structured``) also drop every token their grammar's bitmask forbids, after the
penalties (``engine.grammar`` fills each step's masks before the sampling is launched).

Logprobs are taken from the raw logits (vLLM's default ``raw_logprobs``).

Randomness is counter-based: the uniform for (slot seed, tokens generated so
far, vocabulary id) is an integer hash of those three, so a sequence's tokens
do not depend on its slot, its row, or its neighbours in the batch, and no
``torch.Generator`` state exists to save, copy or keep in step.

On CUDA one fused Triton kernel (``engine.cuda.sampling``) does steps 1-5 and
the logprobs; the torch functions here are its twin and the CPU path. Both
sample the token the exponential race picks among the kept tokens, so they
agree token for token on the same logits and counters (float rounding aside).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.device import HostCopy, to_device
from engine.params import SamplingParams

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# "lowbias32"-style finaliser constants from Wellons' hash-prospector.  Both are
# below 2**31, so a 32-bit value times either fits in a signed int64: we get the
# exact product mod 2**32 with one multiply and one mask, never an overflow.
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_GOLDEN = 0x9E3779B9
_SEED_SALT = 0x5BD1E995
_COUNTER_SALT = 0x68E31DA4
_VOCAB_SALT = 0x1B56C4E9
# top_k/top_p look at this many largest logits per row first (a full sort of the vocabulary only where the
# nucleus is wider): the CPU path's shortcut; the CUDA kernel needs no sort (engine.cuda.sampling).
TOP_CANDIDATES = 1024
# Largest float32 below 1: keeps -log1p(-v) finite.
_V_MAX = 1.0 - 2.0 ** -24

# columns of the per-slot parameter tables (the kernel reads the same)
F_TEMPERATURE, F_TOP_P, F_MIN_P, F_PRESENCE, F_FREQUENCY, F_REPETITION, F_INV_TEMPERATURE, F_LOG_MIN_P = range(8)
NUM_F = 8
I_TOP_K, I_MIN_TOKENS, I_LOGPROBS, I_SEED_KEY, I_NUM_BIAS, I_NUM_BAN, I_MASKED = range(7)
NUM_I = 7


def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """Bijective 32-bit integer finaliser; int64 tensors (or ints) holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """Fold an arbitrary Python int seed into a 32-bit key (host side, once per slot)."""
    s = seed & _MASK64
    return mix32(mix32((s & _MASK32) ^ _SEED_SALT) ^ (s >> 32))


def vocab_keys(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-vocabulary-id hash, computed once: [V] int64 in [0, 2**32)."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix32(((ids * _GOLDEN) & _MASK32) ^ _VOCAB_SALT)


def counter_hash(keys: torch.Tensor, counters: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """32-bit hash of (seed key, counter, vocab id): keys, counters [B]; vocab keys [V] (or per row [B, K])
    -> [B, V] (or [B, K])."""
    row = mix32(keys ^ mix32((counters + _COUNTER_SALT) & _MASK32))
    return mix32(row.unsqueeze(1) ^ (vocab if vocab.dim() == 2 else vocab.unsqueeze(0)))


def exponential_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Exp(1) variates [B, V] float32 from the counter hash.

    v = (h + 0.5) / 2**32 lies in (0, 1); -log1p(-v) is exact where it matters
    (small E, the race winners) since float32 keeps v's relative precision near 0.
    """
    h = counter_hash(keys, counters, vocab)
    v = h.to(torch.float32).add_(0.5).mul_(2.0 ** -32).clamp_(max=_V_MAX)
    return v.neg_().log1p_().neg_()


@dataclass
class SampleOutput:
    token_ids: list[int]
    # Per row; NaN for rows whose params did not ask for logprobs.  None if no row asked.
    logprobs: list[float] | None = None
    # Per row; [] for rows that did not ask.  None if no row asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None


class DeviceSample(NamedTuple):
    """One step's results, still on the device: the overlapped step loop reads them a step later."""
    tokens: torch.Tensor                        # [B] int64
    logprobs_k: torch.Tensor | None = None      # [B] int64: each row's k, -1 where it asked for none
    logprobs: torch.Tensor | None = None        # [B] float32: the chosen token's raw logprob
    top_ids: torch.Tensor | None = None         # [B, K] int64, K = the batch's largest k
    top_logprobs: torch.Tensor | None = None    # [B, K] float32

    def to_host(self) -> SampleOutput:
        """One device-to-host transfer, then plain lists (the serial way; the loop uses ``start_transfer``)."""
        return self.unpack(self.pack().tolist(), self.logprobs is not None)

    def start_transfer(self) -> PendingSample:
        """Start the one device-to-host copy now (non-blocking); read it later with ``result()``."""
        return PendingSample(HostCopy(self.pack()), self.logprobs is not None)

    def pack(self) -> torch.Tensor:
        """Everything the host needs in one tensor: the tokens, or [token, k, logprob, top ids, top logprobs]
        rows in float64 (exact for token ids)."""
        if self.logprobs is None:
            return self.tokens
        cols = [self.tokens.unsqueeze(1), self.logprobs_k.unsqueeze(1), self.logprobs.unsqueeze(1),
                self.top_ids, self.top_logprobs]
        return torch.cat([c.to(torch.float64) for c in cols], dim=1)

    @staticmethod
    def unpack(rows: list, has_logprobs: bool) -> SampleOutput:
        if not has_logprobs:
            return SampleOutput(token_ids=rows)
        max_k = (len(rows[0]) - 3) // 2 if rows else 0
        tokens, lps, tops = [], [], []
        for row in rows:
            tokens.append(int(row[0]))
            k = int(row[1])
            lps.append(row[2] if k >= 0 else math.nan)
            ids, vals = row[3:3 + max_k], row[3 + max_k:]
            tops.append([(int(ids[j]), vals[j]) for j in range(min(max(k, 0), max_k))])
        return SampleOutput(token_ids=tokens, logprobs=lps, top_logprobs=tops)


class PendingSample(NamedTuple):
    """A step's results on their way to the host (see DeviceSample.start_transfer)."""
    copy: HostCopy
    has_logprobs: bool

    def result(self) -> SampleOutput:
        """Waits for the copy (the GPU may still be on the step), then unpacks."""
        return DeviceSample.unpack(self.copy.wait().tolist(), self.has_logprobs)


class SlotTables(NamedTuple):
    """The per-slot state one sampling step reads (row = slot); the kernel and the torch path take the same."""
    fparams: torch.Tensor                 # [S, NUM_F] float32, columns F_*
    iparams: torch.Tensor                 # [S, NUM_I] int64, columns I_*
    generated: torch.Tensor               # [S] int64: tokens generated so far (the noise counter)
    bias_ids: torch.Tensor                # [S, W] int64, sorted; the first I_NUM_BIAS valid, padding (0, 0.0)
    bias_vals: torch.Tensor               # [S, W] float32
    ban_ids: torch.Tensor                 # [S, W'] int64; the first I_NUM_BAN valid, while < min_tokens
    vocab_keys: torch.Tensor              # [V] int64
    output_counts: torch.Tensor | None    # [S, V] int32, allocated when a slot first needs penalties
    prompt_mask: torch.Tensor | None      # [S, V] bool
    masks: torch.Tensor | None = None     # [S, ceil(V / 32)] int32 allowed-token bits, where I_MASKED; else None


@dataclass(frozen=True)
class Features:
    """Which optional stages a step runs: decided from the host mirror of the occupied slots' params, never
    from tensor values. Every stage is the identity for rows that do not use it, so running more is only
    slower (``everything`` runs all: the kernel's twin)."""
    sampled: bool = False
    greedy: bool = False
    min_p: bool = False
    top_p: bool = False
    top_k: bool = False
    bias: bool = False
    ban: bool = False
    penalties: bool = False
    logprobs: bool = False
    max_logprobs: int = 0
    mask: bool = False

    @classmethod
    def of(cls, live: list[tuple[SamplingParams, bool]]) -> Features:
        """From (params, has an active min_tokens ban) of each occupied slot."""
        sampled = [p for p, _ in live if not p.is_greedy]
        return cls(sampled=bool(sampled), greedy=any(p.is_greedy for p, _ in live),
                   min_p=any(p.min_p > 0.0 for p in sampled), top_p=any(p.top_p < 1.0 for p in sampled),
                   top_k=any(p.top_k > 0 for p in sampled), bias=any(p.logit_bias for p, _ in live),
                   ban=any(ban for _, ban in live), penalties=any(p.needs_penalties for p, _ in live),
                   logprobs=any(p.logprobs is not None for p, _ in live),
                   max_logprobs=max((p.logprobs or 0 for p, _ in live), default=0),
                   mask=any(p.structured is not None for p, _ in live))

    @property
    def filtered(self) -> bool:
        """A truncation filter runs (min_p, top_p or top_k): the kernel's filter variants."""
        return self.min_p or self.top_p or self.top_k

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy and nothing else asked: the token is the row's argmax (the lowest id among equal
        maxima, as the kernel picks)."""
        return self.greedy and not (self.sampled or self.bias or self.ban or self.penalties or self.logprobs
                                    or self.mask)

    @classmethod
    def everything(cls, max_logprobs: int = 0) -> Features:
        return cls(True, True, True, True, True, True, True, True, True, max_logprobs, True)


# ------------------------------------------------------------- the torch path (CPU, and the kernel's twin)

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


# ------------------------------------------------------------------------------------- the sampler

class Admission(NamedTuple):
    """A sequence given a slot: what ``Sampler.reset_slots`` writes there."""
    slot: int
    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]


class _SlotRow(NamedTuple):
    """One admission's rows of the slot tables."""
    fparams: list[float]
    iparams: list[int]
    bias: list[tuple[int, float]]
    ban: list[int]


@functools.lru_cache(maxsize=1024)
def rounded_once(temperature: float, min_p: float) -> tuple[float, float]:
    """1 / temperature (greedy rows: 1) and log(min_p) (-inf for 0: no floor), rounded to float32 once for both
    sampling paths; cached, as most requests share a few values (two scalar tensor ops a sequence otherwise)."""
    f32 = dict(dtype=torch.float32)
    inv_t = torch.tensor(1.0, **f32) / torch.tensor(temperature if temperature > 0.0 else 1.0, **f32)
    return float(inv_t), float(torch.log(torch.tensor(min_p, **f32)))


class Sampler:
    """Per-slot sampling state plus one batched ``sample`` step.

    Which optional stages run (bias, ban, penalties, min_p, top_k/top_p, logprobs)
    is decided from a host-side mirror of the occupied slots' params, never from
    tensor values.  Every stage is the identity for rows that do not use it, so
    a stale flag (a finished slot not yet reused) costs time, not correctness;
    ``release_slot`` drops it sooner.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str = "cpu",
                 use_kernel: bool | None = None) -> None:
        """``use_kernel``: sample with the fused Triton kernel (default: on CUDA); False = the torch path."""
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        dev = self.device
        self._fparams = torch.zeros(num_slots, NUM_F, dtype=torch.float32, device=dev)
        self._iparams = torch.zeros(num_slots, NUM_I, dtype=torch.int64, device=dev)
        self._generated = torch.zeros(num_slots, dtype=torch.int64, device=dev)
        self._vocab_keys = vocab_keys(vocab_size, dev)
        # Sparse per-slot tables, widened on demand; padding is (id 0, value 0).
        self._bias_ids = torch.zeros(num_slots, 0, dtype=torch.int64, device=dev)
        self._bias_vals = torch.zeros(num_slots, 0, dtype=torch.float32, device=dev)
        self._ban_ids = torch.zeros(num_slots, 0, dtype=torch.int64, device=dev)
        # [num_slots, V] penalty state, allocated the first time a slot needs penalties.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        # [num_slots, V / 32] allowed-token bits of constrained slots, allocated the first time one is admitted
        self.masks: torch.Tensor | None = None
        # Host mirror of each occupied slot's params: drives which work a step must do.
        self._host: list[SamplingParams | None] = [None] * num_slots
        self._has_ban: list[bool] = [False] * num_slots
        self._flags: Features | None = None
        self._kernel = self._kernel_workspace(use_kernel)

    def _kernel_workspace(self, use_kernel: bool | None):
        if use_kernel is None:
            use_kernel = self.device.type == "cuda"
        if not use_kernel:
            return None
        from engine.cuda.sampling import SamplingWorkspace
        return SamplingWorkspace(self.vocab_size, self.device)

    @property
    def tables(self) -> SlotTables:
        return SlotTables(self._fparams, self._iparams, self._generated, self._bias_ids, self._bias_vals,
                          self._ban_ids, self._vocab_keys, self.output_counts, self.prompt_mask, self.masks)

    # ------------------------------------------------------------------ slots

    def reset_slot(self, slot: int, params: SamplingParams, seed: int,
                   prompt_token_ids: Sequence[int], eos_token_ids: Sequence[int] = (0,)) -> None:
        """Admit a sequence into ``slot``: store its params, zero its counters."""
        self.reset_slots([Admission(slot, params, seed, prompt_token_ids)], eos_token_ids)

    def reset_slots(self, admissions: Sequence[Admission], eos_token_ids: Sequence[int] = (0,),
                    slot_index: torch.Tensor | None = None) -> None:
        """Admit sequences into their slots: every table written by one copy for all of them (on CUDA a
        per-sequence write was ~8 small launches and 2 pinned copies: 64 prompts admitted in a step queued
        ~500 launches behind the running step). Checks everything before writing anything. ``slot_index``:
        the admissions' slots already on the device (the runner's, shared with the state reset)."""
        rows = [self._admission_row(a, eos_token_ids) for a in admissions]
        if not rows:
            return
        slots = [a.slot for a in admissions]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot was admitted twice in one call: {slots}")
        n, idx = len(rows), slot_index if slot_index is not None else to_device(slots, torch.long, self.device)
        self._fparams.index_copy_(0, idx, to_device([v for r in rows for v in r.fparams], torch.float32,
                                                    self.device).view(n, NUM_F))
        self._iparams.index_copy_(0, idx, to_device([v for r in rows for v in r.iparams], torch.int64,
                                                    self.device).view(n, NUM_I))
        self._generated.index_fill_(0, idx, 0)
        self._bias_ids, self._bias_vals = self._widen(self._bias_ids, self._bias_vals,
                                                      max(len(r.bias) for r in rows))
        self._write_rows(self._bias_ids, idx, [[i for i, _ in r.bias] for r in rows], torch.int64)
        self._write_rows(self._bias_vals, idx, [[b for _, b in r.bias] for r in rows], torch.float32)
        self._ban_ids = self._widen(self._ban_ids, None, max(len(r.ban) for r in rows))[0]
        self._write_rows(self._ban_ids, idx, [r.ban for r in rows], torch.int64)
        self._reset_penalty_state(idx, admissions)
        if self.masks is None and any(a.params.structured is not None for a in admissions):
            self.masks = torch.full((self.num_slots, (self.vocab_size + 31) // 32), -1, dtype=torch.int32,
                                    device=self.device)
        for a, r in zip(admissions, rows):
            self._host[a.slot] = a.params
            self._has_ban[a.slot] = bool(r.ban)
        self._flags = None

    def _admission_row(self, a: Admission, eos_token_ids: Sequence[int]) -> _SlotRow:
        """One admission's table rows, checked (nothing is written before every admission passed)."""
        self._check_slot(a.slot)
        params = a.params
        # An out-of-range id would be a device-side assert on CUDA: refuse it here.
        params.validate(self.vocab_size)
        for name, ids in (("prompt_token_ids", a.prompt_token_ids), ("eos_token_ids", eos_token_ids)):
            if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
                raise ValueError(f"{name} must lie in 0..{self.vocab_size - 1}")
        bias = sorted(params.logit_bias.items())
        # vLLM: eos is a stop token unless ignore_eos; all are banned until min_tokens.
        ban = set(params.stop_token_ids)
        if not params.ignore_eos:
            ban.update(eos_token_ids)
        ban_list = sorted(ban) if params.min_tokens > 0 else []
        inv_t, log_min_p = rounded_once(params.temperature, params.min_p)
        fparams = [params.temperature, params.top_p, params.min_p, params.presence_penalty,
                   params.frequency_penalty, params.repetition_penalty, inv_t, log_min_p]
        k = -1 if params.logprobs is None else params.logprobs
        iparams = [max(params.top_k, 0), params.min_tokens, k, seed_key(a.seed), len(bias), len(ban_list),
                   int(params.structured is not None)]
        return _SlotRow(fparams, iparams, bias, ban_list)

    def _write_rows(self, table: torch.Tensor, idx: torch.Tensor, rows: list[list], dtype: torch.dtype) -> None:
        """The admitted slots' whole rows of a padded sparse table (padding 0), in one copy."""
        width = table.shape[1]
        if width == 0:
            return
        flat = [v for row in rows for v in (*row, *[0] * (width - len(row)))]
        table.index_copy_(0, idx, to_device(flat, dtype, self.device).view(len(rows), width))

    def _reset_penalty_state(self, idx: torch.Tensor, admissions: Sequence[Admission]) -> None:
        if self.output_counts is None and any(a.params.needs_penalties for a in admissions):
            v = self.vocab_size
            self.output_counts = torch.zeros(self.num_slots, v, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.num_slots, v, dtype=torch.bool, device=self.device)
        if self.output_counts is None:
            return
        self.output_counts.index_fill_(0, idx, 0)
        self.prompt_mask.index_fill_(0, idx, False)
        marked = [(a.slot, t) for a in admissions if a.params.repetition_penalty != 1.0 for t in a.prompt_token_ids]
        if marked:  # the prompts' tokens, for repetition_penalty: one scatter for all of them
            where = to_device([x for pair in marked for x in pair], torch.int64, self.device).view(-1, 2)
            self.prompt_mask[where[:, 0], where[:, 1]] = True

    def copy_slot(self, src: int, dst: int, seed: int) -> None:
        """Fork ``src`` into ``dst`` (n > 1 after a shared prompt): same state, new seed."""
        self._check_slot(src)
        self._check_slot(dst)
        if self._host[src] is None:
            raise ValueError(f"slot {src} holds no sequence")
        for t in (self._fparams, self._iparams, self._generated, self._bias_ids, self._bias_vals, self._ban_ids):
            t[dst] = t[src]
        if self.output_counts is not None:
            self.output_counts[dst] = self.output_counts[src]
            self.prompt_mask[dst] = self.prompt_mask[src]
        self._iparams[dst, I_SEED_KEY] = seed_key(seed)
        self._host[dst] = self._host[src]
        self._has_ban[dst] = self._has_ban[src]
        self._flags = None

    def write_masks(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The allowed-token bits of constrained ``slots`` [k] for the next sampling: ``rows`` [k, V / 32]
        int32 (pinned host memory: the copy does not wait for the device)."""
        self.masks.index_copy_(0, slots, rows.to(self.device, non_blocking=True))

    def release_slot(self, slot: int) -> None:
        """Optional: forget a finished sequence so its features stop costing work."""
        self._check_slot(slot)
        self._host[slot] = None
        self._has_ban[slot] = False
        self._flags = None

    # ---------------------------------------------------------------- sampling

    def process_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Steps 1-3 (bias, min_tokens ban, penalties) with torch: the logits before temperature."""
        return process_logits(logits, slots, self.tables, self._features())

    def sample_device(self, logits: torch.Tensor, slots: torch.Tensor) -> DeviceSample:
        """One token per row of ``logits`` [B, V] for ``slots`` [B], left on the device; records the tokens
        (counters and penalty counts, on the device). On CUDA: launches only, no transfer, no sync."""
        f = self._features()
        if f.plain_greedy:  # a plain reduction (the kernel's greedy rows also gather the filters' statistics)
            tokens = logits.argmax(dim=-1)
            self._record(slots, tokens)
            return DeviceSample(tokens)
        if self._kernel is not None:
            from engine.cuda.sampling import sample_rows
            return sample_rows(logits, slots, self.tables, f, self._kernel, record=True)
        out = torch_sample(logits, slots, self.tables, f)
        self._record(slots, out.tokens)
        return out

    def sample(self, logits: torch.Tensor, slots: torch.Tensor) -> SampleOutput:
        """``sample_device`` and the step's one device-to-host transfer."""
        return self.sample_device(logits, slots).to_host()

    def warm_up(self, batch_sizes: Sequence[int]) -> None:
        """Compile (and run once) every kernel variant a step can launch, at each batch size, so that no
        request waits for Triton. Slot state is left untouched. A no-op on the torch path."""
        if self._kernel is None:
            return
        from engine.cuda.sampling import warm_up
        warm_up(self.tables, self._kernel, batch_sizes)

    # ---------------------------------------------------------------- internals

    def _record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        # counts only while a live slot has penalties (a slot's counts are zeroed when it is admitted): once
        # the last such request is gone, steps drop the penalty stage again (and on CUDA its kernel variant)
        if self.output_counts is not None and self._features().penalties:
            ones = torch.ones_like(tokens, dtype=torch.int32)
            self.output_counts.index_put_((slots, tokens), ones, accumulate=True)
        self._generated.index_add_(0, slots, torch.ones_like(slots))

    def _features(self) -> Features:
        """Which optional stages any occupied slot needs (host-side, no device sync)."""
        if self._flags is None:
            self._flags = Features.of([(p, ban) for p, ban in zip(self._host, self._has_ban) if p is not None])
        return self._flags

    def _widen(self, ids: torch.Tensor, vals: torch.Tensor | None,
               need: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Grow a padded [num_slots, L] table to hold ``need`` entries (powers of two)."""
        have = ids.shape[1]
        if need <= have:
            return ids, vals
        width = max(4, 1 << (need - 1).bit_length())
        new_ids = torch.zeros(self.num_slots, width, dtype=ids.dtype, device=self.device)
        new_ids[:, :have] = ids
        if vals is None:
            return new_ids, None
        new_vals = torch.zeros(self.num_slots, width, dtype=vals.dtype, device=self.device)
        new_vals[:, :have] = vals
        return new_ids, new_vals

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")


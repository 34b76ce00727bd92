"""What the torch sampler (``engine.sample_torch``, ``engine.sampler``) and the CUDA kernel
(``engine.cuda.sampling``) share: the per-slot tables' columns, the counter hash's constants, and the types a
sampling step reads and returns. Both sides import this module; neither imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.device import HostCopy
from engine.params import SamplingParams

# "lowbias32"-style finaliser constants from Wellons' hash-prospector.  Both are
# below 2**31, so a 32-bit value times either fits in a signed int64: we get the
# exact product mod 2**32 with one multiply and one mask, never an overflow.
MUL1 = 0x21F0AAAD
MUL2 = 0x735A2D97
GOLDEN = 0x9E3779B9
SEED_SALT = 0x5BD1E995
COUNTER_SALT = 0x68E31DA4
VOCAB_SALT = 0x1B56C4E9
# Largest float32 below 1: keeps -log1p(-v) finite.
V_MAX = 1.0 - 2.0 ** -24

# columns of the per-slot parameter tables
F_TEMPERATURE, F_TOP_P, F_MIN_P, F_PRESENCE, F_FREQUENCY, F_REPETITION, F_INV_TEMPERATURE, F_LOG_MIN_P = range(8)
NUM_F = 8
I_TOP_K, I_MIN_TOKENS, I_LOGPROBS, I_SEED_KEY, I_NUM_BIAS, I_NUM_BAN, I_MASKED = range(7)
NUM_I = 7


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

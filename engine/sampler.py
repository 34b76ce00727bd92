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
4. ``temperature == 0`` -> argmax; otherwise divide by the temperature
5. ``min_p``, then ``top_k``, then ``top_p`` (on what is left), then sample.

Logprobs are taken from the raw logits (vLLM's default ``raw_logprobs``).

Randomness is counter-based: the uniform for (slot seed, tokens generated so
far, vocabulary id) is an integer hash of those three, so a sequence's tokens
do not depend on its slot, its row, or its neighbours in the batch, and no
``torch.Generator`` state exists to save, copy or keep in step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
# top_k/top_p look at this many largest logits per row first (a full sort of 65,536 only where the
# nucleus is wider). H200, top_p 0.9 on peaked logits (σ=6, a trained model's kind): 2.33 ms at batch 1,024
# (full sort 14.5), 1.50 ms at batch 1 (1.52); where most rows fall back (wide logits: random weights) it
# costs the candidates plus the sort.
TOP_CANDIDATES = 1024
# Largest float32 below 1: keeps -log1p(-v) finite.
_V_MAX = 1.0 - 2.0 ** -24


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


class Sampler:
    """Per-slot sampling state plus one vectorised ``sample`` step.

    Which optional stages run (bias, ban, penalties, min_p, top_k/top_p, logprobs)
    is decided from a host-side mirror of the occupied slots' params, never from
    tensor values.  Every stage is the identity for rows that do not use it, so
    a stale flag (a finished slot not yet reused) costs time, not correctness;
    ``release_slot`` drops it sooner.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str = "cpu",
                 compile_noise: bool = False) -> None:
        """``compile_noise``: fuse the [B, V] hash + log into one kernel with torch.compile.
        Same values; on an H200 (B=256, V=65536) the noise took 0.14 ms instead of 1.3 ms.
        Costs a compile on first use, so it is off by default (and for CPU tests)."""
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        dev = self.device
        # Float params, one row per slot: written with one copy per reset.
        self._fparams = torch.zeros(num_slots, 6, dtype=torch.float32, device=dev)
        self._temperature = self._fparams[:, 0]
        self._top_p = self._fparams[:, 1]
        self._min_p = self._fparams[:, 2]
        self._presence = self._fparams[:, 3]
        self._frequency = self._fparams[:, 4]
        self._repetition = self._fparams[:, 5]
        # Int params: top_k (0 = off), min_tokens, logprobs k (-1 = none), seed key.
        self._iparams = torch.zeros(num_slots, 4, dtype=torch.int64, device=dev)
        self._top_k = self._iparams[:, 0]
        self._min_tokens = self._iparams[:, 1]
        self._logprobs_k = self._iparams[:, 2]
        self._seed_key = self._iparams[:, 3]
        self._generated = torch.zeros(num_slots, dtype=torch.int64, device=dev)
        self._vocab_keys = vocab_keys(vocab_size, dev)
        self._noise = torch.compile(exponential_noise, dynamic=True) if compile_noise else exponential_noise
        # Sparse per-slot tables, widened on demand; padding is (id 0, value 0 / not banned).
        self._bias_ids = torch.zeros(num_slots, 0, dtype=torch.int64, device=dev)
        self._bias_vals = torch.zeros(num_slots, 0, dtype=torch.float32, device=dev)
        self._ban_ids = torch.zeros(num_slots, 0, dtype=torch.int64, device=dev)
        self._ban_valid = torch.zeros(num_slots, 0, dtype=torch.bool, device=dev)
        # [num_slots, V] penalty state, allocated the first time a slot needs penalties.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        # Host mirror of each occupied slot's params: drives which work a step must do.
        self._host: list[SamplingParams | None] = [None] * num_slots
        self._has_ban: list[bool] = [False] * num_slots
        self._flags: dict[str, int | bool] | None = None

    # ------------------------------------------------------------------ slots

    def reset_slot(self, slot: int, params: SamplingParams, seed: int,
                   prompt_token_ids: Sequence[int], eos_token_ids: Sequence[int] = (0,)) -> None:
        """Admit a sequence into ``slot``: store its params, zero its counters."""
        self._check_slot(slot)
        # An out-of-range id would be a device-side assert on CUDA: refuse it here.
        params.validate(self.vocab_size)
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("eos_token_ids", eos_token_ids)):
            if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
                raise ValueError(f"{name} must lie in 0..{self.vocab_size - 1}")
        dev = self.device
        top_k = params.top_k if params.top_k > 0 else 0
        self._fparams[slot] = torch.tensor(
            [params.temperature, params.top_p, params.min_p, params.presence_penalty,
             params.frequency_penalty, params.repetition_penalty], dtype=torch.float32)
        k = -1 if params.logprobs is None else params.logprobs
        self._iparams[slot] = torch.tensor(
            [top_k, params.min_tokens, k, seed_key(seed)], dtype=torch.int64)
        self._generated[slot] = 0

        bias = sorted(params.logit_bias.items())
        self._bias_ids, self._bias_vals = self._widen(self._bias_ids, self._bias_vals, len(bias))
        self._bias_ids[slot] = 0
        self._bias_vals[slot] = 0.0
        if bias:
            self._bias_ids[slot, :len(bias)] = torch.tensor([i for i, _ in bias], dtype=torch.int64)
            self._bias_vals[slot, :len(bias)] = torch.tensor([b for _, b in bias], dtype=torch.float32)

        # vLLM: eos is a stop token unless ignore_eos; all are banned until min_tokens.
        ban = set(params.stop_token_ids)
        if not params.ignore_eos:
            ban.update(eos_token_ids)
        ban_list = sorted(ban) if params.min_tokens > 0 else []
        self._ban_ids, self._ban_valid = self._widen(self._ban_ids, self._ban_valid, len(ban_list))
        self._ban_ids[slot] = 0
        self._ban_valid[slot] = False
        if ban_list:
            self._ban_ids[slot, :len(ban_list)] = torch.tensor(ban_list, dtype=torch.int64)
            self._ban_valid[slot, :len(ban_list)] = True

        if params.needs_penalties and self.output_counts is None:
            v = self.vocab_size
            self.output_counts = torch.zeros(self.num_slots, v, dtype=torch.int32, device=dev)
            self.prompt_mask = torch.zeros(self.num_slots, v, dtype=torch.bool, device=dev)
        if self.output_counts is not None:
            self.output_counts[slot] = 0
            self.prompt_mask[slot] = False
            if params.repetition_penalty != 1.0 and prompt_token_ids:
                ids = torch.tensor(prompt_token_ids, dtype=torch.int64).to(dev)
                self.prompt_mask[slot, ids] = True

        self._host[slot] = params
        self._has_ban[slot] = bool(ban_list)
        self._flags = None

    def copy_slot(self, src: int, dst: int, seed: int) -> None:
        """Fork ``src`` into ``dst`` (n > 1 after a shared prompt): same state, new seed."""
        self._check_slot(src)
        self._check_slot(dst)
        if self._host[src] is None:
            raise ValueError(f"slot {src} holds no sequence")
        for t in (self._fparams, self._iparams, self._generated, self._bias_ids,
                  self._bias_vals, self._ban_ids, self._ban_valid):
            t[dst] = t[src]
        if self.output_counts is not None:
            self.output_counts[dst] = self.output_counts[src]
            self.prompt_mask[dst] = self.prompt_mask[src]
        self._seed_key[dst] = seed_key(seed)
        self._host[dst] = self._host[src]
        self._has_ban[dst] = self._has_ban[src]
        self._flags = None

    def release_slot(self, slot: int) -> None:
        """Optional: forget a finished sequence so its features stop costing work."""
        self._check_slot(slot)
        self._host[slot] = None
        self._has_ban[slot] = False
        self._flags = None

    # ---------------------------------------------------------------- sampling

    def process_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Steps 1-3 (bias, min_tokens ban, penalties): the logits before temperature.

        Never modifies ``logits`` (the raw values are still needed for logprobs).
        """
        f = self._features()
        if not (f["bias"] or f["ban"] or f["penalties"]):
            return logits
        out = logits.clone()
        if f["bias"]:
            out.scatter_add_(1, self._bias_ids[slots], self._bias_vals[slots])
        if f["ban"]:
            active = (self._generated[slots] < self._min_tokens[slots]).unsqueeze(1)
            ban = torch.where(self._ban_valid[slots] & active, -math.inf, 0.0).to(out.dtype)
            out.scatter_add_(1, self._ban_ids[slots], ban)
        if f["penalties"] and self.output_counts is not None:
            out = self._apply_penalties(out, slots)
        return out

    def sample(self, logits: torch.Tensor, slots: torch.Tensor) -> SampleOutput:
        """One token per row of ``logits`` [B, V] for ``slots`` [B]; records the tokens.

        One device-to-host transfer per step: rows whose top_k/top_p nucleus is wider than the candidates
        come back flagged with it and are re-sampled by a full sort only then (rare for a trained model), so
        the host never waits on the device mid-step and can queue the whole step behind the model's."""
        f = self._features()
        processed = self.process_logits(logits, slots)
        tokens, complete = self._choose(processed, slots, f)
        rows = self._transfer(logits, slots, tokens, complete, f)
        if complete is not None:
            flags = [r[-1] for r in rows]
            rows = [r[:-1] for r in rows] if f["logprobs"] else [r[0] for r in rows]
            wide = [i for i, ok in enumerate(flags) if not ok]
            if wide:  # before _record: the full sort must see the same counters (same noise) as the candidates
                idx = torch.tensor(wide, device=tokens.device)
                scaled = self._scaled(processed[idx], slots[idx], self._temperature[slots[idx]], f)
                tokens[idx] = self._sample_candidates(scaled, slots[idx], scaled.shape[1])[0]
                rows = self._transfer(logits, slots, tokens, None, f)
        self._record(slots, tokens)
        return self._unpack(rows, f)

    # ---------------------------------------------------------------- internals

    def _choose(self, processed: torch.Tensor, slots: torch.Tensor,
                f: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens, and (when top_k/top_p ran) whether each row's nucleus fitted the candidates."""
        if not f["sampled"]:
            return processed.argmax(dim=1), None
        temperature = self._temperature[slots]
        greedy_rows = temperature == 0.0
        scaled = self._scaled(processed, slots, temperature, f)
        if f["top_p"] or f["top_k"]:
            tokens, complete = self._sample_candidates(scaled, slots, min(scaled.shape[1], TOP_CANDIDATES))
            complete = complete | greedy_rows
        else:
            tokens, complete = self._race(scaled, slots), None
        if f["greedy"]:
            tokens = torch.where(greedy_rows, processed.argmax(dim=1), tokens)
        return tokens, complete

    def _transfer(self, logits: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                  complete: torch.Tensor | None, f: dict) -> list:
        """Everything the host needs, in one transfer: the packed rows (+ the complete flag last)."""
        packed = self._pack(logits, slots, tokens, f)
        if complete is None:
            return packed.tolist()
        if packed.dim() == 1:
            packed = packed.unsqueeze(1)
        return torch.cat([packed, complete.to(packed.dtype).unsqueeze(1)], dim=1).tolist()

    def _scaled(self, processed: torch.Tensor, slots: torch.Tensor, temperature: torch.Tensor,
                f: dict) -> torch.Tensor:
        """Logits over the temperature (greedy rows: 1), min_p applied."""
        t = torch.where(temperature == 0.0, 1.0, temperature).unsqueeze(1)
        scaled = processed / t
        if f["min_p"]:
            # p < min_p * p_max  <=>  logit < logit_max + log(min_p)  (no softmax needed)
            floor = scaled.amax(dim=1, keepdim=True) + torch.log(self._min_p[slots]).unsqueeze(1)
            scaled = scaled.masked_fill(scaled < floor, -math.inf)
        return scaled

    def _race(self, scaled: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        noise = self._noise(self._seed_key[slots], self._generated[slots], self._vocab_keys)
        # argmax p_i / E_i  ==  argmax (logit_i / T - log E_i); masked tokens stay -inf.
        return (scaled - torch.log(noise)).argmax(dim=1)

    def _sample_candidates(self, scaled: torch.Tensor, slots: torch.Tensor,
                           n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """top_k (then top_p on what is left, as vLLM) on the row's ``n`` largest logits, and the race run on
        those candidates only (the counter hash gives each vocabulary id the same noise either way); ``n`` =
        the vocabulary size is the full sort. Returns (tokens, complete): a row is complete when every token
        its top_k/top_p keep — ties at the threshold included — is a candidate; the caller re-samples the
        others with the full sort."""
        v = scaled.shape[1]
        raw, ids = scaled.sort(dim=1, descending=True) if n == v else scaled.topk(n, dim=1)
        k = self._top_k[slots]
        k = torch.where(k > 0, k.clamp(max=v), v)
        pos = torch.arange(n, device=scaled.device).unsqueeze(0)
        vals = raw.masked_fill(pos >= k.unsqueeze(1), -math.inf)
        # probabilities over what top_k allows: the candidates when k <= n, else the whole row
        log_z = torch.where(k <= n, torch.logsumexp(vals, dim=1), torch.logsumexp(scaled, dim=1))
        probs = torch.exp(vals - log_z.unsqueeze(1))
        before = probs.cumsum(dim=1) - probs  # mass strictly ahead of each position
        top_p = self._top_p[slots].unsqueeze(1)
        # Keep while the mass before a token is < top_p: the smallest set with mass >= top_p, never empty.
        # top_p == 1 keeps all, whatever the float error of the cumsum.
        keep = ((before < top_p) | (top_p >= 1.0)) & (vals > -math.inf)
        n_keep = keep.sum(dim=1, keepdim=True).clamp(min=1)
        threshold = vals.gather(1, n_keep - 1)
        complete = (raw[:, -1:] < threshold).squeeze(1) & ((k <= n) | (k == v))
        if n == v:
            complete = torch.ones_like(complete)
        noise = self._noise(self._seed_key[slots], self._generated[slots], self._vocab_keys[ids])
        race = raw.masked_fill(raw < threshold, -math.inf) - torch.log(noise)
        return ids.gather(1, race.argmax(dim=1, keepdim=True)).squeeze(1), complete

    def _apply_penalties(self, out: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        counts = self.output_counts[slots]
        seen_out = counts > 0
        rep = self._repetition[slots].unsqueeze(1)
        seen = seen_out | self.prompt_mask[slots]
        penalised = torch.where(out > 0, out / rep, out * rep)
        out = torch.where(seen, penalised, out)
        out = out - self._frequency[slots].unsqueeze(1) * counts.to(out.dtype)
        return out - self._presence[slots].unsqueeze(1) * seen_out.to(out.dtype)

    def _pack(self, logits: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
              f: dict) -> torch.Tensor:
        """Everything the host needs in one tensor, so one transfer per step."""
        if not f["logprobs"]:
            return tokens
        logprobs = torch.log_softmax(logits.float(), dim=1)
        cols = [tokens.to(torch.float64).unsqueeze(1),
                self._logprobs_k[slots].to(torch.float64).unsqueeze(1),
                logprobs.gather(1, tokens.unsqueeze(1)).to(torch.float64)]
        max_k = min(int(f["max_logprobs"]), logits.shape[1])
        if max_k > 0:
            top = logprobs.topk(max_k, dim=1)
            cols += [top.indices.to(torch.float64), top.values.to(torch.float64)]
        return torch.cat(cols, dim=1)

    def _unpack(self, rows: list, f: dict) -> SampleOutput:
        if not f["logprobs"]:
            return SampleOutput(token_ids=rows)
        max_k = (len(rows[0]) - 3) // 2 if rows else 0
        tokens, lps, tops = [], [], []
        for row in rows:
            tokens.append(int(row[0]))
            k = int(row[1])
            if k < 0:
                lps.append(math.nan)
                tops.append([])
                continue
            lps.append(row[2])
            ids, vals = row[3:3 + max_k], row[3 + max_k:]
            tops.append([(int(ids[j]), vals[j]) for j in range(min(k, max_k))])
        return SampleOutput(token_ids=tokens, logprobs=lps, top_logprobs=tops)

    def _record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        if self.output_counts is not None:
            ones = torch.ones_like(tokens, dtype=torch.int32)
            self.output_counts.index_put_((slots, tokens), ones, accumulate=True)
        self._generated.index_add_(0, slots, torch.ones_like(slots))

    def _features(self) -> dict:
        """Which optional stages any occupied slot needs (host-side, no device sync)."""
        if self._flags is not None:
            return self._flags
        live = [(p, ban) for p, ban in zip(self._host, self._has_ban) if p is not None]
        sampled = [p for p, _ in live if not p.is_greedy]
        self._flags = {
            "sampled": bool(sampled),
            "greedy": any(p.is_greedy for p, _ in live),
            "min_p": any(p.min_p > 0.0 for p in sampled),
            "top_p": any(p.top_p < 1.0 for p in sampled),
            "top_k": any(p.top_k > 0 for p in sampled),
            "bias": any(p.logit_bias for p, _ in live),
            "ban": any(ban for _, ban in live),
            "penalties": any(p.needs_penalties for p, _ in live),
            "logprobs": any(p.logprobs is not None for p, _ in live),
            "max_logprobs": max((p.logprobs or 0 for p, _ in live), default=0),
        }
        return self._flags

    def _widen(self, ids: torch.Tensor, vals: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow a padded [num_slots, L] table to hold ``need`` entries (powers of two)."""
        have = ids.shape[1]
        if need <= have:
            return ids, vals
        width = max(4, 1 << (need - 1).bit_length())
        new_ids = torch.zeros(self.num_slots, width, dtype=ids.dtype, device=self.device)
        new_vals = torch.zeros(self.num_slots, width, dtype=vals.dtype, device=self.device)
        new_ids[:, :have] = ids
        new_vals[:, :have] = vals
        return new_ids, new_vals

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")


# -- device-side results (the overlapped loop) -------------------------------------------------------

@dataclass
class DeviceSample:
    """One step's results, still on the device."""
    tokens: torch.Tensor  # [B] int64
    packed: torch.Tensor | None = None  # [B, 3 + 2K] float64 when a row asked for logprobs (see _pack)


def _sample_device(self: Sampler, logits: torch.Tensor, slots: torch.Tensor) -> DeviceSample:
    f = self._features()
    processed = self.process_logits(logits, slots)
    tokens, complete = self._choose(processed, slots, f)
    if complete is not None and not bool(complete.all()):  # rare: a nucleus wider than the candidates
        wide = (~complete).nonzero().squeeze(1)
        scaled = self._scaled(processed[wide], slots[wide], self._temperature[slots[wide]], f)
        tokens[wide] = self._sample_candidates(scaled, slots[wide], scaled.shape[1])[0]
    packed = self._pack(logits, slots, tokens, f) if f["logprobs"] else None
    self._record(slots, tokens)
    return DeviceSample(tokens, packed)


Sampler.sample_device = _sample_device


class PendingSample:
    """A DeviceSample on its way to the host: one non-blocking copy, read by ``result``."""

    def __init__(self, sample: DeviceSample):
        from engine.device import HostCopy
        self.has_logprobs = sample.packed is not None
        self.copy = HostCopy(sample.packed if self.has_logprobs else sample.tokens)

    def result(self) -> SampleOutput:
        rows = self.copy.wait().tolist()
        if not self.has_logprobs:
            return SampleOutput(token_ids=rows)
        return Sampler._unpack(None, rows, {"logprobs": True})

"""Tests for engine.sampler and its torch path (engine.sample_torch): semantics against per-row references, RNG
properties."""

from __future__ import annotations

import math

import pytest
import torch

from engine.params import SamplingParams
from engine.sample_layout import F_INV_TEMPERATURE, F_LOG_MIN_P, F_TOP_P, I_TOP_K, DeviceSample, Features, SlotTables
from engine.sample_torch import counter_hash, exponential_noise, mix32, race, sample_candidates, seed_key, vocab_keys
from engine.sampler import Admission, Sampler


# ----------------------------------------------------------------- helpers

def slots_of(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def chi_square(observed: list[int], expected: list[float]) -> float:
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)


def chi_square_bound(dof: int) -> float:
    # mean dof, sd sqrt(2 dof): ~6 sd of slack keeps a deterministic test robust yet sensitive.
    return dof + 6.0 * math.sqrt(2.0 * dof) + 10.0


def reference_process(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                      output: list[int], eos: list[int]) -> torch.Tensor:
    """Steps 1-3 written token by token, independently of the sampler."""
    out = row.clone().double()
    for tok, bias in p.logit_bias.items():
        out[tok] += bias
    if len(output) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        for tok in banned:
            out[tok] = -math.inf
    for tok in range(out.numel()):
        count = output.count(tok)
        if tok in prompt or count > 0:
            value = out[tok].item()
            out[tok] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        out[tok] -= p.frequency_penalty * count
        if count > 0:
            out[tok] -= p.presence_penalty
    return out.float()


def allowed_tokens(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The set min_p -> top_k -> top_p leaves, from probabilities in float64: the k most probable, then the
    smallest prefix of them with mass >= top_p (renormalised over the k), then every token tied with the
    last one kept (ties at the threshold are kept)."""
    probs = torch.softmax(row.double() / p.temperature, dim=0).tolist()
    alive = {i for i in range(len(probs)) if row[i] > -math.inf}
    if p.min_p > 0:
        top = max(probs)
        alive = {i for i in alive if probs[i] >= p.min_p * top}
    ranked = sorted(alive, key=lambda i: -probs[i])
    if p.top_k > 0:
        ranked = ranked[:p.top_k]
    total = sum(probs[i] for i in ranked)
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += probs[i] / total
        if mass >= p.top_p:
            break
    last = min(probs[i] for i in kept)
    return set(kept) | {i for i in alive if probs[i] == last}


def target_distribution(row: torch.Tensor, p: SamplingParams) -> list[float]:
    allowed = allowed_tokens(row, p)
    probs = torch.softmax(row.double() / p.temperature, dim=0).tolist()
    total = sum(probs[i] for i in allowed)
    return [probs[i] / total if i in allowed else 0.0 for i in range(len(probs))]


def draw_many(p: SamplingParams, row: torch.Tensor, num_slots: int, steps: int) -> list[int]:
    """num_slots seeds x steps counters, all on the same logits row."""
    sampler = Sampler(num_slots, row.numel())
    for slot in range(num_slots):
        sampler.reset_slot(slot, p, seed=1000 + slot, prompt_token_ids=[])
    slots = torch.arange(num_slots)
    logits = row.unsqueeze(0).expand(num_slots, -1).contiguous()
    tokens: list[int] = []
    for _ in range(steps):
        tokens += sampler.sample(logits, slots).token_ids
    return tokens


def run_sequence(sampler: Sampler, slot: int, row_pos: int, seq: list[torch.Tensor],
                 batch_slots: list[int], seed: int) -> list[int]:
    """Feed seq[t] at row_pos of a batch over batch_slots; neighbours get other logits."""
    tokens = []
    for t, row in enumerate(seq):
        logits = random_logits(len(batch_slots), row.numel(), seed=seed * 100 + t)
        logits[row_pos] = row
        out = sampler.sample(logits, torch.tensor(batch_slots))
        assert batch_slots[row_pos] == slot
        tokens.append(out.token_ids[row_pos])
    return tokens


# -------------------------------------------------------------------- RNG

def test_counter_hash_is_uniform() -> None:
    keys = torch.tensor([seed_key(s) for s in range(16)]).repeat_interleave(16)
    counters = torch.arange(16).repeat(16)
    h = counter_hash(keys, counters, vocab_keys(4096)).flatten()
    assert int(h.min()) >= 0 and int(h.max()) < 2 ** 32
    expected = [h.numel() / 256] * 256
    for bins in (h >> 24, (h >> 12) & 255, h & 255):
        observed = torch.bincount(bins, minlength=256).tolist()
        assert chi_square(observed, expected) < chi_square_bound(255)


def test_counter_hash_consecutive_counters_independent() -> None:
    # Joint distribution of (top 4 bits at counter c, at counter c+1) must be flat.
    vocab = vocab_keys(8192)
    key = torch.tensor([seed_key(7)])
    a = counter_hash(key, torch.tensor([5]), vocab).flatten() >> 28
    b = counter_hash(key, torch.tensor([6]), vocab).flatten() >> 28
    observed = torch.bincount(a * 16 + b, minlength=256).tolist()
    assert chi_square(observed, [8192 / 256] * 256) < chi_square_bound(255)


def test_exponential_noise_is_finite_with_unit_mean() -> None:
    keys = torch.tensor([seed_key(s) for s in range(8)])
    e = exponential_noise(keys, torch.zeros(8, dtype=torch.int64), vocab_keys(65536))
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0
    assert abs(float(e.double().mean()) - 1.0) < 0.01
    # Exp(1) tail: P(E > 3) = e^-3.
    assert abs(float((e > 3).double().mean()) - math.exp(-3)) < 0.003


def test_mix32_matches_published_hash() -> None:
    # Pins the stream: a changed hash would silently change every seeded output.
    def reference(x: int) -> int:  # Wellons' hash-prospector 32-bit finaliser
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x735A2D97) & 0xFFFFFFFF
        return x ^ (x >> 15)

    inputs = [0, 1, 2, 0xFFFFFFFF, 0x80000000, 123456789] + torch.randint(
        0, 2 ** 32, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    assert mix32(torch.tensor(inputs)).tolist() == [reference(x) for x in inputs]


def test_seed_key_accepts_any_int() -> None:
    keys = {seed_key(s) for s in (0, 1, -1, 2 ** 32, 2 ** 63, 2 ** 70 + 3)}
    assert len(keys) == 6 and all(0 <= k < 2 ** 32 for k in keys)


# ----------------------------------------------------------------- greedy

def test_greedy_equals_argmax() -> None:
    sampler = Sampler(6, 100)
    for slot in range(6):
        sampler.reset_slot(slot, SamplingParams(temperature=0.0), seed=slot, prompt_token_ids=[1])
    for step in range(4):
        logits = random_logits(4, 100, seed=step)
        out = sampler.sample(logits, slots_of(5, 0, 3, 2))
        assert out.token_ids == logits.argmax(dim=1).tolist()
        assert out.logprobs is None and out.top_logprobs is None


def test_greedy_with_bias_and_penalties_matches_reference() -> None:
    vocab, eos = 30, [0]
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 2.5, 7: -4.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.8, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2], [4, 9, 9, 11], [2, 3], []]
    slots = [3, 0, 2, 1]
    sampler = Sampler(4, vocab)
    for p, prompt, slot in zip(params, prompts, slots):
        sampler.reset_slot(slot, p, seed=slot, prompt_token_ids=prompt, eos_token_ids=eos)
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(12):
        # Small scale so penalties and bias flip the argmax often.
        logits = random_logits(len(slots), vocab, seed=50 + step, scale=1.0)
        logits[:, 0] += 1.5  # eos is tempting: min_tokens must hold it back
        refs = [reference_process(logits[i], p, prompt, out, eos)
                for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs))]
        processed = sampler.process_logits(logits, torch.tensor(slots))
        torch.testing.assert_close(processed, torch.stack(refs), rtol=1e-6, atol=1e-5)
        tokens = sampler.sample(logits, torch.tensor(slots)).token_ids
        assert tokens == [int(r.argmax()) for r in refs]
        for out, tok in zip(outputs, tokens):
            out.append(tok)


def _table_snapshot(sampler: Sampler) -> list[torch.Tensor | None]:
    return [None if t is None else t.clone() for t in sampler.tables] + [torch.tensor(sampler._has_ban)]


def _dirty_sampler(vocab: int) -> Sampler:
    """Every slot used before: wide bias and ban tables, counters and penalty counts not zero."""
    sampler = Sampler(6, vocab)
    for slot in range(6):
        sampler.reset_slot(slot, SamplingParams(temperature=0.7, logit_bias={i: 0.5 * i for i in range(1, 7)},
                                                min_tokens=4, stop_token_ids=[1, 2, 3, 4, 5], frequency_penalty=0.3,
                                                repetition_penalty=1.3, logprobs=2),
                            seed=100 + slot, prompt_token_ids=[7, 8, 9])
    for step in range(3):
        sampler.sample(random_logits(6, vocab, seed=step), slots_of(*range(6)))
    return sampler


def test_admitting_together_equals_one_by_one() -> None:
    """``reset_slots`` (the engine's admission, one copy per table) writes what per-slot admissions write, over
    slots whose earlier tables were wider: rows padded and cleared, counters zeroed, nothing of the others'."""
    vocab = 40
    eos = [0]
    batch = [Admission(4, SamplingParams(temperature=0.0), 1, [1, 2]),
             Admission(1, SamplingParams(temperature=1.2, top_p=0.8, logit_bias={3: -2.0}), 2, []),
             Admission(5, SamplingParams(temperature=0.9, min_tokens=2, repetition_penalty=1.5, min_p=0.05), 3,
                       [5, 6, 6]),
             Admission(0, SamplingParams(temperature=1.0, top_k=5, presence_penalty=0.4, logprobs=3,
                                         logit_bias={i: 0.1 for i in range(10, 19)}), 4, [30])]
    one_by_one, together = _dirty_sampler(vocab), _dirty_sampler(vocab)
    for a in batch:
        one_by_one.reset_slot(a.slot, a.params, a.seed, a.prompt_token_ids, eos)
    together.reset_slots(batch, eos)
    for x, y in zip(_table_snapshot(one_by_one), _table_snapshot(together)):
        assert (x is None and y is None) or torch.equal(x, y)
    assert one_by_one._host == together._host
    t = together.tables  # what an admission must leave, written out independently
    for a in batch:
        assert int(t.generated[a.slot]) == 0 and not t.output_counts[a.slot].any()
        assert t.prompt_mask[a.slot].nonzero().flatten().tolist() == (
            sorted(set(a.prompt_token_ids)) if a.params.repetition_penalty != 1.0 else [])
        bias = sorted(a.params.logit_bias.items())
        width = t.bias_ids.shape[1]
        assert t.bias_ids[a.slot].tolist() == [i for i, _ in bias] + [0] * (width - len(bias))
        assert t.bias_vals[a.slot].tolist() == pytest.approx([v for _, v in bias] + [0.0] * (width - len(bias)))
        assert float(t.fparams[a.slot, F_TOP_P]) == pytest.approx(a.params.top_p)
        assert int(t.iparams[a.slot, I_TOP_K]) == a.params.top_k
    assert int(t.generated[2]) == 3  # a slot not admitted keeps its counter
    slots = slots_of(4, 1, 5, 0, 2)
    for step in range(5):
        logits = random_logits(5, vocab, seed=20 + step)
        assert one_by_one.sample(logits, slots).token_ids == together.sample(logits, slots).token_ids


@pytest.mark.parametrize("bad", ["twice", "token"])
def test_a_refused_admission_writes_nothing(bad: str) -> None:
    sampler = _dirty_sampler(40)
    before = _table_snapshot(sampler)
    good = Admission(1, SamplingParams(temperature=0.0), 1, [1])
    other = Admission(1, SamplingParams(), 2, []) if bad == "twice" else Admission(2, SamplingParams(), 2, [40])
    with pytest.raises(ValueError):
        sampler.reset_slots([good, other])
    assert all(torch.equal(x, y) for x, y in zip(before, _table_snapshot(sampler)) if x is not None)


def test_mixed_greedy_and_sampled_rows() -> None:
    sampler = Sampler(4, 50)
    sampler.reset_slot(0, SamplingParams(temperature=0.0), seed=1, prompt_token_ids=[])
    sampler.reset_slot(1, SamplingParams(temperature=1.5), seed=2, prompt_token_ids=[])
    sampler.reset_slot(2, SamplingParams(temperature=0.0, top_k=3, top_p=0.5), seed=3, prompt_token_ids=[])
    sampler.reset_slot(3, SamplingParams(temperature=1.0, top_p=0.9), seed=4, prompt_token_ids=[])
    sampled: set[int] = set()
    for step in range(20):
        logits = random_logits(4, 50, seed=step, scale=0.5)
        tokens = sampler.sample(logits, slots_of(0, 1, 2, 3)).token_ids
        argmax = logits.argmax(dim=1).tolist()
        assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
        sampled.add(tokens[1] == argmax[1])
    assert False in sampled  # the hot row really samples


# ------------------------------------------------------------ penalties

def test_penalties_change_logits_exactly() -> None:
    vocab = 12
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                       presence_penalty=0.25)
    prompt, forced = [1, 2], [3, 3, 4, 2, 3]
    sampler = Sampler(2, vocab)
    sampler.reset_slot(1, p, seed=0, prompt_token_ids=prompt)
    for tok in forced:  # a spike makes greedy emit exactly these tokens
        spike = torch.zeros(1, vocab)
        spike[0, tok] = 50.0
        assert sampler.sample(spike, slots_of(1)).token_ids == [tok]
    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0, -2.0, 1.0, 0.0, -0.5, 0.1, 0.2, 0.3, -3.0]])
    got = sampler.process_logits(logits, slots_of(1))[0]
    expected = logits[0].clone()
    expected[1] = 2.0 / 1.5                                  # prompt only, positive
    expected[2] = -1.0 * 1.5 - 0.5 * 1 - 0.25                # prompt + output once, negative
    expected[3] = 3.0 / 1.5 - 0.5 * 3 - 0.25                 # output three times
    expected[4] = -2.0 * 1.5 - 0.5 * 1 - 0.25                # output once, negative
    torch.testing.assert_close(got, expected)
    assert torch.equal(logits[0, 0], torch.tensor(0.5))      # input left untouched


def test_penalty_state_is_lazy() -> None:
    sampler = Sampler(4, 64)
    sampler.reset_slot(0, SamplingParams(temperature=0.8, top_k=5, logit_bias={1: 1.0}), 1, [2, 3])
    sampler.sample(random_logits(1, 64, seed=0), slots_of(0))
    assert sampler.output_counts is None and sampler.prompt_mask is None
    sampler.reset_slot(1, SamplingParams(presence_penalty=0.5), 2, [2, 3])
    assert sampler.output_counts is not None and sampler.output_counts.shape == (4, 64)


# ------------------------------------------------- min_tokens, bias, logprobs

def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    vocab = 20
    sampler = Sampler(3, vocab)
    sampler.reset_slot(0, SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
                       seed=0, prompt_token_ids=[], eos_token_ids=[0, 9])
    sampler.reset_slot(1, SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
                       seed=0, prompt_token_ids=[], eos_token_ids=[0, 9])
    sampler.reset_slot(2, SamplingParams(temperature=1.0, min_tokens=2), seed=5,
                       prompt_token_ids=[], eos_token_ids=[0, 7, 9])
    logits = torch.zeros(3, vocab)
    logits[:, 0], logits[:, 9], logits[:, 7], logits[:, 4] = 30.0, 29.0, 28.0, 10.0
    history = [sampler.sample(logits, slots_of(0, 1, 2)).token_ids for _ in range(4)]
    assert [h[0] for h in history] == [4, 4, 4, 0]
    assert [h[1] for h in history] == [0, 0, 0, 0]  # ignore_eos: eos is not a stop token
    assert [h[2] for h in history][:2] == [4, 4]  # sampled rows obey the ban too
    assert history[2][2] in (0, 7, 9)


def test_logit_bias_plus_100_forces_token() -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, logit_bias={17: 100.0})
    tokens = draw_many(p, random_logits(1, 64, seed=3, scale=5.0)[0], num_slots=32, steps=4)
    assert set(tokens) == {17}


def test_logprobs_are_raw_and_top_k_exact() -> None:
    vocab = 40
    sampler = Sampler(4, vocab)
    sampler.reset_slot(0, SamplingParams(temperature=0.5, logprobs=5, presence_penalty=2.0,
                                         logit_bias={3: 7.0}), seed=1, prompt_token_ids=[3])
    sampler.reset_slot(1, SamplingParams(temperature=1.0), seed=2, prompt_token_ids=[])
    sampler.reset_slot(3, SamplingParams(temperature=0.0, logprobs=0), seed=3, prompt_token_ids=[])
    for step in range(3):
        logits = random_logits(3, vocab, seed=step)
        out = sampler.sample(logits, slots_of(3, 0, 1))
        raw = torch.log_softmax(logits, dim=1)
        for row in (0, 1):
            tok = out.token_ids[row]
            assert out.logprobs[row] == pytest.approx(raw[row, tok].item(), abs=1e-6)
        top = raw[1].topk(5)
        assert [t for t, _ in out.top_logprobs[1]] == top.indices.tolist()
        assert [v for _, v in out.top_logprobs[1]] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert out.top_logprobs[0] == []                       # logprobs=0: chosen token only
        assert math.isnan(out.logprobs[2]) and out.top_logprobs[2] == []


# --------------------------------------------------------- reproducibility

def test_same_seed_same_tokens_whatever_the_batch() -> None:
    vocab, steps = 300, 12
    target = SamplingParams(temperature=0.9, top_k=60, frequency_penalty=0.3, repetition_penalty=1.2)
    seq = [random_logits(1, vocab, seed=900 + t, scale=1.5)[0] for t in range(steps)]

    alone = Sampler(1, vocab)
    alone.reset_slot(0, target, seed=42, prompt_token_ids=[5, 6])
    reference = run_sequence(alone, 0, 0, seq, [0], seed=1)

    neighbours = [SamplingParams(temperature=t, top_p=tp, min_p=mp, logit_bias=b, logprobs=lp)
                  for t, tp, mp, b, lp in [(1.0, 0.5, 0.0, {}, None), (0.0, 1.0, 0.0, {1: 3.0}, 2),
                                           (1.3, 1.0, 0.1, {}, None), (0.7, 0.9, 0.0, {}, 4),
                                           (1.0, 1.0, 0.0, {}, None), (0.5, 0.8, 0.05, {9: -5.0}, None),
                                           (2.0, 1.0, 0.0, {}, 1)]]
    for target_slot, batch, seed in [(5, [0, 1, 7, 5, 2, 3, 4, 6], 2), (2, [6, 4, 3, 1, 0, 7, 2, 5], 3)]:
        sampler = Sampler(8, vocab)
        others = [s for s in range(8) if s != target_slot]
        for s, p in zip(others, neighbours):
            sampler.reset_slot(s, p, seed=s + 17 * seed, prompt_token_ids=[5, 7])
        sampler.reset_slot(target_slot, target, seed=42, prompt_token_ids=[5, 6])
        got = run_sequence(sampler, target_slot, batch.index(target_slot), seq, batch, seed)
        assert got == reference


def test_different_seeds_give_different_tokens() -> None:
    vocab = 300
    p = SamplingParams(temperature=1.0)
    seq = [random_logits(1, vocab, seed=t, scale=0.5)[0] for t in range(10)]
    runs = []
    for seed in (1, 2):
        sampler = Sampler(1, vocab)
        sampler.reset_slot(0, p, seed=seed, prompt_token_ids=[])
        runs.append(run_sequence(sampler, 0, 0, seq, [0], seed=0))
    assert runs[0] != runs[1]


# ---------------------------------------------------------------- filters

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.6),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.5, top_k=1),
])
def test_filters_never_sample_outside_their_set(params: SamplingParams) -> None:
    row = random_logits(1, 40, seed=11, scale=1.5)[0]
    allowed = allowed_tokens(row, params)
    tokens = draw_many(params, row, num_slots=128, steps=8)
    assert set(tokens) <= allowed
    assert len(set(tokens)) == len(allowed) or len(allowed) > 8  # small sets are fully reached


@pytest.mark.parametrize("with_top_p_row", [False, True])
def test_per_row_top_k_in_a_mixed_batch(with_top_p_row: bool) -> None:
    # Different k per row exercises both the topk-at-max-k path and the sorted path.
    vocab, ks = 40, [1, 3, 7, 0, 12]
    row = random_logits(1, vocab, seed=21, scale=1.0)[0]
    params = [SamplingParams(temperature=1.0, top_k=k) for k in ks]
    if with_top_p_row:
        params.append(SamplingParams(temperature=1.0, top_p=0.5))
    copies = 64
    sampler = Sampler(len(params) * copies, vocab)
    for slot in range(len(params) * copies):
        sampler.reset_slot(slot, params[slot % len(params)], seed=slot, prompt_token_ids=[])
    slots = torch.arange(len(params) * copies)
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(4):
        tokens = sampler.sample(row.expand(len(slots), -1), slots).token_ids
        for slot, tok in enumerate(tokens):
            seen[slot % len(params)].add(tok)
    for p, got in zip(params, seen):
        allowed = allowed_tokens(row, p)
        assert got <= allowed
        assert len(got) == len(allowed) or len(allowed) > 12


def test_reused_slot_starts_clean() -> None:
    # A slot admitted again must forget counts, bias and counter, and apply its new features.
    vocab = 16
    sampler = Sampler(2, vocab)
    sampler.reset_slot(0, SamplingParams(temperature=0.0, frequency_penalty=1.0,
                                         logit_bias={2: 5.0}), 1, [])
    for _ in range(3):
        sampler.sample(random_logits(1, vocab, seed=0), slots_of(0))
    new = SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=2, min_tokens=1)
    sampler.reset_slot(0, new, 1, [], eos_token_ids=[3])
    # A neighbour with a bias keeps the bias stage running: slot 0's old bias must be gone.
    sampler.reset_slot(1, SamplingParams(temperature=0.0, logit_bias={5: 1.0}), 2, [])
    logits = random_logits(1, vocab, seed=4)
    expected = reference_process(logits[0], new, [], [], [3])
    torch.testing.assert_close(sampler.process_logits(logits, slots_of(0))[0], expected)
    out = sampler.sample(logits, slots_of(0))
    assert out.token_ids == [int(expected.argmax())] and len(out.top_logprobs[0]) == 2


def test_release_slot_drops_its_features() -> None:
    sampler = Sampler(2, 30)
    sampler.reset_slot(0, SamplingParams(temperature=1.0, top_p=0.5, logprobs=3), 1, [])
    sampler.reset_slot(1, SamplingParams(temperature=0.0), 2, [])
    logits = random_logits(1, 30, seed=0)
    first = sampler.sample(logits, slots_of(1))
    assert first.logprobs is not None and math.isnan(first.logprobs[0])  # slot 0 still live
    sampler.release_slot(0)
    out = sampler.sample(logits, slots_of(1))
    assert out.token_ids == logits.argmax(dim=1).tolist() and out.logprobs is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7, min_p=0.02),
])
def test_empirical_distribution_matches_softmax(params: SamplingParams) -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.8, -2.0, 0.2])
    tokens = draw_many(params, row, num_slots=512, steps=24)
    expected = [q * len(tokens) for q in target_distribution(row, params)]
    observed = torch.bincount(torch.tensor(tokens), minlength=row.numel()).tolist()
    support = sum(q > 0 for q in expected)
    assert all(o == 0 for o, e in zip(observed, expected) if e == 0)
    assert chi_square(observed, expected) < chi_square_bound(support - 1)


# ------------------------------------------------------------------ forks

def test_copy_slot_forks_params_and_counts_with_a_new_seed() -> None:
    vocab = 64
    p = SamplingParams(temperature=1.0, top_k=6, presence_penalty=1.0, repetition_penalty=1.3)
    sampler = Sampler(4, vocab)
    sampler.reset_slot(0, p, seed=10, prompt_token_ids=[1, 2, 3])
    for step in range(3):
        sampler.sample(random_logits(1, vocab, seed=step), slots_of(0))
    sampler.copy_slot(0, 2, seed=99)
    sampler.copy_slot(0, 3, seed=10)  # same seed: an exact replica
    assert torch.equal(sampler.output_counts[2], sampler.output_counts[0])
    assert int(sampler.output_counts[2].sum()) == 3
    probe = random_logits(1, vocab, seed=7).expand(3, -1)
    processed = sampler.process_logits(probe, slots_of(0, 2, 3))
    assert torch.equal(processed[0], processed[1]) and torch.equal(processed[0], processed[2])

    streams: list[list[int]] = [[], [], []]
    for step in range(12):
        row = random_logits(1, vocab, seed=100 + step, scale=0.3)
        allowed = allowed_tokens(sampler.process_logits(row, slots_of(2))[0], p)
        tokens = sampler.sample(row.expand(3, -1), slots_of(0, 2, 3)).token_ids
        for stream, tok in zip(streams, tokens):
            stream.append(tok)
        assert tokens[1] in allowed  # the fork keeps top_k
    assert streams[0] == streams[2]
    assert streams[0] != streams[1]


def full_sort_nucleus(t: SlotTables, scaled: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Oracle: top_k, then top_p on the renormalised remainder, by sorting the whole row; the rest -inf."""
    v = scaled.shape[1]
    srt = scaled.sort(dim=1, descending=True).values
    pos = torch.arange(v).unsqueeze(0)
    k = t.iparams[slots, I_TOP_K]
    k = torch.where(k > 0, k.clamp(max=v), v).unsqueeze(1)
    srt = srt.masked_fill(pos >= k, -math.inf)
    probs = srt.softmax(dim=1)
    before = probs.cumsum(dim=1) - probs
    top_p = t.fparams[slots, F_TOP_P].unsqueeze(1)
    keep = ((before < top_p) | (top_p >= 1.0)) & (srt > -math.inf)
    n_keep = keep.sum(dim=1, keepdim=True).clamp(min=1)
    return scaled.masked_fill(scaled < srt.gather(1, n_keep - 1), -math.inf)


@pytest.mark.parametrize("candidates", [16, 1024])
def test_candidate_sampling_equals_full_sort(monkeypatch, candidates):
    """top_k/top_p on the largest logits first (falling back to the full sort for rows whose nucleus is wider)
    picks exactly the token the full sort + race over the whole vocabulary picks, and only allowed tokens."""
    import engine.sample_torch as torch_path
    monkeypatch.setattr(torch_path, "TOP_CANDIDATES", candidates)
    vocab = 4096
    params = [SamplingParams(temperature=1.0, top_p=0.9, logprobs=2),  # scale 0.5 below: a wide nucleus
              SamplingParams(temperature=0.7, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=1.3, top_k=40, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=2000),  # more than the candidates, fewer than the vocabulary
              SamplingParams(temperature=1.0, top_p=0.3, min_p=0.05),
              SamplingParams(temperature=0.9)]  # neither: the whole row
    sampler = Sampler(len(params), vocab)
    for slot, p in enumerate(params):
        sampler.reset_slot(slot, p, seed=1000 + slot, prompt_token_ids=[1])
    slots = torch.arange(len(params))
    fallbacks = 0
    for step in range(6):
        logits = random_logits(len(params), vocab, seed=900 + step)
        logits[0] *= 0.5 / 3.0
        t = sampler.tables
        scaled = logits * t.fparams[slots, F_INV_TEMPERATURE].unsqueeze(1)
        floor = scaled.amax(1, keepdim=True) + t.fparams[slots, F_LOG_MIN_P].unsqueeze(1)
        scaled = scaled.masked_fill(scaled < floor, -math.inf)
        want = race(full_sort_nucleus(t, scaled, slots), slots, t)
        fallbacks += int((~sample_candidates(scaled, slots, t, min(vocab, candidates))[1]).sum())
        out = sampler.sample(logits, slots)
        got = out.token_ids
        assert got == want.tolist(), (step, got, want.tolist())
        # the wide row's logprob is its re-sampled token's
        assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0].double(), 0)[got[0]].item(), abs=1e-4)
        for row, (tok, p) in enumerate(zip(got, params)):
            assert tok in allowed_tokens(logits[row], p), (step, row)
    if candidates == 16:
        assert fallbacks > 0  # the wide rows did take the full-sort path


# ------------------------------------------------ edges of the kept set, against the sorted oracle

def draw_rows(params: list[SamplingParams], row: torch.Tensor, copies: int, steps: int) -> list[list[int]]:
    """Tokens per parameter set: ``copies`` slots (seeds) each, ``steps`` counters, all on ``row``."""
    sampler = Sampler(len(params) * copies, row.numel())
    for slot in range(len(params) * copies):
        sampler.reset_slot(slot, params[slot % len(params)], seed=7 * slot + 1, prompt_token_ids=[])
    slots = torch.arange(len(params) * copies)
    drawn: list[list[int]] = [[] for _ in params]
    for _ in range(steps):
        for slot, tok in enumerate(sampler.sample(row.expand(len(slots), -1).contiguous(), slots).token_ids):
            drawn[slot % len(params)].append(tok)
    return drawn


def assert_matches_oracle(tokens: list[int], row: torch.Tensor, p: SamplingParams) -> None:
    expected = [q * len(tokens) for q in target_distribution(row, p)]
    observed = torch.bincount(torch.tensor(tokens), minlength=row.numel()).tolist()
    assert all(o == 0 for o, e in zip(observed, expected) if e == 0), "sampled a token the oracle drops"
    support = sum(e > 0 for e in expected)
    if support > 1:
        assert chi_square(observed, expected) < chi_square_bound(support - 1), (p, observed, expected)


def test_threshold_edges_follow_the_sorted_oracle() -> None:
    """top_p = 1 keeps all; top_k = 1 keeps the maximum and its ties; ties at the top_p threshold are all
    kept; -inf logits (and a -100 logit_bias) are never drawn; min_p drops what is under its floor."""
    row = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.5, -math.inf, 0.0, -1.0, -math.inf, 1.5])
    params = [SamplingParams(temperature=1.0, top_p=1.0),
              SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=0.62),  # crosses inside the three tied 1.0s
              SamplingParams(temperature=0.8, top_k=3),     # the third place is a three-way tie
              SamplingParams(temperature=1.0, min_p=0.3),
              SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=1.0, top_p=0.95, logit_bias={0: -100.0, 9: -100.0})]
    assert len(allowed_tokens(row, params[2])) == 5 and len(allowed_tokens(row, params[3])) == 5
    for tokens, p in zip(draw_rows(params, row, copies=96, steps=24), params):
        biased = row.clone()
        for tok, b in p.logit_bias.items():
            biased[tok] += b
        assert_matches_oracle(tokens, biased, p)
    tied_max = torch.tensor([3.0, 3.0, 1.0, 0.0])
    tokens = draw_rows([SamplingParams(temperature=1.0, top_k=1)], tied_max, copies=64, steps=8)[0]
    assert set(tokens) == {0, 1}


def test_banned_and_masked_tokens_never_drawn_in_a_wide_row() -> None:
    """A 4,096-token row, half of it -inf: the nucleus (wider than the candidates) never reaches them."""
    row = random_logits(1, 4096, seed=5, scale=0.5)[0]
    row[::2] = -math.inf
    for tokens in draw_rows([SamplingParams(temperature=1.0, top_p=0.95),
                             SamplingParams(temperature=1.0, min_p=0.5, top_k=3000)], row, copies=16, steps=4):
        assert all(tok % 2 == 1 for tok in tokens)


def test_sample_device_leaves_results_on_the_device_and_records() -> None:
    """sample_device + to_host == sample (one transfer), and the counters advance on the device."""
    admitted = {0: SamplingParams(temperature=0.0, logprobs=3),
                2: SamplingParams(temperature=1.0, frequency_penalty=1.0)}
    sampler, twin = Sampler(3, 50), Sampler(3, 50)
    for s in (sampler, twin):
        for slot, p in admitted.items():
            s.reset_slot(slot, p, seed=slot + 1, prompt_token_ids=[])
    for step in range(3):
        logits = random_logits(2, 50, seed=step)
        out = sampler.sample_device(logits, slots_of(2, 0))
        assert isinstance(out, DeviceSample) and out.tokens.dtype == torch.int64 and out.top_ids.shape == (2, 3)
        assert out.logprobs_k.tolist() == [-1, 3]
        host = out.to_host()
        assert host == twin.sample(logits, slots_of(2, 0))
        assert math.isnan(host.logprobs[0]) and host.top_logprobs[0] == [] and len(host.top_logprobs[1]) == 3
    assert sampler._generated.tolist() == [3, 0, 3] and int(sampler.output_counts[2].sum()) == 3


def test_plain_greedy_batches_take_the_argmax_path_and_still_record() -> None:
    """Every occupied slot greedy with nothing else: the argmax path (ties to the lowest id, as the kernel);
    counters advance (penalty counts do not: no live slot has penalties, and a slot's counts start at zero when
    it is admitted); one sampled, biased or logprobs slot sends the step back to the full path."""
    sampler = Sampler(4, 64)
    for slot in range(3):
        sampler.reset_slot(slot, SamplingParams(temperature=0.0), seed=slot, prompt_token_ids=[1])
    assert sampler._features().plain_greedy
    logits = random_logits(3, 64, seed=1)
    logits[1, 7] = logits[1, 40] = logits[1].max() + 1.0  # a tie: the lower id wins
    out = sampler.sample_device(logits, slots_of(0, 1, 2))
    assert out.tokens.tolist() == [int(logits[0].argmax()), 7, int(logits[2].argmax())] and out.logprobs is None
    assert sampler._generated.tolist() == [1, 1, 1, 0]
    for extra in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
                  SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0, presence_penalty=1.0)):
        sampler.reset_slot(3, extra, seed=9, prompt_token_ids=[1])
        assert not sampler._features().plain_greedy, extra
        sampler.release_slot(3)
    assert sampler._features().plain_greedy and sampler.output_counts is not None  # the penalty slot made them
    before = sampler.output_counts.clone()
    sampler.sample_device(logits, slots_of(0, 1, 2))
    assert torch.equal(sampler.output_counts, before) and sampler._generated.tolist() == [2, 2, 2, 0]
    assert Features(greedy=True).plain_greedy and not Features(greedy=True, mask=True).plain_greedy


def test_penalty_counts_are_kept_while_a_penalty_slot_lives() -> None:
    """Counts advance only in steps with a live penalty slot, and a penalty request admitted after steps
    without any counts exactly its own tokens: what its penalties then apply to."""
    vocab = 32
    sampler = Sampler(3, vocab)
    sampler.reset_slot(0, SamplingParams(temperature=1.0), seed=1, prompt_token_ids=[1])
    sampler.reset_slot(1, SamplingParams(temperature=1.0, frequency_penalty=1.0), seed=2, prompt_token_ids=[1])
    sampler.sample(random_logits(2, vocab, seed=0), slots_of(0, 1))
    assert int(sampler.output_counts.sum()) == 2  # both rows of a step with a penalty slot
    sampler.release_slot(1)
    for step in range(3):
        sampler.sample(random_logits(1, vocab, seed=step), slots_of(0))
    assert int(sampler.output_counts.sum()) == 2  # none while no penalty slot lives
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler.reset_slot(2, p, seed=3, prompt_token_ids=[])
    drawn = [sampler.sample(random_logits(2, vocab, seed=10 + step), slots_of(0, 2)).token_ids[1]
             for step in range(4)]
    assert sampler.output_counts[2].tolist() == torch.bincount(torch.tensor(drawn), minlength=vocab).tolist()
    logits = random_logits(1, vocab, seed=50)
    want = reference_process(logits[0], p, [], drawn, [])
    torch.testing.assert_close(sampler.process_logits(logits, slots_of(2))[0], want)

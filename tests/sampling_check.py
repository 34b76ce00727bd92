"""Run under TRITON_INTERPRET=1 (see test_kernels_interpreted.py): the sampling kernel (engine.cuda.sampling),
executed by Triton's CPU interpreter, against its twin, the torch path: the same hash bit for bit, the same
token for the same logits and counters, the same raw logprobs, and a row's token independent of its batch."""

from __future__ import annotations

import math
import sys

import torch

from engine.cuda.sampling import (config_for, counter_hash_rows, counter_hash_rows_ref, has_band, sample_rows,
                                  sample_rows_ref)
from engine.params import SamplingParams as P
from engine.sample_torch import seed_key
from engine.sampler import Sampler

MIXES = [P(temperature=0.0), P(temperature=1.0), P(temperature=1.0, top_p=0.9), P(temperature=0.8, top_k=50),
         P(temperature=1.0, min_p=0.05), P(temperature=0.7, top_k=40, top_p=0.95, logprobs=20),
         P(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
           logit_bias={3: 2.0, 7: -100.0}, logprobs=5),
         P(temperature=1.3, top_k=600, top_p=0.5), P(temperature=1.0, top_p=0.3, min_p=0.02),
         P(temperature=0.5, min_tokens=2, stop_token_ids=[5], top_p=0.8), P(temperature=0.0, logprobs=3),
         P(temperature=2.0, top_p=0.999, top_k=1),
         # sharp edges: an off-by-one in top_k or at the min_p floor changes these rows' tokens often
         P(temperature=1.0, top_k=1), P(temperature=1.5, top_k=2), P(temperature=1.0, top_k=3),
         P(temperature=1.0, min_p=1.0),
         P(temperature=1.0, top_k=5000, min_p=0.1),  # top_k above what min_p leaves: off
         P(temperature=1.0, top_p=0.2)]  # top_p alone, whose runners often all fall outside: the search from -inf

ROWS = {  # logits of every kind the threshold search must survive
    "flat": lambda n, v, g: torch.randn(n, v, generator=g),
    "peaked": lambda n, v, g: torch.randn(n, v, generator=g) * 6,
    "bf16 ties": lambda n, v, g: (torch.randn(n, v, generator=g) * 3).bfloat16().float(),
    "half -inf": lambda n, v, g: torch.where(torch.rand(n, v, generator=g) < 0.5, -math.inf,
                                             torch.randn(n, v, generator=g)),
    "all equal": lambda n, v, g: torch.zeros(n, v),
}


def three_in_a_lane(rows: torch.Tensor, lanes: int = 256) -> torch.Tensor:
    """Each row's three largest values on ids one block apart (one lane of the kernel's stats pass, block 256
    at these vocabularies), rising: the lane's first largest is pushed down to its third."""
    for r in range(rows.shape[0]):
        lane = (r * 37) % lanes
        rows[r, [lane, lane + lanes, lane + 2 * lanes]] = torch.tensor([5.0, 5.5, 6.0])
    return rows


def check_hash() -> None:
    keys = torch.tensor([seed_key(s) for s in (0, 1, 2 ** 40, -5)])
    counters = torch.tensor([0, 1, 2 ** 31 + 7, 2 ** 32 - 1])
    h, log_e = counter_hash_rows(keys, counters, 700)
    want_h, want_log_e = counter_hash_rows_ref(keys, counters, 700)
    assert torch.equal(h, want_h), "the kernel's counter hash differs from engine.sample_torch.counter_hash"
    assert torch.allclose(log_e, want_log_e, rtol=1e-5, atol=1e-6), (log_e - want_log_e).abs().max()


def admit(vocab: int, params: list[P], seed: int = 100) -> Sampler:
    sampler = Sampler(len(params), vocab, "cpu", use_kernel=True)
    for slot, p in enumerate(params):
        sampler.reset_slot(slot, p, seed=seed + slot, prompt_token_ids=[1, 2, 3], eos_token_ids=[0])
    return sampler


def check_same_as_twin(vocab: int, kind: str, steps: int) -> None:
    """Tokens equal and logprobs within 1e-5, several steps (penalty counts and counters advance)."""
    sampler = admit(vocab, MIXES)
    gen = torch.Generator().manual_seed(vocab)
    for step in range(steps):
        logits = ROWS[kind](len(MIXES), vocab, gen)
        slots = torch.randperm(len(MIXES), generator=gen)
        got, want = twin_step(sampler, logits, slots, (vocab, kind, step))
        assert torch.equal(got.logprobs_k, want.logprobs_k)
        asked = want.logprobs_k >= 0
        assert torch.allclose(got.logprobs[asked], want.logprobs[asked], atol=1e-5), (vocab, kind, step)
        raw = torch.log_softmax(logits, dim=1)
        for row, k in enumerate(want.logprobs_k.tolist()):
            if k > 0:  # the k largest values; with ties any k of the equal ones, so check each id's own value
                assert torch.allclose(got.top_logprobs[row, :k], want.top_logprobs[row, :k], atol=1e-5)
                assert torch.allclose(raw[row, got.top_ids[row, :k]], got.top_logprobs[row, :k], atol=1e-5)
                if kind in ("flat", "peaked"):
                    assert got.top_ids[row, :k].tolist() == want.top_ids[row, :k].tolist(), (vocab, kind, row)
        sampler._record(slots, want.tokens)


def twin_step(sampler: Sampler, logits: torch.Tensor, slots: torch.Tensor, where: tuple):
    """The kernel's and the twin's samples of one step (counters not advanced): the same tokens."""
    f = sampler._features()
    got = sample_rows(logits, slots, sampler.tables, f, sampler._kernel)
    want = sample_rows_ref(logits, slots, sampler.tables, f)
    assert got.tokens.tolist() == want.tokens.tolist(), (*where, got.tokens, want.tokens)
    return got, want


def check_recording(vocab: int = 1000) -> None:
    """The kernel advancing the counters and penalty counts itself == the torch path's recording."""
    fast, slow = admit(vocab, MIXES), admit(vocab, MIXES)
    slow._kernel = None
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        logits, slots = torch.randn(len(MIXES), vocab, generator=gen), torch.randperm(len(MIXES), generator=gen)
        got, want = fast.sample(logits, slots), slow.sample(logits, slots)
        assert got.token_ids == want.token_ids
        assert all(math.isclose(a, b, abs_tol=1e-5) or math.isnan(a) and math.isnan(b)
                   for a, b in zip(got.logprobs, want.logprobs))
        assert [len(t) for t in got.top_logprobs] == [len(t) for t in want.top_logprobs]
    assert torch.equal(fast._generated, slow._generated) and torch.equal(fast.output_counts, slow.output_counts)


def check_batch_invariance(vocab: int = 1000) -> None:
    """One sequence's tokens alone, among neighbours, at other rows and batch sizes (past FEW_FILTERED too: the
    smaller ones run wide programs), and with programs looping over several rows each: always the same."""
    target = P(temperature=0.9, top_p=0.7, top_k=300)
    gen = torch.Generator().manual_seed(3)
    seq = [torch.randn(vocab, generator=gen) * 2 for _ in range(2)]
    runs = []
    for batch in (1, 5, 11, 21):
        params = [target] + (MIXES * 2)[:batch - 1]
        sampler = admit(vocab, params, seed=0)
        sampler.reset_slot(0, target, seed=42, prompt_token_ids=[])
        row = batch // 2
        slots = torch.tensor([s for s in range(1, batch) if s <= row] + [0] + [s for s in range(1, batch) if s > row])
        tokens = []
        for logits in seq:
            batch_logits = torch.randn(batch, vocab, generator=gen)
            batch_logits[row] = logits
            tokens.append(sampler.sample(batch_logits, slots).token_ids[row])
        runs.append(tokens)
    assert all(run == runs[0] for run in runs), runs
    assert config_for(vocab).cap < vocab  # the band is smaller than the row: the search really ran


def check_masks(vocab: int = 1000) -> None:
    """Grammar bitmasks (every other row constrained, one of them to a single token): the kernel's tokens equal
    the twin's, and every constrained row's token is one its mask allows."""
    spec = {"type": "regex", "value": "x"}
    params = [P(**{**p.to_dict(), "structured": spec}) if i % 2 == 0 else p for i, p in enumerate(MIXES)]
    sampler = admit(vocab, params)
    gen = torch.Generator().manual_seed(9)
    words = (vocab + 31) // 32
    for step in range(2):
        allowed = torch.rand(len(params), words * 32, generator=gen) < 0.1
        allowed[0] = False
        allowed[0, 123 + step] = True
        bits = (allowed.view(len(params), words, 32).long() << torch.arange(32)).sum(2)
        rows = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
        sampler.write_masks(torch.arange(len(params)), rows)
        logits = ROWS["peaked"](len(params), vocab, gen)
        slots = torch.randperm(len(params), generator=gen)
        assert sampler._features().mask
        got, want = twin_step(sampler, logits, slots, ("masks", step))
        for row, slot in enumerate(slots.tolist()):
            if slot % 2 == 0:
                assert allowed[slot, got.tokens[row]], (slot, int(got.tokens[row]))
        assert got.tokens[slots.tolist().index(0)] == 123 + step
        sampler._record(slots, want.tokens)


def check_exact_rows_across_shapes(vocab: int = 1000) -> None:
    """Steps with no filters and no logprobs switch launch shape with their size (``config_for``: the split race
    for very few rows, the wide shape for a few, the small one for many): a row's token must not notice, at a
    batch size in each, and must equal the twin's; with penalties, bias and a ban (a processed row) as well."""
    plain = [P(temperature=1.0), P(temperature=0.0), P(temperature=1.3, seed=5), P(temperature=0.7)]
    processed = [P(temperature=1.3, repetition_penalty=1.2), P(temperature=0.0, logit_bias={5: 4.0}),
                 P(temperature=0.8, presence_penalty=0.5, logit_bias={3: 2.0, 7: -100.0})]
    for target, neighbours in ((P(temperature=1.0), plain), (P(temperature=0.0), plain),
                               (P(temperature=1.0, frequency_penalty=0.3, logit_bias={11: 3.0}), processed),
                               # bias and ban entries past the split race's first segment (each program writes its own)
                               (P(temperature=1.0, logit_bias={700: 6.0, 300: 2.0}, min_tokens=2,
                                  stop_token_ids=[600, 5]), processed)):
        shapes = {}
        for n in range(1, 64):  # the smallest batch of each shape, and one past the last switch
            shapes.setdefault(config_for(vocab, n, exact=True), n)
        batches = sorted(shapes.values()) + [max(shapes.values()) + 3]
        assert len(batches) >= 4, shapes  # split, wide, small, and past the last switch
        gen = torch.Generator().manual_seed(8)
        seq = [torch.randn(vocab, generator=gen) for _ in range(2)]
        runs = []
        for batch in batches:
            params = [target] + (neighbours * 20)[:batch - 1]
            fast, slow = admit(vocab, params, seed=0), admit(vocab, params, seed=0)
            slow._kernel = None
            tokens = []
            for logits in seq:
                batch_logits = torch.randn(batch, vocab, generator=gen)
                batch_logits[0] = logits
                got = fast.sample(batch_logits, torch.arange(batch))
                assert got.token_ids == slow.sample(batch_logits, torch.arange(batch)).token_ids, (target, batch)
                tokens.append(got.token_ids[0])
            runs.append(tokens)
            assert torch.equal(fast._generated, slow._generated)
        assert all(r == runs[0] for r in runs), (target, batches, runs)


def check_processed_exact_rows(vocab: int = 1000) -> None:
    """Processed rows with no filters or logprobs take one pass with no scratch row (the dense stages as the row
    streams by, bias and ban entries on their own) unless every one of their best race keys is a bias or ban
    entry: then the scratch row. Both against the twin, greedy and sampled, with the rows' largest values on
    biased and banned ids; which path ran is read off the scratch rows (poisoned with NaN before each step)."""
    hot = [17, 230, 480, 700, 999, 3]
    one_pass = [[P(temperature=t, logit_bias={hot[0]: -100.0, hot[1]: 50.0}),
                 P(temperature=t, repetition_penalty=1.3, presence_penalty=0.4, logit_bias={hot[2]: 2.0, 321: 30.0}),
                 P(temperature=t, min_tokens=3, stop_token_ids=hot[:2], frequency_penalty=0.5)] for t in (0.0, 1.0)]
    fall_back = [[P(temperature=t, logit_bias={i: -100.0 for i in hot}),
                  P(temperature=t, min_tokens=3, stop_token_ids=hot, presence_penalty=0.2)] for t in (0.0, 1.0)]
    for params, one in ((one_pass[0] + one_pass[1], True), (fall_back[0] + fall_back[1], False)):
        sampler = admit(vocab, params)
        gen = torch.Generator().manual_seed(9)
        for step in range(3):
            logits = torch.randn(len(params), vocab, generator=gen)
            logits[:, hot] += 30.0  # the six largest keys of every row, whatever the noise
            scratch = sampler._kernel.scratch_rows()
            scratch.fill_(float("nan"))
            slots = torch.arange(len(params))
            _, want = twin_step(sampler, logits, slots, ("processed exact", one, step))
            assert bool(torch.isnan(scratch).all()) == one, (one, step)
            sampler._record(slots, want.tokens)


def check_warm_up() -> None:
    sampler = admit(300, MIXES[:3])
    before = sampler._generated.clone()
    sampler.warm_up([1, 3])
    assert torch.equal(sampler._generated, before)


def check_three_in_a_lane(vocab: int = 1000) -> None:
    """Rows whose three largest values share a lane, under top_k 2 / 3 / 4: a lane band that lost the third
    (the value pushed down from second) would miss a kept value and sample another in its place."""
    params = [P(temperature=1.0, top_k=2 + i % 3) for i in range(48)]
    sampler = admit(vocab, params)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        slots = torch.arange(len(params))
        _, want = twin_step(sampler, three_in_a_lane(torch.randn(len(params), vocab, generator=gen)), slots,
                            ("three in a lane", step))
        sampler._record(slots, want.tokens)


def check_without_the_band(vocab: int = 1000) -> None:
    """A step without top_k rows runs a filter variant without the lane band. Every mix (top_k rows too, which
    then search) in that variant and in the one with the band: the twin's tokens, every kind of row."""
    import dataclasses

    sampler = admit(vocab, MIXES)
    gen = torch.Generator().manual_seed(6)
    with_band = sampler._features()
    assert with_band.top_k and has_band(with_band)
    without = dataclasses.replace(with_band, top_k=False)
    assert without.filtered and not has_band(without)
    for kind, rows in ROWS.items():
        logits = rows(len(MIXES), vocab, gen)
        slots = torch.randperm(len(MIXES), generator=gen)
        want = sample_rows_ref(logits, slots, sampler.tables, with_band).tokens.tolist()
        for f in (with_band, without):
            got = sample_rows(logits, slots, sampler.tables, f, sampler._kernel).tokens.tolist()
            assert got == want, (kind, has_band(f), got, want)


def check_twin_on_every_kind() -> None:
    for kind in ROWS:
        check_same_as_twin(1000, kind, steps=1 if kind == "all equal" else 2)
    check_same_as_twin(4096, "flat", steps=1)


if __name__ == "__main__":
    check_hash()
    check_twin_on_every_kind()
    check_same_as_twin(4096, "peaked", steps=1)
    check_three_in_a_lane()
    check_without_the_band()
    check_recording()
    check_batch_invariance()
    check_exact_rows_across_shapes()
    check_processed_exact_rows()
    check_masks()
    check_warm_up()
    print("sampling checks passed")
    sys.exit(0)

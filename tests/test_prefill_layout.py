"""The host side of the captured prefill (engine.cuda.prefill_graphs): a prefill laid out in a bucket's fixed shape
says what the eager packing says about the real sequences, and padding names only empty or scratch sequences.
(The graphs themselves need a GPU: tests/test_cuda.py compares them with the eager prefill.)"""

from __future__ import annotations

import random

import pytest
import torch

from engine.cuda.prefill_graphs import PrefillBucket, PrefillGraphs, PrefillInputs, bucket_list, lay_out

SCRATCH = 99


def random_prefill(rng: random.Random, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    n = rng.randint(1, 12)
    lengths = [rng.randint(1, max(1, max_tokens // n)) for _ in range(n)]
    return [[rng.randint(1, 500) for _ in range(k)] for k in lengths], rng.sample(range(60), n)


@pytest.mark.parametrize("seed", range(20))
def test_layout_agrees_with_the_eager_packing(seed):
    fla_index = pytest.importorskip("fla.ops.utils.index")
    rng = random.Random(seed)
    chunks, slots = random_prefill(rng, 700)
    real, n = sum(map(len, chunks)), len(chunks)
    b = next(b for b in bucket_list(2048, 64, 64) if b.tokens >= real and b.seqs >= n)
    x = PrefillInputs.view(lay_out(b, chunks, slots, SCRATCH), b)

    cu = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0)
    assert torch.equal(x.cu[:n + 1], cu) and int(x.cu[-1]) == b.tokens
    assert x.tokens[:real].tolist() == [t for c in chunks for t in c] and not x.tokens[real:].any()
    assert x.slots[:n].tolist() == slots and set(x.slots[n:].tolist()) == {SCRATCH}
    # the eager path's boundaries: a first token names its slot, a last token its sequence
    starts = {int(cu[i]): slots[i] for i in range(n)}
    ends = {int(cu[i + 1]) - 1: i for i in range(n)}
    for t in range(real):
        assert int(x.prev_slot[t]) == starts.get(t, -1) and int(x.end_seq[t]) == ends.get(t, -1)
    if real < b.tokens:  # the padding tokens form sequence n, in the scratch slot
        assert int(x.prev_slot[real]) == SCRATCH and int(x.end_seq[-1]) == n
    # chunk indices: fla's for the real sequences, then the padding's, then rows naming the empty last sequence
    want = fla_index.prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu)
    assert torch.equal(x.chunk_indices[:len(want)], want)
    rest = x.chunk_indices[len(want):]
    padding_chunks = -(-(b.tokens - real) // 64)
    assert rest[:padding_chunks].tolist() == [[n, i] for i in range(padding_chunks)]
    assert set(map(tuple, rest[padding_chunks:].tolist())) == {(b.num_seqs - 1, 0)}
    assert int(x.cu[-1] - x.cu[-2]) == 0  # that last sequence is empty


def test_bucket_bound_holds_the_worst_packing():
    """Every sequence one token past a chunk boundary: the most chunk rows a bucket can need."""
    b = PrefillBucket(tokens=1024, seqs=8, chunk_size=64)
    chunks = [[1] * 65] * 8  # 520 tokens, 16 chunks, + 504 padding tokens in 8 chunks
    x = PrefillInputs.view(lay_out(b, chunks, list(range(8)), SCRATCH), b)
    assert b.num_chunks >= 16 + 8 and x.chunk_indices.shape == (b.num_chunks, 2)
    with pytest.raises(ValueError):
        lay_out(b, [[1] * 1025], [0], SCRATCH)
    with pytest.raises(ValueError):
        lay_out(b, [[1]] * 9, list(range(9)), SCRATCH)


def test_bucket_for_picks_the_smallest_that_holds():
    graphs = PrefillGraphs.__new__(PrefillGraphs)
    graphs.buckets = bucket_list(8192, 64, 128)
    pick = lambda tokens, seqs: (lambda b: (b.tokens, b.seqs))(graphs.bucket_for(tokens, seqs))  # noqa: E731
    assert pick(1, 1) == (64, 1)
    assert pick(64, 3) == (64, 4)
    assert pick(65, 1) == (128, 1)
    assert pick(100, 13) == (128, 16)
    assert pick(100, 20) == (256, 32)  # 20 sequences need 8 tokens each in a bucket: 160 > 128
    assert pick(8000, 100) == (8192, 128)
    assert graphs.bucket_for(8193, 1) is None and graphs.bucket_for(1000, 129) is None
    assert pick(5000, 2) == (6144, 2)

"""Run under TRITON_INTERPRET=1 (see test_kernels_interpreted.py): our Triton kernels and the CUDA model's
decode path, executed by Triton's CPU interpreter, against their plain-torch twins and the reference model."""

from __future__ import annotations

import sys

import torch

from engine.cuda.kernels import (ACT_NONE, ACT_RELU_SQUARE, ln_shift_mix, ln_shift_mix_ref,
                                 prefill_ln_shift_mix, prefill_ln_shift_mix_ref, prefill_mix_in, prefill_mix_in_ref,
                                 prefill_mix_out, prefill_mix_out_ref, relu_square_, small_matmul, small_matmul_ref,
                                 lora_up, pack_time_mix_in, small_matmul_partials, time_mix_in,
                                 wkv7_decode, wkv7_decode_ref)
from engine.cuda.model import CudaRwkv7
from engine.demo import random_state_dict
from engine.model import ReferenceRwkv7
from engine.state import StatePool
from engine.weights import weights_from_state_dict


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_kernels() -> None:
    gen = torch.Generator().manual_seed(0)
    S, H, N, B = 6, 2, 16, 3
    C = H * N
    slots = torch.tensor([5, 0, 2])
    # the shipped launch, and heads looped within a program (the bandwidth benchmark's sweep)
    configs = (None, {"HEADS": 2, "STAGES": 2, "num_warps": 4})
    for layer, state_dtype, config in ((la, dt, cf) for la in (0, 1) for dt in (torch.float32, torch.bfloat16)
                                       for cf in configs):
        state = (torch.randn(S, H, N, N, generator=gen) * 0.3).to(state_dtype)
        twin_state = state.clone()
        vecs = [torch.randn(B, C, generator=gen) for _ in range(8)]
        twin_vfirst = vecs[7].clone()
        p = {n: torch.randn(C, generator=gen) for n in ("w0", "a0", "v0", "k_k", "k_a", "ln_x.weight", "ln_x.bias")}
        p["r_k"] = torch.randn(H, N, generator=gen)
        out, twin_out = torch.empty(B, C), torch.empty(B, C)
        wkv7_decode(state, slots, *vecs, p, layer, 64e-5, out, config=config)
        wkv7_decode_ref(twin_state, slots, *vecs[:7], twin_vfirst, p, layer, 64e-5, twin_out)
        tol = 1e-5 if state_dtype == torch.float32 else 1e-2
        assert rel(out, twin_out) < tol, ("wkv out", layer, state_dtype, config, rel(out, twin_out))
        assert rel(state.float(), twin_state.float()) < tol, ("wkv state", layer, state_dtype)
        assert torch.equal(vecs[7], twin_vfirst)
    ln = (torch.rand(C, generator=gen) + 0.5, torch.randn(C, generator=gen))
    for width in (C, 24):  # a power of two and a masked tail
        x, shift = torch.randn(B, width, generator=gen) * 3 + 1, torch.randn(S, width, generator=gen)
        twin_shift, mix = shift.clone(), torch.rand(7, width, generator=gen)
        lnw = (ln[0][:width].contiguous(), ln[1][:width].contiguous())
        out, twin_out = torch.empty(7, B, width), torch.empty(7, B, width)
        ln_shift_mix(x, lnw, shift, slots, mix, out)
        ln_shift_mix_ref(x, lnw, twin_shift, slots, mix, twin_out)
        assert rel(out, twin_out) < 1e-5 and rel(shift, twin_shift) < 1e-5, ("ln_shift_mix", width)


def check_small_matmul() -> None:
    gen = torch.Generator().manual_seed(3)
    for G, M, N, K, act in ((3, 1, 48, 96, ACT_NONE), (4, 5, 24, 80, ACT_NONE), (1, 16, 70, 130, ACT_RELU_SQUARE)):
        x, w = torch.randn(G, M, K, generator=gen), torch.randn(G, N, K, generator=gen) / K ** 0.5
        res = torch.randn(M, N, generator=gen) if G == 1 else None
        got = small_matmul(x, w, act, residual=res)
        assert rel(got, small_matmul_ref(x, w, act, residual=res)) < 1e-5, ("small_matmul", G, M, N, K, act)
    x, w = torch.randn(4, 3, 64, generator=gen), torch.randn(4, 40, 64, generator=gen) / 8
    for dt, tol in ((torch.bfloat16, 2e-2), (torch.float16, 2e-3)):  # half-precision weights and activations
        got = small_matmul(x.to(dt), w.to(dt), ACT_RELU_SQUARE)
        assert got.dtype == dt and rel(got, small_matmul_ref(x, w, ACT_RELU_SQUARE)) < tol, ("small_matmul", dt)
    x = torch.randn(2, 6, 32, generator=gen)[1]  # a strided 2-D view: rows must still be read right
    w = torch.randn(20, 32, generator=gen)
    assert rel(small_matmul(x, w), x @ w.T) < 1e-5
    h = torch.randn(3, 4097, generator=gen)
    assert torch.equal(relu_square_(h.clone()), torch.relu(h).square())


def check_split_k() -> None:
    """Split-K partial sums: added up by ``ln_shift_mix`` (the residual) and ``wkv7_decode`` (r, k, v)."""
    gen = torch.Generator().manual_seed(5)
    M, K, N = 3, 96, 40
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen) / K ** 0.5
    for split in (1, 2, 4):  # 96 / 4 = 24: slices narrower than the kernel's K step
        part = small_matmul_partials(x, w, split)
        assert part.shape == (split, M, N) and part.dtype == torch.float32
        assert rel(part.sum(0), x @ w.T) < 1e-5, ("partials", split)
        if split > 1:  # really split: the second slice has a share
            assert part[1].abs().sum() > 0, ("second slice", split)
    S, C, slots = 5, 32, torch.tensor([4, 1, 2])
    res, part = torch.randn(M, C, generator=gen), torch.randn(3, M, C, generator=gen)
    shift, mix, ln = torch.randn(S, C, generator=gen), torch.rand(7, C, generator=gen), (torch.rand(C) + .5, torch.randn(C))
    x, twin_x, twin_shift = res.clone(), res.clone(), shift.clone()
    out, twin_out = torch.empty(7, M, C), torch.empty(7, M, C)
    ln_shift_mix(x, ln, shift, slots, mix, out, partials=part)
    ln_shift_mix_ref(twin_x, ln, twin_shift, slots, mix, twin_out, partials=part)
    assert rel(x, res + part.sum(0)) < 1e-6 and rel(out, twin_out) < 1e-5 and rel(shift, twin_shift) < 1e-5


def check_time_mix_in() -> None:
    """r/k/v and the four LoRAs at their own ranks (one of them 0, as layer 0's value LoRA; one not a multiple
    of 64) in one split-K launch, then the LoRA ups (activations applied to the summed partials), against plain
    torch; also the LoRAs without r/k/v; and r/k/v straight from the partials into the wkv kernel."""
    gen = torch.Generator().manual_seed(4)
    C, M, ranks = 64, 3, (64, 32, 0, 40)
    rkv = [torch.randn(C, C, generator=gen) / C ** 0.5 for _ in range(3)]
    down = [torch.randn(r, C, generator=gen) / C ** 0.5 for r in ranks]
    up = [torch.randn(C, r, generator=gen) for r in ranks]
    mixed = torch.randn(7, M, C, generator=gen)
    for with_rkv, split in ((True, 2), (False, 1)):
        packed_in, packed_up, packed_ranks = pack_time_mix_in(rkv if with_rkv else [], down, up)
        assert packed_ranks == (64, 64, 64, 64)
        y = time_mix_in(mixed, packed_in, packed_ranks, split)
        assert y.shape == (split, M, packed_in.shape[0])
        lo = y[:, :, 3 * C:] if with_rkv else y
        for j in range(3 if with_rkv else 0):
            assert rel(y[:, :, j * C:(j + 1) * C].sum(0), mixed[j] @ rkv[j].T) < 1e-5, ("rkv", j)
        offsets = [sum(packed_ranks[:j]) for j in range(4)]
        for j, r in enumerate(ranks):
            got = lo.sum(0)[:, offsets[j]:offsets[j] + packed_ranks[j]]
            assert rel(got[:, :r], mixed[3 + j] @ down[j].T) < 1e-5 if r else True, ("lora down", j)
            assert torch.all(got[:, r:] == 0), ("lora padding", j)
        out = lora_up(lo, packed_up, packed_ranks, torch.float32)
        for j, r in enumerate(ranks):
            act = lo.sum(0)[:, offsets[j]:offsets[j] + r]
            act = act.tanh() if j == 0 else act.sigmoid() if j == 3 else act
            assert rel(out[j], act @ up[j].T) < 1e-5 if r else torch.all(out[j] == 0), ("lora up", j)
    H, N, B, slots = 2, 32, M, torch.tensor([2, 0, 1])
    state = torch.randn(3, H, N, N, generator=gen) * 0.3
    twin_state = state.clone()
    vecs = [torch.randn(B, C, generator=gen) for _ in range(5)]
    p = {n: torch.randn(C, generator=gen) for n in ("w0", "a0", "v0", "k_k", "k_a", "ln_x.weight", "ln_x.bias")}
    p["r_k"] = torch.randn(H, N, generator=gen)
    v_first, twin_first = vecs[4].clone(), vecs[4].clone()
    out, twin_out = torch.empty(B, C), torch.empty(B, C)
    r, k, v = (y[:, :, j * C:(j + 1) * C] for j in range(3))
    wkv7_decode(state, slots, r, k, v, *vecs[:4], v_first, p, 1, 64e-5, out)
    wkv7_decode_ref(twin_state, slots, r.sum(0), k.sum(0), v.sum(0), *vecs[:4], twin_first, p, 1, 64e-5, twin_out)
    assert rel(out, twin_out) < 1e-5 and rel(state, twin_state) < 1e-5, "wkv from partials"


def check_prefill_mix() -> None:
    """The prefill's elementwise kernels around fla (fla itself needs a GPU: the GPU tests cover the whole)."""
    gen = torch.Generator().manual_seed(4)
    T, H, N = 21, 2, 16  # T not a multiple of the token block
    C = H * N
    p = {n: torch.randn(C, generator=gen) for n in ("w0", "a0", "v0", "k_k", "k_a", "ln_x.weight", "ln_x.bias")}
    p["r_k"] = torch.randn(H, N, generator=gen)
    for layer in (0, 1):
        r, k, v, wl, al, vl, g = (torch.randn(T, C, generator=gen) for _ in range(7))
        vf = torch.randn(T, C, generator=gen)
        twin_vf = vf.clone()
        got = prefill_mix_in(r, k, v, wl, al, vl, vf, p, layer, H)
        want = prefill_mix_in_ref(r, k, v, wl, al, vl, twin_vf, p, layer, H)
        for name, a, b in zip(("log_decay", "k", "v", "a", "b", "bonus"), got, want):
            assert rel(a, b) < 1e-5, ("prefill_mix_in", layer, name, rel(a, b))
        assert torch.equal(vf, twin_vf), ("v_first", layer)
        o = torch.randn(T, C, generator=gen)
        out = prefill_mix_out(o, got[2], got[5], g, p, 64e-5)
        assert rel(out, prefill_mix_out_ref(o, want[2], want[5], g, p, 64e-5)) < 1e-5, ("prefill_mix_out", layer)
    lengths, slots = [1, 7, 4, 9], [3, 0, 5, 1]  # a one-token sequence: its first token is its last
    cu = torch.tensor([0] + lengths).cumsum(0)
    for width in (C, 24):
        x, shift = torch.randn(int(cu[-1]), width, generator=gen) * 2 + 1, torch.randn(6, width, generator=gen)
        twin_shift, mix = shift.clone(), torch.rand(7, width, generator=gen)
        ln = (torch.rand(width, generator=gen) + 0.5, torch.randn(width, generator=gen))
        prev_slot = torch.full((len(x),), -1, dtype=torch.int32)
        end_seq = prev_slot.clone()
        prev_slot[cu[:-1]] = torch.tensor(slots, dtype=torch.int32)
        end_seq[cu[1:] - 1] = torch.arange(len(slots), dtype=torch.int32)
        got = prefill_ln_shift_mix(x, ln, shift, torch.tensor(slots), prev_slot, end_seq, mix)
        want = prefill_ln_shift_mix_ref(x, ln, twin_shift, torch.tensor(slots), cu[:-1], cu[1:] - 1, mix)
        assert rel(got, want) < 1e-5 and rel(shift, twin_shift) < 1e-5, ("prefill_ln_shift_mix", width)


def check_decode_path() -> None:
    weights = weights_from_state_dict(random_state_dict(layers=3, width=128, vocab=500, head_size=32, seed=2))
    pool = StatePool(weights.shape, 5, "cpu")
    ref = ReferenceRwkv7(weights, pool)
    fast = CudaRwkv7(weights, pool, enforce_eager=True)
    for small_batch_max in (16, 0):  # the weight-streaming kernels, then the cuBLAS/bmm path
        fast.small_batch_max = small_batch_max
        check_decode_equal(ref, fast, pool)


def check_decode_equal(ref, fast, pool) -> None:
    ref.prefill([list(range(1, 30))], [1])
    ref.prefill([list(range(5, 20))], [3])
    saved = [t.clone() for t in (pool.wkv, pool.att_shift, pool.ffn_shift)]
    tokens, slots = torch.tensor([7, 9]), torch.tensor([3, 1])
    expected = ref.decode(tokens, slots)
    expected_state = [t.clone() for t in (pool.wkv, pool.att_shift, pool.ffn_shift)]
    for t, s in zip((pool.wkv, pool.att_shift, pool.ffn_shift), saved):
        t.copy_(s)
    got = fast.decode(tokens, slots)
    assert rel(got, expected) < 1e-5, rel(got, expected)
    for a, b in zip((pool.wkv, pool.att_shift, pool.ffn_shift), expected_state):
        assert rel(a, b) < 1e-5


def check_half_precision_decode() -> None:
    """bf16 and fp16 weights (fp32 state) through both decode paths track the fp32 reference model."""
    w32 = weights_from_state_dict(random_state_dict(layers=2, width=128, vocab=500, head_size=32, seed=5))
    for dt, tol in ((torch.bfloat16, 3e-2), (torch.float16, 3e-3)):
        w = w32.to("cpu", dt)
        for small_batch_max in (16, 0):
            ref = ReferenceRwkv7(w32, StatePool(w32.shape, 4, "cpu"))
            fast = CudaRwkv7(w, StatePool(w.shape, 4, "cpu", dt, torch.float32), enforce_eager=True)
            fast.small_batch_max = small_batch_max
            tokens, slots = torch.tensor([7, 9]), torch.tensor([2, 0])
            for step in range(3):
                want, got = ref.decode(tokens, slots), fast.decode(tokens, slots)
                assert rel(got, want) < tol, ("half decode", dt, small_batch_max, step, rel(got, want))
                tokens = want.argmax(-1)


def check_fp8_weights() -> None:
    """fp8 weights (per-row scales) through the weight-streaming kernels: the dot of the widened fp8 tiles, each
    column scaled once, equals the dequantized matrix's product; the small-batch decode tracks the reference model
    on the dequantized weights (the LoRA downs are fp8 there too: the tolerance)."""
    from engine.quant import Fp8Matrix
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 96, generator=gen), torch.randn(40, 96, generator=gen) / 10
    m = Fp8Matrix.of(w)
    deq = m.dequantized(torch.float32)
    for act in (ACT_NONE, ACT_RELU_SQUARE):
        assert rel(small_matmul(x, m, act), small_matmul_ref(x[None], deq[None], act)[0]) < 1e-5, ("fp8", act)
    assert rel(small_matmul_partials(x, m, 2).sum(0), x @ deq.T) < 1e-5, "fp8 partials"
    # the r/k/v projections of larger batches: three inputs quantized in one launch, each GEMM into its slice
    from engine.cuda.kernels import fp8_linear, fp8_linear_stacked
    xs = torch.randn(3, 16, 96, generator=gen)
    ms = tuple(Fp8Matrix.of(torch.randn(40, 96, generator=gen) / 10) for _ in range(3))
    for rows in (16, 5):  # 5: not a multiple of 16, one padded GEMM each
        want = torch.stack([fp8_linear(xs[j, :rows], mm) for j, mm in enumerate(ms)])
        assert torch.equal(fp8_linear_stacked(xs[:, :rows].contiguous(), ms), want), ("fp8 stacked", rows)
    w32 = weights_from_state_dict(random_state_dict(layers=2, width=128, vocab=500, head_size=32, seed=7))
    w8 = w32.quantized_fp8()
    ref = ReferenceRwkv7(w8.dequantized(torch.float32), StatePool(w32.shape, 4, "cpu"))
    fast = CudaRwkv7(w8, StatePool(w32.shape, 4, "cpu"), enforce_eager=True)
    tokens, slots = torch.tensor([7, 9]), torch.tensor([2, 0])
    for step in range(3):
        want, got = ref.decode(tokens, slots), fast.decode(tokens, slots)
        assert rel(got, want) < 5e-3, ("fp8 decode", step, rel(got, want))
        tokens = want.argmax(-1)


if __name__ == "__main__":
    check_kernels()
    check_small_matmul()
    check_split_k()
    check_time_mix_in()
    check_prefill_mix()
    check_decode_path()
    check_half_precision_decode()
    check_fp8_weights()
    print("kernel checks passed")
    sys.exit(0)

"""fp8 weights and the looped wkv launches on the GPU. Needs a GPU (fp8 GEMMs: Hopper or newer)."""

from __future__ import annotations

import pytest
import torch

from engine.demo import random_state_dict
from engine.state import StatePool
from engine.weights import weights_from_state_dict

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def needs_fp8() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fp8 GEMMs need Hopper or newer")


def build(weights, fp8: bool, slots: int, eager: bool = False):
    from engine.cuda.model import CudaRwkv7
    w = weights.to(DEVICE, torch.bfloat16)
    if fp8:
        w = w.quantized_fp8()
    return CudaRwkv7(w, StatePool(w.shape, slots + 1, DEVICE, torch.bfloat16, torch.float32), enforce_eager=eager)


@pytest.fixture(scope="module")
def small_weights():
    return weights_from_state_dict(random_state_dict(layers=3, width=256, vocab=4096, seed=1, device=DEVICE))


@pytest.mark.parametrize("act", [0, 1], ids=["plain", "relu2"])
def test_the_activation_quantize_kernel_is_the_torch_quantization_bit_for_bit(act):
    needs_fp8()
    from engine.cuda.kernels import _quantize_activations, fp8_linear
    from engine.quant import Fp8Matrix, quantize_rows
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(37, 512, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = Fp8Matrix.of(torch.randn(256, 512, device=DEVICE, generator=gen))
    xa = x if act == 0 else torch.relu(x.float()).square().to(torch.bfloat16)
    q, scale = _quantize_activations(x, act)
    want_q, want_scale = quantize_rows(xa if act == 0 else torch.relu(x.float()).square())
    assert torch.equal(scale[:37], want_scale)
    differ = (q[:37].view(torch.uint8) != want_q.view(torch.uint8)).nonzero()
    examples = [(xa[i, j].item(), q[i, j].item(), want_q[i, j].item()) for i, j in differ[:3].tolist()]
    assert len(differ) == 0, f"{len(differ)} of {q[:37].numel()} bytes differ, e.g. (x, ours, torch's): {examples}"
    assert not q[37:].float().any() and torch.equal(scale[37:], torch.ones_like(scale[37:]))  # the GEMM's padding
    got = fp8_linear(x, w, act=act)
    if act == 0:  # the same quantized rows, the same GEMM: the same bits
        assert torch.equal(got, w.linear(x))
    assert got.shape == (37, 256)
    assert rel_err(got, xa.float() @ w.dequantized(torch.float32).T) < 0.08


@pytest.mark.parametrize("rows", [64, 20])
def test_the_stacked_rkv_projections_are_the_separate_ones_bit_for_bit(rows):
    needs_fp8()
    from engine.cuda.kernels import fp8_linear, fp8_linear_stacked
    from engine.quant import Fp8Matrix
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    xs = torch.randn(3, rows, 512, device=DEVICE, generator=gen).to(torch.bfloat16)
    ms = tuple(Fp8Matrix.of(torch.randn(512, 512, device=DEVICE, generator=gen)) for _ in range(3))
    want = torch.stack([fp8_linear(xs[j], m) for j, m in enumerate(ms)])
    assert torch.equal(fp8_linear_stacked(xs, ms), want)


# KL p99 of fp8 from bf16 weights that random 1.5B-shape weights stay under. The product's target (≤ 1e-2) is
# for trained weights: a random net amplifies the rounding layer by layer (on one shape trained on CPU,
# benchmarks.tiny_trained_model, the trained weights gave 2.5e-3 where their random twin gave 3.4e-2; random 1.5B
# weights measured 3.6e-2 over 8 × 2,048 positions and 7.0e-2 over this test's 4 × 48). A wrong scale, row or
# layout gives a KL of order 1 or more.
RANDOM_WEIGHTS_FP8_KL_P99 = 1.5e-1


def test_fp8_decode_tracks_bf16_within_its_kl_budget():
    """1.5B shape, random weights: 48 teacher-forced steps at batch 4 (weight-streaming kernels) and 64 (fp8
    GEMMs); KL of the fp8 distribution from the bf16 one within the random-weights budget at p99."""
    needs_fp8()
    from benchmarks.decode_accuracy import kl_divergence
    weights = weights_from_state_dict(random_state_dict(layers=24, width=2048, vocab=65536, seed=0, device=DEVICE))
    bf16, fp8 = build(weights, False, 64), build(weights, True, 64)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for batch in (4, 64):
        tokens = torch.randint(1, 65536, (batch, 48), device=DEVICE, generator=gen)
        slots = torch.arange(batch, device=DEVICE)
        kls = []
        for t in range(48):
            kls.append(kl_divergence(bf16.decode(tokens[:, t], slots), fp8.decode(tokens[:, t], slots)))
        kl = torch.stack(kls).flatten()
        print(f"batch {batch}: KL p50 {kl.median():.2e}, p99 {torch.quantile(kl, 0.99):.2e}")
        assert torch.quantile(kl, 0.99) <= RANDOM_WEIGHTS_FP8_KL_P99 and torch.isfinite(kl).all()


@pytest.mark.parametrize("batch", [11, 40], ids=["small", "gemm"])
def test_fp8_graph_decode_equals_eager_bit_for_bit(small_weights, batch):
    needs_fp8()
    graph, eager = build(small_weights, True, 48), build(small_weights, True, 48, eager=True)
    prompts = [list(range(1 + j, 40 + 3 * j)) for j in range(batch)]
    for m in (graph, eager):
        m.prefill(prompts, list(range(batch)))
    tokens = torch.arange(100, 100 + batch, device=DEVICE)
    slots = torch.arange(batch, device=DEVICE)
    for _ in range(4):
        a, b = graph.decode(tokens, slots), eager.decode(tokens, slots)
        assert torch.equal(a, b)
        tokens = a.argmax(-1)


def test_fp8_engine_generates_on_cuda(tmp_path):
    needs_fp8()
    from engine.config import EngineConfig
    from engine.demo import write_demo_model
    from engine.engine import LLMEngine
    from engine.params import SamplingParams
    from engine.sequence import Request
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=0)
    engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, weights="fp8", max_num_seqs=8))
    for i in range(3):
        engine.add(Request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                                                                   ignore_eos=True)))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert sorted(len(v) for v in got.values()) == [20, 20, 20]


def test_heads_looped_per_program_give_the_single_head_launchs_bits():
    """The bandwidth sweep's launches compute each head as the one-head launch with the same warps does."""
    from engine.cuda.kernels import wkv7_decode
    B, H, N = 33, 8, 64
    C = H * N
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    state = torch.randn(B + 1, H, N, N, device=DEVICE, generator=gen) * 0.1
    vecs = [torch.randn(B, C, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(8)]
    p = {x: torch.randn(C, device=DEVICE, generator=gen) for x in ("w0", "a0", "v0", "k_k", "k_a", "ln_x.weight",
                                                                    "ln_x.bias")}
    p["r_k"] = torch.randn(H, N, device=DEVICE, generator=gen)
    slots = torch.randperm(B, device=DEVICE, generator=gen)
    results = {}
    for heads, stages in ((1, 1), (2, 2), (4, 3)):
        s, vf, out = state.clone(), vecs[7].clone(), torch.empty(B, C, device=DEVICE, dtype=torch.bfloat16)
        wkv7_decode(s, slots, *vecs[:7], vf, p, 1, 64e-5, out,
                    config={"HEADS": heads, "STAGES": stages, "num_warps": 4})
        results[heads] = (s, out)
    for heads in (2, 4):
        assert torch.equal(results[heads][0], results[1][0]) and torch.equal(results[heads][1], results[1][1])

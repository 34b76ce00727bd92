"""The CUDA path (fla prefill, fused decode kernel, CUDA graphs) against the fp32 reference. Needs a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.demo import random_state_dict
from engine.model import ReferenceRwkv7
from engine.state import StatePool
from engine.weights import weights_from_state_dict

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def build(weights, dtype, slots=8, state_dtype=torch.float32, eager=False):
    from engine.cuda.model import CudaRwkv7
    w = weights.to(DEVICE, dtype)
    pool = StatePool(w.shape, slots + 1, DEVICE, dtype, state_dtype)
    return CudaRwkv7(w, pool, enforce_eager=eager)


def reference(weights, slots=8):
    w = weights.to(DEVICE, torch.float32)
    return ReferenceRwkv7(w, StatePool(w.shape, slots + 1, DEVICE))


@pytest.fixture(scope="module")
def big_weights():
    """The RWKV-7 1.5B shape (24 × 2048), random weights generated on the GPU."""
    return weights_from_state_dict(random_state_dict(layers=24, width=2048, vocab=65536, seed=0, device=DEVICE))


@pytest.fixture(scope="module")
def small_weights():
    return weights_from_state_dict(random_state_dict(layers=3, width=256, vocab=4096, seed=1, device=DEVICE))


@pytest.fixture(scope="module")
def reference_run(big_weights):
    """fp32 reference logits over a 1,024-token prompt then 256 sampled decode steps (computed once)."""
    ref = reference(big_weights, 2)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 65536, (1024,), generator=gen).tolist()
    logits = [ref.prefill([prompt], [0])[0]]
    tokens = [int(torch.randint(1, 65536, (1,), generator=gen))]
    slot = torch.tensor([0], device=DEVICE)
    for _ in range(256):
        logits.append(ref.decode(torch.tensor(tokens[-1:], device=DEVICE), slot)[0])
        tokens.append(int(torch.multinomial(torch.softmax(logits[-1], -1).cpu(), 1, generator=gen)))
    del ref
    return prompt, tokens, logits


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 2e-3)], ids=["bf16", "fp32"])
def test_cuda_path_tracks_fp32_reference(big_weights, reference_run, dtype, tolerance):
    prompt, tokens, expected = reference_run
    fast = build(big_weights, dtype, 2)
    errors = [rel_err(fast.prefill([prompt], [0])[0], expected[0])]
    slot = torch.tensor([0], device=DEVICE)
    for step in range(256):
        errors.append(rel_err(fast.decode(torch.tensor([tokens[step]], device=DEVICE), slot)[0], expected[step + 1]))
    print(f"{dtype}: max rel err {max(errors):.2e}, prefill {errors[0]:.2e}, first 32 decode mean "
          f"{sum(errors[1:33]) / 32:.2e}, last 32 mean {sum(errors[-32:]) / 32:.2e}")
    assert max(errors) <= tolerance, errors
    assert sum(errors[-32:]) / 32 <= 2 * sum(errors[1:33]) / 32 + 1e-6  # no drift that grows with steps


def test_packed_prefill_equals_one_by_one(small_weights):
    model = build(small_weights, torch.bfloat16, slots=8)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 4096, (n,), generator=gen).tolist() for n in (1, 7, 64, 1000)]
    packed = model.prefill(prompts, [0, 1, 2, 3])
    for j, p in enumerate(prompts):
        alone = model.prefill([p], [4 + j])[0]
        assert rel_err(packed[j], alone) < 1e-3
        for t in (model.pool.wkv, model.pool.att_shift, model.pool.ffn_shift):
            assert rel_err(t[:, j], t[:, 4 + j]) < 1e-3


def test_fla_state_layout_matches_reference(small_weights):
    """Prefill through fla (transposed state) then decode with our kernel == the reference throughout."""
    ref, fast = reference(small_weights, 2), build(small_weights, torch.float32, 2, eager=True)
    prompt = list(range(5, 205))
    err = rel_err(fast.prefill([prompt], [1])[0], ref.prefill([prompt], [1])[0])
    assert err < 2e-3, err
    assert rel_err(fast.pool.wkv[:, 1], ref.pool.wkv[:, 1]) < 2e-3
    t, s = torch.tensor([9], device=DEVICE), torch.tensor([1], device=DEVICE)
    assert rel_err(fast.decode(t, s)[0], ref.decode(t, s)[0]) < 2e-3


def test_graph_decode_equals_eager_bit_for_bit(small_weights):
    graph, eager = build(small_weights, torch.bfloat16, 16), build(small_weights, torch.bfloat16, 16, eager=True)
    prompts = [list(range(1 + j, 40 + 3 * j)) for j in range(11)]
    for m in (graph, eager):
        m.prefill(prompts, list(range(11)))
    tokens = torch.arange(100, 111, device=DEVICE)
    slots = torch.arange(11, device=DEVICE)
    for _ in range(5):
        a, b = graph.decode(tokens, slots), eager.decode(tokens, slots)
        assert torch.equal(a, b)
        tokens = a.argmax(-1)
    assert torch.equal(graph.pool.wkv[:, :11], eager.pool.wkv[:, :11])  # the scratch slot took the padding rows


@pytest.mark.parametrize("lengths", [[1], [7, 64, 1000], [64] * 4, [3] * 13, [250, 6], [128] * 15],
                         ids=["one", "mixed", "fills-chunks", "many-short", "fills-bucket", "fifteen"])
def test_graph_prefill_equals_eager(small_weights, lengths):
    """A prefill padded into a captured bucket gives the eager prefill's logits and states; padding touches
    no slot but the scratch one."""
    graph, eager = build(small_weights, torch.bfloat16, 16), build(small_weights, torch.bfloat16, 16, eager=True)
    gen = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(1, 4096, (n,), generator=gen).tolist() for n in lengths]
    slots = [15 - j for j in range(len(lengths))]  # not 0..n-1: slots and sequence indices differ
    for m in (graph, eager):  # a previous state in the slots: the prefill continues it
        m.prefill([[5, 6, 7]] * len(slots), slots)
    got, want = graph.prefill(prompts, slots), eager.prefill(prompts, slots)
    assert graph.prefill_graphs.bucket_for(sum(lengths), len(lengths)) in graph.prefill_graphs.graphs
    assert eager.prefill_graphs is None
    for j in range(len(lengths)):
        assert rel_err(got[j], want[j]) < 1e-2, j
    for a, b in zip((graph.pool.wkv, graph.pool.att_shift, graph.pool.ffn_shift),
                    (eager.pool.wkv, eager.pool.att_shift, eager.pool.ffn_shift)):
        assert rel_err(a[:, slots], b[:, slots]) < 1e-2
        untouched = [s for s in range(16) if s not in slots]
        assert torch.equal(a[:, untouched], b[:, untouched])  # zero in both: only the scratch slot took padding


def test_overlapped_launches_equal_serial_launches(small_weights, monkeypatch):
    """Programmatic dependent launch lets the large-batch LayerNorm+shift and wkv kernels start before the GEMM
    before them ends: logits and state must equal those of plain serial launches bit for bit (a read before
    the wait would race)."""
    from engine.cuda.kernels import pdl
    if not pdl(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch needs Hopper or newer")
    # both eager at the same batch: the same cuBLAS algorithms and kernel configurations, only the launches differ
    overlapped = build(small_weights, torch.bfloat16, 40, eager=True)
    serial = build(small_weights, torch.bfloat16, 40, eager=True)
    for m in (overlapped, serial):
        m.small_batch_max = 0  # the cuBLAS path at every size
    batch = 37
    prompts = [list(range(2 + j, 30 + 2 * j)) for j in range(batch)]
    slots = torch.arange(batch, device=DEVICE)
    tokens = torch.arange(200, 200 + batch, device=DEVICE)
    for m in (overlapped, serial):
        m.prefill(prompts, list(range(batch)))
    for _ in range(4):
        monkeypatch.setenv("GAGGLE_PDL", "1")
        a = overlapped.decode(tokens, slots)
        monkeypatch.setenv("GAGGLE_PDL", "0")
        b = serial.decode(tokens, slots)
        assert torch.equal(a, b)
        tokens = a.argmax(-1)
    for name in ("wkv", "att_shift", "ffn_shift"):
        assert torch.equal(getattr(overlapped.pool, name)[:, :batch], getattr(serial.pool, name)[:, :batch])


def test_batch_invariance_on_gpu(small_weights):
    model = build(small_weights, torch.bfloat16, 16)
    model.prefill([list(range(3, 60 + j)) for j in range(16)], list(range(16)))
    saved = [t.clone() for t in (model.pool.wkv, model.pool.att_shift, model.pool.ffn_shift)]
    alone = model.decode(torch.tensor([77], device=DEVICE), torch.tensor([5], device=DEVICE))[0]
    for slots in ([5, 1, 2], list(range(16)), [9, 5]):
        for t, s in zip((model.pool.wkv, model.pool.att_shift, model.pool.ffn_shift), saved):
            t.copy_(s)
        toks = torch.tensor([77 if s == 5 else 1000 + s for s in slots], device=DEVICE)
        logits = model.decode(toks, torch.tensor(slots, device=DEVICE))
        assert rel_err(logits[slots.index(5)], alone) < 1e-2


def test_one_slot_engine_warms_up_and_generates_on_cuda(tmp_path):
    """A worker started with --max-num-seqs 1: warm-up's eager packings of several chunks must fit one slot
    (they once asked three sequences of a one-slot pool and crashed)."""
    from engine.config import EngineConfig
    from engine.demo import write_demo_model
    from engine.engine import LLMEngine
    from engine.params import SamplingParams
    from engine.sequence import Request
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=3)
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=1,
                                    max_num_batched_tokens=64))
    engine.warm_up()
    engine.add(Request("x", list(range(10, 90)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    toks = []
    while engine.has_work():
        toks += [t for o in engine.step() for t in o.token_ids]
    assert len(toks) == 5


def test_engine_generates_on_cuda(tmp_path):
    from engine.config import EngineConfig
    from engine.demo import write_demo_model
    from engine.engine import LLMEngine
    from engine.params import SamplingParams
    from engine.sequence import Request
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=3)
    # bf16: fla compiles its fp32 chunk kernels for minutes (it warns fp32 is unsupported on some platforms)
    gpu = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=8,
                                 max_num_batched_tokens=64))
    cpu = LLMEngine(EngineConfig(model=str(path), device="cpu", max_num_seqs=8, max_num_batched_tokens=64))
    assert gpu.runner.backend == "cuda"
    prompt = list(range(10, 90))
    for engine in (gpu, cpu):
        engine.add(Request("x", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    outs = {}
    for name, engine in (("gpu", gpu), ("cpu", cpu)):
        toks = []
        while engine.has_work():
            toks += [t for o in engine.step() for t in o.token_ids]
        outs[name] = toks
    assert len(outs["gpu"]) == len(outs["cpu"]) == 12
    assert outs["gpu"][:2] == outs["cpu"][:2]  # bf16 vs fp32: the first greedy tokens agree (later ones may not)


def test_hf_layout_matches_fla_model(tmp_path):
    fla_models = pytest.importorskip("fla.models")
    from transformers import AutoModelForCausalLM

    from engine.demo import write_demo_model
    from engine.weights import load_model
    path = write_demo_model(tmp_path / "hf", layers=2, width=256, vocab=1024, seed=4, fmt="hf")
    # bf16: fla's chunked delta-rule kernels warn against fp32 and spend minutes autotuning it
    # fuse_norm=False: torch LayerNorms, fewer of fla's Triton kernels to compile (the test spent minutes compiling)
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, fuse_norm=False).to(DEVICE).eval()
    prompt = list(range(3, 67))
    with torch.no_grad():
        expected = theirs(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float()
    ours = reference(load_model(path), 1)
    got = ours.prefill([prompt], [0])[0]
    assert rel_err(got, expected) < 3e-2, rel_err(got, expected)  # a wrong name mapping gives ~1
    assert fla_models is not None


def test_prompt_logprobs_on_cuda_match_the_reference(small_weights):
    """Packed prefill with scoring (two chunks, one scored from its start, one not) == the reference's."""
    ref, fast = reference(small_weights, 3), build(small_weights, torch.float32, 3, eager=True)
    first, second = list(range(5, 69)), list(range(300, 340))
    score = {0: (first[1:], 4)}
    for model in (ref, fast):
        model.pool.wkv.zero_()
    want_rows, want = ref.prefill_with_scores([first, second], [0, 1], score)
    got_rows, got = fast.prefill_with_scores([first, second], [0, 1], score)
    assert set(got) == {0} and len(got[0]) == len(first) - 1
    assert rel_err(got_rows, want_rows) < 2e-3
    for g, w in zip(got[0], want[0]):
        assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 2e-2
        assert [i for i, _ in g.top] == [i for i, _ in w.top]


def _cuda_engine(path, **overrides):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    cfg = dict(model=str(path), device="cuda", max_num_seqs=32, max_num_batched_tokens=256)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def _requests(n: int = 12):
    """Only length finishes: both loops then decode the same rows every step. (A stop seen one step late adds
    a row to the overlapped loop's next step, and on CUDA a row's logits depend in their last bits on the
    batch size — the small-batch kernels vs cuBLAS, its algorithm per M — so stops are compared on CPU.)"""
    from engine.params import SamplingParams
    from engine.sequence import Request
    return [Request(f"r{i}", [1 + (i * 31 + k * 7) % 60000 for k in range(5 + 13 * i)],
                    SamplingParams(max_tokens=20 + i, temperature=0.0 if i % 3 == 0 else 1.0, top_p=0.9, seed=i,
                                   ignore_eos=True, logprobs=2 if i % 5 == 2 else None),
                    n=2 if i % 6 == 5 else 1) for i in range(n)]


def _run(engine, requests) -> dict:
    for r in requests:
        engine.add(r)
    got: dict = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault((o.request_id, o.index), []).extend(o.token_ids)
    return got


def test_overlapped_loop_equals_serial_loop_on_cuda(tmp_path):
    from engine.demo import write_demo_model
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=3)
    serial = _run(_cuda_engine(path, async_scheduling=False), _requests())
    overlapped = _run(_cuda_engine(path, async_scheduling=True), _requests())
    assert overlapped == serial


def test_constrained_outputs_on_cuda_validate_beside_free_ones(tmp_path):
    """The grammar mask through the fused kernel, masks filled while the model runs (the overlapped loop)."""
    import json

    import jsonschema

    from engine.demo import write_demo_model
    from engine.params import SamplingParams
    from engine.sequence import Request
    from benchmarks.serve_loop import TEN_FIELDS
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=3)
    engine = _cuda_engine(path, dtype="bfloat16")
    spec = {"type": "json_schema", "value": TEN_FIELDS}
    for i in range(16):
        params = (SamplingParams(max_tokens=300, seed=i, top_p=0.95, structured=spec) if i % 2 == 0 else
                  SamplingParams(max_tokens=40, seed=i, ignore_eos=True))
        engine.add(Request(f"r{i}", [1 + i, 2, 3], params))
    got = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    for i in range(16):
        outs = got[f"r{i}"]
        if i % 2 == 0:
            assert outs[-1].finish_reason == "stop"
            jsonschema.validate(json.loads("".join(o.text for o in outs)), TEN_FIELDS)
        else:
            assert sum(len(o.token_ids) for o in outs) == 40


def test_overlapped_decode_steps_never_wait_for_the_gpu(tmp_path):
    """In steady decoding a step queues its work and reads the previous step's tokens: the only wait is on that
    step's event. torch's sync debug mode flags any other synchronising call (a blocking copy, .item(), ...)."""
    import warnings

    from engine.demo import write_demo_model
    from engine.params import SamplingParams
    from engine.sequence import Request
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=3)
    engine = _cuda_engine(path)
    engine.warm_up()
    for i in range(16):
        engine.add(Request(f"d{i}", [5, 6, 7 + i], SamplingParams(max_tokens=400, ignore_eos=True, top_p=0.9,
                                                                  seed=i)))
    for _ in range(5):
        engine.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(50):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]


WARM_CHECK = """
import os, sys, torch
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.params import SamplingParams
from engine.sequence import Request
cache = os.environ["TRITON_CACHE_DIR"]
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cuda", max_num_seqs=40, max_num_batched_tokens=512,
                                weights=sys.argv[2]))
engine.warm_up()
model = engine.runner.model
graphs = len(model.graphs.graphs) + len(model.prefill_graphs.graphs)
def entries():
    return sum(len(files) for _, _, files in os.walk(cache))
before = entries()
for batch in (1, 2, 3, 5, 9, 17, 33, 40):
    for i in range(batch):
        engine.add(Request(f"{batch}-{i}", [1 + i] * (1 + 37 * i % 300),
                           SamplingParams(max_tokens=3 + i % 4, top_p=0.9, top_k=5 * (i % 3), seed=i,
                                          logprobs=i % 3 or None, presence_penalty=0.1 * (i % 2))))
    while engine.has_work():
        engine.step()
print("ENTRIES", before, entries(), "GRAPHS", graphs, len(model.graphs.graphs) + len(model.prefill_graphs.graphs))
"""


@pytest.mark.parametrize("weights", ["auto", "fp8"])
def test_warm_up_leaves_nothing_to_compile_or_capture(tmp_path, weights):
    """A fresh Triton cache: after warm_up, requests of every batch size and mixed prompt lengths compile no
    kernel and capture no graph (run in a subprocess: kernels compiled earlier in this process would hide it);
    with fp8 weights too (their quantize kernel and fp8 matmuls)."""
    if weights == "fp8" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fp8 GEMMs need Hopper or newer")
    import os
    import subprocess
    import sys

    from engine.demo import write_demo_model
    from tests.queue_helpers import REPO
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=3)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = subprocess.run([sys.executable, "-c", WARM_CHECK, str(path), weights], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("ENTRIES"))
    _, before, after, _, graphs_before, graphs_after = line.split()
    assert before == after and graphs_before == graphs_after, line


# -- the fused sampler (engine.cuda.sampling) against its twin, the torch path

def sampler_mixes():
    from engine.params import SamplingParams as P
    return [P(temperature=0.0), P(temperature=1.0), P(temperature=1.0, top_p=0.9), P(temperature=0.8, top_k=50),
            P(temperature=1.0, min_p=0.05), P(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5,
                                              repetition_penalty=1.1, logit_bias={11: 3.0, 400: -5.0}),
            P(temperature=1.0, logprobs=5), P(temperature=0.7, top_k=40, top_p=0.95, logprobs=20),
            P(temperature=1.2, top_k=3000, top_p=0.6), P(temperature=1.0, top_k=1), P(temperature=1.0, min_p=1.0),
            P(temperature=0.9, top_p=0.5, min_p=0.02, min_tokens=3, stop_token_ids=[7])]


def admitted_sampler(params, vocab=65536, seed=0):
    from engine.sampler import Sampler
    sampler = Sampler(len(params), vocab, DEVICE)
    for slot, p in enumerate(params):
        sampler.reset_slot(slot, p, seed=seed + slot, prompt_token_ids=[1, 2, 3, 500])
    return sampler


@pytest.mark.parametrize("sigma", [1.0, 6.0])
def test_cuda_sampler_picks_the_torch_path_tokens(sigma):
    """V = 65,536, ~200 rows of every mix: the kernel and the torch path on the same logits and counters
    pick the same token (fused multiply-adds and fast exps may flip a near-tie: 0.5% allowed) and the
    same raw logprobs."""
    from engine.cuda.sampling import sample_rows, sample_rows_ref
    params = sampler_mixes() * 16
    sampler = admitted_sampler(params)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    agree = total = 0
    for _ in range(4):
        logits = torch.randn(len(params), 65536, device=DEVICE, generator=gen) * sigma
        slots = torch.randperm(len(params), device=DEVICE, generator=gen)
        f = sampler._features()
        got = sample_rows(logits, slots, sampler.tables, f, sampler._kernel)
        want = sample_rows_ref(logits, slots, sampler.tables, f)
        same = got.tokens == want.tokens
        agree, total = agree + int(same.sum()), total + len(params)
        asked = (want.logprobs_k >= 0) & same
        assert torch.allclose(got.logprobs[asked], want.logprobs[asked], atol=1e-4)
        cols = torch.arange(want.top_ids.shape[1], device=DEVICE) < want.logprobs_k.unsqueeze(1)
        assert torch.allclose(got.top_logprobs[cols], want.top_logprobs[cols], atol=1e-4)
        sampler._record(slots, want.tokens)
    assert agree >= 0.995 * total, (agree, total)


def oracle_probabilities(row, p):
    """The kept set's probabilities in float64 by sorting the row (top_k, then top_p renormalised over the k,
    ties at the threshold kept): independent of both samplers."""
    probs = torch.softmax(row.double() / p.temperature, 0)
    order = probs.argsort(descending=True)
    ranked = probs[order]
    k = p.top_k if p.top_k > 0 else len(ranked)
    top = ranked[:k] / ranked[:k].sum()
    n_keep = int(((top.cumsum(0) - top) < p.top_p).sum()) if p.top_p < 1 else k
    kept = probs >= ranked[max(n_keep, 1) - 1]
    return torch.where(kept, probs, 0.0) / probs[kept].sum()


@pytest.mark.parametrize("sigma,params", [(6.0, dict(top_p=0.9)), (1.0, dict(top_k=20)), (1.0, dict(top_p=0.9)),
                                          (6.0, dict(top_k=40, top_p=0.95))])
def test_cuda_sampler_distribution_matches_a_sorted_oracle(sigma, params):
    """2,048 sequences × 8 steps on one row: the drawn tokens' frequencies in ten bins of equal oracle mass
    (a bin per token when the kept set is small) against the oracle, chi-square; nothing outside the set."""
    from engine.params import SamplingParams
    p = SamplingParams(temperature=1.0, **params)
    row = torch.randn(65536, generator=torch.Generator().manual_seed(2)) * sigma
    sampler = admitted_sampler([p] * 2048)
    slots, logits = torch.arange(2048, device=DEVICE), row.to(DEVICE).expand(2048, -1).contiguous()
    drawn = torch.cat([sampler.sample_device(logits, slots).tokens.cpu() for _ in range(8)])
    q = oracle_probabilities(row, p)
    assert bool((q[drawn] > 0).all()), "drew a token the oracle drops"
    kept = q.nonzero().squeeze(1)
    if len(kept) <= 12:
        bins, expected = drawn, q
    else:  # deciles of mass, the most probable tokens first
        order = kept[q[kept].argsort(descending=True)]
        decile = torch.zeros(65536, dtype=torch.int64)
        decile[order] = (torch.cumsum(q[order], 0) - q[order]).mul(10).long().clamp(max=9)
        bins, expected = decile[drawn], torch.zeros(10, dtype=torch.float64).index_add_(0, decile[order], q[order])
    observed = torch.bincount(bins, minlength=len(expected)).double()
    expected = expected * len(drawn)
    used = expected > 0
    dof = int(used.sum()) - 1
    chi2 = float(((observed[used] - expected[used]) ** 2 / expected[used]).sum())
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)


@pytest.mark.parametrize("target", [dict(temperature=0.9, top_p=0.8, top_k=500, presence_penalty=0.3, logprobs=2),
                                    dict(temperature=1.0, top_p=0.9, logprobs=5), dict(temperature=1.0, min_p=0.05)])
def test_cuda_sampler_is_deterministic_and_batch_invariant(target):
    """A sequence's token and logprob: the same twice, alone, and at rows of batches of 7, 17 and 1,024 (the
    launch shapes a filter step may take by its size), bit for bit."""
    from engine.params import SamplingParams
    target = SamplingParams(**target)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    row = torch.randn(65536, device=DEVICE, generator=gen) * 2
    seen = []
    for batch, position in ((1, 0), (7, 3), (17, 16), (1024, 0), (1024, 517), (1024, 1023)):
        params = (sampler_mixes() * 100)[:batch]
        params[position] = target
        sampler = admitted_sampler(params)
        sampler.reset_slot(position, target, seed=42, prompt_token_ids=[5])
        logits = torch.randn(batch, 65536, device=DEVICE, generator=gen)
        logits[position] = row
        slots = torch.arange(batch, device=DEVICE)
        kept = [t for t in (sampler._generated, sampler.output_counts) if t is not None]  # counts: penalty rows only
        state = [t.clone() for t in kept]
        first = sampler.sample_device(logits, slots)
        for t, saved in zip(kept, state):
            t.copy_(saved)  # the same positions again: the same noise
        again = sampler.sample_device(logits, slots)
        assert torch.equal(first.tokens, again.tokens)
        lp = float(first.logprobs[position]) if target.logprobs is not None else None  # else undefined
        seen.append((int(first.tokens[position]), lp))
    assert len(set(seen)) == 1, seen


EXACT_ROWS = {  # rows with no filters or logprobs: plain, and processed (penalties, bias and a ban across the row)
    "plain": dict(temperature=1.0),
    "processed": dict(temperature=1.0, repetition_penalty=1.3, logit_bias={100: 2.0, 40000: 5.0, 65000: 4.0},
                      min_tokens=1, stop_token_ids=[3, 50000]),
}


@pytest.mark.parametrize("kind", sorted(EXACT_ROWS))
def test_exact_rows_take_one_token_in_every_launch_shape(kind):
    """T=1 rows with no filters or logprobs run the split race alone or among few (processed rows too: each
    program processes its own segment), the wide shape up to 256 rows and the small one beyond: a row gets the
    same token in all three, and the rows of each batch agree with the torch path (near-ties aside)."""
    from engine.cuda.sampling import FEW_ROWS, SPLIT_ROWS, config_for
    from engine.params import SamplingParams
    params = SamplingParams(**EXACT_ROWS[kind])
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    row = torch.randn(65536, device=DEVICE, generator=gen) * 3
    shapes, tokens, agree, total = set(), set(), 0, 0
    for batch in (1, SPLIT_ROWS, FEW_ROWS, 1024):
        shapes.add(config_for(65536, batch, exact=True))
        sampler = admitted_sampler([params] * batch)
        sampler.reset_slot(batch - 1, params, seed=99, prompt_token_ids=[1])
        logits = torch.randn(batch, 65536, device=DEVICE, generator=gen)
        logits[batch - 1] = row
        slots = torch.arange(batch, device=DEVICE)
        want = sample_rows_ref_tokens(sampler, logits, slots)
        got = sampler.sample_device(logits, slots).tokens
        tokens.add(int(got[-1]))
        agree, total = agree + int((got == want).sum()), total + batch
    assert len(shapes) == 3, shapes
    assert len(tokens) == 1, tokens
    assert agree >= 0.995 * total, (agree, total)


def sample_rows_ref_tokens(sampler, logits, slots):
    from engine.cuda.sampling import sample_rows_ref
    return sample_rows_ref(logits, slots, sampler.tables, sampler._features()).tokens


def test_sample_device_never_synchronises():
    """The step loop may queue the sampler behind the model: sample_device must not wait for the device."""
    params = sampler_mixes() * 4
    sampler = admitted_sampler(params)
    logits = torch.randn(len(params), 65536, device=DEVICE)
    slots = torch.arange(len(params), device=DEVICE)
    sampler.sample_device(logits, slots)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = sampler.sample_device(logits, slots)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.to_host().token_ids == out.tokens.tolist()


def test_sampler_warm_up_leaves_nothing_to_compile(monkeypatch):
    """After warm_up no step compiles a Triton kernel, whatever the mix, batch size or table widths."""
    import triton
    from engine.params import SamplingParams
    from engine.sampler import Sampler
    sampler = Sampler(64, 65536, DEVICE)
    sampler.warm_up([1, 5, 64])
    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: compiled.append(kw["repr"]) or False)
    wide_bias = SamplingParams(logit_bias={i: 1.0 for i in range(0, 65536, 4000)}, logprobs=20, min_tokens=2)
    for slot, p in enumerate(sampler_mixes() * 5 + [wide_bias]):
        sampler.reset_slot(slot, p, seed=slot, prompt_token_ids=[3, 4])
    logits = torch.randn(64, 65536, device=DEVICE)
    for b in (1, 5, 64, 3, 60):
        sampler.sample(logits[:b], torch.arange(b, device=DEVICE) + (60 - b if b <= 4 else 0))
    sampler.sample(logits[0].expand(4, -1), torch.arange(4, device=DEVICE))  # a broadcast row, as a prefill's
    assert compiled == [], compiled


def test_batched_admission_on_cuda_writes_what_the_cpu_path_writes():
    """``Sampler.reset_slots`` on CUDA (pinned copies, index_copy_) leaves the same tables as on the CPU."""
    from engine.params import SamplingParams
    from engine.sampler import Admission, Sampler
    batch = [Admission(7, SamplingParams(temperature=0.8, top_p=0.9, logit_bias={5: 1.5, 9: -3.0}), 1, [1, 2]),
             Admission(2, SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]), 2, [3]),
             Admission(5, SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, logprobs=2), 3, [6, 6, 8])]
    tables = []
    for device in ("cpu", "cuda"):
        sampler = Sampler(8, 512, device, use_kernel=False)
        sampler.reset_slots(batch, eos_token_ids=[0])
        tables.append([None if t is None else t.cpu() for t in sampler.tables])
    for cpu, cuda in zip(*tables):
        assert (cpu is None and cuda is None) or torch.equal(cpu, cuda)


def test_plain_greedy_argmax_path_equals_the_kernel():
    """An all-greedy step on CUDA takes ``argmax``: the same tokens as the kernel's greedy rows (ties included)
    and the same counters."""
    from engine.cuda.sampling import sample_rows
    from engine.params import SamplingParams
    from engine.sample_layout import Features
    from engine.sampler import Sampler
    fast, kernel = Sampler(64, 65536, "cuda"), Sampler(64, 65536, "cuda")
    for s in (fast, kernel):
        for slot in range(64):
            s.reset_slot(slot, SamplingParams(temperature=0.0), seed=slot, prompt_token_ids=[1])
    assert fast._features().plain_greedy
    logits = torch.randn(48, 65536, device=DEVICE)
    logits[3, 100] = logits[3, 9000] = 50.0  # a tie
    slots = torch.randperm(64, device=DEVICE)[:48]
    got = fast.sample_device(logits, slots).tokens
    want = sample_rows(logits, slots, kernel.tables, Features(greedy=True), kernel._kernel, record=True).tokens
    assert torch.equal(got, want) and int(got[3]) == 100
    assert torch.equal(fast._generated, kernel._generated)


@pytest.mark.gpu
def test_prefix_cache_on_cuda_resumes_what_a_cold_prefill_computes(tmp_path):
    """A prompt started from a prefix state (on the device, and moved to the host tier) predicts what the whole
    prompt prefilled from token 0 does: the same first token, logprobs within bf16 noise (the split differs, so
    the GEMMs' shapes do: last bits, as between batch sizes)."""
    from engine.demo import write_demo_model
    from engine.params import SamplingParams
    from engine.sequence import Request
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=5)
    shared = [1 + (k * 37) % 60000 for k in range(192)]
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)

    def first_tokens(engine):
        got = []
        for i, p in enumerate(prompts):
            engine.add(Request(f"r{i}", p, params))
            outs = []
            while engine.has_work():
                outs += engine.step()
            got.append((outs[0].token_ids[0], outs[0].logprobs[0].logprob, outs[0].num_cached_tokens))
        return got

    cold = first_tokens(_cuda_engine(path, prefix_cache_gib=0))
    warm_engine = _cuda_engine(path)
    warm = first_tokens(warm_engine)
    assert [c for _, _, c in warm] == [0, 0, 192, 192]
    for (t_cold, lp_cold, _), (t_warm, lp_warm, _) in zip(cold, warm):
        assert t_cold == t_warm and abs(lp_cold - lp_warm) < 2e-2
    # the device tier pushed to the host and back
    cache = warm_engine.prefix_cache
    cache.device_bytes = warm_engine.runner.prefix_cache_row_bytes
    again = first_tokens(warm_engine)
    assert cache.stats.demoted > 0 and [t for t, _, _ in again] == [t for t, _, _ in cold]


@pytest.mark.gpu
def test_a_burst_of_checkpoints_never_has_more_copies_to_the_host_in_flight_than_spare_rows(tmp_path):
    """A wave of sequences finishing together makes a checkpoint each: with the device tier full, those pushed
    out go to the host only while a spare device row is free for the new one (no step waits on a copy); the rest
    are dropped. Output is unchanged (greedy, against the cache off: no prompt shares a prefix)."""
    from engine.demo import write_demo_model
    from engine.params import SamplingParams
    from engine.sequence import Request
    from engine.state import CheckpointSlab
    path = write_demo_model(tmp_path / "m.pth", layers=2, width=256, vocab=65536, seed=6)
    prompts = [[1 + (i * 7919 + k * 104729) % 60000 for k in range(48)] for i in range(32)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(engine, check=None):
        for i, p in enumerate(prompts):
            engine.add(Request(f"r{i}", p, params))
        outs = {}
        while engine.has_work():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
            if check is not None:
                check()
        return outs

    cold_engine = _cuda_engine(path, prefix_cache_gib=0)
    cold = run(cold_engine)
    # a checkpoint row as the runner sizes it (fp32 logits), from the cold engine's pool: no engine loaded for it
    row_bytes = CheckpointSlab.row_bytes(cold_engine.runner.pool, cold_engine.runner.vocab_size, torch.float32)
    engine = _cuda_engine(path, prefix_cache_gib=16.5 * row_bytes / 2**30)  # 16 rows
    runner = engine.runner
    assert runner._spare_rows == 2
    in_flight = []
    warm = run(engine, lambda: in_flight.append(len(runner._demoting)))
    assert warm == cold
    assert max(in_flight) <= runner._spare_rows  # 64 checkpoints through 14 cache rows

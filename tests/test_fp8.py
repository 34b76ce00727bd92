"""fp8 (e4m3) weights: the quantization's round trip and scales, files written by ``gaggle quantize``, and the
engine with ``weights="fp8"`` (on CPU the reference model computes with the dequantized weights; the fp8 GEMMs
and kernels are checked under the interpreter and on the GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.quant import FP8, FP8_MAX, SCALE_SUFFIX, Fp8Matrix, dequantize_rows, is_quantized_name, quantize_rows
from engine.weights import ModelFormatError, load_model
from tests.queue_helpers import REPO


def test_each_row_uses_the_whole_e4m3_range_and_comes_back_within_its_rounding():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=gen) * torch.logspace(-4, 2, 64)[:, None]  # rows of very different sizes
    w[5] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert scale[5] == 1.0 and torch.all(q[5].float() == 0)
    nonzero = torch.arange(64) != 5
    assert torch.all(q.float().abs().amax(1)[nonzero] == FP8_MAX)  # each row's largest value maps to 448
    back = dequantize_rows(q, scale)
    # e4m3: 3 mantissa bits, relative rounding ≤ 2^-4 for normal values; subnormals (below 2^-6 of a row's
    # scale unit) round to 2^-9 steps
    bound = torch.maximum(w.abs() * 2 ** -4, scale[:, None] * 2 ** -10)
    assert torch.all((back - w).abs() <= bound * 1.0001)
    m = Fp8Matrix.of(w)
    assert torch.equal(m.rows(3, 7).q.float(), q[3:7].float()) and torch.equal(m.rows(3, 7).scale, scale[3:7])


def test_the_fp8_gemm_twin_scales_rows_and_columns():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(48, 64, generator=gen)
    m = Fp8Matrix.of(w)
    xq, sx = quantize_rows(x)
    want = dequantize_rows(xq, sx) @ m.dequantized(torch.float32).T
    got = m.linear(x, out_dtype=torch.float32)
    assert got.shape == (5, 48) and torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_only_the_projections_and_ffn_are_quantized():
    assert is_quantized_name("blocks.3.att.receptance.weight") and is_quantized_name("blocks.0.ffn.value.weight")
    for name in ("emb.weight", "head.weight", "blocks.0.att.w1", "blocks.0.ln1.weight", "blocks.1.att.r_k"):
        assert not is_quantized_name(name)


def test_a_quantized_file_loads_as_the_same_bytes_as_quantizing_at_load(tiny_model_path, tmp_path):
    out = tmp_path / "tiny-fp8.pth"
    done = subprocess.run([sys.executable, "-m", "cli.main", "quantize", "--model", str(tiny_model_path), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size < tiny_model_path.stat().st_size
    saved = load_model(out)
    at_load = load_model(tiny_model_path).to("cpu", torch.bfloat16).quantized_fp8()
    assert saved.has_fp8
    for name, t in at_load.tensors.items():
        if t.dtype == FP8 or name.endswith(SCALE_SUFFIX):
            assert torch.equal(saved.tensors[name].view(torch.uint8) if t.dtype == FP8 else saved.tensors[name],
                               t.view(torch.uint8) if t.dtype == FP8 else t), name


def test_the_engine_serves_a_quantized_file_as_the_model_quantized_at_load(tiny_model_path, tmp_path):
    from engine.params import SamplingParams
    from engine.sequence import Request
    out = tmp_path / "tiny-fp8.pth"
    subprocess.run([sys.executable, "-m", "cli.main", "quantize", "--model", str(tiny_model_path), "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)

    def tokens(engine) -> list[int]:
        engine.add(Request("r", [5, 6, 7, 8, 9], params))
        got = []
        while engine.has_work():
            for o in engine.step():
                got += o.token_ids
        return got
    # the CPU engine computes in fp32: quantize-at-load from bf16 as a GPU does (the file's bytes)
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    quantized_at_load = LLMEngine(EngineConfig(model=str(tiny_model_path), device="cpu", dtype="bfloat16",
                                               weights="fp8", max_num_seqs=4, prefix_cache_gib=0.0))
    from_file = LLMEngine(EngineConfig(model=str(out), device="cpu", dtype="bfloat16", max_num_seqs=4,
                                       prefix_cache_gib=0.0))
    plain = LLMEngine(EngineConfig(model=str(tiny_model_path), device="cpu", dtype="bfloat16", max_num_seqs=4,
                                   prefix_cache_gib=0.0))
    assert len(a := tokens(quantized_at_load)) == 12 and a == tokens(from_file)
    assert quantized_at_load.runner.state_namespace(None) == from_file.runner.state_namespace(None)
    assert plain.runner.state_namespace(None) != from_file.runner.state_namespace(None)  # never share states


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw.pop("blocks.0.att.key.weight" + SCALE_SUFFIX), "needs its scales"),
    (lambda raw: raw.__setitem__("blocks.0.att.key.weight" + SCALE_SUFFIX, torch.ones(3)), "needs its scales"),
    (lambda raw: raw.__setitem__("head.weight", raw["head.weight"].to(FP8)), "only the projection and FFN"),
])
def test_a_damaged_quantized_file_is_a_clear_error(tiny_model_path, tmp_path, damage, message):
    from engine.quant import quantize_state_dict
    raw = quantize_state_dict(torch.load(tiny_model_path, weights_only=True))
    damage(raw)
    bad = tmp_path / "bad.pth"
    torch.save(raw, bad)
    with pytest.raises(ModelFormatError, match=message):
        load_model(bad)


def test_weights_fp8_is_a_flag_and_a_checked_setting():
    import argparse

    from engine.args import add_engine_args, engine_config_from_args
    from engine.config import EngineConfig
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--model", "m.pth", "--weights", "fp8"])).weights == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--weights", "int4"])
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="fp4")

"""The fused Triton kernels run on CPU through Triton's interpreter (no GPU needed) and must equal their twins
(and the sampling kernel, whose control flow the interpreter does not type-check, compiles for Hopper)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.queue_helpers import REPO


def run_interpreted(module: str, success: str, *args: str) -> None:
    """``python -m module`` under Triton's CPU interpreter; it must exit 0 and print ``success``."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert success in proc.stdout


def test_triton_kernels_match_torch_twins_under_the_interpreter():
    run_interpreted("tests.kernel_check", "kernel checks passed")


def test_sampling_kernel_matches_torch_twin_under_the_interpreter():
    run_interpreted("tests.sampling_check", "sampling checks passed")


def test_sampling_kernel_with_lane_band_matches_torch_twin_under_the_interpreter():
    run_interpreted("tests.sampling_check", "sampling checks passed (lane band)", "--lane-band")


def test_sampling_kernel_without_runners_up_matches_torch_twin_under_the_interpreter():
    run_interpreted("tests.sampling_check", "sampling checks passed (no runners-up)", "--no-runners-up")


def test_sampling_kernel_compiles_for_hopper():
    """The interpreter runs any Python; the compiler also checks types (a loop-carried constant, a tensor
    where a pointer goes). Compiled here for sm_90 without a GPU; its streaming loops must stay pipelined."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernel_source import sample_kernel_source
    src, num_warps = sample_kernel_source({"FILTER": True, "LOGPROBS": True, "PREPARE": True})  # every stage
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    except RuntimeError as e:  # a triton without its CUDA compiler (ptxas) cannot say
        pytest.skip(f"no CUDA code generation here: {e}")
    assert "cp.async" in ptx
    import triton.language as tl

    import engine.cuda.sampling as kernel
    for switch, other in (("RUNNERS_ON", False), ("LANE_BAND_ON", True)):  # the switches' other side compiles too
        setattr(kernel, switch, tl.constexpr(other))
        try:
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
            assert "cp.async" in ptx, switch
        finally:
            setattr(kernel, switch, tl.constexpr(not other))
    capped = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": 168})
    assert ".maxnreg 168" in capped.asm["ptx"]  # FILTER_MAX_REGISTERS's launch option
    from engine.cuda.sampling import _race_finish_kernel, _race_split_kernel  # the split race, for few plain rows
    split = {"logits": "*fp32", "V": "i32", "stride": "i32", "slots": "*i64", "fparams": "*fp32", "iparams": "*i64",
             "generated": "*i64", "best": "*i64", "SEGMENT": "constexpr", "BLOCK": "constexpr"}
    ptx = triton.compile(ASTSource(fn=_race_split_kernel, signature=split, constexprs={"SEGMENT": 2048, "BLOCK": 1024}),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "atom.global" in ptx
    finish = {"slots": "*i64", "generated": "*i64", "counts": "*i32", "V": "i32", "best": "*i64", "record": "i32",
              "has_penalty_state": "i32", "out_token": "*i64"}
    triton.compile(ASTSource(fn=_race_finish_kernel, signature=finish), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 1})

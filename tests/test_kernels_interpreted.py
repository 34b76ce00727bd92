"""The fused Triton kernels run on CPU through Triton's interpreter (no GPU needed) and must equal their twins
(and the sampling kernel, whose control flow the interpreter does not type-check, compiles for Hopper)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.queue_helpers import REPO


# Each check is a process of its own under Triton's interpreter (CPU-bound, single-threaded): all start together
# with the first test that needs one, so on CI's two cores they take about half the time they took one by one.
CHECKS = {
    "kernels": (("tests.kernel_check",), "kernel checks passed"),
    "sampling": (("tests.sampling_check",), "sampling checks passed"),
}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """``python -m module args`` under the interpreter for every check, started at once; each test waits for
    its own, which must exit 0 and print its success line."""
    pytest.importorskip("triton")
    logs = tmp_path_factory.mktemp("interpreted")
    procs = {}
    for name, (argv, _) in CHECKS.items():
        out = open(logs / f"{name}.log", "w+")
        procs[name] = (subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                        env={**os.environ, "TRITON_INTERPRET": "1"}), out)

    def finish(name: str) -> None:
        proc, out = procs[name]
        proc.wait(timeout=900)
        out.seek(0)
        text = out.read()
        assert proc.returncode == 0, text[-6000:]
        assert CHECKS[name][1] in text

    yield finish
    for proc, out in procs.values():
        proc.kill()
        proc.wait()
        out.close()


def test_triton_kernels_match_torch_twins_under_the_interpreter(interpreted):
    interpreted("kernels")


def test_sampling_kernel_matches_torch_twin_under_the_interpreter(interpreted):
    interpreted("sampling")


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
    src, num_warps = sample_kernel_source({"FILTER": False, "LOGPROBS": False, "PREPARE": True})  # one-pass processed
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    assert "cp.async" in ptx
    from engine.cuda.sampling.split import _race_finish_kernel, _race_split_kernel  # the split race: few exact rows
    split = {"logits": "*fp32", "V": "i32", "stride": "i32", "slots": "*i64", "fparams": "*fp32", "iparams": "*i64",
             "generated": "*i64", "best": "*i64", "vkeys": "*i32", "bias_ids": "*i64", "bias_vals": "*fp32",
             "bias_w": "i32", "ban_ids": "*i64", "ban_w": "i32", "counts": "*i32", "in_prompt": "*u8",
             "has_penalty_state": "i32", "masks": "*i32", "mask_w": "i32", "has_masks": "i32", "scratch": "*fp32",
             "PREPARE": "constexpr", "SEGMENT": "constexpr", "BLOCK": "constexpr"}
    for prepare in (False, True):  # plain rows, and rows processed segment by segment
        ptx = triton.compile(ASTSource(fn=_race_split_kernel, signature=split,
                                       constexprs={"PREPARE": prepare, "SEGMENT": 2048, "BLOCK": 1024}),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert "atom.global" in ptx
    finish = {"slots": "*i64", "generated": "*i64", "counts": "*i32", "V": "i32", "best": "*i64", "record": "i32",
              "has_penalty_state": "i32", "out_token": "*i64"}
    triton.compile(ASTSource(fn=_race_finish_kernel, signature=finish), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 1})

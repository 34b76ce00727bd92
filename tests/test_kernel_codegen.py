"""The small-batch matmul's code for Hopper, compiled here without a GPU: its weight loads must stay 16-byte
asynchronous copies (``cp.async``) in every form the decode uses. A split-K loop bound once turned them into
scalar 2-byte loads — a 13% slower batch-1 step on the H200 that no numerical test could see."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.cuda.kernels import (ACT_NONE, ACT_RELU_SQUARE, PACK_LORA_UP, PACK_NONE,  # noqa: E402
                                 PACK_TIME_MIX_IN, _small_matmul_kernel)

HOPPER = GPUTarget("cuda", 90, 32)
CONSTEXPRS = ("ACT", "HAS_RES", "IEEE", "UPCAST", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT", "SPLIT_IN", "PACK", "GC",
              "R0", "R1", "R2", "SCALED")
# pointers 16-byte aligned, sizes and strides multiples of 16: what Triton's launcher specializes on a GPU
ALIGNED = (0, 1, 2, 3, 4, 6, 7, 10, 11, 12, 13)

FORMS = {  # name: (x dtype, out dtype, constexprs): the launches of CudaRwkv7._decode_small at the 1.5B shape
    "time_mix_in, split 2": ("bf16", "fp32", dict(PACK=PACK_TIME_MIX_IN, GC=2048, SPLIT=2)),
    "lora_up from partials": ("fp32", "bf16", dict(PACK=PACK_LORA_UP, SPLIT_IN=2)),
    "output, split 4": ("bf16", "fp32", dict(SPLIT=4)),
    "ffn key, relu²": ("bf16", "bf16", dict(ACT=ACT_RELU_SQUARE)),
    "residual fused, no split": ("bf16", "bf16", dict(HAS_RES=True)),
    # fp8 weights (--weights fp8): the same launches reading e4m3 rows and their scales
    "fp8 time_mix_in, split 2": ("bf16", "fp32", dict(PACK=PACK_TIME_MIX_IN, GC=2048, SPLIT=2, SCALED=True)),
    "fp8 output, split 4": ("bf16", "fp32", dict(SPLIT=4, SCALED=True)),
    "fp8 ffn key, relu²": ("bf16", "bf16", dict(ACT=ACT_RELU_SQUARE, SCALED=True)),
}


def _ptx(x: str, out: str, constexprs: dict) -> str:
    fp8 = constexprs.get("SCALED", False)
    signature = {"x": f"*{x}", "w": "*fp8e4nv" if fp8 else "*bf16", "out": f"*{out}", "res": f"*{out}",
                 "w_scale": "*fp32"}
    signature.update({n: "i32" for n in ("M", "N", "K", "sxs", "sxg", "sxm", "sos", "sog", "som")})
    signature.update({n: "constexpr" for n in CONSTEXPRS})
    values = dict(ACT=ACT_NONE, HAS_RES=False, IEEE=False, UPCAST=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                  SPLIT=1, SPLIT_IN=0, PACK=PACK_NONE, GC=0, R0=128, R1=128, R2=64, SCALED=False) | constexprs
    src = ASTSource(fn=_small_matmul_kernel, signature=signature, constexprs=values,
                    attrs={(i,): [["tt.divisibility", 16]] for i in ALIGNED})
    return triton.compile(src, target=HOPPER, options={"num_warps": 4, "num_stages": 4}).asm["ptx"]


@pytest.mark.parametrize("form", list(FORMS))
def test_weight_loads_stay_16_byte_async_copies(form):
    try:
        ptx = _ptx(*FORMS[form])
    except RuntimeError as e:  # a triton without its CUDA compiler (ptxas) cannot say
        pytest.skip(f"no CUDA code generation here: {e}")
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    # the weight tile: 64 rows × 128 bf16 = 1,024 16-byte chunks over 128 threads, 8 per thread and stage (fp8:
    # half the bytes, 4)
    assert len(copies) >= (4 if FORMS[form][2].get("SCALED") else 8), (form, len(copies))
    scalar = re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx)
    assert len(scalar) <= 16, (form, len(scalar))  # at most the activation rows (16 × 128 / 128 threads)

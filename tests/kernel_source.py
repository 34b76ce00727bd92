"""The sampling kernel as Triton's compiler takes it without a GPU (an ASTSource for sm_90 code generation): a
variant's stages, the vocabulary's size and launch shape, 16-byte aligned pointers. Used by the compile test (and
to read a variant's registers and spills with ptxas)."""

from __future__ import annotations

import inspect

POINTERS = {"logits": "fp32", "slots": "i64", "fparams": "fp32", "iparams": "i64", "generated": "i64", "vkeys": "i32",
            "bias_ids": "i64", "bias_vals": "fp32", "ban_ids": "i64", "counts": "i32", "in_prompt": "u8",
            "masks": "i32", "scratch": "fp32", "band_v": "fp32", "band_i": "i32", "out_token": "i64", "out_k": "i64",
            "out_lp": "fp32", "out_top_id": "i64", "out_top_lp": "fp32"}


def sample_kernel_source(stages: dict[str, bool], vocab_size: int = 65536):
    """(ASTSource, num_warps) of ``_sample_kernel`` with ``stages`` (FILTER, LOGPROBS, PREPARE; BAND, the lane
    band, with FILTER unless said)."""
    from triton.compiler import ASTSource
    stages = {"BAND": stages.get("FILTER", False), **stages}

    from engine.cuda.sampling import config_for
    from engine.cuda.sampling.kernel import _sample_kernel
    names = list(inspect.signature(_sample_kernel.fn).parameters)
    signature = {n: f"*{POINTERS[n]}" if n in POINTERS else "constexpr" if n in ("V", "CAP", "BLOCK", *stages)
                 else "i32" for n in names}
    aligned = [i for i, n in enumerate(names) if n in POINTERS or n == "stride"]
    cfg = config_for(vocab_size)
    src = ASTSource(fn=_sample_kernel, signature=signature,
                    constexprs={"V": vocab_size, "CAP": cfg.cap, "BLOCK": cfg.block, **stages},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return src, cfg.num_warps

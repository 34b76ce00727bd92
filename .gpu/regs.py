"""Registers and spills of the sampler kernel's variants compiled for sm_90 on this machine (no GPU needed):
python .gpu/regs.py [SWITCH=on|off ...] [maxnreg=N], e.g. LANE_BAND_ON=on RUNNERS_ON=off maxnreg=128."""
import glob
import inspect
import os
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import engine.cuda.sampling as kernel

PTXAS = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")))[0]
options = {}
for arg in sys.argv[1:]:
    name, value = arg.split("=")
    if name == "maxnreg":  # a register cap (Triton's launch option): spills against occupancy
        options["maxnreg"] = int(value)
    else:
        setattr(kernel, name, tl.constexpr(value == "on"))
pointers = {"logits": "fp32", "slots": "i64", "fparams": "fp32", "iparams": "i64", "generated": "i64",
            "bias_ids": "i64", "bias_vals": "fp32", "ban_ids": "i64", "counts": "i32", "in_prompt": "u8",
            "masks": "i32", "scratch": "fp32", "band_v": "fp32", "band_i": "i32", "out_token": "i64", "out_k": "i64",
            "out_lp": "fp32", "out_top_id": "i64", "out_top_lp": "fp32"}
names = list(inspect.signature(kernel._sample_kernel.fn).parameters)
cfg = kernel.config_for(65536)
for stages in ({"FILTER": f, "LOGPROBS": lp, "PREPARE": pr} for f in (True, False) for lp in (True, False)
               for pr in (True, False)):
    signature = {n: f"*{pointers[n]}" if n in pointers else "constexpr" if n in ("CAP", "BLOCK", *stages) else "i32"
                 for n in names}
    aligned = [i for i, n in enumerate(names) if n in pointers or n in ("V", "stride")]
    src = ASTSource(fn=kernel._sample_kernel, signature=signature,
                    constexprs={"CAP": cfg.cap, "BLOCK": cfg.block, **stages},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps, **options})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    used = [out.stderr[-300:]] if out.returncode else [line.split("ptxas info    : ")[-1] for line in out.stderr.splitlines() if "Used" in line or "spill" in line]
    print({k: int(v) for k, v in stages.items()}, *used)

"""Registers and spills of the sampler kernel's variants compiled for sm_90a on this machine (no GPU needed):
python .gpu/regs.py [--filters] [NAME=VALUE ...] [maxnreg=N], e.g. SPLIT_ROWS=8 (a module setting of
engine.cuda.sampling: on / off, or a number) maxnreg=128."""
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

import engine.cuda.sampling as kernel
from switch_ab import setting
from tests.kernel_source import sample_kernel_source


# the wheel's ptxas for recent PTX versions (its plain ptxas is older than the PTX Triton writes)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
options = {}
filters_only = "--filters" in sys.argv  # the variants the inexact shape is for
for arg in (a for a in sys.argv[1:] if a != "--filters"):
    name, value = arg.split("=")
    if name == "maxnreg":  # a register cap (Triton's launch option): spills against occupancy
        options["maxnreg"] = int(value)
    else:
        setattr(kernel, name, setting(value))
for stages in ({"FILTER": f, "LOGPROBS": lp, "PREPARE": pr, "BAND": band} for f in (True, False)
               for band in ((True, False) if f else (False,)) for lp in (True, False) for pr in (True, False)
               if f or not filters_only):
    src, num_warps = sample_kernel_source(stages)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    used = [out.stderr[-300:]] if out.returncode else [line.split("info    : ")[-1] for line in out.stderr.splitlines()
                                                       if "Used" in line or "spill" in line]
    print({k: int(v) for k, v in stages.items()}, f"{num_warps} warps", *used)

"""The sampler table at batch 1 and 1,024 with the kernel's switches set: python .gpu/switch_ab.py
[--compile-only] [NAME=on|off|N ...], e.g. LANE_BAND_ON=on, RUNNERS_ON=off (module constexprs of
engine.cuda.sampling) or FILTER_MAX_REGISTERS=168 (a launch option). Run each setting in its own process and
Triton cache (.gpu/c.sh compiles them all in parallel first, then times them one at a time)."""
import sys

import torch
import triton.language as tl

import engine.cuda.sampling as kernel
from engine.bench import bench_sampler_cuda

args = [a for a in sys.argv[1:] if a != "--compile-only"]
for arg in args:
    name, value = arg.split("=")
    assert hasattr(kernel, name), name
    setattr(kernel, name, int(value) if value.isdigit() else tl.constexpr(value == "on"))
if "--compile-only" in sys.argv:
    from engine.sampler import Sampler
    Sampler(1024, 65536, "cuda").warm_up((1, 1024))
    torch.cuda.synchronize()
    print("compiled", " ".join(args) or "defaults")
else:
    print(" ".join(args) or "defaults")
    print(bench_sampler_cuda(batches=(1, 1024)))

"""The sampler table at batch 1 and 1,024 with the kernel's switches set: python .gpu/switch_ab.py
[NAME=on|off ...], e.g. LANE_BAND_ON=on or RUNNERS_ON=off (module constexprs of engine.cuda.sampling). Run each
setting in its own process and Triton cache."""
import sys

import triton.language as tl

import engine.cuda.sampling as kernel
from engine.bench import bench_sampler_cuda

for arg in sys.argv[1:]:
    name, value = arg.split("=")
    assert hasattr(kernel, name), name
    setattr(kernel, name, tl.constexpr(value == "on"))
print(" ".join(sys.argv[1:]) or "defaults")
print(bench_sampler_cuda(batches=(1, 1024)))

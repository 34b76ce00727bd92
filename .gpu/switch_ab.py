"""The sampler table at batch 1 and 1,024 with the kernel's switches set: python .gpu/switch_ab.py
[NAME=on|off|N ...], e.g. LANE_BAND_ON=on, RUNNERS_ON=off (module constexprs of engine.cuda.sampling) or
FILTER_MAX_REGISTERS=168 (a launch option). Run each setting in its own process and Triton cache."""
import sys

import triton.language as tl

import engine.cuda.sampling as kernel
from engine.bench import bench_sampler_cuda

for arg in sys.argv[1:]:
    name, value = arg.split("=")
    assert hasattr(kernel, name), name
    setattr(kernel, name, int(value) if value.isdigit() else tl.constexpr(value == "on"))
print(" ".join(sys.argv[1:]) or "defaults")
print(bench_sampler_cuda(batches=(1, 1024)))

"""The sampler table with the runners-up path on or off (``engine.cuda.sampling.RUNNERS_ON``), batches 1 and
1,024: python .gpu/runners_ab.py on|off. Run each in its own process and Triton cache (a module constexpr)."""
import sys

import triton.language as tl

import engine.cuda.sampling as kernel
from engine.bench import bench_sampler_cuda

kernel.RUNNERS_ON = tl.constexpr(sys.argv[1] == "on")
print(f"RUNNERS_ON={kernel.RUNNERS_ON.value}")
print(bench_sampler_cuda(batches=(1, 1024)))

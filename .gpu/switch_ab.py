"""The sampler table at batch 1 and 1,024 with the kernel's module settings set: python .gpu/switch_ab.py
[--compile-only] [--graphed: each step also replayed from a CUDA graph, the device's time] [NAME=VALUE ...],
e.g. VOCAB_TABLE=off (engine.cuda.sampling's settings: on / off for a constexpr switch, or a number). Run each
setting in its own process and Triton cache (.gpu/lib.sh's `ab` compiles them all in parallel first, then times
them one at a time)."""
import sys

import triton.language as tl


def setting(value: str):
    """on / off: a constexpr switch; N: a number."""
    return int(value) if value.isdigit() else tl.constexpr(value == "on")


def apply(args: list[str]) -> None:
    import engine.cuda.sampling as kernel
    for arg in args:
        name, value = arg.split("=")
        assert hasattr(kernel, name), name
        v = setting(value)
        setattr(kernel, name, bool(v.value) if isinstance(getattr(kernel, name), bool) else v)  # a host-side switch


if __name__ == "__main__":
    import torch

    from engine.bench import bench_sampler_cuda
    args = [a for a in sys.argv[1:] if a not in ("--compile-only", "--graphed")]
    apply(args)
    if "--compile-only" in sys.argv:
        from engine.sampler import Sampler
        Sampler(1024, 65536, "cuda").warm_up((1, 1024))
        torch.cuda.synchronize()
        print("compiled", " ".join(args) or "defaults")
    else:
        print(" ".join(args) or "defaults")
        print(bench_sampler_cuda(batches=(1, 1024), graphed="--graphed" in sys.argv))

"""The wkv decode kernel against the GPU's memory bandwidth: one layer's state update at decode batch sizes, the
bytes it moves per second beside a device-to-device copy of the same state bytes in the same run.

Each (state dtype, batch) row: the state bytes (read once, written once), the per-row vectors the kernel reads and
writes, the kernel's time (the shipped autotuned launch, then each fixed configuration of the sweep: heads per
program, pipeline stages, warps), GB/s over every byte it moves, and that as a fraction of the copy's GB/s.

    python -m benchmarks.wkv_bandwidth                      # 1.5B layer: 32 heads of 64, batch 256 and 1,024
    python -m benchmarks.wkv_bandwidth --sweep              # also every configuration of the sweep
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks.report import command_line, markdown_table, publish
from benchmarks.timing import cuda_time_ms, device_copy_ms

VECTORS_IN = 8  # r, k, v, the w/a/v LoRA outputs, the gate, v_first (bf16 rows of C)


def layer_inputs(batch: int, heads: int, n: int, state_dtype: torch.dtype) -> dict:
    """One layer's decode inputs at ``batch`` rows, slots scattered over a pool of ``batch + 1``."""
    C = heads * n
    gen = torch.Generator(device="cuda").manual_seed(0)
    vec = lambda: torch.randn(batch, C, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    p = {x: torch.randn(C, device="cuda", generator=gen) for x in ("w0", "a0", "v0", "k_k", "k_a", "ln_x.weight",
                                                                    "ln_x.bias")}
    p["r_k"] = torch.randn(heads, n, device="cuda", generator=gen)
    state = (torch.randn(batch + 1, heads, n, n, device="cuda", generator=gen) * 0.1).to(state_dtype)
    return {"state": state, "slots": torch.randperm(batch, device="cuda", generator=gen),
            "vecs": [vec() for _ in range(VECTORS_IN)], "p": p, "out": torch.empty(batch, C, device="cuda",
                                                                                    dtype=torch.bfloat16)}


def kernel_ms(x: dict, config: dict | None, large_batch: bool) -> float:
    from engine.cuda.kernels import wkv7_decode
    return cuda_time_ms(lambda: wkv7_decode(x["state"], x["slots"], *x["vecs"], x["p"], 1, 64e-5, x["out"],
                                            large_batch=large_batch, config=config), iters=50, warmup=5)


def sweep_configs() -> list[dict]:
    configs = [{"HEADS": 1, "STAGES": 1, "num_warps": w} for w in (2, 4, 8)]
    for heads, stages, warps in itertools.product((2, 4), (2, 3), (2, 4, 8)):
        configs.append({"HEADS": heads, "STAGES": stages, "num_warps": warps})
    return configs


def describe(config: dict | None) -> str:
    if config is None:
        return "shipped (autotuned)"
    return f"{config['HEADS']} head(s)/program, {config['STAGES']} stage(s), {config['num_warps']} warps"


def measure(batches: list[int], heads: int, n: int, sweep: bool) -> tuple[list[list], list[list]]:
    rows, best_rows = [], []
    for dtype, batch in itertools.product((torch.float32, torch.bfloat16), batches):
        x = layer_inputs(batch, heads, n, dtype)
        state_bytes = batch * heads * n * n * x["state"].element_size()
        vector_bytes = (VECTORS_IN + 1) * batch * heads * n * 2
        moved = 2 * state_bytes + vector_bytes
        copy = device_copy_ms(state_bytes)
        copy_gbs = 2 * state_bytes / copy / 1e6
        name = str(dtype).split(".")[1]
        results = []
        for config in [None] + (sweep_configs() if sweep else []):
            for large in ((False, True) if config is None else (True,)):
                try:
                    ms = kernel_ms(x, config, large)
                except Exception as e:  # a configuration this GPU cannot run (shared memory): skipped, said
                    print(f"{name} {batch} {describe(config)}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                gbs = moved / ms / 1e6
                label = describe(config) + (" + PDL" if large and config is None else "")
                results.append((ms, label))
                rows.append([name, f"{batch:,}", label, f"{ms * 1e3:.1f}", f"{gbs:,.0f}", f"{copy_gbs:,.0f}",
                             f"{gbs / copy_gbs:.3f}"])
                print(rows[-1], file=sys.stderr, flush=True)
        ms, label = min(results)
        best_rows.append([name, f"{batch:,}", f"{state_bytes * 2 / 2**20:,.0f}", f"{vector_bytes / 2**20:,.1f}",
                          label, f"{ms * 1e3:.1f}", f"{moved / ms / 1e6:,.0f}", f"{copy * 1e3:.1f}",
                          f"{copy_gbs:,.0f}", f"{moved / ms / 1e6 / copy_gbs:.3f}"])
    return rows, best_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,1024")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--sweep", action="store_true", help="every configuration of the sweep, not only the shipped")
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    args = ap.parse_args(argv)
    rows, best = measure([int(b) for b in args.batches.split(",")], args.heads, args.head_size, args.sweep)
    body = (f"One layer ({args.heads} heads × {args.head_size}), slots scattered; GB/s counts the state read and "
            "written and the bf16 vectors; the copy moves the same state bytes (read + write)\n\n"
            + markdown_table(["state", "batch", "state MiB moved", "vectors MiB", "fastest launch", "µs", "GB/s",
                              "copy µs", "copy GB/s", "of copy"], best))
    if args.sweep:
        body += "\nEvery launch measured\n\n" + markdown_table(
            ["state", "batch", "launch", "µs", "GB/s", "copy GB/s", "of copy"], rows)
    publish("wkv-bandwidth", command_line("benchmarks.wkv_bandwidth", argv), body, args.out,
            title="wkv decode kernel against memory bandwidth")
    return 0


if __name__ == "__main__":
    sys.exit(main())

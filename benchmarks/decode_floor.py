"""Decode speed against its memory floor, per model shape × state dtype × weights × batch, with each mode's accuracy.

A decode step reads every weight once and each sequence's recurrent state once and writes the state back, so at
the bandwidth a device-to-device copy reaches (measured in the same run) no step can be shorter than
``(weight bytes + 2 × batch × state bytes) / copy bandwidth``: the floor. The table gives the measured step (CUDA
graphs, random weights), tok/s, the floor's tok/s and the fraction reached, and the step with sampling (T=1,
top_p 0.9). The accuracy columns (``--accuracy-positions``) are ``benchmarks.decode_accuracy``'s teacher-forced
KL against fp32 state, for the first shape.

    python -m benchmarks.decode_floor --shapes 1.5b,2.9b,7.2b --batches 1,256,1024
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks.report import command_line, markdown_table, publish
from benchmarks.timing import cuda_time_ms, device_copy_ms, preset_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    return 2 * nbytes / device_copy_ms(nbytes) * 1e3


def weight_bytes_read(weights) -> int:
    """Bytes a decode step reads of the weights: every matrix but the embedding (of which it reads a few rows)."""
    return sum(t.numel() * t.element_size() for name, t in weights.tensors.items() if name != "emb.weight")


def prefill_row(model, name: str, weights_mode: str, vocab: int) -> list:
    """Prefill tok/s: one 4,096-token prompt, and 64 prompts of 512 packed in one step."""
    prompt = torch.randint(1, vocab, (4096,), generator=torch.Generator().manual_seed(1)).tolist()
    one = cuda_time_ms(lambda: model.prefill([prompt], [0]), iters=5, warmup=2)
    prompts = [prompt[i * 8:i * 8 + 512] for i in range(64)]
    packed = cuda_time_ms(lambda: model.prefill(prompts, list(range(64))), iters=5, warmup=2)
    return [name, weights_mode, f"{4096 / one * 1e3:,.0f}", f"{64 * 512 / packed * 1e3:,.0f}"]


def measure_shape(name: str, batches: list[int], state: str, weights_mode: str, bandwidth: float
                  ) -> tuple[list[list], list | None]:
    """Decode rows for each batch, and with fp32 state the prefill row (the state's dtype barely touches it)."""
    from engine.cuda.model import CudaRwkv7
    from engine.params import SamplingParams
    from engine.sampler import Sampler
    from engine.state import StatePool

    torch.cuda.empty_cache()
    weights = preset_weights(name)
    if weights_mode == "fp8":
        weights = weights.quantized_fp8()
    shape, w_bytes = weights.shape, weight_bytes_read(weights)
    slots_needed = max(batches)
    pool = StatePool(shape, slots_needed + 1, "cuda", torch.bfloat16, DTYPES[state])
    model = CudaRwkv7(weights, pool)
    state_bytes = StatePool.bytes_per_slot(shape, torch.bfloat16, DTYPES[state])
    sampler = Sampler(slots_needed, shape.vocab_size, "cuda")
    for slot in range(slots_needed):
        sampler.reset_slot(slot, SamplingParams(temperature=1.0, top_p=0.9), slot, [1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in batches:
        tokens = torch.randint(1, shape.vocab_size, (b,), device="cuda", generator=gen)
        slots = torch.arange(b, device="cuda")
        ms = cuda_time_ms(lambda: model.decode(tokens, slots))
        both = cuda_time_ms(lambda: sampler.sample(model.decode(tokens, slots), slots), iters=10)
        floor_ms = (w_bytes + 2 * b * state_bytes) / bandwidth * 1e3
        rows.append([name, state, weights_mode, f"{b:,}", f"{ms:.3f}", f"{b / ms * 1e3:,.0f}", f"{floor_ms:.3f}",
                     f"{b / floor_ms * 1e3:,.0f}", f"{floor_ms / ms:.2f}", f"{b / both * 1e3:,.0f}"])
        print(rows[-1], file=sys.stderr, flush=True)  # partial results survive a killed run
    prefill = prefill_row(model, name, weights_mode, shape.vocab_size) if state == "fp32" else None
    if prefill is not None:
        print(prefill, file=sys.stderr, flush=True)
    del model, pool, weights, sampler
    torch.cuda.empty_cache()
    return rows, prefill


def accuracy(shape: str, modes: list[tuple[str, str]], positions: int, streams: int
             ) -> dict[tuple[str, str], list[str]]:
    """Each (state, weights) mode's KL p99 and slope against fp32 state with bf16 weights (that mode itself:
    zero by construction)."""
    from benchmarks.decode_accuracy import build, teacher_forced
    weights = preset_weights(shape)
    tokens = torch.randint(1, weights.shape.vocab_size, (streams, positions),
                           generator=torch.Generator().manual_seed(0)).to("cuda")
    out = {("fp32", "bf16"): ["0 (reference)", "–"]}
    for state, mode in modes:
        if (state, mode) in out:
            continue
        reference = build(weights, "cuda", torch.float32, streams)
        test = build(weights, "cuda", DTYPES[state], streams, fp8=mode == "fp8")
        row = teacher_forced(reference, test, tokens, block=min(512, positions)).row()
        out[(state, mode)] = [row[1], row[7]]
        del reference, test
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1.5b,2.9b,7.2b")
    ap.add_argument("--batches", default="1,256,1024")
    ap.add_argument("--states", default="fp32,bf16")
    ap.add_argument("--weights", default="bf16,fp8", help="bf16 and/or fp8 (engine.quant)")
    ap.add_argument("--accuracy-positions", type=int, default=8192, help="0: no accuracy columns")
    ap.add_argument("--accuracy-streams", type=int, default=8)
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    ap.add_argument("--area", default="decode-floor", help="the BENCHMARKS.md block (runs of other shapes: another)")
    args = ap.parse_args(argv)
    bandwidth = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    shapes = args.shapes.split(",")
    rows = []
    modes = list(itertools.product(args.states.split(","), args.weights.split(",")))
    prefills = []
    for name, (state, mode) in itertools.product(shapes, modes):
        decode, prefill = measure_shape(name, batches, state, mode, bandwidth)
        rows += decode
        prefills += [prefill] if prefill is not None else []
    acc = accuracy(shapes[0], modes, args.accuracy_positions, args.accuracy_streams) if args.accuracy_positions \
        else {}
    for row in rows:
        row += acc.get((row[1], row[2]), ["–", "–"]) if row[0] == shapes[0] else ["–", "–"]
    body = (f"Random weights; floor = (weight bytes + 2 × batch × state bytes) at the device-to-device copy's "
            f"{bandwidth / 1e12:.2f} TB/s (measured in the run); accuracy: teacher-forced over "
            f"{args.accuracy_positions:,} positions × {args.accuracy_streams} streams against fp32 state, "
            "bf16 weights "
            f"({shapes[0]} only; `benchmarks.decode_accuracy`)\n\n"
            + markdown_table(["shape", "state", "weights", "batch", "step ms", "tok/s", "floor ms", "floor tok/s",
                              "of floor", "tok/s with sampling", "KL p99", "KL slope / 1k positions"], rows)
            + "\nPrefill (fp32 state), tok/s\n\n"
            + markdown_table(["shape", "weights", "1 × 4,096", "64 × 512 packed"], prefills))
    publish(args.area, command_line("benchmarks.decode_floor", argv), body, args.out,
            title="Decode against its memory floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Accuracy of a reduced-precision decode mode, teacher-forced: the same token streams fed one token a step
through the fp32-state model with unquantized (bf16) weights and through the mode under test (bf16 state, fp8
weights, both), and per position the KL divergence of the test
mode's next-token distribution from the reference's and the largest logit difference.

The error of a recurrent state can grow with the position (rounding accumulates in the state), so the report gives
the KL per block of positions and the slope of a line fitted through the block means: a mode whose error grows
shows a positive slope that is large beside the mean.

    python -m benchmarks.decode_accuracy --shape 1.5b --positions 8192 --streams 8     # bf16 state, fp8 weights
    python -m benchmarks.decode_accuracy --model demo --device cpu --positions 64      # smoke, the CPU model

Random weights give flatter next-token distributions than a trained model: the KL of a trained checkpoint can
differ, and the table says which weights it used.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from benchmarks.report import command_line, markdown_table, publish


def kl_divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref ‖ P_test) per row, in nats, computed in fp64: ``Σ p_ref · (log p_ref − log p_test)``."""
    ref = torch.log_softmax(ref_logits.double(), dim=-1)
    test = torch.log_softmax(test_logits.double(), dim=-1)
    return (ref.exp() * (ref - test)).sum(-1)


def max_abs_logit_diff(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """The largest |Δlogit| per row."""
    return (ref_logits.double() - test_logits.double()).abs().amax(-1)


def slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    mx = (n - 1) / 2
    my = sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def quantile(values: torch.Tensor, q: float) -> float:
    return float(torch.quantile(values.double().flatten(), q))


@dataclass
class Report:
    """Per-position errors of one mode: ``kl`` and ``max_abs`` are ``[positions, streams]``."""
    kl: torch.Tensor
    max_abs: torch.Tensor
    block: int

    def block_means(self) -> list[float]:
        P = self.kl.shape[0] // self.block * self.block
        return self.kl[:P].view(-1, self.block, self.kl.shape[1]).double().mean((1, 2)).tolist()

    def row(self) -> list[str]:
        means = self.block_means()
        per_1k = slope(means) * 1000 / self.block
        return [f"{quantile(self.kl, 0.5):.2e}", f"{quantile(self.kl, 0.99):.2e}", f"{float(self.kl.max()):.2e}",
                f"{quantile(self.max_abs, 0.99):.3f}", f"{float(self.max_abs.max()):.3f}",
                f"{means[0]:.2e}" if means else "–", f"{means[-1]:.2e}" if means else "–", f"{per_1k:+.2e}"]


MODES = (("bf16 state", torch.bfloat16, False), ("fp8 weights", torch.float32, True),
         ("fp8 weights + bf16 state", torch.bfloat16, True))
HEADER = ["KL p50", "KL p99", "KL max", "max abs Δlogit p99", "max abs Δlogit", "KL mean, first block",
          "KL mean, last block", "KL slope per 1k positions"]


def teacher_forced(reference, test, tokens: torch.Tensor, block: int) -> Report:
    """Feed ``tokens`` ``[streams, positions]`` one position a step through both models (slots 0..streams-1 of
    each, fresh states), comparing each step's logits."""
    S, P = tokens.shape
    slots = torch.arange(S, device=tokens.device)
    kl = torch.empty(P, S, dtype=torch.float64)
    max_abs = torch.empty(P, S, dtype=torch.float64)
    for t in range(P):
        a = reference.decode(tokens[:, t], slots)
        b = test.decode(tokens[:, t], slots)
        kl[t] = kl_divergence(a, b).cpu()
        max_abs[t] = max_abs_logit_diff(a, b).cpu()
    return Report(kl, max_abs, block)


def build(weights, device: str, state_dtype: torch.dtype, streams: int, fp8: bool = False):
    """A model over a fresh pool of ``streams`` slots (+ the CUDA model's scratch slot); ``fp8``: its
    projections and FFN quantized (``engine.quant``; on CPU computed with the dequantized weights)."""
    from engine.state import StatePool
    if fp8:
        weights = weights.quantized_fp8()
        if device == "cpu":
            weights = weights.dequantized(torch.float32)
    pool = StatePool(weights.shape, streams + 1, device, weights.tensors["emb.weight"].dtype
                     if device != "cpu" else torch.float32, state_dtype)
    if device == "cpu":
        from engine.model import ReferenceRwkv7
        return ReferenceRwkv7(weights, pool)
    from engine.cuda.model import CudaRwkv7
    return CudaRwkv7(weights, pool)


def load_weights(args):
    if args.model:
        from pathlib import Path

        from engine.args import ensure_demo_model
        from engine.weights import load_model
        path = ensure_demo_model(Path(".gaggle")) if args.model == "demo" else Path(args.model)
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        return load_model(path).to(args.device, dtype), path.name
    from benchmarks.timing import preset_weights
    return preset_weights(args.shape), f"{args.shape} random bf16"


def text_windows(path: str, streams: int, positions: int, gen: torch.Generator) -> torch.Tensor:
    """``streams`` random windows of ``positions`` bytes of the text at ``path`` (a file, or a directory's ``.py``
    and ``.txt`` files concatenated) as token ids ``[streams, positions]``."""
    from pathlib import Path

    from benchmarks.tiny_trained_model import sample_windows
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in (".py", ".txt"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)
    return sample_windows(data, streams, positions, gen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1.5b", help="a preset shape with random weights (unless --model)")
    ap.add_argument("--model", help="a .pth (or 'demo'): its weights instead of a preset's random ones")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--positions", type=int, default=8192)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--block", type=int, default=512, help="positions per block of the trend")
    ap.add_argument("--text-bytes", help="a file or directory of text: the streams are windows of its bytes (token "
                    "id = byte: a byte-level model's own kind of input, such as benchmarks.tiny_trained_model's) "
                    "instead of random token ids")
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    ap.add_argument("--area", default="decode-accuracy", help="the BENCHMARKS.md block to replace")
    args = ap.parse_args(argv)
    args.block = min(args.block, args.positions)
    weights, name = load_weights(args)
    gen = torch.Generator().manual_seed(0)
    if args.text_bytes:
        tokens = text_windows(args.text_bytes, args.streams, args.positions, gen)
        what = f"windows of the bytes of {args.text_bytes}"
    else:
        tokens = torch.randint(1, weights.shape.vocab_size, (args.streams, args.positions), generator=gen)
        what = "random token streams"
    tokens = tokens.to(args.device)
    reference = build(weights, args.device, torch.float32, args.streams)
    rows = []
    for label, state_dtype, fp8 in MODES:
        test = build(weights, args.device, state_dtype, args.streams, fp8)
        report = teacher_forced(reference, test, tokens, args.block)
        rows.append([label] + report.row())
        del test
        reference = build(weights, args.device, torch.float32, args.streams)  # fresh states for the next mode
    body = (f"Teacher-forced against fp32 state and unquantized weights, {name} weights: {args.streams} {what}"
            f" × {args.positions:,} positions, one token a step; KL(reference ‖ mode) in nats, per "
            "position; the trend "
            f"is a line through the means of blocks of {args.block} positions\n\n"
            + markdown_table(["mode"] + HEADER, rows))
    if args.device == "cpu":
        body += ("\nOn the CPU the fp8 modes compute with the weights' fp8 rounding only (dequantized; no fp8 "
                 "GEMM, so no rounding of the activations)")
    publish(args.area, command_line("benchmarks.decode_accuracy", argv), body, args.out,
            title="Accuracy of reduced-precision decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())

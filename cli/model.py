"""``gaggle demo-model`` and ``gaggle generate``: a model's weights and text in this process, no service."""

from __future__ import annotations

import argparse
import sys

from engine.args import add_engine_args, engine_config_from_args


def add_demo_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--preset", choices=["tiny", "0.1b", "0.4b", "1.5b", "2.9b", "7.2b"])
    p.add_argument("--format", default="pth", choices=["pth", "hf"])
    p.add_argument("--seed", type=int, default=0)


def cmd_demo_model(args: argparse.Namespace) -> int:
    from engine.demo import PRESETS, write_demo_model
    layers, width = args.layers, args.width
    if args.preset:
        layers, width = PRESETS[args.preset]["layers"], PRESETS[args.preset]["width"]
    out = write_demo_model(args.out, layers=layers, width=width, vocab=args.vocab,
                           head_size=args.head_size, seed=args.seed, fmt=args.format)
    print(f"wrote random RWKV-7 weights ({layers} layers, width {width}, vocab {args.vocab}, "
          f"{args.format}) to {out}")
    return 0


def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import LLMEngine
    from engine.params import SamplingParams
    from engine.sequence import Request
    from engine.weights import ModelFormatError

    try:
        engine = LLMEngine(engine_config_from_args(args))
    except ModelFormatError as e:
        print(f"gaggle: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=args.stop or [])
    engine.add(Request("cli", engine.tokenizer.encode(args.prompt), params))
    sys.stdout.write(args.prompt)
    while engine.has_work():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                print(f"\n[finish_reason={out.finish_reason}, tokens={out.num_output_tokens}]", file=sys.stderr)
    sys.stdout.write("\n")
    return 0


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="an RWKV-7 .pth (official layout)")
    p.add_argument("--out", required=True, help="the .pth to write: its projections and FFN in fp8 (e4m3)")


def cmd_quantize(args: argparse.Namespace) -> int:
    """An official .pth with the matrices ``--weights fp8`` quantizes stored in fp8 with their scales: it loads
    in about half the memory, and serves as that file quantized at load would."""
    from pathlib import Path

    import torch

    from engine.quant import quantize_state_dict
    from engine.weights import ModelFormatError, load_model
    src = Path(args.model)
    try:
        if src.is_dir():
            raise ModelFormatError(f"{src} is a directory: quantize takes an official .pth")
        shape = load_model(src).shape  # the format checks serving makes
    except ModelFormatError as e:
        print(f"gaggle: {e}", file=sys.stderr)
        return 2
    raw = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    out = quantize_state_dict(raw)
    torch.save(out, args.out)
    before = sum(t.numel() * t.element_size() for t in raw.values())
    after = sum(t.numel() * t.element_size() for t in out.values())
    print(f"wrote {args.out}: {shape.n_layer} layers, width {shape.n_embd}; {before / 2**30:.2f} GiB -> "
          f"{after / 2**30:.2f} GiB")
    return 0

"""The engine's command-line flags and the engine they build, shared by the ``gaggle`` command and the benchmarks.

The flags are generated from ``EngineConfig``'s fields (as vLLM's ``EngineArgs``), so a default lives in one
place. No torch at import: the API's command line imports this module too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import BACKENDS, DTYPES, WEIGHT_MODES, EngineConfig
from engine.params import STATE_NAME

if TYPE_CHECKING:
    from engine.engine import LLMEngine

DEFAULT_DATA_DIR = ".gaggle"
CPU_MAX_NUM_SEQS = 32  # --max-num-seqs on a CPU (EngineConfig's default is a GPU's)

# the EngineConfig fields offered as flags, in this order, with their help and choices
ENGINE_FLAGS: dict[str, dict] = {
    "model": dict(help="RWKV-7 .pth file or fla-hub directory (default: a demo model with random weights)"),
    "device": dict(help="auto | cpu | cuda | cuda:N"),
    "dtype": dict(choices=DTYPES),
    "state_dtype": dict(choices=("float32", "bfloat16"),
                        help="the recurrent state's dtype: bfloat16 halves its bytes (faster decode at large "
                             "batches, more sequences in memory) at a measured accuracy cost (BENCHMARKS.md)"),
    "weights": dict(choices=WEIGHT_MODES,
                    help="fp8: the projections and FFN in e4m3 with per-channel scales (half their bytes; CUDA "
                         "GEMMs on fp8 tensor cores); auto: as the model file stores them"),
    "backend": dict(choices=BACKENDS),
    "max_num_seqs": dict(help=f"concurrent sequences (default {EngineConfig.max_num_seqs} on GPU, "
                              f"{CPU_MAX_NUM_SEQS} on CPU)"),
    "max_num_batched_tokens": dict(help="tokens per step (decodes + prompt chunks); prefill graphs are captured "
                                        "up to this size"),
    "prefill_hold_tokens": dict(help="beside decodes, new prompts wait until this many prompt tokens wait, so that "
                                     "they share one prefill step (0: admit at once)"),
    "prefill_hold_steps": dict(help="... for at most this many steps"),
    "prefill_per_decode": dict(help="beside decodes, prompt tokens a step per decoding sequence (0: no cap) ..."),
    "min_prefill_chunk": dict(help="... but at least this many"),
    "max_model_len": dict(),
    "prefix_cache_gib": dict(help="GiB of device memory for prompt-prefix states (shared instructions, chat "
                                  "histories: prefilled once; 0 turns the cache off)"),
    "prefix_cache_host_gib": dict(help="... and GiB of pinned host memory they move to when pushed out (CUDA)"),
    "prefix_min_tokens": dict(help="no prefix state is kept for shorter prefixes"),
    "prefix_interval": dict(help="prefix states every this many tokens inside long prompts (0: only at prompt "
                                 "ends and where prompts diverge)"),
    "enforce_eager": dict(help="disable CUDA graphs"),
    "gpu_memory_utilization": dict(),
}
SCHEDULING_FIELDS = ("prefill_hold_tokens", "prefill_hold_steps", "prefill_per_decode", "min_prefill_chunk")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The ``engine`` flag group: one flag per ENGINE_FLAGS field, its default EngineConfig's, and --data-dir."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    g = p.add_argument_group("engine")
    for name, extra in ENGINE_FLAGS.items():
        flag, default = "--" + name.replace("_", "-"), defaults[name]
        if isinstance(default, bool):
            g.add_argument(flag, action="store_true", **extra)
        elif name == "max_num_seqs":  # chosen by the device (engine_config_from_args)
            g.add_argument(flag, type=int, default=None, **extra)
        else:
            g.add_argument(flag, type=str if default is None else type(default), default=default, **extra)
    g.add_argument("--state", action="append", default=[], metavar="NAME=FILE",
                   help="an initial state a request may start from (\"state\": NAME): a state-tuning .pth "
                        "(blocks.N.att.time_state per layer); repeatable")
    g.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the demo model and embedded Redis data live")


def add_engine_kind_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="real",
                   help="real | synthetic:TOKENS_PER_S[:PROMPT_TOKENS_PER_S] (no model: tokens at a fixed rate through "
                        "the real scheduler and I/O, for load tests; prompts at twice the rate unless given)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags name; no --model: the demo model, written once into --data-dir."""
    model = args.model or str(ensure_demo_model(Path(args.data_dir)))
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        cpu = args.device == "cpu" or (args.device == "auto" and not _has_cuda())
        max_num_seqs = CPU_MAX_NUM_SEQS if cpu else EngineConfig.max_num_seqs
    return EngineConfig(model=model, device=args.device, dtype=args.dtype, state_dtype=args.state_dtype,
                        weights=args.weights, backend=args.backend, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max(args.max_num_batched_tokens, max_num_seqs),
                        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        prefix_cache_gib=args.prefix_cache_gib, prefix_cache_host_gib=args.prefix_cache_host_gib,
                        prefix_min_tokens=args.prefix_min_tokens, prefix_interval=args.prefix_interval,
                        initial_states=parse_states(args.state), **scheduling_args(args))


def parse_states(specs: list[str]) -> dict[str, str]:
    """``--state NAME=FILE`` flags as {name: file}; ValueError naming the bad one."""
    states: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not STATE_NAME.fullmatch(name) or not path:
            raise ValueError(f"--state takes NAME=FILE (a name of letters, digits, '.', '_' or '-'), got {spec!r}")
        if name.startswith("file-"):  # worker.contract.UPLOADED_STATE_PREFIX: uploaded states' names
            raise ValueError(f"--state {name}: names starting with 'file-' are those of uploaded state files")
        if name in states:
            raise ValueError(f"--state {name} is given twice")
        if not Path(path).is_file():
            raise ValueError(f"--state {name}: no such file: {path}")
        states[name] = path
    return states


def scheduling_args(args: argparse.Namespace) -> dict:
    """The scheduler's EngineConfig fields from the flags (a real or a synthetic engine)."""
    return {name: getattr(args, name) for name in SCHEDULING_FIELDS}


def worker_engine_config(args: argparse.Namespace, synthetic: tuple[float, float | None] | None) -> EngineConfig:
    """The worker's engine config: the model's, or a synthetic engine's (no model at all)."""
    if synthetic is None:
        return engine_config_from_args(args)
    num_seqs = args.max_num_seqs or 1024
    return EngineConfig(model="synthetic", device="cpu", max_num_seqs=num_seqs,
                        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs),
                        max_model_len=args.max_model_len, **scheduling_args(args))


def build_engine(config: EngineConfig, synthetic: tuple[float, float | None] | None = None) -> LLMEngine:
    """The engine ``config`` names; with ``synthetic`` (decode and prefill rates), tokens at a fixed rate through
    the real scheduler and no model. ModelFormatError is a ValueError."""
    if synthetic is not None:
        from engine.synthetic import synthetic_engine
        return synthetic_engine(config, *synthetic)
    from engine.engine import LLMEngine
    return LLMEngine(config)


def ensure_demo_model(data_dir: Path) -> Path:
    """The demo model (2 layers, width 128, real vocabulary), generated once into ``data_dir``."""
    path = data_dir / "demo-model-L2-D128.pth"
    if not path.exists():
        from engine.demo import write_demo_model
        print(f"gaggle: no --model given; writing a demo model with RANDOM weights to {path} "
              "(its output is gibberish until you pass a real RWKV-7 model)", file=sys.stderr)
        tmp = path.with_suffix(".tmp")
        write_demo_model(tmp, layers=2, width=128, vocab=65536, seed=0)
        tmp.rename(path)
    else:
        print(f"gaggle: no --model given; using the demo model with random weights at {path}", file=sys.stderr)
    return path


def use_triton_cache(data_dir: Path) -> None:
    """Compiled kernels live under the data dir, so a restarted worker loads instead of compiling (set before
    Triton is imported; an explicit TRITON_CACHE_DIR wins)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str((data_dir / "triton-cache").resolve()))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # autotuning results too


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()

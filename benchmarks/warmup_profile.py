"""Where a worker's warm-up time goes: each stage, each Triton compile (kernel, specialisation, seconds, thread)
and each autotuning choice (shipped, tuned or cached), in one process, with the worker's engine config.

    python -m benchmarks.warmup_profile --model 1.5b.pth --data-dir D [--cold] [--retune --write-tuned]

``--cold`` removes ``D/triton-cache`` first (a fresh machine). ``--retune`` times every autotune candidate
instead of taking the choices shipped for this GPU; ``--write-tuned`` then adds what was tuned to the shipped
table (``engine/cuda/tuned/<GPU name>.json``). Prints tables; ``--json PATH`` also writes every record.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import markdown_table


@dataclass
class Compile:
    kernel: str
    specialisation: str
    seconds: float
    start_s: float
    thread: str


@contextlib.contextmanager
def timed_compiles(t0: float) -> Iterator[list[Compile]]:
    """Every Triton JIT compile inside the block (a disk-cache hit counts too: it is a load then)."""
    from triton.runtime.jit import JITFunction
    original = getattr(JITFunction, "_do_compile", None)
    records: list[Compile] = []
    lock = threading.Lock()
    if original is None:  # another Triton: no per-compile records
        print("(this Triton has no JITFunction._do_compile: compiles are not timed)", file=sys.stderr)
        yield records
        return

    def do_compile(self, key, signature, device, constexprs, options, *rest, **kw):
        start = time.perf_counter()
        try:
            return original(self, key, signature, device, constexprs, options, *rest, **kw)
        finally:
            spec = ",".join(f"{_arg_name(self, k)}={v}" for k, v in constexprs.items()
                            if isinstance(v, (int, bool, str)))
            spec += f",warps={getattr(options, 'num_warps', '?')},stages={getattr(options, 'num_stages', '?')}"
            with lock:
                records.append(Compile(f"{self.fn.__module__}.{self.fn.__qualname__}", spec,
                                       time.perf_counter() - start, start - t0, threading.current_thread().name))

    JITFunction._do_compile = do_compile
    try:
        yield records
    finally:
        JITFunction._do_compile = original


def _arg_name(fn, key) -> str:
    """Triton keys a constexpr by its argument's position (a tuple) in some versions, by name in others."""
    if isinstance(key, tuple) and key and isinstance(key[0], int) and key[0] < len(fn.arg_names):
        return fn.arg_names[key[0]]
    return str(key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data-dir", default=".gaggle-warmup")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cold", action="store_true", help="remove the data dir's kernel cache first")
    p.add_argument("--retune", action="store_true", help="ignore the shipped autotune choices")
    p.add_argument("--write-tuned", action="store_true", help="add this run's tunings to the shipped table")
    p.add_argument("--top", type=int, default=30, help="compiles listed one by one")
    p.add_argument("--json", default=None, help="write every record here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    data_dir = Path(args.data_dir)
    if args.cold:
        shutil.rmtree(data_dir / "triton-cache", ignore_errors=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    from engine.args import use_triton_cache
    use_triton_cache(data_dir)

    import torch

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.warmup import WarmupProgress
    imported = time.perf_counter() - t0
    with timed_compiles(t0) as compiles:
        t1 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs))
        torch.cuda.synchronize()
        built = time.perf_counter() - t1
        progress = WarmupProgress(lambda snap: None)
        warm = engine.warm_up(progress, retune=args.retune)
    total = time.perf_counter() - t0
    tunings = engine.runner.tunings

    stages = [["python imports", f"{imported:.1f}"], ["engine build (weights, pools)", f"{built:.1f}"]]
    stages += [[name, f"{s:.1f}"] for name, s in progress.stage_seconds.items()]
    stages += [["warm-up", f"{warm:.1f}"], ["total", f"{total:.1f}"]]
    print(markdown_table(["stage", "s"], stages))

    per_kernel: dict[str, list[float]] = defaultdict(list)
    for c in compiles:
        per_kernel[c.kernel].append(c.seconds)
    rows = sorted(([k, len(v), f"{sum(v):.1f}", f"{max(v):.1f}"] for k, v in per_kernel.items()),
                  key=lambda r: -float(r[2]))
    print(f"{len(compiles)} compiles, {sum(c.seconds for c in compiles):.1f} s of threads in all\n")
    print(markdown_table(["kernel", "compiles", "sum s", "max s"], rows))
    top = sorted(compiles, key=lambda c: -c.seconds)[:args.top]
    print(markdown_table(["kernel", "specialisation", "s", "started at s", "thread"],
                         [[c.kernel.rsplit(".", 1)[-1], c.specialisation[:90], f"{c.seconds:.1f}",
                           f"{c.start_s:.1f}", c.thread] for c in top]))
    print(markdown_table(["kernel", "key", "candidates", "source", "s"],
                         [[t.kernel.rsplit(".", 1)[-1], t.key, t.candidates, t.source, f"{t.seconds:.2f}"]
                          for t in tunings]))
    if args.json:
        Path(args.json).write_text(json.dumps({"stages": stages, "compiles": [asdict(c) for c in compiles],
                                               "tunings": [asdict(t) for t in tunings]}, indent=1))
    if args.write_tuned:
        write_tuned(tunings)
    return 0


def write_tuned(tunings: list) -> None:
    """Add the tunings made here (not the shipped or cached ones) to this GPU's shipped table."""
    from importlib.metadata import version

    import torch
    import triton

    from engine.cuda.autotune import TunedConfigs, tuned_path
    name = torch.cuda.get_device_name()
    table = TunedConfigs.for_device(name)
    table.device = name
    table.versions = {"triton": triton.__version__, "fla": version("fla-core"),
                      "torch": torch.__version__}
    table.add([t for t in tunings if t.source == "tuned"])
    path = tuned_path(name)
    path.parent.mkdir(exist_ok=True)
    path.write_text(table.to_json())
    print(f"wrote {sum(len(v) for v in table.kernels.values())} choices to {path}")


if __name__ == "__main__":
    sys.exit(main())

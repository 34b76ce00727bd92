"""The ``gaggle`` command. Heavy imports (torch) happen inside the subcommands that need them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.logs import setup_logging

DEFAULT_DATA_DIR = ".gaggle"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from engine.config import EngineConfig  # the defaults live there (no torch import)
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="RWKV-7 .pth file or fla-hub directory (default: a demo model with random weights)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    g.add_argument("--max-num-seqs", type=int, default=None, help="concurrent sequences (default 256 on GPU, 32 on CPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="tokens per step (decodes + prompt chunks); prefill graphs are captured up to this size")
    g.add_argument("--prefill-hold-tokens", type=int, default=EngineConfig.prefill_hold_tokens,
                   help="beside decodes, new prompts wait until this many prompt tokens wait, so that they share "
                        "one prefill step (0: admit at once)")
    g.add_argument("--prefill-hold-steps", type=int, default=EngineConfig.prefill_hold_steps,
                   help="... for at most this many steps")
    g.add_argument("--prefill-per-decode", type=float, default=EngineConfig.prefill_per_decode,
                   help="beside decodes, prompt tokens a step per decoding sequence (0: no cap) ...")
    g.add_argument("--min-prefill-chunk", type=int, default=EngineConfig.min_prefill_chunk,
                   help="... but at least this many")
    g.add_argument("--max-model-len", type=int, default=EngineConfig.max_model_len)
    g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    g.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization)
    g.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the demo model and embedded Redis data live")


def engine_config_from_args(args: argparse.Namespace):
    from engine.config import EngineConfig
    model = args.model or str(ensure_demo_model(Path(args.data_dir)))
    device = args.device
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = 32 if device == "cpu" or (device == "auto" and not _has_cuda()) else 256
    return EngineConfig(model=model, device=device, dtype=args.dtype, state_dtype=args.state_dtype,
                        backend=args.backend, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max(args.max_num_batched_tokens, max_num_seqs),
                        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        **scheduling_args(args))


def scheduling_args(args: argparse.Namespace) -> dict:
    """The scheduler's EngineConfig fields from the flags (a real or a synthetic engine)."""
    return dict(prefill_hold_tokens=args.prefill_hold_tokens, prefill_hold_steps=args.prefill_hold_steps,
                prefill_per_decode=args.prefill_per_decode, min_prefill_chunk=args.min_prefill_chunk)


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


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


# -- subcommands --------------------------------------------------------------------------

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


def cmd_worker(args: argparse.Namespace) -> int:
    if args.check:
        return check_worker(args.redis_url, args.name)
    use_triton_cache(Path(args.data_dir))
    from engine.synthetic import parse_engine_spec
    from worker.reader import NameInUse
    from worker.worker import Worker, WorkerConfig, unique_worker_name

    try:
        engine, config = build_engine(args, parse_engine_spec(args.engine))
    except ValueError as e:
        print(f"gaggle: {e}", file=sys.stderr)
        return 2
    engine.warm_up()  # before the first heartbeat: no request waits for a compilation
    device = config.resolved_device()
    cfg = WorkerConfig(redis_url=args.redis_url, name=args.name or unique_worker_name(device),
                       max_deliveries=args.max_deliveries, drain_timeout_s=args.drain_timeout,
                       interactive_reserve=args.interactive_reserve, writer_handover=args.writer_handover,
                       launch=args.launch, log_stats_interval_s=args.log_stats_interval,
                       gc_young_threshold=args.gc_young_threshold)
    worker = Worker(engine, cfg, device=device, model_name=Path(config.model).name)
    worker.install_signal_handlers()
    if args.metrics_port:
        from worker.metrics import serve_worker_metrics
        serve_worker_metrics(worker, args.metrics_port)
    try:
        worker.run(burst=args.burst)
    except NameInUse as e:
        print(f"gaggle: {e}", file=sys.stderr)
        return 2
    return 0


def add_engine_kind_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="real",
                   help="real | synthetic:TOKENS_PER_S[:PROMPT_TOKENS_PER_S] (no model: tokens at a fixed rate through "
                        "the real scheduler and I/O, for load tests; prompts at twice the rate unless given)")


def build_engine(args: argparse.Namespace, synthetic: tuple[float, float | None] | None):
    """The worker's engine and its config: the model's, or (decode and prefill rates) a synthetic one with no
    model at all."""
    from engine.engine import LLMEngine
    if synthetic is not None:
        from engine.config import EngineConfig
        from engine.synthetic import synthetic_engine
        config = EngineConfig(model="synthetic", device="cpu", max_num_seqs=args.max_num_seqs or 1024,
                              max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs or 1024),
                              max_model_len=args.max_model_len, **scheduling_args(args))
        return synthetic_engine(config, *synthetic), config
    config = engine_config_from_args(args)
    return LLMEngine(config), config  # ModelFormatError is a ValueError


def use_triton_cache(data_dir: Path) -> None:
    """Compiled kernels live under the data dir, so a restarted worker loads instead of compiling (set before
    Triton is imported; an explicit TRITON_CACHE_DIR wins)."""
    import os
    os.environ.setdefault("TRITON_CACHE_DIR", str((data_dir / "triton-cache").resolve()))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # autotuning results too


def check_worker(redis_url: str, name: str | None) -> int:
    """Exit status for a container healthcheck: 0 if the named worker's heartbeat is fresh (no name: any worker
    of this host)."""
    import socket

    import redis

    from worker import contract
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2)
        if name:
            alive = [name] if client.exists(contract.heartbeat_key(name)) else []
        else:
            names = [n.decode() for n in client.zrange(contract.WORKER_REGISTRY, 0, -1)]
            beats = client.mget([contract.heartbeat_key(n) for n in names]) if names else []
            host = socket.gethostname()
            alive = [n for n, b in zip(names, beats) if b and contract.Heartbeat.decode(b).host == host]
    except redis.RedisError as e:
        print(f"gaggle: redis unreachable: {e}", file=sys.stderr)
        return 1
    what = name or f"any worker on {socket.gethostname()}"
    print(f"{what}: {'alive (' + ', '.join(alive) + ')' if alive else 'no heartbeat'}")
    return 0 if alive else 1


def cmd_api(args: argparse.Namespace) -> int:
    from api.server import serve  # no torch on this path
    return serve(args)


def add_redis_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default="redis://localhost:6379/0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gaggle", description="RWKV-7 generation service")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--log-format", default="text", choices=["text", "json"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-model", help="write seeded random RWKV-7 weights")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--preset", choices=["tiny", "0.1b", "0.4b", "1.5b", "2.9b", "7.2b"])
    p.add_argument("--format", default="pth", choices=["pth", "hf"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser("generate", help="generate text from a prompt in this process")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("worker", help="serve requests from Redis on one device")
    add_engine_args(p)
    add_redis_arg(p)
    p.add_argument("--name", help="consumer name, unique among live workers (default: <host>-<device>-<random>); "
                                  "a restart under the same name takes over its predecessor's entries at once")
    add_engine_kind_arg(p)
    p.add_argument("--max-deliveries", type=int, default=3)
    p.add_argument("--interactive-reserve", type=int, default=None,
                   help="slots that batch lines leave free for synchronous requests (default: a 128th of the slots)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    from worker.writer import HANDOVERS
    p.add_argument("--writer-handover", choices=HANDOVERS, default="after-launch",
                   help="when a step's outputs go to the writer thread: once the next step is launched (default), "
                        "or at once (step-end: the A/B)")
    from engine.device_timeline import LAUNCHES
    p.add_argument("--launch", choices=LAUNCHES, default="early",
                   help="when the next step is launched while the device runs the last: at once (early, the "
                        "default), or shortly before the device runs out of work, taking the requests that arrive "
                        "until then into it (just-in-time: a closed loop's replacements start a step sooner)")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between 'loop stats' log lines (steps, step time by phase, tok/s, queues; 0: none)")
    from engine.gc_policy import YOUNG_THRESHOLD
    p.add_argument("--gc-young-threshold", type=int, default=YOUNG_THRESHOLD,
                   help="allocations between the garbage collector's young collections once serving (CPython's "
                        "default is 700; engine/gc_policy.py says why it is raised)")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument("--check", action="store_true",
                   help="exit 0 if the worker's heartbeat (--name; without it: any worker on this host) is fresh")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("up", help="run the whole service: embedded Redis, a worker per GPU (or CPU), the API")
    from worker.supervisor import add_up_args, cmd_up
    add_up_args(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (or the engine alone)",
                       conflict_handler="resolve")  # its --model: the served model (engine-only: the file)
    from worker.loadgen.cli import add_bench_args, cmd_bench
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    from worker.batch_cli import add_batch_args, add_batch_worker_args, cmd_batch, cmd_batch_worker
    p = sub.add_parser("batch", help="submit, follow, cancel and download OpenAI batches")
    add_batch_args(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("batch-worker", help="run batch jobs (RQ) from the batch queue")
    add_redis_arg(p)
    add_batch_worker_args(p)
    p.set_defaults(func=cmd_batch_worker)

    p = sub.add_parser("api", help="serve the OpenAI-compatible HTTP API (imports no torch)")
    add_redis_arg(p)
    from api.server import add_api_args
    add_api_args(p)
    p.set_defaults(func=cmd_api)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

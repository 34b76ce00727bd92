"""The ``gaggle`` command: one subcommand per process kind, each from its own module. The command line sits on
top of every package (engine < worker < api < cli); heavy imports (torch) happen inside the subcommands that
need them."""

from __future__ import annotations

import argparse
import sys

from cli.batch import add_batch_args, add_batch_worker_args, cmd_batch, cmd_batch_worker
from cli.model import (add_demo_model_args, add_generate_args, add_quantize_args, cmd_demo_model, cmd_generate,
                       cmd_quantize)
from cli.up import add_up_args, cmd_up
from cli.worker import add_redis_arg, add_worker_args, cmd_worker
from worker.logs import setup_logging


def cmd_api(args: argparse.Namespace) -> int:
    from api.server import serve  # no torch on this path
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gaggle", description="RWKV-7 generation service")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--log-format", default="text", choices=["text", "json"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-model", help="write seeded random RWKV-7 weights")
    add_demo_model_args(p)
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser("quantize", help="write a model's projections and FFN in fp8 (half their bytes)")
    add_quantize_args(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("generate", help="generate text from a prompt in this process")
    add_generate_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("worker", help="serve requests from Redis on one device")
    add_worker_args(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("up", help="run the whole service: embedded Redis, a worker per GPU (or CPU), the API")
    add_up_args(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (or the engine alone)",
                       conflict_handler="resolve")  # its --model: the served model (engine-only: the file)
    from benchmarks.loadgen.cli import add_bench_args, cmd_bench
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

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
    from worker.lifeline import watch_lifeline
    watch_lifeline()  # a child of `gaggle up`: stop once it is gone
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

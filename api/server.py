"""``gaggle api``: settings from flags (passed to every uvicorn process as GAGGLE_* variables), then uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

FLAG_SETTINGS = {  # argparse dest -> Settings field
    "redis_url": "redis_url", "api_keys_file": "api_keys_file", "max_queue": "max_queue",
    "max_prompt_tokens": "max_prompt_tokens", "model_name": "model_name",
    "model_aliases": "model_aliases", "max_model_len": "max_model_len",
    "request_timeout": "request_timeout_s", "max_n": "max_n", "max_queue_per_tenant": "max_queue_per_tenant",
    "max_sequences_per_call": "max_sequences_per_call", "max_body_bytes": "max_body_bytes",
    "files_dir": "files_dir",
}


def add_api_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1, help="API processes, each with its own listening socket on Linux")
    p.add_argument("--api-keys-file", help="lines 'key tenant' (also: GAGGLE_API_KEYS=key:tenant,...)")
    p.add_argument("--max-queue", type=int, help="429 above this many queued + running requests")
    p.add_argument("--max-queue-per-tenant", type=int, help="429 above this many of one tenant's (0: no own limit)")
    p.add_argument("--max-sequences-per-call", type=int, help="400 above this many prompts × n in one call (256)")
    p.add_argument("--max-body-bytes", type=int, help="413 above this request body size (4 MiB)")
    p.add_argument("--files-dir", help="the Batch API's file store, shared with the batch workers (.gaggle/files)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds to finish the requests in flight (taking no new ones)")
    add_limit_args(p)
    p.add_argument("--request-timeout", type=float, help="seconds a sync request may take (then 504)")


# The API flags a batch line is checked and answered with, as a live request: the batch worker takes them too
# (``gaggle up`` passes the API's to it), so a line the API would refuse fails its batch's validation.
LIMIT_FLAGS = ("--max-prompt-tokens", "--max-model-len", "--max-n", "--model-name", "--model-aliases")


def add_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-prompt-tokens", type=int)
    p.add_argument("--max-model-len", type=int, help="prompt + max_tokens limit")
    p.add_argument("--max-n", type=int)
    p.add_argument("--model-name", help="the model id clients see")
    p.add_argument("--model-aliases", help="other names requests may use for the model, comma-separated (default: "
                                           "rwkv-7; '*': any name); any other name is a 404 model_not_found")


def export_settings(args: argparse.Namespace) -> None:
    """Flags given → GAGGLE_* variables, which Settings reads in every process started from here (uvicorn's
    workers, RQ's job processes)."""
    for dest, name in FLAG_SETTINGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            os.environ[f"GAGGLE_{name.upper()}"] = str(value)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.processes import reuse_port_supported, serve_processes

    export_settings(args)
    os.environ["GAGGLE_LOG_LEVEL"] = args.log_level
    os.environ["GAGGLE_LOG_FORMAT"] = args.log_format
    if args.workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="gaggle-prometheus-")
    try:
        from api.settings import Settings
        Settings()  # fail here, once, on a bad setting
    except ValueError as e:
        print(f"gaggle: {e}", file=sys.stderr)
        return 2
    from api.http_limits import BoundedHeadProtocol
    options = {"log_config": None, "access_log": False, "timeout_graceful_shutdown": args.shutdown_timeout,
               "http": BoundedHeadProtocol}
    if args.workers > 1 and reuse_port_supported():
        return serve_processes(args.host, args.port, args.workers, args.shutdown_timeout, options)
    uvicorn.run("api.main:create_app", factory=True, host=args.host, port=args.port, workers=args.workers, **options)
    return 0

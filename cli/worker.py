"""``gaggle worker``: serve requests from Redis on one device (or, ``--check``, a container's healthcheck)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.args import add_engine_args, add_engine_kind_arg, build_engine, use_triton_cache, worker_engine_config


def add_redis_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default="redis://localhost:6379/0")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_redis_arg(p)
    p.add_argument("--name", help="consumer name, unique among live workers (default: <host>-<device>-<random>); "
                                  "a restart under the same name takes over its predecessor's entries at once")
    add_engine_kind_arg(p)
    p.add_argument("--max-deliveries", type=int, default=3)
    p.add_argument("--interactive-reserve", type=int, default=None,
                   help="slots that batch lines leave free for synchronous requests (default: a 128th of the slots, at "
                        "least 1)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
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
    g = p.add_argument_group("shared prefix states (the prefix cache's tier in Redis, shared by all workers)")
    g.add_argument("--shared-prefix-gib", type=float, default=2.0,
                   help="GiB of Redis memory for prefix states, all workers together: the least recently used are "
                        "evicted past it (0: no shared tier)")
    g.add_argument("--shared-prefix-redis-url", default=None,
                   help="a Redis for them other than the queue's (e.g. one without persistence; default: the queue's)")
    g.add_argument("--shared-prefix-ttl", type=int, default=3600, help="seconds a shared state lives unused")
    g.add_argument("--shared-prefix-min-tokens", type=int, default=256,
                   help="no shorter prefix's state is shared, and none fetched to save fewer tokens")


def cmd_worker(args: argparse.Namespace) -> int:
    if args.check:
        return check_worker(args.redis_url, args.name)
    use_triton_cache(Path(args.data_dir))
    from engine.synthetic import parse_engine_spec
    from worker.reader import NameInUse
    from worker.worker import Worker, WorkerConfig, unique_worker_name

    synthetic = parse_engine_spec(args.engine)
    try:
        config = worker_engine_config(args, synthetic)
    except ValueError as e:
        print(f"gaggle: {e}", file=sys.stderr)
        return 2
    device = config.resolved_device()
    name = args.name or unique_worker_name(device)
    try:
        engine = build_warm_engine(config, synthetic, args.redis_url, name)
    except ValueError as e:
        print(f"gaggle: {e}", file=sys.stderr)
        return 2
    cfg = WorkerConfig(redis_url=args.redis_url, name=name,
                       max_deliveries=args.max_deliveries, drain_timeout_s=args.drain_timeout,
                       interactive_reserve=args.interactive_reserve, log_stats_interval_s=args.log_stats_interval,
                       gc_young_threshold=args.gc_young_threshold, shared_states_gib=args.shared_prefix_gib,
                       shared_states_redis_url=args.shared_prefix_redis_url,
                       shared_states_ttl_s=args.shared_prefix_ttl,
                       shared_states_min_tokens=args.shared_prefix_min_tokens)
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


def build_warm_engine(config, synthetic, redis_url: str, name: str):
    """The engine, loaded and warmed up before the worker's first heartbeat (no request waits for a compilation),
    each stage printed and published to Redis as it goes."""
    from engine.warmup import WarmupProgress
    from worker.warmup_report import WarmupReporter
    reporter = WarmupReporter(redis_url, name, config.resolved_device(), Path(config.model).name)
    progress = WarmupProgress(reporter)
    try:
        with progress.stage("loading model", 1):
            engine = build_engine(config, synthetic)
            progress.advance("loading model")
        seconds = engine.warm_up(progress)
    finally:
        reporter.close()
    print(f"gaggle worker: warmed up in {seconds:.1f} s; {name} takes requests", file=sys.stderr, flush=True)
    return engine


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

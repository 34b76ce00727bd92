"""``gaggle up``: the whole service as one process tree on one machine.

embedded redis-server (unless --redis-url) → one worker per visible GPU (or one CPU
worker) → the API. Children run in their own sessions so a terminal Ctrl-C reaches
only the supervisor, which stops them in order: API, then workers (they drain),
then Redis. A child that dies (Redis too, with its data) is restarted with exponential
backoff; one that keeps dying stops the service with a non-zero exit. No child outlives
the supervisor, however it ends (``worker.lifeline``), and one data dir serves one
``gaggle up`` at a time (a lock file).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from cli.status import StatusLine
from engine.args import DEFAULT_DATA_DIR, ensure_demo_model
from worker import contract as c
from worker.lifeline import Lifeline, die_with_parent

log = logging.getLogger("gaggle.up")

BACKOFF_START_S, BACKOFF_MAX_S, HEALTHY_AFTER_S = 1.0, 30.0, 60.0
READY_TIMEOUT_S = 900.0  # a first GPU start compiles kernels for minutes; its stages are shown meanwhile
CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_S = 5, 120.0  # this many restarts of one child within the window: give up
EXIT_CRASH_LOOP = 4
EXIT_CANNOT_START = 2  # the data dir or the port is taken: nothing was started
LOCK_FILE = "gaggle-up.lock"


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff_s: float = BACKOFF_START_S
    restart_at: float = 0.0
    restarts: int = 0
    log_path: Path | None = None
    env: dict = field(default_factory=dict)
    lifeline: Lifeline | None = None
    recent_restarts: list[float] = field(default_factory=list)
    log_offset: int = 0  # the log's size when this run of the child started: what it wrote begins there

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None
        self.log_offset = out.tell() if out is not None else 0
        env, fds = {**os.environ, **self.env}, ()
        if self.lifeline is not None:
            env.update(self.lifeline.child_env())
            fds = (self.lifeline.read_fd,)
        self.proc = subprocess.Popen(self.cmd, env=env, start_new_session=True, pass_fds=fds,
                                     preexec_fn=die_with_parent, stdout=out or None,
                                     stderr=subprocess.STDOUT if out else None)
        if out is not None:
            out.close()  # the child has its own copy
        self.started = time.monotonic()
        log.info("started", extra={"child": self.name, "pid": self.proc.pid})

    def crash_looping(self, now: float) -> bool:
        """Restarted CRASH_LOOP_RESTARTS times within CRASH_LOOP_WINDOW_S (counting this restart)."""
        self.recent_restarts = [t for t in self.recent_restarts if now - t < CRASH_LOOP_WINDOW_S] + [now]
        return len(self.recent_restarts) > CRASH_LOOP_RESTARTS

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)  # the child's whole session (uvicorn workers too)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees (Linux)


def cuda_device_count(proc_dir: Path = NVIDIA_GPUS) -> int:
    """The GPUs CUDA would show a child, counted without importing torch (its import and CUDA's start took ~4 s
    of a start on an H200 host, before any child was started): the driver's entries, narrowed by
    CUDA_VISIBLE_DEVICES (CUDA stops at its first invalid entry; '-1' or empty hides every GPU); torch only where
    the driver's entries are missing."""
    if proc_dir.is_dir():
        n = sum(1 for _ in proc_dir.iterdir())
    else:
        try:
            import torch
            return torch.cuda.device_count()  # it applies CUDA_VISIBLE_DEVICES itself
        except Exception:
            return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return n
    listed = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        listed += 1
    return min(listed, n)


def visible_gpus(device: str) -> list[str]:
    if device not in ("auto", "cuda"):
        return [device]
    n = cuda_device_count()
    if n == 0:
        if device == "cuda":
            raise SystemExit("gaggle: --device cuda but no CUDA GPU is visible")
        return ["cpu"]
    return [f"cuda:{i}" for i in range(n)]


def limit_args(api_args: list[str]) -> list[str]:
    """The ``--api-arg`` flags the batch worker takes too (``--flag=value`` or ``--flag value``)."""
    from api.server import LIMIT_FLAGS
    out = []
    for i, arg in enumerate(api_args):
        name = arg.split("=", 1)[0]
        if name in LIMIT_FLAGS:
            out += [arg] if "=" in arg or i + 1 >= len(api_args) else [arg, api_args[i + 1]]
    return out


class Supervisor:
    def __init__(self, args: argparse.Namespace, model: str):
        self.args = args
        self.model = model
        self.data_dir = Path(args.data_dir).resolve()
        self.logs = self.data_dir / "logs"
        self.redis = None
        self.redis_url = args.redis_url
        self.children: list[Child] = []
        self.stopping = False
        self.exit_code = 0
        self.lifeline: Lifeline | None = None  # run(): every child's
        self.model_name = args.model_name or Path(model).stem  # the id clients see and send
        self.instance = uuid.uuid4().hex  # this run's API says it on /health and /ready (GAGGLE_INSTANCE_ID)
        # the embedded Redis's restart bookkeeping (RedisServer starts it)
        self._redis_child = Child(name="redis", cmd=[], log_path=self.data_dir / "redis" / "redis.log")

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cli.main", "--log-level", "INFO",
                "--log-format", "json", *args]

    def build(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        for device in visible_gpus(self.args.device):
            name = f"{host}-{device.replace(':', '')}"
            cmd = self._python("worker", "--redis-url", self.redis_url, "--model", self.model, "--device", device,
                               "--name", name, "--data-dir", str(self.data_dir), "--drain-timeout", str(self.args.drain_timeout),
                               *self.args.worker_args)
            self.children.append(Child(name=f"worker {name}", cmd=cmd, log_path=self.logs / f"worker-{name}.log",
                                       lifeline=self.lifeline))
        files = str(self.data_dir / "files")  # the Batch API's file store, shared by the API and the batch worker
        # the API's served name and limits: batch lines are checked and answered as the API would
        batch = self._python("batch-worker", "--redis-url", self.redis_url, "--files-dir", files,
                             "--model-name", self.model_name, *limit_args(self.args.api_args))
        self.children.append(Child(name="batch-worker", cmd=batch, log_path=self.logs / "batch-worker.log",
                                   lifeline=self.lifeline))
        api = self._python("api", "--redis-url", self.redis_url, "--host", self.args.host, "--port",
                           str(self.args.port), "--workers", str(self.args.api_workers or default_api_workers()),
                           "--model-name", self.model_name, "--files-dir", files,
                           "--shutdown-timeout", str(self.args.drain_timeout), *self.args.api_args)
        self.children.append(Child(name="api", cmd=api, log_path=self.logs / "api.log", lifeline=self.lifeline,
                                   env={"GAGGLE_INSTANCE_ID": self.instance}))

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # Ctrl-C, a stop, a closed terminal
            signal.signal(sig, self._on_signal)
        problem = port_problem(self.args.host, self.args.port)
        if problem:
            print(f"gaggle: {problem}", file=sys.stderr)
            return EXIT_CANNOT_START
        self.lifeline = Lifeline()
        if not self.redis_url:
            from worker.redis_server import RedisServer
            print(f"gaggle: starting the embedded Redis (data in {self.data_dir / 'redis'})", file=sys.stderr)
            self.redis = RedisServer(self.data_dir / "redis", port=self.args.redis_port,
                                     preexec_fn=die_with_parent).start()
            self.redis_url = self.redis.url
            log.info("embedded redis started", extra={"url": self.redis_url, "aof": str(self.data_dir / 'redis')})
        self.build()
        print(f"gaggle: starting {', '.join(child.name for child in self.children)} (logs in {self.logs})",
              file=sys.stderr, flush=True)
        for child in self.children:
            child.start()
        try:
            if self._wait_ready():
                self._print_banner()
            elif not self.stopping:
                print(f"gaggle: still not ready after {READY_TIMEOUT_S:.0f} s; going on (see the logs in {self.logs})",
                      file=sys.stderr, flush=True)
            status = StatusLine(self.redis_url)
            while not self.stopping:
                self._restart_crashed()
                status.maybe_print()
                time.sleep(0.2)
        finally:
            self.shutdown()
        return self.exit_code

    def _on_signal(self, signum, _frame) -> None:
        if self.stopping:
            return
        self.stopping = True
        print("\ngaggle: stopping (workers drain first)…", file=sys.stderr)

    def _restart_crashed(self) -> None:
        now = time.monotonic()
        self._restart_redis(now)
        for child in self.children:
            if child.alive():
                if now - child.started > HEALTHY_AFTER_S:
                    child.backoff_s = BACKOFF_START_S
                continue
            if self._due_for_restart(child, child.proc.returncode if child.proc else None, now):
                child.start()
                self._count_restart(child)
            if self.stopping:  # it kept dying: the service stops
                return

    def _restart_redis(self, now: float) -> None:
        """The embedded Redis, restarted on its port from its append-only file when it dies."""
        server, child = self.redis, self._redis_child
        if server is None or server.proc is None or server.proc.poll() is None or self.stopping:
            return
        if not self._due_for_restart(child, server.proc.returncode, now):
            return
        try:
            server.start(timeout_s=600.0)  # loading a large append-only file takes a while
            child.started = time.monotonic()
            self._count_restart(child)
            print("gaggle: the embedded Redis is back", file=sys.stderr, flush=True)
        except RuntimeError as e:
            log.error("embedded redis did not start", extra={"error": str(e)})

    def _due_for_restart(self, child: Child, exit_code: int | None, now: float) -> bool:
        """For a child found dead: the first time, its restart is scheduled after its backoff (logged and said);
        True once that time has come (its backoff doubled for the next time), unless it keeps dying (_gave_up)."""
        if child.restart_at == 0.0:
            child.restart_at = now + child.backoff_s
            log.error("child exited; restarting with backoff", extra={
                "child": child.name, "exit_code": exit_code, "backoff_s": child.backoff_s, "log": str(child.log_path)})
            print(f"gaggle: {child.name} exited ({exit_code}); restarting in {child.backoff_s:.0f} s "
                  f"(log: {child.log_path})", file=sys.stderr, flush=True)
            return False
        if now < child.restart_at or self._gave_up(child, now):
            return False
        child.restart_at, child.restarts = 0.0, child.restarts + 1
        child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
        return True

    def _gave_up(self, child: Child, now: float) -> bool:
        """A child that keeps dying stops the service: restarting it again would hide what is wrong."""
        if not child.crash_looping(now):
            return False
        print(f"gaggle: {child.name} keeps exiting ({CRASH_LOOP_RESTARTS} restarts in {CRASH_LOOP_WINDOW_S:.0f} s); "
              f"stopping everything. Its log: {child.log_path}", file=sys.stderr, flush=True)
        log.error("crash loop; stopping", extra={"child": child.name, "restarts": child.restarts})
        self.exit_code = EXIT_CRASH_LOOP
        self.stopping = True
        return True

    def _count_restart(self, child: Child) -> None:
        """In Redis, for the API's /metrics (gaggle_child_restarts_total)."""
        try:
            import redis
            redis.Redis.from_url(self.redis_url, socket_timeout=2).hincrby(c.RESTARTS, child.name, 1)
        except Exception as e:  # Redis may be the one restarting
            log.warning("could not count a restart", extra={"child": child.name, "error": str(e)})

    def _url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::") else self.args.host
        return f"http://{host}:{self.args.port}"

    def _wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Until ``/ready`` answers 200, saying what it waits for whenever that changes (every worker's warm-up
        stage and count, the API not listening yet), at most every 2 s."""
        deadline = time.monotonic() + timeout_s
        said, said_at = "", 0.0
        while time.monotonic() < deadline and not self.stopping:
            reason = self._not_ready_reason()
            if reason is None:
                return True
            if reason != said and time.monotonic() - said_at >= 2.0:
                print(f"gaggle: {reason}", file=sys.stderr, flush=True)
                said, said_at = reason, time.monotonic()
            if self._api_could_not_bind():
                return False
            self._restart_crashed()
            time.sleep(0.5)
        return False

    def _not_ready_reason(self) -> str | None:
        """None once this run's own API answers ``/ready`` with 200; else why not (a warming worker's stage, no
        worker yet, another service answering on the port, ...)."""
        base = self._url()
        try:
            instance = fetch_json(base + "/health").get("instance")
        except urllib.error.HTTPError as e:
            return f"another service answers on {base} (HTTP {e.code} on /health), not this gaggle's API"
        except (OSError, ValueError, AttributeError):
            return "starting: the API is not listening yet"
        if instance != self.instance:
            return f"another service answers on {base}, not this gaggle's API"
        try:
            fetch_json(base + "/ready")
            return None
        except urllib.error.HTTPError as e:
            try:
                return json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return f"not ready (HTTP {e.code})"
        except (OSError, ValueError):
            return "starting: the API is not listening yet"

    def _api_could_not_bind(self) -> bool:
        """The API exited because its port is taken (bound by another program since the check at start): say so
        and stop, rather than restart it again and again."""
        api = next((child for child in self.children if child.name == "api"), None)
        if api is None or api.alive() or api.log_path is None or not bind_failed(api.log_path, api.log_offset):
            return False
        why = port_problem(self.args.host, self.args.port) or "address already in use"
        print(f"gaggle: the API could not listen: {why} (log: {api.log_path})", file=sys.stderr, flush=True)
        self.exit_code = EXIT_CANNOT_START
        self.stopping = True
        return True

    def _print_banner(self) -> None:
        url = self._url()
        print(f"""
gaggle is up: {url}/v1   (model: {self.model_name}, from {self.model}; logs: {self.logs})

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{self.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.completions.create(model='{self.model_name}', prompt='The goose', max_tokens=32).choices[0].text)"

Ctrl-C stops everything (workers finish their running requests first; batches resume on the next start).
""", flush=True)

    def shutdown(self) -> None:
        self.stopping = True
        """In order: the batch worker (its batch stops at once: it resumes from its files), the API (it finishes
        the requests it has, up to the drain timeout, taking no new ones), then the workers (they finish the
        interactive requests they run and write their results; batch lines are left to the next worker), and
        Redis last, so every result written during the drain is kept."""
        api = [c for c in self.children if c.name == "api"]
        batch = [c for c in self.children if c.name == "batch-worker"]
        workers = [c for c in self.children if c not in api and c not in batch]
        drain = self.args.drain_timeout + 15.0
        for group, timeout_s in ((batch, 15.0), (api, drain), (workers, drain)):
            for child in group:
                child.signal(signal.SIGTERM)
            for child in group:
                if not child.wait(timeout_s):
                    log.warning("child did not stop; killing", extra={"child": child.name})
                    child.signal(signal.SIGKILL)
                    child.wait(5.0)
        if self.redis is not None:
            self.redis.stop()  # SIGTERM: Redis writes its append-only file out, then exits
        if self.lifeline is not None:
            self.lifeline.close()
        print("gaggle: stopped", file=sys.stderr)


def fetch_json(url: str, timeout_s: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def port_problem(host: str, port: int) -> str | None:
    """Why this service's API could not listen on (host, port), checked before anything starts; None when it
    can. Another gaggle there is named as such (it answers /health)."""
    from api.processes import bind_socket

    try:
        bind_socket(host, port, reuse_port=False).close()
        return None
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    try:
        other = fetch_json(f"http://{probe_host}:{port}/health", timeout_s=1.0)
        who = "another gaggle" if isinstance(other, dict) and other.get("service") == "gaggle" else "another program"
    except (OSError, ValueError):
        who = "another program"
    return (f"port {port} on {host} is in use by {who}: stop it, or start this one with another port "
            f"(gaggle up --port N; make up ARGS='--port N')")


def bind_failed(log_path: Path, since: int = 0, tail_bytes: int = 8192) -> bool:
    """The log's last lines, written after ``since``, say a bind failed because the address is in use
    (uvicorn's "[Errno 98] ... address already in use")."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(since, f.seek(0, os.SEEK_END) - tail_bytes))
            tail = f.read().decode(errors="replace").lower()
    except OSError:
        return False
    return "address already in use" in tail


def default_api_workers() -> int:
    """A quarter of the cores, 1 to 8: at ~19k streamed tok/s four API processes were each 50-65% busy
    (BENCHMARKS.md), and the worker, its I/O threads and Redis need cores of their own."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="RWKV-7 .pth or fla-hub directory (default: a demo model, random weights)")
    p.add_argument("--device", default="auto", help="auto (every visible GPU, else CPU) | cpu | cuda | cuda:N")
    p.add_argument("--redis-url", default="", help="use this Redis instead of starting an embedded one")
    p.add_argument("--redis-port", type=int, default=None, help="port of the embedded Redis (default: a free one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-workers", type=int, default=None,
                   help=f"API processes (default: a quarter of the cores, 1 to 8; here {default_api_workers()})")
    p.add_argument("--model-name", help="model id clients see (default: the file's name)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="demo model, Redis AOF and logs")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--worker-arg", dest="worker_args", action="append", default=[],
                   help="extra flag passed to each worker, e.g. --worker-arg=--max-num-seqs=512")
    p.add_argument("--api-arg", dest="api_args", action="append", default=[],
                   help="extra flag passed to the API, e.g. --api-arg=--api-keys-file=keys.txt")


def hold_data_dir(data_dir: Path):
    """The data dir's lock (an open file, locked while this process lives: the kernel drops the lock however
    the process ends, so a stale file never blocks), or None with a message when a live ``gaggle up`` holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    f = open(data_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "?"
        f.close()
        print(f"gaggle: another gaggle up (pid {owner}) is using {data_dir}: stop it first (Ctrl-C in its terminal, "
              f"or kill -TERM {owner}), or give this one its own --data-dir", file=sys.stderr)
        return None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def cmd_up(args: argparse.Namespace) -> int:
    lock = hold_data_dir(Path(args.data_dir).resolve())
    if lock is None:
        return 2
    model = args.model or str(ensure_demo_model(Path(args.data_dir)))
    if args.model and not Path(args.model).exists():
        print(f"gaggle: model not found: {args.model}", file=sys.stderr)
        return 2
    return Supervisor(args, model).run()

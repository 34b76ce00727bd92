"""Test-side helpers to talk to workers through the queue contract (what the API does, synchronously)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import orjson
import redis

from worker import contract as c

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def submit(r: redis.Redis, rid: str, prompt: list[int], priority: str = "interactive", n: int = 1,
           stream: bool = False, tenant: str = c.DEFAULT_TENANT, **params) -> c.QueuedRequest:
    params.setdefault("max_tokens", 8)
    req = c.QueuedRequest(id=rid, prompt_token_ids=prompt, params=params, n=n, stream=stream, priority=priority,
                          tenant=tenant)
    pipe = r.pipeline()
    req.enqueue(pipe)
    pipe.execute()
    return req


def request_streams(r: redis.Redis) -> list[str]:
    """Every tenant's request streams."""
    tenants = [t.decode() for t in r.zrange(c.TENANTS, 0, -1)]
    return [c.request_stream(p, t) for t in tenants for p in c.PRIORITIES]


def result(r: redis.Redis, rid: str) -> c.Result | None:
    data = r.get(c.result_key(rid))
    return c.Result.decode(data) if data else None


def wait_results(r: redis.Redis, rids: list[str], timeout_s: float = 120.0) -> dict[str, c.Result]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pipe = r.pipeline()
        for rid in rids:
            pipe.get(c.result_key(rid))
        values = pipe.execute()
        if all(values):
            return {rid: c.Result.decode(v) for rid, v in zip(rids, values)}
        time.sleep(0.1)
    missing = [rid for rid, v in zip(rids, values) if not v]
    raise AssertionError(f"{len(missing)} results missing after {timeout_s} s, e.g. {missing[:5]}")


def pending_count(r: redis.Redis) -> int:
    total = 0
    for stream in request_streams(r):
        try:
            total += r.xpending(stream, c.GROUP)["pending"]
        except redis.ResponseError:
            pass
    return total


# Worker processes of tests run torch on one thread: two workers with torch's default (a thread a core) beside the
# API and the test on CI's 2 cores oversubscribe them, and spinning threads then cost 2x (measured: the batch
# kill test, 53 s → 25 s under one busy core; it timed out once on CI).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def start_worker(redis_url: str, model: str, name: str | None, *extra: str,
                 env: dict | None = None) -> subprocess.Popen:
    """A worker process (``name`` None: the worker picks its own); its log goes to a file (a pipe nobody reads
    would block it), see ``log_of``."""
    named = ["--name", name] if name is not None else []
    cmd = [sys.executable, "-m", "cli.main", "--log-level", "INFO", "--log-format", "json", "worker",
           "--redis-url", redis_url, "--model", model, "--device", "cpu", *named, *extra]
    log = tempfile.NamedTemporaryFile(prefix=f"gaggle-{name or 'worker'}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ONE_THREAD, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=log)
    proc.log_path = log.name
    STARTED.append(proc)
    return proc


STARTED: list[subprocess.Popen] = []  # killed after each test by the conftest fixture


def kill_started(since: int = 0) -> None:
    while len(STARTED) > since:
        proc = STARTED.pop()
        if proc.poll() is None:
            if getattr(proc, "own_group", False):
                kill_group(proc)
            else:
                proc.kill()
            proc.wait()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process started in a session of its own, its group and its children (an RQ worker forks its
    job process into a session of that process's own)."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def log_of(proc: subprocess.Popen, tail: int = 3000) -> str:
    with open(proc.log_path, errors="replace") as f:
        return f.read()[-tail:]


def heartbeat(r: redis.Redis, name: str) -> c.Heartbeat | None:
    data = r.get(c.heartbeat_key(name))
    return c.Heartbeat.decode(data) if data else None


def decode_message(data: bytes) -> dict:
    return orjson.loads(data)


def wait_running(r: redis.Redis, rids: list[str], timeout_s: float = 120.0) -> bool:
    """Wait until every request's record says a worker runs it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pipe = r.pipeline()
        for rid in rids:
            pipe.hget(c.request_key(rid), "status")
        if all(v == c.STATUS_RUNNING.encode() for v in pipe.execute()):
            return True
        time.sleep(0.02)
    return False

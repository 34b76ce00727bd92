"""Helpers for the test_api* modules (this module holds no tests): an API server process, SSE parsing."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx
import orjson
import redis

from tests.queue_helpers import REPO, heartbeat
from worker.redis_server import free_port


class ApiServer:
    """``gaggle api`` in a subprocess (the real CLI path); its log goes to a file."""

    def __init__(self, redis_url: str, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cli.main", "--log-level", "INFO", "--log-format", "json", "api",
               "--host", "127.0.0.1", "--port", str(self.port), "--redis-url", redis_url, *extra]
        log = tempfile.NamedTemporaryFile(prefix="gaggle-api-", suffix=".log", delete=False)
        self.log_path = log.name
        clean_env = {k: v for k, v in os.environ.items()
                     if not k.startswith("GAGGLE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**clean_env, **(env or {})},
                                     stdout=subprocess.DEVNULL, stderr=log)

    def wait_healthy(self, timeout_s: float = 90.0) -> "ApiServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"api exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"api not healthy after {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self, tail: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:]


def flushed(redis_url: str) -> redis.Redis:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    return client


def sse_data(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response, JSON-decoded ("[DONE]" kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else orjson.loads(payload))
        else:
            assert line == "" or line.startswith(":"), f"not SSE: {line!r}"
    return out


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_heartbeat(client: redis.Redis, name: str, timeout_s: float = 120.0):
    return wait_for(lambda: heartbeat(client, name), timeout_s, 0.1, f"heartbeat of worker {name}")


def is_openai_error(body: object) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and {"message", "type", "param", "code"} <= set(body["error"])
            and isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str))

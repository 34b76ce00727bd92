"""The process tree's lifecycle, as an operator meets it: one `gaggle up` per data dir, a killed worker restarted
(its requests complete once, the restart counted in /metrics), a SIGKILLed supervisor leaving no process behind
(and a new `gaggle up` on its data dir generating nothing finished again), and every process type stopping on
SIGTERM when Redis is gone. Real processes, CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.queue_helpers import ONE_THREAD, REPO
from tests.test_api_support import free_port
from tests.test_up import start_up, started_ids, wait_ready
from worker.procs import descendants, is_alive
from worker.redis_server import RedisServer

pytestmark = pytest.mark.slow


def ask(port: int, i: int, outcomes: list, max_tokens: int = 60) -> None:
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": f"Count {i}", "max_tokens": max_tokens, "ignore_eos": True, "seed": i})
        outcomes.append((i, r.status_code, r.json()))
    except httpx.HTTPError as e:
        outcomes.append((i, None, repr(e)))


def child_pid(up: subprocess.Popen, marker: bytes) -> int:
    """The process under ``up`` whose command line holds ``marker``."""
    for pid in descendants(up.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker in f.read():
                    return pid
        except OSError:
            pass
    raise AssertionError(f"no {marker!r} process under gaggle up")


def test_one_up_per_data_dir_restarts_a_killed_worker_and_a_killed_supervisor_leaves_nothing(tmp_path):
    port, data = free_port(), tmp_path / "data"
    up = start_up(data, port, "--drain-timeout", "10", "--api-workers", "1")
    try:
        wait_ready(port)
        # a second `gaggle up` on the same data dir refuses at once, and the first serves on
        second = subprocess.run([sys.executable, "-m", "cli.main", "up", "--device", "cpu", "--port",
                                 str(free_port()), "--data-dir", str(data)], cwd=REPO, capture_output=True,
                                text=True, timeout=60, env={**os.environ, **ONE_THREAD})
        assert second.returncode == 2 and f"pid {up.pid}" in second.stderr and "--data-dir" in second.stderr
        # the worker SIGKILLed with requests in flight: restarted, each request answered once and whole
        outcomes: list = []
        threads = [threading.Thread(target=ask, args=(port, i, outcomes, 1500)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        assert not outcomes  # under way
        os.kill(child_pid(up, b"\0worker\0"), signal.SIGKILL)
        for t in threads:
            t.join(timeout=150)
        assert sorted(o[0] for o in outcomes) == [0, 1, 2, 3]
        assert all(o[1] == 200 and o[2]["usage"]["completion_tokens"] == 1500 for o in outcomes), outcomes
        restarts = [m for m in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines()
                    if m.startswith("gaggle_child_restarts_total{")]
        assert len(restarts) == 1 and restarts[0].startswith('gaggle_child_restarts_total{child="worker ') and \
            restarts[0].endswith(" 1.0"), restarts
        # the embedded Redis SIGKILLed: restarted from its append-only file, the service serves again
        os.kill(child_pid(up, b"redis-server"), signal.SIGKILL)
        time.sleep(1.0)
        deadline, served = time.monotonic() + 60, []
        while not served and time.monotonic() < deadline:
            attempt: list = []
            ask(port, 50, attempt, 4)
            served = [o for o in attempt if o[1] == 200]
            time.sleep(0.5)
        assert served, attempt
        restarts = [m for m in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines()
                    if m.startswith('gaggle_child_restarts_total{child="redis"}')]
        assert restarts == ['gaggle_child_restarts_total{child="redis"} 1.0'], restarts
        # SIGKILL of the supervisor with streams in flight: within 10 s, no process of the tree is left
        finished = {o[2]["id"] for o in outcomes}
        more: list = []
        for i in range(4, 7):
            threading.Thread(target=ask, args=(port, i, more, 400), daemon=True).start()
        time.sleep(1.5)
        tree = descendants(up.pid)
        assert len(tree) >= 4  # redis, worker, batch worker, api
        up.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while [p for p in tree if is_alive(p)] and time.monotonic() - killed_at < 10:
            time.sleep(0.2)
        assert not [p for p in tree if is_alive(p)], "processes outlived the killed supervisor"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    # a new `gaggle up` on the same data dir serves, and generates none of the finished requests again
    worker_log = next((data / "logs").glob("worker-*.log"))
    before = worker_log.stat().st_size
    again = start_up(data, port, "--api-workers", "1")
    try:
        wait_ready(port)
        time.sleep(2)  # a worker replays its own pending entries first thing
        restarted = started_ids(worker_log.read_text()[before:])
        check: list = []
        ask(port, 99, check, 4)
        assert check[0][1] == 200
    finally:
        os.killpg(again.pid, signal.SIGINT)
        again.wait(timeout=90)
    assert not finished & restarted, "requests finished before the kill were generated again"


def test_every_process_stops_on_sigterm_with_redis_gone(tmp_path, tiny_model_path):
    """The API, a worker and a batch worker whose Redis has stopped: SIGTERM ends each within its drain timeout,
    with a documented status."""
    redis = RedisServer(tmp_path / "redis").start()
    py = [sys.executable, "-m", "cli.main", "--log-level", "INFO"]
    commands = {
        "api": ["api", "--redis-url", redis.url, "--port", str(free_port()), "--workers", "2",
                "--shutdown-timeout", "5"],
        "worker": ["worker", "--redis-url", redis.url, "--model", str(tiny_model_path), "--device", "cpu",
                   "--drain-timeout", "5"],
        "batch-worker": ["batch-worker", "--redis-url", redis.url, "--files-dir", str(tmp_path / "files")],
    }
    procs = {name: subprocess.Popen(py + cmd, cwd=REPO, env={**os.environ, **ONE_THREAD},
                                    stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.log", "wb"))
             for name, cmd in commands.items()}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b"worker started" not in (tmp_path / "worker.log").read_bytes():
            time.sleep(0.2)
        time.sleep(1.0)
        redis.stop()
        time.sleep(3.0)  # each notices: retries, reconnects
        assert all(p.poll() is None for p in procs.values()), {n: p.returncode for n, p in procs.items()}
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for name, p in procs.items():
            p.wait(timeout=max(1.0, 20 - (time.monotonic() - t0)))
        took = time.monotonic() - t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert took < 20, took
    statuses = {name: p.returncode for name, p in procs.items()}
    from api.batch.worker import EXIT_REDIS_GONE, EXIT_STOP_GRACE
    assert statuses["api"] == 0 and statuses["worker"] == 0
    assert statuses["batch-worker"] in (0, EXIT_REDIS_GONE, EXIT_STOP_GRACE), statuses


def test_a_batch_worker_rides_out_a_redis_restart_and_takes_over_a_dead_namesake(tmp_path):
    import redis as redis_py

    from tests.test_batch import start_batch_worker
    server = RedisServer(tmp_path / "redis").start()
    r = redis_py.Redis.from_url(server.url)
    registered = lambda: r.hget("rq:worker:bw", "pid")  # noqa: E731

    def wait(cond, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if cond():
                    return True
            except redis_py.RedisError:
                pass
            time.sleep(0.2)
        return False

    first = start_batch_worker(server.url, tmp_path / "files", "bw", "--name", "bw")
    second = None
    try:
        assert wait(lambda: registered() == str(first.pid).encode())
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_batch_worker(server.url, tmp_path / "files", "bw", "--name", "bw")  # RQ refused the name before
        assert wait(lambda: registered() == str(second.pid).encode()), "the dead worker's name was not taken over"
        server.stop()
        time.sleep(2.0)
        server = RedisServer(tmp_path / "redis", port=server.port).start()
        r = redis_py.Redis.from_url(server.url)
        assert wait(lambda: registered() == str(second.pid).encode()) and second.poll() is None
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
        server.stop()

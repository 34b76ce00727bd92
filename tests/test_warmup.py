"""A starting worker says what it does: progress lines (stage and count) before its first heartbeat, and ``/ready``
answers "warming up" with the stage while it does. Real processes: ``gaggle worker`` (tiny CPU model), ``gaggle api``
and Redis; the worker is held in its warm-up with SIGSTOP at its first progress line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engine.warmup import WarmupProgress
from tests.queue_helpers import REPO
from tests.test_api_support import ApiServer
from worker import contract as c

PROGRESS = re.compile(r"^gaggle worker: warming up · (?P<stages>.+) · \d+ s$")
STAGE = re.compile(r"(?P<name>[a-z][a-z ]+) (?P<done>\d+)/(?P<total>\d+)")

pytestmark = pytest.mark.slow


def test_progress_counts_stages_and_reports_every_change():
    seen = []
    progress = WarmupProgress(seen.append)
    with progress.stage("compiling", 3):
        with progress.stage("capturing", 2):
            progress.advance("capturing")
            progress.advance("compiling", 2)
    assert [[(s.name, s.done, s.total) for s in snap.stages] for snap in seen] == [
        [("compiling", 0, 3)],
        [("compiling", 0, 3), ("capturing", 0, 2)],
        [("compiling", 0, 3), ("capturing", 1, 2)],
        [("compiling", 2, 3), ("capturing", 1, 2)],
        [("compiling", 2, 3)],
        [],
    ]
    assert seen[-1].finished == ("capturing", "compiling")
    assert set(progress.stage_seconds) == {"compiling", "capturing"}


@pytest.fixture()
def api(redis_url):
    server = ApiServer(redis_url).wait_healthy()
    yield server
    server.stop()


def test_worker_prints_progress_before_its_first_heartbeat_and_ready_says_warming_up(api, r, redis_url,
                                                                                     tiny_model_path):
    name = "warming-worker"
    assert httpx.get(api.url + "/ready").json()["error"]["code"] == "no_workers"
    cmd = [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "worker", "--redis-url", redis_url,
           "--model", str(tiny_model_path), "--device", "cpu", "--name", name, "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        first = _read_until(proc, lines, lambda line: PROGRESS.match(line))
        os.kill(proc.pid, signal.SIGSTOP)  # held mid-warm-up
        try:
            assert not r.exists(c.heartbeat_key(name)), "a heartbeat before the warm-up ended"
            error = _ready_error(api.url)
            assert error["code"] == "warming_up", error
            assert name in error["message"] and STAGE.search(first).group("name") in error["message"], error
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        _read_until(proc, lines, lambda line: "takes requests" in line)
        _wait_ready(api.url)
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=30)
        lines += rest.splitlines()
    progress = [PROGRESS.match(line) for line in lines]
    stages = [(m.group("name"), int(m.group("done")), int(m.group("total")))
              for p in progress if p for m in STAGE.finditer(p.group("stages"))]
    assert {"loading model", "checking the model"} <= {s[0] for s in stages}, lines
    assert all(0 <= done <= total for _, done, total in stages), stages
    ready_at = next(i for i, line in enumerate(lines) if "takes requests" in line)
    assert all(i < ready_at for i, p in enumerate(progress) if p), "progress after the worker took requests"
    assert not r.exists(c.warming_key(name)), "the warm-up status outlived the warm-up"


def _read_until(proc: subprocess.Popen, lines: list[str], predicate, timeout_s: float = 120.0) -> str:
    found: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if predicate(lines[-1]):
                found.append(lines[-1])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert found, f"not seen in {timeout_s} s; the worker printed:\n" + "\n".join(lines[-30:])
    return found[0]


def _ready_error(url: str) -> dict:
    resp = httpx.get(url + "/ready", timeout=5)
    assert resp.status_code == 503, resp.text
    return resp.json()["error"]


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(url + "/ready", timeout=5).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError("/ready never answered 200")

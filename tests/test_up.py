"""`gaggle up` as a new user runs it: embedded Redis, demo model, a CPU worker, the API; Ctrl-C cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.queue_helpers import REPO
from worker.redis_server import free_port


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_gaggle_up_serves_openai_and_stops_cleanly(tmp_path):
    import openai
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--device", "cpu", "--port", str(port),
                             "--data-dir", str(tmp_path / "data")], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read_output() -> None:  # read as it comes: the banner is awaited below, not raced
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        ready = False
        while time.monotonic() < deadline and not ready:
            tree |= descendants(proc.pid)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
                    ready = resp.status == 200
            except Exception:
                time.sleep(0.5)
        assert ready, "the service never became ready"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
        tree |= descendants(proc.pid)
        assert len(tree) >= 3  # redis-server, a worker, the API
        banner_by = time.monotonic() + 60  # gaggle polls /ready on its own clock: wait for its banner
        while not any("gaggle is up" in line for line in lines) and time.monotonic() < banner_by:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert "gaggle is up" in out and "RANDOM weights" in out
    time.sleep(0.5)
    assert not [pid for pid in tree if alive(pid)], "processes of the tree outlived gaggle up"

"""`gaggle up` as a new user runs it: embedded Redis, demo model, a CPU worker, the API; Ctrl-C cleans up."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.queue_helpers import ONE_THREAD, REPO
from worker.procs import descendants, is_alive
from worker.redis_server import free_port


@pytest.mark.slow
def test_gaggle_up_serves_openai_and_stops_cleanly(tmp_path):
    import openai
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--device", "cpu", "--port", str(port),
                             "--data-dir", str(tmp_path / "data")], cwd=REPO, env={**os.environ, **ONE_THREAD},
                            stdout=subprocess.PIPE,
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
        chat = client.chat.completions.create(model="rwkv-7", messages=[{"role": "user", "content": "Hi"}],
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
    assert not [pid for pid in tree if is_alive(pid)], "processes of the tree outlived gaggle up"


def start_up(data_dir, port: int, *extra: str) -> subprocess.Popen:
    """``gaggle up`` as a terminal runs it: its own process group, which Ctrl-C signals as a whole."""
    return subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--device", "cpu", "--port", str(port),
                             "--data-dir", str(data_dir), *extra], cwd=REPO, env={**os.environ, **ONE_THREAD},
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def logs_tail(logs, lines: int = 12) -> str:
    """The last lines of each process's log (what a timing assertion shows when it fails)."""
    return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                     for p in sorted(logs.glob("*.log")))


def wait_ready(port: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except Exception:
            time.sleep(0.3)
    raise AssertionError("gaggle up never became ready")


def started_ids(log_text: str) -> set[str]:
    import orjson
    return {orjson.loads(line[line.index("{"):])["request_id"] for line in log_text.splitlines()
            if '"request running"' in line}


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_drains_in_order_and_nothing_runs_twice(tmp_path):
    """SIGINT to the whole foreground group (a terminal's Ctrl-C): the API finishes its requests, the workers
    write their results, Redis stops last; every client gets its whole answer; a restart generates none again."""
    import httpx
    port, data = free_port(), tmp_path / "data"
    up = start_up(data, port, "--drain-timeout", "20")
    try:
        wait_ready(port)
        outcomes: list = []

        def ask(i: int) -> None:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                               json={"prompt": f"Count {i}", "max_tokens": 80, "ignore_eos": True, "seed": i})
                outcomes.append(("ok", r.status_code, r.json()))
            except httpx.HTTPError as e:
                outcomes.append(("error", repr(e), None))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # under way
        os.killpg(up.pid, signal.SIGINT)
        t0 = time.monotonic()
        up.wait(timeout=90)
        stopped_in = time.monotonic() - t0
        for t in threads:
            t.join(timeout=30)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    assert up.returncode == 0, up.stderr.read()[-3000:]
    assert stopped_in < 20 + 30, stopped_in
    assert len(outcomes) == 6 and all(o[0] == "ok" and o[1] == 200 for o in outcomes), outcomes
    assert all(o[2]["usage"]["completion_tokens"] == 80 for o in outcomes)  # whole answers
    first_ids = {o[2]["id"] for o in outcomes}
    worker_log = next((data / "logs").glob("worker-*.log"))
    before = worker_log.stat().st_size
    assert first_ids <= started_ids(worker_log.read_text())
    again = start_up(data, port)
    try:
        wait_ready(port)
        time.sleep(2)  # a worker replays its own pending entries first thing
        restarted = started_ids(worker_log.read_text()[before:])
    finally:
        os.killpg(again.pid, signal.SIGINT)
        again.wait(timeout=90)
    assert not first_ids & restarted, "requests finished before Ctrl-C were generated again"


@pytest.mark.slow
def test_a_batch_completes_through_gaggle_up(tmp_path):
    """gaggle up starts a batch worker next to the API and the worker, sharing the file store."""
    import json

    import openai
    port = free_port()
    up = start_up(tmp_path / "data", port)
    try:
        wait_ready(port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": f"Line {i}", "max_tokens": 4}}) + "\n" for i in range(20))
        file = client.files.create(file=("twenty.jsonl", lines.encode()), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 20, batch
        out = client.files.content(batch.output_file_id).text.splitlines()
        assert sorted(json.loads(line)["custom_id"] for line in out) == sorted(f"c{i}" for i in range(20))
        served = client.models.list().data[0].id  # the batch worker answers as the API does, not as its default
        assert {json.loads(line)["response"]["body"]["model"] for line in out} == {served}
        assert (tmp_path / "data" / "files" / batch.output_file_id).exists()  # under gaggle up's data dir
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=90)
    assert up.returncode == 0


@pytest.mark.slow
def test_ctrl_c_with_a_batch_running_stops_at_once_and_the_batch_resumes_on_the_next_start(tmp_path):
    """The batch worker stops without waiting for its batch and the worker without waiting for batch lines (both
    resume from Redis and the batch's files); nothing is killed; the next start finishes every line once."""
    import json

    import openai
    port, data = free_port(), tmp_path / "data"
    up = start_up(data, port, "--drain-timeout", "30")
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "rwkv-7", "prompt": f"Line {i}", "max_tokens": 150, "ignore_eos": True, "seed": i}}) + "\n"
        for i in range(24))
    try:
        wait_ready(port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        file = client.files.create(file=("long.jsonl", lines.encode()), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).status != "in_progress" and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # its lines are generating
        assert client.batches.retrieve(batch.id).request_counts.completed < 24
        os.killpg(up.pid, signal.SIGINT)
        t0 = time.monotonic()
        up.wait(timeout=90)
        stopped_in = time.monotonic() - t0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    err = up.stderr.read()
    assert up.returncode == 0, err[-3000:]
    if stopped_in >= 10:  # shown with the failure: when each process stopped
        print(err[-2000:], logs_tail(data / "logs"), sep="\n")
    assert stopped_in < 10, stopped_in
    assert "killing" not in err and "stop grace" not in (data / "logs" / "batch-worker.log").read_text()
    again = start_up(data, port)
    try:
        wait_ready(port)
        deadline = time.monotonic() + 240
        while (done := client.batches.retrieve(batch.id)).status != "completed" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert done.status == "completed" and done.request_counts.completed == 24, done
        out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(f"c{i}" for i in range(24))
        assert all(o["response"]["body"]["usage"]["completion_tokens"] == 150 for o in out)
    finally:
        os.killpg(again.pid, signal.SIGINT)
        again.wait(timeout=90)


def test_the_batch_worker_gets_the_apis_limits():
    """``gaggle up --api-arg``: the flags a batch line is checked against reach the batch worker too, in either
    spelling; the others (keys, timeouts) stay the API's."""
    from cli.up import limit_args
    api_args = ["--max-prompt-tokens=64", "--api-keys-file=k.txt", "--max-n", "4", "--request-timeout=9",
                "--model-name", "goose"]
    assert limit_args(api_args) == ["--max-prompt-tokens=64", "--max-n", "4", "--model-name", "goose"]
    assert limit_args([]) == []


@pytest.mark.parametrize("visible, expected", [(None, 2), ("1", 1), ("0,1,2", 2), ("", 0), ("-1", 0), ("1,-1,0", 1)])
def test_gpus_are_counted_from_the_driver_and_cuda_visible_devices(tmp_path, monkeypatch, visible, expected):
    from cli.up import cuda_device_count
    for pci in ("0000:18:00.0", "0000:2a:00.0"):  # the driver's /proc layout: one entry per GPU
        (tmp_path / pci).mkdir()
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cuda_device_count(tmp_path) == expected


def test_without_the_driver_torch_counts(tmp_path):
    import torch

    from cli.up import cuda_device_count
    assert cuda_device_count(tmp_path / "absent") == torch.cuda.device_count()


def test_a_child_restarted_five_times_in_two_minutes_is_a_crash_loop():
    from cli.up import CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_S, Child
    child = Child(name="api", cmd=[])
    assert not any(child.crash_looping(float(t)) for t in range(CRASH_LOOP_RESTARTS))
    assert child.crash_looping(float(CRASH_LOOP_RESTARTS))
    spaced = Child(name="worker", cmd=[])  # restarts spread wider than the window are not a loop
    assert not any(spaced.crash_looping(t * CRASH_LOOP_WINDOW_S / 2) for t in range(3 * CRASH_LOOP_RESTARTS))


def run_up(tmp_path, port: int, model: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "up", "--device", "cpu", "--port", str(port),
                           "--model", model, "--data-dir", str(tmp_path / "data")], cwd=REPO,
                          env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=60)


def test_a_port_taken_by_another_program_stops_gaggle_up_at_once(tmp_path, tiny_model_path):
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        done = run_up(tmp_path, port, str(tiny_model_path))
    assert done.returncode == 2, done.stderr
    assert f"port {port} on 127.0.0.1 is in use by another program" in done.stderr
    assert "gaggle is up" not in done.stdout
    assert not (tmp_path / "data" / "redis").exists()  # nothing was started


@pytest.mark.slow
def test_another_gaggle_on_the_port_is_named_and_never_taken_for_this_one(tmp_path, tiny_model_path, redis_url):
    """The other instance listens with SO_REUSEPORT (several API processes), which a second SO_REUSEPORT bind
    would silently share; and while it answers /ready, a supervisor must not take it for its own API."""
    from cli.up import Supervisor, add_up_args
    port = free_port()
    other = subprocess.Popen([sys.executable, "-m", "cli.main", "api", "--redis-url", redis_url, "--port", str(port),
                              "--workers", "2"], cwd=REPO, env={**os.environ, **ONE_THREAD},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline and other.poll() is None, "the other API never answered"
                time.sleep(0.3)
        done = run_up(tmp_path, port, str(tiny_model_path))
        assert done.returncode == 2, done.stderr
        assert f"port {port} on 127.0.0.1 is in use by another gaggle" in done.stderr
        parser = argparse.ArgumentParser()
        add_up_args(parser)
        args = parser.parse_args(["--port", str(port), "--data-dir", str(tmp_path / "data2")])
        reason = Supervisor(args, str(tiny_model_path))._not_ready_reason()
        assert reason is not None and "another service answers" in reason
    finally:
        os.killpg(other.pid, signal.SIGTERM)
        other.wait(timeout=30)

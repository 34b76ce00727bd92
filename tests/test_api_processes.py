"""``gaggle api --workers N``: a listening socket a process (SO_REUSEPORT), so a burst of keep-alive connections
is spread over the processes, a process that dies is replaced, and a port already taken is a clear error."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from api.processes import reuse_port_supported
from tests.queue_helpers import REPO
from tests.test_api_support import ApiServer, flushed, wait_for
from worker import procs
from worker.redis_server import free_port

pytestmark = pytest.mark.skipif(not reuse_port_supported(), reason="SO_REUSEPORT balancing is Linux's")


def serving_processes(api: ApiServer) -> dict[int, int]:
    """The API's processes that listen on its port -> the established connections each holds."""
    return {pid: n for pid, n in procs.serving_processes(api.proc.pid, api.port).items() if pid != api.proc.pid}


def burst(url: str, connections: int, requests_each: int, while_open=lambda: None) -> tuple[dict[int, int], object]:
    """``connections`` keep-alive connections opened at once, each POSTing ``requests_each`` async requests:
    the answers by status, and what ``while_open()`` returned before the connections were closed."""
    return asyncio.run(_burst(url, connections, requests_each, while_open))


async def _burst(url: str, connections: int, requests_each: int, while_open) -> tuple[dict[int, int], object]:
    from benchmarks.loadgen.http import Endpoint, Pool

    endpoint = Endpoint.parse(url + "/v1/requests")
    pool = Pool(endpoint)
    head = endpoint.request_head("POST", {"Content-Type": "application/json"})
    statuses: dict[int, int] = {}

    async def one(k: int) -> None:
        for i in range(requests_each):
            body = b'{"endpoint":"completions","prompt":"goose %d %d","max_tokens":4}' % (k, i)
            response = await pool.send(head, body)
            await response.read_body()
            pool.release(response)
            statuses[response.status] = statuses.get(response.status, 0) + 1

    await asyncio.gather(*[one(k) for k in range(connections)])
    seen = while_open()
    pool.close()
    return statuses, seen


@pytest.fixture()
def two_process_api(redis_url):
    flushed(redis_url)
    api = ApiServer(redis_url, "--workers", "2").wait_healthy()
    wait_for(lambda: len(serving_processes(api)) == 2, 60, 0.1, "two serving processes")
    yield api
    api.stop()


def test_a_burst_of_connections_is_spread_over_the_processes(two_process_api):
    """48 connections opened at once: with one shared socket the first process to wake took most of them
    (47 of 64 here, all but a few on 16 cores); with a socket a process the kernel hashes them over both."""
    api = two_process_api

    statuses, held = burst(api.url, 48, 3, lambda: serving_processes(api))
    assert statuses == {202: 144}
    assert sum(held.values()) == 48, held
    # Binomial(48, 1/2): below 10 on one side has probability ~2e-5
    assert min(held.values()) >= 10, f"connections per process: {held}"


def test_a_killed_process_is_replaced_and_the_port_keeps_answering(two_process_api):
    api = two_process_api
    before = set(serving_processes(api))
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:  # a process that was not there before listens beside the survivor
        now = set(serving_processes(api))
        return len(now) == 2 and victim not in now and bool(now - before)
    try:
        wait_for(replaced, 60, 0.1, "a replacement process listening")
    except AssertionError as e:
        raise AssertionError(f"{e}; serving {serving_processes(api)}; api log:\n{api.log(6000)}") from None
    statuses, _ = burst(api.url, 16, 2)
    assert statuses == {202: 32} and api.proc.poll() is None, f"{statuses}; api log:\n{api.log(6000)}"
    whole = api.log(10**8)  # the whole log: the burst logs after it
    lifecycle = "\n".join(line for line in whole.splitlines() if "request_id" not in line)
    assert "api process died; restarting" in whole, f"victim {victim}; the api log but requests:\n{lifecycle[-6000:]}"


def test_sigterm_stops_every_process(two_process_api):
    api = two_process_api
    children = list(serving_processes(api))
    api.proc.send_signal(signal.SIGTERM)
    assert api.proc.wait(timeout=30) == 0
    for pid in children:
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, 0.05, f"api process {pid} gone")


def test_a_port_in_use_is_a_clear_error(redis_url):
    """Something else listens on the port: exit 1 with the reason, not API processes sharing it with it."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        done = subprocess.run([sys.executable, "-m", "cli.main", "api", "--port", str(taken.getsockname()[1]),
                               "--workers", "2", "--redis-url", redis_url], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1, done.stderr
    assert "cannot listen on 127.0.0.1:" in done.stderr


def test_processes_stop_when_their_parent_is_killed(two_process_api):
    """SIGKILL to the parent (it cannot stop them): its processes notice and stop, freeing the port."""
    api = two_process_api
    children = list(serving_processes(api))
    api.proc.kill()
    api.proc.wait(timeout=10)
    for pid in children:
        wait_for(lambda: not procs.is_alive(pid), 30, 0.1, f"orphaned api process {pid} gone")
    free = socket.socket()
    free.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    free.bind(("127.0.0.1", api.port))  # nothing listens there any more
    free.close()


def test_sighup_replaces_every_process_while_the_port_keeps_answering(two_process_api):
    """SIGHUP: each process replaced by a new one that serves before the old one stops. Requests sent all along
    are answered (a connection refused or reset is retried once, as the openai SDK retries connection errors)."""
    import httpx
    api = two_process_api
    old = set(serving_processes(api))
    answers, stop = [], threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            for attempt in range(2):
                try:
                    with httpx.Client(timeout=10) as http:  # a new connection each time: any process may get it
                        answers.append(http.post(api.url + "/v1/requests", json={
                            "endpoint": "completions", "prompt": "goose", "max_tokens": 2}).status_code)
                    break
                except httpx.TransportError:
                    if attempt:
                        answers.append("failed")
            time.sleep(0.02)

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        time.sleep(0.5)
        api.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: (now := set(serving_processes(api))) and len(now) == 2 and not now & old, 90, 0.1,
                 "two new processes serving, the old ones gone")
        time.sleep(0.5)
    finally:
        stop.set()
        asker.join()
    assert api.proc.poll() is None
    assert len(answers) > 20 and set(answers) == {202}, answers
    assert api.log(50000).count("api process replaced") == 2


def test_sigttin_adds_a_process_and_sigttou_stops_one_but_never_the_last(two_process_api):
    """As uvicorn's supervisor: SIGTTIN one process more, SIGTTOU one fewer (the newest, gracefully); SIGTTOU
    with one left keeps it, and the port answers throughout."""
    api = two_process_api
    first = set(serving_processes(api))
    api.proc.send_signal(signal.SIGTTIN)
    wait_for(lambda: len(serving_processes(api)) == 3, 60, 0.1, "a third process serving")
    assert first < set(serving_processes(api))
    for _ in range(3):
        api.proc.send_signal(signal.SIGTTOU)
        time.sleep(0.3)
    wait_for(lambda: len(serving_processes(api)) == 1, 60, 0.1, "one process left")
    time.sleep(1.0)  # the third SIGTTOU must not stop it
    assert len(serving_processes(api)) == 1 and api.proc.poll() is None, api.log(6000)
    statuses, _ = burst(api.url, 8, 2)
    assert statuses == {202: 16}
    assert "SIGTTOU with one process left" in api.log(50000)


def test_processes_that_cannot_start_stop_the_api_with_status_3(redis_url):
    """A setting every process fails on at startup (an API keys file that is not there): exit 3, not restarts
    forever."""
    done = subprocess.run([sys.executable, "-m", "cli.main", "api", "--port", str(free_port()), "--workers", "2",
                           "--redis-url", redis_url, "--api-keys-file", "/nonexistent/keys.txt"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "api process failed to start" in done.stderr

"""Hostile inputs a client or a stray key can send: schemas too deep or with integers beyond 64 bits, thousands of
tools, file names outside Latin-1, a key of the wrong type where a tenant's stream belongs; and what /metrics and
the status page show without a key. Each is a clear 4xx or goes unnoticed by everyone else, never a 500, a 503
for all, or another tenant's data. Real Redis, API and worker processes."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import nested_schema
from tests.queue_helpers import start_worker
from tests.test_api_support import ApiServer, flushed, is_openai_error, wait_heartbeat
from worker import contract as c

KEYS = {"GAGGLE_API_KEYS": "ka:alice,kb:bob"}
ALICE = {"Authorization": "Bearer ka"}


@pytest.fixture(scope="module")
def served(redis_server, tiny_model_path):
    r = flushed(redis_server.url)
    worker = start_worker(redis_server.url, str(tiny_model_path), "hostile-worker")
    api = ApiServer(redis_server.url, env=KEYS).wait_healthy()
    wait_heartbeat(r, "hostile-worker")
    yield api, r
    api.stop()
    worker.kill()


def chat(api: ApiServer, **body) -> httpx.Response:
    return httpx.post(api.url + "/v1/chat/completions", headers=ALICE, timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})


@pytest.mark.parametrize("schema, says", [(nested_schema(100), "deeper than 64 levels"),
                                          ({"type": "integer", "minimum": 10**30}, "beyond 64 bits")])
def test_a_schema_past_the_limits_is_a_400_naming_the_limit(served, schema, says):
    api, _ = served
    reply = chat(api, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert reply.status_code == 400 and is_openai_error(reply.json()), reply.text[:500]
    assert says in reply.json()["error"]["message"]
    assert chat(api).status_code == 200  # and the API serves on


def test_thousands_of_tools_are_refused_at_once(served):
    api, _ = served
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    t0 = time.monotonic()
    reply = chat(api, tools=[tool] * 10_000)
    assert reply.status_code == 400 and "at most 128 tools" in reply.json()["error"]["message"]
    assert time.monotonic() - t0 < 3.0


def test_a_file_named_outside_latin_1_downloads(served):
    api, _ = served
    name = "данные-🦢.jsonl"
    made = httpx.post(api.url + "/v1/files", headers=ALICE, timeout=30, data={"purpose": "batch"},
                      files={"file": (name, b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                                            b'"body": {"prompt": "x"}}\n')})
    assert made.status_code == 200, made.text
    got = httpx.get(api.url + f"/v1/files/{made.json()['id']}/content", headers=ALICE, timeout=30)
    assert got.status_code == 200
    from urllib.parse import quote
    assert f"filename*=UTF-8''{quote(name, safe='')}" in got.headers["content-disposition"]


def test_a_wrong_type_key_in_a_tenant_slot_fails_no_one_else(served):
    api, r = served
    r.set(c.request_stream("interactive", "mallory"), "not a stream")
    r.zadd(c.TENANTS, {"mallory": time.time()})
    try:
        assert chat(api).status_code == 200  # admission counts queues; the worker reads every other stream
        assert httpx.get(api.url + "/dashboard/status.json", timeout=10).status_code == 200
        assert httpx.get(api.url + "/metrics", timeout=10).status_code == 200
    finally:
        r.delete(c.request_stream("interactive", "mallory"))
        r.zrem(c.TENANTS, "mallory")


def test_no_tenant_data_without_a_key(served):
    api, _ = served
    assert chat(api).status_code == 200
    httpx.get(api.url + "/v1/files/file-0123456789abcdef/content", headers=ALICE, timeout=10)  # a 404, recorded?
    time.sleep(1.1)  # the API's list of tenants is cached for a second
    metrics = httpx.get(api.url + "/metrics", timeout=10).text
    assert "alice" not in metrics and "bob" not in metrics
    assert 'gaggle_queue_depth{priority="interactive",tenant="*"}' in metrics
    status = httpx.get(api.url + "/dashboard/status.json", timeout=10).text
    assert "alice" not in status and "file-0123456789abcdef" not in status


def test_an_oversized_request_head_is_a_431_and_the_api_serves_on(served):
    import socket
    api, _ = served
    host, port = "127.0.0.1", int(api.url.rsplit(":", 1)[1])
    for head in ({"X-Big": "a" * (4 << 20)}, {f"X-H{i}": "v" for i in range(500)}):
        with socket.create_connection((host, port), timeout=30) as s:
            lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
            try:
                s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                pass  # it may close before taking it all
            reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert httpx.get(api.url + "/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_chunked_upload_past_the_limit_is_a_413(served):
    api, _ = served
    from api.batch.files import MAX_UPLOAD_BYTES
    boundary = b"gagglebound"

    def body():  # multipart, chunked (no Content-Length): the limit is found as it streams in
        yield (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--' + boundary
               + b'\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n')
        chunk = b"x" * (1 << 20)
        for _ in range(MAX_UPLOAD_BYTES // len(chunk) + 8):
            yield chunk
        yield b"\r\n--" + boundary + b"--\r\n"

    reply = httpx.post(api.url + "/v1/files", headers={**ALICE, "Content-Type":
                                                        f"multipart/form-data; boundary={boundary.decode()}"},
                       content=body(), timeout=120)
    assert reply.status_code == 413, reply.text[:300]


def test_an_expired_batch_leaves_the_tenants_index(served):
    api, r = served
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}\n'
    file_id = httpx.post(api.url + "/v1/files", headers=ALICE, timeout=30, data={"purpose": "batch"},
                         files={"file": ("b.jsonl", line)}).json()["id"]
    made = httpx.post(api.url + "/v1/batches", headers=ALICE, timeout=30,
                      json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})
    assert made.status_code == 200, made.text
    batch_id = made.json()["id"]
    assert r.zscore(c.batches_index("alice"), batch_id) is not None
    r.delete(c.batch_key(batch_id))  # its record expired
    listed = httpx.get(api.url + "/v1/batches", headers=ALICE, timeout=30).json()["data"]
    assert batch_id not in [b["id"] for b in listed]
    assert r.zscore(c.batches_index("alice"), batch_id) is None

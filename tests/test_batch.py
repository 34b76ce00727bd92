"""The OpenAI Batch API through the official SDK: real Redis, the API process, real RQ batch workers and GPU-worker
processes running the tiny model on CPU. Crashes are real SIGKILLs of process groups."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.conftest import nested_schema
from tests.queue_helpers import REPO, STARTED, kill_group, log_of, start_worker
from tests.test_api_support import ApiServer, flushed, wait_for
from worker import contract as c

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "sk-batch-tenant-a-000000", "sk-batch-tenant-b-111111"


def start_batch_worker(redis_url: str, files_dir: Path, name: str, *extra: str) -> subprocess.Popen:
    """``gaggle batch-worker`` in its own process group (RQ forks a job process: a crash kills both)."""
    files_dir.mkdir(parents=True, exist_ok=True)
    log = open(files_dir.parent / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "--log-level", "INFO", "batch-worker",
                             "--redis-url", redis_url, "--files-dir", str(files_dir), "--window", "64", *extra],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    proc.log_path = log.name
    proc.own_group = True
    STARTED.append(proc)
    return proc


def started_requests(*workers) -> list[str]:
    """Request ids the GPU workers' logs say they started (a line generated twice would appear twice)."""
    ids = []
    for w in workers:
        for line in log_of(w, tail=10**9).splitlines():
            if '"request running"' in line:
                ids.append(orjson.loads(line[line.index("{"):])["request_id"])
    return ids


def write_lines(path: Path, n: int, max_tokens: int = 6, endpoint: str = "/v1/chat/completions",
                start: int = 0) -> Path:
    lines = []
    for i in range(start, start + n):
        body = ({"model": "rwkv-7", "messages": [{"role": "user", "content": f"Question {i}"}], "max_tokens": max_tokens,
                 "seed": i, "ignore_eos": True}
                if endpoint == "/v1/chat/completions" else
                {"model": "rwkv-7", "prompt": f"Story {i}", "max_tokens": max_tokens, "seed": i, "ignore_eos": True})
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body}))
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_batch(client: openai.OpenAI, batch_id: str, until=lambda b: b.status in ("completed", "failed", "expired",
                                                                                  "cancelled"), timeout_s: float = 120):
    seen = []

    def check():
        batch = client.batches.retrieve(batch_id)
        seen[:] = [batch]
        return batch if until(batch) else None
    try:
        return wait_for(check, timeout_s, 0.2, f"batch {batch_id}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: {seen[0] if seen else None}") from None


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    r = flushed(redis_server.url)
    files_dir = tmp / "files"
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    gpu = [start_worker(redis_server.url, str(tiny_model_path), f"bgpu{k}", "--max-num-seqs", "16")
           for k in range(2)]
    api = ApiServer(redis_server.url, "--files-dir", str(files_dir), "--api-keys-file", str(keys))
    batch_worker = start_batch_worker(redis_server.url, files_dir, "bw0")
    batch_workers = [batch_worker]
    try:
        api.wait_healthy()
        wait_for(lambda: httpx.get(api.url + "/ready").json().get("workers") == 2, 120, 0.2, "two workers")
        yield {"r": r, "api": api, "gpu": gpu, "batch_worker": batch_workers, "files_dir": files_dir, "tmp": tmp,
               "url": redis_server.url}
    finally:
        api.stop()
        for proc in gpu:
            proc.kill()
        for proc in batch_workers:  # started at module scope: the per-test reaper leaves them alone
            if proc.poll() is None:
                kill_group(proc)
        r.flushdb()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack["api"].url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def batch_worker_alive(request):
    """A batch worker a test started (after killing one) is killed when that test ends: the next test starts one."""
    if "stack" not in request.fixturenames:
        return
    stack = request.getfixturevalue("stack")
    if stack["batch_worker"][-1].poll() is not None:
        stack["batch_worker"].append(start_batch_worker(stack["url"], stack["files_dir"],
                                                        f"bw-{request.node.name[:40]}"))


def test_sdk_round_trip_every_custom_id_once_and_equal_to_single_requests(stack, client):
    path = write_lines(stack["tmp"] / "round.jsonl", 200, max_tokens=6)
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size
    assert client.files.retrieve(uploaded.id).filename == "round.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "round trip"})
    assert batch.status == "validating" and batch.metadata == {"job": "round trip"}
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 200 and done.request_counts.completed == 200 and done.request_counts.failed == 0
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(done, stamp) is not None
    out = file_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(200))  # each exactly once
    assert done.error_file_id is None
    assert done.usage.output_tokens == 200 * 6 == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    by_id = {o["custom_id"]: o for o in out}
    for i in (0, 7, 199):  # the same body through the live API, same seed: the same text
        body = json.loads(path.read_text().splitlines()[i])["body"]
        extra = {k: body.pop(k) for k in ("ignore_eos",)}  # vLLM's field: the SDK passes it as extra_body
        single = client.chat.completions.create(**body, extra_body=extra)
        assert by_id[f"req-{i}"]["response"]["body"]["choices"][0]["message"]["content"] == \
            single.choices[0].message.content
        assert by_id[f"req-{i}"]["response"]["status_code"] == 200
    listed = client.batches.list(limit=5)
    assert listed.data[0].id == batch.id
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_structured_and_tool_lines_in_a_batch(stack, client, tmp_path):
    """Batch lines constrained by a JSON schema, and lines with tools: every output validates; a line whose
    grammar does not compile fails alone."""
    import jsonschema
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a"], "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
    lines = []
    for i in range(12):
        body = {"model": "rwkv-7", "messages": [{"role": "user", "content": f"Q{i}"}], "max_tokens": 80, "seed": i}
        if i % 3 == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
        elif i % 3 == 1:
            body.update(tools=[tool], tool_choice="required")
        else:
            body["structured_outputs"] = {"grammar": "root ::= undefined" if i == 11 else 'root ::= "a" | "b"'}
        lines.append(json.dumps({"custom_id": f"s-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    path = tmp_path / "structured.jsonl"
    path.write_text("\n".join(lines) + "\n")
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.request_counts.completed == 11 and done.request_counts.failed == 1, done
    out = {o["custom_id"]: o["response"]["body"] for o in file_lines(client, done.output_file_id)}
    for i in range(11):
        message = out[f"s-{i}"]["choices"][0]["message"]
        if i % 3 == 0:
            jsonschema.validate(json.loads(message["content"]), schema)
        elif i % 3 == 1:
            assert out[f"s-{i}"]["choices"][0]["finish_reason"] == "tool_calls"
            jsonschema.validate(json.loads(message["tool_calls"][0]["function"]["arguments"]),
                                tool["function"]["parameters"])
        else:
            assert message["content"] in ("a", "b")
    errors = file_lines(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["s-11"]


@pytest.mark.parametrize("bad,code", [
    (b"{not json", "invalid_json"),
    (json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}).encode(), "missing_required_parameter"),
    (json.dumps({"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "x"}]}}).encode(), "duplicate_custom_id"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}).encode(),
     "mismatched_url"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "x"}], "temperature": 9}}).encode(), "invalid_value"),
    (json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}).encode(),
     "invalid_method"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",  # once failed, then looped
                 "body": {"messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "deep", "schema": nested_schema(98)}}}}).encode(),
     "invalid_value"),
], ids=["json", "custom_id", "duplicate", "url", "body", "method", "deep-schema"])
def test_a_bad_line_fails_the_batch_naming_it_and_nothing_is_queued(stack, client, bad, code):
    path = write_lines(stack["tmp"] / f"bad-{code}.jsonl", 3)
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], lines[1], bad, lines[2]]) + b"\n")
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    assert [(e.line, e.code) for e in done.errors.data] == [(3, code)], done.errors
    assert not stack["r"].exists(c.request_key(f"{batch.id}-1"))  # nothing of it was queued
    assert done.output_file_id is None


def test_more_than_50000_lines_fail_validation(stack, client):
    path = stack["tmp"] / "huge.jsonl"
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    path.write_text((line + "\n") * 50_001)
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/completions", completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.status == "failed" and done.errors.data[0].code == "too_many_requests"


def test_batch_worker_killed_twice_resumes_and_generates_nothing_twice(stack, client):
    path = write_lines(stack["tmp"] / "kills.jsonl", 160, max_tokens=40, endpoint="/v1/completions")
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/completions", completion_window="24h")
    for fraction in (0.3, 0.7):
        wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= fraction * 160)
        kill_group(stack["batch_worker"].pop())
        stack["batch_worker"].append(start_batch_worker(stack["url"], stack["files_dir"], f"bw-{fraction}"))
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 160, done
    out = file_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(160))
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 40 for o in out)  # no truncated line
    started = [rid for rid in started_requests(*stack["gpu"]) if rid.startswith(batch.id)]
    assert sorted(started) == sorted(f"{batch.id}-{i}" for i in range(1, 161))  # each line generated once


def test_a_gpu_worker_killed_mid_batch_loses_nothing(stack, client, tiny_model_path):
    path = write_lines(stack["tmp"] / "gpu-kill.jsonl", 96, max_tokens=40, endpoint="/v1/completions")
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/completions", completion_window="24h")
    wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 20)
    victim = stack["gpu"].pop(0)
    victim.kill()
    victim.wait()
    stack["gpu"].append(start_worker(stack["url"], str(tiny_model_path), "bgpu-replacement", "--max-num-seqs", "16"))
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 96, done
    out = file_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(96))
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 40 for o in out)


def test_cancel_midway_keeps_the_finished_lines(stack, client):
    path = write_lines(stack["tmp"] / "cancel.jsonl", 200, max_tokens=60, endpoint="/v1/completions")
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/completions", completion_window="24h")
    wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 60)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at, done
    out, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert 60 <= len(out) < 200
    assert sorted(o["custom_id"] for o in out + errors) == sorted(f"req-{i}" for i in range(200))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_the_batch_worker_checks_lines_with_the_apis_limits(redis_server, tmp_path):
    """``gaggle batch-worker --max-prompt-tokens`` (what ``gaggle up`` passes on from the API's flags): a line the
    live API would refuse fails its batch's validation, named by line, with the API's code. A database of its
    own; no GPU worker: nothing is generated."""
    url = redis_server.url.rsplit("/", 1)[0] + "/6"
    r = flushed(url)
    files_dir = tmp_path / "files"
    api = ApiServer(url, "--files-dir", str(files_dir)).wait_healthy()
    start_batch_worker(url, files_dir, "bw-limits", "--max-prompt-tokens", "8")
    try:
        client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
        path = write_lines(tmp_path / "long.jsonl", 3, endpoint="/v1/completions")
        lines = path.read_text().splitlines()
        long_line = json.loads(lines[1])
        long_line["body"]["prompt"] = "Story " * 40
        path.write_text("\n".join([lines[0], json.dumps(long_line), lines[2]]) + "\n")
        batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                      endpoint="/v1/completions", completion_window="24h")
        done = wait_batch(client, batch.id)
        assert done.status == "failed", done
        assert [(e.line, e.code) for e in done.errors.data] == [(2, "prompt_too_long")], done.errors
    finally:
        api.stop()
        r.flushdb()


def test_a_batch_worker_without_the_apis_file_store_fails_the_batch_saying_so(redis_server, tmp_path):
    """A batch worker started with another --files-dir than the API's (another directory, another host without
    the shared store): the batch fails at once naming the store, not stuck in validating. A database of its own."""
    url = redis_server.url.rsplit("/", 1)[0] + "/5"
    r = flushed(url)
    api = ApiServer(url, "--files-dir", str(tmp_path / "api-files")).wait_healthy()
    worker = start_batch_worker(url, tmp_path / "other-files", "bw-elsewhere")
    try:
        client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
        path = write_lines(tmp_path / "lines.jsonl", 2, endpoint="/v1/completions")
        batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                      endpoint="/v1/completions", completion_window="24h")
        done = wait_batch(client, batch.id, timeout_s=60)
        assert done.status == "failed", done
        [error] = done.errors.data
        assert error.code == "file_not_found" and str(tmp_path / "other-files") in error.message, error
        assert error.param == "input_file_id"
        assert "batch input file not in this worker's file store" in log_of(worker, tail=20000)
    finally:
        api.stop()
        r.flushdb()


def test_a_batch_past_its_window_expires_with_partial_output(redis_server, tiny_model_path, tmp_path):
    """A window of a few seconds (GAGGLE_BATCH_COMPLETION_WINDOW_S, what tests use for the 24 h clients ask for).
    A database of its own: the module's stack (its batch worker reads another file store) stays out of it."""
    url = redis_server.url.rsplit("/", 1)[0] + "/7"
    r = flushed(url)
    files_dir = tmp_path / "files"
    gpu = start_worker(url, str(tiny_model_path), "exp-gpu", "--max-num-seqs", "8")
    api = ApiServer(url, "--files-dir", str(files_dir),
                    env={"GAGGLE_BATCH_COMPLETION_WINDOW_S": "6"}).wait_healthy()
    start_batch_worker(url, files_dir, "bw-exp")
    try:
        wait_for(lambda: httpx.get(api.url + "/ready").status_code == 200, 120, 0.2, "ready")
        client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
        path = write_lines(tmp_path / "slow.jsonl", 300, max_tokens=60, endpoint="/v1/completions")
        batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                      endpoint="/v1/completions", completion_window="24h")
        done = wait_batch(client, batch.id, timeout_s=120)
        assert done.status == "expired" and done.expired_at, done
        out, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
        assert out and errors and len(out) + len(errors) == 300
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    finally:
        api.stop()
        gpu.kill()
        r.flushdb()


def test_tenants_cannot_see_each_others_files_or_batches(stack, client):
    path = write_lines(stack["tmp"] / "mine.jsonl", 2)
    mine = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = openai.OpenAI(base_url=stack["api"].url + "/v1", api_key=KEY_B, max_retries=0)
    for call in (lambda: other.files.retrieve(mine.id), lambda: other.files.content(mine.id),
                 lambda: other.files.delete(mine.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError):  # nor start a batch on it
        other.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert mine.id not in [f.id for f in other.files.list().data]
    assert batch.id not in [b.id for b in other.batches.list().data]
    wait_batch(client, batch.id)
    assert client.files.delete(mine.id).deleted  # the owner may
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(mine.id)


def test_uploads_are_checked(stack, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")
    expiring = client.files.create(file=("e.jsonl", b"{}\n"), purpose="batch",
                                   expires_after={"anchor": "created_at", "seconds": 3600})
    assert expiring.expires_at == expiring.created_at + 3600
    assert stack["r"].ttl(c.file_key(expiring.id)) > 3500


def test_the_cli_submits_follows_and_downloads(stack, tmp_path):
    path = write_lines(tmp_path / "cli.jsonl", 12, max_tokens=4)
    env = {**os.environ, "OPENAI_API_KEY": KEY_A}
    cli = [sys.executable, "-m", "cli.main", "batch"]
    url = ["--base-url", stack["api"].url]
    done = subprocess.run([*cli, "submit", str(path), "--wait", *url], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.splitlines()[0]
    assert json.loads(done.stdout[done.stdout.index("{"):])["status"] == "completed"
    assert "12/12" in done.stderr and "tok/s" in done.stderr  # the progress bar's last state
    out = tmp_path / "out.jsonl"
    got = subprocess.run([*cli, "download", batch_id, "-o", str(out), *url], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines()) == \
        sorted(f"req-{i}" for i in range(12))
    status = subprocess.run([*cli, "status", batch_id, *url], cwd=REPO, env=env, capture_output=True, text=True)
    assert json.loads(status.stdout)["request_counts"]["completed"] == 12
    listed = subprocess.run([*cli, "list", *url], cwd=REPO, env=env, capture_output=True, text=True)
    assert batch_id in listed.stdout
    missing = subprocess.run([*cli, "status", "batch_nope", *url], cwd=REPO, env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and "404" in missing.stderr


def test_gaggle_batch_takes_the_url_gaggle_up_prints_and_openai_base_url(stack):
    """``--base-url`` with or without /v1, else $OPENAI_BASE_URL; off a terminal, progress comes as whole lines."""
    path = write_lines(stack["tmp"] / "cli.jsonl", 6, max_tokens=4)
    base = stack["api"].url
    env = {**os.environ, "OPENAI_API_KEY": KEY_A}
    runs = [(["--base-url", base + "/v1"], env), (["--base-url", base + "/"], env),
            ([], {**env, "OPENAI_BASE_URL": base + "/v1"})]
    for flags, run_env in runs:
        done = subprocess.run([sys.executable, "-m", "cli.main", "batch", "submit", str(path), "--wait", *flags],
                              cwd=REPO, env=run_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        batch = json.loads(done.stdout.split("\n", 1)[1])
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 6
        assert "\r" not in done.stderr and "\x1b" not in done.stderr and "6/6" in done.stderr.splitlines()[-1]


def test_the_base_url_is_the_server_root_however_it_is_given(monkeypatch):
    from api.base_url import DEFAULT_SERVER, server_root
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert server_root() == DEFAULT_SERVER
    for given in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert server_root(given) == "http://h:1"
    monkeypatch.setenv("OPENAI_BASE_URL", "https://gaggle.example/v1")
    assert server_root() == "https://gaggle.example" and server_root("http://h:1/v1") == "http://h:1"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_redraws_without_leftovers_on_a_terminal_and_as_lines_elsewhere():
    from cli.batch import Progress
    screen = _Terminal()
    progress = Progress(screen)
    for line in ("[....] 0/300  ETA ?  in_progress", "[#...] 80/300  ETA 1,234 s", "[####] 300/300  ETA 0 s"):
        progress.show(line, line)
    progress.show("done", None, final=True)
    redraws = screen.getvalue().split(Progress.ERASE)
    assert redraws[0] == "" and redraws[1:] == ["[....] 0/300  ETA ?  in_progress", "[#...] 80/300  ETA 1,234 s",
                                                "[####] 300/300  ETA 0 s", "done\n"]
    log = io.StringIO()
    progress = Progress(log, every_s=0.0)
    for counts in (1, 1, 2):
        progress.show(f"line {counts}", counts)
    progress.show("final", None, final=True)
    assert log.getvalue() == "line 1\nline 2\nfinal\n"  # a line per change, no carriage returns

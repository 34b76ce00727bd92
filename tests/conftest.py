"""Shared fixtures: tiny random RWKV-7 models in the official layout, engines on CPU."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RWKV_V7_ON", "1")  # the official package picks its model class at import
os.environ.setdefault("RWKV_JIT_ON", "1")

try:
    import torch
except ImportError:  # api-only environments
    torch = None


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Leave without the interpreter's teardown once pytest has reported: Triton's nanobind bindings (loaded by
    the interpreted kernel tests) otherwise print a page of "leaked instance" lines under the pass count, about
    objects Triton's own caches hold at exit. Only after a whole run: the report and the status are final."""
    if _exit_status and os.environ.get("GAGGLE_TEST_SKIP_TEARDOWN", "1") == "1":
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def pytest_collection_modifyitems(config, items):
    has_cuda = torch is not None and torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_path(model_dir):
    """2 layers, width 128 (2 heads of 64), the real 65,536-token vocabulary."""
    from engine.demo import write_demo_model
    return write_demo_model(model_dir / "tiny.pth", layers=2, width=128, vocab=65536, seed=0)


@pytest.fixture(scope="session")
def tiny_weights(tiny_model_path):
    from engine.weights import load_model
    return load_model(tiny_model_path)


def make_engine(weights, **overrides):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    # a small prefix-cache slab: every engine's is committed memory, and the session's forks need room
    cfg = dict(device="cpu", max_num_seqs=8, max_num_batched_tokens=64, prefix_cache_gib=0.25)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), weights=weights)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free port for the whole session (AOF on)."""
    from worker.redis_server import RedisServer
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server):
    import redis
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.flushall()


@pytest.fixture()
def r(redis_url):
    """A client of the test's (flushed) Redis."""
    import redis
    return redis.Redis.from_url(redis_url)


@pytest.fixture(autouse=True)
def _no_stray_workers():
    """Worker processes a test started never outlive it, even when it fails or times out.

    Higher-scoped fixtures are set up before this one, so workers they share across tests are left alone.
    """
    from tests.queue_helpers import STARTED, kill_started
    mark = len(STARTED)
    yield
    kill_started(since=mark)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the log tails of the worker and batch-worker processes alive for it
    (tests.queue_helpers.STARTED): a failure on CI, where nothing else survives, can be read from its output."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    from tests.queue_helpers import STARTED
    for proc in STARTED:
        path = getattr(proc, "log_path", None)
        if not path:
            continue
        try:
            with open(path, errors="replace") as f:
                tail = f.read()[-4000:]
        except OSError:
            continue
        state = "running" if proc.poll() is None else f"exited {proc.returncode}"
        report.sections.append((f"log of pid {proc.pid} ({state}): {path}", tail))


def same_seed_tokens(weights, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """What a cold engine generates for each prompt (request id -> prompt), sampled at temperature 1 with the
    seed its position gives (0, 1, ...), ignoring EOS: the reference for runs that crossed a failure."""
    from engine.params import SamplingParams
    from engine.sequence import Request
    from tests.test_engine import generated, run_all
    cold = make_engine(weights, prefix_cache_gib=0)
    for seed, (rid, prompt) in enumerate(prompts.items()):
        cold.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                                                     ignore_eos=True)))
    outs = run_all(cold)
    return {rid: generated(outs, rid) for rid in prompts}


def nested_schema(depth: int) -> dict:
    """A JSON schema of objects nested ``depth`` levels around a string."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema

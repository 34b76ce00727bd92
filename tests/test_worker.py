"""The worker against a real redis-server: delivery, crash safety, poison entries, lifecycle, streaming."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import orjson
import pytest
import redis

from tests.conftest import make_engine
from tests.queue_helpers import (REPO, heartbeat, log_of, pending_count, request_streams, result, start_worker,
                                 submit, wait_results, wait_running)
from tests.test_api_support import wait_for
from worker import contract as c
from worker.ops import Outputs, Publish, Start
from worker.worker import Worker, WorkerConfig


def prompt(i: int) -> list[int]:
    return [1 + (i * 7919 + k * 104729) % 65000 for k in range(5 + i % 7)]


class InProcessWorker:
    """A Worker on a thread, for tests that need to look inside the engine."""

    def __init__(self, weights, redis_url: str, name: str = "w-test", **cfg):
        self.engine = make_engine(weights, max_num_seqs=4, max_num_batched_tokens=64)
        self.worker = Worker(self.engine, WorkerConfig(redis_url=redis_url, name=name, **cfg))
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.worker.stop_now = True
        self.thread.join(timeout=30)


def test_thousand_requests_through_two_worker_processes(r, redis_url, tiny_model_path):
    rids = [f"bulk-{i}" for i in range(1000)]
    for i, rid in enumerate(rids):
        submit(r, rid, prompt(i), priority="batch" if i % 2 else "interactive", max_tokens=3, temperature=0.0)
    workers = [start_worker(redis_url, str(tiny_model_path), f"w{k}", "--burst", "--max-num-seqs", "64",
                            "--max-num-batched-tokens", "512") for k in range(2)]
    for w in workers:
        assert w.wait(timeout=600) == 0, log_of(w)
    results = wait_results(r, rids, timeout_s=5)
    assert all(res.status == "completed" and len(res.choices[0].token_ids) == 3 for res in results.values())
    served_by = {res.worker for res in results.values()}
    assert served_by == {"w0", "w1"}  # both workers took a share
    assert pending_count(r) == 0
    assert sum(r.xlen(s) for s in request_streams(r)) == 0  # acknowledged entries are deleted
    # greedy is deterministic: the same prompt gives the same tokens whichever worker ran it
    again = [f"again-{i}" for i in range(3)]
    for i, rid in enumerate(again):
        submit(r, rid, prompt(i), max_tokens=3, temperature=0.0)
    w = start_worker(redis_url, str(tiny_model_path), "w2", "--burst")
    assert w.wait(timeout=300) == 0
    for i, rid in enumerate(again):
        assert result(r, rid).choices[0].token_ids == results[rids[i]].choices[0].token_ids


def test_sigkill_mid_generation_is_recovered_by_the_other_worker(r, redis_url, tiny_model_path):
    rids = [f"kill-{i}" for i in range(50)]
    for i, rid in enumerate(rids):
        submit(r, rid, prompt(i), max_tokens=60, temperature=0.0, ignore_eos=True)
    victim = start_worker(redis_url, str(tiny_model_path), "victim",
                          "--max-num-seqs", "64", "--max-num-batched-tokens", "512")
    if not wait_running(r, rids):  # all 50 mid-generation on the victim
        victim.kill()
        pytest.fail("victim never ran all 50 requests")
    assert not any(result(r, rid) for rid in rids)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    survivor = start_worker(redis_url, str(tiny_model_path), "survivor",
                            "--max-num-seqs", "64", "--max-num-batched-tokens", "512")
    try:
        results = wait_results(r, rids, timeout_s=300)
    finally:
        survivor.send_signal(signal.SIGTERM)
        survivor.wait(timeout=60)
    assert {res.worker for res in results.values()} == {"survivor"}
    assert all(res.status == "completed" and len(res.choices[0].token_ids) == 60 for res in results.values())
    assert pending_count(r) == 0
    time.sleep(c.HEARTBEAT_TTL_S)
    assert heartbeat(r, "victim") is None  # a dead worker's slots stop counting


def test_queued_requests_survive_a_redis_restart(tmp_path, tiny_model_path):
    from worker.redis_server import RedisServer
    server = RedisServer(tmp_path / "data").start()
    try:
        client = redis.Redis.from_url(server.url)
        rids = [f"aof-{i}" for i in range(20)]
        for i, rid in enumerate(rids):
            submit(client, rid, prompt(i), max_tokens=4)
        time.sleep(1.2)  # appendfsync everysec
        server.stop()
        server = RedisServer(tmp_path / "data", port=server.port).start()
        client = redis.Redis.from_url(server.url)
        assert client.xlen(c.request_stream("interactive", c.DEFAULT_TENANT)) == 20
        w = start_worker(server.url, str(tiny_model_path), "after-restart", "--burst")
        assert w.wait(timeout=300) == 0, log_of(w)
        assert all(res.status == "completed" for res in wait_results(client, rids, 5).values())
    finally:
        server.stop()


def test_poison_entries_are_dead_lettered_and_others_served(r, redis_url, tiny_weights):
    stream = c.request_stream("interactive", c.DEFAULT_TENANT)
    r.zadd(c.TENANTS, {c.DEFAULT_TENANT: time.time()})
    r.xadd(stream, {c.ENTRY_FIELD: b"{not json"})
    r.xadd(stream, {c.ENTRY_FIELD: orjson.dumps({"v": 99, "id": "future"})})
    submit(r, "bad-token", [1, 999_999], max_tokens=4)
    submit(r, "bad-param", [1, 2], max_tokens=4, temperature=-1)
    good = [f"good-{i}" for i in range(5)]
    for i, rid in enumerate(good):
        submit(r, rid, prompt(i), max_tokens=4)
    w = InProcessWorker(tiny_weights, redis_url)
    w.worker.run(burst=True)
    assert all(res.status == "completed" for res in wait_results(r, good, 5).values())
    for rid, words in (("future", "schema version"), ("bad-token", "outside the vocabulary"),
                       ("bad-param", "temperature")):
        res = result(r, rid)
        assert res.status == "failed" and words in res.error["message"], (rid, res.error)
    dead = r.xrange(c.STREAM_DEAD)
    assert len(dead) == 4
    assert any(b"undecodable" in fields[b"reason"] for _, fields in dead)
    assert pending_count(r) == 0


def test_a_request_that_breaks_the_step_is_isolated(r, redis_url, tiny_weights):
    poison_token = 4242
    w = InProcessWorker(tiny_weights, redis_url)
    model = w.engine.runner.model
    real_prefill = model.prefill_with_scores

    def failing_prefill(chunks, slots, score):  # fault injection: this prompt crashes the model
        if any(poison_token in chunk for chunk in chunks):
            raise RuntimeError("simulated kernel failure")
        return real_prefill(chunks, slots, score)

    model.prefill_with_scores = failing_prefill
    rids = [f"ok-{i}" for i in range(6)]
    for i, rid in enumerate(rids[:3]):
        submit(r, rid, prompt(i), max_tokens=5, temperature=0.0)
    submit(r, "poison", [1, poison_token, 3], max_tokens=5)
    for i, rid in enumerate(rids[3:], start=3):
        submit(r, rid, prompt(i), max_tokens=5, temperature=0.0)
    w.worker.run(burst=True)
    results = wait_results(r, rids + ["poison"], 5)
    assert results["poison"].status == "failed" and "simulated kernel failure" in results["poison"].error["message"]
    assert all(results[rid].status == "completed" and len(results[rid].choices[0].token_ids) == 5 for rid in rids)
    assert len(r.xrange(c.STREAM_DEAD)) == 1


def test_abort_frees_the_slot_within_one_step(r, redis_url, tiny_weights):
    with InProcessWorker(tiny_weights, redis_url) as w:
        submit(r, "long", prompt(1), max_tokens=10_000, ignore_eos=True)
        deadline = time.monotonic() + 30
        while w.engine.num_running < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.engine.num_free_slots == 3
        # the abort is a pub/sub message alone (the API also sets a marker, read after a (re)subscribe): publish
        # only once the worker listens, or under load it can go out before the subscription and be lost
        while r.pubsub_numsub(c.CHANNEL_ABORTS)[0][1] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        steps = []
        real_step = w.engine.step
        w.engine.step = lambda **kw: (steps.append(1), real_step(**kw))[1]  # the worker passes after_launch
        r.publish(c.CHANNEL_ABORTS, "long")
        while w.engine.num_free_slots < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        steps_after_abort = len(steps)
        res = wait_results(r, ["long"], 10)["long"]
    assert w.engine.num_free_slots == 4
    assert steps_after_abort <= 2  # applied between steps: at most the step in flight plus one
    assert res.status == "cancelled" and 0 < res.completion_tokens < 10_000


def test_cancel_marker_and_deadline_for_queued_requests(r, redis_url, tiny_weights):
    submit(r, "cancelled-early", prompt(1), max_tokens=4)
    r.set(c.cancel_key("cancelled-early"), 1)
    req = c.QueuedRequest(id="too-late", prompt_token_ids=[1, 2], params={"max_tokens": 4},
                          created=time.time() - 10, deadline=time.time() - 1)
    r.xadd(req.stream_key, req.encode())
    InProcessWorker(tiny_weights, redis_url).worker.run(burst=True)
    assert result(r, "cancelled-early").status == "cancelled"
    assert result(r, "too-late").status == "expired"


def test_a_deadline_passing_mid_generation_ends_it_with_what_was_streamed(r, redis_url, tiny_weights):
    """The worker finds a deadline passed between steps, with the next step already launched (the overlapped
    loop): the result is "expired" with the tokens streamed before it, no more (the token of the step in flight
    is dropped), counted exactly; the same request without a deadline starts with the same tokens."""
    pubsub = r.pubsub()
    pubsub.subscribe(c.out_channel("late"))
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    sampling = dict(max_tokens=10_000, ignore_eos=True, temperature=1.0, seed=11)
    with InProcessWorker(tiny_weights, redis_url, deadline_check_interval_s=0.01):
        late = c.QueuedRequest(id="late", prompt_token_ids=prompt(2), params=sampling, stream=True,
                               created=time.time(), deadline=time.time() + 2.0)
        pipe = r.pipeline()
        late.enqueue(pipe)
        pipe.execute()
        res = wait_results(r, ["late"], 60)["late"]
        submit(r, "free", prompt(2), **{**sampling, "max_tokens": res.completion_tokens + 3})
        free = wait_results(r, ["free"], 60)["free"]
    streamed = []
    while (msg := pubsub.get_message(timeout=1)) is not None:
        if msg["type"] == "message" and (body := orjson.loads(msg["data"]))["type"] == "delta":
            streamed += [t for ch in body["choices"] for t in ch["token_ids"]]
    tokens = res.choices[0].token_ids
    assert res.status == "expired" and 0 < res.completion_tokens < 10_000, (res.status, res.completion_tokens)
    assert streamed == tokens and len(tokens) == res.completion_tokens
    assert free.choices[0].token_ids[:len(tokens)] == tokens


def test_a_result_says_when_redis_and_the_reader_had_its_entry(r, redis_url, tiny_weights):
    """The result's timings say when Redis added the entry (added_s, from its id) and when the worker's reader had
    it (read_s), between the API's request and the loop's taking it (queued_s): the breakdown splits the API's
    enqueue, Redis and the reader, and the worker's inbox there."""
    assert c.entry_time(b"1796285350772-0") == pytest.approx(1796285350.772)
    assert c.entry_time("not-an-id") is None and c.entry_time(b"12") is None
    submit(r, "read", prompt(1), max_tokens=2)
    InProcessWorker(tiny_weights, redis_url).worker.run(burst=True)
    timings = result(r, "read").timings
    assert 0 < timings["read_s"] <= timings["queued_s"] < timings["ttft_s"], timings
    assert -0.002 < timings["added_s"] <= timings["read_s"] + 0.001, timings  # Redis's millisecond stamp


def test_streaming_gets_every_delta_in_order_and_non_streaming_none(r, redis_url, tiny_weights):
    """The step thread holds a step's outputs until the next step is launched, then hands them to the writer:
    every delta comes, in order, before the final."""
    pubsub = r.pubsub()
    pubsub.subscribe(c.out_channel("s"), c.out_channel("q"))
    for _ in range(2):
        pubsub.get_message(timeout=1)  # subscribe confirmations
    submit(r, "s", prompt(3), stream=True, n=2, max_tokens=12, temperature=1.0, seed=5)
    submit(r, "q", prompt(4), max_tokens=12)
    InProcessWorker(tiny_weights, redis_url).worker.run(burst=True)
    messages = {"s": [], "q": []}
    while (msg := pubsub.get_message(timeout=1)) is not None:
        if msg["type"] == "message":
            body = orjson.loads(msg["data"])
            messages[body["id"]].append(body)
    assert [m["type"] for m in messages["q"]] == ["final"]
    kinds = [m["type"] for m in messages["s"]]
    assert kinds[0] == "status" and kinds[-1] == "final" and set(kinds[1:-1]) == {"delta"}
    final = messages["s"][-1]["result"]
    for index in range(2):
        deltas = [ch for m in messages["s"] if m["type"] == "delta" for ch in m["choices"] if ch["index"] == index]
        assert "".join(d["text"] for d in deltas) == final["choices"][index]["text"]
        assert [t for d in deltas for t in d["token_ids"]] == final["choices"][index]["token_ids"]
        assert deltas[-1]["finish_reason"] == final["choices"][index]["finish_reason"]


def test_requests_naming_a_reply_channel_share_one_publish_per_write(r, redis_url, tiny_weights):
    """Sync requests name their API process's reply channel: a write publishes one message there for all of
    them (newline-joined), each request's messages in order — status, deltas adding up to the result, final."""
    channel = c.reply_channel("api-1")
    pubsub = r.pubsub()
    pubsub.subscribe(channel)
    pubsub.get_message(timeout=1)
    rids = [f"rc-{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        req = c.QueuedRequest(id=rid, prompt_token_ids=prompt(i), stream=True, reply_to=channel, owner="api-1",
                              params={"max_tokens": 10, "ignore_eos": True, "temperature": 1.0, "seed": i})
        req.enqueue(r)
    quiet = c.QueuedRequest(id="rc-quiet", prompt_token_ids=prompt(7), params={"max_tokens": 5}, reply_to=channel)
    quiet.enqueue(r)
    InProcessWorker(tiny_weights, redis_url).worker.run(burst=True)
    publishes, messages = 0, {rid: [] for rid in [*rids, "rc-quiet"]}
    while (msg := pubsub.get_message(timeout=1)) is not None:
        if msg["type"] == "message":
            publishes += 1
            for part in c.split_messages(msg["data"]):
                body = orjson.loads(part)
                messages[body["id"]].append(body)
    assert [m["type"] for m in messages["rc-quiet"]] == ["final"]
    for rid in rids:
        kinds = [m["type"] for m in messages[rid]]
        assert kinds[0] == "status" and kinds[-1] == "final" and set(kinds[1:-1]) == {"delta"}, kinds
        final = messages[rid][-1]["result"]["choices"][0]
        deltas = [ch for m in messages[rid][1:-1] for ch in m["choices"]]
        assert "".join(d["text"] for d in deltas) == final["text"]
        assert [t for d in deltas for t in d["token_ids"]] == final["token_ids"] and len(final["token_ids"]) == 10
    total = sum(len(v) for v in messages.values())
    assert publishes * 2 < total, (publishes, total)  # ~4 requests' deltas per PUBLISH
    assert r.pubsub_numsub(c.out_channel("rc-0"))[0][1] == 0


def test_a_reply_channel_must_be_one(r):
    """reply_to is '' or a gaggle:reply: channel: an entry cannot make a worker publish anywhere else."""
    req = c.QueuedRequest(id="bad-reply", prompt_token_ids=[1], params={"max_tokens": 1}, reply_to=c.CHANNEL_ABORTS)
    with pytest.raises(c.SchemaError, match="reply_to"):
        c.QueuedRequest.decode(req.encode())
    ok = c.QueuedRequest(id="ok-reply", prompt_token_ids=[1], params={"max_tokens": 1}, reply_to=c.reply_channel("a"))
    assert c.QueuedRequest.decode(ok.encode()).reply_to == c.reply_channel("a")


def test_sigterm_drains_and_check_reflects_liveness(r, redis_url, tiny_model_path):
    rids = [f"drain-{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        submit(r, rid, prompt(i), max_tokens=150, ignore_eos=True)
    w = start_worker(redis_url, str(tiny_model_path), "drainer", "--max-num-seqs", "4", "--drain-timeout", "600")
    check = [sys.executable, "-m", "cli.main", "worker", "--check", "--name", "drainer", "--redis-url", redis_url]
    assert wait_running(r, rids)
    assert subprocess.run(check, cwd=REPO, capture_output=True).returncode == 0
    w.send_signal(signal.SIGTERM)
    wait_for(lambda: '"action": "drain"' in log_of(w) or '"action":"drain"' in log_of(w), 30, 0.05, "draining")
    submit(r, "late", prompt(9), max_tokens=4)  # arrives while draining: left for others
    assert w.wait(timeout=600) == 0
    assert all(res.status == "completed" and res.completion_tokens == 150
               for res in wait_results(r, rids, 5).values())
    assert result(r, "late") is None
    assert subprocess.run(check, cwd=REPO, capture_output=True).returncode == 1
    other = start_worker(redis_url, str(tiny_model_path), "other", "--burst")
    assert other.wait(timeout=120) == 0
    assert result(r, "late").status == "completed"


def test_coalesced_steps_publish_one_merged_delta_per_request(r, redis_url):
    """A write covering several steps publishes one delta per request, its outputs merged per choice, after its
    status and before its final; in order they add up to the result and to the recorded text."""
    from engine.sequence import SequenceOutput, TokenLogprob
    from worker.results import InFlight

    def out(rid, index, token, text, finished=False):
        return SequenceOutput(rid, index, [token], text, [TokenLogprob(token, -0.5, [(token, -0.5)])], finished,
                              "length" if finished else None)

    pubsub = r.pubsub()
    pubsub.subscribe(c.out_channel("m"), c.out_channel("one"))
    for _ in range(2):
        pubsub.get_message(timeout=1)
    w = Worker(None, WorkerConfig(redis_url=redis_url, name="merge"))
    m = c.QueuedRequest(id="m", prompt_token_ids=[1], params={"logprobs": 0}, n=2, stream=True, record_text=True)
    one = c.QueuedRequest(id="one", prompt_token_ids=[1], params={}, stream=True)
    r.xgroup_create(m.stream_key, c.GROUP, id="0", mkstream=True)  # the entries pending under this worker's name:
    for req in (m, one):                                              # a final is written only for those
        r.xadd(m.stream_key, req.encode())
    read = r.xreadgroup(c.GROUP, "merge", {m.stream_key: ">"})[0][1]
    flights = {req.id: InFlight(req, m.stream_key, eid) for req, (eid, _) in zip((m, one), read)}
    flights["m"].watched = True  # an async request publishes deltas only while an /events stream watches it
    start = [op for req in (m, one) for op in (Start(flights[req.id]),
                                                Publish(c.out_channel(req.id), c.status_message(req.id, "running")))]
    steps = [[out("m", 0, 11, "a"), out("m", 1, 21, "x"), out("one", 0, 5, "p")],
             [out("m", 1, 22, "y", True), out("m", 0, 12, "b"), out("one", 0, 6, "q")],
             [out("m", 0, 13, "c", True), out("one", 0, 7, "r")],
             [out("one", 0, 8, "s", True)]]
    w.writer.write([start] + [[Outputs(step, time.time())] for step in steps[:2]])  # two steps, one write
    for step in steps[2:]:
        w.writer.write([[Outputs(step, time.time())]])
    got = {"m": [], "one": []}
    while (msg := pubsub.get_message(timeout=1)) is not None:
        if msg["type"] == "message":
            body = orjson.loads(msg["data"])
            got[body["id"]].append(body)

    assert [b["type"] for b in got["m"]] == ["status", "delta", "delta", "final"]
    assert [b["type"] for b in got["one"]] == ["status", "delta", "delta", "delta", "final"]
    merged = {ch["index"]: ch for ch in got["m"][1]["choices"]}
    assert len(got["m"][1]["choices"]) == 2  # one entry per choice
    assert (merged[0]["text"], merged[0]["token_ids"], len(merged[0]["logprobs"])) == ("ab", [11, 12], 2)
    assert (merged[1]["text"], merged[1]["token_ids"], merged[1]["finish_reason"]) == ("xy", [21, 22], "length")
    assert "finish_reason" not in merged[0]
    assert [ch["text"] for b in got["one"][1:-1] for ch in b["choices"]] == ["pq", "r", "s"]
    for rid, n in (("m", 2), ("one", 1)):
        final = got[rid][-1]["result"]
        assert final == orjson.loads(r.get(c.result_key(rid)))
        for index in range(n):
            deltas = [ch for b in got[rid][1:-1] for ch in b["choices"] if ch["index"] == index]
            assert "".join(ch["text"] for ch in deltas) == final["choices"][index]["text"]
            assert [t for ch in deltas for t in ch["token_ids"]] == final["choices"][index]["token_ids"]
            assert deltas[-1]["finish_reason"] == final["choices"][index]["finish_reason"] == "length"
    assert final["choices"][0]["text"] == "pqrs"
    assert [r.get(c.text_key("m", i)) for i in range(2)] == [b"abc", b"xy"]


def test_burst_worker_exits_as_soon_as_the_streams_are_empty(r, redis_url):
    from benchmarks.queue_overhead import NoComputeEngine
    for i in range(8):
        submit(r, f"b{i}", prompt(i), max_tokens=3)
    w = Worker(NoComputeEngine(4), WorkerConfig(redis_url=redis_url, name="burst"))
    t0 = time.monotonic()
    w.run(burst=True)
    assert time.monotonic() - t0 < 3.0  # not a reader's blocking read nor a socket timeout later
    assert all(res.completion_tokens == 3 for res in wait_results(r, [f"b{i}" for i in range(8)], 5).values())


def test_a_write_whose_connection_dropped_is_retried_and_its_deltas_sent_at_most_once(r, redis_url, caplog):
    from engine.sequence import SequenceOutput
    from worker.results import InFlight

    pubsub = r.pubsub()
    pubsub.subscribe(c.out_channel("x"))
    pubsub.get_message(timeout=1)
    w = Worker(None, WorkerConfig(redis_url=redis_url, name="retry"))
    req = c.QueuedRequest(id="x", prompt_token_ids=[1], params={}, stream=True)
    r.xadd(req.stream_key, req.encode())
    r.xgroup_create(req.stream_key, c.GROUP, id="0")
    entry_id = r.xreadgroup(c.GROUP, "retry", {req.stream_key: ">"})[0][1][0][0]
    w.writer.write([[Start(InFlight(req, req.stream_key, entry_id)),
                     Publish(c.out_channel("x"), c.status_message("x", "running"))],
                    [Outputs([SequenceOutput("x", 0, [5], "a", None, False)], time.time())]])
    assert r.client_kill_filter(_type="normal", skipme=True) >= 1  # the writer's connection
    w.writer.write([[Outputs([SequenceOutput("x", 0, [6], "b", None, False)], time.time())],
                    [Outputs([SequenceOutput("x", 0, [7], "c", None, True, "length")], time.time())]])
    kinds, texts = [], []
    while (msg := pubsub.get_message(timeout=1)) is not None:
        if msg["type"] == "message":
            body = orjson.loads(msg["data"])
            kinds.append(body["type"])
            texts += [ch["text"] for ch in body.get("choices", [])]
    assert kinds[0] == "status" and kinds[-1] == "final" and texts[0] == "a" and texts.count("bc") <= 1
    assert result(r, "x").choices[0].text == "abc"  # the transaction was retried on a new connection
    assert any("retrying" in rec.getMessage() for rec in caplog.records)
    assert r.xlen(req.stream_key) == 0 and pending_count(r) == 0


def test_the_writer_leaves_the_recorded_redis_state():
    """Typed operations framed by hiredis leave exactly the keys, stream entries and published messages the
    tuple-op writer with hand-written framing left on the same scripted run (tests/data/writer_state.json)."""
    import json

    from tests.writer_ops import OPS
    from tests.writer_scenario import RECORDING, run_scenario
    assert run_scenario(OPS) == json.loads(RECORDING.read_text())


def test_held_outputs_are_queued_before_anything_submitted_after_them(redis_url):
    """Writer.hold keeps a step's ops until release(); submit() and flush() release them first, so the writer
    still runs every op in the order the step thread produced them (a request's last tokens before its end)."""
    from worker.writer import Writer
    writer = Writer(redis_url, "order", forget=lambda entry_id: None)
    first, second, third, fourth = ([Publish(f"ch{i}", b"m")] for i in range(4))
    writer.hold(first)
    writer.hold([])
    assert writer._outbox.qsize() == 0  # held: nothing for the writer thread yet
    writer.submit(second)
    writer.hold(third)
    writer.release()
    writer.release()  # nothing held: nothing queued twice
    writer.hold(fourth)
    assert not writer.flush(timeout_s=0.01)  # no writer thread runs here: flushing only queues
    queued = [writer._outbox.get_nowait() for _ in range(writer._outbox.qsize())]
    assert queued == [first, second, third, fourth]


def test_loop_stats_lines_add_up_to_the_run(r, redis_url, tiny_weights, caplog):
    """The periodic "loop stats" lines (and the last one at shutdown) count every generated token, prompt token
    and started request of the run exactly once, with the step thread's time by phase."""
    import logging
    rids = [f"stats-{i}" for i in range(6)]
    for i, rid in enumerate(rids):
        submit(r, rid, prompt(i), max_tokens=5 + i, temperature=0.0)
    with caplog.at_level(logging.INFO, logger="worker.loop_stats"):
        InProcessWorker(tiny_weights, redis_url, log_stats_interval_s=0.05).worker.run(burst=True)
    lines = [rec.__dict__ for rec in caplog.records if rec.getMessage() == "loop stats"]
    assert len(lines) >= 2
    results = wait_results(r, rids, timeout_s=5)
    assert sum(x["tokens"] for x in lines) == sum(len(res.choices[0].token_ids) for res in results.values())
    assert sum(x["requests"] for x in lines) == len(rids)
    assert sum(x["prompt_tokens"] for x in lines) == sum(res.prompt_tokens for res in results.values())
    assert sum(x["steps"] for x in lines) > 0 and any(x["wait_ms"] > 0 or x["launch_ms"] > 0 for x in lines)
    assert all({"running", "waiting", "free_slots", "inbox", "writer_backlog"} <= x.keys() for x in lines)
    assert all(x["gc_ms_per_s"] >= 0 and x["gc_young"] >= 0 and x["gc_full"] >= 0 for x in lines)
    assert lines[-1]["running"] == 0 and lines[-1]["waiting"] == 0


def test_the_workers_threads_carry_their_names_in_the_os():
    """top -H / ps -L show which of the worker's threads is busy: the I/O threads name themselves to the kernel."""
    import sys
    import threading

    from worker.redis_io import _named
    if not sys.platform.startswith("linux"):
        pytest.skip("thread names in /proc: Linux")
    seen = []

    def read_own_name(_stop):
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    t = threading.Thread(target=_named(read_own_name, "gaggle-writer"), args=(None,))
    t.start()
    t.join()
    assert seen == ["gaggle-writer"]


def test_the_heartbeats_rate_falls_to_zero_once_idle(redis_url, r, tiny_model_path):
    """tokens/s on the heartbeat (the status line, the dashboard) shows the generation rate while tokens come and
    0 within a few seconds after they stop, not the last busy rate forever."""
    from tests.queue_helpers import heartbeat, start_worker, submit, wait_results
    from tests.test_api_support import wait_for, wait_heartbeat
    worker = start_worker(redis_url, str(tiny_model_path), "rate-w")
    try:
        wait_heartbeat(r, "rate-w")
        submit(r, "busy", [1, 2, 3], max_tokens=2000, ignore_eos=True)
        wait_for(lambda: heartbeat(r, "rate-w").tokens_per_s > 0, 60, 0.05, "a rate while busy")
        wait_results(r, ["busy"])
        wait_for(lambda: heartbeat(r, "rate-w").tokens_per_s == 0, 10, 0.1, "the rate back to 0 once idle")
    finally:
        worker.kill()

"""Queue overhead of a worker without the model: ``python -m worker.bench``.

A no-compute engine (this benchmark only) emits one token per running sequence
per step; the real Worker, RedisIO and an embedded redis-server do everything
else, with an API-like subscriber listening on every request channel. Reports
messages/s, the per-step cost on the GPU loop (what the step thread spends
handing outputs over) and the pipelined Redis round trip per step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time

import redis

from engine.report import publish
from engine.sequence import SequenceOutput
from worker import contract as c
from worker.redis_server import RedisServer
from worker.worker import Worker, WorkerConfig


class NoComputeEngine:
    """The LLMEngine surface the Worker uses; each step 'generates' one token for every running sequence."""

    def __init__(self, num_slots: int, step_s: float = 0.0):
        self.num_slots = num_slots
        self.step_s = step_s
        self.running: dict[str, list] = {}  # id -> [max_tokens, generated, prompt_tokens]
        self.own_s = 0.0

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running)

    def add(self, request) -> None:
        self.running[request.request_id] = [request.params.max_tokens, 0, len(request.prompt_token_ids)]

    def abort(self, request_id: str) -> bool:
        return self.running.pop(request_id, None) is not None

    def step(self) -> list[SequenceOutput]:
        if self.step_s:
            time.sleep(self.step_s)
        t0 = time.perf_counter()
        outs = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            outs.append(SequenceOutput(rid, 0, [42], " tok", None, done, "length" if done else None,
                                       num_prompt_tokens=state[2], num_output_tokens=state[1]))
            if done:
                del self.running[rid]
        self.own_s += time.perf_counter() - t0  # the stub's own Python time, excluded from the hand-over
        return outs


def listen(url: str, rids: list[str], max_tokens: int, ready, received) -> None:
    """What an API process does: one pub/sub connection subscribed to every request channel."""
    pubsub = redis.Redis.from_url(url).pubsub()
    pubsub.subscribe(*[c.out_channel(rid) for rid in rids])
    for _ in rids:
        pubsub.get_message(timeout=5)
    ready.set()
    expected = len(rids) * (max_tokens + 2)  # status, deltas, final
    while received.value < expected:
        msg = pubsub.get_message(timeout=5)
        if msg is None:
            return
        if msg["type"] == "message":
            received.value += 1


def run(num_seqs: int, max_tokens: int, step_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp, appendonly=False) as server:
        r = redis.Redis.from_url(server.url)
        rids = [f"bench-{i}" for i in range(num_seqs)]
        ready, received = multiprocessing.Event(), multiprocessing.Value("l", 0)
        listener = multiprocessing.Process(target=listen, args=(server.url, rids, max_tokens, ready, received),
                                           daemon=True)
        listener.start()  # a separate process, like the API: no GIL shared with the worker
        ready.wait(30)
        pipe = r.pipeline(transaction=False)
        for i, rid in enumerate(rids):
            req = c.QueuedRequest(id=rid, prompt_token_ids=[1, 2, 3], params={"max_tokens": max_tokens}, stream=True)
            pipe.xadd(req.stream_key, req.encode())
        pipe.execute()
        engine = NoComputeEngine(num_seqs, step_s)
        worker = Worker(engine, WorkerConfig(redis_url=server.url, name="bench"))
        writes: list[tuple[int, int, float]] = []
        worker.io.on_write = lambda steps, ops, s: writes.append((steps, ops, s))
        handover: list[float] = []
        real_step = worker._step

        def timed_step():
            t0, stub0 = time.perf_counter(), engine.own_s
            real_step()
            handover.append(time.perf_counter() - t0 - step_s - (engine.own_s - stub0))

        worker._step = timed_step
        t0 = time.perf_counter()
        worker.run(burst=True)
        wall = time.perf_counter() - t0
        listener.join(timeout=30)
        full = [w for w in writes if w[1] >= num_seqs]  # pipelines carrying a full step of deltas
        return {"seqs": num_seqs, "steps": len(handover), "wall_s": wall, "messages": received.value,
                "msgs_per_s": received.value / wall,
                "handover_ms_p50": 1e3 * statistics.median(handover),
                "handover_ms_p99": 1e3 * sorted(handover)[int(0.99 * (len(handover) - 1))],
                "redis_ms_p50": 1e3 * statistics.median(w[2] / w[0] for w in full) if full else float("nan"),
                "redis_ms_p99": 1e3 * sorted(w[2] / w[0] for w in full)[int(0.99 * (len(full) - 1))] if full else float("nan"),
                "steps_per_write": statistics.mean(w[0] for w in writes)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="256,1024")
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=10.0, help="simulated GPU step time")
    ap.add_argument("--out", default="BENCHMARKS.md")
    args = ap.parse_args(argv)
    rows = []
    for n in map(int, args.seqs.split(",")):
        res = run(n, args.max_tokens, args.step_ms / 1e3)
        rows.append(res)
        print(res, file=sys.stderr)
    header = ("| streaming seqs | steps | messages/s | step-thread hand-over ms p50 / p99 | "
              "Redis round trip per step ms p50 / p99 | steps per pipeline |\n|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['seqs']} | {r['steps']} | {r['msgs_per_s']:,.0f} | {r['handover_ms_p50']:.2f} / "
                   f"{r['handover_ms_p99']:.2f} | {r['redis_ms_p50']:.2f} / {r['redis_ms_p99']:.2f} | "
                   f"{r['steps_per_write']:.2f} |\n" for r in rows)
    publish(f"Worker queue overhead — no-compute engine, simulated {args.step_ms} ms step, embedded "
            "redis-server, one subscriber process on every channel", "worker.bench", argv, header + body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Slots refilled as they free: with requests already waiting in Redis, a slot freed by a finished sequence runs a
waiting request within 2 engine steps, at full occupancy. Counted from the worker's own records (the engine's
step number in its "sequence finished" and "sequence admitted" log lines), not timed. Real Redis and worker."""

from __future__ import annotations

import json

from tests.queue_helpers import start_worker, submit, wait_results
from tests.test_engine import tokens

SLOTS, REQUESTS = 4, 40


def records(log_path: str, message: str) -> list[dict]:
    with open(log_path) as f:
        lines = [json.loads(line) for line in f if line.startswith("{") and message in line]
    return [line for line in lines if line.get("msg") == message]


def test_a_freed_slot_runs_a_waiting_request_within_two_steps(redis_url, r, tiny_model_path):
    ids = [f"refill-{i}" for i in range(REQUESTS)]
    for i, rid in enumerate(ids):  # waiting before the worker starts; lengths differ so that slots free apart
        submit(r, rid, tokens(8, seed=i), max_tokens=6 + (i * 7) % 23, ignore_eos=True, seed=i)
    worker = start_worker(redis_url, str(tiny_model_path), "refill-w", "--max-num-seqs", str(SLOTS))
    results = wait_results(r, ids, timeout_s=120)
    assert all(results[rid].status == "completed" for rid in ids)
    worker.kill()
    admitted = records(worker.log_path, "sequence admitted")
    finished = records(worker.log_path, "sequence finished")
    assert len(admitted) == len(finished) == REQUESTS
    # the freed slots in the order they freed (the first SLOTS free from the start), each taken by the next
    # admission: a slot waits at most 2 steps while requests wait (all of them did until the last admission)
    last_admission = max(a["step"] for a in admitted)
    free = [0] * SLOTS + sorted(f["step"] for f in finished)
    late = [(freed_at, a) for freed_at, a in zip(free, sorted(a["step"] for a in admitted)) if a - freed_at > 2]
    late += [(freed_at, None) for freed_at in free[len(admitted):] if freed_at + 2 < last_admission]
    assert not late, f"slots refilled more than 2 steps after they freed (freed at step, refilled at): {late}"

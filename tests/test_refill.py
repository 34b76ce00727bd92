"""Slots refilled as they free: with requests already waiting in Redis, a slot freed by a finished sequence runs a
waiting request within 2 engine steps, at full occupancy. Counted from the worker's own records (the engine's
step number in its "sequence finished" and "sequence admitted" log lines), not timed. Real Redis and worker."""

from __future__ import annotations

from pathlib import Path

from benchmarks.loadgen.refill import idle_slot_steps, read_slot_log, refill_waits
from tests.queue_helpers import start_worker, submit, wait_results
from tests.test_engine import tokens

SLOTS, REQUESTS = 4, 40


def test_a_freed_slot_runs_a_waiting_request_within_two_steps(redis_url, r, tiny_model_path):
    ids = [f"refill-{i}" for i in range(REQUESTS)]
    for i, rid in enumerate(ids):  # waiting before the worker starts; lengths differ so that slots free apart
        submit(r, rid, tokens(8, seed=i), max_tokens=6 + (i * 7) % 23, ignore_eos=True, seed=i)
    worker = start_worker(redis_url, str(tiny_model_path), "refill-w", "--max-num-seqs", str(SLOTS))
    results = wait_results(r, ids, timeout_s=120)
    assert all(results[rid].status == "completed" for rid in ids)
    worker.kill()
    log = read_slot_log(Path(worker.log_path))
    assert log.slots == SLOTS and len(log.admitted) == len(log.finished) == REQUESTS
    late = [wait for wait in refill_waits(log) if wait > 2]
    assert not late and idle_slot_steps(log) == 0, (
        f"slots refilled more than 2 steps after they freed: waits {refill_waits(log)}, "
        f"idle slot-steps {idle_slot_steps(log)}")

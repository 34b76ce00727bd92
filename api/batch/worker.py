"""``gaggle batch-worker``: RQ's worker on the batch queue, plus a janitor that resumes orphaned batches.

A batch whose runner died (SIGKILL, a lost host) holds no lease: the janitor of any batch worker notices it on two
passes in a row and queues a new run of it (an RQ job per attempt); the runner then resumes from the output files.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import redis
from rq import Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job

from api.batch.service import enqueue_batch
from api.batch.model import Batch
from worker import contract as c
from worker.reader import LAPSED, wait_for_lapse

log = logging.getLogger(__name__)

JANITOR_INTERVAL_S = 2.0
BATCH_WORKER_TTL_S = 3 * JANITOR_INTERVAL_S  # a named batch worker's liveness key
EXIT_REDIS_GONE = 5  # the batch worker lost Redis (documented in the README): a supervisor restarts it
EXIT_STOP_GRACE = 6  # stopped, but its batch or Redis did not let it finish in STOP_GRACE_S (README)
STOP_GRACE_S = 10.0
UNSUBSCRIBE_WAIT_S = 1.5  # RQ's pubsub teardown at a stop (BatchWorker.unsubscribe)


class Janitor:
    def __init__(self, client: redis.Redis, queue: Queue, name: str | None = None):
        self.redis = client
        self.queue = queue
        self.name = name  # the batch worker's --name: its liveness key is kept fresh here
        self.suspects: dict[str, int] = {}  # batch id -> passes in a row it looked orphaned

    def run(self, stop: threading.Event) -> None:
        while True:
            try:
                if self.name is not None:
                    self.redis.set(c.batch_worker_key(self.name), f"{os.getpid()}:{time.monotonic()}",
                                   px=int(BATCH_WORKER_TTL_S * 1000))
            except redis.RedisError:
                pass
            if stop.wait(JANITOR_INTERVAL_S):
                return
            try:
                self.sweep()
            except redis.RedisError as e:
                log.warning("batch janitor: redis unavailable", extra={"error": str(e)})
            except Exception:
                log.exception("batch janitor error")

    def sweep(self) -> None:
        active = [b.decode() for b in self.redis.smembers(c.BATCHES_ACTIVE)]
        suspects = {}
        for batch_id in active:
            if self._orphaned(batch_id):
                suspects[batch_id] = self.suspects.get(batch_id, 0) + 1
                if suspects[batch_id] >= 2:
                    self._resume(batch_id)
                    suspects.pop(batch_id)
        self.suspects = suspects

    def _orphaned(self, batch_id: str) -> bool:
        """No runner holds its lease and no run of it waits in the queue."""
        if self.redis.exists(c.batch_lease_key(batch_id)):
            return False
        job_id = self.redis.hget(c.batch_key(batch_id), "job_id")
        if job_id:
            try:
                if Job.fetch(job_id.decode(), connection=self.redis).get_status() == "queued":
                    return False
            except NoSuchJobError:
                pass
        return True

    def _resume(self, batch_id: str) -> None:
        raw = self.redis.hgetall(c.batch_key(batch_id))
        if not raw:
            self.redis.srem(c.BATCHES_ACTIVE, batch_id)
            return
        batch = Batch.decode(raw)
        log.warning("resuming an orphaned batch", extra={"batch_id": batch_id, "status": batch.status})
        enqueue_batch(self.queue, self.redis, batch_id, max(1, batch.expires_at - int(time.time())))


class BatchWorker(Worker):
    """RQ's worker, stopping at once: a batch resumes from its files under the next batch worker, so a stop does
    not wait for it (RQ's warm shutdown would, for hours): the work horse running it is taken down, as in RQ's
    cold shutdown. With Redis gone RQ retries its connection forever; after STOP_GRACE_S this process exits
    regardless."""

    stopping: threading.Event | None = None  # set on a stop request: the janitor resumes no batch from then on

    def request_stop(self, signum, frame):
        timer = threading.Timer(STOP_GRACE_S, _exit_stopped)
        timer.daemon = True
        timer.start()
        if self.stopping is not None:
            self.stopping.set()
        if self.horse_pid:  # the loop reaps it, then stops (a warm stop with nothing left to wait for)
            log.info("batch worker stopping; its batch resumes from its files", extra={"signal": signum})
            self.kill_horse()
        super().request_stop(signum, frame)


    def unsubscribe(self):
        """RQ's, bounded to UNSUBSCRIBE_WAIT_S: its pubsub thread waits on the channel in 60 s reads, and when the
        unsubscribe reply reaches that thread before it is told to stop, it goes back to wait and closing the
        connection held the stopping worker ~10 s (1 stop in 4 on a 2-core host). The process exits right after."""
        done = threading.Thread(target=super().unsubscribe, name="gaggle-rq-unsubscribe", daemon=True)
        done.start()
        done.join(UNSUBSCRIBE_WAIT_S)


def _exit_stopped() -> None:
    log.warning("batch worker: stop grace over; exiting, its batch resumes from its files",
                extra={"grace_s": STOP_GRACE_S})
    _exit_now(EXIT_STOP_GRACE)


def _exit_now(status: int) -> None:
    """Exit without the interpreter's teardown: everything of a batch worker is in Redis and the files already,
    and that teardown once held a stopped batch worker for seconds after RQ had signed it off (on a loaded CPU
    host; not reproduced otherwise)."""
    log.info("batch worker stopped", extra={"exit_status": status})
    logging.shutdown()
    os._exit(status)


def serve(redis_url: str, burst: bool = False, name: str | None = None) -> int:
    """RQ's worker on the batch queue until stopped: through a Redis restart it reconnects and goes on (a batch
    it ran resumes from its files); a name a dead batch worker left registered is taken over."""
    from api.batch.runner import shared_tokenizer
    shared_tokenizer()  # before the first fork
    client = redis.Redis.from_url(redis_url)
    queue = Queue(c.BATCH_QUEUE, connection=client)
    if name is not None and not _take_name(client, name):  # before our own liveness key is written
        print(f"gaggle: a live batch worker is named {name!r}; give each its own --name", file=sys.stderr)
        return 2
    stop = threading.Event()
    janitor = Janitor(client, queue, name)
    if not burst:
        threading.Thread(target=janitor.run, args=(stop,), name="gaggle-batch-janitor", daemon=True).start()
    log.info("batch worker started", extra={"queue": c.BATCH_QUEUE, "burst": burst})
    delay = 0.5
    try:
        while True:
            worker = None
            try:
                if name is not None:  # a registration of ours that a Redis restart left behind
                    client.delete(Worker.redis_worker_namespace_prefix + name)
                worker = BatchWorker([queue], connection=client, name=name)
                worker.stopping = stop
                worker.work(burst=burst, with_scheduler=False, logging_level=logging.getLogger().level or "INFO")
                if worker._stop_requested:
                    _exit_now(0)
                return 0
            except redis.ConnectionError as e:  # Redis restarting, or gone: nothing is lost either way
                if worker is not None and worker._stop_requested:
                    log.error("batch worker stopped: redis unavailable; a running batch resumes from its files",
                              extra={"error": str(e)})
                    return EXIT_REDIS_GONE
                log.warning("redis unavailable; the batch worker reconnects", extra={"error": str(e)})
                if _wait_for_redis(client, stop, delay):
                    return EXIT_REDIS_GONE
                delay = min(delay * 2, 5.0)
    finally:
        stop.set()


def _take_name(client: redis.Redis, name: str) -> bool:
    """False if a live batch worker has ``name`` (its liveness key is refreshed while we wait for it to lapse);
    else RQ's registration of a dead one under it is removed, so this one can register."""
    if wait_for_lapse(client, c.batch_worker_key(name), BATCH_WORKER_TTL_S + 1.0) != LAPSED:
        return False
    client.delete(Worker.redis_worker_namespace_prefix + name)
    return True


def _wait_for_redis(client: redis.Redis, stop: threading.Event, delay: float) -> bool:
    """Until Redis answers; True if a SIGTERM came first (the caller exits)."""
    stopping = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        while not stopping.wait(delay):
            try:
                client.ping()
                return False
            except redis.RedisError:
                continue
        return True
    finally:
        signal.signal(signal.SIGTERM, previous)

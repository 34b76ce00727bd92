"""``gaggle batch-worker``: RQ's worker on the batch queue, plus a janitor that resumes orphaned batches.

A batch whose runner died (SIGKILL, a lost host) holds no lease: the janitor of any batch worker notices it on two
passes in a row and queues a new run of it (an RQ job per attempt); the runner then resumes from the output files.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from rq import Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job

from api.batch.service import enqueue_batch
from api.batch.model import Batch
from worker import contract as c

log = logging.getLogger(__name__)

JANITOR_INTERVAL_S = 2.0
EXIT_REDIS_GONE = 5  # the batch worker lost Redis (documented in the README): a supervisor restarts it


class Janitor:
    def __init__(self, client: redis.Redis, queue: Queue):
        self.redis = client
        self.queue = queue
        self.suspects: dict[str, int] = {}  # batch id -> passes in a row it looked orphaned

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(JANITOR_INTERVAL_S):
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


def serve(redis_url: str, burst: bool = False, name: str | None = None) -> int:
    from api.batch.runner import shared_tokenizer
    shared_tokenizer()  # before the first fork
    client = redis.Redis.from_url(redis_url)
    queue = Queue(c.BATCH_QUEUE, connection=client)
    stop = threading.Event()
    janitor = Janitor(client, queue)
    if not burst:
        threading.Thread(target=janitor.run, args=(stop,), name="gaggle-batch-janitor", daemon=True).start()
    log.info("batch worker started", extra={"queue": c.BATCH_QUEUE, "burst": burst})
    try:
        Worker([queue], connection=client, name=name).work(burst=burst, with_scheduler=False,
                                                            logging_level=logging.getLogger().level or "INFO")
    except redis.ConnectionError as e:  # Redis went away (stopping, or between restarts): nothing is lost
        log.error("batch worker stopped: redis unavailable; a running batch resumes from its files",
                  extra={"error": str(e)})
        return EXIT_REDIS_GONE
    finally:
        stop.set()
    return 0

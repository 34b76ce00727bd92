"""``gaggle up``'s status line: what the cluster is doing, read from the keys the workers and batches keep."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("gaggle.up")


class StatusLine:
    """Every few seconds, when it changed: live workers, running and queued requests, tok/s, running batches."""

    INTERVAL_S = 5.0

    def __init__(self, redis_url: str):
        import redis
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=2)
        self.last, self.next_at = "", 0.0

    def maybe_print(self) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.INTERVAL_S
        try:
            line = cluster_status(self.redis)
        except Exception as e:  # redis restarting: say nothing rather than something wrong
            log.debug("status unavailable", extra={"error": str(e)})
            return
        if line != self.last:
            self.last = line
            print(f"gaggle: {line}", file=sys.stderr, flush=True)


def cluster_status(r) -> str:
    from worker import contract as c
    names = [n.decode() for n in r.zrange(c.WORKER_REGISTRY, 0, -1)]
    beats = [c.Heartbeat.decode(b) for b in (r.mget([c.heartbeat_key(n) for n in names]) if names else []) if b]
    tenants = [t.decode() for t in r.zrange(c.TENANTS, 0, -1)]
    streams = [c.request_stream(p, t) for t in tenants for p in c.PRIORITIES]
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xlen(stream)
    in_streams = sum(pipe.execute()) if streams else 0
    running = sum(w.running for w in beats)
    parts = [f"{len(beats)} worker{'s' * (len(beats) != 1)}", f"{running} running",
             f"{max(0, in_streams - running)} queued", f"{sum(w.tokens_per_s for w in beats):,.0f} tok/s"]
    for batch_id in sorted(b.decode() for b in r.smembers(c.BATCHES_ACTIVE))[:3]:
        status, total, done, failed = r.hmget(c.batch_key(batch_id), "status", "total", "completed", "failed")
        if status:
            parts.append(f"{batch_id[:14]}… {status.decode()} {int(done or 0) + int(failed or 0)}/{int(total or 0)}"
                         + (f" ({int(failed)} failed)" if failed and int(failed) else ""))
    return " · ".join(parts)

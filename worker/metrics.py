"""Prometheus metrics of a worker, served on ``--metrics-port``."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class WorkerMetrics:
    def __init__(self, worker_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = {"worker": worker_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["worker"], registry=r).labels(**labels)

        self.running = gauge("gaggle_worker_running_sequences", "Sequences decoding now")
        self.free_slots = gauge("gaggle_worker_free_slots", "State slots free")
        self.gpu_memory = gauge("gaggle_worker_gpu_memory_bytes", "GPU memory allocated by the engine")
        self.gpu_utilization = gauge("gaggle_worker_gpu_utilization_ratio",
                                     "GPU busy fraction (NVML, where available; else 0)")
        self.tokens = Counter("gaggle_worker_generated_tokens", "Tokens generated", ["worker"], registry=r).labels(**labels)
        self.requests = Counter("gaggle_worker_requests", "Requests ended, by status", ["worker", "status"], registry=r)
        self.step_seconds = Histogram("gaggle_worker_step_seconds", "Engine step time", ["worker"],
                                      buckets=STEP_BUCKETS, registry=r).labels(**labels)
        self.batch_size = Histogram("gaggle_worker_batch_size", "Sequences producing a token per step", ["worker"],
                                    buckets=BATCH_BUCKETS, registry=r).labels(**labels)
        self.redis_write_seconds = Histogram("gaggle_worker_redis_write_seconds", "One pipelined write round trip",
                                             ["worker"], buckets=STEP_BUCKETS, registry=r).labels(**labels)
        self.worker_name = worker_name
        self._gc_clock = None
        self._prefix_cache = None
        self._shared_states = None  # worker.shared_states.SharedStates
        r.register(self)  # collect(): what is read at scrape time

    def collect(self):
        """Read at scrape time: the process's time in garbage collections (engine/gc_policy.py) and the prefix
        cache's counts (engine/prefix_cache.py)."""
        if self._gc_clock is not None:
            family = CounterMetricFamily("gaggle_worker_gc_seconds", "Time in garbage collections, every thread",
                                         labels=["worker"])
            family.add_metric([self.worker_name], self._gc_clock.seconds)
            yield family
        cache = self._prefix_cache
        if cache is not None:
            st = cache.stats
            for name, doc, value in (
                    ("lookups", "Prompts looked up in the prefix cache", st.lookups),
                    ("hits", "Prompts started from a prefix-cache checkpoint", st.hits),
                    ("tokens_saved", "Prompt tokens taken from the prefix cache instead of prefilled",
                     st.tokens_saved),
                    ("checkpoints_made", "Prefix-cache checkpoints made", st.checkpoints_made)):
                family = CounterMetricFamily(f"gaggle_worker_prefix_cache_{name}", doc, labels=["worker"])
                family.add_metric([self.worker_name], value)
                yield family
            for name, doc, read in (("bytes", "Bytes of prefix-cache checkpoints, by tier", cache.bytes_used),
                                    ("checkpoints", "Prefix-cache checkpoints held, by tier", cache.checkpoints)):
                family = GaugeMetricFamily(f"gaggle_worker_prefix_cache_{name}", doc, labels=["worker", "tier"])
                for tier, on_device in (("device", True), ("host", False)):
                    family.add_metric([self.worker_name, tier], read(on_device))
                yield family

        shared = self._shared_states
        if shared is not None:
            st = shared.stats
            for name, doc in (("lookups", "Prompts looked up in the shared (Redis) tier of the prefix cache"),
                              ("hits", "Prompts started from a state fetched from the shared tier"),
                              ("tokens", "Prompt tokens the fetched shared states saved"),
                              ("bytes_fetched", "Bytes of states fetched from the shared tier"),
                              ("recomputed", "Shared states found but not fetched: prefilling was cheaper"),
                              ("published", "States this worker wrote to the shared tier"),
                              ("bytes_published", "Bytes of states this worker wrote to the shared tier"),
                              ("dropped", "States not written to the shared tier: the writes were behind"),
                              ("evicted", "Shared states this worker's writes evicted (byte cap, least recent)"),
                              ("errors", "Shared-tier reads and writes that failed (a prefill instead)")):
                family = CounterMetricFamily(f"gaggle_worker_shared_prefix_{name}", doc, labels=["worker"])
                family.add_metric([self.worker_name], getattr(st, name))
                yield family

    def describe(self):
        return []  # collected lazily: no name clash to check at registration

    def attach_gc_clock(self, clock) -> None:
        self._gc_clock = clock

    def attach_prefix_cache(self, cache, shared=None) -> None:
        self._prefix_cache = cache
        self._shared_states = shared

    def on_step(self, seconds: float, num_outputs: int, running: int, free_slots: int) -> None:
        self.step_seconds.observe(seconds)
        if num_outputs:
            self.batch_size.observe(num_outputs)
            self.tokens.inc(num_outputs)
        self.running.set(running)
        self.free_slots.set(free_slots)

    def on_request_end(self, status: str) -> None:
        self.requests.labels(worker=self.worker_name, status=status).inc()

    def on_write(self, _steps: int, _ops: int, seconds: float) -> None:
        self.redis_write_seconds.observe(seconds)

    def sample_gpu_memory(self) -> None:
        try:
            import torch
            if torch.cuda.is_available():
                self.gpu_memory.set(torch.cuda.memory_allocated())
                self.gpu_utilization.set(torch.cuda.utilization() / 100)
        except Exception:
            log.debug("gpu memory probe failed", exc_info=True)


def serve_worker_metrics(worker, port: int) -> WorkerMetrics:
    metrics = WorkerMetrics(worker.cfg.name)
    worker.attach_metrics(metrics)
    metrics.attach_prefix_cache(getattr(worker.engine, "prefix_cache", None), worker.shared)
    start_http_server(port, registry=metrics.registry)
    log.info("worker metrics served", extra={"worker": worker.cfg.name, "port": port})
    return metrics

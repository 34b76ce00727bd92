"""Prometheus metrics of the API process, and the cluster view (queues, workers) read at scrape time.

With ``--workers N`` uvicorn runs N processes: set ``PROMETHEUS_MULTIPROC_DIR`` (``gaggle api``
does it for you) and the counters and histograms of all of them are merged at scrape time
(prometheus_client's multiprocess mode; its usual limits apply: no per-process gauges here, and
files of dead processes are only cleaned on restart). The cluster gauges come from Redis, so any
process answers them alike.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker import contract as c

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5)


def is_multiprocess() -> bool:
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


class Metrics:
    def __init__(self) -> None:
        self.registry = None if is_multiprocess() else CollectorRegistry()
        r = self.registry
        self.requests = Counter("gaggle_api_requests", "HTTP requests by route and status code",
                                ["endpoint", "code"], registry=r)
        self.prompt_tokens = Counter("gaggle_api_prompt_tokens", "Prompt tokens accepted", ["endpoint"], registry=r)
        self.generation_tokens = Counter("gaggle_api_generation_tokens", "Tokens generated", ["endpoint"],
                                         registry=r)
        self.ttft = Histogram("gaggle_api_time_to_first_token_seconds", "Time to first token",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gaggle_api_inter_token_latency_seconds", "Time between output tokens",
                             ["endpoint"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("gaggle_api_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)

    def observe_result(self, endpoint: str, result: c.Result) -> None:
        """Latencies of a finished request from the worker's timings (non-streaming requests)."""
        t = result.timings or {}
        tokens = result.completion_tokens
        self.generation_tokens.labels(endpoint).inc(tokens)
        if "ttft_s" in t and tokens:
            self.ttft.labels(endpoint).observe(max(0.0, t["ttft_s"]))
        if "e2e_s" in t:
            self.e2e.labels(endpoint).observe(max(0.0, t["e2e_s"]))
        per_choice = tokens / max(1, len(result.choices))
        if "ttft_s" in t and "e2e_s" in t and per_choice > 1:  # the mean gap of this request
            self.itl.labels(endpoint).observe(max(0.0, t["e2e_s"] - t["ttft_s"]) / (per_choice - 1))

    def exposition(self, cluster: dict) -> bytes:
        if self.registry is not None:
            own = generate_latest(self.registry)
        else:
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            own = generate_latest(merged)
        cluster_registry = CollectorRegistry()
        cluster_registry.register(ClusterCollector(cluster))
        return own + generate_latest(cluster_registry)


class ClusterCollector:
    """Gauges from one Redis snapshot: {"queues": {stream: depth}, "workers": [Heartbeat]}."""

    def __init__(self, snapshot: dict):
        self.snapshot = snapshot

    def collect(self):
        queue = GaugeMetricFamily("gaggle_queue_depth", "Entries in a request stream (queued + in flight)",
                                  labels=["priority", "tenant"])
        for stream, depth in self.snapshot.get("queues", {}).items():
            queue.add_metric(list(c.stream_priority_tenant(stream)), depth)
        yield queue
        workers: list[c.Heartbeat] = self.snapshot.get("workers", [])
        yield GaugeMetricFamily("gaggle_workers_live", "Workers with a fresh heartbeat", value=len(workers))
        yield GaugeMetricFamily("gaggle_workers_running_sequences", "Sequences running on all live workers",
                                value=sum(w.running for w in workers))
        yield GaugeMetricFamily("gaggle_workers_free_slots", "Free sequence slots on all live workers",
                                value=sum(w.free_slots for w in workers))
        yield GaugeMetricFamily("gaggle_workers_tokens_per_second", "Generation rate of all live workers",
                                value=sum(w.tokens_per_s for w in workers))
        batches: list[dict] = self.snapshot.get("batches", [])
        yield GaugeMetricFamily("gaggle_batches_active", "Batches not yet ended", value=len(batches))
        progress = GaugeMetricFamily("gaggle_batch_requests", "Requests of a running batch by state",
                                     labels=["batch", "state"])
        for b in batches:
            for state in ("total", "completed", "failed"):
                progress.add_metric([b["id"], state], b[state])
        yield progress
        restarts = CounterMetricFamily("gaggle_child_restarts", "Times `gaggle up` restarted a child process",
                                       labels=["child"])
        for child, count in self.snapshot.get("restarts", {}).items():
            restarts.add_metric([child], count)
        yield restarts


class MetricsMiddleware:
    """Counts every HTTP response by route template and status (plain ASGI: streams pass untouched)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status)).inc()

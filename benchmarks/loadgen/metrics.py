"""Per-request timings → the numbers ``vllm bench serve`` reports, its table, the saved JSON, the ratio.

Definitions (vLLM's ``calculate_metrics``): TTFT is send → first token-bearing chunk; ITL the gaps between
token-bearing chunks (a chunk that carries several tokens is one gap, as vLLM counts); E2E send → last
token-bearing chunk; TPOT (E2E − TTFT) / (output tokens − 1) for requests with more than one token.
Throughputs divide by the duration: the first send to the last response's end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))
MAX_ERRORS_KEPT = 5


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, ``start`` from the run's start."""
    index: int
    is_success: bool = False
    start: float = 0.0
    ttft: float | None = None  # None: not streamed (no first-token time)
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    end: float = 0.0  # the response read to its end (from the run's start)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the server took from its prefix cache (usage reports it)
    error: str | None = None
    request_id: str | None = None  # the response's id (the server's request id: joins the server's logs)
    sent_wall: float = 0.0  # time.time() when sent (the server's logs stamp wall time)


def summarize(values_s: list[float], name: str) -> dict[str, float | None]:
    """mean/std/median/p90/p99 in ms (numpy's linear percentiles, as vLLM); None when nothing was measured."""
    keys = [f"{stat}_{name}_ms" for stat in ("mean", "std", "median")] + \
        [f"p{p}_{name}_ms" for p in PERCENTILES if p != 50]
    if not values_s:
        return dict.fromkeys(keys)
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = [arr.mean(), arr.std(), np.median(arr)] + [np.percentile(arr, p) for p in PERCENTILES if p != 50]
    return {key: float(v) for key, v in zip(keys, stats)}


def tpot(record: RequestRecord) -> float | None:
    if record.ttft is None or record.output_tokens <= 1:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def compute_metrics(records: list[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.is_success]
    failed = [r for r in records if not r.is_success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    metrics = {
        "completed": len(ok), "failed": len(failed), "duration_s": duration_s,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "total_cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "errors": [r.error for r in failed[:MAX_ERRORS_KEPT]],
    }
    metrics.update(summarize([r.ttft for r in ok if r.ttft is not None], "ttft"))
    metrics.update(summarize([t for r in ok if (t := tpot(r)) is not None], "tpot"))
    metrics.update(summarize([gap for r in ok for gap in r.itl], "itl"))
    metrics.update(summarize([r.e2e for r in ok], "e2el"))
    return metrics


def details(records: list[RequestRecord]) -> dict[str, list]:
    """Per-request arrays for ``--save-detailed`` (seconds, as vLLM saves them)."""
    return {"start": [r.start for r in records], "ttft": [r.ttft for r in records], "itl": [r.itl for r in records],
            "e2el": [r.e2e for r in records], "output_tokens": [r.output_tokens for r in records],
            "input_tokens": [r.prompt_tokens for r in records], "errors": [r.error for r in records],
            "request_id": [r.request_id for r in records], "sent_wall": [r.sent_wall for r in records]}


# -- printing ---------------------------------------------------------------------------------

def _row(label: str, value: object, fmt: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{label:<40} {'n/a':<10}"
    return f"{label:<40} {format(value, fmt):<10}"


def format_table(metrics: dict, title: str, config: dict, client: dict | None) -> str:
    lines = [f"{' ' + title + ' ':=^50}", _row("Successful requests:", metrics["completed"]),
             _row("Failed requests:", metrics["failed"])]
    if config.get("max_concurrency"):
        lines.append(_row("Maximum request concurrency:", config["max_concurrency"]))
    if config["request_rate"] != "inf":
        lines.append(_row("Request rate configured (RPS):", config["request_rate"], ".2f"))
    lines += [_row("Benchmark duration (s):", metrics["duration_s"], ".2f"),
              _row("Total input tokens:", metrics["total_input_tokens"]),
              _row("Input tokens computed (not cached):",
                   metrics["total_input_tokens"] - metrics.get("total_cached_input_tokens", 0)),
              _row("Total generated tokens:", metrics["total_output_tokens"]),
              _row("Request throughput (req/s):", metrics["request_throughput"], ".2f"),
              _row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f"),
              _row("Total token throughput (tok/s):", metrics["total_token_throughput"], ".2f")]
    if metrics.get("slot_occupancy") is not None:  # mean running sequences / slots (see loadgen.occupancy)
        lines.append(_row("Slot occupancy (running / slots):", metrics["slot_occupancy"], ".3f"))
    for key, heading, short in LATENCIES:
        lines.append(f"{heading:-^50}")
        lines.append(_row(f"Mean {short} (ms):", metrics[f"mean_{key}_ms"], ".2f"))
        lines.append(_row(f"Median {short} (ms):", metrics[f"median_{key}_ms"], ".2f"))
        for p in PERCENTILES[1:]:
            lines.append(_row(f"P{p} {short} (ms):", metrics[f"p{p}_{key}_ms"], ".2f"))
    if client:
        lines.append(f"{'Client (this tool)':-^50}")
        lines.append(_row("Client processes:", len(client["per_process"])))
        lines.append(_row("Client CPU, all processes (CPU s/s):", client["cpu_per_wall"], ".3f"))
        busiest = max((p["cpu_s"] / max(p["wall_s"], 1e-9) for p in client["per_process"]), default=0.0)
        lines.append(_row("Busiest client process (CPU s/s):", busiest, ".3f"))
        lines.append(_row("Connections opened:", sum(p["connections"] for p in client["per_process"])))
    lines.append("=" * 50)
    for i, err in enumerate(metrics["errors"]):
        lines.append(f"error {i}: {err}")
    return "\n".join(lines)


RATIO_KEYS = (("request_throughput", "Request throughput"), ("output_throughput", "Output token throughput"),
              ("mean_ttft_ms", "Mean TTFT"), ("median_ttft_ms", "Median TTFT"), ("mean_tpot_ms", "Mean TPOT"),
              ("median_itl_ms", "Median ITL"), ("mean_e2el_ms", "Mean E2EL"), ("median_e2el_ms", "Median E2EL"))


def compare(served: dict, engine: dict) -> dict[str, float | None]:
    """served / engine-only for each headline metric (throughput below 1 and latency above 1 are the
    cost of the service around the engine)."""
    ratios = {}
    for key, _ in RATIO_KEYS:
        a, b = served["metrics"].get(key), engine["metrics"].get(key)
        ratios[key] = a / b if a is not None and b else None
    return ratios


def format_comparison(ratios: dict[str, float | None]) -> str:
    lines = [f"{' Served / engine-only ':=^50}"]
    lines += [_row(f"{label}:", ratios[key], ".3f") for key, label in RATIO_KEYS]
    return "\n".join(lines + ["=" * 50])

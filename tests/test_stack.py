"""The production stack's files, checked without a Docker engine: compose.yaml parses and hangs together (every
gaggle command parses with the real CLI, every GAGGLE_* variable is a setting, volumes and ports line up with the
Prometheus and Grafana files), the Dockerfile builds what compose runs, and every metric the Grafana dashboard
queries is one the API or a worker exports."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.queue_helpers import REPO

ROOT = Path(REPO)
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
GAGGLE = [name for name, s in SERVICES.items() if s.get("image") == "gaggle:latest"]
VAR = re.compile(r"\$\{([A-Z_]+)(?::-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default}, with nothing set."""
    return VAR.sub(lambda m: m.group(2) or "", value)


def test_compose_has_the_stack():
    assert {"redis", "api", "worker", "batch-worker", "prometheus", "grafana", "rq-dashboard"} <= SERVICES.keys()
    assert set(GAGGLE) == {"api", "worker", "batch-worker"}
    assert "--appendonly" in SERVICES["redis"]["command"] and SERVICES["redis"]["healthcheck"]
    gpu = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["count"] == 1  # --scale worker=N: one GPU each
    assert any(v.endswith(":/models:ro") for v in SERVICES["worker"]["volumes"])  # the model, read-only
    assert SERVICES["worker"]["healthcheck"]["test"][1:4] == ["gaggle", "worker", "--check"]


def test_every_gaggle_command_parses_with_the_cli():
    from cli.main import build_parser
    parser = build_parser()
    for name in GAGGLE:
        args = parser.parse_args([interpolate(a) for a in SERVICES[name]["command"]])
        assert args.func is not None, name
    check = SERVICES["worker"]["healthcheck"]["test"][2:]  # CMD gaggle ...
    assert parser.parse_args(check).check


def test_every_environment_variable_is_a_setting():
    from api.settings import Settings
    fields = {f"GAGGLE_{name.upper()}" for name in Settings.model_fields}
    for name in GAGGLE:
        for var in SERVICES[name].get("environment", {}):
            assert var in fields, f"{name}: {var} is not a setting"


def test_volumes_and_ports_line_up():
    named = set(COMPOSE["volumes"])
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = interpolate(volume).split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists() or source == "./models", f"{name}: {source} is missing"
            else:
                assert source in named, f"{name}: volume {source} is not declared"
    files = {interpolate(v).split(":")[0] for n in ("api", "batch-worker") for v in SERVICES[n]["volumes"]}
    assert files == {"files"}  # the file store is shared by the API and the batch worker
    for name in ("api", "batch-worker"):
        command = SERVICES[name]["command"]
        assert command[command.index("--files-dir") + 1] == "/data/files"
    prometheus = yaml.safe_load((ROOT / "dashboards/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["gaggle-api"]["static_configs"][0]["targets"] == ["api:8000"]
    assert "8000" in interpolate(SERVICES["api"]["ports"][0]).split(":")[1]
    worker_port = SERVICES["worker"]["command"][SERVICES["worker"]["command"].index("--metrics-port") + 1]
    assert jobs["gaggle-worker"]["dns_sd_configs"][0] == {"names": ["worker"], "type": "A", "port": int(worker_port)}
    datasource = yaml.safe_load((ROOT / "dashboards/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "dashboards/grafana/provisioning/dashboards/gaggle.yml").read_text())
    mounted = {interpolate(v).split(":")[1] for v in SERVICES["grafana"]["volumes"]}
    assert provider["providers"][0]["options"]["path"] in mounted


def test_the_dockerfile_builds_what_compose_runs():
    text = (ROOT / "Dockerfile").read_text()
    for part in ("api", "worker", "engine", "cli", "benchmarks", "dashboards", "pyproject.toml"):
        assert f"COPY {part}" in text, part
    assert 'ENTRYPOINT ["gaggle"' in text and "pip install torch==" in text


def exported_metrics() -> set[str]:
    """What the API (its own metrics and the cluster view) and a worker expose, after some activity."""
    from prometheus_client import CollectorRegistry, generate_latest
    from api.metrics import Metrics
    from worker import contract as c
    from worker.metrics import WorkerMetrics
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    api = Metrics()
    api.requests.labels("/v1/completions", "500").inc()
    api.prompt_tokens.labels("completions").inc()
    result = c.Result(id="r", choices=[c.Choice(0, "x", [1, 2])], completion_tokens=2,
                      timings={"ttft_s": 0.1, "e2e_s": 0.3})
    api.observe_result("completions", result)
    beat = c.Heartbeat(name="w", pid=1, host="h", device="cuda:0", model="m", num_slots=8, running=2, free_slots=6,
                       tokens_per_s=10.0, started=time.time())
    cluster = {"queues": {c.request_stream("interactive", "t"): 3}, "workers": [beat],
               "batches": [{"id": "b", "status": "in_progress", "total": 3, "completed": 1, "failed": 0}]}
    text = api.exposition(cluster).decode()
    worker = WorkerMetrics("w", CollectorRegistry())
    worker.on_step(0.01, 4, 4, 4)
    worker.on_request_end("failed")
    worker.on_write(1, 3, 0.001)
    worker.gpu_memory.set(1)
    worker.gpu_utilization.set(0.5)
    from engine.prefix_cache import PrefixCache
    cache = PrefixCache(100, 0, min_tokens=1)
    cache.add([1, 2, 3], 10, True, lambda: "state")
    cache.plan([1, 2, 3, 4])
    from worker.shared_states import SharedStates, SharedStatesConfig
    shared = SharedStates(SharedStatesConfig("redis://127.0.0.1:1/0", 1 << 20), {}, 1, lambda: 0.0)  # no I/O
    worker.attach_prefix_cache(cache, shared)
    text += generate_latest(worker.registry).decode()
    shared.close()
    assert 'gaggle_worker_prefix_cache_hits_total{worker="w"} 1.0' in text
    assert 'gaggle_worker_prefix_cache_bytes{tier="device",worker="w"} 10.0' in text
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads((ROOT / "dashboards/grafana/dashboards/gaggle.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"gaggle_[a-z0-9_]+", target["expr"])}
    assert len(queried) >= 15
    missing = queried - exported_metrics()
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("tokens", "first token", "inter-token", "end-to-end", "queue", "running", "batch size",
                  "workers", "batch progress", "errors", "gpu"):
        assert topic in titles, topic


@pytest.mark.parametrize("panel_expr", ["histogram_quantile", "rate("])
def test_the_dashboard_uses_rates_and_quantiles(panel_expr):
    text = (ROOT / "dashboards/grafana/dashboards/gaggle.json").read_text()
    assert panel_expr in text

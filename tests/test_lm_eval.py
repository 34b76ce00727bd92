"""lm-eval's ``local-completions`` with ``tokenizer_backend=remote`` against a live service: a tiny local
log-likelihood task (written here, no downloads) runs, and each log-likelihood equals the engine's own prompt
logprobs for the same tokens."""

from __future__ import annotations

import json
import math

import pytest

from engine.params import SamplingParams
from engine.sequence import Request
from engine.tokenizer import WorldTokenizer
from tests.conftest import make_engine
from tests.queue_helpers import start_worker
from tests.test_api_support import ApiServer, flushed, wait_heartbeat

pytestmark = pytest.mark.slow
MODEL = "tiny-rwkv"
DOCS = [{"context": "The goose walked to the", "continuation": " river"},
        {"context": "One, two, three,", "continuation": " four, five"},
        {"context": "Question: what is 2 + 2?\nAnswer:", "continuation": " 4"},
        {"context": "naïve café", "continuation": " — déjà vu"}]
TASK = """task: gaggle_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


@pytest.fixture()
def service(redis_server, tiny_model_path):
    url = redis_server.url.rsplit("/", 1)[0] + "/4"
    r = flushed(url)
    worker = start_worker(url, str(tiny_model_path), "lm-eval-worker", "--max-num-seqs", "8")
    api = ApiServer(url, "--model-name", MODEL)
    try:
        api.wait_healthy()
        wait_heartbeat(r, "lm-eval-worker")
        yield api
    finally:
        api.stop()
        worker.kill()
        r.flushdb()


def engine_loglikelihood(engine, tokenizer: WorldTokenizer, context: str, continuation: str) -> float:
    """What lm-eval asks for: the continuation's tokens (those of context + continuation past the context's own
    tokens), scored by the engine in this process."""
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    rid = f"ll-{len(engine._sequences)}-{context[:8]}"
    engine.add(Request(rid, whole, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)))
    prompt = None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid and out.prompt_logprobs is not None:
                prompt = out.prompt_logprobs
    return sum(entry.logprob for entry in prompt[len(ctx):])


def test_local_completions_with_the_remote_tokenizer_scores_like_the_engine(service, tmp_path, tiny_weights,
                                                                            monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["gaggle_tiny_ll"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"model": MODEL, "base_url": service.url + "/v1/completions", "tokenizer_backend": "remote",
                    "num_concurrent": 1, "max_retries": 1}, log_samples=True, batch_size=1)
    samples = results["samples"]["gaggle_tiny_ll"]
    assert len(samples) == len(DOCS)
    engine, tokenizer = make_engine(tiny_weights), WorldTokenizer.default()
    for sample in samples:
        served = sample["resps"][0][0][0]
        doc = sample["doc"]
        want = engine_loglikelihood(engine, tokenizer, doc["context"], doc["continuation"])
        assert math.isclose(served, want, rel_tol=1e-4, abs_tol=1e-4), (doc, served, want)
    assert math.isfinite(results["results"]["gaggle_tiny_ll"]["perplexity,none"])

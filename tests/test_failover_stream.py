"""A streaming client whose worker is killed mid-generation: another worker reclaims the request and generates it
again from its prompt with the same seed, and the client's stream carries on where it was — no restarted or
repeated text — ending equal to the stored result. Real API, real workers, real Redis, tiny CPU model."""

from __future__ import annotations

import contextlib
import signal

import httpx
import openai
import orjson

from tests.queue_helpers import log_of, start_worker
from tests.test_api_support import ApiServer, flushed, wait_for, wait_heartbeat
from worker import contract as c


@contextlib.contextmanager
def api_and_victim(redis_server, model_path, victim_name: str):
    """An empty Redis, the API, and the one worker the test will kill (short reclaim idle timeout)."""
    r = flushed(redis_server.url)
    victim = start_worker(redis_server.url, str(model_path), victim_name)
    api = ApiServer(redis_server.url, "--model-name", "tiny")
    try:
        api.wait_healthy()
        wait_heartbeat(r, victim_name)
        yield r, api, victim
    finally:
        api.stop()


def test_stream_carries_on_after_its_worker_is_killed(redis_server, tiny_model_path):
    with api_and_victim(redis_server, tiny_model_path, "victim") as (r, api, victim):
        client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=180)
        stream = iter(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=400,
                                                temperature=1.0, stream=True))  # no seed: one is fixed per id
        first = [next(stream) for _ in range(6)]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        survivor = start_worker(redis_server.url, str(tiny_model_path), "survivor")
        rest = list(stream)
        streamed = "".join(ch.choices[0].text for ch in first + rest if ch.choices)
        rid = first[0].id
        result = c.Result.decode(r.get(c.result_key(rid)))
        assert result.worker == "survivor", log_of(survivor)  # it was generated again, elsewhere
        assert result.completion_tokens == 400
        assert streamed == result.choices[0].text
        assert rest[-1].choices[0].finish_reason == "length"


def test_async_events_carry_on_after_the_worker_is_killed(redis_server, tiny_model_path):
    """The same for an async request's event stream (its recorded text starts again on the new worker)."""
    with api_and_victim(redis_server, tiny_model_path, "victim2") as (r, api, victim):
        with httpx.Client(base_url=api.url, timeout=180) as http:
            created = http.post("/v1/requests", json={"endpoint": "completions", "prompt": "Once upon a time",
                                                      "max_tokens": 400, "temperature": 1.0})
            assert created.status_code == 202, created.text
            rid = created.json()["id"]
            wait_for(lambda: http.get(f"/v1/requests/{rid}").json()["choices"][0]["text"], 60, 0.05, "some text")
            events, killed, survivor = [], False, None
            with http.stream("GET", f"/v1/requests/{rid}/events") as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    events.append(orjson.loads(line[len("data: "):]))
                    if len(events) >= 4 and not killed:
                        victim.send_signal(signal.SIGKILL)
                        victim.wait()
                        killed = True
                        survivor = start_worker(redis_server.url, str(tiny_model_path), "survivor2")
        final = events[-1]
        assert killed and final["object"] == "request" and final["status"] == "completed"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        result = c.Result.decode(r.get(c.result_key(rid)))
        assert result.worker == "survivor2", log_of(survivor)
        assert text == result.choices[0].text == final["choices"][0]["text"]
        assert r.get(c.text_key(rid, 0)).decode() == result.choices[0].text

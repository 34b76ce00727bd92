"""Named initial states (state tuning): a request that names one starts from it, as the official package does
when given that state; bad files and unknown names are clear errors."""

from __future__ import annotations

import pytest
import torch

from engine.demo import write_demo_model
from engine.initial_states import StateFileError, load_initial_state, write_state_file
from engine.params import ParamError, SamplingParams
from engine.sequence import Request
from engine.weights import load_model
from tests.conftest import make_engine
from tests.test_engine import generated, run_all


@pytest.fixture(scope="module")
def model_and_state(tmp_path_factory):
    d = tmp_path_factory.mktemp("state")
    path = write_demo_model(d / "m.pth", layers=2, width=128, vocab=512, seed=4)
    weights = load_model(path)
    return path, weights, write_state_file(d / "s.pth", weights.shape, seed=9)


def official_greedy(path, state_file, prompt: list[int], steps: int) -> list[int]:
    """The rwkv package's greedy continuation from the state file, loaded as its chat demo loads one."""
    from rwkv.model import RWKV
    official = RWKV(model=str(path)[:-len(".pth")], strategy="cpu fp32")
    raw = torch.load(state_file)
    L, C = official.args.n_layer, official.args.n_embd
    state = []
    for i in range(L):
        state += [torch.zeros(C), raw[f"blocks.{i}.att.time_state"].transpose(1, 2).float().contiguous(),
                  torch.zeros(C)]
    out, state = official.forward(prompt, state)
    tokens = []
    for _ in range(steps):
        token = int(out.argmax())
        tokens.append(token)
        out, state = official.forward([token], state)
    return tokens


def test_a_request_that_names_a_state_continues_as_the_official_package_does(model_and_state):
    path, weights, state_file = model_and_state
    engine = make_engine(weights, initial_states={"tuned": str(state_file)})
    prompt = [5, 17, 301, 44, 9, 120, 77, 3]
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add(Request("with", prompt, SamplingParams(**params, state="tuned")))
    engine.add(Request("without", prompt, SamplingParams(**params)))
    outs = run_all(engine)
    assert generated(outs, "with") == official_greedy(path, state_file, prompt, 12)
    assert generated(outs, "with") != generated(outs, "without")


def test_prefix_states_are_kept_apart_per_initial_state(model_and_state):
    _, weights, state_file = model_and_state
    prompt = list(range(100, 150))  # past the 32-token minimum: kept, and a repeat is a whole-prompt hit
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    warm = make_engine(weights, initial_states={"tuned": str(state_file)})
    cold = make_engine(weights, initial_states={"tuned": str(state_file)}, prefix_cache_gib=0)
    for rid, state in (("zero", None), ("tuned", "tuned"), ("zero-again", None), ("tuned-again", "tuned")):
        for engine in (warm, cold):
            engine.add(Request(rid, prompt, SamplingParams(**params, state=state)))
    w, c = run_all(warm), run_all(cold)
    def first_logprob(outs, rid):
        return outs[(rid, 0)][0].logprobs[0].logprob

    for rid in ("zero", "tuned", "zero-again", "tuned-again"):
        assert generated(w, rid) == generated(c, rid), rid
        assert first_logprob(w, rid) == pytest.approx(first_logprob(c, rid), abs=1e-5), rid
    assert w[("tuned-again", 0)][0].num_cached_tokens == len(prompt)
    # the state still shows after 50 tokens (a random model forgets it fast: in the numbers, not the argmax)
    assert abs(first_logprob(w, "zero") - first_logprob(w, "tuned")) > 1e-4


def test_bad_state_files_and_unknown_names_are_refused(model_and_state, tmp_path):
    _, weights, state_file = model_and_state
    shape = weights.shape
    torch.save({"blocks.0.att.time_state": torch.zeros(3, 3)}, tmp_path / "small.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a pickle")
    for bad, words in ((tmp_path / "small.pth", "shape"), (tmp_path / "junk.pth", "cannot read")):
        with pytest.raises(StateFileError, match=words):
            load_initial_state("x", bad, shape, "cpu", torch.float32, torch.float32)
    torch.save({"blocks.0.att.time_state": torch.zeros(shape.n_head, shape.head_size, shape.head_size)},
               tmp_path / "one-layer.pth")
    with pytest.raises(StateFileError, match="blocks.1.att.time_state"):
        load_initial_state("x", tmp_path / "one-layer.pth", shape, "cpu", torch.float32, torch.float32)
    engine = make_engine(weights, initial_states={"tuned": str(state_file)})
    with pytest.raises(ValueError, match="not loaded here"):
        engine.add(Request("r", [1, 2], SamplingParams(state="other")))
    with pytest.raises(ParamError):
        SamplingParams(state="no spaces allowed")
    assert SamplingParams.from_wire(SamplingParams(state="tuned").to_wire()).state == "tuned"


def test_the_api_takes_a_held_state_and_refuses_others_at_once(redis_server, tiny_model_path, tmp_path):
    import httpx

    from tests.queue_helpers import start_worker
    from tests.test_api_support import ApiServer, flushed, wait_heartbeat
    r = flushed(redis_server.url)
    state_file = write_state_file(tmp_path / "tuned.pth", load_model(tiny_model_path).shape, seed=2)
    worker = start_worker(redis_server.url, str(tiny_model_path), "state-worker", "--state", f"tuned={state_file}")
    api = ApiServer(redis_server.url).wait_healthy()
    try:
        wait_heartbeat(r, "state-worker")
        post = lambda **kw: httpx.post(api.url + "/v1/completions", timeout=60,  # noqa: E731
                                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, **kw})
        assert post(state="tuned").status_code == 200
        unknown = post(state="other")
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_state"
        assert "tuned" in unknown.json()["error"]["message"] and unknown.json()["error"]["param"] == "state"
        assert post(state="not a name").status_code == 400
        chat = httpx.post(api.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "state": "other"})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "unknown_state"
        from worker import contract as c
        assert r.xlen(c.STREAM_DEAD) == 0  # refused before anything was queued
    finally:
        api.stop()
        worker.kill()


def test_an_uploaded_state_file_serves_its_tenant_as_the_same_file_given_at_start(redis_server, tiny_model_path,
                                                                                   tmp_path):
    """POST /v1/files (purpose rwkv_state) checks the file and stores it; a request naming its id starts from it
    (the tokens of the same file loaded with --state); another tenant naming it, a bad file and a file of another
    shape are 400s."""
    import httpx

    from tests.queue_helpers import start_worker
    from tests.test_api_support import ApiServer, flushed, wait_heartbeat
    r = flushed(redis_server.url)
    shape = load_model(tiny_model_path).shape
    state_file = write_state_file(tmp_path / "tuned.pth", shape, seed=3)
    worker = start_worker(redis_server.url, str(tiny_model_path), "upload-worker", "--state", f"tuned={state_file}")
    api = ApiServer(redis_server.url, env={"GAGGLE_API_KEYS": "ka:alice,kb:bob"}).wait_healthy()
    try:
        wait_heartbeat(r, "upload-worker")

        def upload(data: bytes, key: str = "ka") -> httpx.Response:
            return httpx.post(api.url + "/v1/files", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                              files={"file": ("state.pth", data)}, data={"purpose": "rwkv_state"})

        def complete(key: str = "ka", **kw) -> httpx.Response:
            return httpx.post(api.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                              json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, **kw})

        made = upload(state_file.read_bytes())
        assert made.status_code == 200, made.text
        file_id = made.json()["id"]
        assert made.json()["purpose"] == "rwkv_state"
        from_upload = complete(state=file_id)
        assert from_upload.status_code == 200, from_upload.text
        assert from_upload.json()["choices"][0]["text"] == complete(state="tuned").json()["choices"][0]["text"]
        assert from_upload.json()["choices"][0]["text"] != complete().json()["choices"][0]["text"]
        theirs = complete("kb", state=file_id)
        assert theirs.status_code == 400 and "not an uploaded state file of this tenant" in theirs.json()["error"]["message"]
        bad = upload(b"not a state file")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_state_file"
        import dataclasses
        other_shape = write_state_file(tmp_path / "other.pth", dataclasses.replace(shape, n_layer=3), seed=1)
        wrong = upload(other_shape.read_bytes())
        assert wrong.status_code == 400 and "3 layers" in wrong.json()["error"]["message"]
        deleted = httpx.delete(api.url + f"/v1/files/{file_id}", headers={"Authorization": "Bearer ka"}, timeout=30)
        assert deleted.status_code == 200 and not r.exists(f"gaggle:istate:{file_id}")
    finally:
        api.stop()
        worker.kill()

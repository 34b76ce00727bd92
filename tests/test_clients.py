"""What real clients expect, with the real clients against a live service (API + one CPU worker, the tiny random
model): structured outputs through the openai SDK's ``parse``, tool calls, the tokenizer endpoints, scoring a
prompt alone, and a 400 naming every OpenAI field Gaggle does not implement."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
import rwkv.rwkv_tokenizer as official
from pydantic import BaseModel, Field

from tests.queue_helpers import start_worker
from tests.test_api_support import ApiServer, flushed, sse_data, wait_heartbeat
from tests.test_tokenizer import OFFICIAL_VOCAB

pytestmark = pytest.mark.slow
WORKER = "clients-worker"
MODEL = "tiny-rwkv"


class Pet(BaseModel):
    """Every field bounded: a random model's output ends within max_tokens."""
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=40)]
    vaccinated: bool
    kind: Literal["cat", "dog", "goose"]
    toys: Annotated[list[Annotated[str, Field(max_length=4)]], Field(max_length=2)]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                  "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}


@pytest.fixture(scope="module")
def service(redis_server, tiny_model_path):
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    r = flushed(url)
    worker = start_worker(url, str(tiny_model_path), WORKER, "--max-num-seqs", "24")
    api = ApiServer(url, "--model-name", MODEL)
    try:
        api.wait_healthy()
        wait_heartbeat(r, WORKER)
        yield api
    finally:
        api.stop()
        worker.kill()
        r.flushdb()


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.url + "/v1", api_key="none", max_retries=0, timeout=120)


def in_parallel(fn, items):
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


# -- structured outputs ---------------------------------------------------------------------------------------

def test_sdk_parse_returns_a_valid_object_for_20_seeds(client):
    schema = openai.lib._pydantic.to_strict_json_schema(Pet)

    def ask(seed: int):
        return client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet, please"}],
                                             response_format=Pet, seed=seed, temperature=1.0, max_tokens=200)
    for done in in_parallel(ask, list(range(20))):
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Pet)
        jsonschema.validate(json.loads(message.content), schema)


def test_structured_outputs_on_completions_regex_choice_and_json(client):
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30, temperature=1.0, seed=1,
                                      extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{2,4}"}})
    assert __import__("re").fullmatch(r"[A-Z]{3}-\d{2,4}", regex.choices[0].text)
    choice = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, n=4, seed=2, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "perhaps"]}})
    assert all(c.text in ("yes", "no", "perhaps") for c in choice.choices)
    schema = Pet.model_json_schema()
    js = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, seed=3, temperature=1.0,
                                   extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                       "name": "pet", "schema": schema}}})
    jsonschema.validate(json.loads(js.choices[0].text), schema)


def test_constrained_stream_and_free_requests_together(client):
    """Half constrained, half free, in one batch; the streamed constrained text is valid JSON."""
    def constrained(seed: int) -> str:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "json"}], seed=seed, max_tokens=200, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}})
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    def free(seed: int) -> int:
        done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=seed,
                                              max_tokens=20, extra_body={"ignore_eos": True})
        return done.usage.completion_tokens
    results = in_parallel(lambda job: job[0](job[1]), [(constrained, s) for s in range(4)] + [(free, s) for s in range(4)])
    for text in results[:4]:
        Pet.model_validate_json(text)
    assert results[4:] == [20] * 4


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400_naming_the_field(service, body, param):
    r = httpx.post(service.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_grammar_the_worker_cannot_compile_is_a_400(service):
    r = httpx.post(service.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "structured_outputs": {"grammar": "root ::= undefined_rule"}})
    assert r.status_code == 400, r.text
    assert "grammar" in r.json()["error"]["message"]


# -- tool calls --------------------------------------------------------------------------------------------------

def test_required_and_named_tool_choice_give_valid_calls(client):
    messages = [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD],
                                          tool_choice="required", seed=4, max_tokens=200)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        spec = {"get_weather": WEATHER, "add": ADD}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], seed=5,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=200)
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    single = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], seed=6,
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert len(single.choices[0].message.tool_calls) == 1


def test_tool_round_trip_streaming_and_not(client):
    """call → the tool's result in the history → an answer; the streamed calls equal the whole ones."""
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD], tool_choice="required",
                                           seed=7, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD], tool_choice="required",
                                            seed=7, max_tokens=200, stream=True)
    chunks = [c for c in stream if c.choices]
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert all(s.id and s.id.startswith("call_") and s.type == "function" for s in streamed)
    assert [(s.function.name, s.function.arguments) for s in streamed] == [
        (tc.function.name, tc.function.arguments) for tc in first.choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = messages + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    for stream_answer in (False, True):
        answer = client.chat.completions.create(model=MODEL, messages=history, tools=[ADD], tool_choice="none",
                                                seed=8, max_tokens=12, stream=stream_answer)
        if stream_answer:
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            assert answer.choices[0].message.tool_calls is None
            text = answer.choices[0].message.content
        assert text


def assembled_chat_stream(client, **body) -> tuple[str | None, list, str]:
    """A streamed chat reply put together as a client does: (content, calls, finish_reason); every chunk says
    something (no empty deltas)."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        assert delta.content or delta.tool_calls or delta.role or choice.finish_reason, chunk
        content += delta.content or ""
        calls += [(tc.function.name, tc.function.arguments) for tc in delta.tool_calls or ()]
        finish = choice.finish_reason or finish
    return content or None, calls, finish


@pytest.mark.parametrize("max_tokens", [200, 14])  # 14: max_tokens cuts the first call
def test_streamed_tool_calls_assemble_to_exactly_the_whole_reply(client, max_tokens):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}],
            "tools": [WEATHER, ADD], "tool_choice": "required", "max_tokens": max_tokens}
    most_calls = 0
    for seed in range(6):
        whole = client.chat.completions.create(seed=seed, **body).choices[0]
        calls = [(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls or ()]
        assert assembled_chat_stream(client, seed=seed, **body) == (whole.message.content or None, calls,
                                                                    whole.finish_reason)
        assert "<tool_call" not in (whole.message.content or "") and "</tool_call" not in (whole.message.content or "")
        most_calls = max(most_calls, len(calls))
        if max_tokens == 14:
            assert whole.finish_reason == "length" and not calls
    if max_tokens == 200:
        assert most_calls >= 2  # parallel calls were among them: what lies between them is not content


def test_streamed_responses_with_tools_have_the_whole_responses_items(client):
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **ADD["function"]}]
    body = {"model": MODEL, "input": "Weather in Paris, and 2 + 3?", "tools": tools, "tool_choice": "required",
            "max_output_tokens": 200}

    def items(response) -> list:
        return [(o.type, o.name, o.arguments) if o.type == "function_call" else (o.type, o.content[0].text)
                for o in response.output]
    for seed in range(3):
        whole = client.responses.create(extra_body={"seed": seed}, **body)
        with client.responses.stream(extra_body={"seed": seed}, **body) as s:
            for _ in s:
                pass
            streamed = s.get_final_response()
        assert items(streamed) == items(whole) and all(kind == "function_call" for kind, *_ in items(whole))


def test_tools_and_their_results_are_in_the_prompt(service):
    """The documented prompt format, read back through /tokenize with messages."""
    history = [{"role": "user", "content": "2 + 3?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = httpx.post(service.url + "/tokenize", json={"messages": history, "return_token_strs": True})
    text = "".join(r.json()["token_strs"])
    assert text == ('User: 2 + 3?\n\nAssistant: <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                    '</tool_call>\n\nTool: 5\n\nAssistant:')


def test_langchain_structured_output_and_tool_round_trip(service):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=service.url + "/v1", api_key="none", max_retries=0,
                                      max_tokens=200, seed=9, temperature=1.0)
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("A pet, please")
    assert isinstance(pet, Pet)

    @tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Add two numbers."""
        return a + b
    bound = llm.bind_tools([add], tool_choice="required")
    for streaming in (False, True):
        messages = [HumanMessage("What is 2 + 3?")]
        if streaming:
            reply = None
            for chunk in bound.stream(messages):
                reply = chunk if reply is None else reply + chunk
        else:
            reply = bound.invoke(messages)
        assert reply.tool_calls and reply.tool_calls[0]["name"] == "add", reply
        args = reply.tool_calls[0]["args"]
        assert set(args) == {"a", "b"}
        messages += [reply, ToolMessage(str(add.invoke(args)), tool_call_id=reply.tool_calls[0]["id"])]
        answer = llm.bind_tools([add], tool_choice="none").invoke(messages)
        assert answer.content and not answer.tool_calls


# -- tokenizer endpoints and scoring ---------------------------------------------------------------------------

def test_tokenize_and_detokenize_match_the_official_tokenizer(service):
    oracle = official.TRIE_TOKENIZER(str(OFFICIAL_VOCAB))
    for text in ("Hello, world!", "naïve café — 東京 👍🏽\n\n\tdef f(): return 1", ""):
        r = httpx.post(service.url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False,
                                                       "return_token_strs": True}).json()
        assert r["tokens"] == oracle.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
        assert len(r["token_strs"]) == r["count"]  # a token holding part of a character shows U+FFFD for it
        if text.isascii():
            assert "".join(r["token_strs"]) == text
        back = httpx.post(service.url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
        assert back == {"prompt": text}
    bad = httpx.post(service.url + "/detokenize", json={"tokens": [70000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(service.url + "/tokenize", json={}).status_code == 400


def test_tokenizer_info_chat_template_renders_what_chat_completions_renders(service):
    jinja2 = pytest.importorskip("jinja2")
    info = httpx.get(service.url + "/tokenizer_info").json()
    assert "eos_token" in info and info["eos_token_id"] == 0 and info["vocab_size"] == 65536
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(messages=messages,
                                                                               add_generation_prompt=True)
    served = httpx.post(service.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert official.TRIE_TOKENIZER(str(OFFICIAL_VOCAB)).encode(rendered) == served


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(service, stream):
    body = {"model": MODEL, "prompt": "The goose walked to the river", "max_tokens": 1, "echo": True,
            "logprobs": 2, "temperature": 0}
    reference = httpx.post(service.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    r = httpx.post(service.url + "/v1/completions", json={**body, "max_tokens": 0, "stream": stream,
                                                          "stream_options": {"include_usage": True} if stream else None},
                   timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [e for e in sse_data(r) if e != "[DONE]"]
        choice, usage = events[0]["choices"][0], events[-1]["usage"]
    else:
        choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == body["prompt"] and choice["finish_reason"] == "length"
    n = len(choice["logprobs"]["tokens"])
    assert choice["logprobs"]["token_logprobs"] == reference["logprobs"]["token_logprobs"][:n]
    assert choice["logprobs"]["token_logprobs"][0] is None and n == usage["prompt_tokens"]
    assert usage["completion_tokens"] == 0
    no_echo = httpx.post(service.url + "/v1/completions", json={**body, "max_tokens": 0, "echo": False})
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"


# -- nothing silently ignored ---------------------------------------------------------------------------------

CHAT_FIELDS = [("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
               ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
               ("functions", [{"name": "f"}]), ("function_call", "auto"), ("reasoning_effort", "high"),
               ("verbosity", "high"), ("store", True), ("service_tier", "flex")]
COMPLETION_FIELDS = [("suffix", "the end"), ("best_of", 3)]


@pytest.mark.parametrize("field, value", CHAT_FIELDS)
def test_each_unimplemented_chat_field_is_a_400_naming_it(service, field, value):
    if field == "web_search_options":
        value = {"search_context_size": "low"}
    r = httpx.post(service.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"] and error["code"] == "unsupported_field"


@pytest.mark.parametrize("field, value", COMPLETION_FIELDS)
def test_each_unimplemented_completions_field_is_a_400_naming_it(service, field, value):
    r = httpx.post(service.url + "/v1/completions", json={"model": MODEL, "prompt": "x", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_defaults_and_nulls_of_those_fields_are_accepted_and_unknown_fields_logged_once(service):
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "x", "refusal": None, "audio": None}],
          "max_tokens": 2, "modalities": ["text"], "store": False, "service_tier": "auto", "audio": None,
          "metadata": {"k": "v"}, "user": "u", "frobnicate_level": 3}
    for _ in range(2):
        r = httpx.post(service.url + "/v1/chat/completions", json=ok, timeout=60)
        assert r.status_code == 200, r.text
    done = httpx.post(service.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                             "best_of": 1, "suffix": None}, timeout=60)
    assert done.status_code == 200, done.text
    lines = [line for line in service.log(10**7).splitlines() if "frobnicate_level" in line]
    assert len(lines) == 1 and "not in the API" in lines[0]


# -- the Responses API ----------------------------------------------------------------------------------------

def test_responses_create_with_text_and_with_a_json_schema(client):
    done = client.responses.create(model=MODEL, input="Say something", instructions="Be brief.",
                                   max_output_tokens=12, temperature=0.0)
    assert done.object == "response" and done.id.startswith("resp_") and done.store is True
    assert done.output[0].type == "message" and done.output_text
    assert done.usage.output_tokens <= 12 and done.usage.input_tokens > 0
    assert done.status in ("completed", "incomplete")
    if done.status == "incomplete":
        assert done.incomplete_details.reason == "max_output_tokens"
    same = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}])
    assert done.output_text == same.choices[0].message.content  # one prompt format, one answer
    parsed = client.responses.parse(model=MODEL, input="A pet", text_format=Pet, max_output_tokens=200, extra_body={"seed": 11})
    assert isinstance(parsed.output_parsed, Pet)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    raw = client.responses.create(model=MODEL, input="A number", max_output_tokens=40, extra_body={"seed": 12}, text={
        "format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(raw.output_text), schema)


def test_responses_stream_with_text_and_with_a_json_schema(client):
    with client.responses.stream(model=MODEL, input="Say something", max_output_tokens=10, temperature=0.0) as s:
        events = list(s)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    last = events[-1]  # cut at max_output_tokens: incomplete, as OpenAI ends such a stream
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = client.responses.create(model=MODEL, input="Say something", max_output_tokens=10, temperature=0.0)
    assert deltas == last.response.output_text == whole.output_text and deltas
    with client.responses.stream(model=MODEL, input="A pet", text_format=Pet, max_output_tokens=200,
                                 extra_body={"seed": 13}) as s:
        for _ in s:
            pass
        pet = s.get_final_response().output_parsed
    assert isinstance(pet, Pet)


def test_responses_function_tools_round_trip(client):
    tools = [{"type": "function", "name": "add", "description": "Add two numbers",
              "parameters": ADD["function"]["parameters"]}]
    first = client.responses.create(model=MODEL, input="2 + 3?", tools=tools, tool_choice="required", extra_body={"seed": 14},
                                    max_output_tokens=200)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "add" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), ADD["function"]["parameters"])
    with client.responses.stream(model=MODEL, input="2 + 3?", tools=tools, tool_choice="required", extra_body={"seed": 14},
                                 max_output_tokens=200) as s:
        for _ in s:
            pass
        streamed = [o for o in s.get_final_response().output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    follow = client.responses.create(model=MODEL, tools=tools, tool_choice="none", max_output_tokens=8, input=[
        {"role": "user", "content": "2 + 3?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "add", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}])
    assert follow.output_text


@pytest.mark.parametrize("field, value", [("background", True), ("include", ["reasoning.encrypted_content"]),
                                          ("reasoning", {"effort": "high"}), ("truncation", "auto")])
def test_responses_fields_without_stored_state_are_400(service, field, value):
    r = httpx.post(service.url + "/v1/responses", json={"model": MODEL, "input": "x", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


LONG_QUESTION = "Tell me everything you know about foxes, their dens, their food and their cubs. " * 3


def test_a_conversation_continues_from_its_previous_response(client):
    first = client.responses.create(model=MODEL, input=LONG_QUESTION, max_output_tokens=8, temperature=0.0)
    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text and fetched.store is True
    second = client.responses.create(model=MODEL, input="And wolves?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0.0)
    resent = client.responses.create(model=MODEL, store=False, max_output_tokens=8, temperature=0.0, input=[
        {"role": "user", "content": LONG_QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And wolves?"}])
    assert second.previous_response_id == first.id
    assert second.output_text == resent.output_text and second.usage.input_tokens == resent.usage.input_tokens
    # the history came from the worker's prefix cache: at least the whole first prompt
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # store false: nothing to continue from
        client.responses.create(model=MODEL, input="x", previous_response_id=resent.id, max_output_tokens=2)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_an_unknown_previous_response_is_a_404_naming_the_field(service):
    r = httpx.post(service.url + "/v1/responses", json={"model": MODEL, "input": "x",
                                                          "previous_response_id": "resp_nothing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "response_not_found"


def test_an_unknown_model_is_a_404_and_the_served_name_and_aliases_answer(client, service):
    for call in (lambda m: client.completions.create(model=m, prompt="Hi", max_tokens=2),
                 lambda m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}],
                                                          max_tokens=2),
                 lambda m: client.responses.create(model=m, input="Hi", max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError) as e:
            call("gpt-4o")
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        assert "gpt-4o" in e.value.body["message"]
        for name in (MODEL, "rwkv-7"):
            call(name)
    listed = [m.id for m in client.models.list()]
    assert listed == [MODEL, "rwkv-7"]
    assert client.models.retrieve("rwkv-7").id == "rwkv-7"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    async_request = httpx.post(service.url + "/v1/requests", json={"endpoint": "completions", "model": "gpt-4o",
                                                                   "prompt": "Hi", "max_tokens": 2})
    assert async_request.status_code == 404 and async_request.json()["error"]["code"] == "model_not_found"


def test_the_served_chats_benchmark_resumes_conversations_from_the_cache(service, capsys):
    """benchmarks/served_chats against this service: both APIs run every turn, and from turn 2 on part of each
    prompt comes from the prefix cache (the previous turn's state: its prompt is past the 32-token minimum),
    through previous_response_id and through re-sent history."""
    from benchmarks.served_chats import main
    assert main(["--base-url", service.url, "--chats", "2", "--turns", "3", "--turn-in", "40", "--turn-out", "4",
                 "--out", "-"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    turns = {(r[0].strip(), int(r[1])): float(r[5]) for r in rows if len(r) == 6 and r[1].strip().isdigit()}
    assert set(turns) == {(api, t) for api in ("responses", "chat") for t in (1, 2, 3)}
    assert all(turns[(api, t)] > 0 for api in ("responses", "chat") for t in (2, 3)), turns

"""The served run: requests as bodies built up front, sent by client processes on one shared clock.

Each process is one asyncio loop over ``http.Pool``. Without ``--max-concurrency`` the requests are dealt
round-robin and each process sends its own at their arrival times (an open loop). With it, the processes
hold that many slots between them and take the next request from a shared counter, so the whole run keeps
vLLM's semantics (a request goes at its arrival time or when a slot frees up, in order); each process then
holds every body. The SSE stream is parsed by hand: a chunk is only searched for ``"choices"``,
``"usage"`` and ``"error"``; one JSON parse per request reads the usage.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import orjson

from benchmarks.loadgen.dataset import BenchRequest
from benchmarks.loadgen.http import Endpoint, Pool, Response, get_json_bytes
from benchmarks.loadgen.metrics import RequestRecord

START_DELAY_S = 0.05  # between telling the processes when to start and the start itself
WHITESPACE = b" \t\r\n"


def build_body(req: BenchRequest, model: str, is_chat: bool, sampling: dict, is_stream: bool) -> bytes:
    """The JSON a request sends: ``max_completion_tokens`` for chat, ``max_tokens`` for completions (as vLLM)."""
    body: dict = {"model": model}
    if is_chat:
        body["messages"] = req.prompt
        body["max_completion_tokens"] = req.max_tokens
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.max_tokens
    body.update(sampling)
    body["stream"] = is_stream
    if is_stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(base_url: str, api_key: str | None) -> str:
    """The first id of GET /v1/models (vLLM's default for --model)."""
    status, body = await get_json_bytes(base_url.rstrip("/") + "/v1/models", auth_headers(api_key))
    if status != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {status}: {body[:300].decode(errors='replace')}")
    data = orjson.loads(body).get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models listed no model; pass --model")
    return data[0]["id"]


# -- one request --------------------------------------------------------------------------------

def _value_byte(payload: bytes, key: bytes) -> int:
    """The first byte of ``key``'s value in a JSON object, or -1: enough to tell ``[]``, ``null``, ``{``."""
    i = payload.find(key)
    if i < 0:
        return -1
    i = payload.find(b":", i + len(key)) + 1
    while 0 < i < len(payload) and payload[i] in WHITESPACE:
        i += 1
    return payload[i] if 0 < i < len(payload) else -1


def _has_choices(payload: bytes) -> bool:
    """A token-bearing chunk: a non-empty ``choices`` array (vLLM counts these for TTFT and ITL)."""
    if _value_byte(payload, b'"choices"') != ord("["):
        return False
    i = payload.find(b"[", payload.find(b'"choices"')) + 1
    while i < len(payload) and payload[i] in WHITESPACE:
        i += 1
    return i < len(payload) and payload[i] != ord("]")


def _error_message(payload: bytes) -> str:
    try:
        err = orjson.loads(payload).get("error")
        return f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
    except orjson.JSONDecodeError:
        return f"stream error: {payload[:300].decode(errors='replace')}"


async def _read_stream(response: Response, record: RequestRecord, sent: float) -> None:
    buf, last, num_chunks, usage = b"", None, 0, None
    while (piece := await response.next_piece()) is not None:
        now = time.monotonic()
        buf += piece
        if b"\r" in buf:  # CRLF events; buf holds only an unfinished event, so this stays cheap
            buf = buf.replace(b"\r\n", b"\n")
        while (cut := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:cut], buf[cut + 2:]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments (keep-alives), event names
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                if _has_choices(payload):
                    if last is None:
                        record.ttft = now - sent
                        record.request_id = orjson.loads(payload).get("id")
                    else:
                        record.itl.append(now - last)
                    last, num_chunks = now, num_chunks + 1
                elif _value_byte(payload, b'"error"') == ord("{"):
                    record.error = _error_message(payload)
                if _value_byte(payload, b'"usage"') == ord("{"):
                    usage = orjson.loads(payload)["usage"]
    if record.error is None and last is None:
        record.error = "the stream ended without a token"
    if record.error is None:
        record.is_success = True
        record.e2e = last - sent
        record.output_tokens = (usage or {}).get("completion_tokens") or num_chunks
        record.prompt_tokens = (usage or {}).get("prompt_tokens") or record.prompt_tokens
        record.cached_tokens = cached_tokens(usage)


async def _read_whole(response: Response, record: RequestRecord, sent: float) -> None:
    body = await response.read_body()
    record.e2e = time.monotonic() - sent
    usage = orjson.loads(body).get("usage") or {}
    record.is_success = True
    record.output_tokens = usage.get("completion_tokens", 0)
    record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
    record.cached_tokens = cached_tokens(usage)


def cached_tokens(usage: dict | None) -> int:
    """Prompt tokens the server reports as cached (OpenAI's usage.prompt_tokens_details; 0 where absent)."""
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def send_one(pool: Pool, head: bytes, body: bytes, is_stream: bool, record: RequestRecord, t0: float,
                   timeout_s: float) -> None:
    """One request into ``record``; every failure (HTTP status, stream error, exception, timeout) is kept
    as its message, never raised."""
    sent, record.sent_wall = time.monotonic(), time.time()
    record.start = sent - t0
    response: Response | None = None

    async def go() -> None:
        nonlocal response
        response = await pool.send(head, body)
        if response.status != 200:
            text = await response.read_body()
            record.error = f"HTTP {response.status}: {text[:300].decode(errors='replace')}"
        elif is_stream:
            await _read_stream(response, record, sent)
        else:
            await _read_whole(response, record, sent)

    try:
        await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"no complete response within --timeout ({timeout_s:g} s)"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, counted and reported
        record.error = f"{type(e).__name__}: {e}"
    if record.error is not None:
        record.is_success = False
    if response is not None:
        pool.release(response)  # closes it unless complete and reusable
    record.end = time.monotonic() - t0


# -- one process --------------------------------------------------------------------------------

@dataclass
class Shard:
    """What one client process sends: ``bodies`` by request index (all of them with a shared counter)."""
    url: str
    head: bytes
    bodies: dict[int, bytes]
    prompt_lens: dict[int, int | None]
    arrivals: list[float]
    is_stream: bool
    timeout_s: float
    num_slots: int = 0  # > 0: closed loop over the shared counter
    counter: object = None  # multiprocessing.Value: the next request index to take


async def run_shard(shard: Shard, t0: float) -> tuple[list[RequestRecord], int]:
    """The shard's records and how many connections it opened (keep-alive at work: far fewer than requests)."""
    pool = Pool(Endpoint.parse(shard.url))
    records: list[RequestRecord] = []

    async def one(i: int) -> None:
        record = RequestRecord(i, prompt_tokens=shard.prompt_lens[i] or 0)
        records.append(record)
        delay = t0 + shard.arrivals[i] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await send_one(pool, shard.head, shard.bodies[i], shard.is_stream, record, t0, shard.timeout_s)

    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    if shard.num_slots:
        async def slot() -> None:
            while (i := _claim(shard.counter)) < len(shard.arrivals):
                await one(i)
        await asyncio.gather(*(slot() for _ in range(shard.num_slots)))
    else:
        tasks = []
        for i in sorted(shard.bodies, key=shard.arrivals.__getitem__):
            delay = t0 + shard.arrivals[i] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    pool.close()
    return records, pool.num_opened


def _claim(counter) -> int:
    with counter.get_lock():
        i = counter.value
        counter.value = i + 1
    return i


def client_process(conn, shard: Shard) -> None:
    """A client process: say ready, wait for the start time, run, send back records and own CPU use."""
    _raise_fd_limit()
    conn.send("ready")
    t0 = conn.recv()
    cpu0 = time.process_time()
    records, num_connections = asyncio.run(run_shard(shard, t0))
    conn.send((records, {"cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - t0,
                         "connections": num_connections}))
    conn.close()


def _raise_fd_limit() -> None:
    """One socket per request in flight: an open loop at a high rate needs more than the usual 1,024."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


# -- the processes together --------------------------------------------------------------------

@dataclass
class ClientRun:
    records: list[RequestRecord]
    duration_s: float
    client: dict  # {"per_process": [{"cpu_s", "wall_s", "connections"}], "cpu_s", "wall_s", "cpu_per_wall"}


def run_clients(url: str, head: bytes, bodies: list[bytes], prompt_lens: list[int | None], arrivals: list[float],
                is_stream: bool, timeout_s: float, num_processes: int,
                max_concurrency: int | None) -> ClientRun:
    """Start the client processes, start them together, gather what they measured."""
    n = len(bodies)
    num_processes = max(1, min(num_processes, n, max_concurrency or n))
    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of the parent's threads or loop
    counter = ctx.Value("q", 0) if max_concurrency else None
    shards = []
    for p in range(num_processes):
        if max_concurrency:
            mine = range(n)
            slots = max_concurrency // num_processes + (p < max_concurrency % num_processes)
        else:
            mine, slots = range(p, n, num_processes), 0
        shards.append(Shard(url, head, {i: bodies[i] for i in mine}, {i: prompt_lens[i] for i in mine}, arrivals,
                            is_stream, timeout_s, slots, counter))
    procs, conns = [], []
    for shard in shards:
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=client_process, args=(child_end, shard), daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    try:
        for conn in conns:
            if conn.recv() != "ready":
                raise RuntimeError("a client process did not start")
        t0 = time.monotonic() + START_DELAY_S
        for conn in conns:
            conn.send(t0)
        results = [conn.recv() for conn in conns]
    except EOFError:
        raise RuntimeError("a client process died; its error is above") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    records = sorted((r for rs, _ in results for r in rs), key=lambda r: r.index)
    per_process = [stats for _, stats in results]
    cpu, wall = sum(p["cpu_s"] for p in per_process), max(p["wall_s"] for p in per_process)
    client = {"per_process": per_process, "cpu_s": cpu, "wall_s": wall, "cpu_per_wall": cpu / max(wall, 1e-9),
              "cpu_count": os.cpu_count()}
    return ClientRun(records, max(r.end for r in records), client)

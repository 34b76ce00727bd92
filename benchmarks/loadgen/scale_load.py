"""The load of ``python -m benchmarks.scale``: processes that stand in for API processes on Redis (``drive``) and
clients that post async requests (``accept_client``). Each runs in a process of its own and reports through a
multiprocessing queue."""

from __future__ import annotations

import socket
import time

import redis

from worker import contract as c

PROMPT = [510, 4325, 8213, 3319, 4600, 261, 1417, 33, 2133, 3728, 4810, 4600, 22590, 33, 11, 5216]
DELTA_MARK, FINAL_MARK = b'"type":"delta"', b'"type":"final"'


# -- a driver process: what an API process does on Redis ------------------------------------------------------

def drive(port: int, name: str, concurrency: int, output_len: int, window: tuple[float, float], stop_at: float,
          shared: bool, report) -> None:
    """Keep ``concurrency`` streaming requests in flight until ``stop_at``; report what arrived in ``window``
    (wall-clock times). ``shared``: as the API does, one reply channel for all (subscribed once, messages routed
    by request id); else a channel per request, subscribed before and unsubscribed after it."""
    import hiredis
    import orjson

    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.05)
    cmd = redis.Redis(port=port)
    reader = hiredis.Reader()
    reply = c.reply_channel(f"scale-{name}").encode() if shared else None
    t_from, t_to = window
    serial = 0
    submitted: dict[str, float] = {}  # request id -> enqueue time
    last: dict[str, float] = {}
    awaiting: set[bytes] = set()  # subscribed, confirmation not yet back
    ttft, gaps, tokens, deltas, finals, publishes = [], [], 0, 0, 0, 0
    cpu0 = None

    def new_ids(k: int) -> list[str]:
        nonlocal serial
        serial += k
        return [f"{name}-{i}" for i in range(serial - k + 1, serial + 1)]

    def subscribe(rids: list[str]) -> None:
        channels = [c.out_channel(rid).encode() for rid in rids]
        awaiting.update(channels)
        sock.sendall(hiredis.pack_command(("SUBSCRIBE", *channels)))

    def enqueue(rids: list[str]) -> None:
        pipe = cmd.pipeline(transaction=False)
        now = time.time()
        for rid in rids:
            c.QueuedRequest(id=rid, prompt_token_ids=PROMPT, stream=True, reply_to=reply.decode() if shared else "",
                            params={"max_tokens": output_len, "ignore_eos": True, "temperature": 1.0}).enqueue(pipe)
            submitted[rid] = now
        pipe.execute()

    def start(k: int) -> None:
        (enqueue if shared else subscribe)(new_ids(k))

    if shared:
        awaiting.add(reply)
        sock.sendall(hiredis.pack_command(("SUBSCRIBE", reply)))
    else:
        start(concurrency)
    while time.time() < stop_at:
        if cpu0 is None and time.time() >= t_from:
            cpu0 = time.process_time()
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            continue
        if not data:
            break
        reader.feed(data)
        now = time.time()
        confirmed, done = [], []
        in_window = t_from <= now < t_to
        while (msg := reader.gets()) is not False:
            kind, channel = msg[0], msg[1]
            if kind == b"subscribe":
                if channel in awaiting:
                    awaiting.discard(channel)
                    confirmed.append(channel)
                continue
            if kind != b"message":
                continue
            publishes += in_window
            for payload in (c.split_messages(msg[2]) if shared else (msg[2],)):
                head = payload[:40]
                if DELTA_MARK in head:
                    body = orjson.loads(payload)
                    rid, n = body["id"], sum(len(ch["token_ids"]) for ch in body["choices"])
                    if in_window:
                        tokens += n
                        deltas += 1
                        if rid in last:
                            gaps.append(now - last[rid])
                        elif submitted.get(rid, 0) >= t_from:
                            ttft.append(now - submitted[rid])
                    last[rid] = now
                elif FINAL_MARK in head:
                    done.append(orjson.loads(payload)["id"])
                    finals += in_window
        if shared and reply in confirmed:
            start(concurrency)
        elif confirmed:
            enqueue([ch.decode()[len(c.out_channel("")):] for ch in confirmed])
        if done:
            if not shared:
                sock.sendall(hiredis.pack_command(("UNSUBSCRIBE", *[c.out_channel(rid) for rid in done])))
            for rid in done:
                submitted.pop(rid, None), last.pop(rid, None)
            if now < t_to:
                start(len(done))
    cpu = time.process_time() - (cpu0 if cpu0 is not None else time.process_time())
    report.put({"tokens": tokens, "deltas": deltas, "finals": finals, "publishes": publishes, "ttft": ttft,
                "gaps": gaps, "cpu_s": cpu})


def accept_client(url: str, concurrency: int, until: float, report) -> None:
    """POST /v1/requests (async: the API queues it and answers 202) from ``concurrency`` keep-alive connections
    until ``until``; report each answer's status and latency."""
    import asyncio

    from benchmarks.loadgen.http import Endpoint, Pool

    async def main() -> None:
        endpoint = Endpoint.parse(url + "/v1/requests")
        pool = Pool(endpoint)
        head = endpoint.request_head("POST", {"Content-Type": "application/json"})
        statuses: dict[int, int] = {}
        latencies: list[float] = []
        cpu0 = time.process_time()

        async def loop(k: int) -> None:
            i = 0
            while time.time() < until:
                i += 1
                body = b'{"endpoint":"completions","prompt":"The goose %d-%d walked along the river","max_tokens":8}' % (k, i)
                t = time.perf_counter()
                response = await pool.send(head, body)
                await response.read_body()
                pool.release(response)
                latencies.append(time.perf_counter() - t)
                statuses[response.status] = statuses.get(response.status, 0) + 1

        await asyncio.gather(*[loop(k) for k in range(concurrency)])
        pool.close()
        report.put({"statuses": statuses, "latencies": latencies, "cpu_s": time.process_time() - cpu0})

    asyncio.run(main())

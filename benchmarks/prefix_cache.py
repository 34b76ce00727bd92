"""The prompt-prefix cache, in one engine process, cache on against cache off on the same workloads:

- shared: ``--lines`` prompts that share a ``--shared`` token instruction and differ in ``--unique`` tokens, all
  queued at once (a bulk job), ``--output`` tokens each: prompt tokens computed, wall time;
- chats: ``--chats`` conversations of ``--turns`` turns (``--turn-in`` new tokens, ``--turn-out`` out), each turn
  re-sending its whole history: time to first token of turn 2 and of the last turn;
- random: the shared workload's sizes with nothing shared: wall time (what the cache costs where it cannot help);
- shared tier: engine A serves two prompts on a ``--tier-prefix`` token prefix (its state goes to Redis) and then a
  third from its own checkpoint of the prefix; engine B, which never saw it, serves the third from Redis: B's time
  to first token against a cold engine's, whether its tokens are exactly A's (the same state, moved through
  Redis), and whether its first token is the cold run's (greedy).

Random token ids, greedy, ignore_eos. Prints tables; ``--out`` puts them in BENCHMARKS.md (area ``prefix-cache``).

    python -m benchmarks.prefix_cache --model 1.5b.pth
    python -m benchmarks.prefix_cache --model demo --device cpu --lines 16 --shared 200 --chats 2 --turns 4   # smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from benchmarks.report import command_line, markdown_table, publish


def release(engine) -> None:
    """An engine's device memory back before the next one is built."""
    import gc

    import torch
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_token_and_tokens(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One prompt alone (greedy): seconds to its first token, and its tokens."""
    wall, first, _ = run(engine, {rid: prompt}, max_tokens, keep := {})
    return first[rid], keep[rid]


def shared_tier(args, reference: tuple[float, list[int]], prompts: list[list[int]]) -> dict:
    """Engine A on ``prompts[:2]`` (their common prefix is written to Redis), then engine B on ``prompts[2]``.
    A also serves ``prompts[2]`` from its own device checkpoint of that prefix: B, resuming from the same state
    taken from Redis, must give exactly A's tokens. Against the cold run (``reference``: prefilled from token 0,
    so split elsewhere and its GEMMs of other shapes) only the first token is compared: later greedy tokens of
    random weights can part on a last-bit difference."""
    import tempfile

    from worker.redis_server import RedisServer
    from worker.shared_states import SharedStates, SharedStatesConfig
    server = RedisServer(tempfile.mkdtemp(prefix="gaggle-bench-redis-"), appendonly=False).start()
    try:
        cfg = SharedStatesConfig(server.url, 2 << 30, min_tokens=256)
        a = make_engine(args, cache_on=True)
        shared_a = SharedStates.for_engine(a, cfg)
        for i, p in enumerate(prompts[:2]):
            first_token_and_tokens(a, f"a{i}", p, 4)
        shared_a.flush(30)
        published = shared_a.stats.bytes_published
        _, local = first_token_and_tokens(a, "a2", prompts[2], len(reference[1]))
        shared_a.close()
        release(a)
        b = make_engine(args, cache_on=True)
        shared_b = SharedStates.for_engine(b, cfg)
        t0 = time.perf_counter()
        future = shared_b.lookup_request(prompts[2], None)
        taken = shared_b.take(prompts[2], None, future.result() if future is not None else None)
        fetch_s = time.perf_counter() - t0
        ttft, toks = first_token_and_tokens(b, "b", prompts[2], len(reference[1]))
        stats = shared_b.stats
        shared_b.close()
        release(b)
    finally:
        server.stop()
    return {"taken": taken, "fetch_ms": 1e3 * fetch_s, "ttft_ms": 1e3 * (fetch_s + ttft),
            "cold_ttft_ms": 1e3 * reference[0], "same_as_local": toks == local,
            "first_as_cold": toks[:1] == reference[1][:1], "bytes": stats.bytes_fetched, "published": published}


def make_engine(args, cache_on: bool):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    cfg = EngineConfig(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                       prefix_cache_gib=args.cache_gib if cache_on else 0.0)
    engine = LLMEngine(cfg)
    if args.device != "cpu":
        engine.warm_up()
    return engine


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 65530) for _ in range(n)]


def run(engine, prompts: dict[str, list[int]], max_tokens: int,
        tokens_out: dict[str, list[int]] | None = None) -> tuple[float, dict[str, float], int]:
    """All ``prompts`` queued at once, stepped to the end: wall seconds, each one's time to its first token, and
    the prompt tokens it took from the cache (``tokens_out``: each one's tokens, where given)."""
    from engine.params import SamplingParams
    from engine.sequence import Request
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for rid, prompt in prompts.items():
        engine.add(Request(rid, prompt, params))
    first: dict[str, float] = {}
    cached = 0
    while engine.has_work():
        for out in engine.step():
            if out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
                cached += out.num_cached_tokens
            if tokens_out is not None:
                tokens_out.setdefault(out.request_id, []).extend(out.token_ids)
    return time.perf_counter() - t0, first, cached


def shared_workload(args, engine, rng: random.Random, share: bool) -> dict:
    instruction = rand_tokens(rng, args.shared)
    prompts = {f"s{i}": (instruction if share else rand_tokens(rng, args.shared)) + rand_tokens(rng, args.unique)
               for i in range(args.lines)}
    sent = sum(map(len, prompts.values()))
    wall, _, cached = run(engine, prompts, args.output)
    return {"wall_s": wall, "sent": sent, "computed": sent - cached,
            "unique": args.shared + args.lines * args.unique if share else sent}


def chat_workload(args, engine, rng: random.Random) -> dict:
    histories = {f"c{i}": [] for i in range(args.chats)}
    ttft: dict[int, list[float]] = {}
    for turn in range(1, args.turns + 1):
        prompts = {f"{cid}-t{turn}": h + rand_tokens(rng, args.turn_in) for cid, h in histories.items()}
        start = time.perf_counter()
        outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
        from engine.params import SamplingParams
        from engine.sequence import Request
        for rid, p in prompts.items():
            engine.add(Request(rid, p, SamplingParams(max_tokens=args.turn_out, temperature=0.0, ignore_eos=True)))
        firsts = []
        while engine.has_work():
            for out in engine.step():
                if not outputs[out.request_id]:
                    firsts.append(time.perf_counter() - start)
                outputs[out.request_id] += out.token_ids
        ttft[turn] = firsts
        for cid in histories:
            rid = f"{cid}-t{turn}"
            histories[cid] = prompts[rid] + outputs[rid]
    return {"ttft_p50_ms": {t: 1e3 * statistics.median(v) for t, v in ttft.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a .pth (or 'demo': the 2-layer demo model, written if missing)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cache-gib", type=float, default=2.0)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--shared", type=int, default=1000)
    p.add_argument("--unique", type=int, default=50)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--turn-in", type=int, default=100)
    p.add_argument("--turn-out", type=int, default=100)
    p.add_argument("--tier-prefix", type=int, default=2000, help="the shared tier's prefix, tokens (0: skip it)")
    p.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    args = p.parse_args(argv)
    if args.model == "demo":
        from pathlib import Path

        from engine.args import ensure_demo_model
        args.model = str(ensure_demo_model(Path(".gaggle")))
    rows_shared, rows_chat, rows_random = [], [], []
    results = {}
    rng = random.Random(4)
    tier_prefix = rand_tokens(rng, args.tier_prefix)
    tier_prompts = [tier_prefix + rand_tokens(rng, 50) for _ in range(3)]
    reference = None
    for cache_on in (False, True):
        engine = make_engine(args, cache_on)
        label = "cache on" if cache_on else "cache off"
        if not cache_on and args.tier_prefix:
            first_token_and_tokens(engine, "warm", tier_prompts[0], 2)
            reference = first_token_and_tokens(engine, "cold", tier_prompts[2], 32)
        results[label] = {"shared": shared_workload(args, engine, random.Random(1), share=True),
                          "random": shared_workload(args, engine, random.Random(2), share=False),
                          "chat": chat_workload(args, engine, random.Random(3))}
        release(engine)
    tier = shared_tier(args, reference, tier_prompts) if args.tier_prefix else None
    off, on = results["cache off"], results["cache on"]
    for label, r in results.items():
        s = r["shared"]
        rows_shared.append([label, f"{s['sent']:,}", f"{s['computed']:,}", f"{s['computed'] / s['unique']:.2f}",
                            f"{s['wall_s']:.2f}", f"{off['shared']['wall_s'] / s['wall_s']:.2f}"])
        t = r["chat"]["ttft_p50_ms"]
        rows_chat.append([label, f"{t[2]:.1f}" if 2 in t else "–", f"{t[args.turns]:.1f}",
                          f"{t[args.turns] / t[2]:.2f}" if 2 in t else "–"])
        rows_random.append([label, f"{r['random']['wall_s']:.2f}", f"{off['random']['wall_s'] / r['random']['wall_s']:.3f}"])
    body = (f"Shared instruction: {args.lines:,} prompts of {args.shared:,} shared + {args.unique} unique tokens, "
            f"{args.output} out, all queued at once\n\n"
            + markdown_table(["", "prompt tokens sent", "computed", "computed / unique", "wall s", "speed-up"],
                             rows_shared)
            + f"\nChats: {args.chats} conversations × {args.turns} turns ({args.turn_in} tokens in, {args.turn_out} "
              "out), each turn re-sending its history: time to first token, p50 (ms)\n\n"
            + markdown_table(["", "turn 2", f"turn {args.turns}", f"turn {args.turns} / turn 2"], rows_chat)
            + f"\nNothing shared: {args.lines:,} random prompts of {args.shared + args.unique:,} tokens\n\n"
            + markdown_table(["", "wall s", "speed vs cache off"], rows_random))
    if tier is not None:
        body += (f"\nShared tier (Redis, same host): engine A serves two prompts on a {args.tier_prefix:,}-token prefix; "
                 "engine B, which never saw it, serves a third (50 new tokens, 32 out, greedy)\n\n"
                 + markdown_table(["", "prompt tokens from the shared tier", "state bytes fetched",
                                   "lookup + fetch ms", "time to first token ms",
                                   "tokens = A's from its own checkpoint", "first token = cold run"],
                                  [["engine B", f"{tier['taken']:,}", f"{tier['bytes']:,}", f"{tier['fetch_ms']:.1f}",
                                    f"{tier['ttft_ms']:.1f}", "yes" if tier["same_as_local"] else "no",
                                    "yes" if tier["first_as_cold"] else "no"],
                                   ["cold engine", "0", "–", "–", f"{tier['cold_ttft_ms']:.1f}", "–", "–"]]))
    publish("prefix-cache", command_line("benchmarks.prefix_cache", argv), body, args.out, title="Prefix cache")
    return 0 if on["shared"]["computed"] <= off["shared"]["computed"] else 1


if __name__ == "__main__":
    sys.exit(main())

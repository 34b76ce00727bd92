"""Multi-turn chats against a running service: does a turn's time to first token stay flat as its history grows?

``--chats`` conversations run at once, each ``--turns`` turns of about ``--turn-in`` new tokens in (random words)
and ``--turn-out`` tokens out, streamed. Each conversation goes on the way a client would:

- ``responses``: the Responses API with ``store`` and ``previous_response_id`` (the service keeps the history);
- ``chat``: chat completions re-sending the whole history each turn.

Per turn: time to first token p50 / p99 over the conversations, and the prompt tokens the service took from its
prefix cache (``usage``'s cached tokens) against those sent. Without a state cache a turn's first token waits for
its whole history's prefill, so the last turn's TTFT over the second's is the number to read.

    gaggle up --model 1.5b.pth &
    python -m benchmarks.served_chats --chats 64 --turns 20
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from benchmarks.loadgen.refill import percentile
from benchmarks.report import command_line, markdown_table, publish

WORDS = ("goose river stone light quiet market paper window garden number silver morning engine "
         "letter mountain orange pocket signal winter yellow basket candle dinner forest harbor island jacket "
         "kettle ladder meadow needle ocean pillow rabbit saddle ticket valley wagon").split()


@dataclass
class Turn:
    ttft: float
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)


def user_text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words (one token each in the World vocabulary, with their leading space)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def cached_of(usage) -> tuple[int, int]:
    if usage is None:
        return 0, 0
    prompt = getattr(usage, "prompt_tokens", None) or getattr(usage, "input_tokens", 0) or 0
    details = getattr(usage, "prompt_tokens_details", None) or getattr(usage, "input_tokens_details", None)
    return prompt, (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0


async def chat_turns(client, model: str, args, rng: random.Random) -> Conversation:
    conv, messages = Conversation(), []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": user_text(rng, args.turn_in)})
        t0 = time.perf_counter()
        first, text, usage = None, [], None
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.turn_out, temperature=1.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        messages.append({"role": "assistant", "content": "".join(text)})
        conv.turns.append(Turn(first if first is not None else time.perf_counter() - t0, *cached_of(usage)))
    return conv


async def responses_turns(client, model: str, args, rng: random.Random) -> Conversation:
    conv, previous = Conversation(), None
    for _ in range(args.turns):
        t0 = time.perf_counter()
        first, usage = None, None
        stream = await client.responses.create(
            model=model, input=user_text(rng, args.turn_in), max_output_tokens=args.turn_out, temperature=1.0,
            store=True, previous_response_id=previous, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta" and first is None:
                first = time.perf_counter() - t0
            elif event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                previous, usage = event.response.id, event.response.usage
        conv.turns.append(Turn(first if first is not None else time.perf_counter() - t0, *cached_of(usage)))
    return conv


async def run_mode(mode: str, args) -> list[Conversation]:
    import openai
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", max_retries=0,
                                timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    fn = responses_turns if mode == "responses" else chat_turns
    seed = 0 if mode == "responses" else 10**6  # each mode its own texts: no cache hits from the other's
    return await asyncio.gather(*(fn(client, model, args, random.Random(seed + i)) for i in range(args.chats)))


def mode_rows(mode: str, convs: list[Conversation], turns: int) -> list[list]:
    rows = []
    for t in sorted({1, 2, turns // 2, turns} - {0}):
        if t > turns:
            continue
        ttfts = [c.turns[t - 1].ttft * 1e3 for c in convs]
        sent = sum(c.turns[t - 1].prompt_tokens for c in convs)
        cached = sum(c.turns[t - 1].cached_tokens for c in convs)
        rows.append([mode, t, f"{statistics.median(ttfts):.1f}", f"{percentile(ttfts, 0.99):.1f}",
                     f"{sent / len(convs):,.0f}", f"{cached / max(1, sent):.2f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    from api.base_url import add_base_url_arg
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_base_url_arg(ap)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the first model the service lists")
    ap.add_argument("--chats", type=int, default=64)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--turn-in", type=int, default=100)
    ap.add_argument("--turn-out", type=int, default=100)
    ap.add_argument("--modes", default="responses,chat")
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    args = ap.parse_args(argv)
    from api.base_url import server_root
    args.base_url = server_root(args.base_url) + "/v1"
    rows, ratios = [], []
    for mode in args.modes.split(","):
        convs = asyncio.run(run_mode(mode, args))
        rows += mode_rows(mode, convs, args.turns)
        if args.turns >= 2:
            p50 = lambda t: statistics.median(c.turns[t - 1].ttft for c in convs)  # noqa: E731
            ratios.append([mode, f"{p50(args.turns) / p50(2):.2f}"])
    body = (f"{args.chats} conversations at once × {args.turns} turns (~{args.turn_in} tokens in, {args.turn_out} "
            "out, streamed); time to first token per turn over the conversations, and the share of the sent "
            "prompt tokens the service took from its prefix cache\n\n"
            + markdown_table(["API", "turn", "TTFT p50 ms", "TTFT p99 ms", "prompt tokens sent (mean)",
                              "cached share"], rows)
            + "\n" + markdown_table(["API", f"turn {args.turns} TTFT p50 / turn 2"], ratios))
    publish("served-chats", command_line("benchmarks.served_chats", argv), body, args.out,
            title="Multi-turn chats, served")
    return 0


if __name__ == "__main__":
    sys.exit(main())

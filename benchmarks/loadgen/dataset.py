"""The workload: prompts with their output lengths, and when each request is sent.

Both are fixed by ``--seed`` before anything runs, so the served run and ``--engine-only`` see the
same prompts, lengths and schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages


@dataclass
class BenchRequest:
    prompt: Prompt
    max_tokens: int
    prompt_len: int | None = None  # known for token-id prompts; the server's usage says for the others

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random dataset: lengths uniform in [len·(1−r), len·(1+r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    as_text: bool, shared_prefix_len: int = 0) -> list[BenchRequest]:
    """Prompts of random vocabulary tokens: token ids for /v1/completions, their text as one user
    message for chat (only tokens that are whole UTF-8 then, so the text is what the ids say).
    ``shared_prefix_len``: every prompt starts with the same that many random tokens (a shared instruction, as
    vLLM's ``--random-prefix-len``) before its own ``input_len``; drawn apart, so the prompts' own tokens are
    those of the same seed without it."""
    from engine.tokenizer import VOCAB_PATH, read_vocab  # the vocabulary file only: no regex compile, no torch
    vocab = read_vocab(VOCAB_PATH)
    if as_text:
        vocab = {i: t for i, t in vocab.items() if _is_utf8(t) and b"\n\n" not in t}
    ids = np.array(sorted(vocab), dtype=np.int64)
    rng = np.random.default_rng(seed)
    if shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {shared_prefix_len}")
    prefix = ids[np.random.default_rng([seed, 1]).integers(0, len(ids), size=shared_prefix_len)].tolist()
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    requests = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        prompt_ids = prefix + ids[rng.integers(0, len(ids), size=n_in)].tolist()
        if as_text:
            text = b"".join(vocab[i] for i in prompt_ids).decode("utf-8")
            requests.append(BenchRequest([{"role": "user", "content": text}], n_out))
        else:
            requests.append(BenchRequest(prompt_ids, n_out, len(prompt_ids)))
    return requests


def file_requests(path: str | Path, num_prompts: int, output_len: int, is_chat: bool) -> list[BenchRequest]:
    """JSONL lines ``{"prompt": text | [ids]}`` or ``{"messages": [...]}``, optional ``"max_tokens"``;
    repeated in order up to ``num_prompts``."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = orjson.loads(line)
        where = f"{path}:{lineno}"
        if "messages" in row:
            if not is_chat:
                raise ValueError(f"{where}: 'messages' needs --endpoint /v1/chat/completions")
            prompt = row["messages"]
        elif "prompt" in row:
            prompt = row["prompt"]
            if is_chat:
                if not isinstance(prompt, str):
                    raise ValueError(f"{where}: a chat prompt must be text")
                prompt = [{"role": "user", "content": prompt}]
        else:
            raise ValueError(f"{where}: a line needs 'prompt' or 'messages'")
        max_tokens = int(row.get("max_tokens") or output_len)
        prompt_len = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else None
        rows.append(BenchRequest(prompt, max_tokens, prompt_len))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [rows[i % len(rows)] for i in range(num_prompts)]


def arrival_times(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (vLLM's ``get_request``).

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``: burstiness 1 is a Poisson
    process, below 1 burstier, above 1 more even. The sum is rescaled so the last request goes at
    ``n/rate``, as vLLM does, so throughput does not depend on the seed's luck. ``inf`` sends all at once.
    """
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng([seed, 1])  # a stream of its own: the prompts do not shift it
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    if num_requests and times[-1] > 0:
        times *= (num_requests / request_rate) / times[-1]
    return times.tolist()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(data)

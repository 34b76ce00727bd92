"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it (vLLM's
``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``), and the top-k tokens at that position.

The models hand over their hidden states after the output LayerNorm at the positions that predict each
target; the head runs over them a slice at a time so a long prompt never holds ``[tokens, vocab]`` logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.sequence import TokenLogprob

ROWS_PER_PASS = 512  # fp32 logits for this many positions at a time: 128 MiB with a 65,536-token vocabulary


def score_positions(normed: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: Sequence[int],
                    k: int) -> list[TokenLogprob]:
    """``normed`` [L, C]: the states that predict ``targets`` (L of them); ``head`` maps states to fp32 logits.
    Each target's log-probability and the ``k`` most likely tokens there (one transfer to the host)."""
    assert normed.shape[0] == len(targets)
    if not targets:
        return []
    ids = torch.tensor(list(targets), dtype=torch.long, device=normed.device)
    chosen, top_ids, top_lps = [], [], []
    for s in range(0, len(targets), ROWS_PER_PASS):
        logits = head(normed[s:s + ROWS_PER_PASS])
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        chosen.append((logits.gather(1, ids[s:s + ROWS_PER_PASS, None]) - log_z)[:, 0])
        if k:
            values, indices = logits.topk(k, dim=-1)
            top_ids.append(indices)
            top_lps.append(values - log_z)
    lps = torch.cat(chosen).tolist()
    if not k:
        return [TokenLogprob(t, lp, []) for t, lp in zip(targets, lps)]
    tops_i, tops_v = torch.cat(top_ids).tolist(), torch.cat(top_lps).tolist()
    return [TokenLogprob(t, lp, list(zip(i, v))) for t, lp, i, v in zip(targets, lps, tops_i, tops_v)]

"""The reference RWKV-7: plain PyTorch, any device, exact against the official package.

``forward`` runs ``[B, T]`` tokens from the states of ``B`` pool slots and writes
the new states back. Decode is ``T = 1``; prefill is one sequence with ``T``
tokens. The wkv recurrence runs step by step in fp32, as the official CPU
path does: ``S' = S·diag(w) + (S·a)(b)ᵀ + v kᵀ`` with ``a = -κ, b = κ·iclr``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.scoring import score_positions
from engine.sequence import TokenLogprob
from engine.state import StatePool
from engine.weights import Rwkv7Weights

DECAY_SCALE = 0.606531  # exp(-0.5): decay = exp(-e^-0.5 · sigmoid(w))


class ReferenceRwkv7:
    """Forward passes over pool slots; the model interface the runner calls."""

    name = "reference"

    def __init__(self, weights: Rwkv7Weights, pool: StatePool):
        self.w = weights.tensors
        self.shape = weights.shape
        self.pool = pool

    def prefill(self, chunks: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run each chunk from its slot's state; returns each chunk's last-token logits ``[len, V]``."""
        return self.prefill_with_scores(chunks, slots, {})[0]

    @torch.inference_mode()
    def prefill_with_scores(self, chunks: list[list[int]], slots: list[int], score: dict[int, tuple[list[int], int]]
                            ) -> tuple[torch.Tensor, dict[int, list[TokenLogprob]]]:
        """``prefill``, and for each chunk ``i`` in ``score`` = {i: (targets, k)}: the logprobs of ``targets``
        predicted by the chunk's first ``len(targets)`` positions (``engine.scoring``)."""
        device = self.pool.wkv.device
        rows, scores = [], {}
        for i, (tokens, slot) in enumerate(zip(chunks, slots)):
            t = torch.tensor([tokens], dtype=torch.long, device=device)
            h = self.hidden(t, torch.tensor([slot], device=device))[0]
            rows.append(self._head(self._normed(h[-1:]))[0])
            if i in score:
                targets, k = score[i]
                scores[i] = score_positions(self._normed(h[:len(targets)]), self._head, targets, k)
        return torch.stack(rows), scores

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of ``B`` slots; returns logits ``[B, V]``."""
        return self.forward(token_ids.view(-1, 1), slots)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Logits ``[B, V]`` of each row's last token (``all_logits``: ``[B, T, V]``); the slots' states move on."""
        x = self.hidden(tokens, slots)
        return self._head(self._normed(x if all_logits else x[:, -1]))

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.shape.n_embd,), self.w["ln_out.weight"], self.w["ln_out.bias"])

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w["head.weight"]).float()

    def hidden(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last layer ``[B, T, C]`` (before the output LayerNorm)."""
        w, pool = self.w, self.pool
        C = self.shape.n_embd
        x = w["emb.weight"][tokens].to(w["blocks.0.att.receptance.weight"].dtype)
        v_first = None
        for i in range(self.shape.n_layer):
            p = f"blocks.{i}."
            xx = F.layer_norm(x, (C,), w[p + "ln1.weight"], w[p + "ln1.bias"])
            att_shift, wkv = pool.att_shift[i].index_select(0, slots), pool.wkv[i].index_select(0, slots)
            att, att_shift, wkv, v_first = self.time_mix(i, xx, att_shift, wkv, v_first)
            pool.att_shift[i].index_copy_(0, slots, att_shift.to(pool.att_shift.dtype))
            pool.wkv[i].index_copy_(0, slots, wkv.to(pool.wkv.dtype))
            x = x + att
            xx = F.layer_norm(x, (C,), w[p + "ln2.weight"], w[p + "ln2.bias"])
            ffn, ffn_shift = self.channel_mix(i, xx, pool.ffn_shift[i].index_select(0, slots))
            pool.ffn_shift[i].index_copy_(0, slots, ffn_shift.to(pool.ffn_shift.dtype))
            x = x + ffn
        return x

    def time_mix(self, i: int, x: torch.Tensor, shift: torch.Tensor, wkv: torch.Tensor,
                 v_first: torch.Tensor | None):
        w, p = self.w, f"blocks.{i}.att."
        B, T, C = x.shape
        H, N = self.shape.n_head, self.shape.head_size
        xx = torch.cat([shift.to(x.dtype)[:, None], x[:, :-1]], 1) - x
        xr, xw, xk, xv, xa, xg = (x + xx * w[p + "x_" + c] for c in "rwkvag")
        r = F.linear(xr, w[p + "receptance.weight"])
        k = F.linear(xk, w[p + "key.weight"])
        v = F.linear(xv, w[p + "value.weight"])
        decay_lora = torch.tanh(xw @ w[p + "w1"]) @ w[p + "w2"]
        iclr = torch.sigmoid(w[p + "a0"] + (xa @ w[p + "a1"]) @ w[p + "a2"])
        g = torch.sigmoid(xg @ w[p + "g1"]) @ w[p + "g2"]
        kk = F.normalize((k * w[p + "k_k"]).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C)
        k = k * (1 + (iclr - 1) * w[p + "k_a"])
        if i == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(w[p + "v0"] + (xv @ w[p + "v1"]) @ w[p + "v2"])
        decay = torch.exp(-DECAY_SCALE * torch.sigmoid(w[p + "w0"] + decay_lora.float()))
        y, wkv = wkv_recurrent(r, decay, k, v, -kk, kk * iclr, wkv, H)
        y = F.group_norm(y.reshape(B * T, C), H, w[p + "ln_x.weight"].float(), w[p + "ln_x.bias"].float(),
                         eps=self.shape.ln_x_eps).view(B, T, C).to(x.dtype)
        bonus = ((r * k * w[p + "r_k"].view(C)).view(B, T, H, N).sum(-1, keepdim=True) * v.view(B, T, H, N))
        y = y + bonus.view(B, T, C).to(y.dtype)
        return F.linear(y * g, w[p + "output.weight"]), x[:, -1], wkv, v_first

    def channel_mix(self, i: int, x: torch.Tensor, shift: torch.Tensor):
        w, p = self.w, f"blocks.{i}.ffn."
        xx = torch.cat([shift.to(x.dtype)[:, None], x[:, :-1]], 1) - x
        k = torch.relu(F.linear(x + xx * w[p + "x_k"], w[p + "key.weight"])) ** 2
        return F.linear(k, w[p + "value.weight"]), x[:, -1]


def wkv_recurrent(r, w, k, v, a, b, state, num_heads: int):
    """Step the wkv state over ``T`` tokens in fp32; returns outputs ``[B, T, C]`` and the new state.

    ``state`` is ``[B, H, N(value), N(key)]``; inputs are ``[B, T, C]``.
    """
    B, T, C = r.shape
    H, N = num_heads, C // num_heads
    r, w, k, v, a, b = (t.float().view(B, T, H, N) for t in (r, w, k, v, a, b))
    s = state.float()
    out = torch.empty(B, T, H, N, dtype=torch.float32, device=r.device)
    for t in range(T):
        s = (s * w[:, t, :, None, :]
             + (s @ a[:, t, :, :, None]) @ b[:, t, :, None, :]
             + v[:, t, :, :, None] @ k[:, t, :, None, :])
        out[:, t] = (s @ r[:, t, :, :, None]).squeeze(-1)
    return out.view(B, T, C), s

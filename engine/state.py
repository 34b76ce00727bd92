"""Preallocated recurrent state, one slot per running sequence.

A sequence owns a slot from admission to finish; kernels gather and scatter
by slot index, so nothing is concatenated per step. Layout per layer follows
the official package: wkv ``[slot, head, value_dim, key_dim]`` (fla's is the
transpose), token shifts ``[slot, C]``.
"""

from __future__ import annotations

import torch

from engine.weights import ModelShape


class StatePool:
    def __init__(self, shape: ModelShape, num_slots: int, device: torch.device | str,
                 shift_dtype: torch.dtype = torch.float32, state_dtype: torch.dtype = torch.float32):
        L, C, H, N = shape.n_layer, shape.n_embd, shape.n_head, shape.head_size
        self.shape = shape
        self.num_slots = num_slots
        self.att_shift = torch.zeros(L, num_slots, C, device=device, dtype=shift_dtype)
        self.ffn_shift = torch.zeros(L, num_slots, C, device=device, dtype=shift_dtype)
        self.wkv = torch.zeros(L, num_slots, H, N, N, device=device, dtype=state_dtype)

    @staticmethod
    def bytes_per_slot(shape: ModelShape, shift_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        return shape.state_bytes(_itemsize(state_dtype), _itemsize(shift_dtype))

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the state of ``slots`` (a new sequence starts from the zero state)."""
        for t in (self.att_shift, self.ffn_shift, self.wkv):
            t.index_fill_(1, slots, 0)

    def copy(self, src: int, dst: torch.Tensor) -> None:
        """Copy slot ``src`` into every slot of ``dst`` (n > 1 shares one prefill)."""
        for t in (self.att_shift, self.ffn_shift, self.wkv):
            t.index_copy_(1, dst, t[:, src:src + 1].expand(-1, len(dst), *t.shape[2:]).contiguous())

    def write(self, slot: int, att_shift: torch.Tensor, ffn_shift: torch.Tensor, wkv: torch.Tensor) -> None:
        """Set one slot's state (all layers: ``[L, C]``, ``[L, C]``, ``[L, H, N, N]``; queued, from device or
        pinned host memory)."""
        for t, src in ((self.att_shift, att_shift), (self.ffn_shift, ffn_shift), (self.wkv, wkv)):
            t[:, slot].copy_(src, non_blocking=True)

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """One slot's state as the official package lays it out (tests and debugging)."""
        out = []
        for i in range(self.shape.n_layer):
            out += [self.att_shift[i, slot].clone(), self.wkv[i, slot].clone(), self.ffn_shift[i, slot].clone()]
        return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

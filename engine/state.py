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


class CheckpointSlab:
    """Fixed storage for prefix-cache checkpoints: ``rows`` rows, each one sequence's state (all layers) and one
    logits row, allocated once (no allocation per checkpoint in the serving loop; pinned when on the host beside a
    GPU, so its copies are asynchronous). Rows are taken and given back; copies are queued on the current stream,
    so a row reused later is written only after earlier copies out of it."""

    def __init__(self, pool: StatePool, rows: int, vocab_size: int, logits_dtype: torch.dtype,
                 device: torch.device | str, pinned: bool = False):
        L, C = pool.att_shift.shape[0], pool.att_shift.shape[2]
        H, N = pool.wkv.shape[2], pool.wkv.shape[3]
        kw = dict(device=device, pin_memory=pinned) if pinned else dict(device=device)
        self.att_shift = torch.empty(rows, L, C, dtype=pool.att_shift.dtype, **kw)
        self.ffn_shift = torch.empty(rows, L, C, dtype=pool.ffn_shift.dtype, **kw)
        self.wkv = torch.empty(rows, L, H, N, N, dtype=pool.wkv.dtype, **kw)
        self.logits = torch.empty(rows, vocab_size, dtype=logits_dtype, **kw)
        self.rows = rows
        self._free = list(range(rows - 1, -1, -1))

    @staticmethod
    def row_bytes(pool: StatePool, vocab_size: int, logits_dtype: torch.dtype) -> int:
        one = sum(t[:, 0].numel() * t.element_size() for t in (pool.att_shift, pool.ffn_shift, pool.wkv))
        return one + vocab_size * _itemsize(logits_dtype)

    def take(self) -> int:
        return self._free.pop()

    def give(self, row: int) -> None:
        self._free.append(row)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def save(self, row: int, pool: StatePool, slot: int, logits: torch.Tensor | None) -> None:
        """A pool slot's state and a logits row (None: none kept) into ``row``."""
        self.att_shift[row].copy_(pool.att_shift[:, slot], non_blocking=True)
        self.ffn_shift[row].copy_(pool.ffn_shift[:, slot], non_blocking=True)
        self.wkv[row].copy_(pool.wkv[:, slot], non_blocking=True)
        if logits is not None:
            self.logits[row].copy_(logits, non_blocking=True)

    def restore(self, row: int, pool: StatePool, slot: int) -> None:
        pool.write(slot, self.att_shift[row], self.ffn_shift[row], self.wkv[row])

    def copy_row(self, row: int, dst: "CheckpointSlab", dst_row: int) -> None:
        """One row into another slab's (the device tier's to the host's)."""
        for a, b in ((self.att_shift, dst.att_shift), (self.ffn_shift, dst.ffn_shift), (self.wkv, dst.wkv),
                     (self.logits, dst.logits)):
            b[dst_row].copy_(a[row], non_blocking=True)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

"""fla's chunked RWKV-7 scan over packed variable-length sequences, with the per-call work done once per prefill.

``fla.ops.rwkv7.chunk_rwkv7`` goes through an autograd Function, input guards and a chunk-index computation with a
blocking host-to-device copy, every layer: on an H200 that was ~0.6 ms of Python per layer, 14 ms of a 1.5B
prefill step's ~35 ms of host time (BENCHMARKS.md). A prefill builds one ``PackedChunks`` (chunk size, gate safety,
chunk indices through pinned memory) and calls fla's forward directly for each layer; where that internal entry
point is missing (another fla version) it falls back to the public function.
"""

from __future__ import annotations

import functools

import torch

from engine.cuda.fla_import import kernel_modules, without_dynamo
from engine.device import to_device


@functools.cache
def _direct() -> tuple | None:
    kernel_modules()
    try:
        with without_dynamo():
            from fla.ops.generalized_delta_rule.dplr.chunk import chunk_dplr_fwd, gate_bound_is_safe
            from fla.ops.utils.index import prepare_chunk_indices
            from fla.utils import TRITON_ABOVE_3_4_0
    except ImportError:
        return None
    return chunk_dplr_fwd, gate_bound_is_safe, prepare_chunk_indices, TRITON_ABOVE_3_4_0


class PackedChunks:
    """One prefill's packing: ``cu_seqlens`` on both sides and what fla derives from it, computed once."""

    def __init__(self, lengths: list[int], device: torch.device, lower_bound: float):
        self.lower_bound = lower_bound
        self.cu_cpu = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
        self.cu = to_device(self.cu_cpu.tolist(), torch.long, device)
        self.fast = _direct()
        if self.fast is None:
            return
        self.chunk_size = self.direct_chunk_size(lower_bound)
        self.safe_gate = self.fast[1](lower_bound, self.chunk_size)
        indices = self.fast[2](self.cu_cpu, self.chunk_size, cu_seqlens_cpu=self.cu_cpu)  # on the CPU
        self.chunk_indices = indices.pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
            else indices.to(device)

    @classmethod
    def on_device(cls, cu: torch.Tensor, chunk_indices: torch.Tensor, chunk_size: int,
                  lower_bound: float) -> PackedChunks:
        """A packing whose ``cu_seqlens`` and chunk indices are already on the device (a captured prefill's
        fixed-shape buffers, ``engine.cuda.prefill_graphs``); needs fla's direct entry point."""
        self = cls.__new__(cls)
        self.lower_bound, self.cu_cpu, self.cu, self.fast = lower_bound, None, cu, _direct()
        self.chunk_size, self.chunk_indices = chunk_size, chunk_indices
        self.safe_gate = self.fast[1](lower_bound, chunk_size)
        return self

    @staticmethod
    def direct_chunk_size(lower_bound: float) -> int | None:
        """The chunk length fla's scan uses (as ``chunk_dplr_delta_rule`` picks it), or None without fla's
        direct entry point."""
        fast = _direct()
        if fast is None:
            return None
        _, safe, _, triton_34 = fast
        return 64 if triton_34 and safe(lower_bound, 64) else 16

    def scan(self, r, log_decay, k, v, a, b, h0) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, T, H, N]`` inputs, ``h0`` ``[num_seqs, H, K, V]`` fp32: the outputs and the final states."""
        if self.fast is None:
            from fla.ops.rwkv7 import chunk_rwkv7
            return chunk_rwkv7(r, log_decay, k, v, a, b, scale=1.0, initial_state=h0, output_final_state=True,
                               cu_seqlens=self.cu, cu_seqlens_cpu=self.cu_cpu, lower_bound=self.lower_bound)
        chunk_dplr_fwd = self.fast[0]
        o, final_state, _, _ = chunk_dplr_fwd(q=r, k=k, v=v, a=a, b=b, gk=log_decay, scale=1.0, initial_state=h0,
                                              output_final_state=True, cu_seqlens=self.cu,
                                              chunk_size=self.chunk_size, safe_gate=self.safe_gate,
                                              chunk_indices=self.chunk_indices)
        return o.to(r.dtype), final_state

"""fp8 (e4m3) weights: per-output-channel scales for the weight matrices, per-token scales for the activations
that meet them in a GEMM.

A weight ``W`` [out, in] is kept as ``W8 = round_e4m3(W / s)`` with ``s[o] = max|W[o, :]| / 448`` (448: e4m3's
largest finite value), so each output channel uses the format's whole range. A GEMM of ``B`` rows quantizes its
input the same way per row (``x8``, ``sx``) and computes ``(x8 @ W8ᵀ) · sx · sᵀ`` in fp32 on the tensor cores
(``torch._scaled_mm``, row-wise scales). The weight-streaming kernels of small decode batches read ``W8`` and
multiply by ``s`` after their sum (activations stay bf16 there: those steps are bound by the weight bytes).

Which tensors: the projections (receptance, key, value, output) and the FFN's key and value. The embedding, the
head, the LoRAs, norms and vectors stay bf16 (or fp32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = ".fp8_scale"  # a saved fp8 matrix's scales: ``<name>.fp8_scale`` beside ``<name>``
QUANTIZED = re.compile(r"blocks\.\d+\.(att\.(receptance|key|value|output)|ffn\.(key|value))\.weight$")
GEMM_MULTIPLE = 16  # torch._scaled_mm wants each dimension a multiple of 16


def is_quantized_name(name: str) -> bool:
    """Whether ``name`` is one of the matrices fp8 mode keeps in fp8."""
    return QUANTIZED.search(name) is not None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [rows, cols] → (e4m3 ``[rows, cols]``, fp32 scales ``[rows]``): each row scaled to e4m3's range (an
    all-zero row gets scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


@dataclass
class Fp8Matrix:
    """A weight matrix ``[out, in]`` in e4m3 with one fp32 scale per output row."""
    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor) -> Fp8Matrix:
        return cls(*quantize_rows(w))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, start: int, end: int) -> Fp8Matrix:
        return Fp8Matrix(self.q[start:end], self.scale[start:end])

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.q, self.scale, dtype)

    def linear(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x @ Wᵀ`` for ``x`` [M, in]: ``x`` quantized per row, one fp8 GEMM with both scales, ``out_dtype``
        (default ``x``'s) out. Rows are padded to a multiple of 16 for the GEMM and the padding dropped. (Plain
        torch, any device: the twin of ``engine.cuda.kernels.fp8_linear``.)"""
        M = x.shape[0]
        pad = -M % GEMM_MULTIPLE
        xq, sx = quantize_rows(x if not pad else torch.nn.functional.pad(x, (0, 0, 0, pad)))
        y = torch._scaled_mm(xq, self.q.t(), scale_a=sx[:, None], scale_b=self.scale[None, :],
                             out_dtype=out_dtype or x.dtype)
        return y[:M] if pad else y


def quantize_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An official-layout state dict with its fp8 matrices in e4m3 and their scales beside them
    (``<name>.fp8_scale``): what ``gaggle quantize`` saves, half the bytes of those matrices in bf16. Each is
    quantized from its bf16 rounding, as ``--weights fp8`` does after the cast to the serving dtype on a GPU: the
    same bytes either way."""
    out = {}
    for name, t in tensors.items():
        if is_quantized_name(name) and t.dtype != FP8:
            out[name], out[name + SCALE_SUFFIX] = quantize_rows(t.to(torch.bfloat16))
        else:
            out[name] = t
    return out

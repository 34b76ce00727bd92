"""Fused Triton kernels for the decode step, each with a plain-torch twin for tests.

``wkv7_decode``: one program per (sequence, head) reads the head's 64×64 fp32
state straight from its pool slot, applies the whole per-token time-mix
epilogue (decay, in-context learning rate, value residual, key update, state
update, readout, per-head GroupNorm, bonus, gate) and writes the state back:
each state is read once and written once per layer.

``ln_shift_mix``: LayerNorm of each row, then gathers the sequence's
token-shift vector from its slot, writes the new one, and produces the K mixed
inputs in one pass (``prefill_ln_shift_mix``: the same over packed prompts).

``small_matmul`` and its packed forms (``time_mix_in``: r/k/v and the four
LoRA downs in one launch, each LoRA at its own rank; ``lora_up``): weight-
streaming matmuls for decode batches of ≤ 16 rows. Where a launch would leave
SMs idle they split K (``split_k``) and write fp32 partial sums that the
consuming kernel adds up in a fixed order (LoRA up, wkv, the next LayerNorm
for the residual): more loads in flight, no atomics, the same bits whatever
the batch.

The LayerNorm+shift and wkv kernels of large decode batches are launched with
programmatic dependent launch on Hopper (``large_batch=True``): a kernel starts
while its predecessor (a cuBLAS GEMM) finishes, reads what no kernel of the
step writes (this layer's recurrent and shift state, parameters) and only then
waits for the predecessor (``_wait_for_predecessor``); everything another
kernel of the step touches comes after that wait. Measured on an H200 (1.5B):
batch 1,024 12.68 → 12.31 ms per step; on the small-batch path it made steps
slower (1.53 → 1.74 ms at batch 1), so those launch plainly. (Also measured
and dropped: an L2 weight prefetch in the small matmul, streaming cache hints
on the wkv state, and LayerNorm + shift mix recomputed inside the small-batch
projections — 6 launches a layer instead of 9, but 1.54 / 1.90 / 2.00 ms at
batch 1 / 4 / 16 against 1.53 / 1.62 / 1.72.)
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.quant import FP8, GEMM_MULTIPLE, Fp8Matrix

DECAY_SCALE = 0.606531  # exp(-0.5)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch is available: CUDA on Hopper or newer, not switched off by
    ``GAGGLE_PDL=0``."""
    if device.type != "cuda" or os.environ.get("GAGGLE_PDL", "1") == "0":
        return False
    return _pdl_supported(_device_index(device))


@triton.jit
def _wait_for_predecessor(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the previous kernel has finished and its writes are
    visible, then let the next kernel start (it runs its own prologue, then waits for this one)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _wkv7_decode_kernel(state, slots, r, k, v, w_lora, a_lora, v_lora, g, v_first,
                        w0, a0, v0, k_k, k_a, r_k, ln_w, ln_b, out,
                        B, rkv_stride, rkv_split_stride, H: tl.constexpr, N: tl.constexpr, C: tl.constexpr, eps,
                        IS_FIRST_LAYER: tl.constexpr, PDL: tl.constexpr, LARGE_BATCH: tl.constexpr,
                        SPLIT_IN: tl.constexpr, HEADS: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """One program per (sequence, ``HEADS`` consecutive heads): with more than one, the heads are a loop that
    Triton pipelines ``STAGES`` deep (the next head's state is loading while this one's is updated)."""
    b = tl.program_id(0)
    slot = tl.load(slots + b).to(tl.int64)
    if HEADS == 1:
        _wkv7_decode_head(state, slot, b, tl.program_id(1), r, k, v, w_lora, a_lora, v_lora, g, v_first,
                          w0, a0, v0, k_k, k_a, r_k, ln_w, ln_b, out, rkv_stride, rkv_split_stride, H, N, C, eps,
                          IS_FIRST_LAYER, PDL, SPLIT_IN)
    else:
        for i in tl.range(0, HEADS, num_stages=STAGES):
            _wkv7_decode_head(state, slot, b, tl.program_id(1) * HEADS + i, r, k, v, w_lora, a_lora, v_lora, g,
                              v_first, w0, a0, v0, k_k, k_a, r_k, ln_w, ln_b, out, rkv_stride, rkv_split_stride,
                              H, N, C, eps, IS_FIRST_LAYER, PDL, SPLIT_IN)


@triton.jit
def _wkv7_decode_head(state, slot, b, h, r, k, v, w_lora, a_lora, v_lora, g, v_first,
                      w0, a0, v0, k_k, k_a, r_k, ln_w, ln_b, out, rkv_stride, rkv_split_stride,
                      H: tl.constexpr, N: tl.constexpr, C: tl.constexpr, eps,
                      IS_FIRST_LAYER: tl.constexpr, PDL: tl.constexpr, SPLIT_IN: tl.constexpr):
    offs = h * N + tl.arange(0, N)
    row = b * C + offs
    # the layer's state and parameters: no kernel of this step before this one writes them
    base = ((slot * H + h) * N) * N
    idx = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]  # [value, key]
    s = tl.load(state + base + idx).to(tl.float32)
    a0_h = tl.load(a0 + offs).to(tl.float32)
    k_k_h = tl.load(k_k + offs).to(tl.float32)
    k_a_h = tl.load(k_a + offs).to(tl.float32)
    w0_h = tl.load(w0 + offs).to(tl.float32)
    _wait_for_predecessor(PDL)
    rkv_row = b * rkv_stride + offs  # r, k, v: column blocks of one packed projection, or its split-K partials
    rr = _sum_partials(r + rkv_row, rkv_split_stride, offs < C, SPLIT_IN).to(tl.float32)
    kr = _sum_partials(k + rkv_row, rkv_split_stride, offs < C, SPLIT_IN).to(tl.float32)
    vr = _sum_partials(v + rkv_row, rkv_split_stride, offs < C, SPLIT_IN).to(tl.float32)
    iclr = tl.sigmoid(a0_h + tl.load(a_lora + row).to(tl.float32))
    if IS_FIRST_LAYER:
        vv = vr
        tl.store(v_first + row, vr.to(v_first.dtype.element_ty))
    else:
        vmix = tl.sigmoid(tl.load(v0 + offs).to(tl.float32) + tl.load(v_lora + row).to(tl.float32))
        vf = tl.load(v_first + row).to(tl.float32)
        vv = vr + (vf - vr) * vmix
    kk = kr * k_k_h
    kk = kk / tl.maximum(tl.sqrt(tl.sum(kk * kk, axis=0)), 1e-12)
    k2 = kr * (1.0 + (iclr - 1.0) * k_a_h)
    w = w0_h + tl.load(w_lora + row).to(tl.float32)
    decay = tl.exp(-0.606531 * tl.sigmoid(w))
    a = -kk
    bb = kk * iclr

    sa = tl.sum(s * a[None, :], axis=1)
    s = s * decay[None, :] + sa[:, None] * bb[None, :] + vv[:, None] * k2[None, :]
    y = tl.sum(s * rr[None, :], axis=1)
    tl.store(state + base + idx, s.to(state.dtype.element_ty))

    mean = tl.sum(y, axis=0) / N
    d = y - mean
    var = tl.sum(d * d, axis=0) / N
    yn = d / tl.sqrt(var + eps) * tl.load(ln_w + offs).to(tl.float32) + tl.load(ln_b + offs).to(tl.float32)
    bonus = tl.sum(rr * k2 * tl.load(r_k + offs).to(tl.float32), axis=0) * vv
    gate = tl.load(g + row).to(tl.float32)
    tl.store(out + row, ((yn + bonus) * gate).to(out.dtype.element_ty))


# The warp count is one per decode path, never per batch size: it sets the order of the per-head sums, and a row's
# result must not depend on how many rows share its step (a graph pads 11 rows to 16; batch invariance).
# Small batches (≤ 16 rows): tuned on the GPU (the autotuner needs a GPU driver, so the interpreter on CPU runs the
# plain kernel). Large batches: fixed. `benchmarks.wkv_bandwidth --sweep` on an H100 (commit 3cabcae, 2026-12-07):
# one head per program with 2 warps was the fastest launch at batch 256 and 1,024, fp32 and bf16 state (fp32: 161 /
# 433 µs a layer against 207 / 452 for what the autotuner had picked at its first call); the H200's table holds 2.
WKV_LARGE_BATCH_WARPS = 2
_wkv7_decode_tuned = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)],
                                     key=["C", "LARGE_BATCH"], restore_value=["state", "v_first", "out"])(_wkv7_decode_kernel)


def wkv7_decode(state: torch.Tensor, slots: torch.Tensor, r, k, v, w_lora, a_lora, v_lora, g, v_first,
                p: dict, layer: int, eps: float, out: torch.Tensor, large_batch: bool = False,
                config: dict | None = None) -> torch.Tensor:
    """Fused decode time-mix core for one layer. ``state`` is the layer's ``[S, H, N, N]`` pool view; ``r``,
    ``k``, ``v`` share a row stride, the other rows are contiguous. ``r``, ``k``, ``v`` may be ``[S, B, C]``:
    a split-K projection's fp32 partial sums, added here.
    ``large_batch``: the cuBLAS decode path (launched with PDL, one fixed launch: see ``WKV_LARGE_BATCH_WARPS``)."""
    r3, k3, v3 = (t if t.dim() == 3 else t[None] for t in (r, k, v))
    _, B, C = r3.shape
    H, N = state.shape[1], state.shape[2]
    assert r3.stride() == k3.stride() == v3.stride() and r3.stride(2) == 1
    use_pdl = large_batch and pdl(state.device)
    if not state.is_cuda:
        kernel, extra = _wkv7_decode_kernel, {"num_warps": 4}
    elif large_batch:
        kernel, extra = _wkv7_decode_kernel, {"launch_pdl": use_pdl, "num_warps": WKV_LARGE_BATCH_WARPS}
    else:
        kernel, extra = _wkv7_decode_tuned, {"launch_pdl": use_pdl}
    if config is not None:  # a benchmark's fixed choice: HEADS, STAGES, num_warps
        kernel, extra = _wkv7_decode_kernel, {**extra, **config}
    kernel[lambda meta: (B, H // meta.get("HEADS", 1))](
        state, slots, r, k, v, w_lora, a_lora, v_lora, g, v_first,
        p["w0"], p["a0"], p["v0"] if layer else p["a0"], p["k_k"], p["k_a"], p["r_k"], p["ln_x.weight"],
        p["ln_x.bias"], out, B, r3.stride(1), r3.stride(0), H=H, N=N, C=C, eps=eps, IS_FIRST_LAYER=layer == 0,
        PDL=use_pdl, LARGE_BATCH=large_batch, SPLIT_IN=r3.shape[0], **extra)
    return out


def wkv7_decode_ref(state, slots, r, k, v, w_lora, a_lora, v_lora, g, v_first, p: dict, layer: int,
                    eps: float, out: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of ``wkv7_decode`` (same inputs, same in-place effects)."""
    f = lambda t: t.float()  # noqa: E731
    r, k, v = (f(t).sum(0) if t.dim() == 3 else f(t) for t in (r, k, v))
    B, C = r.shape
    H, N = state.shape[1], state.shape[2]
    iclr = torch.sigmoid(f(p["a0"]) + f(a_lora))
    if layer == 0:
        v_first.copy_(v.to(v_first.dtype))
    else:
        v = v + (f(v_first) - v) * torch.sigmoid(f(p["v0"]) + f(v_lora))
    kk = torch.nn.functional.normalize((k * f(p["k_k"])).view(B, H, N), dim=-1).view(B, C)
    k2 = k * (1 + (iclr - 1) * f(p["k_a"]))
    decay = torch.exp(-DECAY_SCALE * torch.sigmoid(f(p["w0"]) + f(w_lora)))
    s = f(state[slots])
    a, b = (-kk).view(B, H, N), (kk * iclr).view(B, H, N)
    s = s * decay.view(B, H, 1, N) + (s @ a[..., None]) @ b[:, :, None, :] + v.view(B, H, N, 1) @ k2.view(B, H, 1, N)
    state[slots] = s.to(state.dtype)
    y = (s @ r.view(B, H, N, 1)).view(B, C)
    y = torch.nn.functional.group_norm(y, H, f(p["ln_x.weight"]), f(p["ln_x.bias"]), eps=eps)
    bonus = ((r * k2 * f(p["r_k"]).view(C)).view(B, H, N).sum(-1, keepdim=True) * v.view(B, H, N)).view(B, C)
    out.copy_(((y + bonus) * f(g)).to(out.dtype))
    return out


def shift_mix_ref(x, shift, slots, mix, out):
    prev = shift[slots].to(x.dtype)
    shift[slots] = x.to(shift.dtype)
    out.copy_((x.float()[None] + (prev.float() - x.float())[None] * mix.float()[:, None]).to(out.dtype))
    return out


@triton.jit
def _sum_partials(ptr, stride, mask, SPLIT: tl.constexpr):
    """Σ over a split-K projection's SPLIT fp32 partial sums, in a fixed order (the result is the same whichever
    program wrote first)."""
    total = tl.load(ptr, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total += tl.load(ptr + s * stride, mask=mask, other=0.0)
    return total


@triton.jit
def _layer_norm_row(x_row, mask, w, bias, C: tl.constexpr, eps):
    """LayerNorm of one fp32 row (masked tail ignored)."""
    mean = tl.sum(x_row, axis=0) / C
    d = tl.where(mask, x_row - mean, 0.0)
    return d / tl.sqrt(tl.sum(d * d, axis=0) / C + eps) * w + bias


@triton.jit
def _store_mixes(xb, prev, mix, out, row, rows, offs, mask, C: tl.constexpr, K: tl.constexpr):
    """``out[j, row] = xb + (prev - xb) * mix[j]`` for the K mixes of one row (``out``: [K, rows, C])."""
    xf = xb.to(tl.float32)
    delta = prev.to(tl.float32) - xf
    for j in tl.static_range(K):
        m = tl.load(mix + j * C + offs, mask=mask).to(tl.float32)
        tl.store(out + (j * rows + row) * C + offs, (xf + delta * m).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _ln_shift_mix_kernel(x, ln_w, ln_b, shift, slots, mix, out, part, part_stride, B, eps,
                         C: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         SPLIT_IN: tl.constexpr):
    """LayerNorm of one row fused with its token-shift mixes (one launch instead of two); first, with
    ``SPLIT_IN`` partial sums of a split-K projection, the residual add ``x += Σ part`` (in place)."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < C
    # the slot's shift state and the LayerNorm weights: no earlier kernel of this step writes them
    slot = tl.load(slots + b).to(tl.int64)
    prev = tl.load(shift + slot * C + offs, mask=mask)
    w = tl.load(ln_w + offs, mask=mask).to(tl.float32)
    bias = tl.load(ln_b + offs, mask=mask).to(tl.float32)
    _wait_for_predecessor(PDL)
    xf = tl.load(x + b * C + offs, mask=mask, other=0.0).to(tl.float32)
    if SPLIT_IN > 0:
        xf += _sum_partials(part + b * C + offs, part_stride, mask, SPLIT_IN)
        xr = xf.to(x.dtype.element_ty)  # the residual stream as the unsplit projection rounds it
        tl.store(x + b * C + offs, xr, mask=mask)
        xf = xr.to(tl.float32)
    xb = _layer_norm_row(xf, mask, w, bias, C, eps).to(x.dtype.element_ty)  # rounded as an unfused LayerNorm
    tl.store(shift + slot * C + offs, xb.to(shift.dtype.element_ty), mask=mask)
    _store_mixes(xb, prev.to(x.dtype.element_ty), mix, out, b, B, offs, mask, C, K)


def ln_shift_mix(x: torch.Tensor, ln: tuple[torch.Tensor, torch.Tensor], shift: torch.Tensor, slots: torch.Tensor,
                 mix: torch.Tensor, out: torch.Tensor, eps: float = 1e-5, large_batch: bool = False,
                 partials: torch.Tensor | None = None) -> torch.Tensor:
    """``xx = LayerNorm(x)``; ``out[j, b] = xx[b] + (shift[slot_b] - xx[b]) * mix[j]``; ``shift[slot_b] = xx[b]``.
    ``partials`` ([S, B, C] fp32, a split-K projection's): first ``x += Σ partials``, in place.
    ``large_batch``: the cuBLAS decode path (launched with PDL: see the module's doc)."""
    B, C = x.shape
    BLOCK = triton.next_power_of_2(C)
    use_pdl = large_batch and pdl(x.device)
    launch = {"launch_pdl": True} if use_pdl else {}
    assert x.is_contiguous() and (partials is None or partials.is_contiguous())
    part = partials if partials is not None else x
    _ln_shift_mix_kernel[(B,)](x, ln[0], ln[1], shift, slots, mix, out, part, B * C, B, eps, C=C, K=mix.shape[0],
                               BLOCK=BLOCK, PDL=use_pdl, SPLIT_IN=0 if partials is None else partials.shape[0],
                               num_warps=8 if BLOCK >= 2048 else 4, **launch)
    return out


def ln_shift_mix_ref(x, ln, shift, slots, mix, out, eps: float = 1e-5, partials=None):
    if partials is not None:
        x.copy_((x.float() + partials.sum(0)).to(x.dtype))
    return shift_mix_ref(torch.nn.functional.layer_norm(x, (x.shape[1],), *ln, eps=eps), shift, slots, mix, out)


ACT_NONE, ACT_RELU_SQUARE = 0, 1
PACK_NONE, PACK_TIME_MIX_IN, PACK_LORA_UP = 0, 1, 2


@triton.jit
def _small_matmul_kernel(x, w, out, res, w_scale, M, N, K, sxs, sxg, sxm, sos, sog, som,
                         ACT: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr = 1, SPLIT_IN: tl.constexpr = 0,
                         PACK: tl.constexpr = 0, GC: tl.constexpr = 0, R0: tl.constexpr = 0, R1: tl.constexpr = 0,
                         R2: tl.constexpr = 0, SCALED: tl.constexpr = False):
    """``out[g] = act(x[g] @ w[g]ᵀ) (+ res)`` for a few rows: weight-streaming, one read of ``w``.
    ``SPLIT``: split-K, program (n, g, s) writes the fp32 partial sum over its K/SPLIT slice to ``out[s, g]``
    (with ACT_NONE, no residual: the consumer adds the partials up). ``SPLIT_IN`` ≥ 1: ``x`` is such partials
    (summed here; with PACK 2, the LoRA activations applied).
    ``PACK``: the time mix's input projections, each at its own size, in one launch (``time_mix_in``,
    ``lora_up``): r/k/v (GC rows each) and the four LoRAs (ranks R0..R3).
    ``SCALED``: ``w`` is fp8 with one fp32 scale per output row (``w_scale``, ``engine.quant``): its tiles are
    widened to ``x``'s dtype for the dot and each column of the sum is scaled once, before the activation."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w + g * N * K + offs_n[:, None].to(tl.int64) * K
    if PACK == 1:  # w: [3·GC + R, K] = r, k, v, LoRA downs; a block's rows read mix g (GC, ranks: multiples of it)
        first = pid_n * BLOCK_N
        g = ((first >= GC).to(tl.int64) + (first >= 2 * GC).to(tl.int64) + (first >= 3 * GC).to(tl.int64)
             + (first >= 3 * GC + R0).to(tl.int64) + (first >= 3 * GC + R0 + R1).to(tl.int64)
             + (first >= 3 * GC + R0 + R1 + R2).to(tl.int64))
        w_base = w + offs_n[:, None].to(tl.int64) * K
    x_base = x + g * sxg + offs_m[:, None] * sxm
    if PACK == 2:  # x: [M, R] the LoRA downs; LoRA g reads its R_g columns and its own [N, R_g] weights
        offset = tl.where(g == 0, 0, tl.where(g == 1, R0, tl.where(g == 2, R0 + R1, R0 + R1 + R2)))
        K = tl.where(g == 0, R0, tl.where(g == 1, R1, tl.where(g == 2, R2, K - R0 - R1 - R2)))
        x_base = x + offset + offs_m[:, None] * sxm
        w_base = w + N * offset + offs_n[:, None].to(tl.int64) * K
    # slices of whole BLOCK_K steps: the only mask is K's (a multiple of 16 the compiler knows of, so the loads
    # stay vectorised; a computed slice end as the bound made them scalar)
    k_slice = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    for k0 in range(split * k_slice, tl.minimum(K, (split + 1) * k_slice), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if SPLIT_IN == 0:
            xt = tl.load(x_base + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        else:
            xt = _sum_partials(x_base + offs_k[None, :], sxs, m_mask[:, None] & k_mask[None, :], SPLIT_IN)
            if PACK == 2:  # the LoRA downs' activations: tanh on w (0), sigmoid on g (3)
                xt = tl.where(g == 0, 2.0 * tl.sigmoid(2.0 * xt) - 1.0, tl.where(g == 3, tl.sigmoid(xt), xt))
            xt = xt.to(w.dtype.element_ty)  # rounded as the unsplit projection's output
        wt = tl.load(w_base + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SCALED:
            wt = wt.to(xt.dtype)
        if UPCAST:  # Triton's CPU interpreter computes bf16 dots wrongly: it gets fp32 tiles
            acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
        elif IEEE:  # fp32 weights: no TF32 rounding
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    if SCALED:  # packed (PACK 1): the scales follow the packed rows; grouped: group g's rows
        scale_base = w_scale + offs_n if PACK == 1 else w_scale + g * N + offs_n
        acc = acc * tl.load(scale_base, mask=n_mask, other=0.0)[None, :]
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(res + offs_m[:, None] * som + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + split * sos + g * sog + offs_m[:, None] * som + offs_n[None, :], acc.to(out.dtype.element_ty),
             mask=mask)


_small_matmul_tuned = triton.autotune(
    # H200, 1.5B shapes (python -m benchmarks.matmul_sweep): 64 output rows × 128-wide K steps per program,
    # split-K where a launch would leave SMs idle, stream 1.8-3.3 TB/s; 16 × 256 without split: 1.3-3.1
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for n, k, s, w in ((64, 128, 3, 4), (64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 4), (16, 256, 4, 4),
                                (16, 512, 4, 4))],
    key=["N", "K", "BLOCK_M", "PACK", "SPLIT", "SPLIT_IN", "SCALED"])(_small_matmul_kernel)

SMALL_MATMUL_MAX_ROWS = 16  # decode batches up to this use the weight-streaming kernel instead of cuBLAS
LORA_RANK_MULTIPLE = 64  # packed LoRA ranks are padded to this (a multiple of every BLOCK_N)
# split-K until a launch has about one program per SM (64-row blocks × K slices ≥ 0.9 × SMs). H200, 1.5B,
# batch 1 (time-mix input, output, FFN value splits → step ms): (2, 4, 4) 1.350 [this rule], (4, 4, 8) 1.362,
# (4, 8, 8) 1.404, (8, 8, 8) 1.434; no split before (one launch more, LoRAs padded) 1.540
SPLIT_FILL = 0.9
MAX_SPLIT = 8


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k(rows: int, K: int, device: torch.device) -> int:
    """How many K slices a weight-streaming launch over ``rows`` output rows gets: enough programs to give
    every SM one, each slice ≥ 256 wide. Depends on the shape only, never on the batch (a row's sum must not
    depend on how many rows share its step)."""
    sms = _sm_count(_device_index(device)) if device.type == "cuda" else 132
    split = 1
    while split < MAX_SPLIT and triton.cdiv(rows, 64) * split < SPLIT_FILL * sms and K // (2 * split) >= 256:
        split *= 2
    return split


def _launch_small_matmul(x, w, out, res, M: int, N: int, K: int, G: int, x_strides: tuple[int, int, int],
                         out_strides: tuple[int, int, int], split: int = 1, **flags) -> None:
    """``w``: a tensor, or an ``engine.quant.Fp8Matrix`` (fp8 rows, their scales)."""
    w, scale = (w.q, w.scale) if isinstance(w, Fp8Matrix) else (w, None)
    args = (x, w, out, res, scale if scale is not None else out, M, N, K, *x_strides, *out_strides)
    flags.update(IEEE=w.dtype == torch.float32, UPCAST=not x.is_cuda, BLOCK_M=16, SPLIT=split,
                 SCALED=scale is not None)
    if x.is_cuda:
        _small_matmul_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), G, split)](*args, **flags)
    else:  # the interpreter: one fixed configuration
        _small_matmul_kernel[(triton.cdiv(N, 16), G, split)](*args, **flags, BLOCK_N=16, BLOCK_K=64)


def _unsqueezed(w):
    return Fp8Matrix(w.q[None], w.scale) if isinstance(w, Fp8Matrix) else w[None]


def _contiguous(w) -> bool:
    return (w.q if isinstance(w, Fp8Matrix) else w).is_contiguous()


def small_matmul(x: torch.Tensor, w, act: int = ACT_NONE, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped ``act(x[g] @ w[g].T) + residual`` for at most 16 rows. ``x``: [G, M, K] or [M, K] (rows
    contiguous); ``w``: [G, N, K] or [N, K] contiguous (nn.Linear layout), or an ``Fp8Matrix`` [N, K];
    ``residual``: [M, N]."""
    squeeze = x.dim() == 2
    x3, w3 = (x[None], _unsqueezed(w)) if squeeze else (x, w)
    G, M, K = x3.shape
    N = w3.shape[1]
    assert M <= SMALL_MATMUL_MAX_ROWS and x3.stride(2) == 1 and _contiguous(w3)
    if out is None:
        out = torch.empty(G, M, N, dtype=x.dtype, device=x.device)
    out3 = out[None] if out.dim() == 2 else out
    res = residual if residual is not None else out3
    _launch_small_matmul(x3, w3, out3, res, M, N, K, G, (0, x3.stride(0), x3.stride(1)),
                         (0, out3.stride(0), out3.stride(1)), ACT=act, HAS_RES=residual is not None)
    return out3[0] if squeeze else out3


def small_matmul_partials(x: torch.Tensor, w: torch.Tensor, split: int) -> torch.Tensor:
    """``x @ w.T`` (``x`` [M, K], M ≤ 16; ``w`` [N, K]) split ``split`` ways along K: the fp32 partial sums
    ``[split, M, N]`` — more programs stream the weights; the consumer adds them up (``ln_shift_mix``)."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= SMALL_MATMUL_MAX_ROWS and x.stride(1) == 1 and _contiguous(w)
    out = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _launch_small_matmul(x, w, out, out, M, N, K, 1, (0, 0, x.stride(0)), (out.stride(0), 0, N), split,
                         ACT=ACT_NONE, HAS_RES=False)
    return out


@triton.jit
def _quantize_rows_kernel(x, q, scale, M, K, sxm, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``m`` of ``x`` (after ``ACT``) in fp8 with its scale, ``max|row| / 448``; rows past ``M`` (the GEMM's
    padding) are zeros with scale 1."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    width = tl.where(m < M, K, 0)  # a padding row reads nothing
    v = tl.load(x + m.to(tl.int64) * sxm + offs, mask=offs < width, other=0.0).to(tl.float32)
    if ACT == 1:
        v = tl.maximum(v, 0.0)
        v = v * v
    amax = tl.max(tl.abs(v), axis=0)
    # IEEE-rounded divisions (Triton's ``/`` is approximate): the bytes of ``engine.quant.quantize_rows``
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(q + m.to(tl.int64) * K + offs, tl.math.div_rn(v, s).to(q.dtype.element_ty), mask=offs < K)
    tl.store(scale + m, s)


def _quantize_activations(x: torch.Tensor, act: int = ACT_NONE) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(x)`` [M, K] in e4m3 per row, one launch: (rows padded with zeros to a multiple of 16, their scales)."""
    M, K = x.shape
    Mp = -(-M // GEMM_MULTIPLE) * GEMM_MULTIPLE
    assert x.stride(1) == 1
    q = torch.empty(Mp, K, dtype=FP8, device=x.device)
    scale = torch.empty(Mp, dtype=torch.float32, device=x.device)
    BLOCK = triton.next_power_of_2(K)
    _quantize_rows_kernel[(Mp,)](x, q, scale, M, K, x.stride(0), ACT=act, BLOCK=BLOCK,
                                 num_warps=min(16, max(4, BLOCK // 512)))
    return q, scale


def fp8_linear(x: torch.Tensor, w: Fp8Matrix, act: int = ACT_NONE, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """``act(x) @ wᵀ`` on fp8 tensor cores: ``x`` [M, K] quantized per row in one launch (``act`` applied
    first: the FFN's relu² fused into its value projection's input), one ``torch._scaled_mm`` with both scales
    (rows padded to 16 there, dropped here)."""
    M = x.shape[0]
    q, scale = _quantize_activations(x, act)
    y = torch._scaled_mm(q, w.q.t(), scale_a=scale[:, None], scale_b=w.scale[None, :],
                         out_dtype=out_dtype or x.dtype)
    return y[:M] if q.shape[0] != M else y


def fp8_linear_stacked(xs: torch.Tensor, ws: tuple[Fp8Matrix, ...]) -> torch.Tensor:
    """``xs[j] @ ws[j]ᵀ`` for each j → ``[n, M, N]`` (the r/k/v projections): the n inputs quantized in one
    launch and each product written into its slice of the output, no stack copy. Rows not a multiple of 16
    (no padding inside the stack): one ``fp8_linear`` each."""
    n, M, K = xs.shape
    if M % GEMM_MULTIPLE or not xs.is_contiguous():
        return torch.stack([fp8_linear(xs[j], w) for j, w in enumerate(ws)])
    q, scale = _quantize_activations(xs.view(n * M, K))
    out = torch.empty(n, M, ws[0].q.shape[0], dtype=xs.dtype, device=xs.device)
    for j, w in enumerate(ws):
        rows = slice(j * M, (j + 1) * M)
        torch._scaled_mm(q[rows], w.q.t(), scale_a=scale[rows, None], scale_b=w.scale[None, :],
                         out_dtype=xs.dtype, out=out[j])
    return out


def pack_time_mix_in(rkv: list[torch.Tensor], down: list[torch.Tensor], up: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Weights for ``time_mix_in``/``lora_up``: r/k/v [C, C] and the four LoRAs (w, a, v, g), ``down[j]``
    [r_j, C] and ``up[j]`` [C, r_j] (nn.Linear layout) → (r, k, v, downs stacked [3C + R, C]; ups back to back,
    flat; ranks). Each rank is zero-padded to a multiple of 64 (a rank of 0 — layer 0's unused value LoRA —
    becomes 64 zeros); ``rkv`` may be empty (LoRAs only)."""
    ranks = tuple(max(LORA_RANK_MULTIPLE, -(-d.shape[0] // LORA_RANK_MULTIPLE) * LORA_RANK_MULTIPLE) for d in down)
    rows = lambda t, n: torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[0]))  # noqa: E731
    cols = lambda t, n: torch.nn.functional.pad(t, (0, n - t.shape[1]))  # noqa: E731
    packed_in = torch.cat([*rkv, *(rows(d, r) for d, r in zip(down, ranks))]).contiguous()
    packed_up = torch.cat([cols(u, r).reshape(-1) for u, r in zip(up, ranks)]).contiguous()
    return packed_in, packed_up, ranks


def time_mix_in(mixed: torch.Tensor, w: torch.Tensor, ranks: tuple[int, ...], split: int) -> torch.Tensor:
    """The time mix's input projections in one launch, each read at its own size, split-K ``split`` ways:
    ``mixed`` [7, M, C] (the mixes r, k, v, w, a, v, g); ``w`` from ``pack_time_mix_in`` → fp32 partial sums
    ``[split, M, 3C + R]``: r, k, v, then the four LoRA downs (LoRA j in its R_j columns, before its
    activation: ``lora_up`` applies it). Without r/k/v in ``w``: ``[split, M, R]``."""
    _, M, K = mixed.shape
    N = w.shape[0]
    rkv_rows = (N - sum(ranks)) // 3
    assert M <= SMALL_MATMUL_MAX_ROWS and mixed.stride(2) == 1 and rkv_rows in (0, K)
    out = torch.empty(split, M, N, dtype=torch.float32, device=mixed.device)
    _launch_small_matmul(mixed, w, out, out, M, N, K, 1, (0, mixed.stride(0), mixed.stride(1)),
                         (out.stride(0), 0, N), split, ACT=ACT_NONE, HAS_RES=False, PACK=PACK_TIME_MIX_IN,
                         GC=rkv_rows, R0=ranks[0], R1=ranks[1], R2=ranks[2])
    return out


def lora_up(lo: torch.Tensor, w: torch.Tensor, ranks: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The four LoRA up projections: ``lo`` [S, M, R], ``time_mix_in``'s partial sums of the downs (a column
    slice) → ``[4, M, C]`` in ``dtype``; the downs' activations (tanh on w, sigmoid on g) are applied here."""
    S, M, R = lo.shape
    N = w.numel() // R
    assert lo.stride(2) == 1 and R == sum(ranks)
    out = torch.empty(4, M, N, dtype=dtype, device=lo.device)
    _launch_small_matmul(lo, w, out, out, M, N, R, 4, (lo.stride(0), 0, lo.stride(1)),
                         (0, out.stride(0), out.stride(1)), ACT=ACT_NONE, HAS_RES=False, SPLIT_IN=S,
                         PACK=PACK_LORA_UP, R0=ranks[0], R1=ranks[1], R2=ranks[2])
    return out


def small_matmul_ref(x, w, act: int = ACT_NONE, residual=None):
    y = torch.matmul(x.float(), w.float().transpose(-1, -2))
    if act == ACT_RELU_SQUARE:
        y = torch.relu(y).square()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


@triton.jit
def _relu_square_kernel(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.maximum(tl.load(x + offs, mask=mask).to(tl.float32), 0.0)
    tl.store(x + offs, (v * v).to(x.dtype.element_ty), mask=mask)


def relu_square_(x: torch.Tensor) -> torch.Tensor:
    """In place ``relu(x)²`` in one pass (the large-batch FFN; small batches fuse it into the matmul)."""
    n = x.numel()
    _relu_square_kernel[(triton.cdiv(n, 4096),)](x, n, BLOCK=4096, num_warps=8)
    return x


# -- prefill: the time mix's elementwise work around fla's chunked kernel, one pass in and one out -------------

@triton.jit
def _token_head_tile(h, T, N: tl.constexpr, C: tl.constexpr, BT: tl.constexpr):
    """This program's BT tokens × head h of a [T, C] tensor: rows, columns, row mask, element offsets."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = h * N + tl.arange(0, N)
    return rows, cols, (rows < T)[:, None], rows[:, None].to(tl.int64) * C + cols[None, :]


@triton.jit
def _prefill_mix_in_kernel(r, k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a, r_k,
                           log_decay, k_out, v_out, a_out, b_out, bonus, T,
                           H: tl.constexpr, N: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                           IS_FIRST_LAYER: tl.constexpr):
    """fla's inputs for a block of tokens × one head: log decay, k (iclr-scaled), v (value residual),
    a = -k̂, b = k̂·iclr; plus the per-head bonus coefficient Σ r·k·r_k."""
    h = tl.program_id(1)
    rows, cols, mask, idx = _token_head_tile(h, T, N, C, BT)
    kr = tl.load(k + idx, mask=mask, other=0.0).to(tl.float32)
    vr = tl.load(v + idx, mask=mask, other=0.0).to(tl.float32)
    iclr = tl.sigmoid(tl.load(a0 + cols).to(tl.float32)[None, :]
                      + tl.load(a_lora + idx, mask=mask, other=0.0).to(tl.float32))
    if IS_FIRST_LAYER:
        vv = vr
        tl.store(v_first + idx, vr.to(v_first.dtype.element_ty), mask=mask)
    else:
        vmix = tl.sigmoid(tl.load(v0 + cols).to(tl.float32)[None, :]
                          + tl.load(v_lora + idx, mask=mask, other=0.0).to(tl.float32))
        vf = tl.load(v_first + idx, mask=mask, other=0.0).to(tl.float32)
        vv = vr + (vf - vr) * vmix
    kk = kr * tl.load(k_k + cols).to(tl.float32)[None, :]
    kk = kk / tl.maximum(tl.sqrt(tl.sum(kk * kk, axis=1)), 1e-12)[:, None]
    k2 = kr * (1.0 + (iclr - 1.0) * tl.load(k_a + cols).to(tl.float32)[None, :])
    w = tl.load(w0 + cols).to(tl.float32)[None, :] + tl.load(w_lora + idx, mask=mask, other=0.0).to(tl.float32)
    out_ty = k_out.dtype.element_ty
    tl.store(log_decay + idx, (-0.606531 * tl.sigmoid(w)).to(out_ty), mask=mask)
    tl.store(k_out + idx, k2.to(out_ty), mask=mask)
    tl.store(v_out + idx, vv.to(out_ty), mask=mask)
    tl.store(a_out + idx, (-kk).to(out_ty), mask=mask)
    tl.store(b_out + idx, (kk * iclr).to(out_ty), mask=mask)
    rr = tl.load(r + idx, mask=mask, other=0.0).to(tl.float32)
    coef = tl.sum(rr * k2 * tl.load(r_k + cols).to(tl.float32)[None, :], axis=1)
    tl.store(bonus + rows * H + h, coef, mask=rows < T)


@triton.jit
def _prefill_mix_out_kernel(o, v, bonus, g, ln_w, ln_b, out, T, eps,
                            H: tl.constexpr, N: tl.constexpr, C: tl.constexpr, BT: tl.constexpr):
    """Per-head GroupNorm of fla's output, plus the bonus (Σ r·k·r_k)·v, times the gate."""
    h = tl.program_id(1)
    rows, cols, mask, idx = _token_head_tile(h, T, N, C, BT)
    y = tl.load(o + idx, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(y, axis=1) / N
    d = y - mean[:, None]
    var = tl.sum(d * d, axis=1) / N
    yn = d / tl.sqrt(var + eps)[:, None] * tl.load(ln_w + cols).to(tl.float32)[None, :] \
        + tl.load(ln_b + cols).to(tl.float32)[None, :]
    coef = tl.load(bonus + rows * H + h, mask=rows < T, other=0.0)
    vv = tl.load(v + idx, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(g + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + idx, ((yn + coef[:, None] * vv) * gate).to(out.dtype.element_ty), mask=mask)


PREFILL_BT = 16  # tokens per program


def prefill_mix_in(r, k, v, w_lora, a_lora, v_lora, v_first, p: dict, layer: int, n_head: int):
    """Returns (log_decay, k, v, a, b, bonus): fla's inputs ``[T, C]`` in ``r.dtype`` and ``bonus [T, H]`` fp32.
    On the first layer ``v_first`` (``[T, C]``) receives ``v``."""
    T, C = r.shape
    N = C // n_head
    log_decay, k2, vv, a, b = (torch.empty_like(r) for _ in range(5))
    bonus = torch.empty(T, n_head, dtype=torch.float32, device=r.device)
    _prefill_mix_in_kernel[(triton.cdiv(T, PREFILL_BT), n_head)](
        r, k, v, w_lora, a_lora, v_lora, v_first, p["w0"], p["a0"], p["v0"] if layer else p["a0"], p["k_k"],
        p["k_a"], p["r_k"], log_decay, k2, vv, a, b, bonus, T, H=n_head, N=N, C=C, BT=PREFILL_BT,
        IS_FIRST_LAYER=layer == 0, num_warps=4)
    return log_decay, k2, vv, a, b, bonus


def prefill_mix_out(o, v, bonus, g, p: dict, eps: float) -> torch.Tensor:
    T, C = v.shape
    H = bonus.shape[1]
    out = torch.empty_like(v)
    _prefill_mix_out_kernel[(triton.cdiv(T, PREFILL_BT), H)](o, v, bonus, g, p["ln_x.weight"], p["ln_x.bias"], out,
                                                             T, eps, H=H, N=C // H, C=C, BT=PREFILL_BT, num_warps=4)
    return out


def prefill_mix_in_ref(r, k, v, w_lora, a_lora, v_lora, v_first, p: dict, layer: int, n_head: int):
    T, C = r.shape
    f = lambda t: t.float()  # noqa: E731
    kr, vr = f(k), f(v)
    iclr = torch.sigmoid(f(p["a0"]) + f(a_lora))
    if layer == 0:
        v_first.copy_(v)
        vv = vr
    else:
        vv = vr + (f(v_first) - vr) * torch.sigmoid(f(p["v0"]) + f(v_lora))
    kk = torch.nn.functional.normalize((kr * f(p["k_k"])).view(T, n_head, -1), dim=-1).view(T, C)
    k2 = kr * (1 + (iclr - 1) * f(p["k_a"]))
    log_decay = -DECAY_SCALE * torch.sigmoid(f(p["w0"]) + f(w_lora))
    bonus = (f(r) * k2 * f(p["r_k"]).view(C)).view(T, n_head, -1).sum(-1)
    return (*(t.to(r.dtype) for t in (log_decay, k2, vv, -kk, kk * iclr)), bonus)


def prefill_mix_out_ref(o, v, bonus, g, p: dict, eps: float) -> torch.Tensor:
    T, C = v.shape
    H = bonus.shape[1]
    y = torch.nn.functional.group_norm(o.reshape(T, C).float(), H, p["ln_x.weight"].float(), p["ln_x.bias"].float(),
                                       eps=eps)
    bonus_v = (bonus[..., None] * v.float().view(T, H, -1)).view(T, C)
    return ((y + bonus_v) * g.float()).to(v.dtype)


@triton.jit
def _prefill_ln_shift_mix_kernel(x, ln_w, ln_b, shift, prev_slot, end_seq, mix, out, new_shift, T, eps,
                                 C: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    """One token of a packed prefill: LayerNorm of it and of its predecessor (or, for a sequence's first
    token, the slot's shift state), the K mixes; a sequence's last token leaves its normalized row in
    ``new_shift[seq]`` (written to the pool after the launch: first and last tokens race otherwise)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < C
    w = tl.load(ln_w + offs, mask=mask).to(tl.float32)
    bias = tl.load(ln_b + offs, mask=mask).to(tl.float32)
    xf = tl.load(x + t * C + offs, mask=mask, other=0.0).to(tl.float32)
    xb = _layer_norm_row(xf, mask, w, bias, C, eps).to(x.dtype.element_ty)
    pslot = tl.load(prev_slot + t).to(tl.int64)
    if pslot >= 0:  # first token of its sequence
        prev = tl.load(shift + pslot * C + offs, mask=mask).to(x.dtype.element_ty)
    else:
        pf = tl.load(x + (t - 1) * C + offs, mask=mask, other=0.0).to(tl.float32)
        prev = _layer_norm_row(pf, mask, w, bias, C, eps).to(x.dtype.element_ty)
    seq = tl.load(end_seq + t).to(tl.int64)
    if seq >= 0:  # last token of its sequence
        tl.store(new_shift + seq * C + offs, xb.to(new_shift.dtype.element_ty), mask=mask)
    _store_mixes(xb, prev, mix, out, t, T, offs, mask, C, K)


def prefill_ln_shift_mix(x: torch.Tensor, ln: tuple[torch.Tensor, torch.Tensor], shift: torch.Tensor,
                         slots: torch.Tensor, prev_slot: torch.Tensor, end_seq: torch.Tensor, mix: torch.Tensor,
                         eps: float = 1e-5) -> torch.Tensor:
    """Packed prefill: ``xx = LayerNorm(x)``; ``out[j, t] = xx[t] + (prev_t - xx[t]) * mix[j]`` where ``prev_t``
    is ``xx[t-1]`` inside a sequence and ``shift[prev_slot[t]]`` at its start; then each sequence's slot
    takes its last ``xx``. ``prev_slot[t]``: the slot at a first token, else -1; ``end_seq[t]``: the
    sequence index at a last token, else -1; ``slots[s]``: sequence s's slot."""
    T, C = x.shape
    BLOCK = triton.next_power_of_2(C)
    out = torch.empty(mix.shape[0], T, C, dtype=x.dtype, device=x.device)
    new_shift = torch.empty(len(slots), C, dtype=shift.dtype, device=x.device)
    _prefill_ln_shift_mix_kernel[(T,)](x, ln[0], ln[1], shift, prev_slot, end_seq, mix, out, new_shift, T, eps,
                                       C=C, K=mix.shape[0], BLOCK=BLOCK, num_warps=8 if BLOCK >= 2048 else 4)
    shift[slots] = new_shift
    return out


def prefill_ln_shift_mix_ref(x, ln, shift, slots, starts, ends, mix, eps: float = 1e-5):
    xx = torch.nn.functional.layer_norm(x, (x.shape[1],), *ln, eps=eps)
    prev = torch.roll(xx, 1, 0)
    prev[starts] = shift[slots].to(xx.dtype)
    shift[slots] = xx[ends].to(shift.dtype)
    return (xx.float()[None] + (prev.float() - xx.float())[None] * mix.float()[:, None, :]).to(x.dtype)

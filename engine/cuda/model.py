"""RWKV-7 on CUDA: fla packed chunked prefill, fused batched decode, CUDA graphs.

Same interface as ``engine.model.ReferenceRwkv7`` (``prefill``, ``decode``) and the
same pool layout (official: wkv ``[value, key]``; fla's is the transpose, handled
at the prefill boundary).

Decode per layer: LayerNorm fused with the token-shift mix (7 mixes, shift
state gathered/scattered by slot) → r/k/v projections → the four LoRA down
projections with tanh/sigmoid → the four LoRA ups (cuBLAS: zero-padded to one rank;
the small-batch kernels read each LoRA at its own rank, no padding) →
fused wkv kernel (decay, iclr, value residual, key update, state update,
readout, GroupNorm, bonus, gate) → output projection + residual → LayerNorm
fused with the FFN shift mix → key projection, relu² → value projection +
residual. Batches of up to 16 rows (batch-1 latency) run every projection
through a weight-streaming Triton kernel, r/k/v and the LoRA downs in one
launch, split along K where a launch would leave SMs idle (fp32 partial sums
added by the next kernel: 8 launches per layer); larger batches use cuBLAS
(tensor cores), with the
LayerNorm+shift and wkv kernels overlapping the GEMMs' tails (programmatic
dependent launch).
All weights are kept in nn.Linear layout ``[out, in]``. With fp8 weights (``engine.quant``) the projections and
the FFN are ``Fp8Matrix``es: the weight-streaming kernels read them directly, larger batches multiply on fp8
tensor cores (``fp8_linear``: activations quantized per token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cuda.graphs import DecodeGraphs
from engine.cuda.prefill_graphs import PrefillBucket, PrefillGraphs, PrefillInputs
from engine.cuda.varlen import PackedChunks
from engine.device import to_device
from engine.quant import SCALE_SUFFIX, Fp8Matrix, quantize_rows
from engine.cuda.kernels import (ACT_RELU_SQUARE, SMALL_MATMUL_MAX_ROWS, fp8_linear, fp8_linear_stacked,
                                 ln_shift_mix, lora_up, pack_time_mix_in, prefill_ln_shift_mix, prefill_mix_in,
                                 prefill_mix_out, relu_square_, small_matmul, small_matmul_partials, split_k,
                                 time_mix_in, wkv7_decode)
from engine.scoring import score_positions
from engine.sequence import TokenLogprob
from engine.state import StatePool
from engine.weights import Rwkv7Weights

log = logging.getLogger(__name__)

ATT_MIX_ORDER = ("r", "k", "v", "w", "a", "v", "g")  # rkv = mixes[0:3]; LoRA inputs (w, a, v, g) = mixes[3:7]
LORA_ORDER = ("w", "a", "v", "g")
DECAY_LOWER_BOUND = -0.6066  # log decay = -exp(-0.5)·sigmoid(·) ≥ -0.60653


@dataclass
class Layer:
    ln1: tuple[torch.Tensor, torch.Tensor]
    ln2: tuple[torch.Tensor, torch.Tensor]
    att_mix: torch.Tensor  # [7, C]
    rkv: torch.Tensor | tuple[Fp8Matrix, ...]  # [3, C, C] (out, in): a view of time_mix_in; fp8: r, k, v
    lora_down: torch.Tensor  # [4, D, C] zero-padded to the largest rank (out, in): cuBLAS batches
    lora_up: torch.Tensor  # [4, C, D]
    time_mix_in: tuple  # (r, k, v, LoRA downs [3C + R, C]; LoRA ups flat; ranks): the small-batch kernels'
    splits: tuple[int, int, int]  # split-K of the small-batch time_mix_in, output and FFN value projections
    output: torch.Tensor | Fp8Matrix  # [C, C] (out, in)
    ffn_mix: torch.Tensor  # [1, C]
    ffn_key: torch.Tensor | Fp8Matrix  # [F, C]
    ffn_value: torch.Tensor | Fp8Matrix  # [C, F]
    p: dict  # vectors for the wkv kernel: w0 a0 v0 k_k k_a r_k ln_x.weight ln_x.bias


class CudaRwkv7:
    name = "cuda"

    def __init__(self, weights: Rwkv7Weights, pool: StatePool, enforce_eager: bool = False,
                 max_graph_batch: int | None = None, max_prefill_tokens: int = 8192,
                 prefill_graphs: bool = True):
        self.shape = s = weights.shape
        self.pool = pool
        self.eps = s.ln_x_eps
        t = weights.tensors
        self.dtype = t["head.weight"].dtype  # the activations' (the projections may be fp8)
        self.emb = t["emb.weight"].to(self.dtype)
        self.ln_out = (t["ln_out.weight"], t["ln_out.bias"])
        self.head = t["head.weight"]
        self.layers = [self._prepare_layer(t, i) for i in range(s.n_layer)]
        self.small_batch_max = SMALL_MATMUL_MAX_ROWS  # tests set 0 to run the cuBLAS path at any size
        self._mm_out_dtype: bool | None = None  # torch.mm(..., out_dtype=float32) works here; None: not tried
        self.scratch_slot = pool.num_slots - 1  # padding rows of a graph batch write here
        self.graphs = None if enforce_eager else DecodeGraphs(self._decode_eager, max_graph_batch or self.scratch_slot,
                                                              self.scratch_slot, pool.wkv.device)
        chunk_size = PackedChunks.direct_chunk_size(DECAY_LOWER_BOUND)
        eager_prefill = enforce_eager or not prefill_graphs or chunk_size is None or not pool.wkv.is_cuda
        self.prefill_graphs = None if eager_prefill else PrefillGraphs(
            self._prefill_graphed, max_prefill_tokens, self.scratch_slot, chunk_size, self.scratch_slot,
            s.vocab_size, pool.wkv.device)

    def _prepare_layer(self, t: dict, i: int) -> Layer:
        p = lambda name: t[f"blocks.{i}.{name}"]  # noqa: E731
        C, dt, dev = self.shape.n_embd, self.dtype, self.emb.device
        ranks = [p(f"att.{x}1").shape[1] if (x != "v" or i > 0) else 0 for x in LORA_ORDER]
        D = max(ranks)
        down = torch.zeros(4, D, C, dtype=dt, device=dev)
        up = torch.zeros(4, C, D, dtype=dt, device=dev)
        for j, (x, r) in enumerate(zip(LORA_ORDER, ranks)):
            if r:  # official layout is (in, out): x @ w1 @ w2
                down[j, :r], up[j, :, :r] = p(f"att.{x}1").t(), p(f"att.{x}2").t()
        downs, ups = [down[j, :r] for j, r in enumerate(ranks)], [up[j, :, :r] for j, r in enumerate(ranks)]
        names = [f"blocks.{i}.att.{n}.weight" for n in ("receptance", "key", "value")]
        if names[0] + SCALE_SUFFIX in t:  # fp8: r/k/v rows, then the LoRA downs quantized too
            packed_downs, packed_up, packed_ranks = pack_time_mix_in([], downs, ups)
            dq, ds = quantize_rows(packed_downs)
            rkv_in = Fp8Matrix(torch.cat([t[n] for n in names] + [dq]).contiguous(),
                               torch.cat([t[n + SCALE_SUFFIX] for n in names] + [ds]).contiguous())
            packed = (rkv_in, packed_up, packed_ranks)
            rkv = tuple(rkv_in.rows(j * C, (j + 1) * C) for j in range(3))
        else:
            packed = pack_time_mix_in([t[n] for n in names], downs, ups)
            rkv = packed[0][:3 * C].view(3, C, C)
        vec = {n: p(f"att.{n}") for n in ("w0", "a0", "k_k", "k_a", "r_k", "ln_x.weight", "ln_x.bias")}
        vec["v0"] = p("att.v0") if i > 0 else vec["a0"]
        return Layer(
            ln1=(p("ln1.weight"), p("ln1.bias")), ln2=(p("ln2.weight"), p("ln2.bias")),
            att_mix=torch.stack([p(f"att.x_{x}") for x in ATT_MIX_ORDER]).to(dt).contiguous(),
            rkv=rkv, lora_down=down, lora_up=up, time_mix_in=packed,
            output=_matrix(t, f"blocks.{i}.att.output.weight"),
            splits=(split_k(packed[0].shape[0], C, dev), split_k(C, C, dev), split_k(C, 4 * C, dev)),
            ffn_mix=p("ffn.x_k").to(dt)[None].contiguous(), ffn_key=_matrix(t, f"blocks.{i}.ffn.key.weight"),
            ffn_value=_matrix(t, f"blocks.{i}.ffn.value.weight"), p=vec)

    # -- decode ----------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(len(token_ids)):
            return self.graphs.run(token_ids, slots)
        return self._decode_eager(token_ids, slots)

    def _decode_eager(self, token_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if token_ids.shape[0] <= self.small_batch_max:
            return self._decode_small(token_ids, slots)
        return self._decode_large(token_ids, slots)

    def _step_buffers(self, batch: int) -> tuple[torch.Tensor, ...]:
        """A decode step's activations: v_first, the 7 time-mix inputs, the FFN input, the wkv output."""
        C, device = self.shape.n_embd, self.emb.device
        empty = lambda *shape: torch.empty(*shape, dtype=self.dtype, device=device)  # noqa: E731
        return empty(batch, C), empty(7, batch, C), empty(1, batch, C), empty(batch, C)

    def _decode_large(self, token_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """cuBLAS projections; LayerNorm+shift and wkv overlap the GEMMs before them (PDL)."""
        pool = self.pool
        x = self.emb[token_ids]
        v_first, att_mixed, ffn_mixed, att = self._step_buffers(token_ids.shape[0])
        residual = None  # fp8: the last projection's product, added to x by the next LayerNorm kernel
        for i, L in enumerate(self.layers):
            ln_shift_mix(x, L.ln1, pool.att_shift[i], slots, L.att_mix, att_mixed, large_batch=True,
                         partials=residual)
            rkv, up = self._time_mix_projections(L, att_mixed)
            wkv7_decode(pool.wkv[i], slots, rkv[0], rkv[1], rkv[2], up[0], up[1], up[2], up[3], v_first,
                        L.p, i, self.eps, att, large_batch=True)
            residual = _add_linear_(x, att, L.output, defer=True)
            ln_shift_mix(x, L.ln2, pool.ffn_shift[i], slots, L.ffn_mix, ffn_mixed, large_batch=True,
                         partials=residual)
            residual = self._channel_mix(L, ffn_mixed[0], x, defer=True)
        if residual is not None:
            x.add_(residual[0])
        return self._head(self._normed(x))

    def _decode_small(self, token_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Up to 16 rows: every projection streams its weights through our kernel, split along K where that
        puts more loads in flight (the r/k/v + LoRA, output and FFN value projections); their fp32 partial
        sums are added by the kernel that consumes them (LoRA up, wkv, the next LayerNorm: residual)."""
        pool, C = self.pool, self.shape.n_embd
        x = self.emb[token_ids]
        v_first, att_mixed, ffn_mixed, att = self._step_buffers(token_ids.shape[0])
        residual = None  # the last projection's partial sums, not yet added to x
        for i, L in enumerate(self.layers):
            ln_shift_mix(x, L.ln1, pool.att_shift[i], slots, L.att_mix, att_mixed, partials=residual)
            w_in, w_up, ranks = L.time_mix_in
            y = time_mix_in(att_mixed, w_in, ranks, L.splits[0])
            up = lora_up(y[:, :, 3 * C:], w_up, ranks, self.dtype)
            wkv7_decode(pool.wkv[i], slots, y[:, :, :C], y[:, :, C:2 * C], y[:, :, 2 * C:3 * C], up[0], up[1],
                        up[2], up[3], v_first, L.p, i, self.eps, att)
            residual = small_matmul_partials(att, L.output, L.splits[1])
            ln_shift_mix(x, L.ln2, pool.ffn_shift[i], slots, L.ffn_mix, ffn_mixed, partials=residual)
            h = small_matmul(ffn_mixed[0], L.ffn_key, ACT_RELU_SQUARE)
            residual = small_matmul_partials(h, L.ffn_value, L.splits[2])
        x = (x.float() + residual.sum(0)).to(self.dtype)
        return self._head(self._normed(x))

    @staticmethod
    def _time_mix_projections(L: Layer, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cuBLAS: r/k/v ``[3, T, C]`` from mixes 0-2 and the four LoRA outputs (w, a, v, g) ``[4, T, C]`` from
        mixes 3-6 (zero-padded to one rank)."""
        lo = torch.bmm(mixed[3:7], L.lora_down.transpose(1, 2))
        lo[0].tanh_()
        lo[3].sigmoid_()
        if isinstance(L.rkv, tuple):  # fp8: the three inputs quantized in one launch, one GEMM each
            rkv = fp8_linear_stacked(mixed[0:3], L.rkv)
        else:
            rkv = torch.bmm(mixed[0:3], L.rkv.transpose(1, 2))
        return rkv, torch.bmm(lo, L.lora_up.transpose(1, 2))

    @staticmethod
    def _channel_mix(L: Layer, mixed: torch.Tensor, x: torch.Tensor, defer: bool = False) -> torch.Tensor | None:
        """cuBLAS: ``x += relu(mixed @ key.T)² @ value.T``, in place (fp8: relu² fused into the value GEMM's input
        quantization; ``defer``: the product returned as for ``_add_linear_``)."""
        if isinstance(L.ffn_key, Fp8Matrix):
            y = fp8_linear(fp8_linear(mixed, L.ffn_key), L.ffn_value, act=ACT_RELU_SQUARE)
            return _added_or_deferred(x, y, defer)
        x.addmm_(relu_square_(F.linear(mixed, L.ffn_key)), L.ffn_value.t())
        return None

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """The output LayerNorm (what the head reads)."""
        return F.layer_norm(x, (self.shape.n_embd,), *self.ln_out)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits straight out of the matmul where torch can (no separate [B, vocab] cast pass)."""
        if x.is_cuda and self._mm_out_dtype is not False:
            try:
                logits = torch.mm(x, self.head.t(), out_dtype=torch.float32)
                self._mm_out_dtype = True
                return logits
            except (TypeError, RuntimeError, NotImplementedError):
                self._mm_out_dtype = False  # this torch has no bf16 → fp32 mm: found once, not per step
        return F.linear(x, self.head).float()

    # -- prefill ---------------------------------------------------------------------

    def prefill(self, chunks: list[list[int]], slots: list[int]) -> torch.Tensor:
        """All chunks packed into one sequence with ``cu_seqlens``; returns each chunk's last logits."""
        return self.prefill_with_scores(chunks, slots, {})[0]

    @torch.inference_mode()
    def prefill_with_scores(self, chunks: list[list[int]], slots: list[int], score: dict[int, tuple[list[int], int]],
                            eager: bool = False) -> tuple[torch.Tensor, dict[int, list[TokenLogprob]]]:
        """``prefill``, and for each chunk ``i`` in ``score`` = {i: (targets, k)}: the logprobs of ``targets``
        predicted by the chunk's first ``len(targets)`` positions (``engine.scoring``). A captured graph runs
        it where one fits and nothing is scored, unless ``eager``."""
        if not score and not eager and self.prefill_graphs is not None:
            rows = self.prefill_graphs.run(chunks, slots)
            if rows is not None:
                return rows, {}
        device = self.emb.device
        packed = PackedChunks([len(c) for c in chunks], device, DECAY_LOWER_BOUND)
        cu_cpu, cu = packed.cu_cpu, packed.cu
        tokens = to_device([t for c in chunks for t in c], torch.long, device)
        boundaries = torch.full((2, len(tokens)), -1, dtype=torch.int32)  # first token → slot; last → sequence
        boundaries[0, cu_cpu[:-1]] = torch.tensor(slots, dtype=torch.int32)
        boundaries[1, cu_cpu[1:] - 1] = torch.arange(len(chunks), dtype=torch.int32)
        prev_slot, end_seq = boundaries.pin_memory().to(device, non_blocking=True)
        x = self._prefill_layers(tokens, to_device(slots, torch.long, device), prev_slot, end_seq, packed)
        scores = {i: score_positions(self._normed(x[int(cu_cpu[i]):int(cu_cpu[i]) + len(targets)]), self._head,
                                     targets, k)
                  for i, (targets, k) in score.items()}
        return self._head(self._normed(x[cu[1:] - 1])), scores

    def _prefill_graphed(self, inputs: PrefillInputs, bucket: PrefillBucket) -> torch.Tensor:
        """A bucket's prefill on fixed shapes, all on the device (what ``PrefillGraphs`` captures)."""
        packed = PackedChunks.on_device(inputs.cu, inputs.chunk_indices, bucket.chunk_size, DECAY_LOWER_BOUND)
        x = self._prefill_layers(inputs.tokens, inputs.slots, inputs.prev_slot.to(torch.int32),
                                 inputs.end_seq.to(torch.int32), packed)
        return self._head(self._normed(x[inputs.cu[1:] - 1]))

    def _prefill_layers(self, tokens: torch.Tensor, slot_t: torch.Tensor, prev_slot: torch.Tensor,
                        end_seq: torch.Tensor, packed: PackedChunks) -> torch.Tensor:
        """The packed tokens through every layer (states read and written by slot); the last hidden states."""
        x = self.emb[tokens]
        v_first = None
        for i, L in enumerate(self.layers):
            mixed = prefill_ln_shift_mix(x, L.ln1, self.pool.att_shift[i], slot_t, prev_slot, end_seq, L.att_mix)
            att, v_first = self._prefill_time_mix(i, L, mixed, slot_t, packed, v_first)
            _add_linear_(x, att, L.output)
            kx = prefill_ln_shift_mix(x, L.ln2, self.pool.ffn_shift[i], slot_t, prev_slot, end_seq, L.ffn_mix)[0]
            self._channel_mix(L, kx, x)
        return x

    def _prefill_time_mix(self, i, L: Layer, mixed, slots, packed: PackedChunks, v_first):
        T, C = mixed.shape[1], self.shape.n_embd
        H, N = self.shape.n_head, self.shape.head_size
        (r, k, v), up = self._time_mix_projections(L, mixed)
        if i == 0:
            v_first = torch.empty_like(v)
        log_decay, k2, v, a, b, bonus = prefill_mix_in(r, k, v, up[0], up[1], up[2], v_first, L.p, i, H)
        h0 = self.pool.wkv[i][slots].transpose(-1, -2).float().contiguous()  # fla: [N, H, K, V]
        as_heads = lambda t: t.view(1, T, H, N)  # noqa: E731
        o, h_final = packed.scan(as_heads(r), as_heads(log_decay), as_heads(k2), as_heads(v), as_heads(a),
                                 as_heads(b), h0)
        self.pool.wkv[i][slots] = h_final.transpose(-1, -2).to(self.pool.wkv.dtype)
        return prefill_mix_out(o.view(T, C), v, bonus, up[3], L.p, self.eps), v_first


def _matrix(t: dict, name: str) -> torch.Tensor | Fp8Matrix:
    """A weight matrix as the layer keeps it: the tensor, or fp8 with its scales."""
    scale = t.get(name + SCALE_SUFFIX)
    return t[name] if scale is None else Fp8Matrix(t[name], scale)


def _add_linear_(x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor | Fp8Matrix, defer: bool = False
                 ) -> torch.Tensor | None:
    """``x += inp @ wᵀ``, in place: the residual stream (cuBLAS adds it in the GEMM). ``defer`` with fp8 weights:
    the product is returned as ``[1, B, C]`` instead, for the next LayerNorm kernel to add (``ln_shift_mix``'s
    partials; the same rounding as an add of its own, one launch fewer)."""
    if isinstance(w, Fp8Matrix):
        return _added_or_deferred(x, fp8_linear(inp, w), defer)
    x.addmm_(inp, w.t())
    return None


def _added_or_deferred(x: torch.Tensor, y: torch.Tensor, defer: bool) -> torch.Tensor | None:
    if defer:
        return y[None]
    x.add_(y)
    return None

"""Micro-benchmark of the small-batch weight-streaming matmul on the 1.5B decode shapes (needs a GPU).

    python -m benchmarks.matmul_sweep            # SHAPES=output,ffn_value MS=1 to narrow it

Each measurement: a CUDA graph of 24 launches on 24 distinct weight copies (weights come from HBM, as in
the model), per-launch µs = graph time / 24. "current" is ``small_matmul`` as the model runs it; the sweep
is a plain variant of it over tiles, warps, stages and split-K (fp32 partials written, not added up).
"""
import itertools
import os
import time

import torch
import triton
import triton.language as tl

from benchmarks.timing import cuda_time_ms
from engine.cuda.kernels import small_matmul

L = 24


@triton.jit
def _mm(x, w, out, M, N, K, KS, sxg, sxm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    G = tl.num_programs(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_base = x + g * sxg + offs_m[:, None] * sxm
    w_base = w + g * N * K + offs_n[:, None].to(tl.int64) * K
    for k0 in range(s * KS, s * KS + KS, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_base + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        wt = tl.load(w_base + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc)
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out + ((s * G + g) * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _noop(x):
    tl.store(x + tl.program_id(0), 1.0)


def graph_us(launch, reps=30):
    launch(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(L):
            launch(i)
    ms = cuda_time_ms(g.replay, iters=reps)
    return ms * 1e3 / L


SHAPES = {  # name: (G, N, K)
    "rkv": (3, 2048, 2048), "lora_down": (4, 256, 2048), "lora_down_packed": (1, 512, 2048),
    "lora_up": (4, 2048, 256), "lora_up_packed": (4, 2048, 128), "output": (1, 2048, 2048),
    "ffn_key": (1, 8192, 2048), "ffn_value": (1, 2048, 8192),
}
only = os.environ.get("SHAPES")
if only:
    SHAPES = {k: v for k, v in SHAPES.items() if k in only.split(",")}
MS = [int(m) for m in os.environ.get("MS", "1,16").split(",")]
CONFIGS = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)))
SPLITS = (1, 2, 4, 8)


def main() -> None:
    t0 = time.time()
    buf = torch.zeros(1024, device="cuda")
    print(f"noop launch: {graph_us(lambda i: _noop[(1,)](buf)):.2f} us; 132-program noop: "
          f"{graph_us(lambda i: _noop[(132,)](buf)):.2f} us", flush=True)
    summary = {}
    for name, (G, N, K) in SHAPES.items():
        ws = [torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
        mb = G * N * K * 2 / 1e6
        for M in MS:
            x = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
            base = graph_us(lambda i: small_matmul(x, ws[i]))
            res = []
            for (bn, bk, nw, st), sk in itertools.product(CONFIGS, SPLITS):
                if K % (sk * bk) or N % bn:
                    continue
                out = torch.empty(sk, G, M, N, device="cuda", dtype=torch.float32)
                grid = (N // bn, G, sk)
                try:
                    us = graph_us(lambda i: _mm[grid](x, ws[i], out, M, N, K, K // sk, x.stride(0), x.stride(1),
                                                      BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st))
                except Exception:  # noqa: BLE001 (out of shared memory etc.)
                    continue
                res.append((us, f"n{bn} k{bk} w{nw} s{st} split{sk}"))
            res.sort()
            summary[(name, M)] = (base, res[0][0])
            print(f"{name} M={M} ({mb:.1f} MB): current {base:.2f} us ({mb / base:.2f} TB/s); best: "
                  + "; ".join(f"{u:.2f} [{c}] {mb / u:.2f} TB/s" for u, c in res[:4])
                  + f"  [{time.time() - t0:.0f}s]", flush=True)
        ws.clear()
        torch.cuda.empty_cache()

    for M in MS:
        per_layer = ["rkv", "lora_down", "lora_up", "output", "ffn_key", "ffn_value"]
        packed = ["rkv", "lora_down_packed", "lora_up_packed", "output", "ffn_key", "ffn_value"]
        for label, names in (("current layout", per_layer), ("packed LoRA", packed)):
            if all((n, M) in summary for n in names):
                b = sum(summary[(n, M)][0] for n in names)
                o = sum(summary[(n, M)][1] for n in names)
                print(f"M={M} {label}: per layer current {b:.1f} us, best configs {o:.1f} us; x24 = {b * 24:.0f} -> {o * 24:.0f} us")


if __name__ == "__main__":
    main()

"""A small TRAINED byte-level RWKV-7, built on CPU, for comparing reduced-precision accuracy on trained vs random
weights of one shape.

``benchmarks.decode_accuracy`` measures how far bf16 recurrent state and fp8 weights move the next-token
distribution from the fp32 reference. On random weights that error may be unrepresentative (a random net is
chaotic: a perturbation grows layer by layer), so this trains the random model of ``engine.demo`` on bytes (token
id = byte value, vocabulary 256) and writes it in the official ``.pth`` layout, the one ``random_state_dict``
writes, to run the accuracy benchmark on both:

    python -m benchmarks.tiny_trained_model --out tiny.pth
    python -m benchmarks.decode_accuracy --model tiny.pth --device cpu --positions 256 --streams 4 --block 64 --out -

Training starts from ``random_state_dict(layers, width, vocab, head_size, seed)`` and updates every tensor with
Adam (fp32) on next-byte cross-entropy over random windows of a corpus (by default the ``.py`` files of Python's
standard library; every 20th file is held out). The forward is ``engine.model.ReferenceRwkv7``'s math, written
to be differentiable and to start each window from the zero state; after saving, the file is loaded through
``engine.weights.load_model`` and the reference model's logits on held-out windows must match this forward's
(|Δlogit| ≤ 1e-3, fp32 both), else the exit status is 1.

Measured on a 2-core CPU (torch 2.13, 2 threads) at the defaults (4 layers, width 256, batch 16 × 128 bytes):
0.97 s per iteration (the first few slower), so the default 600 steps take about 10 minutes; they bring the
held-out loss from 14.3 to about 1.97 bits/byte.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.demo import random_state_dict
from engine.model import DECAY_SCALE
from engine.weights import ModelShape, weights_from_state_dict

Params = dict[str, torch.Tensor]

HELD_OUT_EVERY = 20  # every 20th corpus file (sorted) is held out: unseen text from all over the corpus
MAX_DELTA_LOGIT = 1e-3
LN2 = math.log(2)


# --- corpus ---------------------------------------------------------------------------------------------------


def corpus_files(root: Path, pattern: str = "*.py") -> list[Path]:
    """The corpus files under ``root``, sorted; installed packages are left out (some Pythons keep site-packages
    inside the standard library's directory)."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob(pattern) if p.is_file() and not skip & set(p.relative_to(root).parts))


def load_corpus(root: Path, pattern: str = "*.py") -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) bytes as uint8 tensors: the files concatenated, every ``HELD_OUT_EVERY``-th held out."""
    files = corpus_files(root, pattern)
    if len(files) < 2:
        raise SystemExit(f"corpus {root} has {len(files)} {pattern} file(s); need at least 2")
    held_out = set(range(HELD_OUT_EVERY - 1, len(files), HELD_OUT_EVERY)) or {len(files) - 1}
    train, held = bytearray(), bytearray()
    for i, f in enumerate(files):
        (held if i in held_out else train).extend(f.read_bytes())
    return torch.frombuffer(train, dtype=torch.uint8).clone(), torch.frombuffer(held, dtype=torch.uint8).clone()


def sample_windows(data: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``length`` bytes as token ids ``[batch, length]`` (int64)."""
    if len(data) <= length:
        raise SystemExit(f"corpus part of {len(data)} bytes is too short for windows of {length}")
    starts = torch.randint(0, len(data) - length, (batch,), generator=gen)
    return torch.stack([data[s:s + length] for s in starts.tolist()]).long()


# --- the model: ReferenceRwkv7's math on official-layout tensors, differentiable ----------------------------------


def model_shape(params: Params) -> ModelShape:
    """The shape as the engine reads it from an official file (also validates the names and shapes)."""
    return weights_from_state_dict({k: v.detach() for k, v in params.items()}).shape


def vec(params: Params, name: str, C: int) -> torch.Tensor:
    return params[name].view(C)  # official vectors are (1, 1, C)


def forward(params: Params, tokens: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Logits ``[B, T, V]`` of every position of ``tokens`` ``[B, T]``, from the zero state."""
    C = shape.n_embd
    # the engine folds ln0 into the embedding at load: the same LayerNorm, per row
    x = F.layer_norm(params["emb.weight"][tokens], (C,), vec(params, "blocks.0.ln0.weight", C),
                     vec(params, "blocks.0.ln0.bias", C))
    v_first = None
    for i in range(shape.n_layer):
        p = f"blocks.{i}."
        att, v_first = time_mix(params, i, F.layer_norm(x, (C,), vec(params, p + "ln1.weight", C),
                                                         vec(params, p + "ln1.bias", C)), v_first, shape)
        x = x + att
        x = x + channel_mix(params, i, F.layer_norm(x, (C,), vec(params, p + "ln2.weight", C),
                                                     vec(params, p + "ln2.bias", C)), C)
    x = F.layer_norm(x, (C,), vec(params, "ln_out.weight", C), vec(params, "ln_out.bias", C))
    return F.linear(x, params["head.weight"])


def token_shift(x: torch.Tensor) -> torch.Tensor:
    """The previous token's ``x`` minus this one's, the first token's previous being the zero state."""
    return F.pad(x, (0, 0, 1, -1)) - x


def time_mix(params: Params, i: int, x: torch.Tensor, v_first: torch.Tensor | None,
             shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, C = x.shape
    H, N = shape.n_head, shape.head_size
    p = f"blocks.{i}.att."

    def v(name: str) -> torch.Tensor:
        return vec(params, p + name, C)

    xx = token_shift(x)
    xr, xw, xk, xv, xa, xg = (x + xx * v("x_" + c) for c in "rwkvag")
    r = F.linear(xr, params[p + "receptance.weight"])
    k = F.linear(xk, params[p + "key.weight"])
    val = F.linear(xv, params[p + "value.weight"])
    decay_lora = torch.tanh(xw @ params[p + "w1"]) @ params[p + "w2"]
    iclr = torch.sigmoid(v("a0") + (xa @ params[p + "a1"]) @ params[p + "a2"])
    g = torch.sigmoid(xg @ params[p + "g1"]) @ params[p + "g2"]
    kk = F.normalize((k * v("k_k")).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C)
    k = k * (1 + (iclr - 1) * v("k_a"))
    if i == 0:
        v_first = val  # layer 0's v0/v1/v2 exist in the file but are unused (and get no gradient)
    else:
        val = val + (v_first - val) * torch.sigmoid(v("v0") + (xv @ params[p + "v1"]) @ params[p + "v2"])
    decay = torch.exp(-DECAY_SCALE * torch.sigmoid(v("w0") + decay_lora))
    y = wkv(r, decay, k, val, -kk, kk * iclr, H)
    y = F.group_norm(y.reshape(B * T, C), H, v("ln_x.weight"), v("ln_x.bias"), eps=shape.ln_x_eps).view(B, T, C)
    bonus = (r * k * params[p + "r_k"].view(C)).view(B, T, H, N).sum(-1, keepdim=True) * val.view(B, T, H, N)
    y = y + bonus.view(B, T, C)
    return F.linear(y * g, params[p + "output.weight"]), v_first


def channel_mix(params: Params, i: int, x: torch.Tensor, C: int) -> torch.Tensor:
    p = f"blocks.{i}.ffn."
    k = torch.relu(F.linear(x + token_shift(x) * vec(params, p + "x_k", C), params[p + "key.weight"])) ** 2
    return F.linear(k, params[p + "value.weight"])


def wkv(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
        num_heads: int) -> torch.Tensor:
    """``engine.model.wkv_recurrent`` from the zero state, differentiable: ``S' = S·diag(w) + (S·a)bᵀ + v kᵀ``
    with ``S`` ``[B, H, N(value), N(key)]``; outputs ``[B, T, C]``.

    The two rank-1 updates go as one batched ``[S·a, v] @ [b; k]`` added onto ``S·diag(w)`` (``baddbmm``): fewer
    kernels and fewer saved tensors per step than three separate products, which is most of a CPU step's time.
    """
    B, T, C = r.shape
    H, N = num_heads, C // num_heads
    r, w, k, v, a, b = (t.view(B, T, H, N) for t in (r, w, k, v, a, b))
    # per-step slices by unbind: indexing [t] would make backward add T full-size zero tensors, one per step
    bk = torch.stack([b, k], -2).transpose(0, 1).reshape(T, B * H, 2, N).unbind(0)
    w_t = w.transpose(0, 1).reshape(T, B * H, 1, N).unbind(0)
    a_t, v_t, r_t = (t.transpose(0, 1).reshape(T, B * H, N, 1).unbind(0) for t in (a, v, r))
    s = r.new_zeros(B * H, N, N)
    out = []
    for t in range(T):
        s = torch.baddbmm(s * w_t[t], torch.cat([torch.bmm(s, a_t[t]), v_t[t]], -1), bk[t])
        out.append(torch.bmm(s, r_t[t]))
    return torch.stack(out).view(T, B, H * N).transpose(0, 1)


def loss_of(params: Params, windows: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) over ``windows`` ``[B, T + 1]``."""
    logits = forward(params, windows[:, :-1], shape)
    return F.cross_entropy(logits.reshape(-1, shape.vocab_size), windows[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(params: Params, windows: torch.Tensor, shape: ModelShape, batch: int) -> float:
    losses = [(loss_of(params, windows[i:i + batch], shape)).item() for i in range(0, len(windows), batch)]
    return sum(losses) / len(losses)


# --- training -------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    first_loss: float
    last_loss: float  # the mean of the last few steps' losses
    held_out_start: float
    held_out_end: float
    seconds_per_step: float
    max_delta_logit: float = float("nan")


def learning_rate(step: int, steps: int, peak: float) -> float:
    """A short linear warm-up (Adam's first steps on a random net are large), then cosine down to a tenth."""
    warm = max(1, min(20, steps // 10))
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(params: Params, shape: ModelShape, train_bytes: torch.Tensor, held: torch.Tensor, steps: int,
          batch: int, seq_len: int, lr: float, gen: torch.Generator, log_every: int = 20) -> TrainResult:
    """Adam on next-byte cross-entropy; prints the loss every ``log_every`` steps."""
    opt = torch.optim.Adam(params.values(), lr=lr)
    held_start = held_out_loss(params, held, shape, batch)
    print(f"held-out loss before training {held_start:.4f} nats ({held_start / LN2:.3f} bits/byte)", flush=True)
    t0, first, recent = time.perf_counter(), float("nan"), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        loss = loss_of(params, sample_windows(train_bytes, batch, seq_len + 1, gen), shape)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)  # a random net's early gradients spike
        opt.step()
        value = loss.item()
        if not math.isfinite(value):
            raise SystemExit(f"step {step}: loss is {value}")
        first = value if step == 0 else first
        recent = (recent + [value])[-10:]
        if step % log_every == 0 or step == steps - 1:
            elapsed = time.perf_counter() - t0
            print(f"step {step:5d}  loss {value:.4f}  ({value / LN2:.3f} bits/byte)  lr {opt.param_groups[0]['lr']:.2e}"
                  f"  {elapsed:7.1f} s  ({elapsed / (step + 1):.2f} s/step)", flush=True)
    per_step = (time.perf_counter() - t0) / max(1, steps)
    held_end = held_out_loss(params, held, shape, batch)
    last = sum(recent) / len(recent) if recent else float("nan")
    print(f"training loss, mean of the last {len(recent)} steps: {last:.4f} nats ({last / LN2:.3f} bits/byte)\n"
          f"held-out loss after {steps} steps {held_end:.4f} nats ({held_end / LN2:.3f} bits/byte) "
          f"over {len(held)} windows of {held.shape[1] - 1} bytes", flush=True)
    return TrainResult(first, last, held_start, held_end, per_step)


def save(params: Params, path: Path) -> None:
    """The official layout, as ``random_state_dict`` writes it: same keys, order, shapes, fp32."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().float().contiguous().clone() for k, v in params.items()}, path)


# --- verification against the serving reference ------------------------------------------------------------------


def max_delta_against_engine(path: Path, params: Params, tokens: torch.Tensor) -> float:
    """Largest |Δlogit| between ``engine.model.ReferenceRwkv7`` on the file at ``path`` (fresh states, all
    positions) and ``forward`` on ``params``, over ``tokens`` ``[B, T]``; fp32 both."""
    from engine.model import ReferenceRwkv7
    from engine.state import StatePool
    from engine.weights import load_model

    weights = load_model(path).to("cpu", torch.float32)
    B = tokens.shape[0]
    reference = ReferenceRwkv7(weights, StatePool(weights.shape, B, "cpu"))
    ref_logits = reference.forward(tokens, torch.arange(B), all_logits=True)
    with torch.no_grad():
        ours = forward(params, tokens, model_shape(params))
    return float((ref_logits.double() - ours.double()).abs().max())


# --- command line ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the .pth to write (official RWKV-7 layout)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256, help="token id = byte value, so at least 256")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=600, help="~10 min on 2 CPU cores at the default shape")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the window sampling")
    ap.add_argument("--corpus", type=Path, help="a directory of text files (default: Python's standard library)")
    ap.add_argument("--glob", default="*.py", help="which files of the corpus directory")
    ap.add_argument("--held-out-windows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.vocab < 256:
        ap.error("--vocab must be at least 256 (a token is a byte)")
    return args


def run(args: argparse.Namespace) -> TrainResult:
    """Train, save to ``args.out`` and check the file against the engine's reference model."""
    torch.set_num_threads(args.threads)
    root = args.corpus or Path(sysconfig.get_paths()["stdlib"])
    train_bytes, held_bytes = load_corpus(root, args.glob)
    print(f"corpus {root} ({args.glob}): {len(train_bytes):,} training bytes, {len(held_bytes):,} held out",
          flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    held = sample_windows(held_bytes, args.held_out_windows, args.seq_len + 1,
                          torch.Generator().manual_seed(args.seed + 1))
    params = {k: v.requires_grad_() for k, v in
              random_state_dict(args.layers, args.width, args.vocab, args.head_size, args.seed).items()}
    shape = model_shape(params)
    print(f"{shape.n_layer} layers, width {shape.n_embd}, {shape.n_head} heads of {shape.head_size}, vocab "
          f"{shape.vocab_size}: {sum(p.numel() for p in params.values()):,} parameters", flush=True)
    result = train(params, shape, train_bytes, held, args.steps, args.batch, args.seq_len, args.lr, gen)
    out = Path(args.out)
    save(params, out)
    result.max_delta_logit = max_delta_against_engine(out, params, held[:4, :-1])
    print(f"wrote {out}; engine reference vs training forward on 4 held-out windows: max |Δlogit| "
          f"{result.max_delta_logit:.2e} (limit {MAX_DELTA_LOGIT:g})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    if not result.max_delta_logit <= MAX_DELTA_LOGIT:
        print("FAILED: the saved model does not reproduce the training forward through the engine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

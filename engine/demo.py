"""Seeded random RWKV-7 weights in the official ``.pth`` or the fla-hub layout.

Real weights cannot be downloaded everywhere (CI, air-gapped hosts), so tests,
benchmarks and ``gaggle up`` without ``--model`` use these. The scales follow
the spirit of RWKV-7's initialisation: decays spread over (0, 1), unit-ish
activations, logits with a few units of spread, so everything stays finite.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from engine.weights import ATT_LINEARS, hf_name

# named shapes for benchmarks: (layers, width, ffn, lora ranks w/a/v/g)
PRESETS = {
    "tiny": dict(layers=2, width=128),
    "0.1b": dict(layers=12, width=768),
    "0.4b": dict(layers=24, width=1024),
    "1.5b": dict(layers=24, width=2048),
    "2.9b": dict(layers=32, width=2560),
    "7.2b": dict(layers=32, width=4096),
}


def lora_ranks(width: int) -> dict[str, int]:
    """LoRA ranks as the official RWKV-7 models pick them from the width."""
    def rank(factor: float, exponent: float) -> int:
        return max(32, int(round(factor * width ** exponent / 32) * 32))
    return {"w": rank(1.8, 0.5), "a": rank(1.8, 0.5), "v": rank(1.3, 0.5), "g": rank(0.6, 0.8)}


def random_state_dict(layers: int = 2, width: int = 128, vocab: int = 65536, head_size: int = 64,
                      seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random weights under the official key names and shapes (vectors as (1, 1, C))."""
    if width % head_size:
        raise ValueError(f"width {width} must be a multiple of head_size {head_size}")
    g = torch.Generator(device).manual_seed(seed)
    C, H, ffn = width, width // head_size, 4 * width
    ranks = lora_ranks(width)

    def randn(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * std + mean

    def uniform(*shape: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        return torch.rand(*shape, generator=g, device=device) * (hi - lo) + lo

    def vec(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1, 1, C)

    sd: dict[str, torch.Tensor] = {
        "emb.weight": randn(vocab, C),
        "blocks.0.ln0.weight": randn(C, std=0.1, mean=1.0), "blocks.0.ln0.bias": randn(C, std=0.1),
        "ln_out.weight": randn(C, std=0.1, mean=1.0), "ln_out.bias": randn(C, std=0.1),
        "head.weight": randn(vocab, C, std=3.0 / math.sqrt(C)),
    }
    for i in range(layers):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2", "att.ln_x"):
            sd[p + ln + ".weight"] = randn(C, std=0.1, mean=1.0)
            sd[p + ln + ".bias"] = randn(C, std=0.1)
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[p + "att." + name] = vec(uniform(C))
        sd[p + "att.w0"] = vec(uniform(C, lo=-3.0, hi=1.0))
        sd[p + "att.a0"] = vec(randn(C, std=0.5))
        sd[p + "att.v0"] = vec(randn(C, std=0.5, mean=1.0))
        for kind in "wavg":
            r = ranks[kind]
            sd[p + f"att.{kind}1"] = randn(C, r, std=0.5 / math.sqrt(C))
            sd[p + f"att.{kind}2"] = randn(r, C, std=0.5 / math.sqrt(r))
        sd[p + "att.k_k"] = vec(uniform(C, lo=0.7, hi=1.0))
        sd[p + "att.k_a"] = vec(uniform(C, lo=0.8, hi=1.2))
        sd[p + "att.r_k"] = randn(H, head_size, std=0.1)
        for name in ATT_LINEARS:
            std = 0.5 if name == "output" else 1.0
            sd[p + f"att.{name}.weight"] = randn(C, C, std=std / math.sqrt(C))
        sd[p + "ffn.x_k"] = vec(uniform(C))
        sd[p + "ffn.key.weight"] = randn(ffn, C, std=1.0 / math.sqrt(C))
        sd[p + "ffn.value.weight"] = randn(C, ffn, std=0.5 / math.sqrt(ffn))
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def write_demo_model(out: str | Path, layers: int = 2, width: int = 128, vocab: int = 65536,
                     head_size: int = 64, seed: int = 0, fmt: str = "pth",
                     dtype: torch.dtype = torch.float32) -> Path:
    """Write random weights; ``fmt`` is ``pth`` (official file) or ``hf`` (fla-hub directory)."""
    sd = random_state_dict(layers, width, vocab, head_size, seed, dtype)
    out = Path(out)
    if fmt == "pth":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(sd, out)
    elif fmt == "hf":
        _write_hf(out, sd, layers, width, vocab, head_size)
    else:
        raise ValueError(f"format must be 'pth' or 'hf', got {fmt!r}")
    return out


def _write_hf(out: Path, sd: dict[str, torch.Tensor], layers: int, width: int, vocab: int,
              head_size: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf = {}
    for name, t in sd.items():
        if re.fullmatch(r"blocks\.0\.att\.v[012]", name):
            continue  # layer 0 has no value-residual LoRA in fla
        if name.split(".")[-1] in ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"):
            t = t.t()
        elif t.dim() == 3 and ".att.x_" not in name:
            t = t.reshape(-1)  # fla keeps only the token-shift mixes as (1, 1, C)
        hf[hf_name(name)] = t.contiguous()
    save_file(hf, str(out / "model.safetensors"))
    ranks = lora_ranks(width)
    config = {
        "architectures": ["RWKV7ForCausalLM"], "model_type": "rwkv7",
        "hidden_size": width, "num_hidden_layers": layers, "head_dim": head_size,
        "num_heads": width // head_size, "intermediate_size": 4 * width, "hidden_ratio": 4,
        "decay_low_rank_dim": ranks["w"], "a_low_rank_dim": ranks["a"],
        "v_low_rank_dim": ranks["v"], "gate_low_rank_dim": ranks["g"],
        "vocab_size": vocab, "norm_eps": 1e-5, "norm_first": True, "norm_bias": True,
        "hidden_act": "sqrelu", "tie_word_embeddings": False, "attn_mode": "chunk",
        "value_dim": [width] * layers, "fuse_norm": False, "fuse_cross_entropy": False,
        "torch_dtype": str(next(iter(sd.values())).dtype).replace("torch.", ""),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))

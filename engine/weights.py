"""Load RWKV-7 weights (official BlinkDL ``.pth`` or fla-hub Hugging Face) into one layout.

The internal layout uses the official key names with the leading ``(1, 1, C)``
dimensions squeezed away, ``emb`` already passed through ``blocks.0.ln0`` (as
the official package does at load), and matrices kept as ``nn.Linear``
weights ``[out, in]``. Every shape is read from the weights. A file written by
``gaggle quantize`` holds its projection and FFN matrices in fp8 (e4m3) with
per-row scales beside them (``<name>.fp8_scale``, ``engine.quant``): they are
kept so, in ``tensors`` under the same two names.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.quant import FP8, SCALE_SUFFIX, dequantize_rows, is_quantized_name, quantize_rows

log = logging.getLogger(__name__)

LN_X_EPS_OFFICIAL = 64e-5  # the official package's GroupNorm eps (head size 64 × 1e-5)

ATT_VECTORS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "k_k", "k_a")
ATT_LORAS = (("w1", "w2"), ("a1", "a2"), ("g1", "g2"))
ATT_LINEARS = ("receptance", "key", "value", "output")
OLDER_RWKV_KEYS = {
    "att.time_decay": "RWKV-5/6", "att.time_faaaa": "RWKV-6", "att.time_first": "RWKV-4/5",
    "att.time_maa_x": "RWKV-6", "att.time_mix_k": "RWKV-4/5",
}


class ModelFormatError(ValueError):
    """A model file that is not a loadable RWKV-7 model; the message says what is wrong."""


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_embd: int
    n_head: int
    head_size: int
    vocab_size: int
    dim_ffn: int
    dim_w: int  # decay LoRA rank
    dim_a: int  # in-context learning rate LoRA rank
    dim_v: int  # value residual LoRA rank (0 for a one-layer model)
    dim_g: int  # gate LoRA rank
    ln_x_eps: float = LN_X_EPS_OFFICIAL

    def state_bytes(self, state_dtype_bytes: int = 4, shift_dtype_bytes: int = 4) -> int:
        """Bytes of one sequence's recurrent state: wkv matrices plus two token-shift vectors per layer."""
        wkv = self.n_layer * self.n_head * self.head_size * self.head_size * state_dtype_bytes
        return wkv + 2 * self.n_layer * self.n_embd * shift_dtype_bytes


@dataclass
class Rwkv7Weights:
    shape: ModelShape
    tensors: dict[str, torch.Tensor]  # internal layout (see module docstring)

    def layer(self, i: int, name: str) -> torch.Tensor:
        return self.tensors[f"blocks.{i}.{name}"]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "Rwkv7Weights":
        """Cast floating weights to ``dtype``; decay-path vectors and fp8 scales stay fp32 (they feed exp(), they
        scale fp32 sums); fp8 matrices stay fp8."""
        keep_fp32 = re.compile(r"att\.(w0|k_k|k_a|r_k|ln_x\.weight|ln_x\.bias)$")
        out = {}
        for k, t in self.tensors.items():
            if t.dtype == FP8:
                out[k] = t.to(device=device)
            else:
                fp32 = keep_fp32.search(k) or k.endswith(SCALE_SUFFIX)
                out[k] = t.to(device=device, dtype=torch.float32 if fp32 else dtype)
        return Rwkv7Weights(self.shape, out)

    @property
    def has_fp8(self) -> bool:
        return any(t.dtype == FP8 for t in self.tensors.values())

    def quantized_fp8(self) -> "Rwkv7Weights":
        """The projection and FFN matrices in fp8 with per-row scales (``engine.quant``), one matrix at a time
        (on a GPU the bf16 copy of each goes as its fp8 one is made); the rest as is."""
        out = dict(self.tensors)
        for k in list(out):
            if is_quantized_name(k) and out[k].dtype != FP8:
                out[k], out[k + SCALE_SUFFIX] = quantize_rows(out.pop(k))
        return Rwkv7Weights(self.shape, out)

    def dequantized(self, dtype: torch.dtype) -> "Rwkv7Weights":
        """fp8 matrices back to ``dtype`` (what a backend without fp8 GEMMs computes with: the weights' rounding,
        not the activations')."""
        out = {}
        for k, t in self.tensors.items():
            if k.endswith(SCALE_SUFFIX):
                continue
            out[k] = dequantize_rows(t, self.tensors[k + SCALE_SUFFIX], dtype) if t.dtype == FP8 else t
        return Rwkv7Weights(self.shape, out)


def load_model(path: str | Path) -> Rwkv7Weights:
    """Load an RWKV-7 model from a ``.pth`` file or a Hugging Face (fla-hub) directory."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"model not found: {path}")
    if path.is_dir():
        raw, ln_x_eps = _read_hf(path)
    else:
        raw, ln_x_eps = _read_pth(path), LN_X_EPS_OFFICIAL
    return _to_internal(raw, source=str(path), ln_x_eps=ln_x_eps)


def weights_from_state_dict(raw: dict[str, torch.Tensor], source: str = "state dict") -> Rwkv7Weights:
    """Validate an official-layout state dict already in memory (benchmarks, tests)."""
    return _to_internal(raw, source=source, ln_x_eps=LN_X_EPS_OFFICIAL)


def _read_pth(path: Path) -> dict[str, torch.Tensor]:
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated zip, pickle garbage, wrong file type
        raise ModelFormatError(f"cannot read {path} as a PyTorch weights file "
                               f"(truncated or not a .pth?): {e}") from e
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ModelFormatError(f"{path} does not hold a state dict of tensors")
    return raw


def _read_hf(path: Path) -> tuple[dict[str, torch.Tensor], float]:
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelFormatError(f"{path} is a directory but has no config.json (expected a Hugging Face model)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{config_path} is not valid JSON: {e}") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path} has no *.safetensors files")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            hf.update(load_file(str(f)))
        except Exception as e:
            raise ModelFormatError(f"cannot read {f} (truncated or not safetensors?): {e}") from e
    if config.get("tie_word_embeddings") and "lm_head.weight" not in hf:
        hf["lm_head.weight"] = hf.get("model.embeddings.weight")
    eps = float(config.get("norm_eps", 1e-5)) * int(config.get("head_dim", 64))
    raw = {}
    for k, v in hf.items():
        name = official_name(k)
        if name:
            raw[name] = v.t() if _is_lora_matrix(name) else v  # fla stores LoRAs as nn.Linear
    return raw, eps


def _is_lora_matrix(official: str) -> bool:
    return re.search(r"att\.[wavg][12]$", official) is not None


_HF_TOP = {"model.embeddings.weight": "emb.weight", "model.norm.weight": "ln_out.weight",
           "model.norm.bias": "ln_out.bias", "lm_head.weight": "head.weight"}
_HF_BLOCK = {"pre_norm": "ln0", "attn_norm": "ln1", "ffn_norm": "ln2", "attn": "att", "ffn": "ffn"}
_HF_PROJ = {"r_proj": "receptance", "k_proj": "key", "v_proj": "value", "o_proj": "output", "g_norm": "ln_x"}
_HF_LORA = {"lora.0.weight": "1", "lora.2.weight": "2", "lora.2.bias": "0"}


def official_name(hf_name: str) -> str:
    """Map an fla-hub name onto the official one (inverse of fla's convert_from_rwkv7.py)."""
    if hf_name in _HF_TOP:
        return _HF_TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.(.+)", hf_name)
    if not m or m.group(2) not in _HF_BLOCK:
        return ""
    layer, block, rest = m.group(1), _HF_BLOCK[m.group(2)], m.group(3)
    lora = re.fullmatch(r"([wavg])_lora\.(lora\.\d\.(?:weight|bias))", rest)
    if lora:
        rest = lora.group(1) + _HF_LORA[lora.group(2)]
    elif block == "att":
        head, _, tail = rest.partition(".")
        rest = _HF_PROJ.get(head, head) + ("." + tail if tail else "")
    return f"blocks.{layer}.{block}.{rest}"


def hf_name(official: str) -> str:
    """Map an official name onto the fla-hub one (used by the demo-model writer)."""
    inverse_top = {v: k for k, v in _HF_TOP.items()}
    if official in inverse_top:
        return inverse_top[official]
    _, layer, block, rest = official.split(".", 3)
    block = {v: k for k, v in _HF_BLOCK.items()}[block]
    lora = re.fullmatch(r"([wavg])([012])", rest)
    if lora:
        rest = f"{lora.group(1)}_lora." + {v: k for k, v in _HF_LORA.items()}[lora.group(2)]
    elif block == "attn":
        head, _, tail = rest.partition(".")
        rest = {v: k for k, v in _HF_PROJ.items()}.get(head, head) + ("." + tail if tail else "")
    return f"model.layers.{layer}.{block}.{rest}"


def _to_internal(raw: dict[str, torch.Tensor], source: str, ln_x_eps: float) -> Rwkv7Weights:
    _reject_other_architectures(raw, source)
    shape = _infer_shape(raw, source, ln_x_eps)
    t: dict[str, torch.Tensor] = {}
    for key, expected in _expected_shapes(shape).items():
        t[key] = _take(raw, key, expected, source)
        if t[key].dtype == FP8:
            t[key + SCALE_SUFFIX] = _take_fp8_scale(raw, key, source)
    emb = t.pop("emb.weight").float()
    t["emb.weight"] = F.layer_norm(emb, (shape.n_embd,), t.pop("blocks.0.ln0.weight").float(),
                                   t.pop("blocks.0.ln0.bias").float())
    return Rwkv7Weights(shape, t)


def _reject_other_architectures(raw: dict, source: str) -> None:
    for key in raw:
        for marker, arch in OLDER_RWKV_KEYS.items():
            if key.endswith(marker):
                raise ModelFormatError(f"{source} looks like an {arch} model (it has '{key}'); "
                                       "Gaggle serves RWKV-7 only")
    if "emb.weight" not in raw or "blocks.0.att.r_k" not in raw:
        missing = "emb.weight" if "emb.weight" not in raw else "blocks.0.att.r_k"
        raise ModelFormatError(f"{source} is not an RWKV-7 model: missing key '{missing}'")


def _dim(raw: dict, key: str, axis: int, source: str) -> int:
    if key not in raw:
        raise ModelFormatError(f"{source} is not a complete RWKV-7 model: missing key '{key}'")
    t = raw[key]
    if t.dim() <= axis:
        raise ModelFormatError(f"{source}: '{key}' has shape {tuple(t.shape)}, expected a matrix")
    return int(t.shape[axis])


def _infer_shape(raw: dict, source: str, ln_x_eps: float) -> ModelShape:
    layers = {int(m.group(1)) for k in raw if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not layers:
        raise ModelFormatError(f"{source} has no 'blocks.N.*' keys")
    n_layer = max(layers) + 1
    missing_layers = sorted(set(range(n_layer)) - layers)
    if missing_layers:
        raise ModelFormatError(f"{source}: layer(s) {missing_layers} missing (found blocks up to {n_layer - 1})")
    vocab, n_embd = _dim(raw, "emb.weight", 0, source), _dim(raw, "emb.weight", 1, source)
    n_head, head_size = _dim(raw, "blocks.0.att.r_k", 0, source), _dim(raw, "blocks.0.att.r_k", 1, source)
    if n_head * head_size != n_embd:
        raise ModelFormatError(f"{source}: r_k says {n_head} heads × {head_size} but the width is {n_embd}")
    return ModelShape(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, head_size=head_size, vocab_size=vocab,
        dim_ffn=_dim(raw, "blocks.0.ffn.key.weight", 0, source),
        dim_w=_dim(raw, "blocks.0.att.w1", 1, source), dim_a=_dim(raw, "blocks.0.att.a1", 1, source),
        dim_v=_dim(raw, "blocks.1.att.v1", 1, source) if n_layer > 1 else 0,
        dim_g=_dim(raw, "blocks.0.att.g1", 1, source), ln_x_eps=ln_x_eps)


def _expected_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    C = s.n_embd
    shapes: dict[str, tuple[int, ...]] = {
        "emb.weight": (s.vocab_size, C), "blocks.0.ln0.weight": (C,), "blocks.0.ln0.bias": (C,),
        "ln_out.weight": (C,), "ln_out.bias": (C,), "head.weight": (s.vocab_size, C)}
    ranks = {"w": s.dim_w, "a": s.dim_a, "g": s.dim_g, "v": s.dim_v}
    for i in range(s.n_layer):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2", "att.ln_x"):
            shapes[p + ln + ".weight"] = shapes[p + ln + ".bias"] = (C,)
        for name in ATT_VECTORS:
            shapes[p + "att." + name] = (C,)
        loras = ATT_LORAS + ((("v1", "v2"),) if i > 0 else ())
        for down, up in loras:
            r = ranks[down[0]]
            shapes[p + "att." + down], shapes[p + "att." + up] = (C, r), (r, C)
        if i > 0:
            shapes[p + "att.v0"] = (C,)
        shapes[p + "att.r_k"] = (s.n_head, s.head_size)
        for name in ATT_LINEARS:
            shapes[p + f"att.{name}.weight"] = (C, C)
        shapes[p + "ffn.x_k"] = (C,)
        shapes[p + "ffn.key.weight"] = (s.dim_ffn, C)
        shapes[p + "ffn.value.weight"] = (C, s.dim_ffn)
    return shapes


def _take_fp8_scale(raw: dict, key: str, source: str) -> torch.Tensor:
    """The per-row scales of an fp8 matrix of a quantized file; only the matrices fp8 mode quantizes may be fp8."""
    if not is_quantized_name(key):
        raise ModelFormatError(f"{source}: '{key}' is fp8, but only the projection and FFN matrices may be")
    scale = raw.get(key + SCALE_SUFFIX)
    rows = raw[key].shape[0]
    if scale is None or scale.numel() != rows or not scale.is_floating_point():
        raise ModelFormatError(f"{source}: the fp8 matrix '{key}' needs its scales '{key}{SCALE_SUFFIX}' "
                               f"({rows} floats)")
    return scale.reshape(rows).float()


def _take(raw: dict, key: str, expected: tuple[int, ...], source: str) -> torch.Tensor:
    if key not in raw:
        raise ModelFormatError(f"{source} is not a complete RWKV-7 model: missing key '{key}'")
    t = raw[key]
    if not t.is_floating_point():
        raise ModelFormatError(f"{source}: '{key}' has dtype {t.dtype}, expected a float tensor")
    if len(expected) == 1 and t.numel() == expected[0]:
        t = t.reshape(expected)  # official vectors are stored as (1, 1, C)
    if tuple(t.shape) != expected:
        raise ModelFormatError(f"{source}: '{key}' has shape {tuple(t.shape)}, expected {expected}")
    return t

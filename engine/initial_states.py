"""Named initial states: a sequence that asks for one starts from it instead of the zero state.

RWKV "state tuning" trains a model's initial wkv state instead of its weights (RWKV-PEFT); the result is a
``.pth`` holding ``blocks.{i}.att.time_state`` of shape [heads, head_size, head_size] for each layer. It is read
as the official ``rwkv`` package's chat demo reads it (transposed into the official [value, key] layout, token
shifts zero). A worker loads them at start (``gaggle worker --state NAME=FILE``); a request selects one by name
(``"state": NAME``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from engine.weights import ModelShape


class StateFileError(ValueError):
    """A state file that cannot serve this model: unreadable, keys missing or of the wrong shape."""


@dataclass
class InitialState:
    name: str
    att_shift: torch.Tensor  # [L, C] (zeros)
    ffn_shift: torch.Tensor  # [L, C] (zeros)
    wkv: torch.Tensor  # [L, H, N, N], official layout


def load_initial_state(name: str, path: str | Path | BinaryIO, shape: ModelShape, device: torch.device | str,
                       shift_dtype: torch.dtype, state_dtype: torch.dtype) -> InitialState:
    """The state file at ``path`` (or an open file: an uploaded one) for a model of ``shape``; StateFileError
    saying what does not fit."""
    if not isinstance(path, (str, Path)):
        source, path = path, "the uploaded file"
    else:
        source = path
    try:
        raw = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:
        raise StateFileError(f"state {name!r}: cannot read {path} as a PyTorch file: {e}") from e
    if not isinstance(raw, dict):
        raise StateFileError(f"state {name!r}: {path} does not hold a dict of tensors")
    L, C, H, N = shape.n_layer, shape.n_embd, shape.n_head, shape.head_size
    wkv = torch.empty(L, H, N, N, dtype=torch.float32)
    for i in range(L):
        key = f"blocks.{i}.att.time_state"
        t = raw.get(key)
        if not isinstance(t, torch.Tensor):
            raise StateFileError(f"state {name!r}: {path} has no {key} (a state-tuning file has one per layer, "
                                 f"{L} layers for this model)")
        if tuple(t.shape) != (H, N, N):
            raise StateFileError(f"state {name!r}: {key} has shape {tuple(t.shape)}, this model needs "
                                 f"{(H, N, N)} (heads, head size, head size)")
        if not torch.isfinite(t).all():
            raise StateFileError(f"state {name!r}: {key} holds values that are not finite")
        wkv[i] = t.float().transpose(1, 2)
    if f"blocks.{L}.att.time_state" in raw:
        raise StateFileError(f"state {name!r}: {path} has more layers than this model's {L}")
    zeros = torch.zeros(L, C, dtype=shift_dtype, device=device)
    return InitialState(name, zeros, zeros.clone(), wkv.to(device=device, dtype=state_dtype))


def write_state_file(path: str | Path, shape: ModelShape, seed: int = 0, scale: float = 0.5) -> Path:
    """A random state-tuning file for ``shape`` (tests and demos)."""
    gen = torch.Generator().manual_seed(seed)
    H, N = shape.n_head, shape.head_size
    torch.save({f"blocks.{i}.att.time_state": torch.randn(H, N, N, generator=gen) * scale
                for i in range(shape.n_layer)}, path)
    return Path(path)

"""One prefix checkpoint as bytes, for the tier that workers share (worker.shared_states).

    b"GGST" | header length (4 bytes, little-endian) | header (JSON) | tensors' raw bytes, in header order

The header names each tensor's dtype and shape and the prefix it belongs to (token count and digest), so a reader
checks what it got against what it asked for before a byte of it reaches a slot: a wrong model, dtype, layout or
prefix is refused, never served. The tensors are views of the blob (no copy on read).
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import orjson
import torch

MAGIC = b"GGST"
VERSION = 1
_NAMES = ("att_shift", "ffn_shift", "wkv", "logits")


class StateBlobError(ValueError):
    pass


@dataclass
class StateBlob:
    tokens: int  # the prefix's length
    digest: str  # the prefix's digest (worker.prefix_digests)
    att_shift: torch.Tensor
    ffn_shift: torch.Tensor
    wkv: torch.Tensor
    logits: torch.Tensor | None  # the last position's logits, where kept

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t) for name in _NAMES if (t := getattr(self, name)) is not None]


def pack(blob: StateBlob) -> list[memoryview | bytes]:
    """The blob as buffers to write back to back (the tensors' own memory: no copy here; they must stay
    unchanged until written)."""
    tensors = blob.tensors()
    header = orjson.dumps({"v": VERSION, "tokens": blob.tokens, "digest": blob.digest,
                           "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                       for name, t in tensors]})
    parts: list[memoryview | bytes] = [MAGIC + struct.pack("<I", len(header)) + header]
    for _, t in tensors:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        parts.append(memoryview(flat.numpy()))
    return parts


def unpack(data: bytes, expect: dict[str, tuple[torch.dtype, tuple[int, ...]]], tokens: int,
           digest: str) -> StateBlob:
    """The blob in ``data``, checked: the prefix (``tokens``, ``digest``) and each tensor's dtype and shape as
    ``expect`` has them (logits optional). StateBlobError otherwise."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise StateBlobError("not a state blob")
    (n,) = struct.unpack_from("<I", data, 4)
    try:
        header = orjson.loads(data[8:8 + n])
    except orjson.JSONDecodeError as e:
        raise StateBlobError(f"bad header: {e}") from None
    if header.get("v") != VERSION or header.get("tokens") != tokens or header.get("digest") != digest:
        raise StateBlobError("a blob of another prefix or format")
    offset, found = 8 + n, {}
    for name, dtype_name, shape in header.get("tensors", []):
        if name not in expect:
            raise StateBlobError(f"unexpected tensor {name!r}")
        dtype, want = expect[name]
        if str(dtype).removeprefix("torch.") != dtype_name or tuple(shape) != tuple(want):
            raise StateBlobError(f"{name}: {dtype_name}{tuple(shape)}, this worker has {dtype}{tuple(want)}")
        size = dtype.itemsize * _numel(shape)
        if offset + size > len(data):
            raise StateBlobError("truncated")
        with warnings.catch_warnings():  # read-only bytes: the views are only read (copied into a slot's row)
            warnings.simplefilter("ignore", UserWarning)
            found[name] = torch.frombuffer(data, dtype=dtype, count=_numel(shape), offset=offset).view(shape)
        offset += size
    if offset != len(data) or any(name not in found for name in _NAMES[:3]):
        raise StateBlobError("incomplete or trailing bytes")
    return StateBlob(tokens, digest, found["att_shift"], found["ffn_shift"], found["wkv"], found.get("logits"))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

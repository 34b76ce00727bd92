"""Uploaded initial states (``POST /v1/files`` with purpose ``rwkv_state``): a state-tuning ``.pth`` read without
torch (the API imports none), only far enough to check it before any worker loads it.

A ``torch.save`` file is a zip: ``<name>/data.pkl`` (a pickle that rebuilds tensors from storages) and one
``<name>/data/<key>`` entry per storage. The pickle is read with an unpickler that knows only the few names a dict
of tensors needs (anything else is refused: a pickle can run code), and each tensor becomes its shape and the size
of its storage. The file must hold ``blocks.{i}.att.time_state`` for layers 0..L-1, each [heads, head size, head
size], and nothing else; a worker reads the values (``engine.initial_states``, which also refuses non-finite ones).
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from dataclasses import dataclass

STATE_PURPOSE = "rwkv_state"
MAX_STATE_FILE_BYTES = 512 * 2**20
_KEY = re.compile(r"blocks\.(\d+)\.att\.time_state")
_ITEMSIZE = {"FloatStorage": 4, "BFloat16Storage": 2, "HalfStorage": 2, "DoubleStorage": 8}


class StateFileRefused(ValueError):
    pass


@dataclass
class _Storage:
    key: str
    itemsize: int
    numel: int


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    storage: _Storage


def _rebuild_tensor(storage, offset, size, stride, *_rest):
    if not isinstance(storage, _Storage):
        raise StateFileRefused("a tensor without a storage")
    numel = 1
    for d in size:
        numel *= d
    if offset + numel > storage.numel:
        raise StateFileRefused("a tensor larger than its storage")
    return _Tensor(tuple(size), storage)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _ITEMSIZE:
            return name
        raise StateFileRefused(f"the file refers to {module}.{name}: not a plain dict of tensors")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _ITEMSIZE):
            raise StateFileRefused("a storage of an unsupported kind (float32, bfloat16, float16, float64 only)")
        return _Storage(str(pid[2]), _ITEMSIZE[pid[1]], int(pid[4]))


def state_file_shape(data: bytes) -> tuple[int, int, int]:
    """(layers, heads, head size) of a state-tuning file; StateFileRefused saying what is wrong."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
        pkl = next(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")
        raw = _Unpickler(io.BytesIO(archive.read(pkl))).load()
    except StateFileRefused:
        raise
    except (zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            AttributeError, IndexError, KeyError) as e:
        raise StateFileRefused(f"not a PyTorch (torch.save) file of tensors: {e!r}") from None
    if not isinstance(raw, dict) or not raw:
        raise StateFileRefused("the file does not hold a dict of tensors")
    prefix = pkl[:-len("data.pkl")]
    layers: dict[int, tuple[int, ...]] = {}
    for key, t in raw.items():
        m = _KEY.fullmatch(key) if isinstance(key, str) else None
        if m is None or not isinstance(t, _Tensor):
            raise StateFileRefused(f"unexpected entry {key!r}: a state-tuning file holds only "
                                   "blocks.N.att.time_state tensors")
        entry = f"{prefix}data/{t.storage.key}"
        if entry not in names or archive.getinfo(entry).file_size < t.storage.numel * t.storage.itemsize:
            raise StateFileRefused(f"{key}: its data is missing from the file")
        layers[int(m.group(1))] = t.shape
    if sorted(layers) != list(range(len(layers))):
        raise StateFileRefused(f"layers must run from 0 without gaps, got {sorted(layers)}")
    shapes = set(layers.values())
    shape = next(iter(shapes))
    if len(shapes) != 1 or len(shape) != 3 or shape[1] != shape[2]:
        raise StateFileRefused(f"each time_state must be [heads, head size, head size], got {sorted(shapes)}")
    return len(layers), shape[0], shape[1]

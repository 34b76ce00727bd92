"""fla's kernel modules without its package ``__init__``s.

``import fla.ops.<anything>`` first runs ``fla/__init__.py`` and ``fla/ops/__init__.py``, which import every model
family fla has (~40 of them, their layers and the torch.compile machinery): ~6 s of a start on a 2-core VM and
~8 s on an H200 host, for kernels of which we use one family. ``kernel_modules()`` registers the two packages as
bare namespace-style modules (their real directories as ``__path__``, ``__version__`` from the installed
distribution) before anything of fla is imported, so submodules import alone. Where fla is already imported, it
does nothing.

Two of fla's kernel modules also decorate functions we never call with ``torch.compiler.disable`` at import time,
which imports torch's dynamo (~4 s on an H200 host, ~5 s cold). ``without_dynamo()`` makes that decorator the
identity while fla's kernels are imported: nothing here runs under torch.compile.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import sys
import types
from collections.abc import Iterator


@functools.cache
def kernel_modules() -> bool:
    """True where the bare packages are in place (or fla was imported already); False without fla."""
    if "fla" in sys.modules:
        return True
    spec = importlib.util.find_spec("fla")  # a top-level spec: runs no code of the package
    if spec is None or not spec.submodule_search_locations:
        return False
    root = list(spec.submodule_search_locations)[0]
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    # fla's backend dispatch wraps each entry point in torch.compiler.disable, whose first call imports torch's
    # dynamo (~5 s of a cold start on an H200 host); we call fla's own Triton kernels, never another backend
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    for name, path in (("fla", root), ("fla.ops", os.path.join(root, "ops"))):
        module = types.ModuleType(name)
        module.__path__ = [path]
        module.__package__ = name
        module.__version__ = version
        sys.modules[name] = module
    sys.modules["fla"].ops = sys.modules["fla.ops"]
    return True


@contextlib.contextmanager
def without_dynamo() -> Iterator[None]:
    """``torch.compiler.disable`` as the identity inside the block (where dynamo is not imported yet)."""
    import torch
    if "torch._dynamo" in sys.modules:
        yield
        return
    original = torch.compiler.disable

    def disable(fn=None, *args, **kwargs):
        return fn if fn is not None else (lambda f: f)

    torch.compiler.disable = disable
    try:
        yield
    finally:
        torch.compiler.disable = original

"""Triton autotuning at warm-up: the choices shipped for this GPU where there are some, every other candidate
config compiled at once and then timed briefly.

Triton's autotuner compiles a kernel's configs one after another inside its timing loop and times each for
~125 ms. fla's prefill kernels have up to a dozen configs each: on a cold H200 host their first prefill spent
~60 s compiling one config at a time and ~20 s timing (BENCHMARKS.md, cold start). Within
``parallel_autotuning``:

- an autotuner call whose (kernel, key) is in the shipped table for this GPU (``tuned/<device name>.json``, as
  vLLM ships its fused-MoE configs per device) takes that config: one compile, no timing. A table is written by
  ``python -m benchmarks.warmup_profile --retune --write-tuned``; a config the kernel no longer offers (another
  fla version) is ignored and tuned;
- any other first call for a key that Triton's autotuning disk cache does not hold compiles all its configs in
  a thread pool (Triton's compiler releases the GIL for most of its work), then times each with a shorter run.

Either way the choice lands in the autotuner's cache (and Triton's autotuning disk cache when it tunes), so a
warm restart neither compiles nor times.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

BENCH_WARMUP_MS = 5  # Triton's defaults: 25 and 100; kernels here run for microseconds to a few milliseconds
BENCH_REP_MS = 25
TUNED_DIR = Path(__file__).with_name("tuned")


def compile_threads() -> int:
    return max(1, os.cpu_count() or 1)


@dataclass
class Tuning:
    """One autotuner's choice for one key, as made at warm-up."""
    kernel: str
    key: str
    candidates: int
    config: dict
    source: str  # "shipped" (the table's), "tuned" (compiled and timed here), "cached" (Triton's disk cache)
    seconds: float


@dataclass
class TunedConfigs:
    """Autotuning choices per kernel (module-qualified name) and key (a JSON list), for one kind of GPU."""
    device: str = ""
    kernels: dict[str, dict[str, dict]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_device(cls, device_name: str, directory: Path = TUNED_DIR) -> "TunedConfigs":
        path = tuned_path(device_name, directory)
        if not path.exists():
            return cls(device=device_name)
        raw = json.loads(path.read_text())
        return cls(device=raw.get("device", device_name), kernels=raw.get("kernels", {}),
                   versions=raw.get("versions", {}))

    def pick(self, kernel: str, key: str, configs: list) -> object | None:
        """The shipped config for (kernel, key) if the kernel still offers it."""
        wanted = self.kernels.get(kernel, {}).get(key)
        if wanted is None:
            return None
        return next((c for c in configs if config_dict(c) == wanted), None)

    def add(self, tunings: list[Tuning]) -> None:
        for t in tunings:
            self.kernels.setdefault(t.kernel, {})[t.key] = t.config

    def to_json(self) -> str:
        kernels = {k: dict(sorted(v.items())) for k, v in sorted(self.kernels.items())}
        return json.dumps({"device": self.device, "versions": self.versions, "kernels": kernels}, indent=1) + "\n"


def tuned_path(device_name: str, directory: Path = TUNED_DIR) -> Path:
    return directory / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def config_dict(config) -> dict:
    """A Triton Config as plain JSON values (what the table stores and compares)."""
    return json.loads(json.dumps(config.all_kwargs(), default=str, sort_keys=True))


def current_device_table() -> TunedConfigs:
    import torch
    return TunedConfigs.for_device(torch.cuda.get_device_name())


@contextlib.contextmanager
def parallel_autotuning(threads: int | None = None, shipped: TunedConfigs | None = None,
                        record: list[Tuning] | None = None) -> Iterator[None]:
    """Autotuners called inside take ``shipped``'s choice where it has one, else compile their candidate configs
    concurrently before timing them (all threads: the patch is on Triton's class, for the duration of the
    block; calls outside it behave as Triton's). ``record`` collects each choice made."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.testing import do_bench
    except ImportError:  # no Triton: nothing to tune
        yield
        return
    shipped = shipped or TunedConfigs()
    original_run = Autotuner.run
    lock = threading.Lock()
    seen: set[tuple[int, tuple]] = set()
    pool = ThreadPoolExecutor(threads or compile_threads(), thread_name_prefix="autotune-compile")
    quick_bench = functools.partial(do_bench, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS)

    def run(self, *args, **kwargs):
        key = tuning_key(self, args, kwargs)
        with lock:
            first = key is not None and (id(self), key) not in seen
            seen.add((id(self), key))
        if not first or key in self.cache:
            return original_run(self, *args, **kwargs)
        start = time.perf_counter()
        kernel, key_text = kernel_name(self), json.dumps(list(key), default=str)
        choice = shipped.pick(kernel, key_text, self.configs)
        if choice is not None:
            self.cache[key] = choice  # Triton's run takes it as tuned: compiles that config only
        compiled = []

        def bench(kernel_call, **kw):  # called only when Triton times (not on a disk-cache hit): compile all first
            if not compiled:
                compiled.append(True)
                _precompile(self, args, kwargs, pool)
            return quick_bench(kernel_call, **kw)

        saved = self.__dict__.get("do_bench")
        self.do_bench = bench
        try:
            return original_run(self, *args, **kwargs)
        finally:
            if saved is None:
                self.__dict__.pop("do_bench", None)
            else:
                self.do_bench = saved
            source = "shipped" if choice is not None else "tuned" if compiled else "cached"
            if record is not None and key in self.cache:
                record.append(Tuning(kernel, key_text, len(self.configs), config_dict(self.cache[key]), source,
                                     time.perf_counter() - start))

    Autotuner.run = run
    try:
        yield
    finally:
        Autotuner.run = original_run
        pool.shutdown(wait=True)


def tuning_key(tuner, args: tuple, kwargs: dict) -> tuple | None:
    """The key Triton's Autotuner.run computes (its ``keys`` arguments, then every tensor's dtype); None for a
    one-config tuner (it never tunes)."""
    if len(tuner.configs) <= 1:
        return None
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {k: v for k, v in named.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


def _precompile(tuner, args: tuple, kwargs: dict, pool: ThreadPoolExecutor) -> None:
    """Compile (no launch) each of the tuner's configs, from within Triton's timing: the first here, to build
    Triton's per-function caches once, the rest in the pool. A config that fails to compile is left to the autotuner, which skips it."""
    saved = tuner.nargs  # inside Triton's run: its own, still needed after the timing
    try:
        tuner.nargs = dict(zip(tuner.arg_names, args))
        configs = tuner.prune_configs(kwargs)
    except Exception as e:  # an unknown Triton version: tune as Triton does
        log.debug("autotune precompile skipped", extra={"kernel": kernel_name(tuner), "error": repr(e)})
        return
    finally:
        tuner.nargs = saved

    def compile_one(config) -> None:
        meta = {**kwargs, **config.all_kwargs(), "warmup": True}
        try:
            tuner.fn.run(*args, **meta)
        except Exception as e:
            log.debug("autotune config did not compile", extra={"kernel": kernel_name(tuner), "error": repr(e)})

    if not configs:
        return
    compile_one(configs[0])
    list(pool.map(compile_one, configs[1:]))
    log.debug("autotune configs compiled", extra={"kernel": kernel_name(tuner), "configs": len(configs)})


def kernel_name(tuner) -> str:
    """The module-qualified name of the Python function under an autotuner (through heuristics wrappers)."""
    fn = tuner
    while hasattr(fn, "fn"):
        fn = fn.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

"""Triton autotuning at warm-up: every candidate config compiled at once, then timed briefly.

Triton's autotuner compiles a kernel's configs one after another inside its timing loop, and times each for
~125 ms. fla's prefill kernels have up to a dozen configs each: on a cold H200 host their first prefill spent
~60 s compiling one config at a time and ~20 s timing (BENCHMARKS.md, cold start). Within
``parallel_autotuning`` an autotuner's first call for a key compiles all its configs in a thread pool (Triton's
compiler releases the GIL for most of its work) and times each with a shorter run; the choice is stored in
Triton's autotuning cache like any other, so a warm restart neither compiles nor times.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

BENCH_WARMUP_MS = 5  # Triton's defaults: 25 and 100; kernels here run for microseconds to a few milliseconds
BENCH_REP_MS = 25


def compile_threads() -> int:
    return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def parallel_autotuning(threads: int | None = None) -> Iterator[None]:
    """Autotuners called inside compile their candidate configs concurrently before timing them (all threads:
    the patch is on Triton's class, for the duration of the block; calls outside it behave as Triton's)."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.testing import do_bench
    except ImportError:  # no Triton: nothing to tune
        yield
        return
    original_run = Autotuner.run
    lock = threading.Lock()
    precompiled: set[tuple[int, tuple]] = set()
    pool = ThreadPoolExecutor(threads or compile_threads(), thread_name_prefix="autotune-compile")
    quick_bench = functools.partial(do_bench, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS)

    def run(self, *args, **kwargs):
        signature = (id(self), _arg_signature(args, kwargs))
        with lock:
            first = signature not in precompiled
            precompiled.add(signature)
        if first and len(self.configs) > 1:
            _precompile(self, args, kwargs, pool)
        saved = self.__dict__.get("do_bench")
        self.do_bench = quick_bench
        try:
            return original_run(self, *args, **kwargs)
        finally:
            if saved is None:
                self.__dict__.pop("do_bench", None)
            else:
                self.do_bench = saved

    Autotuner.run = run
    try:
        yield
    finally:
        Autotuner.run = original_run
        pool.shutdown(wait=True)


def _arg_signature(args: tuple, kwargs: dict) -> tuple:
    """What Triton specialises a compile on, roughly: dtypes, and ints (sizes) as they are."""
    def one(a):
        dtype = getattr(a, "dtype", None)
        if dtype is not None:
            return str(dtype)
        return a if isinstance(a, (int, bool, str, type(None))) else type(a).__name__
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()) if k != "grid")


def _precompile(tuner, args: tuple, kwargs: dict, pool: ThreadPoolExecutor) -> None:
    """Compile (no launch) each of the tuner's configs: the first here, to build Triton's per-function caches
    once, the rest in the pool. A config that fails to compile is left to the autotuner, which skips it."""
    try:
        tuner.nargs = dict(zip(tuner.arg_names, args))
        configs = tuner.prune_configs(kwargs)
    except Exception as e:  # an unknown Triton version: tune as Triton does
        log.debug("autotune precompile skipped", extra={"kernel": _name(tuner), "error": repr(e)})
        return
    finally:
        tuner.nargs = None

    def compile_one(config) -> None:
        meta = {**kwargs, **config.all_kwargs(), "warmup": True}
        try:
            tuner.fn.run(*args, **meta)
        except Exception as e:
            log.debug("autotune config did not compile", extra={"kernel": _name(tuner), "error": repr(e)})

    if not configs:
        return
    compile_one(configs[0])
    list(pool.map(compile_one, configs[1:]))
    log.debug("autotune configs compiled", extra={"kernel": _name(tuner), "configs": len(configs)})


def _name(tuner) -> str:
    fn = tuner
    while hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", repr(fn))

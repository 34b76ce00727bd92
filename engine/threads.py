"""One call in a thread of its own, for start-up work that overlaps other start-up work."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def background(fn: Callable[[], T], name: str = "engine-init") -> Future[T]:
    """``fn()`` started now in a new thread; its future (``result()`` waits and raises its error)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)

"""Children that do not outlive their supervisor (``gaggle up``), however it ends.

Two mechanisms, so the rule holds where one is missing:
- the parent-death signal (Linux ``PR_SET_PDEATHSIG``): the kernel sends SIGTERM to a child when the process that
  started it dies, set between fork and exec (``die_with_parent``), so it covers non-Python children too (Redis);
- a lifeline: the supervisor holds the write end of a pipe that every child inherits the read end of (its number in
  ``GAGGLE_LIFELINE_FD``) and never writes to it. The supervisor's death closes it, the child's read returns, and
  the child stops (``watch_lifeline``): a graceful SIGTERM to itself first, then an exit after
  ORPHAN_GRACE_S whatever it was waiting for (Redis may be gone too). What it could not hand over stays where a
  restart finds it: pending stream entries, batch files.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

LIFELINE_ENV = "GAGGLE_LIFELINE_FD"
ORPHAN_GRACE_S = 5.0  # a child's graceful stop once orphaned, before it exits regardless
EXIT_ORPHANED = 3  # the status of a child that had to exit regardless (documented in the README)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """(Between fork and exec: Popen's ``preexec_fn``.) SIGTERM this process when its parent dies (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass


class Lifeline:
    """The supervisor's end: a pipe whose read end its children inherit."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_inheritable(self.read_fd, True)

    def child_env(self) -> dict[str, str]:
        return {LIFELINE_ENV: str(self.read_fd)}

    def close(self) -> None:
        """Cut it (children stop as if the supervisor had died); the supervisor's normal shutdown does not."""
        for fd in (self._write_fd, self.read_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def watch_lifeline() -> bool:
    """In a child of ``gaggle up``: stop once the supervisor is gone (see the module docstring). False where this
    process has no lifeline (started by hand)."""
    raw = os.environ.pop(LIFELINE_ENV, None)  # a grandchild (uvicorn's processes) must not watch it again
    if raw is None or not raw.isdigit():
        return False
    fd = int(raw)
    if os.getppid() == 1:  # the supervisor died before we got here
        _orphaned()
    threading.Thread(target=_watch, args=(fd,), name="gaggle-lifeline", daemon=True).start()
    return True


def _watch(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    _orphaned()


def _orphaned() -> None:
    log.error("the supervisor is gone; stopping", extra={"pid": os.getpid(), "grace_s": ORPHAN_GRACE_S})
    timer = threading.Timer(ORPHAN_GRACE_S, lambda: os._exit(EXIT_ORPHANED))
    timer.daemon = True
    timer.start()
    os.kill(os.getpid(), signal.SIGTERM)

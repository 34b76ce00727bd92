"""Several API processes on one port, each with its own listening socket (``SO_REUSEPORT``).

uvicorn's ``--workers`` shares one listening socket between its processes: whichever process wakes first accepts
every connection waiting (asyncio accepts up to the backlog at once), so a burst of keep-alive connections lands
mostly on one process and stays there — measured on the 16-core H200 host, 4 API processes used 1.00 core
between them and accepted 2,051 requests/s. With a socket a process the kernel spreads new connections over
the processes by a hash of their addresses.

The parent binds the port first (nothing else may listen there: it checks with a plain bind), starts the
processes, restarts one that dies, replaces them one by one on SIGHUP (no moment without a process serving), adds
one on SIGTTIN and stops one gracefully on SIGTTOU (never the last), as uvicorn's own supervisor does, and on
SIGINT/SIGTERM stops them all, waiting for their graceful shutdown.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before restarting a process that died
HEALTHY_AFTER_S = 30.0  # serving this long resets a process's backoff
PARENT_CHECK_S = 0.5  # how often a process checks that its parent still runs
STARTUP_TIMEOUT_S = 120.0  # SIGHUP: how long a replacement process may take to serve


def reuse_port_supported() -> bool:
    """Linux balances connections over ``SO_REUSEPORT`` sockets; other systems (macOS) give them to one."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to (host, port), not listening: a listening socket of a ``SO_REUSEPORT`` group gets
    a share of the connections, so only the serving processes listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """The port for this service's processes, or ``OSError`` when something else listens there. A plain bind
    first: another ``SO_REUSEPORT`` listener of the same user would otherwise silently share the port."""
    bind_socket(host, port, reuse_port=False).close()
    return bind_socket(host, port, reuse_port=True)


def _serve_one(host: str, port: int, uvicorn_kwargs: dict[str, Any], ready, parent: int) -> None:
    """One API process: its own listening socket, then uvicorn until SIGINT/SIGTERM or until its parent is
    gone (killed outright, it cannot stop us: we would keep the port); ``ready`` is set once the app has
    started (lifespan done, socket listening)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # listening, the app started: said at once (a poll left a window for a kill)
                ready.set()

    sock = bind_socket(host, port, reuse_port=True)
    config = uvicorn.Config("api.main:create_app", factory=True, host=host, port=port, **uvicorn_kwargs)
    server = Server(config)

    def watch() -> None:
        while not server.should_exit:
            if os.getppid() != parent:
                log.warning("api parent process gone; stopping", extra={"parent": parent})
                server.should_exit = True  # a graceful stop: requests in flight finish
            time.sleep(PARENT_CHECK_S)

    threading.Thread(target=watch, daemon=True).start()
    server.run(sockets=[sock])


class _Child:
    def __init__(self, host: str, port: int, uvicorn_kwargs: dict[str, Any]) -> None:
        self.args = (host, port, uvicorn_kwargs)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.ready = None
        self.started = 0.0
        self.failures = 0  # deaths in a row, for the restart backoff

    def start(self) -> None:
        # spawn, not fork: the parent may hold threads and sockets that a forked child should not inherit
        context = multiprocessing.get_context("spawn")
        self.ready = context.Event()
        self.process = context.Process(target=_serve_one, args=(*self.args, self.ready, os.getpid()), daemon=False)
        self.process.start()
        self.started = time.monotonic()
        log.info("api process started", extra={"pid": self.process.pid})

    def restart_delay(self) -> float:
        first, longest = RESTART_BACKOFF_S
        return min(longest, first * 2 ** max(0, self.failures - 1))


def serve_processes(host: str, port: int, processes: int, shutdown_timeout_s: float,
                    uvicorn_kwargs: dict[str, Any]) -> int:
    """Run ``processes`` API processes on host:port until SIGINT/SIGTERM (SIGHUP: replace them one by one, each
    new one serving before the old one stops — the API keys file is read again, the flags stay as started;
    SIGTTIN / SIGTTOU: one process more / fewer); the exit status (3: a process failed to start)."""
    try:
        reservation = reserve_port(host, port)
    except OSError as e:
        print(f"gaggle: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    supervisor = _Supervisor(host, port, processes, shutdown_timeout_s, uvicorn_kwargs)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)
    previous = {s: signal.signal(s, supervisor.on_signal) for s in handled}
    try:
        return supervisor.run()
    finally:
        _stop_all(supervisor.children, shutdown_timeout_s)
        reservation.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Supervisor:
    def __init__(self, host: str, port: int, processes: int, shutdown_timeout_s: float,
                 uvicorn_kwargs: dict[str, Any]) -> None:
        self.new_child = lambda: _Child(host, port, uvicorn_kwargs)
        self.children = [self.new_child() for _ in range(processes)]
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stopping = False
        self.reload = False
        self.resize = 0  # SIGTTIN / SIGTTOU received and not yet applied: processes to add (< 0: to stop)
        self.status = 0
        self.pending: dict[int, float] = {}  # child index -> when to restart it
        self.port = port

    def on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGHUP:
            self.reload = True
        elif signum in (signal.SIGTTIN, signal.SIGTTOU):
            self.resize += 1 if signum == signal.SIGTTIN else -1
        else:
            self.stopping = True

    def run(self) -> int:
        for child in self.children:
            child.start()
        log.info("api listening", extra={"port": self.port, "processes": len(self.children)})
        while not self.stopping:
            time.sleep(0.2)
            if self.reload:
                self.reload = False
                self._replace_all()
            if self.resize:
                self._resize()
            self._check(time.monotonic())
        return self.status

    def _check(self, now: float) -> None:
        """Restart a process that died (after a backoff); stop everything if one never started."""
        for i, child in enumerate(self.children):
            if i in self.pending:
                if now >= self.pending[i]:
                    del self.pending[i]
                    child.start()
                continue
            if child.process.is_alive():
                if now - child.started > HEALTHY_AFTER_S:
                    child.failures = 0
                continue
            code = child.process.exitcode
            if not child.ready.is_set() and child.failures == 0 and code is not None and code >= 0:
                # exited before serving (bad settings, Redis URL, port): every restart would fail the same way;
                # one killed by a signal (the OOM killer, an operator) is restarted like any other
                log.error("api process failed to start", extra={"pid": child.process.pid, "exitcode": code})
                self.stopping, self.status = True, 3
                return
            child.failures += 1
            self.pending[i] = now + child.restart_delay()
            log.warning("api process died; restarting", extra={"pid": child.process.pid, "exitcode": code,
                                                                "restart_in_s": round(self.pending[i] - now, 1)})

    def _resize(self) -> None:
        """SIGTTIN: start one more process; SIGTTOU: stop the newest gracefully (requests in flight finish),
        never the last one."""
        grow, self.resize = self.resize, 0
        for _ in range(grow):
            child = self.new_child()
            child.start()
            self.children.append(child)
        for _ in range(-grow):
            if len(self.children) == 1:
                log.warning("api: SIGTTOU with one process left; keeping it")
                break
            child = self.children.pop()
            self.pending.pop(len(self.children), None)
            _stop_all([child], self.shutdown_timeout_s)
        log.info("api processes resized", extra={"processes": len(self.children), "change": grow})

    def _replace_all(self) -> None:
        """SIGHUP: each process in turn replaced by a new one, which serves beside it (its own socket) before
        the old one stops gracefully; a new one that does not start leaves the old one serving."""
        log.info("api processes restarting one by one", extra={"processes": len(self.children)})
        for i, old in enumerate(self.children):
            new = self.new_child()
            new.start()
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not new.ready.is_set() and new.process.is_alive() and time.monotonic() < deadline \
                    and not self.stopping:
                time.sleep(0.05)
            if not new.ready.is_set():
                if not self.stopping:
                    log.error("a new api process did not start; keeping the old one",
                              extra={"pid": new.process.pid, "old_pid": old.process.pid})
                _stop_all([new], 0.0)
                return
            self.pending.pop(i, None)
            self.children[i] = new
            _stop_all([old], self.shutdown_timeout_s)
            log.info("api process replaced", extra={"pid": new.process.pid, "old_pid": old.process.pid})


def _stop_all(children: list[_Child], shutdown_timeout_s: float) -> None:
    """SIGTERM to every process (uvicorn finishes the requests in flight), SIGKILL to any still there after
    the shutdown timeout."""
    live = [c.process for c in children if c.process is not None and c.process.is_alive()]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + shutdown_timeout_s + 5.0
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.warning("api process did not stop in time; killing it", extra={"pid": p.pid})
            p.kill()
            p.join(5.0)

"""Processes as Linux's /proc shows them: a process's descendants and its CPU time (benchmarks and tests)."""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def is_alive(pid: int) -> bool:
    """Running: a zombie (dead, not yet reaped) counts as gone."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry))[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # exited while we looked
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children."""
    return sum(int(x) for x in _stat_fields(pid)[11:15]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of a process and its live descendants (e.g. an API's uvicorn workers)."""
    total = 0.0
    for pid in (root, *descendants(root)):
        try:
            total += cpu_seconds(pid)
        except OSError:
            pass  # exited
    return total


_TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def tcp_sockets(port: int) -> dict[int, str]:
    """inode -> state ('LISTEN', 'ESTABLISHED', else the kernel's hex code) of the TCP sockets on local ``port``."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                out[int(cols[9])] = _TCP_STATES.get(cols[3], cols[3])
    return out


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets a process holds open."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def serving_processes(root: int, port: int) -> dict[int, int]:
    """The processes under ``root`` (itself included) listening on ``port`` -> the connections each holds."""
    sockets = tcp_sockets(port)
    out = {}
    for pid in (root, *descendants(root)):
        mine = [sockets[i] for i in socket_inodes(pid) if i in sockets]
        if "LISTEN" in mine:
            out[pid] = mine.count("ESTABLISHED")
    return out

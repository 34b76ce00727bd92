"""RESP framing for the writer: what redis-py's pack_command makes, without its ~10 µs of Python per command."""

from __future__ import annotations


def bulk(arg) -> bytes:
    """One RESP bulk string; str, bytes, int and float (as repr) arguments."""
    if isinstance(arg, str):
        arg = arg.encode()
    elif isinstance(arg, float):
        arg = repr(arg).encode()
    elif not isinstance(arg, (bytes, bytearray)):
        arg = str(arg).encode()
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def command(*args) -> bytes:
    """One RESP command."""
    return b"*%d\r\n" % len(args) + b"".join(map(bulk, args))

"""A plain socket to Redis for the writer: commands framed by ``hiredis.pack_command``, replies parsed by a
``hiredis.Reader``. The writer sends one pipelined write per engine step and reads its replies itself; redis-py's
client spends ~10 µs of Python per pipelined command, this a microsecond."""

from __future__ import annotations

import socket
import ssl

import hiredis
import redis
from redis.connection import parse_url


def handshake(options: dict, client_name: str) -> list[tuple]:
    """The commands a new connection sends first (AUTH, SELECT, CLIENT SETNAME), from ``parse_url`` options."""
    commands = []
    if options.get("password"):
        user = options.get("username")
        commands.append(("AUTH", user, options["password"]) if user else ("AUTH", options["password"]))
    if options.get("db"):
        commands.append(("SELECT", options["db"]))
    commands.append(("CLIENT", "SETNAME", client_name))
    return commands


def tls_context(options: dict) -> ssl.SSLContext | None:
    """A TLS context for a ``rediss://`` URL (verification off with ``ssl_cert_reqs=none``), else None."""
    if options.get("connection_class") is not redis.connection.SSLConnection:
        return None
    context = ssl.create_default_context()
    if options.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


class NotSent(redis.ConnectionError):
    """Redis could not be reached: nothing of the write ran."""


class RawConnection:
    def __init__(self, url: str, client_name: str, timeout_s: float = 30.0):
        self.options = parse_url(url)
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.sock: socket.socket | None = None
        self.reader: hiredis.Reader | None = None

    def connect(self) -> None:
        """Open the socket and hand-shake (AUTH, SELECT, CLIENT SETNAME); NotSent if Redis is unreachable."""
        o = self.options
        try:
            if "path" in o:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                sock.connect(o["path"])
            else:
                sock = socket.create_connection((o.get("host", "localhost"), o.get("port", 6379)), self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                context = tls_context(o)
                if context is not None:
                    sock = context.wrap_socket(sock, server_hostname=o.get("host"))
        except OSError as e:
            raise NotSent(f"cannot connect to redis: {e}") from e
        self.sock, self.reader = sock, hiredis.Reader()
        first = handshake(o, self.client_name)
        try:
            self.send(b"".join(hiredis.pack_command(cmd) for cmd in first))
            errors = [r for r in self.read(len(first)) if isinstance(r, hiredis.ReplyError)]
        except BaseException:
            self.close()
            raise
        if errors:
            self.close()
            raise NotSent(f"redis refused the connection: {errors[0]}")

    def send(self, blob: bytes) -> None:
        try:
            self.sock.sendall(blob)
        except OSError as e:
            self.close()
            raise redis.ConnectionError(f"redis write: {e!r}") from e

    def read(self, count: int) -> list:
        """``count`` replies (error replies as hiredis.ReplyError values)."""
        replies: list = []
        try:
            while len(replies) < count:
                reply = self.reader.gets()
                if reply is False:
                    data = self.sock.recv(1 << 20)
                    if not data:
                        raise redis.ConnectionError("connection closed by the server")
                    self.reader.feed(data)
                else:
                    replies.append(reply)
        except OSError as e:
            self.close()
            raise redis.ConnectionError(f"redis read: {e!r}") from e
        except BaseException:  # replies may be left unread: start afresh next time
            self.close()
            raise
        return replies

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock, self.reader = None, None

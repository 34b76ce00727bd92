"""A lean HTTP/1.1 client over asyncio streams: what a load generator needs and nothing more.

Keep-alive connections in a per-process pool, requests written as pre-built bytes, bodies read by
Content-Length or chunked framing. No redirects, no compression, no cookies: a benchmark client should
spend its CPU on the wire, not on a general-purpose library (httpx is a test dependency only).
"""

from __future__ import annotations

import asyncio
import ssl as ssl_lib
from dataclasses import dataclass
from urllib.parse import urlsplit

READ_LIMIT = 1 << 20  # longest header block or chunk-size line the reader buffers


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: host, port, TLS, and the request-line path."""
    host: str
    port: int
    path: str
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--base-url must be http://host[:port] or https://…, got {url!r}")
        tls = parts.scheme == "https"
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.hostname, parts.port or (443 if tls else 80), path, tls)

    def request_head(self, method: str, headers: dict[str, str]) -> bytes:
        """Everything before Content-Length; one request adds its length and body."""
        lines = [f"{method} {self.path} HTTP/1.1", f"Host: {self.host}:{self.port}", "User-Agent: gaggle-bench",
                 "Accept: */*"] + [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n").encode("latin-1")


class Response:
    """Status and headers read; the body is read with ``read_body`` or chunk by chunk with ``next_piece``."""

    def __init__(self, conn: Connection, status: int, headers: dict[bytes, bytes]):
        self.conn = conn
        self.status = status
        self.headers = headers
        self.is_chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        length = headers.get(b"content-length")
        self._remaining = int(length) if length is not None and not self.is_chunked else None
        self.is_complete = False
        self._buf = b""  # chunked framing not yet decoded

    async def next_piece(self) -> bytes | None:
        """The body's next bytes as they arrive (every chunk complete in one socket read, joined); None at
        the end. One read per arrival, not two awaits per chunk: the client's CPU is what is being saved."""
        reader = self.conn.reader
        if self.is_complete:
            return None
        if self.is_chunked:
            while True:
                data = self._take_chunks()
                if data or self.is_complete:
                    return data or None
                more = await reader.read(1 << 16)
                if not more:
                    raise asyncio.IncompleteReadError(self._buf, None)
                self._buf += more
        if self._remaining is not None:
            if self._remaining == 0:
                self.is_complete = True
                return None
            data = await reader.read(min(self._remaining, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", self._remaining)
            self._remaining -= len(data)
            return data
        data = await reader.read(1 << 16)  # no framing: the body ends with the connection
        if not data:
            self.is_complete = True
            self.conn.is_reusable = False
            return None
        return data

    def _take_chunks(self) -> bytes:
        """Decode every complete chunk in the buffer; the last (size 0) and its trailers complete the body."""
        buf, pos, out = self._buf, 0, []
        while (eol := buf.find(b"\r\n", pos)) >= 0:
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                end = eol + 4 if buf[eol + 2:eol + 4] == b"\r\n" else buf.find(b"\r\n\r\n", eol) + 4
                if end >= 4 and end <= len(buf):
                    self.is_complete, pos = True, end
                break
            if len(buf) < eol + 4 + size:
                break
            out.append(buf[eol + 2:eol + 2 + size])
            pos = eol + 4 + size
        self._buf = buf[pos:]
        return b"".join(out)

    async def read_body(self) -> bytes:
        if self._remaining is not None and not self.is_complete:
            data = await self.conn.reader.readexactly(self._remaining)
            self._remaining = 0
            self.is_complete = True
            return data
        pieces = []
        while (piece := await self.next_piece()) is not None:
            pieces.append(piece)
        return b"".join(pieces)


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.is_reusable = True

    async def send(self, head: bytes, body: bytes) -> Response:
        """Write one request and read the status line and headers of its response."""
        self.writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        block = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = block[:-4].split(b"\r\n")
        version, status = status_line.split(b" ", 2)[:2]
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if version != b"HTTP/1.1" or headers.get(b"connection", b"").lower() == b"close":
            self.is_reusable = False
        return Response(self, int(status), headers)

    def close(self) -> None:
        self.is_reusable = False
        self.writer.close()


class Pool:
    """Idle keep-alive connections to one endpoint; a new one is opened whenever none is idle."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self._idle: list[Connection] = []
        self._ssl = ssl_lib.create_default_context() if endpoint.tls else None
        self.num_opened = 0

    async def open(self) -> Connection:
        reader, writer = await asyncio.open_connection(self.endpoint.host, self.endpoint.port, ssl=self._ssl,
                                                       limit=READ_LIMIT)
        self.num_opened += 1
        return Connection(reader, writer)

    async def send(self, head: bytes, body: bytes) -> Response:
        """Send on an idle connection, or a new one; a reused connection the server closed meanwhile
        (it fails before any response byte) is retried once on a fresh one, as browsers do."""
        while self._idle:
            conn = self._idle.pop()
            try:
                return await conn.send(head, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                conn.close()
        conn = await self.open()
        return await conn.send(head, body)

    def release(self, response: Response) -> None:
        """Back to the pool if the body was read to its end and the server keeps the connection open."""
        conn = response.conn
        if response.is_complete and conn.is_reusable:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


async def get_json_bytes(url: str, headers: dict[str, str], timeout_s: float = 30.0) -> tuple[int, bytes]:
    """One GET (e.g. /v1/models): status and body."""
    endpoint = Endpoint.parse(url)
    pool = Pool(endpoint)
    try:
        async def go() -> tuple[int, bytes]:
            response = await pool.send(endpoint.request_head("GET", headers), b"")
            body = await response.read_body()
            pool.release(response)
            return response.status, body
        return await asyncio.wait_for(go(), timeout_s)
    finally:
        pool.close()

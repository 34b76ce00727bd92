"""Bounded request heads: uvicorn's httptools protocol keeps a request's headers in memory however large they are
(8 connections sending 100 MB headers took an API process from 108 MB to 937 MB and stalled it). Here a head past
MAX_HEAD_BYTES, or with more than MAX_HEADERS headers, is answered 431 and its connection closed, as nginx and
uvicorn's h11 protocol do with their own limits.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 128 * 1024  # request line and headers (counted as bytes read until the headers are complete)
MAX_HEADERS = 100
_BODY = (b'{"error":{"message":"the request head (line and headers) is too large","type":"invalid_request_error",'
         b'"param":null,"code":"headers_too_large"}}')
_REFUSAL = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class BoundedHeadProtocol(HttpToolsProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._headers = 0
        self._in_head = True
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)  # a read may end the head and carry body bytes: the head's end decides
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self._refused:
            self._refuse()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > MAX_HEADERS:
            self._refuse()
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._headers = True, 0, 0  # the next request on this connection

    def _refuse(self) -> None:
        self._refused = True
        if not self.transport.is_closing():
            self.transport.write(_REFUSAL)
            self.transport.close()

"""A lean HTTP/1.1 transport for httpx, for the tap's hop to vLLM.

Why: httpx's default transport (httpcore + h11, pure Python) costs about a millisecond of CPU per
request, which is most of the tap's budget; plain asyncio streams cost a fraction of it. This
transport speaks just what a reverse proxy needs — HTTP/1.1 requests with a known body, responses
framed by Content-Length, chunked encoding or connection close — with keep-alive pooling, and maps
every failure to the httpx exception a caller expects (``ConnectError``, ``ConnectTimeout``,
``ReadTimeout``, ``RemoteProtocolError``). Bodies are passed through as received (de-chunked,
never decoded), like ``Response.aiter_raw()``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httpx

_HEAD_LIMIT_BYTES = 64 * 1024
_READ_SIZE = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})
# httpx sends "Content-Length: 0" for these methods when the body is empty (and none for the others).
_EMPTY_BODY_LENGTH_METHODS = frozenset({"POST", "PUT", "PATCH"})

T = TypeVar("T")


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 with keep-alive over asyncio streams. ``read_timeout_s`` None waits forever
    (generation may pause for long); ``max_idle`` idle connections are kept per host."""

    def __init__(
        self, *, connect_timeout_s: float = 5.0, read_timeout_s: float | None = None, max_idle: int = 100
    ) -> None:
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be positive but got {connect_timeout_s}")
        if read_timeout_s is not None and read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be positive or None but got {read_timeout_s}")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport interface (``httpx.AsyncClient(transport=...)``)."""
        origin = (request.url.scheme, request.url.host, request.url.port or _default_port(request.url.scheme))
        head = _request_head(request.method, request.url.raw_path or b"/", request.headers.raw)
        body = await _request_body(request)
        answer = await self._send(origin, request.method, head, body, request)
        return httpx.Response(
            answer.status_code,
            headers=answer.headers,
            stream=answer.stream,
            request=request,
            extensions={"http_version": answer.http_version, "reason_phrase": answer.reason},
        )

    async def send(
        self,
        origin: tuple[str, str, int],
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        host: bytes,
    ) -> UpstreamResponse:
        """The proxy's fast path: one request without building httpx objects (an ``httpx.Request``
        costs more than the rest of the hop). Adds ``Host: host`` (``httpx.URL.netloc``) and
        ``Content-Length`` exactly as httpx would; ``headers`` must carry neither. Raises the same
        httpx exceptions as :meth:`handle_async_request`."""
        auto = [(b"Host", host)]
        if body:
            headers = [*headers, (b"Content-Length", str(len(body)).encode())]
        elif method in _EMPTY_BODY_LENGTH_METHODS:
            auto.append((b"Content-Length", b"0"))
        return await self._send(origin, method, _request_head(method, target, auto + headers), body, None)

    async def _send(
        self, origin: tuple[str, str, int], method: str, head: bytes, body: bytes, request: httpx.Request | None
    ) -> UpstreamResponse:
        conn = self._take_idle(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, origin, method, request, head, body)
            except _StaleConnection:
                pass  # the upstream closed a kept-alive connection before reading this request
        conn = await self._connect(origin, request)
        try:
            return await self._exchange(conn, origin, method, request, head, body)
        except _StaleConnection as exc:
            raise httpx.RemoteProtocolError(
                "upstream closed the connection without answering", request=request
            ) from exc

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # -- connections ------------------------------------------------------------------------------
    def _take_idle(self, origin: tuple[str, str, int]) -> _Connection | None:
        pool = self._idle.get(origin)
        while pool:
            conn = pool.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    def release(self, origin: tuple[str, str, int], conn: _Connection) -> None:
        pool = self._idle.setdefault(origin, [])
        if conn.usable() and len(pool) < self.max_idle:
            pool.append(conn)
        else:
            conn.close()

    async def _connect(self, origin: tuple[str, str, int], request: httpx.Request | None) -> _Connection:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=context, limit=_HEAD_LIMIT_BYTES),
                self.connect_timeout_s,
            )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                f"no connection to {host}:{port} within {self.connect_timeout_s:g} s", request=request
            ) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}", request=request) from exc
        return _Connection(reader, writer)

    # -- one exchange -----------------------------------------------------------------------------
    async def _exchange(
        self,
        conn: _Connection,
        origin: tuple[str, str, int],
        method: str,
        request: httpx.Request | None,
        head: bytes,
        body: bytes,
    ) -> UpstreamResponse:
        try:
            conn.writer.write(head + body)
            await conn.writer.drain()
            raw_head = await _timed(conn.reader.readuntil(b"\r\n\r\n"), self.read_timeout_s, request)
            status, reason, headers, http10 = _parse_head(raw_head, request)
            while 100 <= status < 200 and status != 101:  # interim answers (100 Continue): skip
                raw_head = await _timed(conn.reader.readuntil(b"\r\n\r\n"), self.read_timeout_s, request)
                status, reason, headers, http10 = _parse_head(raw_head, request)
        except asyncio.IncompleteReadError as exc:
            conn.close()
            if not exc.partial:
                raise _StaleConnection from exc
            raise httpx.RemoteProtocolError("upstream sent a cut response head", request=request) from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            conn.close()
            raise _StaleConnection from exc
        except asyncio.LimitOverrunError as exc:
            conn.close()
            raise httpx.RemoteProtocolError("upstream response head over 64 KiB", request=request) from exc
        except BaseException:
            conn.close()
            raise

        names = {name.lower(): value for name, value in headers}
        connection = names.get(b"connection", b"").lower()
        keep_alive = b"close" not in connection and (not http10 or b"keep-alive" in connection)
        if method == "HEAD" or status in _NO_BODY_STATUS or status == 101:
            framing, length = "none", 0
        elif b"chunked" in names.get(b"transfer-encoding", b"").lower():
            framing, length = "chunked", 0
        elif b"content-length" in names:
            try:
                length = int(names[b"content-length"])
            except ValueError as exc:
                conn.close()
                raise httpx.RemoteProtocolError("bad Content-Length from upstream", request=request) from exc
            framing = "length"
        else:
            framing, length, keep_alive = "close", 0, False
        stream = _Body(self, conn, origin, request, framing, length, keep_alive)
        if framing == "none":
            stream.finish()
        return UpstreamResponse(status, reason, headers, stream, b"HTTP/1.0" if http10 else b"HTTP/1.1")


async def _timed(awaitable: Awaitable[T], timeout_s: float | None, request: httpx.Request | None) -> T:
    """Await a read, as an httpx ``ReadTimeout`` if it takes over ``timeout_s`` (None: no limit)."""
    if timeout_s is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError as exc:
        raise httpx.ReadTimeout(f"upstream sent nothing for {timeout_s:g} s", request=request) from exc


class UpstreamResponse:
    """An answer from the upstream: status, raw headers (as received) and the body stream."""

    __slots__ = ("headers", "http_version", "reason", "status_code", "stream")

    def __init__(
        self,
        status_code: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        stream: _Body,
        http_version: bytes,
    ) -> None:
        self.status_code = status_code
        self.reason = reason
        self.headers = headers
        self.stream = stream
        self.http_version = http_version

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked, never decoded); read it to the end or ``aclose``."""
        return self.stream.__aiter__()

    async def aclose(self) -> None:
        await self.stream.aclose()


class _StaleConnection(Exception):
    """A pooled connection turned out closed before any answer: safe to retry on a fresh one."""


class _Body(httpx.AsyncByteStream):
    """The response body as it arrives; gives the connection back to the pool when fully read."""

    def __init__(
        self,
        transport: UpstreamTransport,
        conn: _Connection,
        origin: tuple[str, str, int],
        request: httpx.Request | None,
        framing: str,
        length: int,
        keep_alive: bool,
    ) -> None:
        self._transport = transport
        self._timeout_s = transport.read_timeout_s
        self._conn: _Connection | None = conn
        self._origin = origin
        self._request = request
        self._framing = framing
        self._length = length
        self._keep_alive = keep_alive
        self._done = False

    def finish(self) -> None:
        self._done = True
        self._give_back()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._done or self._conn is None:
            return
        reader = self._conn.reader
        try:
            if self._framing == "length":
                remaining = self._length
                while remaining > 0:
                    chunk = await _timed(reader.read(min(remaining, _READ_SIZE)), self._timeout_s, self._request)
                    if not chunk:
                        raise httpx.RemoteProtocolError(
                            f"upstream closed the connection {remaining} bytes short of the body",
                            request=self._request,
                        )
                    remaining -= len(chunk)
                    yield chunk
            elif self._framing == "chunked":
                async for chunk in self._chunks(reader):
                    yield chunk
            else:  # delimited by the connection closing
                while chunk := await _timed(reader.read(_READ_SIZE), self._timeout_s, self._request):
                    yield chunk
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            self._abandon()
            raise httpx.RemoteProtocolError("upstream closed the connection mid-body", request=self._request) from exc
        except BaseException:
            self._abandon()
            raise
        self.finish()

    async def _chunks(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        timeout_s, request = self._timeout_s, self._request
        while True:
            line = await _timed(reader.readuntil(b"\r\n"), timeout_s, request)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise httpx.RemoteProtocolError(f"bad chunk size line {line[:40]!r}", request=self._request) from exc
            if size == 0:
                while await _timed(reader.readuntil(b"\r\n"), timeout_s, request) != b"\r\n":
                    pass  # trailers: not forwarded
                return
            data = await _timed(reader.readexactly(size + 2), timeout_s, request)
            if data[-2:] != b"\r\n":
                raise httpx.RemoteProtocolError("chunk not followed by CRLF", request=self._request)
            yield data[:-2]

    async def aclose(self) -> None:
        if not self._done:
            self._abandon()  # not read to the end: the connection is in an unknown state

    def _abandon(self) -> None:
        self._done = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _give_back(self) -> None:
        if self._conn is None:
            return
        if self._keep_alive:
            self._transport.release(self._origin, self._conn)
        else:
            self._conn.close()
        self._conn = None


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _request_head(method: str, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [method.encode("ascii") + b" " + target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _request_body(request: httpx.Request) -> bytes:
    body = await request.aread()
    if b"chunked" in request.headers.get("transfer-encoding", "").encode().lower():
        return (f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    return body


def _parse_head(
    raw: bytes, request: httpx.Request | None
) -> tuple[int, bytes, list[tuple[bytes, bytes]], bool]:
    lines = raw[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"bad status line from upstream: {lines[0][:80]!r}", request=request)
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"bad header line from upstream: {line[:80]!r}", request=request)
        headers.append((name, value.strip()))
    return int(parts[1]), parts[2] if len(parts) > 2 else b"", headers, parts[0] == b"HTTP/1.0"

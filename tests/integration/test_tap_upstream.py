"""The tap's lean HTTP/1.1 upstream transport against raw scripted servers on 127.0.0.1.

Each server writes exact bytes, so every framing and failure case is real: Content-Length,
chunked, close-delimited, HEAD/204, keep-alive reuse, a kept-alive connection the server closed,
a body cut short, a stall past the read timeout, garbage instead of HTTP.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from collectors.upstream import UpstreamTransport

pytestmark = pytest.mark.anyio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on loopback; yields (base URL, list of connection numbers seen)."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def client(**kwargs: float | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=UpstreamTransport(**kwargs))  # type: ignore[arg-type]


async def test_content_length_body_and_keep_alive_reuse() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            seen.append(head + body)
            payload = b'{"ok": true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Twice: 1\r\nX-Twice: 2\r\n"
                b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
            )
            await writer.drain()

    async with raw_server(handler) as (url, connections), client() as c:
        for i in range(3):
            r = await c.post(f"{url}/v1/x?q={i}", content=b"abc", headers={"x-a": "1"})
            assert r.status_code == 200 and r.json() == {"ok": True}
            assert r.headers.get_list("x-twice") == ["1", "2"]
            assert r.reason_phrase == "OK"
    assert len(connections) == 1, "one kept-alive connection served all three"
    assert seen[2].startswith(b"POST /v1/x?q=2 HTTP/1.1\r\n")
    assert b"\r\nx-a: 1\r\n" in seen[2].lower() and seen[2].endswith(b"\r\n\r\nabc")


async def test_chunked_body_arrives_chunk_by_chunk_and_trailers_are_dropped() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n")
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"7;ext=1\r\ndata: 2\r\n0\r\nX-Trailer: t\r\n\r\n")
        await writer.drain()

    async with raw_server(handler) as (url, _), client() as c, c.stream("GET", url) as r:
        parts = r.aiter_raw()
        assert await parts.__anext__() == b"data: 1"  # before the server sends the rest
        release.set()
        rest = [p async for p in parts]
    assert rest == [b"data: 2"]


async def test_close_delimited_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await writer.drain()

    async with raw_server(handler) as (url, _), client() as c:
        r = await c.get(url)
    assert r.content == b"all of it"


async def test_head_and_204_have_no_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if head.startswith(b"HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    async with raw_server(handler) as (url, connections), client() as c:
        assert (await c.head(url)).content == b""
        r = await c.delete(url)
        assert r.status_code == 204 and r.content == b""
        assert (await c.head(url)).headers["content-length"] == "1000"
    assert len(connections) == 1


async def test_a_kept_alive_connection_the_server_closed_is_replaced() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        # then close: like uvicorn's keep-alive timeout, without saying "Connection: close"

    async with raw_server(handler) as (url, connections), client() as c:
        assert (await c.get(url)).content == b"ok"
        await asyncio.sleep(0.05)
        assert (await c.get(url)).content == b"ok"
    assert len(connections) == 2


async def test_stale_connection_detected_only_on_write_is_retried_once() -> None:
    transport = UpstreamTransport()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_server(handler) as (url, connections), httpx.AsyncClient(transport=transport) as c:
        assert (await c.get(url)).content == b"ok"
        # Make the pooled connection look usable though the server has gone from it.
        for pool in transport._idle.values():
            for conn in pool:
                conn.reader.at_eof = lambda: False  # type: ignore[method-assign]
        await asyncio.sleep(0.05)
        assert (await c.get(url)).content == b"ok"
    assert len(connections) == 2


async def test_body_cut_short_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()

    async with raw_server(handler) as (url, _), client() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="short"):
            await c.get(url)


async def test_chunked_body_cut_short_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nonly")
        await writer.drain()

    async with raw_server(handler) as (url, _), client() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="mid-body"):
            await c.get(url)


async def test_read_timeout_and_connect_errors_are_httpx_errors() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with raw_server(stall) as (url, _), client(read_timeout_s=0.2) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.get(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    async with client() as c:
        with pytest.raises(httpx.ConnectError, match=str(dead)):
            await c.get(f"http://127.0.0.1:{dead}/")


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 2",
    ],
)
async def test_garbage_instead_of_http_is_a_protocol_error(answer: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with raw_server(handler) as (url, _), client() as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(url)


async def test_an_abandoned_stream_closes_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(b"56789")
            await writer.drain()

    async with raw_server(handler) as (url, connections), client() as c:
        async with c.stream("GET", url) as r:
            async for _ in r.aiter_raw():
                break  # the client walks away mid-body
        assert (await c.get(url)).content == b"0123456789"
    assert len(connections) == 2, "the half-read connection was not reused"


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="connect_timeout_s"):
        UpstreamTransport(connect_timeout_s=0)
    with pytest.raises(ValueError, match="read_timeout_s"):
        UpstreamTransport(read_timeout_s=-1)

"""The per-request tap: a reverse proxy in front of vLLM's OpenAI API that records each response.

Traffic passes untouched — method, path, query, headers, body, status, response headers and bytes
(SSE streams chunk by chunk, as they arrive). For completion endpoints the proxy keeps what it
needs of the response on the side and, after the client has its last byte, turns it into a
``RequestRecord`` (``collectors.request_metrics``) queued to a ``BatchWriter``: recording never
sits on the request path and a slow store only ever costs dropped records (counted), not latency.
An unreachable upstream gives the client a 502 with a JSON error saying so.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime

import anyio
import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from collectors.batch_writer import BatchWriter
from collectors.records import RequestRecord
from collectors.request_metrics import (
    ResponseContext,
    ResponseNotUsable,
    StreamTail,
    record_from_json_body,
)
from collectors.scrape import utc_now
from collectors.upstream import UpstreamTransport

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) belong to one connection and are never forwarded; Host and
# Content-Length are set again for the upstream connection by httpx.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-connection",
    }
)
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length"}
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
# Whole bodies up to this size are read before answering (one write to the client, cheapest for
# ordinary JSON); larger or unsized bodies and SSE streams are passed through chunk by chunk.
_BUFFER_LIMIT_BYTES = 1024 * 1024
_URL_CACHE_SIZE = 1024


# "lean": collectors.upstream (asyncio streams; a fraction of the CPU per request); "httpcore":
# httpx's own transport, kept for comparison (bench/bench_tap.py) and as a fallback.
TRANSPORTS = ("lean", "httpcore")


@dataclass
class TapStats:
    """Counters the tap keeps; ``/_spectuner/tap`` shows them."""

    requests: int = 0
    recorded: int = 0
    upstream_errors: Counter[str] = field(default_factory=Counter)
    not_recorded: Counter[str] = field(default_factory=Counter)


def is_recorded_path(method: str, path: str) -> bool:
    """Completion endpoints are the ones whose responses carry usage and spec-decode metrics."""
    return method == "POST" and path.rstrip("/").endswith("completions")


class TapProxy:
    """Forwards requests to ``upstream`` and queues a ``RequestRecord`` per completion response."""

    def __init__(
        self,
        upstream: str,
        writer: BatchWriter[RequestRecord] | None,
        *,
        clock: Callable[[], datetime] = utc_now,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        max_connections: int = 1000,
        transport: str = "lean",
    ) -> None:
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be positive but got {connect_timeout_s}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)} but got {transport!r}")
        self.upstream = upstream.rstrip("/")
        self.writer = writer
        self.clock = clock
        self.stats = TapStats()
        self.transport = transport
        # Generation can pause for long stretches (queueing, long prompts): no read timeout by
        # default, as for a client talking to vLLM directly.
        self._timeouts = {"connect": connect_timeout_s, "read": read_timeout_s, "write": 60.0, "pool": 60.0}
        # The proxy sends httpx Requests straight to an httpx transport: the AsyncClient layer on top
        # (base-URL merging, cookie jar, default headers, redirects, auth) is what a proxy must not
        # do, and it costs a few hundred microseconds a request.
        self._transport: httpx.AsyncBaseTransport = (
            UpstreamTransport(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
            if transport == "lean"
            else httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
            )
        )
        self._base = httpx.URL(self.upstream)
        self._urls: dict[bytes, httpx.URL] = {}

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _upstream_url(self, target: bytes) -> httpx.URL:
        """The upstream URL for a request target; parsing a URL costs more than the rest of the
        request line, and clients hit a handful of paths, so parsed ones are kept (bounded)."""
        url = self._urls.get(target)
        if url is None:
            url = self._base.copy_with(raw_path=self._base.raw_path.rstrip(b"/") + target)
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()
            self._urls[target] = url
        return url

    async def handle(self, request: Request) -> Response:
        started = time.perf_counter()
        self.stats.requests += 1
        path: str = request.scope["path"]
        # The target exactly as the client sent it (percent-encoding and all), not re-encoded.
        query = request.scope.get("query_string", b"")
        target = (request.scope.get("raw_path") or path.encode()) + (b"?" + query if query else b"")
        try:
            url = self._upstream_url(target)
        except (UnicodeDecodeError, httpx.InvalidURL) as exc:
            self.stats.upstream_errors["bad_request_target"] += 1
            return JSONResponse(
                {
                    "error": {
                        "message": f"spectuner tap: bad request target ({exc})",
                        "type": "bad_request",
                        "code": 400,
                    }
                },
                status_code=400,
            )
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _REQUEST_DROP]
        body = await request.body()
        upstream_request = httpx.Request(
            request.method, url, headers=headers, content=body, extensions={"timeout": self._timeouts}
        )
        try:
            upstream = await self._transport.handle_async_request(upstream_request)
        except httpx.TimeoutException as exc:
            return self._upstream_error(504, "upstream_timeout", exc)
        except httpx.HTTPError as exc:
            return self._upstream_error(502, "upstream_unavailable", exc)

        record = self.writer is not None and is_recorded_path(request.method, path)
        response_headers = [(k, v) for k, v in upstream.headers.raw if k.lower() not in _HOP_BY_HOP]
        content_type = upstream.headers.get("content-type", "")
        declared = upstream.headers.get("content-length")
        streaming = (
            "text/event-stream" in content_type
            or declared is None
            or not declared.isdigit()
            or int(declared) > _BUFFER_LIMIT_BYTES
        )
        encoded = upstream.headers.get("content-encoding", "identity") != "identity"
        if record and encoded:
            record = False
            self.stats.not_recorded["encoded_body"] += 1
        request_id = request.headers.get("x-request-id", "")

        if not streaming:
            try:
                # Raw bytes, as sent: a compressed body stays compressed, matching its headers.
                content = b"".join([chunk async for chunk in upstream.aiter_raw()])
            except httpx.HTTPError as exc:
                return self._upstream_error(502, "upstream_broken", exc)
            finally:
                await upstream.aclose()
            latency_s = time.perf_counter() - started
            response = Response(content=content, status_code=upstream.status_code)
            response.raw_headers = response_headers
            if record:
                response.background = BackgroundTask(
                    self._record_body, content, upstream.status_code, latency_s, False, request_id
                )
            return response

        tail = StreamTail() if record else None
        finished: list[float] = []

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if tail is not None:
                        tail.feed(chunk)
                    yield chunk
                finished.append(time.perf_counter() - started)
            except httpx.HTTPError as exc:
                # Headers are gone already: all we can do is end the stream early and say why.
                self.stats.upstream_errors["stream_broken"] += 1
                logger.warning("tap %s: upstream stream broke mid-response: %s", self.upstream, exc)
            finally:
                # The client may have gone (this task is then cancelled): close upstream anyway, so
                # vLLM stops generating for nobody and the connection goes back to the pool clean.
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()

        async def after() -> None:
            if tail is None:
                return
            if not finished:
                self.stats.not_recorded["incomplete_stream"] += 1
                return
            self._record(lambda ctx: tail.record(ctx), upstream.status_code, finished[0], True, request_id)

        response = StreamingResponse(relay(), status_code=upstream.status_code, background=BackgroundTask(after))
        response.raw_headers = response_headers
        return response

    # -- recording (runs after the response is sent) -------------------------------------------
    async def _record_body(
        self, content: bytes, status: int, latency_s: float, streamed: bool, request_id: str
    ) -> None:
        self._record(lambda ctx: record_from_json_body(content, ctx), status, latency_s, streamed, request_id)

    def _record(
        self,
        build: Callable[[ResponseContext], RequestRecord],
        status: int,
        latency_s: float,
        streamed: bool,
        request_id: str,
    ) -> None:
        assert self.writer is not None
        ctx = ResponseContext(
            ts=self.clock(),
            latency_s=latency_s,
            upstream_url=self.upstream,
            status_code=status,
            streamed=streamed,
            request_id_header=request_id,
        )
        try:
            rec = build(ctx)
        except ResponseNotUsable as exc:
            if status >= 400:
                rec = RequestRecord(
                    ts=ctx.ts,
                    request_id=request_id,
                    model_name="",
                    prompt_tokens=0,
                    output_tokens=0,
                    latency_s=latency_s,
                    upstream_url=self.upstream,
                    streamed=streamed,
                    status_code=status,
                )
            else:
                self.stats.not_recorded[exc.reason] += 1
                logger.debug("tap %s: response not recorded: %s", self.upstream, exc)
                return
        if self.writer.submit(rec):
            self.stats.recorded += 1
        else:
            self.stats.not_recorded["queue_full"] += 1

    def _upstream_error(self, status: int, kind: str, exc: Exception) -> JSONResponse:
        self.stats.upstream_errors[kind] += 1
        message = (
            f"spectuner tap: upstream {self.upstream} "
            + ("did not answer in time" if status == 504 else "is unreachable")
            + f" ({type(exc).__name__}: {exc}). Is vLLM running there? Check `spectuner tap --upstream`."
        )
        logger.warning("tap %s: %s", self.upstream, message)
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    def stats_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "upstream": self.upstream,
            "requests": self.stats.requests,
            "recorded": self.stats.recorded,
            "upstream_errors": dict(self.stats.upstream_errors),
            "not_recorded": dict(self.stats.not_recorded),
        }
        if self.writer is not None:
            data["writer"] = self.writer.stats.__dict__
        return data


def create_tap_app(proxy: TapProxy) -> Starlette:
    """The ASGI app: ``/_spectuner/tap`` answers the tap's own counters; everything else is forwarded."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if proxy.writer is not None:
            proxy.writer.start()
        try:
            yield
        finally:
            await proxy.aclose()
            if proxy.writer is not None:
                proxy.writer.close()

    async def tap_stats(request: Request) -> Response:
        return JSONResponse(proxy.stats_dict())

    return Starlette(
        routes=[
            Route("/_spectuner/tap", tap_stats, methods=["GET"]),
            Route("/{path:path}", proxy.handle, methods=_METHODS),
        ],
        lifespan=lifespan,
    )


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_listen(listen: str) -> tuple[str, int]:
    """``127.0.0.1:PORT`` → (host, port). Only loopback addresses: servers here never listen on a
    public interface. Raises ``ValueError`` naming what is wrong."""
    host, sep, port_text = listen.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"--listen {listen!r}: write HOST:PORT, e.g. 127.0.0.1:8001")
    if host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"--listen {listen!r}: the tap binds loopback only (127.0.0.1, localhost or ::1); "
            "put a reverse proxy in front of it to expose it"
        )
    return host, int(port_text)

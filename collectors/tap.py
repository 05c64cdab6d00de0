"""The per-request tap: a reverse proxy in front of vLLM's OpenAI API that records each response.

Traffic passes untouched — method, path, query, headers, body, status, response headers and bytes
(SSE streams chunk by chunk, as they arrive). For completion endpoints the proxy keeps what it
needs of the response on the side and, after the client has its last byte, turns it into a
``RequestRecord`` (``collectors.request_metrics``) queued to a ``BatchWriter``: recording never
sits on the request path and a slow store only ever costs dropped records (counted), not latency.
An unreachable upstream gives the client a 502 with a JSON error saying so, one that sends nothing
within the read timeout a 504, and a request body over ``max_body_bytes`` a 413.

The tap is also the engine's front door (``collectors.front_door``): each request goes to the
upstream the door picks, and while an engine changes new requests are held and released to the new
one (``POST /_spectuner/control`` with the control token drives it).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from collectors.batch_writer import BatchWriter
from collectors.front_door import CONTROL_PATH, ControlError, FrontDoor, Refusal
from collectors.records import RequestRecord
from collectors.request_metrics import (
    ResponseContext,
    ResponseNotUsable,
    StreamTail,
    record_from_json_body,
)
from collectors.scrape import utc_now
from collectors.traffic_record import StreamCopy, TrafficRecorder
from collectors.upstream import UpstreamResponse, UpstreamTransport

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
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # far above any prompt a 512k-token context holds as JSON
DEFAULT_READ_TIMEOUT_S = 600.0  # first byte / between chunks: above a long generation's silence
STATS_PATH = "/_spectuner/tap"
SWITCH_INTERVAL_S = 0.0005
ERROR_LOG_INTERVAL_S = 10.0

# ASGI, spelled out (the tap is a plain ASGI app; see ``create_tap_app``).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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


class _Target:
    """One upstream, parsed once: base URL, connection origin, Host header and request-target URLs."""

    __slots__ = ("base", "host", "origin", "url", "urls")

    def __init__(self, url: str) -> None:
        self.url = url
        self.base = httpx.URL(url)
        scheme = self.base.scheme
        self.origin = (scheme, self.base.host, self.base.port or (443 if scheme == "https" else 80))
        self.host = self.base.netloc
        self.urls: dict[bytes, httpx.URL] = {}

    def upstream_url(self, target: bytes) -> httpx.URL:
        """The upstream URL for a request target; parsing a URL costs more than the rest of the
        request line, and clients hit a handful of paths, so parsed ones are kept (bounded)."""
        url = self.urls.get(target)
        if url is None:
            url = self.base.copy_with(raw_path=self.base.raw_path.rstrip(b"/") + target)
            if len(self.urls) >= _URL_CACHE_SIZE:
                self.urls.clear()
            self.urls[target] = url
        return url


class TapProxy:
    """Forwards requests to the upstream(s) the front door picks and queues a ``RequestRecord`` per
    completion response."""

    def __init__(
        self,
        upstream: str | list[str],
        writer: BatchWriter[RequestRecord] | None,
        *,
        clock: Callable[[], datetime] = utc_now,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        max_connections: int = 1000,
        transport: str = "lean",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        door: FrontDoor | None = None,
        control_token: str | None = None,
        traffic: TrafficRecorder | None = None,
    ) -> None:
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be positive but got {connect_timeout_s}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)} but got {transport!r}")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1 but got {max_body_bytes}")
        upstreams = [upstream] if isinstance(upstream, str) else list(upstream)
        self.door = door or FrontDoor(upstreams)
        self.upstream = self.door.upstreams[0]
        self.writer = writer
        # The opt-in sampled record of prompts and outputs for shadow evaluation (user data; None: off).
        self.traffic = traffic
        self.clock = clock
        self.stats = TapStats()
        self.transport = transport
        self.max_body_bytes = max_body_bytes
        # None: the control endpoint is off (a plain recording proxy).
        self.control_token = control_token
        # Generation can pause for long stretches (queueing, long prompts): the read timeout is per
        # read (first byte, then between chunks), not for the whole answer.
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
        self._lean = self._transport if isinstance(self._transport, UpstreamTransport) else None
        self._targets: dict[str, _Target] = {}
        self._error_log: dict[str, tuple[float, int]] = {}  # kind -> (last logged, not logged since)

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _target(self, upstream: str) -> _Target:
        target = self._targets.get(upstream)
        if target is None:
            target = self._targets[upstream] = _Target(upstream)
        return target

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Forward one HTTP exchange (an ASGI ``http`` scope).

        Plain ASGI, no framework: routing, request and response objects and middleware cost a
        few hundred microseconds a request, which is most of the tap's latency budget."""
        started = time.perf_counter()
        self.stats.requests += 1
        method: str = scope["method"]
        path: str = scope["path"]
        # The target exactly as the client sent it (percent-encoding and all), not re-encoded.
        query = scope.get("query_string", b"")
        target = (scope.get("raw_path") or path.encode()) + (b"?" + query if query else b"")
        declared_length = _header(scope["headers"], b"content-length")
        if declared_length.isdigit() and int(declared_length) > self.max_body_bytes:
            await self._too_large(send)
            return
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            return  # the client left before sending its whole request: nothing to forward
        if body is _TOO_LARGE:
            await self._too_large(send)
            return
        admitted = await self.door.admit(lambda: asyncio.ensure_future(_disconnected(receive)))
        if admitted is None:
            return  # the client left while held: it reached no engine
        if isinstance(admitted, Refusal):
            await self._refuse(send, admitted)
            return
        failed = True
        try:
            failed = await self._forward(admitted, scope, receive, send, started, method, path, target, body)
        finally:
            self.door.done(admitted, failed)

    async def _forward(
        self,
        upstream_url: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        started: float,
        method: str,
        path: str,
        target: bytes,
        body: bytes,
    ) -> bool:
        """One exchange with ``upstream_url``; True when the client got an error of the tap's making
        or a cut stream (what the front door counts as a failed request)."""
        upstream_target = self._target(upstream_url)
        try:
            url = upstream_target.upstream_url(target)
        except (UnicodeDecodeError, httpx.InvalidURL) as exc:
            self.stats.upstream_errors["bad_request_target"] += 1
            error = {"message": f"spectuner tap: bad request target ({exc})", "type": "bad_request", "code": 400}
            await send_json(send, 400, {"error": error})
            return False
        drop = _REQUEST_DROP
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
        try:
            if self._lean is not None:
                upstream: UpstreamResponse | _HttpxAnswer = await self._lean.send(
                    upstream_target.origin, method, url.raw_path, headers, body, host=upstream_target.host
                )
            else:
                upstream_request = httpx.Request(
                    method, url, headers=headers, content=body, extensions={"timeout": self._timeouts}
                )
                upstream = _HttpxAnswer(await self._transport.handle_async_request(upstream_request))
        except httpx.TimeoutException as exc:
            await self._upstream_error(send, 504, "upstream_timeout", exc, upstream_url)
            return True
        except httpx.HTTPError as exc:
            await self._upstream_error(send, 502, "upstream_unavailable", exc, upstream_url)
            return True

        record = self.writer is not None and is_recorded_path(method, path)
        raw_headers = upstream.headers
        response_headers = [(k, v) for k, v in raw_headers if k.lower() not in _HOP_BY_HOP]
        content_type = declared = encoding = None
        for k, v in raw_headers:
            name = k.lower()
            if name == b"content-type":
                content_type = v
            elif name == b"content-length":
                declared = v
            elif name == b"content-encoding":
                encoding = v
        streaming = (
            (content_type is not None and b"text/event-stream" in content_type)
            or declared is None
            or not declared.isdigit()
            or int(declared) > _BUFFER_LIMIT_BYTES
        )
        if record and encoding is not None and encoding.strip().lower() != b"identity":
            record = False
            self.stats.not_recorded["encoded_body"] += 1
        status = upstream.status_code

        if not streaming:
            try:
                # Raw bytes, as sent: a compressed body stays compressed, matching its headers.
                content = b"".join([chunk async for chunk in upstream.aiter_raw()])
            except httpx.TimeoutException as exc:
                await self._upstream_error(send, 504, "upstream_timeout", exc, upstream_url)
                return True
            except httpx.HTTPError as exc:
                await self._upstream_error(send, 502, "upstream_broken", exc, upstream_url)
                return True
            finally:
                await upstream.aclose()
            await send({"type": "http.response.start", "status": status, "headers": response_headers})
            await send({"type": "http.response.body", "body": content, "more_body": False})
            if record:
                # After the client has its last byte: parsing never delays the response.
                latency_s = time.perf_counter() - started
                request_id = _header(scope["headers"], b"x-request-id")
                self._record(
                    lambda ctx: record_from_json_body(content, ctx), status, latency_s, False, request_id,
                    upstream_url,
                )
            if (
                self.traffic is not None
                and status == 200
                and encoding in (None, b"identity")
                and is_recorded_path(method, path)
            ):
                self.traffic.observe(body, content)  # a draw and a queue put; the recorder's thread does the rest
            return False

        # A sampled stream is drawn before it starts and copied as it passes, so the traffic record
        # sees streamed traffic too (most production traffic), at the cost of one bounded copy.
        copy = (
            StreamCopy()
            if self.traffic is not None
            and status == 200
            and encoding in (None, b"identity")
            and is_recorded_path(method, path)
            and self.traffic.draw()
            else None
        )
        tail = StreamTail() if record else None
        finished, broken = await self._relay(upstream, response_headers, receive, send, tail, upstream_url, copy)
        if copy is not None and self.traffic is not None:
            if finished is None:
                self.traffic.skip("incomplete_stream")
            elif copy.overflowed:
                self.traffic.skip("stream_too_large")
            else:
                sse = content_type is not None and b"text/event-stream" in content_type
                self.traffic.enqueue(body, copy.body(), sse=sse)  # a large unsized JSON body is not SSE
        if tail is None:
            return broken
        if finished is None:
            self.stats.not_recorded["incomplete_stream"] += 1
            return broken
        request_id = _header(scope["headers"], b"x-request-id")
        self._record(tail.record, status, finished - started, True, request_id, upstream_url)
        return False

    async def _relay(
        self,
        upstream: UpstreamResponse | _HttpxAnswer,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        send: Send,
        tail: StreamTail | None,
        upstream_url: str,
        copy: StreamCopy | None = None,
    ) -> tuple[float | None, bool]:
        """Pass a streamed body on chunk by chunk: (the time it ended or None if it did not, whether
        the upstream broke it off).

        If the client goes away, the relay is cancelled and the upstream connection closed, so
        vLLM stops generating for nobody (a plain ASGI send to a gone client is silently dropped,
        so the disconnect is watched for)."""
        task = asyncio.current_task()
        assert task is not None
        state = {"streaming": True, "client_gone": False}

        async def watch_client() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if state["streaming"]:
                        state["client_gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.ensure_future(watch_client())
        try:
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
            async for chunk in upstream.aiter_raw():
                if tail is not None:
                    tail.feed(chunk)
                if copy is not None:
                    copy.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state["streaming"] = False
            ended = time.perf_counter()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return ended, False
        except httpx.HTTPError as exc:
            # Headers are gone already: all we can do is end the stream early and say why.
            state["streaming"] = False
            self.stats.upstream_errors["stream_broken"] += 1
            logger.warning("tap %s: upstream stream broke mid-response: %s", upstream_url, exc)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None, True
        except asyncio.CancelledError:
            if not state["client_gone"]:
                raise  # the server is shutting down: let it
            task.uncancel()
            return None, False
        finally:
            state["streaming"] = False
            watcher.cancel()
            # Close upstream in every case, so the connection never goes back to the pool dirty.
            await upstream.aclose()

    # -- recording (runs after the client has its last byte) -----------------------------------
    def _record(
        self,
        build: Callable[[ResponseContext], RequestRecord],
        status: int,
        latency_s: float,
        streamed: bool,
        request_id: str,
        upstream_url: str,
    ) -> None:
        assert self.writer is not None
        ctx = ResponseContext(
            ts=self.clock(),
            latency_s=latency_s,
            upstream_url=upstream_url,
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
                    upstream_url=upstream_url,
                    streamed=streamed,
                    status_code=status,
                )
            else:
                self.stats.not_recorded[exc.reason] += 1
                logger.debug("tap %s: response not recorded: %s", upstream_url, exc)
                return
        if self.writer.submit(rec):
            self.stats.recorded += 1
        else:
            self.stats.not_recorded["queue_full"] += 1

    async def _upstream_error(self, send: Send, status: int, kind: str, exc: Exception, upstream_url: str) -> None:
        self.stats.upstream_errors[kind] += 1
        message = (
            f"spectuner tap: upstream {upstream_url} "
            + ("did not answer in time" if status == 504 else "is unreachable")
            + f" ({type(exc).__name__}: {exc}). Is vLLM running there? Check `spectuner tap --upstream`."
        )
        self._log_error(kind, f"tap {upstream_url}: {message}")
        await send_json(send, status, {"error": {"message": message, "type": kind, "code": status}})

    def _log_error(self, kind: str, text: str) -> None:
        """One line per kind of upstream error at most every ``ERROR_LOG_INTERVAL_S``, with how many
        were not logged: an engine starting or gone is hundreds of identical errors a minute."""
        now = time.monotonic()
        last, quiet = self._error_log.get(kind, (-ERROR_LOG_INTERVAL_S, 0))
        if now - last < ERROR_LOG_INTERVAL_S:
            self._error_log[kind] = (last, quiet + 1)
            return
        self._error_log[kind] = (now, 0)
        logger.warning("%s%s", text, f" (and {quiet} more like it since the last line)" if quiet else "")

    async def _too_large(self, send: Send) -> None:
        self.stats.upstream_errors["body_too_large"] += 1
        message = (
            f"spectuner tap: request body over {self.max_body_bytes} bytes; not forwarded "
            "(raise `spectuner tap --max-body-bytes` if such requests are expected)"
        )
        error = {"message": message, "type": "request_too_large", "code": 413}
        await send_json(send, 413, {"error": error}, [(b"connection", b"close")])

    async def _refuse(self, send: Send, refusal: Refusal) -> None:
        """503 with Retry-After: the engine is changing and this request could not wait longer."""
        self.stats.upstream_errors[refusal.reason] += 1
        message = (
            "spectuner tap: the engine is being changed and this request "
            + ("waited the longest it may" if refusal.reason == "held_too_long" else "found the hold queue full")
            + f"; it reached no engine — retry in {refusal.retry_after_s} s"
        )
        error = {"message": message, "type": refusal.reason, "code": 503}
        await send_json(send, 503, {"error": error}, [(b"retry-after", str(refusal.retry_after_s).encode())])

    async def control(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /_spectuner/control`` (bearer token): drive the front door; ``GET``: its state."""
        if self.control_token is None:
            await send_json(send, 404, {"error": {"message": "the control endpoint is off", "code": 404}})
            return
        given = _header(scope["headers"], b"authorization").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.control_token.encode()):
            await send_json(send, 401, {"error": {"message": "bad or missing control token", "code": 401}})
            return
        body = await _read_body(receive, 64 * 1024)
        if body is None:
            return
        if body is _TOO_LARGE:
            await send_json(send, 413, {"error": {"message": "control request over 64 KiB", "code": 413}})
            return
        try:
            request = json.loads(body) if body else {"op": "state"}
            if not isinstance(request, dict):
                raise ControlError("the body must be a JSON object with an 'op'")
            answer = await self.door.control(request)
        except (ValueError, ControlError) as exc:
            await send_json(send, 400, {"error": {"message": f"spectuner tap control: {exc}", "code": 400}})
            return
        await send_json(send, 200, answer)

    def stats_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "upstream": self.upstream,
            "upstreams": list(self.door.upstreams),
            "requests": self.stats.requests,
            "recorded": self.stats.recorded,
            "upstream_errors": dict(self.stats.upstream_errors),
            "not_recorded": dict(self.stats.not_recorded),
        }
        if self.writer is not None:
            data["writer"] = self.writer.stats.__dict__
        if self.traffic is not None:
            data["traffic_record"] = self.traffic.stats_dict()
        return data


class _HttpxAnswer:
    """An ``httpx.Response`` seen through the few attributes the proxy uses (as ``UpstreamResponse``)."""

    __slots__ = ("aclose", "aiter_raw", "headers", "status_code")

    def __init__(self, response: httpx.Response) -> None:
        self.status_code = response.status_code
        self.headers = response.headers.raw
        self.aiter_raw = response.aiter_raw
        self.aclose = response.aclose


def create_tap_app(proxy: TapProxy, *, on_startup: Callable[[], None] | None = None) -> ASGIApp:
    """The ASGI app: ``GET /_spectuner/tap`` answers the tap's own counters; everything else is
    forwarded. Its lifespan starts the record writer (then calls ``on_startup``, e.g.
    :func:`tune_process_for_latency`) and, on shutdown, flushes it."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            method = scope["method"]
            if scope["path"] == STATS_PATH and method in ("GET", "HEAD"):
                await send_json(send, 200, proxy.stats_dict())
            elif scope["path"] == CONTROL_PATH:
                await proxy.control(scope, receive, send)
            elif method in _METHODS:
                await proxy.handle(scope, receive, send)
            else:
                error = {"message": f"spectuner tap: method {method} is not forwarded", "type": "bad_request"}
                await send_json(send, 405, {"error": {**error, "code": 405}})
        elif kind == "lifespan":
            await _lifespan(proxy, receive, send, on_startup)
        # websocket: not proxied; returning without accepting makes the server refuse it

    return app


def tune_process_for_latency() -> None:
    """Process-wide settings for a process whose job is the tap (``spectuner tap`` calls this once
    started; an app embedded in another process leaves them alone):

    - everything alive at start-up (modules, app, settings) lives as long as the process: it is
      frozen out of the garbage collector's reach, so a full collection scans only request garbage
      and never stalls a request for milliseconds (the p99);
    - the record writer is a thread: while it runs Python (encoding a batch, SQLAlchemy), the event
      loop waits for the GIL up to the switch interval, 5 ms by default — a request arriving then
      pays it. 0.5 ms bounds that stall at a small cost to the writer's throughput.
    """
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))


async def _lifespan(
    proxy: TapProxy, receive: Receive, send: Send, on_startup: Callable[[], None] | None
) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if proxy.writer is not None:
                proxy.writer.start()
            if proxy.traffic is not None:
                proxy.traffic.start()
            if on_startup is not None:
                on_startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await proxy.aclose()
            if proxy.writer is not None:
                proxy.writer.close()
            if proxy.traffic is not None:
                proxy.traffic.close()
            await send({"type": "lifespan.shutdown.complete"})
            return


_TOO_LARGE = b"\0too large"  # a sentinel, compared by identity


async def _read_body(receive: Receive, limit_bytes: int) -> bytes | None:
    """The whole request body, ``_TOO_LARGE`` once it passes ``limit_bytes`` (the rest is not read:
    a client can't make the tap hold more than the limit), or None if the client disconnected first."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if len(body) > limit_bytes:
        return _TOO_LARGE
    if not message.get("more_body", False):
        return body  # the usual case: one message
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > limit_bytes:
            return _TOO_LARGE
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (after its whole body was read, receive() says nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return ""


async def send_json(
    send: Send, status: int, payload: object, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += extra_headers or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


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


def bind_listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one), bound before the server starts so a
    port in use is a clear ``OSError`` here, not a server that exits on its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock

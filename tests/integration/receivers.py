"""Real local HTTP receivers for the exporter and alert tests (127.0.0.1, a free port, own thread).

``Receiver`` records every request (path, headers, body, arrival time) and answers from a script of
behaviours: ``ok``, ``slow`` (sleep then 200), ``fail`` (500), ``reject`` (400). The last behaviour
repeats. ``OtlpReceiver`` decodes OTLP/HTTP protobuf bodies into ``opentelemetry-proto`` messages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic()


class Receiver:
    def __init__(self, behaviours: Sequence[str] = ("ok",), slow_s: float = 2.0) -> None:
        self.behaviours = list(behaviours)
        self.slow_s = slow_s
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        self._stop_sleep = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                with receiver._lock:
                    n = len(receiver.requests)
                    receiver.requests.append(
                        Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic())
                    )
                    behaviour = receiver.behaviours[min(n, len(receiver.behaviours) - 1)]
                receiver.answer(self, behaviour, body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, handler: BaseHTTPRequestHandler, behaviour: str, body: bytes) -> None:
        if behaviour == "slow":
            self._stop_sleep.wait(self.slow_s)
            behaviour = "ok"
        code = {"ok": 200, "fail": 500, "reject": 400}[behaviour]
        payload = b"{}" if code == 200 else f"error {code}".encode()
        try:
            handler.send_response(code)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout): expected for "slow"

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_sleep.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.requests) >= count:
                    return list(self.requests)
            time.sleep(0.02)
        raise AssertionError(f"expected {count} request(s) within {timeout_s} s, got {len(self.requests)}")


class OtlpReceiver(Receiver):
    """Answers OTLP/HTTP like a collector and keeps the decoded requests."""

    def __init__(self) -> None:
        super().__init__(("ok",))
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []

    def answer(self, handler: BaseHTTPRequestHandler, behaviour: str, body: bytes) -> None:
        response: bytes
        if handler.path == "/v1/metrics":
            msg = ExportMetricsServiceRequest()
            msg.ParseFromString(body)
            with self._lock:
                self.metrics.append(msg)
            response = ExportMetricsServiceResponse().SerializeToString()
        elif handler.path == "/v1/traces":
            tmsg = ExportTraceServiceRequest()
            tmsg.ParseFromString(body)
            with self._lock:
                self.traces.append(tmsg)
            response = ExportTraceServiceResponse().SerializeToString()
        else:
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/x-protobuf")
        handler.send_header("Content-Length", str(len(response)))
        handler.end_headers()
        handler.wfile.write(response)

    def metric_points(self) -> Iterator[tuple[dict[str, str], str, dict[str, str], float]]:
        """(resource attributes, metric name, point attributes, value) of every data point received."""
        with self._lock:
            requests = list(self.metrics)
        for req in requests:
            for rm in req.resource_metrics:
                res = {a.key: a.value.string_value for a in rm.resource.attributes}
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        points = m.gauge.data_points if m.HasField("gauge") else m.sum.data_points
                        for p in points:
                            attrs = {a.key: a.value.string_value for a in p.attributes}
                            value = p.as_double if p.HasField("as_double") else float(p.as_int)
                            yield res, m.name, attrs, value

    def spans(self) -> list[tuple[dict[str, str], Any]]:
        """(resource attributes, span) of every span received."""
        out: list[tuple[dict[str, str], Any]] = []
        with self._lock:
            requests = list(self.traces)
        for req in requests:
            for rs in req.resource_spans:
                res = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((res, span) for span in ss.spans)
        return out

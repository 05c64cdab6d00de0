"""The webhook actuator against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from tuner.actuators import ApplyStatus, WebhookActuator

CFG = {"method": "ngram", "num_speculative_tokens": 4}


class Orchestrator(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, dict]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Orchestrator.received.append((self.path, body))
        if self.path == "/slow":
            time.sleep(3)
        status, answer = {
            "/ok": (200, {"ok": True}),
            "/slow": (200, {"ok": True}),
            "/fail": (503, {"error": "overloaded"}),
            "/refuse": (200, {"ok": False, "message": "canary failed"}),
        }[self.path]
        data = json.dumps(answer).encode()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # /slow: the client gave up
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def server() -> Iterator[str]:
    Orchestrator.received = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Orchestrator)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_success_posts_the_config_and_is_idempotent(server: str) -> None:
    act = WebhookActuator(f"{server}/ok", timeout_s=5, headers={"X-Token": "t"})
    result = act.apply(CFG)
    assert result.status is ApplyStatus.APPLIED and act.current == CFG
    assert Orchestrator.received == [("/ok", {"speculative_config": CFG})]
    assert act.apply(CFG).status is ApplyStatus.UNCHANGED
    assert len(Orchestrator.received) == 1


def test_5xx_is_a_failure(server: str) -> None:
    result = WebhookActuator(f"{server}/fail", timeout_s=5).apply(CFG)
    assert result.status is ApplyStatus.FAILED and "HTTP 503" in result.message and "overloaded" in result.detail


def test_refusal_in_a_2xx_answer_is_a_failure(server: str) -> None:
    result = WebhookActuator(f"{server}/refuse", timeout_s=5).apply(CFG)
    assert result.status is ApplyStatus.FAILED and "canary failed" in result.message


def test_timeout(server: str) -> None:
    t0 = time.monotonic()
    result = WebhookActuator(f"{server}/slow", timeout_s=0.5).apply(CFG)
    assert time.monotonic() - t0 < 2.5
    assert result.status is ApplyStatus.FAILED and "did not answer within 0.5 s" in result.message


def test_unreachable() -> None:
    from tuner.engine.process import free_port

    result = WebhookActuator(f"http://127.0.0.1:{free_port()}/x", timeout_s=2).apply(CFG)
    assert result.status is ApplyStatus.FAILED and "cannot reach" in result.message

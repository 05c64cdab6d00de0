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
        if self.path.startswith("/hooks/"):  # an orchestrator whose error page echoes the URL it was called on
            ok = "/ok" in self.path
            answer_echo = {"ok": ok, "message": f"bad request to {self.path}"}
            self._send(200 if ok else 503, answer_echo)
            return
        status, answer = {
            "/ok": (200, {"ok": True}),
            "/slow": (200, {"ok": True}),
            "/fail": (503, {"error": "overloaded"}),
            "/refuse": (200, {"ok": False, "message": "canary failed"}),
        }[self.path]
        self._send(status, answer)

    def _send(self, status: int, answer: dict) -> None:
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


@pytest.mark.parametrize("outcome", ["ok", "fail", "unreachable"])
def test_the_url_secret_never_reaches_messages_details_or_logs(
    server: str, outcome: str, caplog: pytest.LogCaptureFixture
) -> None:
    from tuner.engine.process import free_port

    secrets = ("T0SECRETPATHTOKEN", "QUERYSECRETVALUE", "hunter2pass")
    base = server if outcome != "unreachable" else f"http://127.0.0.1:{free_port()}"
    base = base.replace("http://", "http://ops:hunter2pass@")
    url = f"{base}/hooks/T0SECRETPATHTOKEN/{outcome}?api_key=QUERYSECRETVALUE"
    caplog.set_level("DEBUG", logger="tuner")  # httpx's own request log is WARNING-only in the CLI
    act = WebhookActuator(url, timeout_s=5)
    result = act.apply(CFG)
    assert result.status is (ApplyStatus.APPLIED if outcome == "ok" else ApplyStatus.FAILED)
    shown = " ".join([result.message, result.detail or "", json.dumps(result.event_data()), caplog.text])
    assert "/hooks/" in url and "webhook http://ops:***@127.0.0.1" in result.message
    for secret in secrets:
        assert secret not in shown, (secret, shown)

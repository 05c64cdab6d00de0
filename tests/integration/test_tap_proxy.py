"""The tap proxy between a real client and a real upstream, both HTTP on 127.0.0.1.

The upstream is a small Starlette app that answers like vLLM's OpenAI server: completions with
``usage`` and ``metrics.speculative_decoding``, SSE streams whose last chunk carries them (only
when the client asks for usage), errors, and an echo endpoint that shows what it received.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from collectors.batch_writer import BatchWriter
from collectors.records import RequestRecord
from collectors.tap import TRANSPORTS, TapProxy, create_tap_app, parse_listen
from tuner.engine.process import free_port
from tuner.store import Store

REPO = Path(__file__).resolve().parents[2]
K = 3
CHUNK_DELAY_S = 0.3


def spec_for(n_tokens: int) -> dict[str, Any]:
    """Deterministic per-request spec metrics: step j accepts j % (K+1) tokens."""
    hist = [0] * (K + 1)
    emitted = steps = 0
    per_step: list[int] = []
    while emitted < n_tokens:
        j = steps % (K + 1)
        hist[j] += 1
        per_step.append(j)
        emitted += j + 1
        steps += 1
    accepted = sum(j * n for j, n in enumerate(hist))
    return {
        "mean_acceptance_length": 1 + accepted / steps,
        "draft_acceptance_rate": accepted / (steps * K),
        "acceptance_histogram": hist,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": steps * K,
        "num_spec_tokens": K,
        "per_step_accepted": per_step,
        "per_step_drafted": [K] * steps,
    }


async def completions(request: Request) -> Response:
    body = await request.json()
    if body.get("model") != "target":
        return JSONResponse(
            {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}},
            status_code=404,
        )
    n = int(body.get("max_tokens", 16))
    prompt_tokens = len(str(body.get("prompt", "")).split())
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    rid = f"cmpl-{abs(hash(json.dumps(body, sort_keys=True))) % 10**8}"
    if not body.get("stream"):
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "model": "target",
                "choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}],
                "usage": usage,
                "metrics": {"speculative_decoding": spec_for(n)},
            },
            headers={"x-request-id": rid},
        )

    async def events() -> Any:
        for i in range(int(body.get("chunks", 3))):
            chunk = {
                "id": rid,
                "object": "text_completion",
                "model": "target",
                "choices": [{"index": 0, "text": f" tok{i}"}],
            }
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(CHUNK_DELAY_S)
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {
                "id": rid,
                "object": "text_completion",
                "model": "target",
                "choices": [],
                "usage": usage,
                "metrics": {"speculative_decoding": spec_for(n)},
            }
            yield f"data: {json.dumps(final)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def echo(request: Request) -> Response:
    body = await request.body()
    response = JSONResponse(
        {
            "method": request.method,
            "path": request.url.path,
            "raw_path": request.scope["raw_path"].decode("latin-1"),
            "query": request.url.query,
            "headers": [[k.decode(), v.decode()] for k, v in request.headers.raw],
            "body": body.decode("latin-1"),
        },
        status_code=201,
    )
    response.raw_headers.append((b"set-cookie", b"a=1"))
    response.raw_headers.append((b"set-cookie", b"b=2"))
    response.raw_headers.append((b"x-upstream", b"yes"))
    return response


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "target", "object": "model"}]})


UPSTREAM = Starlette(
    routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/echo/{rest:path}", echo, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
)


class ThreadedServer:
    """uvicorn serving an ASGI app on a loopback socket, in a thread."""

    def __init__(self, asgi: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(asgi, log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class ListSink:
    def __init__(self) -> None:
        self.requests: list[RequestRecord] = []
        self.batches = 0
        self.gate = threading.Event()
        self.gate.set()

    def write(self, records: Sequence[RequestRecord]) -> None:
        self.gate.wait(30)
        self.requests.extend(records)
        self.batches += 1


@pytest.fixture(scope="module")
def upstream() -> Iterator[ThreadedServer]:
    with ThreadedServer(UPSTREAM) as server:
        yield server


@pytest.fixture(params=TRANSPORTS)
def tap(
    upstream: ThreadedServer, request: pytest.FixtureRequest
) -> Iterator[tuple[ThreadedServer, TapProxy, ListSink]]:
    """The tap in front of the fake vLLM, once per upstream HTTP client (lean and httpcore)."""
    sink = ListSink()
    writer: BatchWriter[RequestRecord] = BatchWriter(sink.write, name="test", flush_interval_s=0.05)
    proxy = TapProxy(upstream.url, writer, transport=request.param)
    with ThreadedServer(create_tap_app(proxy)) as server:
        yield server, proxy, sink


def settled(proxy: TapProxy, handled: int, timeout_s: float = 10.0) -> None:
    """Wait until ``handled`` responses were recorded or refused and the writer wrote them.

    Recording runs after the client has its last byte, so the test may get there first."""
    deadline = time.monotonic() + timeout_s
    while proxy.stats.recorded + sum(proxy.stats.not_recorded.values()) < handled:
        assert time.monotonic() < deadline, f"only {proxy.stats} after {timeout_s} s"
        time.sleep(0.01)
    assert proxy.writer is None or proxy.writer.flush(timeout_s)


def comparable_headers(response: httpx.Response) -> list[tuple[str, str]]:
    skip = {"date", "server"}
    return [(k.lower(), v) for k, v in response.headers.multi_items() if k.lower() not in skip]


def test_completion_passes_untouched_and_is_recorded(
    upstream: ThreadedServer, tap: tuple[ThreadedServer, TapProxy, ListSink]
) -> None:
    server, proxy, sink = tap
    body = {"model": "target", "prompt": "one two three", "max_tokens": 17}
    direct = httpx.post(f"{upstream.url}/v1/completions", json=body)
    via = httpx.post(f"{server.url}/v1/completions", json=body)
    assert (via.status_code, via.content) == (direct.status_code, direct.content)
    assert comparable_headers(via) == comparable_headers(direct)
    settled(proxy, 1)
    (rec,) = sink.requests
    spec = spec_for(17)
    assert (rec.request_id, rec.model_name, rec.prompt_tokens, rec.output_tokens) == (
        via.json()["id"],
        "target",
        3,
        17,
    )
    assert rec.num_spec_steps == spec["num_spec_steps"]
    assert rec.num_accepted_draft_tokens == spec["num_accepted_draft_tokens"]
    assert rec.num_draft_tokens == spec["num_draft_tokens"]
    assert rec.acceptance_histogram == tuple(spec["acceptance_histogram"])
    assert rec.per_step_accepted == tuple(spec["per_step_accepted"])
    assert rec.upstream_url == upstream.url and rec.status_code == 200 and not rec.streamed
    assert 0 < rec.latency_s < 5


def test_stream_arrives_chunk_by_chunk_and_the_final_chunk_is_recorded(
    upstream: ThreadedServer, tap: tuple[ThreadedServer, TapProxy, ListSink]
) -> None:
    server, proxy, sink = tap
    body = {
        "model": "target",
        "prompt": "a b",
        "max_tokens": 9,
        "stream": True,
        "chunks": 4,
        "stream_options": {"include_usage": True},
    }
    direct = httpx.post(f"{upstream.url}/v1/completions", json=body).content
    arrivals: list[tuple[float, bytes]] = []
    started = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for part in response.iter_raw():
            arrivals.append((time.perf_counter() - started, part))
    assert b"".join(p for _, p in arrivals) == direct
    # The first event reaches the client long before the upstream has finished (4 × 0.3 s).
    assert arrivals[0][0] < CHUNK_DELAY_S
    assert arrivals[-1][0] > 4 * CHUNK_DELAY_S - 0.1
    assert len(arrivals) >= 4
    settled(proxy, 1)
    (rec,) = sink.requests
    assert rec.streamed and rec.output_tokens == 9 and rec.prompt_tokens == 2
    assert rec.num_spec_steps == spec_for(9)["num_spec_steps"]
    assert rec.latency_s >= 4 * CHUNK_DELAY_S - 0.1


def test_chat_completions_are_recorded_too(tap: tuple[ThreadedServer, TapProxy, ListSink]) -> None:
    server, proxy, sink = tap
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "target", "max_tokens": 5})
    assert r.status_code == 200
    settled(proxy, 1)
    assert [x.output_tokens for x in sink.requests] == [5]


def test_stream_without_usage_is_forwarded_but_not_recorded(
    tap: tuple[ThreadedServer, TapProxy, ListSink],
) -> None:
    server, proxy, sink = tap
    body = {"model": "target", "prompt": "a", "max_tokens": 3, "stream": True, "chunks": 1}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    settled(proxy, 1)
    assert sink.requests == []
    assert proxy.stats.not_recorded["no_usage"] == 1


def test_upstream_errors_pass_through_and_are_recorded_with_their_status(
    upstream: ThreadedServer, tap: tuple[ThreadedServer, TapProxy, ListSink]
) -> None:
    server, proxy, sink = tap
    body = {"model": "nope", "prompt": "x"}
    direct = httpx.post(f"{upstream.url}/v1/completions", json=body)
    via = httpx.post(f"{server.url}/v1/completions", json=body)
    assert (via.status_code, via.content) == (404, direct.content)
    settled(proxy, 1)
    (rec,) = sink.requests
    assert rec.status_code == 404 and rec.output_tokens == 0


def test_method_path_query_headers_and_body_reach_upstream_untouched(
    tap: tuple[ThreadedServer, TapProxy, ListSink],
) -> None:
    server, _, sink = tap
    payload = bytes(range(256)) * 4
    r = httpx.put(
        f"{server.url}/echo/a/b%20c?x=1&x=2&y=%C3%A9",
        content=payload,
        headers={
            "authorization": "Bearer sk-test",
            "x-custom": "v1",
            "content-type": "application/octet-stream",
        },
    )
    assert r.status_code == 201
    seen = r.json()
    assert seen["method"] == "PUT"
    assert seen["path"] == "/echo/a/b c"
    assert seen["query"] == "x=1&x=2&y=%C3%A9"
    assert seen["raw_path"] == "/echo/a/b%20c"  # as sent, not re-encoded
    assert seen["body"].encode("latin-1") == payload
    headers = dict((k, v) for k, v in seen["headers"])
    assert headers["authorization"] == "Bearer sk-test" and headers["x-custom"] == "v1"
    assert headers["content-length"] == str(len(payload))
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
    assert r.headers["x-upstream"] == "yes"
    assert sink.requests == []  # not a completion endpoint


def test_upstream_down_gives_a_clear_502(tmp_path: Path) -> None:
    dead_port = free_port()
    proxy = TapProxy(f"http://127.0.0.1:{dead_port}", None, connect_timeout_s=1)
    with ThreadedServer(create_tap_app(proxy)) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "target"})
        stats = httpx.get(f"{server.url}/_spectuner/tap").json()
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["type"] == "upstream_unavailable" and error["code"] == 502
    assert f"127.0.0.1:{dead_port}" in error["message"] and "unreachable" in error["message"]
    assert stats["upstream_errors"] == {"upstream_unavailable": 1}


def test_a_stalled_store_never_slows_requests_and_full_queue_drops_are_counted(
    upstream: ThreadedServer,
) -> None:
    sink = ListSink()
    sink.gate.clear()  # the store hangs
    writer: BatchWriter[RequestRecord] = BatchWriter(sink.write, max_queue=5, batch_size=2, flush_interval_s=0.05)
    proxy = TapProxy(upstream.url, writer)
    with ThreadedServer(create_tap_app(proxy)) as server, httpx.Client() as client:
        started = time.perf_counter()
        for i in range(20):
            r = client.post(f"{server.url}/v1/completions", json={"model": "target", "prompt": str(i), "max_tokens": 2})
            assert r.status_code == 200
        elapsed = time.perf_counter() - started
        settled_deadline = time.monotonic() + 10
        while proxy.stats.recorded + sum(proxy.stats.not_recorded.values()) < 20:
            assert time.monotonic() < settled_deadline
            time.sleep(0.01)
        stats = client.get(f"{server.url}/_spectuner/tap").json()
        sink.gate.set()
        assert writer.flush(10)
    assert elapsed < 10
    dropped = stats["writer"]["dropped_queue_full"]
    assert dropped >= 20 - 5 - 2 and stats["not_recorded"]["queue_full"] == dropped
    assert len(sink.requests) == 20 - dropped
    assert sink.batches >= 1


def test_concurrent_requests_are_all_recorded_in_batches(
    tap: tuple[ThreadedServer, TapProxy, ListSink],
) -> None:
    server, proxy, sink = tap

    async def burst() -> list[int]:
        async with httpx.AsyncClient() as client:
            responses = await asyncio.gather(
                *(
                    client.post(f"{server.url}/v1/completions", json={"model": "target", "max_tokens": 1 + i % 7})
                    for i in range(60)
                )
            )
        return [r.status_code for r in responses]

    assert asyncio.run(burst()) == [200] * 60
    settled(proxy, 60)
    assert len(sink.requests) == 60
    assert sum(r.output_tokens for r in sink.requests) == sum(1 + i % 7 for i in range(60))
    assert sink.batches < 60


def test_records_land_in_the_real_store(upstream: ThreadedServer, db_url: str) -> None:
    with Store(db_url) as store:
        writer: BatchWriter[RequestRecord] = BatchWriter(store.write_requests, flush_interval_s=0.05)
        proxy = TapProxy(upstream.url, writer)
        with ThreadedServer(create_tap_app(proxy)) as server:
            for n in (4, 8, 16):
                assert httpx.post(f"{server.url}/v1/completions", json={"model": "target", "max_tokens": n}).is_success
        # leaving the server ran the lifespan shutdown, which closes (flushes) the writer
        stored = store.requests()
    assert sorted(r.output_tokens for r in stored) == [4, 8, 16]
    assert sum(r.num_spec_steps for r in stored) == sum(spec_for(n)["num_spec_steps"] for n in (4, 8, 16))


def test_requests_are_tagged_with_the_config_in_force_when_they_finished(upstream: ThreadedServer, db_url: str) -> None:
    from datetime import UTC, datetime, timedelta

    from collectors.records import EngineKey
    from collectors.scrape import metrics_url
    from tuner.store import EngineConfigRecord
    from tuner.store.tagging import RequestConfigTagger

    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    engine_url = metrics_url(upstream.url)
    times = iter([t0 + timedelta(seconds=s) for s in (5, 65, 70)])
    with Store(db_url) as store:
        # Data-parallel rank 1 has a config of its own; rank 0's is the one used. Another server's
        # engine serving the same model name must not be taken.
        first = store.record_config(EngineKey(engine_url, "target", "0"), EngineConfigRecord("draft_model", t0))
        store.record_config(EngineKey(engine_url, "target", "1"), EngineConfigRecord("ngram", t0))
        store.record_config(EngineKey("http://10.9.9.9:8000/metrics", "target", "0"), EngineConfigRecord("ngram", t0))
        second = store.record_config(
            EngineKey(engine_url, "target", "0"), EngineConfigRecord("draft_model", t0 + timedelta(seconds=60))
        )
        writer: BatchWriter[RequestRecord] = BatchWriter(
            RequestConfigTagger(store, engine_url), flush_interval_s=0.05, linger_s=0.5
        )
        proxy = TapProxy(upstream.url, writer, clock=lambda: next(times))
        with ThreadedServer(create_tap_app(proxy)) as server:
            for n in (4, 8):
                assert httpx.post(f"{server.url}/v1/completions", json={"model": "target", "max_tokens": n}).is_success
            settled(proxy, 2)
            unknown = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "max_tokens": 2})
            assert unknown.status_code == 404
        stored = store.requests()
    assert [(r.output_tokens, r.config_id) for r in stored] == [(4, first), (8, second), (0, None)]


@pytest.mark.parametrize("listen", ["0.0.0.0:8001", "10.1.2.3:80", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:x"])
def test_listen_must_be_a_loopback_host_and_port(listen: str) -> None:
    with pytest.raises(ValueError, match="--listen"):
        parse_listen(listen)


def test_listen_accepts_loopback() -> None:
    assert parse_listen("127.0.0.1:8001") == ("127.0.0.1", 8001)
    assert parse_listen("[::1]:8001") == ("::1", 8001)


def test_tap_cli_end_to_end(upstream: ThreadedServer, tmp_path: Path) -> None:
    """The real command: start it, send traffic, SIGTERM it, find the records in the database."""
    from tuner.store import upgrade

    db = f"sqlite:///{tmp_path / 'tap.db'}"
    upgrade(db)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tuner.cli.main",
            "tap",
            "--upstream",
            upstream.url,
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            db,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/_spectuner/tap", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "tap did not come up"
                time.sleep(0.2)
        for n in (3, 5):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "target", "max_tokens": n})
            assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()
    with Store(db) as store:
        assert sorted(r.output_tokens for r in store.requests()) == [3, 5]


def test_tap_cli_refuses_a_public_listen_address() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner.cli.main",
            "tap",
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            "0.0.0.0:8001",
            "--no-record",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "loopback" in result.stderr


def test_cookies_set_by_upstream_never_leak_into_other_requests(
    tap: tuple[ThreadedServer, TapProxy, ListSink],
) -> None:
    server, _, _ = tap
    first = httpx.get(f"{server.url}/echo/one")  # the upstream answers with set-cookie a=1, b=2
    assert first.headers.get_list("set-cookie") == ["a=1", "b=2"]
    second = httpx.get(f"{server.url}/echo/two")  # a fresh client, no cookies of its own
    sent = {k for k, _ in second.json()["headers"]}
    assert "cookie" not in sent


def test_an_encoded_slash_stays_encoded(tap: tuple[ThreadedServer, TapProxy, ListSink]) -> None:
    server, _, _ = tap
    r = httpx.get(f"{server.url}/echo/models%2Fmy-model?name=a%2Fb")
    assert r.json()["raw_path"] == "/echo/models%2Fmy-model"
    assert r.json()["query"] == "name=a%2Fb"


def test_the_proxy_adds_no_headers_of_its_own(tap: tuple[ThreadedServer, TapProxy, ListSink]) -> None:
    server, _, _ = tap
    raw = (
        f"POST /echo/raw HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Length: 3\r\nX-Only: 1\r\n"
        "Connection: close\r\n\r\nabc"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(raw)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201")
    seen = json.loads(body)
    assert sorted(k for k, _ in seen["headers"]) == ["content-length", "host", "x-only"]
    assert seen["body"] == "abc"


def test_an_upstream_with_a_path_prefix_keeps_it(upstream: ThreadedServer) -> None:
    proxy = TapProxy(f"{upstream.url}/echo/", None)
    with ThreadedServer(create_tap_app(proxy)) as server:
        first = httpx.get(f"{server.url}/x/y?z=1").json()
        again = httpx.get(f"{server.url}/x/y?z=1").json()  # the cached target
        other = httpx.get(f"{server.url}/other").json()
    assert (first["raw_path"], first["query"]) == ("/echo/x/y", "z=1")
    assert again["raw_path"] == "/echo/x/y"
    assert other["raw_path"] == "/echo/other"


def test_tap_cli_refuses_a_bad_metrics_url() -> None:
    from typer.testing import CliRunner

    from tuner.cli.main import app

    result = CliRunner().invoke(
        app, ["tap", "--upstream", "http://127.0.0.1:1", "--metrics-url", "ftp://x", "--no-record"]
    )
    assert result.exit_code == 2
    assert "--metrics-url" in result.output


def test_a_client_leaving_mid_stream_stops_the_upstream_stream_at_once(
    tap: tuple[ThreadedServer, TapProxy, ListSink],
) -> None:
    """A gone client must not keep vLLM generating: the relay is cancelled and the upstream
    connection closed long before the stream would have ended (20 chunks × 0.3 s)."""
    server, proxy, sink = tap
    body = {"model": "target", "max_tokens": 9, "stream": True, "chunks": 20, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        first = next(response.iter_raw())
        assert first.startswith(b"data: ")
    left = time.monotonic()
    while proxy.stats.not_recorded["incomplete_stream"] < 1:
        assert time.monotonic() - left < 3, f"the relay went on after the client left: {proxy.stats}"
        time.sleep(0.02)
    assert proxy.stats.recorded == 0 and sink.requests == []
    # The tap still serves the next client normally.
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "target", "max_tokens": 3})
    assert r.status_code == 200


def test_startup_hook_runs_once_and_the_latency_tuning_is_process_wide(upstream: ThreadedServer) -> None:
    called: list[int] = []
    proxy = TapProxy(upstream.url, None)
    with ThreadedServer(create_tap_app(proxy, on_startup=lambda: called.append(1))) as server:
        assert httpx.get(f"{server.url}/_spectuner/tap").json()["requests"] == 0
    assert called == [1]
    # In its own process (it changes the interpreter's GC and GIL settings for good).
    code = (
        "import gc, sys; from collectors.tap import tune_process_for_latency as t; t(); "
        "print(sys.getswitchinterval(), gc.get_freeze_count() > 1000)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["0.0005", "True"]


def test_the_opt_in_traffic_record_keeps_sampled_prompts_and_outputs(upstream: ThreadedServer, tmp_path: Path) -> None:
    from collectors.traffic_record import RecorderSettings, SampleStore, TrafficRecorder

    def words(text: str, special: bool) -> list[int]:  # a tokenizer at our own seam
        return ([1] if special else []) + [len(w) for w in text.split()]

    store = SampleStore(RecorderSettings(tmp_path / "record", sample_rate=1.0))
    proxy = TapProxy(upstream.url, None, traffic=TrafficRecorder(store, words))
    with ThreadedServer(create_tap_app(proxy)) as server:
        for n in (3, 5):
            r = httpx.post(f"{server.url}/v1/completions", json={"model": "target", "prompt": "ab c", "max_tokens": n,
                                                                 "temperature": 0})
            assert r.status_code == 200
        # a streamed answer is recorded from its events; an error is forwarded but not recorded
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={"model": "target", "prompt": "x", "stream": True, "temperature": 0}) as streamed:
            body = streamed.read()
        assert body.count(b"data: ") == 4  # three chunks and [DONE], passed through
        assert httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        deadline = time.monotonic() + 10
        while len(list(store)) < 3:
            assert time.monotonic() < deadline, proxy.stats_dict()
            time.sleep(0.02)
        stats = httpx.get(f"{server.url}/_spectuner/tap").json()["traffic_record"]
    samples = sorted(store, key=lambda s: (len(s.prompt_ids), len(s.output_ids)))
    assert [s.prompt_ids for s in samples] == [(1, 1), (1, 2, 1), (1, 2, 1)]
    # " tok0 tok1 tok2" joined from the stream's chunks; " tok" × n, tokenised
    assert [s.output_ids for s in samples] == [(4,) * 3, (3,) * 3, (3,) * 5]
    assert all(s.greedy and s.ids_source == "tokenized" for s in samples)
    assert stats["seen"] == 3 and stats["recorded"] == 3  # the 404 never reached the recorder

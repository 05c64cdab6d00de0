"""The tap as the engine's front door: hold, release, 503 past the bound, client cancel, drain,
upstream switching and the control endpoint — a real tap between a real client and real upstreams."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from collectors.front_door import FrontDoor
from collectors.tap import TapProxy, create_tap_app
from tests.integration.test_tap_proxy import REPO, UPSTREAM, ThreadedServer
from tuner.actuators.front_door import FrontDoorClient, FrontDoorError
from tuner.engine.process import free_port

TOKEN = "test-token"


@pytest.fixture(scope="module")
def upstream() -> Iterator[ThreadedServer]:
    with ThreadedServer(UPSTREAM) as server:
        yield server


@pytest.fixture(scope="module")
def upstream_b() -> Iterator[ThreadedServer]:
    with ThreadedServer(UPSTREAM) as server:
        yield server


def start_tap(upstreams: list[str], **door: Any) -> tuple[ThreadedServer, FrontDoorClient, TapProxy]:
    proxy = TapProxy(upstreams, None, door=FrontDoor(upstreams, **door), control_token=TOKEN)
    server = ThreadedServer(create_tap_app(proxy)).__enter__()
    return server, FrontDoorClient(server.url, TOKEN), proxy


@pytest.fixture
def tap(upstream: ThreadedServer) -> Iterator[tuple[ThreadedServer, FrontDoorClient, TapProxy]]:
    server, client, proxy = start_tap([upstream.url], max_hold_s=30.0)
    yield server, client, proxy
    server.__exit__()


def completion(url: str, n: int = 3, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "target", "max_tokens": n, **extra}, timeout=60)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_held_requests_wait_and_are_released_in_order_to_the_new_upstream(
    tap: tuple[ThreadedServer, FrontDoorClient, TapProxy], upstream_b: ThreadedServer
) -> None:
    server, client, _ = tap
    client.hold(lease_s=60)
    with ThreadPoolExecutor(3) as pool:
        futures: list[Future[httpx.Response]] = []
        for n in (1, 2, 3):
            futures.append(pool.submit(completion, server.url, n))
            wait_for(lambda n=n: client.state()["held_now"] == n, f"{n} held")  # type: ignore[misc]
        assert not any(f.done() for f in futures)
        time.sleep(0.3)  # held, not answered
        assert not any(f.done() for f in futures)
        state = client.release([upstream_b.url])
        responses = [f.result(timeout=30) for f in futures]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [1, 2, 3]
    period = state["period"]
    assert period["held"] == 3 and period["released"] == 3 and period["failed"] == 0
    assert period["longest_hold_s"] > 0.3
    assert state["upstreams"] == [upstream_b.url]


def test_a_request_held_past_the_bound_gets_503_with_retry_after_and_reaches_no_engine(
    upstream: ThreadedServer,
) -> None:
    server, client, proxy = start_tap([upstream.url], max_hold_s=0.5)
    try:
        client.hold(lease_s=60)
        response = httpx.post(f"{server.url}/echo/x", content=b"held", timeout=30)
        assert response.status_code == 503
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"] == "held_too_long"
        state = client.release()
        assert state["period"]["expired"] == 1 and state["period"]["failed"] == 1
        assert proxy.stats.upstream_errors["held_too_long"] == 1
    finally:
        server.__exit__()


def test_a_full_hold_queue_refuses_at_once_with_503(upstream: ThreadedServer) -> None:
    server, client, _ = start_tap([upstream.url], max_hold_s=30.0, max_held=1)
    try:
        client.hold(lease_s=60)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(completion, server.url)
            wait_for(lambda: client.state()["held_now"] == 1, "one held")
            refused = completion(server.url)
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "hold_queue_full"
            client.release()
            assert first.result(timeout=30).status_code == 200
    finally:
        server.__exit__()


def test_a_client_leaving_while_held_is_cancelled_and_never_forwarded(
    tap: tuple[ThreadedServer, FrontDoorClient, TapProxy],
) -> None:
    server, client, proxy = tap
    client.hold(lease_s=60)

    async def leave_early() -> None:
        async with httpx.AsyncClient() as c:
            task = asyncio.ensure_future(c.post(f"{server.url}/echo/cancelled", content=b"x", timeout=30))
            await asyncio.sleep(0.5)
            task.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave_early())
    wait_for(lambda: client.state()["period"]["cancelled"] == 1, "the cancel to be seen")
    state = client.release()
    assert state["period"]["released"] == 0 and state["held_now"] == 0 and state["in_flight"] == {}
    assert proxy.stats.requests == 1


def test_drain_waits_for_a_stream_in_flight_and_new_requests_go_to_the_new_upstream(
    tap: tuple[ThreadedServer, FrontDoorClient, TapProxy], upstream: ThreadedServer, upstream_b: ThreadedServer
) -> None:
    server, client, _ = tap
    with ThreadPoolExecutor(1) as pool:
        # ~6 s: long enough to be still in flight when the drain begins on a loaded machine (1.5 s was not)
        stream = pool.submit(completion, server.url, 3, stream=True, chunks=20)
        wait_for(lambda: client.state()["in_flight"].get(upstream.url) == 1, "the stream in flight")
        client.set_upstreams([upstream_b.url], new_period=True)
        assert completion(server.url).status_code == 200  # to the new upstream, while the old streams
        answer = client.drain(upstream.url, timeout_s=30)
        body = stream.result(timeout=30)
    assert answer["left"] == 0 and answer["drain_s"] > 0.2
    assert body.status_code == 200 and body.text.count(" tok") == 20 and body.text.endswith("data: [DONE]\n\n")
    assert answer["period"]["failed"] == 0


def test_a_drain_that_times_out_says_how_many_are_left(
    tap: tuple[ThreadedServer, FrontDoorClient, TapProxy], upstream: ThreadedServer
) -> None:
    server, client, _ = tap
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(completion, server.url, 3, stream=True, chunks=10)
        wait_for(lambda: client.state()["in_flight"].get(upstream.url) == 1, "the stream in flight")
        answer = client.drain(upstream.url, timeout_s=0.2)
        assert answer["left"] == 1
        assert stream.result(timeout=30).status_code == 200


def test_a_hold_nobody_releases_ends_with_its_lease(tap: tuple[ThreadedServer, FrontDoorClient, TapProxy]) -> None:
    server, client, _ = tap
    client.hold(lease_s=0.5)
    response = completion(server.url)
    assert response.status_code == 200
    assert client.state()["holding"] is False


def test_several_upstreams_share_the_load(upstream: ThreadedServer, upstream_b: ThreadedServer) -> None:
    server, client, _ = start_tap([upstream.url, upstream_b.url])
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(completion, server.url, 3, stream=True, chunks=4) for _ in range(2)]
            wait_for(lambda: sum(client.state()["in_flight"].values()) == 2, "two streams in flight")
            assert client.state()["in_flight"] == {upstream.url: 1, upstream_b.url: 1}
            assert all(s.result(timeout=30).status_code == 200 for s in streams)
    finally:
        server.__exit__()


def test_the_control_endpoint_needs_the_token_and_a_known_op(
    tap: tuple[ThreadedServer, FrontDoorClient, TapProxy], upstream: ThreadedServer
) -> None:
    server, _, _ = tap
    with pytest.raises(FrontDoorError, match="401"):
        FrontDoorClient(server.url, "wrong").state()
    bad = httpx.post(
        f"{server.url}/_spectuner/control", json={"op": "explode"}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert bad.status_code == 400 and "unknown op" in bad.text
    bad = httpx.post(
        f"{server.url}/_spectuner/control",
        json={"op": "hold", "lease_s": -1},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert bad.status_code == 400
    plain = TapProxy(upstream.url, None)  # no token: the endpoint is off
    with ThreadedServer(create_tap_app(plain)) as off:
        assert httpx.post(f"{off.url}/_spectuner/control", json={"op": "state"}).status_code == 404


# -- issue 18 item 6: read timeout, body cap, port in use ------------------------------------------------
async def stuck(request: Request) -> Response:
    await asyncio.sleep(3600)
    return JSONResponse({})


async def count_body(request: Request) -> Response:
    return JSONResponse({"bytes": len(await request.body())})


STUCK = Starlette(
    routes=[Route("/v1/completions", stuck, methods=["POST"]), Route("/body", count_body, methods=["POST"])]
)


def run_tap_cli(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tuner.cli.main", "tap", "--no-record", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/_spectuner/tap", timeout=1)
            return
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "tap did not come up"
            time.sleep(0.2)


def test_tap_cli_read_timeout_gives_504_and_body_cap_gives_413() -> None:
    with ThreadedServer(STUCK) as stuck_upstream:
        port = free_port()
        proc = run_tap_cli(
            "--upstream",
            stuck_upstream.url,
            "--listen",
            f"127.0.0.1:{port}",
            "--read-timeout-s",
            "1",
            "--max-body-bytes",
            "1000000",
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_up(url, proc)
            t0 = time.monotonic()
            response = httpx.post(f"{url}/v1/completions", json={"model": "x"}, timeout=60)
            assert response.status_code == 504 and time.monotonic() - t0 < 30
            assert response.json()["error"]["type"] == "upstream_timeout"
            big = httpx.post(f"{url}/body", content=b"x" * 2_000_000, timeout=60)
            assert big.status_code == 413 and "--max-body-bytes" in big.json()["error"]["message"]

            def chunks() -> Iterator[bytes]:  # no Content-Length: the cap holds while reading
                for _ in range(40):
                    yield b"y" * 100_000

            unsized = httpx.post(f"{url}/body", content=chunks(), timeout=60)
            assert unsized.status_code == 413
            small = httpx.post(f"{url}/body", content=b"z" * 1000, timeout=60)
            assert small.json() == {"bytes": 1000}
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


def test_tap_cli_port_in_use_exits_2_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run_tap_cli("--upstream", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{port}")
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err.decode()
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot listen" in lines[0] and "Traceback" not in err.decode()


def test_tap_cli_refuses_an_empty_control_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n")
    proc = run_tap_cli(
        "--upstream", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{free_port()}", "--control-token-file", str(token)
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and b"empty" in err


def test_an_unreachable_upstream_is_logged_once_per_interval_not_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = TapProxy(f"http://127.0.0.1:{free_port()}", None, connect_timeout_s=1)
    with ThreadedServer(create_tap_app(proxy)) as server, caplog.at_level("WARNING", logger="collectors.tap"):
        statuses = [httpx.get(f"{server.url}/health", timeout=30).status_code for _ in range(5)]
    assert statuses == [502] * 5
    lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lines) == 1 and proxy.stats.upstream_errors["upstream_unavailable"] == 5

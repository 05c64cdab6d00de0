"""The per-step ingest endpoint with the real plugin shipper, a real HTTP server and a real store."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from collectors.records import EngineKey, EventRecord, RequestRecord, StepRecord, WindowRecord
from collectors.step_ingest import StepIngestServer
from collectors.vllm_plugin.shipper import Shipper
from collectors.vllm_plugin.wire import STATS_PATH, TOKEN_HEADER
from tuner.engine.process import free_port
from tuner.store import Store

ENGINE_URL = "http://127.0.0.1:8000/metrics"
KEY = EngineKey(url=ENGINE_URL, model_name="lab-target", engine="0")
TOKEN = "t0k"
T0 = float(int(time.time()))  # steps are stamped near the sidecar's clock, or they are rejected


def wire_step(i: int, k: int = 3, drafted: int = 3, batch: int = 2) -> dict[str, Any]:
    dp = [batch if p < drafted else 0 for p in range(k)]
    ap = [max(0, batch - p) if p < drafted else 0 for p in range(k)]
    return {
        "t": T0 + i * 0.01,
        "e": 0,
        "b": batch,
        "dt": 0.01,
        "bs": "frontend",
        "k": k,
        "d": batch if drafted else 0,
        "dn": sum(dp),
        "a": sum(ap),
        "ap": ap,
        "dp": dp,
        "g": batch + sum(ap),
        "s": None,
        "r": batch,
        "w": 0,
    }


class ListSink:
    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.events: list[EventRecord] = []

    def write_windows(self, records: Sequence[WindowRecord]) -> None: ...

    def write_requests(self, records: Sequence[RequestRecord]) -> None: ...

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        self.steps.extend(records)

    def write_events(self, records: Sequence[EventRecord]) -> None:
        self.events.extend(records)


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header(TOKEN_HEADER, token)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def batch(steps: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"v": 1, "source": {"model": "lab-target", "pid": 7}, "steps": steps, **extra}).encode()


def test_shipper_to_store_round_trip(db_url: str) -> None:
    """Steps shipped by the plugin's shipper land in the steps table under the scraper's engine key.

    On a loaded machine an answer may come after the shipper's timeout: that batch is "unconfirmed"
    (sent whole, stored all the same), never dropped. What must hold whatever the load: every step
    is stored once, and each one the shipper sent is counted as sent or unconfirmed."""
    store = Store(db_url)
    try:
        with StepIngestServer(store, ENGINE_URL, token="t0k") as ingest:
            shipper = Shipper(ingest.url, token="t0k", source={"model": "lab-target", "pid": 1}, flush_interval_s=0.05)
            for i in range(1200):
                shipper.submit(wire_step(i, drafted=3 if i % 3 else 1))
            assert shipper.flush(10)
            shipper.close()
            assert ingest.writer.flush(10)
            stats = shipper.stats
            assert stats.sent + stats.unconfirmed == 1200 and stats.dropped_send_failed == 0, stats
            assert stats.dropped_queue_full == 0 and stats.batches >= 3, stats  # batched, ≤ 512 per POST
        rows = store.steps(KEY)
        assert len(rows) == 1200
        assert rows[1].spec.draft_tokens_per_pos == (2, 2, 2)
        assert rows[0].spec.draft_tokens_per_pos == (2, 0, 0)
        assert rows[0].ts == datetime.fromtimestamp(T0, UTC)
        sent_accepted = sum(wire_step(i, drafted=3 if i % 3 else 1)["a"] for i in range(1200))
        assert sum(r.spec.accepted_tokens for r in rows) == sent_accepted
    finally:
        store.close()


def test_bad_input_is_named_and_good_steps_kept() -> None:
    sink = ListSink()
    with StepIngestServer(sink, ENGINE_URL, token=TOKEN) as ingest:
        bad = wire_step(1)
        bad["ap"] = [1, 2]
        worse = wire_step(2)
        worse["a"] = 99
        status, answer = post(ingest.url, batch([wire_step(0), bad, worse, "x"]))  # type: ignore[list-item]
        assert status == 200
        assert answer["accepted"] == 1 and answer["rejected"] == 3
        assert "steps[1]: fields 'ap' and 'dp' must have k=3 entries" in answer["errors"][0]
        assert "accepted tokens (99) exceed draft tokens" in answer["errors"][1]
        assert "steps[3]: a step must be a JSON object" in answer["errors"][2]
        assert post(ingest.url, b"not json")[0] == 400
        status, answer = post(ingest.url, json.dumps({"v": 99, "steps": []}).encode())
        assert status == 400 and "wire version 99" in answer["error"]
        status, answer = post(ingest.url, json.dumps({"v": 1, "steps": []}).encode())
        assert status == 400 and "source.model" in answer["error"]
        assert post(ingest.url.replace("/v1/steps", "/nope"), batch([]))[0] == 404
        ingest.writer.flush(5)
    assert len(sink.steps) == 1


def test_token_is_mandatory_and_guards_every_path() -> None:
    for empty in (None, "", "  "):
        with pytest.raises(ValueError, match="token"):
            StepIngestServer(ListSink(), ENGINE_URL, token=empty)  # type: ignore[arg-type]
    sink = ListSink()
    with StepIngestServer(sink, ENGINE_URL, token="right") as ingest:
        assert post(ingest.url, batch([wire_step(0)]), token="wrong")[0] == 401
        assert post(ingest.url, batch([wire_step(0)]), token=None)[0] == 401
        assert post(ingest.url, batch([wire_step(0)]), token="right")[0] == 200
        stats_url = f"http://127.0.0.1:{ingest.port}{STATS_PATH}"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(stats_url, timeout=5)
        assert refused.value.code == 401
        req = urllib.request.Request(stats_url, headers={TOKEN_HEADER: "right"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            stats = json.loads(resp.read())
        assert stats["unauthorized"] == 3 and stats["accepted"] == 1


def _with(step: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**step, **changes}


def test_steps_outside_sane_bounds_are_rejected_and_counted() -> None:
    sink = ListSink()
    good = wire_step(0)
    hostile = [
        _with(good, t=86_400.0),  # 1970
        _with(good, t=99_999_999_999.0 - 1),  # 5138
        _with(good, t=T0 + 3600),  # an hour ahead of the sidecar
        _with(good, b=1_000_000, r=1_000_000),  # batch size over --max-num-seqs
        _with(good, dt=3599.0),  # a one-hour step
        _with(good, d=50),  # more drafts than sequences in the batch
        _with(good, dn=1000),  # more draft tokens than drafts × K
        _with(good, ap=[2, 1, 1]),  # per-position counts that do not sum to "a"
        _with(good, k=1000, ap=[0] * 1000, dp=[0] * 1000),
    ]
    with StepIngestServer(sink, ENGINE_URL, token=TOKEN, max_batch_size=256) as ingest:
        status, answer = post(ingest.url, batch([good, *hostile]))
        assert status == 200
        assert (answer["accepted"], answer["rejected"]) == (1, len(hostile))
        ingest.writer.flush(5)
        assert ingest.stats_json()["rejected"] == len(hostile)
    assert len(sink.steps) == 1


def test_binds_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback"):
        StepIngestServer(ListSink(), ENGINE_URL, host="0.0.0.0", token=TOKEN)


def test_sidecar_down_costs_the_engine_nothing_and_drops_are_reported() -> None:
    """With nothing listening, submit() stays O(1) and drops are counted; when the sidecar comes back
    the counters arrive with the next batch and become an event."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/steps"
    shipper = Shipper(url, token=TOKEN, source={"model": "lab-target", "pid": 3}, queue_max=1000, flush_interval_s=0.02)
    try:
        t0 = time.perf_counter()
        for i in range(5000):
            shipper.submit(wire_step(i))
        per_submit_us = (time.perf_counter() - t0) / 5000 * 1e6
        assert per_submit_us < 100, f"submit took {per_submit_us:.1f} µs with the sidecar down"
        deadline = time.monotonic() + 5
        while shipper.stats.send_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = shipper.stats
        assert st.send_errors >= 1 and st.queued <= 1000  # bounded
        assert st.dropped_queue_full + st.dropped_send_failed + st.queued == 5000  # every step accounted for
        sink = ListSink()
        with StepIngestServer(sink, ENGINE_URL, port=port, drop_event_interval_s=0, token=TOKEN) as ingest:
            time.sleep(shipper.max_backoff_s + 0.5)  # past the back-off
            for i in range(10):
                shipper.submit(wire_step(i))
            assert shipper.flush(10)
            deadline = time.monotonic() + 5
            while not sink.events and time.monotonic() < deadline:
                time.sleep(0.02)
            stats = ingest.stats_json()
        assert stats["plugin_dropped"] >= 4000 - 1000  # at most the last queue-full could still be sent
        assert sink.events and sink.events[0].kind == "plugin_steps_dropped"
        assert "dropped" in sink.events[0].message
    finally:
        shipper.close()


def test_stopping_the_sidecar_closes_keep_alive_connections() -> None:
    """A stopped ingest server must not keep taking steps on an open keep-alive connection (into a
    writer that no longer writes): the plugin sees the failure, counts its drops, and reaches the
    next server on the same port."""
    sink = ListSink()
    ingest = StepIngestServer(sink, ENGINE_URL, token=TOKEN).start()
    port = ingest.port
    shipper = Shipper(
        ingest.url, token=TOKEN, source={"model": "lab-target", "pid": 5}, flush_interval_s=0.02, max_backoff_s=0.2
    )
    try:
        shipper.submit(wire_step(0))
        assert shipper.flush(5) and shipper.stats.sent == 1
        ingest.stop()
        for i in range(5):
            shipper.submit(wire_step(i))
        deadline = time.monotonic() + 5
        while shipper.stats.send_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shipper.stats.send_errors >= 1 and shipper.stats.dropped_send_failed >= 1
        sink2 = ListSink()
        with StepIngestServer(sink2, ENGINE_URL, port=port, token=TOKEN) as again:
            time.sleep(0.5)
            shipper.submit(wire_step(9))
            assert shipper.flush(5)
            deadline = time.monotonic() + 5
            while again.stats.accepted == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert again.stats.accepted >= 1
            assert again.stats.plugin_dropped >= 1
    finally:
        shipper.close()


def test_a_plugin_that_hangs_up_before_the_answer_loses_no_steps(capfd: pytest.CaptureFixture[str]) -> None:
    """The plugin's POST times out on a starved host and it closes the socket (RST): the batch is still
    stored, and the server neither prints a traceback nor stops serving."""
    import socket
    import struct
    from urllib.parse import urlsplit

    sink = ListSink()
    with StepIngestServer(sink, ENGINE_URL, token=TOKEN) as ingest:
        parts = urlsplit(ingest.url)
        body = batch([wire_step(i) for i in range(50)])
        # at once: the reset hits the answer; after 0.3 s: it hits the keep-alive wait for the next request
        for delay_s in (0.0, 0.3, 0.3):
            with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
                head = (
                    f"POST {parts.path} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode()
                sock.sendall(head + body)
                time.sleep(delay_s)
        deadline = time.monotonic() + 10
        while len(sink.steps) < 150 and time.monotonic() < deadline:
            assert ingest.writer.flush(1)
            time.sleep(0.05)
        assert len(sink.steps) == 150
        status, answer = post(ingest.url, batch([wire_step(99)]))  # and it still serves
        assert status == 200 and answer["accepted"] == 1
    assert "Traceback" not in capfd.readouterr().err


def test_a_batch_sent_whole_without_an_answer_is_unconfirmed_not_dropped() -> None:
    """A sidecar too slow to answer within the plugin's timeout has usually stored the batch: the plugin
    counts it as unconfirmed. Only a batch that never went out (nobody listening) counts as dropped. Both
    counters reach the sidecar with the next batch."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    silent_port = listener.getsockname()[1]
    received: list[bytes] = []

    def read_and_never_answer() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                data.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0]
            ):
                data += conn.recv(65536)
            received.append(data)
            time.sleep(1.5)  # past the plugin's timeout

    server = threading.Thread(target=read_and_never_answer, daemon=True)
    server.start()
    slow = Shipper(
        f"http://127.0.0.1:{silent_port}/v1/steps",
        token=TOKEN,
        source={"model": "lab-target", "pid": 11},
        timeout_s=0.3,
        flush_interval_s=0.3,
        max_backoff_s=0.2,
    )
    refused = Shipper(f"http://127.0.0.1:{free_port()}/v1/steps", timeout_s=0.3, flush_interval_s=0.3)
    try:
        for i in range(7):  # one batch each: the shipping thread first wakes 0.3 s after the first record
            slow.submit(wire_step(i))
            refused.submit(wire_step(i))
        deadline = time.monotonic() + 5
        while (slow.stats.send_errors == 0 or refused.stats.send_errors == 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert received and b'"steps"' in received[0]
        assert (slow.stats.unconfirmed, slow.stats.dropped_send_failed) == (7, 0)
        assert (refused.stats.unconfirmed, refused.stats.dropped_send_failed) == (0, 7)
        server.join(5)
        listener.close()
        # the sidecar answers again on the same port: the next batch carries the plugin's counters
        sink = ListSink()
        with StepIngestServer(sink, ENGINE_URL, port=silent_port, token=TOKEN) as ingest:
            slow.submit(wire_step(8))
            deadline = time.monotonic() + 5
            while ingest.stats_json()["plugin_unconfirmed"] != 7 and time.monotonic() < deadline:
                time.sleep(0.02)
            stats = ingest.stats_json()
        assert stats["plugin_unconfirmed"] == 7 and stats["plugin_dropped"] == 0
    finally:
        slow.close(0.1)
        refused.close(0.1)
        listener.close()

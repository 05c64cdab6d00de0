"""Collectors against the real vLLM lab engine (CPU): scrape windows, the tap, an engine restart.

Independent checks: the engine's own counters are read back with a plain line scan of /metrics
(not our parser), and the per-request figures come from the responses the load generator saw.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from collectors.batch_writer import BatchWriter
from collectors.records import RequestRecord
from collectors.scrape import Collector
from collectors.tap import TapProxy, create_tap_app
from tuner.lab.load import LoadResult, run_load
from tuner.lab.prompts import HARD, PREDICTABLE
from tuner.store import Store, upgrade

SPEC_NAMES = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


def engine_counters(metrics_url: str) -> dict[str, float]:
    """The engine's counters by a plain line scan (one engine on the lab page)."""
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for key, name in SPEC_NAMES.items():
        (line,) = [x for x in text.splitlines() if x.startswith(name + "{")]
        out[key] = float(line.rsplit(" ", 1)[1])
    for line in text.splitlines():
        m = re.match(r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)".*\} (\S+)$', line)
        if m:
            out[f"pos{m.group(1)}"] = float(m.group(2))
    return out


# A cap on the rounds of load the windows test sends while it waits for the loop to store windows.
MAX_LOAD_ROUNDS = 10


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'live.db'}"
    upgrade(url)
    return url


def test_stored_windows_add_up_to_the_engine_counters_under_load(lab_engine: Any, db_url: str) -> None:
    loads: list[LoadResult] = []
    with (
        Store(db_url) as store,
        Collector(lab_engine.metrics_url, store, interval_s=0.5, timeout_s=10) as collector,
    ):
        first = collector.collect_once()
        assert first.ok, first.error
        (key,) = [s.key for s in first.samples]
        before = engine_counters(lab_engine.metrics_url)
        stop = threading.Event()
        loop = threading.Thread(target=collector.run, args=(stop,))
        loop.start()
        try:
            # Rounds of load until the loop has stored windows of its own: one round stored a single
            # loop window on CI's faster machine (likely served in about one scrape interval).
            for _ in range(MAX_LOAD_ROUNDS):
                loads.append(run_load(
                    lab_engine.base_url, lab_engine.model_name, PREDICTABLE, concurrency=4, count=20, max_tokens=64
                ))
                loads.append(run_load(
                    lab_engine.base_url, lab_engine.model_name, HARD, concurrency=4, count=8, max_tokens=32
                ))
                if len(store.windows(key)) >= 3:
                    break
        finally:
            stop.set()
            loop.join(30)
        loop_windows = len(store.windows(key))
        last = collector.collect_once()
        assert last.ok, last.error
        after = engine_counters(lab_engine.metrics_url)
        assert all(load.errors == 0 for load in loads)
        totals = store.window_totals(key)
        windows = store.windows(key)

    engine = delta(after, before)
    assert engine["drafts"] > 0
    assert totals.resets == 0
    assert loop_windows >= 3, (
        f"the loop stored {loop_windows} window(s) in {len(loads) // 2} round(s) of load; errors {collector.errors}"
    )
    assert len(windows) == loop_windows + 1
    assert totals.spec.drafts == engine["drafts"]
    assert totals.spec.draft_tokens == engine["draft_tokens"]
    assert totals.spec.accepted_tokens == engine["accepted_tokens"]
    assert totals.generation_tokens == engine["generation_tokens"]
    assert list(totals.spec.accepted_per_pos) == [engine[f"pos{i}"] for i in range(lab_engine.k)]
    # The engine generated what the clients received.
    assert engine["generation_tokens"] == sum(load.output_tokens for load in loads)
    assert collector.errors == {}


def test_tap_records_sum_to_the_engine_counters(lab_engine: Any, db_url: str) -> None:
    with Store(db_url) as store:
        writer: BatchWriter[RequestRecord] = BatchWriter(store.write_requests, name="live", flush_interval_s=0.1)
        proxy = TapProxy(lab_engine.base_url, writer)
        with _serve(create_tap_app(proxy)) as tap_url:
            before = engine_counters(lab_engine.metrics_url)
            load = run_load(tap_url, lab_engine.model_name, PREDICTABLE + HARD, concurrency=4, count=20, max_tokens=48)
            streamed = _stream_through(tap_url, lab_engine.model_name, PREDICTABLE[0], max_tokens=24)
            after = engine_counters(lab_engine.metrics_url)
        # The tap's shutdown flushed the writer.
        records = store.requests()
    assert load.errors == 0
    engine = delta(after, before)
    assert len(records) == 21 and sum(r.streamed for r in records) == 1
    assert sum(r.num_spec_steps for r in records) == engine["drafts"]
    assert sum(r.num_draft_tokens for r in records) == engine["draft_tokens"]
    assert sum(r.num_accepted_draft_tokens for r in records) == engine["accepted_tokens"]
    assert sum(r.output_tokens for r in records) == engine["generation_tokens"]
    # And they are what the clients saw.
    seen = load.spec_totals()
    stream_spec = streamed["metrics"]["speculative_decoding"]
    assert sum(r.num_spec_steps for r in records) == seen["drafts"] + stream_spec["num_spec_steps"]
    assert all(r.num_spec_tokens == lab_engine.k and len(r.acceptance_histogram) == lab_engine.k + 1 for r in records)
    assert all(r.per_step_accepted is not None for r in records)  # the lab runs the detailed level


# An engine restart mid-collection, stored as a counter reset, is checked live in
# tests/live/test_closed_loop_live.py (every controller restart) instead of two more engine starts here.


class _serve:
    """Run an ASGI app with uvicorn on a loopback port in a thread; yields its base URL."""

    def __init__(self, asgi: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(asgi, log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def _stream_through(base_url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion asking for usage; returns the final chunk (usage + metrics)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    final: dict[str, Any] = {}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "metrics" in chunk:
                    final = chunk
    assert final, "the final chunk carries usage and metrics"
    return final

"""A writer killed with SIGKILL mid-write leaves a consistent database (SQLite and PostgreSQL).

A child process writes batches in a loop (windows, requests, steps: one transaction each); the test
kills it with ``kill -9`` at random moments, three times, restarting it in between, then checks that
SQLite's ``PRAGMA integrity_check`` passes and every batch is either all there or not there at all.
Run as a script, this module is that child.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import text

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 3, 1, tzinfo=UTC)
ENGINES = 4
REQUESTS_PER_BATCH = 300
STEPS_PER_BATCH = 2000


def _writer(url: str) -> None:  # the child
    sys.path.insert(0, str(REPO))
    from collectors.records import EngineKey, RequestRecord, StepRecord, WindowRecord
    from policies.counters import SpecCounters
    from tuner.store import Store

    keys = [EngineKey("http://127.0.0.1:8000/metrics", "m", str(e)) for e in range(ENGINES)]
    store = Store(url)
    batch = 0
    for key in keys:
        latest = store.latest_window(key)
        if latest is not None:
            batch = max(batch, int((latest.end - T0).total_seconds()) // 5)
    announced = False
    while True:
        start = T0 + timedelta(seconds=5 * batch)
        per_pos = (batch % 5 + 3, batch % 3 + 1, 1)
        counters = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=sum(per_pos), accepted_per_pos=per_pos)
        store.write_windows(
            [WindowRecord(k, start, start + timedelta(seconds=5), counters, generation_tokens=50.0) for k in keys]
        )
        store.write_requests(
            [
                RequestRecord(
                    ts=start + timedelta(microseconds=i),
                    request_id=f"b{batch}-{i}",
                    model_name="m",
                    prompt_tokens=5,
                    output_tokens=7,
                    latency_s=0.1,
                    num_spec_steps=2,
                    num_draft_tokens=6,
                    num_accepted_draft_tokens=4,
                    acceptance_histogram=(0, 1, 1, 0),
                )
                for i in range(REQUESTS_PER_BATCH)
            ]
        )
        store.write_steps(
            [
                StepRecord(
                    ts=start + timedelta(microseconds=i),
                    key=keys[i % ENGINES],
                    batch_size=4,
                    step_time_s=0.01,
                    spec=counters,
                )
                for i in range(STEPS_PER_BATCH)
            ]
        )
        batch += 1
        if not announced:
            print("ready", flush=True)
            announced = True


def _kill_writer_repeatedly(url: str, rounds: int = 3) -> None:
    rng = random.Random(20260301)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(rounds):
        proc = subprocess.Popen(
            [sys.executable, __file__, url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise AssertionError(f"writer did not start: {line!r} {proc.communicate()[1]}")
        time.sleep(rng.uniform(0.1, 0.8))
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL


def _as_datetimes(values: object) -> list[datetime]:
    """Raw SQL gives SQLite's text timestamps (UTC) or PostgreSQL's aware datetimes."""
    out = []
    for value in values:  # type: ignore[attr-defined]
        if isinstance(value, str):
            value = datetime.fromisoformat(value).replace(tzinfo=UTC)
        out.append(value)
    return out


def test_kill_9_mid_write_leaves_a_consistent_database(db_url: str) -> None:
    from tuner.store import Store

    _kill_writer_repeatedly(db_url)

    if db_url.startswith("sqlite"):
        raw = sqlite3.connect(db_url.removeprefix("sqlite:///"))
        try:
            assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
        finally:
            raw.close()

    with Store(db_url) as store, store.read_connection() as conn:  # opens: schema intact
        ends = Counter(row[0] for row in conn.execute(text("SELECT end_ts FROM scrape_windows")))
        assert ends, "the writer never committed a batch"
        assert set(ends.values()) == {ENGINES}, f"a window batch was torn: {ends}"
        per_window = conn.execute(text("SELECT accepted_tokens, accepted_per_pos FROM scrape_windows")).all()
        for accepted, per_pos in per_window:
            values = per_pos if isinstance(per_pos, list) else json.loads(per_pos)
            assert sum(values) == accepted
        request_batches = Counter(row[0].split("-")[0] for row in conn.execute(text("SELECT request_id FROM requests")))
        assert set(request_batches.values()) <= {REQUESTS_PER_BATCH}, f"a request batch was torn: {request_batches}"
    with Store(db_url) as store:
        step_batches = Counter(
            int((s.ts - T0).total_seconds()) // 5
            for key in {engine.key for engine in store.engines()}
            for s in store.steps(key)
        )
    assert set(step_batches.values()) <= {STEPS_PER_BATCH}, f"a step batch was torn: {step_batches}"
    # Each batch writes windows, then requests, then steps: a later kind never has a batch the
    # earlier one lacks (a kill between kinds leaves that batch without the later kinds).
    window_batches = {int((end - T0).total_seconds()) // 5 - 1 for end in _as_datetimes(ends)}
    assert {int(b.removeprefix("b")) for b in request_batches} <= window_batches
    assert set(step_batches) <= {int(b.removeprefix("b")) for b in request_batches}
    assert len(step_batches) >= len(window_batches) - 3  # at most one batch cut short per kill
    with Store(db_url) as store:  # and it takes writes again
        from collectors.records import EngineKey, WindowRecord

        key = EngineKey("http://127.0.0.1:8000/metrics", "m", "0")
        last = store.latest_window(key)
        assert last is not None
        store.write_windows([WindowRecord(key, last.end, last.end + timedelta(seconds=5), None, 0.0)])
        assert store.latest_window(key).end == last.end + timedelta(seconds=5)  # type: ignore[union-attr]


if __name__ == "__main__":
    _writer(sys.argv[1])

"""bench/bench_fleet_store.py at tiny scale on the real PostgreSQL: the simulated engines serve pages
the real parser takes, their steps pass the real ingest, and the audit finds nothing lost. Counts
only; no timing is asserted (the figures come from the benchmark run, not from tests)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from bench.bench_fleet_store import MODEL, K, PageTemplate, SimEngine, run_fleet, verdict
from collectors.exposition import parse_metrics_page
from collectors.step_ingest import StepBounds, step_from_wire
from tests.integration.pg import PostgresServer

pytestmark = pytest.mark.integration


def test_the_page_counts_exactly_the_engines_steps() -> None:
    template = PageTemplate.load()
    engine = SimEngine(template, steps_per_s=25.0, seed=7, now_s=1_000.0)
    before = parse_metrics_page(engine.page(), url="http://e/metrics", ts=datetime.now(UTC))[0].spec
    steps = engine.steps_until(1_004.0)
    assert len(steps) == 100
    bounds = StepBounds(now_s=1_004.0)
    records = [step_from_wire(s, "http://e/metrics", MODEL, bounds) for s in steps]  # raises on a bad step
    after = parse_metrics_page(engine.page(), url="http://e/metrics", ts=datetime.now(UTC))[0].spec
    assert before is not None and after is not None
    assert len(after.accepted_per_pos) == K
    assert after.drafts - before.drafts == sum(r.spec.drafts for r in records)
    assert after.accepted_tokens - before.accepted_tokens == sum(r.spec.accepted_tokens for r in records)
    for p in range(K):
        assert after.accepted_per_pos[p] - before.accepted_per_pos[p] == sum(
            r.spec.accepted_per_pos[p] for r in records
        )


def test_a_tiny_fleet_stores_every_window_and_step(pg_server: PostgresServer) -> None:
    run = run_fleet(
        pg_server.create_database(),
        pg_server.postmaster_pid(),
        engines=3,
        duration_s=5.0,
        collect_interval_s=1.0,
        retention_interval_s=2.0,
    )
    r = run.result
    assert r["scrape_errors"] == {}
    assert r["windows_expected"] > 0
    assert r["windows_stored"] == r["windows_expected"]
    assert r["window_chain_breaks"] == 0
    assert r["steps_accepted"] > 0 and r["steps_rejected"] == 0
    assert r["steps_stored"] == r["steps_accepted"]
    assert r["steps_dropped_by_writers"] == 0
    assert r["retention"]["runs"] >= 3 and r["retention"]["errors"] == 0
    assert r["write_latency"]["write_scrape"]["count"] > 0 and r["write_latency"]["write_steps"]["count"] > 0
    assert r["postgresql"]["processes"] > 1  # the sampler found the server and its backends
    assert r["rows"]["scrape_windows"] == r["windows_stored"]
    v = verdict(run)
    assert v["nothing_lost"] and v["failures"] == 0
    assert not v["met"]  # 3 engines are not the target's 100

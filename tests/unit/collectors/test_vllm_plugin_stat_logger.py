"""The stat-logger plugin turns vLLM's real per-step stats objects into wire records (no engine needed)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.metrics.stats import IterationStats, SchedulerIterationDetails, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from collectors.step_ingest import step_from_wire
from collectors.vllm_plugin import env
from collectors.vllm_plugin.stat_logger import SpectunerStatLogger


def _config(k: int = 5) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="lab-target"),
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
    )


@pytest.fixture
def logger(monkeypatch: pytest.MonkeyPatch) -> SpectunerStatLogger:
    # An unreachable port: records queue and are dropped by the shipper thread, never raise.
    monkeypatch.setenv(env.INGEST_URL, "http://127.0.0.1:9/v1/steps")
    return SpectunerStatLogger(_config(), 0)


def _spec(drafted: list[int], accepted: list[int], k: int = 5) -> SpecDecodingStats:
    s = SpecDecodingStats.new(k)
    for d, a in zip(drafted, accepted, strict=True):
        s.observe_draft(d, a)
    return s


def test_inert_without_ingest_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.INGEST_URL, raising=False)
    lg = SpectunerStatLogger(_config(), 0)
    assert lg.shipper is None
    lg.record(SchedulerStats(num_running_reqs=2, spec_decoding_stats=_spec([5], [3])), IterationStats())
    lg.log()
    lg.log_engine_initialized()


def test_step_record_carries_per_position_drafts(logger: SpectunerStatLogger) -> None:
    it = IterationStats()
    it.num_generation_tokens = 9
    sched = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, spec_decoding_stats=_spec([5, 5, 2], [5, 1, 0]))
    rec = logger.step_record(sched, it, 0, now_s=1_800_000_000.0, now_mono=100.0)
    assert rec is not None
    assert (rec["b"], rec["k"], rec["d"], rec["dn"], rec["a"]) == (3, 5, 3, 12, 6)
    assert rec["dp"] == [3, 3, 2, 2, 2]  # what /metrics lacks
    assert rec["ap"] == [2, 1, 1, 1, 1]
    assert rec["g"] == 9 and rec["w"] == 1 and rec["bs"] == "frontend"
    assert rec["dt"] is None  # first step: no previous busy step to time against
    # The sidecar side accepts exactly this record.
    stored = step_from_wire(rec, "http://e/metrics", "lab-target")
    assert stored.spec.draft_tokens_per_pos == (3, 3, 2, 2, 2) and stored.spec.num_spec_tokens == 5


def test_step_time_between_busy_steps_and_reset_after_idle(logger: SpectunerStatLogger) -> None:
    busy = SchedulerStats(num_running_reqs=2, spec_decoding_stats=_spec([5, 5], [1, 2]))
    assert logger.step_record(busy, IterationStats(), 0, 1e9, 10.0)["dt"] is None  # type: ignore[index]
    assert logger.step_record(busy, IterationStats(), 0, 1e9, 10.04)["dt"] == pytest.approx(0.04)  # type: ignore[index]
    # Requests finished: the stats of that last step still count, then the engine goes idle.
    done = SchedulerStats(num_running_reqs=0, spec_decoding_stats=_spec([5], [5]))
    it = IterationStats()
    it.finished_requests = [object(), object()]  # type: ignore[list-item]
    last = logger.step_record(done, it, 0, 1e9, 10.08)
    assert last is not None and last["b"] == 2 and last["dt"] == pytest.approx(0.04)
    # An idle stats message is not a step; the next busy step after idle has no step time.
    assert logger.step_record(SchedulerStats(), None, 0, 1e9, 30.0) is None
    assert logger.step_record(busy, IterationStats(), 0, 1e9, 30.1)["dt"] is None  # type: ignore[index]


def test_k_zero_step_is_shipped_with_zero_counts(logger: SpectunerStatLogger) -> None:
    it = IterationStats()
    it.num_generation_tokens = 4
    rec = logger.step_record(SchedulerStats(num_running_reqs=4), it, 0, 1e9, 1.0)
    assert rec is not None
    assert (rec["d"], rec["dn"], rec["k"], rec["dp"], rec["g"]) == (0, 0, 5, [0] * 5, 4)


def test_iteration_details_give_exact_batch_and_time(logger: SpectunerStatLogger) -> None:
    details = SchedulerIterationDetails(
        iteration_index=7,
        num_ctx_requests=1,
        num_ctx_tokens=30,
        num_generation_requests=3,
        num_generation_tokens=18,
        elapsed_ms=12.5,
    )
    sched = SchedulerStats(num_running_reqs=9, spec_decoding_stats=_spec([5], [2]), iteration_details=details)
    rec = logger.step_record(sched, IterationStats(), 0, 1e9, 1.0)
    assert rec is not None
    assert (rec["b"], rec["dt"], rec["s"], rec["bs"]) == (4, 0.0125, 48, "details")


def test_record_never_raises_or_blocks(logger: SpectunerStatLogger) -> None:
    """The sidecar is unreachable: 20 000 records are queued or dropped without waiting on the network
    (a record that waited on a connection, even for a millisecond, would take far past the bound; how fast
    record() is belongs to bench/bench_plugin.py, not to a timed test), and a malformed stats object is
    swallowed (logged once) instead of ending vLLM's output loop."""
    sched = SchedulerStats(num_running_reqs=8, spec_decoding_stats=_spec([5] * 8, [3] * 8))
    it = IterationStats()
    t0 = time.perf_counter()
    for _ in range(20_000):
        logger.record(sched, it)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60.0, f"record() took {elapsed / 20_000 * 1e6:.1f} µs per step: it waits on something"
    logger.record(SimpleNamespace(spec_decoding_stats=1), it)  # type: ignore[arg-type]
    assert logger._errors == 1
    assert logger.shipper is not None
    st = logger.shipper.stats
    assert st.submitted == 20_000
    assert st.sent == 0

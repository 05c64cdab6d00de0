"""Every surface that shows α̂ reports the controller's α̂ (policies.acceptance.alpha_of_windows) on a real
store (SQLite and PostgreSQL): the controller's decision context, ``spectuner status``, the exporters,
the report and the demo's status line.

The run is one config with a per-batch-size table (K_max = 5): its windows drafted 5 and 2 tokens per
step (T/D = 5, 2, ...). Read at K_max, the summed counters would count every 2-token draft as rejected
at positions 3–5; each surface must read every window at the K it drafted and pool them. The test fails
if any surface regresses to the summed counters.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from collectors.records import EngineKey, WindowRecord
from policies.acceptance import alpha_of_windows, estimate_alpha
from policies.counters import SpecCounters
from policies.spec_config import SpecConfig
from tuner.cli.status import gather as status_gather
from tuner.config import PolicySection
from tuner.controller.context import ControllerMemory, build_context, measure
from tuner.controller.settings import ControllerSettings, PolicySettings
from tuner.exporters.source import StoreSource
from tuner.exporters.values import engine_samples
from tuner.report.data import gather as report_gather
from tuner.store import AppliedBy, EngineConfigRecord, Store

URL = "http://127.0.0.1:8000/metrics"
KEY = EngineKey(URL, "target", "0")
T0 = datetime(2026, 12, 1, tzinfo=UTC)
TABLE = SpecConfig("draft_model", "/drafts/good", 5, ((1, 2, 5), (3, 16, 2)))
# Windows a day long: the report then puts all of them in ONE α̂ bucket (its bucket is at least the
# typical window; six days fit the one-week bucket), so its α̂ is over the same windows as the others'.
WINDOW_S = 86401.0
N_WINDOWS = 6
HORIZON_S = WINDOW_S * (N_WINDOWS + 1)  # every surface's look-back covers all the windows
CONFIDENCE = 0.95


def counters(k: int, drafts: int, alpha: float, wobble: int) -> SpecCounters:
    """Counters of a window that drafted ``k`` tokens per step with the engine at K_max = 5 (positions past
    k stay zero, as vLLM reports them under a table); ``wobble`` keeps the windows from being identical."""
    per_pos = [round(drafts * alpha ** (i + 1)) + (wobble if i == 0 else 0) for i in range(k)]
    per_pos += [0] * (5 - k)
    return SpecCounters(drafts, drafts * k, sum(per_pos), tuple(per_pos), num_spec_tokens=5)


def windows() -> list[WindowRecord]:
    start = T0 + timedelta(seconds=60)  # after the config started
    out = []
    for i in range(N_WINDOWS):
        k = 5 if i % 2 == 0 else 2  # quiet spells draft 5 per step, busy ones 2
        out.append(
            WindowRecord(
                key=KEY,
                start=start + timedelta(seconds=WINDOW_S * i),
                end=start + timedelta(seconds=WINDOW_S * (i + 1)),
                spec=counters(k, 2000 + 100 * i, 0.7, wobble=7 * i),
                generation_tokens=1000.0 * WINDOW_S,
                requests_running=1.0 if k == 5 else 8.0,
            )
        )
    return out


def test_every_surface_reports_the_controllers_alpha_of_a_table(db_url: str) -> None:
    wins = windows()
    specs = [w.spec for w in wins if w.spec is not None]
    now = wins[-1].end + timedelta(seconds=1)
    # the expected α̂: each window at its own K, pooled
    expected = alpha_of_windows(specs, CONFIDENCE)
    assert expected.alpha is not None and expected.alpha_ci is not None
    assert expected.alpha == pytest.approx(0.7, abs=0.01)
    assert "pooled over windows at K = [2, 5]" in expected.message
    # the summed counters read at K_max: refused (T/D is not 5) and, by the closed form
    # A / (A + D − a_{K−1}), far from the truth; no surface may show either
    summed = SpecCounters()
    for s in specs:
        summed = summed + s
    assert summed.draft_tokens / summed.drafts not in (2.0, 5.0)
    assert estimate_alpha(summed, confidence=CONFIDENCE).alpha is None
    naive = summed.accepted_tokens / (summed.accepted_tokens + summed.drafts - summed.accepted_per_pos[-1])
    assert abs(naive - expected.alpha) > 0.05

    with Store(db_url) as store:
        config_id = store.record_config(KEY, EngineConfigRecord.of(TABLE, T0, AppliedBy.STARTUP))
        store.write_windows(wins)
        stored = store.current_config(KEY)
        assert stored is not None and stored.id == config_id and stored.config.spec == TABLE

        # (a) the controller: the context a decision reads (and the measured part alone)
        settings = ControllerSettings(
            metrics_url=URL,
            policy=PolicySettings(
                PolicySection(
                    evidence_window_s=HORIZON_S, confidence=CONFIDENCE, per_batch_size=True, step_cost_fit=False
                )
            ),
        )
        ctx, _ = build_context(store, [KEY], stored, now, settings, (), (), ControllerMemory())
        assert ctx.windows == N_WINDOWS and ctx.current == TABLE
        controller = ctx.alpha
        assert measure(store, [KEY], stored, now, HORIZON_S, CONFIDENCE).alpha == controller

        # (b) spectuner status --json
        [engine] = status_gather(store, now, HORIZON_S, 3600.0, URL)["engines"]
        status = engine["window"]
        assert status["windows"] == N_WINDOWS

        # (c) the exporters: the gauges of the engine series
        source = StoreSource(store, metrics_url=URL, window_s=HORIZON_S, confidence=CONFIDENCE)
        [(engine_id, key)] = source.engines()
        snap = source.snapshot(engine_id, key, [engine_id], now)
        assert len(snap.window_specs) == N_WINDOWS
        gauges = {s.name: s.value for s in engine_samples(snap, cost_ratio=0.05, confidence=CONFIDENCE)}

        # (d) the report: one α̂ bucket holding every window
        report = report_gather(store, since=T0, until=now, now=now)
        [bucket] = report.alpha
        assert bucket.windows == N_WINDOWS

        # (e) the demo's status line: α̂ of the latest window (read at the K it drafted)
        from tuner.demo import _status_line

        daemon = SimpleNamespace(
            controller=SimpleNamespace(engine_keys=lambda: [KEY]),
            clock=lambda: wins[-1].end,
            config=SimpleNamespace(controller=SimpleNamespace(collect_interval_s=10.0)),
        )
        line = _status_line(store, daemon, None, time.monotonic(), "phase")  # type: ignore[arg-type]

    surfaces = {
        "controller": (controller.alpha, controller.alpha_ci),
        "status": (status["alpha"], tuple(status["alpha_ci"]) if status["alpha_ci"] else None),
        "exporters": (
            gauges.get("spectuner_alpha"),
            (gauges.get("spectuner_alpha_lower"), gauges.get("spectuner_alpha_upper")),
        ),
        "report": (bucket.alpha, (bucket.alpha_lower, bucket.alpha_upper)),
    }
    for name, (alpha, ci) in surfaces.items():
        assert alpha is not None and ci is not None, name
        assert alpha == pytest.approx(expected.alpha, rel=1e-9, abs=1e-12), name
        assert ci == pytest.approx(expected.alpha_ci, rel=1e-9, abs=1e-12), name
        assert abs(alpha - naive) > 0.05, name

    # the demo shows the latest window's α̂ to two decimals: that window drafted 2 per step under K_max = 5
    latest = wins[-1].spec
    assert latest is not None and latest.draft_tokens / latest.drafts == 2.0
    one = alpha_of_windows([latest])
    assert one.alpha is not None and one.alpha_ci is not None
    assert estimate_alpha(latest).alpha != pytest.approx(one.alpha)  # read at K_max it would differ
    match = re.search(r"α̂=(\S+) \[(\S+),(\S+)\]", line)
    assert match is not None, line
    assert [float(x) for x in match.groups()] == [
        round(one.alpha, 2),
        round(one.alpha_ci[0], 2),
        round(one.alpha_ci[1], 2),
    ]
    assert "K/step=2.0" in line
    assert float(match.group(1)) == pytest.approx(expected.alpha, abs=0.02)  # the same α, one window's worth


def test_after_a_draft_swap_every_surface_reads_the_config_in_force(db_url: str) -> None:
    """Windows of two drafts inside the look-back: the controller, ``status`` and the exporters all report
    the α̂ of the draft now in force (the swap must not pool two drafts' acceptance)."""
    weak = SpecConfig("draft_model", "/drafts/weak", 3)
    good = SpecConfig("draft_model", "/drafts/good", 3)
    swap_at = T0 + timedelta(seconds=600)
    wins = [
        WindowRecord(
            key=KEY,
            start=T0 + timedelta(seconds=10 + 60 * i),
            end=T0 + timedelta(seconds=70 + 60 * i),
            spec=counters(3, 2000, 0.3 if i < 9 else 0.9, wobble=i),
            generation_tokens=6000.0,
        )
        for i in range(20)
    ]
    now = wins[-1].end + timedelta(seconds=1)
    after = [w.spec for w in wins if w.start >= swap_at and w.spec is not None]
    expected = alpha_of_windows(after, CONFIDENCE)
    pooled = alpha_of_windows([w.spec for w in wins if w.spec is not None], CONFIDENCE)
    assert expected.alpha is not None and pooled.alpha is not None and abs(expected.alpha - pooled.alpha) > 0.1
    look_back_s = (now - T0).total_seconds() + 60
    with Store(db_url) as store:
        store.record_config(KEY, EngineConfigRecord.of(weak, T0, AppliedBy.STARTUP))
        store.record_config(KEY, EngineConfigRecord.of(good, swap_at, AppliedBy.RESTART))
        store.write_windows(wins)
        stored = store.current_config(KEY)
        assert stored is not None and stored.config.spec == good
        controller = measure(store, [KEY], stored, now, look_back_s, CONFIDENCE).alpha
        [engine] = status_gather(store, now, look_back_s, 3600.0, URL)["engines"]
        source = StoreSource(store, metrics_url=URL, window_s=look_back_s, confidence=CONFIDENCE)
        [(engine_id, key)] = source.engines()
        gauges = {
            s.name: s.value
            for s in engine_samples(source.snapshot(engine_id, key, [engine_id], now), cost_ratio=0.05)
        }
    assert controller.alpha == pytest.approx(expected.alpha)
    assert engine["window"]["alpha"] == pytest.approx(expected.alpha)
    assert gauges["spectuner_alpha"] == pytest.approx(expected.alpha)
    assert engine["window"]["windows"] == 20  # throughput still covers every window of the look-back

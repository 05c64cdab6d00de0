"""Shared test doubles: the one fake clock, and decision contexts built from window counters.

:class:`FakeClock` stands in for every ``clock: Callable[[], datetime]`` seam (controller, collector,
alert dispatcher, exporters). :func:`make_context` builds a :class:`DecisionContext` the way
:func:`tuner.controller.context.build_context` does (α̂ by ``alpha_of_windows`` of the window counters,
the running candidate by ``current_candidate``, failed candidates by ``same_draft``), without a store,
so unit tests of the policy read exactly what the controller would hand it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from collectors.records import EngineKey
from policies.acceptance import AcceptanceEvidence, alpha_of_windows, effective_counters
from policies.counters import SpecCounters
from policies.draft_choice import DraftCandidate, SpecWindow
from policies.positional import PositionData
from policies.spec_config import SpecConfig
from tuner.controller.candidates import current_candidate, same_draft
from tuner.controller.context import DecisionContext

CLOCK_START = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
KEY = EngineKey("http://127.0.0.1:8000/metrics", "m", "0")


class FakeClock:
    """A callable clock returning an aware UTC datetime; ``advance`` moves it (and returns the new time).

    ``now`` may also be assigned directly (a test that wrote windows up to some time sets it there)."""

    def __init__(self, start: datetime = CLOCK_START) -> None:
        if start.tzinfo is None:
            raise ValueError("FakeClock needs an aware datetime")
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


def iid_counters(alpha: float, k: int, drafts: int, *, rounding: str = "round") -> SpecCounters:
    """Expected counts of ``drafts`` drafts of K tokens at per-token acceptance α (i.i.d.), with the
    engine's K recorded. ``rounding="floor"`` truncates each position's count instead."""
    cut = round if rounding == "round" else int
    per_pos = tuple(cut(drafts * alpha ** (i + 1)) for i in range(k))
    return SpecCounters(drafts, drafts * k, sum(per_pos), per_pos, num_spec_tokens=k)


def declining_counters(drafts: int, conditional: Sequence[float]) -> SpecCounters:
    """Counters of ``drafts`` drafts whose conditional acceptance at each position is ``conditional`` (K is
    its length), falling with position as an EAGLE head's or a lookup's does."""
    per_pos: list[int] = []
    reach = float(drafts)
    for c in conditional:
        reach *= c
        per_pos.append(round(reach))
    k = len(conditional)
    return SpecCounters(drafts, drafts * k, sum(per_pos), tuple(per_pos), num_spec_tokens=k)


def make_context(
    spec: SpecConfig | Mapping[str, Any],
    windows: Sequence[SpecCounters],
    *,
    now: datetime = NOW,
    key: EngineKey = KEY,
    config_id: int = 1,
    window_s: float = 20.0,
    rate: float = 100.0,
    batch: float | None = 1.0,
    candidates: Sequence[DraftCandidate] = (),
    history: Mapping[str, AcceptanceEvidence] | None = None,
    failed: Sequence[SpecConfig | Mapping[str, Any]] = (),
    cost_ratio: float | None = 0.05,
    confidence: float = 0.95,
    load_profile: tuple[tuple[float, float], ...] = (),
) -> DecisionContext:
    """A context for a config that ran ``windows`` back to back (each ``window_s`` long, ending at ``now``,
    generating ``rate`` tokens/s at ``batch`` requests running).

    As :func:`~tuner.controller.context.build_context`: α̂ is ``alpha_of_windows`` of the window
    counters; ``running`` is the candidate the engine runs (``current_candidate``); ``candidates``
    (every candidate, the running one included), ``trigger_windows``, ``history`` and
    ``failed_candidates`` are only set when candidates are configured (swapping on)."""
    current = spec if isinstance(spec, SpecConfig) else SpecConfig.from_vllm(spec)
    failed_configs = tuple(f if isinstance(f, SpecConfig) else SpecConfig.from_vllm(f) for f in failed)
    start = now - timedelta(seconds=len(windows) * window_s)
    spec_windows = tuple(
        SpecWindow(start + timedelta(seconds=i * window_s), start + timedelta(seconds=(i + 1) * window_s), c)
        for i, c in enumerate(windows)
    )
    total = SpecCounters()
    for c in windows:
        total = total + c
    running, everyone = current_candidate(current, candidates, cost_ratio)
    # as context.measure pools them
    positions = PositionData.from_windows(e for e in (effective_counters(c) for c in windows) if e is not None)
    ctx = DecisionContext(
        now=now,
        keys=(key,),
        config_id=config_id,
        current=current,
        spec=total,
        alpha=alpha_of_windows(list(windows), confidence),
        windows=len(windows),
        positions=positions,
        duration_s=len(windows) * window_s,
        generation_tokens=rate * len(windows) * window_s,
        window_rates=tuple(rate for _ in windows),
        window_batches=tuple(batch for _ in windows),
        mean_batch_size=batch,
        batch_profile=tuple((window_s, batch) for _ in windows) if batch is not None else (),
        load_profile=load_profile,
        running=running,
        failed=failed_configs,
    )
    if not candidates:
        return ctx
    return replace(
        ctx,
        candidates=tuple(everyone),
        trigger_windows=spec_windows,
        history=dict(history or {}),
        failed_candidates=frozenset(c.name for c in everyone if any(same_draft(f, c) for f in failed_configs)),
    )


__all__ = ["CLOCK_START", "KEY", "NOW", "FakeClock", "iid_counters", "make_context"]

"""Non-stationarity, part 1: old evidence counts less (exponential forgetting) or not at all (windows).

Purely computational. Evidence (S, F) from a window that ended ``age`` seconds before ``now`` is
weighted 2^(−age / half_life_s); the Beta interval of the discounted counts is then as wide as the
effective amount of recent data warrants. A sliding window keeps only windows that ended within
``window_s`` of ``now``. Windows that end after ``now`` are a clock error and are refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from policies.acceptance import AcceptanceEvidence


@dataclass(frozen=True)
class TimedEvidence:
    """One window's evidence and the time it ended."""

    end: datetime
    evidence: AcceptanceEvidence


def _age_s(item: TimedEvidence, now: datetime) -> float:
    age = (now - item.end).total_seconds()
    if age < 0:
        raise ValueError(f"a window ends at {item.end.isoformat()}, after now = {now.isoformat()}: check the clocks")
    return age


def discounted_evidence(windows: Sequence[TimedEvidence], now: datetime, half_life_s: float) -> AcceptanceEvidence:
    """Σ 2^(−age/half_life_s)·evidence. Purely computational."""
    if not (math.isfinite(half_life_s) and half_life_s > 0):
        raise ValueError(f"half-life must be a positive number of seconds but got {half_life_s!r}")
    total = AcceptanceEvidence()
    for item in windows:
        total = total + item.evidence.scaled(math.exp2(-_age_s(item, now) / half_life_s))
    return total


def windowed_evidence(windows: Sequence[TimedEvidence], now: datetime, window_s: float) -> AcceptanceEvidence:
    """Evidence of windows that ended within the last ``window_s`` seconds."""
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window must be a positive number of seconds but got {window_s!r}")
    total = AcceptanceEvidence()
    for item in windows:
        if _age_s(item, now) <= window_s:
            total = total + item.evidence
    return total

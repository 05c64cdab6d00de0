"""Which load one K is chosen for: the whole load horizon, or the current load regime once it is sustained.

Purely computational: ``choose_load_window(tracker, now, horizon_s, sustained_s) -> LoadWindow``.

One K must serve whatever load comes, so the controller scores every K over the load profile (requests
running + waiting per window, weighted by time) of the last ``load_horizon_s``: a 5-minute burst barely
moves an hour's profile, so it is not chased. But a load that steps and *stays* is followed only as the
horizon fills with it (a rise from 16 to 128 requests: 20 minutes; the fall back: an hour).

The load is tracked as regimes (:class:`policies.regime.RegimeTracker` over the requests of the last
decide interval, band ``max(1 request, rel_band × level)``). Once the current regime, whose beginning
was seen, is ``sustained_s`` old, K is chosen for the load since it began; before that, and for the
first regime (its beginning was not seen), over the whole horizon. A sustained change is then followed
within ``sustained_s`` plus the hysteresis ticks, a burst shorter than ``sustained_s`` is judged on the
horizon as before, and the window's regime length goes to the switching-cost rail: a restart answering a
load regime must repay within its expected remaining length (the engine's own history of load regimes
of that direction, :func:`policies.regime.remaining_s`), so a burst that outlived ``sustained_s`` but is
no longer than the bursts on record still does not restart the engine, and one older than every burst
on record does only once it has outlived the restart's payback (Lindy: it is expected to last as long
again as it has lasted). With no load regime of that direction on record the remaining length is unknown
and the fixed ``payback_horizon_s`` applies: a sustained change is followed within ``sustained_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from policies.regime import RegimeTracker, remaining_s

LOAD_ABS_BAND = 1.0  # requests: at a low load one request more or less (1 ↔ 2 running) is not a new regime


def load_tracker(rel_band: float) -> RegimeTracker:
    """A fresh tracker of the load (requests running + waiting), band ``max(1, rel_band × level)``. One
    load regime of a direction on record is history enough (``min_history = 1``): K follows a sustained
    load within ``sustained_s``, so without it every burst that outlives ``sustained_s`` (two bursts a
    minute apart read as one) would restart the engine until three were on record."""
    return RegimeTracker(LOAD_ABS_BAND, rel_band, min_history=1)


@dataclass(frozen=True)
class LoadWindow:
    """The load K is chosen for, and why."""

    since: datetime  # K is scored over the load of the windows that ended after this
    regime: bool  # True: the current load regime's (sustained); False: the whole load horizon
    remaining_s: float | None  # expected remaining length of that regime (switching cost); None: unknown
    message: str

    def to_json(self) -> dict[str, object]:
        return {
            "since": self.since.isoformat(),
            "regime": self.regime,
            "remaining_s": self.remaining_s,
            "message": self.message,
        }


def choose_load_window(tracker: RegimeTracker, now: datetime, horizon_s: float, sustained_s: float) -> LoadWindow:
    """The current load regime's window when it is at least ``sustained_s`` old (and younger than the
    horizon), else the whole ``horizon_s`` (see the module doc)."""
    horizon = LoadWindow(now - timedelta(seconds=horizon_s), False, None, f"Load of the last {horizon_s:.0f} s.")
    if tracker.direction == 0 or tracker.started is None or tracker.level is None:
        return horizon  # no shift seen since the controller started (or our own restart began the regime)
    age = tracker.age_s(now)
    moved = "rose" if tracker.direction > 0 else "fell"
    if age < sustained_s:
        return LoadWindow(
            horizon.since,
            False,
            None,
            f"The load {moved} to ~{tracker.level:.0f} requests {age:.0f} s ago, not sustained yet "
            f"({sustained_s:.0f} s): load of the last {horizon_s:.0f} s.",
        )
    if age >= horizon_s:
        return horizon  # the regime fills the horizon: the same load either way
    remaining = remaining_s(tracker, now)
    return LoadWindow(
        tracker.started,
        True,
        remaining if math.isfinite(remaining) else None,
        f"The load {moved} to ~{tracker.level:.0f} requests {age:.0f} s ago and stayed: K is chosen for the "
        f"load since then, not the last {horizon_s:.0f} s"
        + (f"; expected to last another {remaining:.0f} s." if math.isfinite(remaining) else "."),
    )


__all__ = ["LOAD_ABS_BAND", "LoadWindow", "choose_load_window", "load_tracker"]

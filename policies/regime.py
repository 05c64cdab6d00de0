"""How long regimes last on this engine, and how long the current one is expected to go on.

Purely computational: ``observe(tracker, now, value, noise) -> tracker``, ``remaining_s(tracker, now)``, and
``basis(tracker, now, quantity)``, what that estimate went by in words.

A regime is a stretch in which a measured quantity (acceptance α̂ of the running draft, or the load:
requests running plus waiting) stays within a band around its level: ``abs_band`` or ``rel_band`` × the
level, whichever is wider, or the observation's own noise or the regime's own scatter when wider still (a
scatter sampling explains is not a new regime). ``confirm`` observations in a row outside the band, on the
same side of it, start a new regime at the first of them (one noisy tick does not, nor a tick above and
one below), and the length of the regime that ended is kept.

A change to the engine pays back only if the regime it answers lasts longer than its payback time
(switching cost / gain). The expected remaining length of the current regime, at age a, is the median
of L − a over the recorded regimes of the same direction (a fall is compared with past falls — dips —,
a rise with past rises) that lasted longer than a (what the engine's own history says about regimes of
that age); when fewer than ``min_history`` recorded lasted that long it is a itself (a regime that has
lasted a is about as likely to last another a: Lindy) — one regime that ended 10 s after this age would
otherwise say 10 s, while one more second of age, past it, would say the age again. With fewer than
``min_history`` regimes of that direction recorded the history says nothing yet: the remaining length
is unknown (infinite here; the caller's fixed horizon applies — Lindy on a young regime with no history
would hold back every change, bursts' aftermath included, for its payback time). So once a few 3-minute
dips are on record, a dip never repays a change that needs 10 minutes, while a sustained change is
followed once its age exceeds the payback.

A regime whose beginning was not observed — the first one (the traffic was there before the controller
looked), or one the engine's own change began (:func:`restart`) — has no age to go by: its remaining
length is unknown (infinite here; the caller's fixed horizon applies). Taking the time since the
controller started as its age would block every change for the first payback time after a start.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from datetime import datetime

MAX_HISTORY = 64  # regime lengths kept (the newest)
# For a sampled quantity (α̂): an observation further from the level than this many standard deviations
# of the current regime's own observations (once it has SCATTER_MIN of them) is outside: 99 % of an
# unchanged regime's stay inside, and two in a row (``confirm``) outside by chance come about once in
# 6 500 ticks (9 hours of 5-s ticks).
SAMPLED_SCATTER_Z = 2.5
SCATTER_MIN = 5


@dataclass(frozen=True)
class RegimeTracker:
    """One quantity's regimes. Start with ``RegimeTracker(abs_band, rel_band)``; a value, not a state
    machine with hidden parts: each :func:`observe` returns the next one."""

    abs_band: float
    rel_band: float = 0.0
    confirm: int = 2
    min_history: int = 3
    # > 0 for a sampled quantity (SAMPLED_SCATTER_Z): its own scatter widens the band, and a run outside
    # that ends without a new regime is folded into it. 0 for one measured exactly (the load: requests
    # running), whose every move is real — folded in, a burst's ramp made its regime's scatter wide enough
    # to hold the fall after it (gpu_bursty: a 5-minute burst "lasted" 4.4 hours)
    scatter_z: float = 0.0
    started: datetime | None = None
    level: float | None = None  # mean of the observations of the current regime
    count: int = 0
    m2: float = 0.0  # sum of squared deviations of the current regime's observations from ``level``
    last_scatter: float = 0.0  # the previous regime's: the measurement's noise did not change with the level
    outside: tuple[tuple[datetime, float], ...] = ()  # consecutive observations outside the band
    lengths_s: tuple[float, ...] = ()  # regimes that ended, oldest first
    directions: tuple[int, ...] = ()  # aligned with lengths_s: +1 rose from its predecessor, −1 fell, 0 first
    direction: int = 0  # the current regime's
    # the level of the regime before the current one (None: none ended yet): where a rise came from, the
    # load a change that serves only the current one will have to be undone at
    previous_level: float | None = None

    def __post_init__(self) -> None:
        if self.abs_band < 0 or self.rel_band < 0 or self.confirm < 1 or self.min_history < 1 or self.scatter_z < 0:
            raise ValueError(
                f"regime tracker: bands ≥ 0, confirm ≥ 1, min_history ≥ 1, scatter_z ≥ 0; got {self.abs_band}, "
                f"{self.rel_band}, {self.confirm}, {self.min_history}, {self.scatter_z}"
            )

    def band(self) -> float:
        return max(self.abs_band, self.rel_band * abs(self.level or 0.0))

    def scatter(self) -> float:
        """Standard deviation of the current regime's observations; the previous regime's until this one
        has ``SCATTER_MIN`` (a fresh regime of two observations would otherwise read every scatter as a
        move again, and again)."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count >= SCATTER_MIN else self.last_scatter

    def threshold(self, noise: float = 0.0) -> float:
        """How far from the level an observation must be to count as outside."""
        return max(self.band(), noise if math.isfinite(noise) else 0.0, self.scatter_z * self.scatter())

    def age_s(self, now: datetime) -> float:
        return max((now - self.started).total_seconds(), 0.0) if self.started is not None else 0.0


def observe(tracker: RegimeTracker, now: datetime, value: float | None, noise: float = 0.0) -> RegimeTracker:
    """The tracker after one observation (None or not finite: nothing measured, nothing changes).

    ``noise``: the observation's own sampling uncertainty (the half-width of its interval, in the value's
    units). A value counts as outside only when it is further from the level than the band, its noise and
    ``scatter_z`` × the scatter of the regime's observations so far (:meth:`RegimeTracker.threshold`): at one
    stream five seconds' α̂ scatters ±0.05–0.1 around an unchanged acceptance (one or two requests, each
    with its own prompt), and a fixed band read that scatter as the traffic moving every few minutes (the
    simulator's lab_phases: 4 moves in 3 minutes of one prompt mix, each discounting the candidates'
    shadow measurements as taken on other traffic)."""
    if value is None or not math.isfinite(value):
        return tracker
    if tracker.level is None or tracker.started is None:
        return replace(tracker, started=now, level=value, count=1, m2=0.0, outside=())
    # a run outside that ended without a new regime was this one's scatter (sampled quantities)
    ended_run = [v for _, v in tracker.outside] if tracker.scatter_z > 0 else []
    if abs(value - tracker.level) <= tracker.threshold(noise):
        return replace(_fold(tracker, [*ended_run, value]), outside=())
    if tracker.outside and (tracker.outside[0][1] > tracker.level) != (value > tracker.level):
        # outside on the other side: not a level that moved; a new run begins
        return replace(_fold(tracker, ended_run), outside=((now, value),))
    outside = (*tracker.outside, (now, value))
    if len(outside) < tracker.confirm:
        return replace(tracker, outside=outside)
    begun = outside[0][0]
    ended = max((begun - tracker.started).total_seconds(), 0.0)
    values = [v for _, v in outside]
    level = sum(values) / len(values)
    return replace(
        tracker,
        started=begun,
        level=level,
        count=len(values),
        m2=sum((v - level) ** 2 for v in values),
        last_scatter=tracker.scatter(),
        outside=(),
        lengths_s=(*tracker.lengths_s, ended)[-MAX_HISTORY:],
        directions=(*tracker.directions, tracker.direction)[-MAX_HISTORY:],
        direction=1 if level > tracker.level else -1,
        previous_level=tracker.level,
    )


def _fold(tracker: RegimeTracker, values: list[float]) -> RegimeTracker:
    """The current regime with ``values`` added to its mean and scatter (Welford)."""
    level, n, m2 = tracker.level or 0.0, tracker.count, tracker.m2
    for v in values:
        n += 1
        step = v - level
        level += step / n
        m2 += step * (v - level)
    return replace(tracker, level=level, count=n, m2=m2)


def restart(tracker: RegimeTracker, now: datetime) -> RegimeTracker:
    """A new regime that the engine's own change began (another draft is another α): nothing ended, so
    no length is recorded; the history is kept (the previous level was another draft's: dropped)."""
    return replace(tracker, started=now, level=None, count=0, m2=0.0, outside=(), direction=0, previous_level=None)


def _history(tracker: RegimeTracker, now: datetime) -> tuple[int, list[float]]:
    """Regimes of the current one's direction on record, and by how much those that outlived its age did."""
    age = tracker.age_s(now)
    same = [length for length, d in zip(tracker.lengths_s, tracker.directions, strict=True) if d == tracker.direction]
    return len(same), [length - age for length in same if length > age]


def remaining_s(tracker: RegimeTracker, now: datetime) -> float:
    """Expected remaining length of the current regime (see the module doc), in seconds; ``math.inf``
    when its beginning was not observed."""
    if tracker.direction == 0:
        return math.inf
    recorded, longer = _history(tracker, now)
    if recorded < tracker.min_history:
        return math.inf  # too few regimes like this one recorded: the engine's history says nothing yet
    if len(longer) >= tracker.min_history:
        return float(statistics.median(longer))
    # Too few lasted this long to say how much longer such a regime goes on: one that ended 10 s later
    # would say 10 s, and none would say the age. Lindy, as if none had.
    return tracker.age_s(now)


def left_band(tracker: RegimeTracker, quantity: str) -> str | None:
    """When the last observation left the current regime's band (the next confirms a new regime or folds
    it back), what that means in words; else None. The regime may be ending now: a change that pays only
    over its remaining length should wait a tick — at the end of a 20-minute load regime no regime on record
    had lasted longer, Lindy said 20 minutes more, and the simulator's lab_gpu_like dropped the draft for
    plain decoding one tick after the load had fallen 64 → 4."""
    if not tracker.outside or tracker.level is None:
        return None
    return (
        f"the {quantity} left its regime's band ({tracker.level:.3g} ± {tracker.threshold():.3g}) at the last "
        f"observation ({tracker.outside[-1][1]:.3g}): the regime may be ending"
    )


def basis(tracker: RegimeTracker, now: datetime, quantity: str) -> str:
    """What :func:`remaining_s` went by, in words: ``quantity`` ("acceptance", "load") moved how long ago,
    and what the regimes of that direction on record say (so an operator can tell a 10-s estimate from
    one earlier regime apart from one from many)."""
    if tracker.direction == 0:
        return f"the {quantity} regime began with our own change or before the controller looked"
    moved, noun = ("rose", "rises") if tracker.direction > 0 else ("fell", "falls")
    recorded, longer = _history(tracker, now)
    head = f"the {quantity} {moved} {tracker.age_s(now):.0f} s ago"
    if recorded < tracker.min_history:
        return f"{head}; {recorded} earlier {noun} on record, {tracker.min_history} needed"
    if len(longer) >= tracker.min_history:
        return (
            f"{head}; {len(longer)} of {recorded} earlier {noun} lasted longer, "
            f"by {statistics.median(longer):.0f} s (median)"
        )
    few = f"only {len(longer)}" if longer else "none"
    return f"{head}; {few} of {recorded} earlier {noun} lasted that long: expected to last as long again"


__all__ = ["MAX_HISTORY", "RegimeTracker", "basis", "left_band", "observe", "remaining_s", "restart"]

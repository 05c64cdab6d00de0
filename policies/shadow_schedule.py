"""When to replay the traffic record through the draft candidates again. Pure.

A shadow replay costs the host minutes of CPU (the live benchmark's lab: ~13 CPU-s per run of four
candidates on 48 samples, every 90 s — ~7 % of a 2-core machine the engine shares). Run on a fixed
clock it mostly re-measures what the last run said. So:

- a run whose every candidate's interval overlaps the one the previous run gave it (or whose α̂ is within
  ``AGREE_ALPHA`` of it) learned nothing: the next waits twice as long, up to ``max_interval_s``;
- any other outcome — a candidate moved, appeared or vanished — brings the wait back to ``interval_s``;
- the traffic moving (the controller's acceptance regime changed since the last run began) or another
  set of candidates makes a run due at once, whatever the wait: that is when a ranking can change;
- and every run, whatever made it due, stays inside a CPU budget: the replays take at most
  ``machine_share`` of the host over time (a token bucket of machine-seconds, filled at that rate and
  holding ``BURST_RUNS`` runs, each charged what it measured). On the 2-core lab a run costs ~6.5
  machine-seconds, so at 0.02 one runs every ~5 min on average, a burst of two when the traffic moves after
  a quiet spell; a replay's CPU there slows the engine it shares the cores with, and a clock of 90 s cost
  the simulated lab 7 % of its goodput for rankings it already had. On a many-core GPU host the same share
  is many cores and never binds.

A value, not a state machine: :func:`shadow_due` reads a :class:`ShadowSchedule`, :func:`after_run`
returns the next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

DEFAULT_BACKOFF = 4.0
"""``max_interval_s`` when the operator sets none: this many times ``interval_s`` (agreeing runs come a
quarter as often; the traffic moving still runs one at once)."""

BURST_RUNS = 2.0
"""The budget's bucket holds this many runs (of the last run's cost): two replays in a row when the traffic
moves after a quiet spell, then the average rate."""

Interval = tuple[float, float, float]
"""A candidate's α̂ and its interval (lo, hi)."""


@dataclass(frozen=True)
class ShadowSchedule:
    interval_s: float  # the configured wait between runs (``[shadow] evaluate_interval_s``)
    max_interval_s: float  # the longest wait while runs agree (``[shadow] evaluate_interval_max_s``)
    wait_s: float | None = None  # the current wait (None: interval_s)
    last_run: datetime | None = None  # when the last run began
    results: Mapping[str, Interval | None] = field(default_factory=dict)  # the last run's, per candidate
    machine_share: float = 0.0  # the most of the host the replays take over time; 0: no budget
    cost_s: float | None = None  # the last run's cost, machine-seconds (its CPU-s ÷ the host's CPUs)
    credit_s: float | None = None  # the budget's machine-seconds left at credit_at (None: a full bucket)
    credit_at: datetime | None = None

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.max_interval_s >= self.interval_s):
            raise ValueError(
                f"shadow schedule: 0 < interval_s ≤ max_interval_s; got {self.interval_s}, {self.max_interval_s}"
            )
        if not 0.0 <= self.machine_share < 1.0:
            raise ValueError(f"shadow schedule: 0 ≤ machine_share < 1; got {self.machine_share}")

    @classmethod
    def configured(
        cls, interval_s: float, max_interval_s: float | None, machine_share: float = 0.0
    ) -> ShadowSchedule:
        """From the operator's settings: an unset cap is ``DEFAULT_BACKOFF`` × the interval, a cap below
        the interval is the interval; ``machine_share`` is ``[shadow] max_machine_share``."""
        longest = DEFAULT_BACKOFF * interval_s if max_interval_s is None else max(interval_s, max_interval_s)
        return cls(interval_s, longest, machine_share=machine_share)

    @property
    def current_wait_s(self) -> float:
        return self.interval_s if self.wait_s is None else self.wait_s

    def credit(self, now: datetime) -> float | None:
        """The budget's machine-seconds at ``now``; None where it does not bind (no budget, no run measured)."""
        if self.machine_share <= 0 or self.cost_s is None:
            return None
        full = BURST_RUNS * self.cost_s
        if self.credit_s is None or self.credit_at is None:
            return full
        elapsed = max((now - self.credit_at).total_seconds(), 0.0)
        return min(full, self.credit_s + self.machine_share * elapsed)

    def budget_allows_at(self, now: datetime) -> datetime | None:
        """When the budget holds the cost of another run (None: now)."""
        credit = self.credit(now)
        if credit is None or self.cost_s is None or credit >= self.cost_s - 1e-9:
            return None
        return now + timedelta(seconds=(self.cost_s - credit) / self.machine_share)


@dataclass(frozen=True)
class ShadowDue:
    due: bool
    reason: str


def shadow_due(
    schedule: ShadowSchedule, now: datetime, candidates: Iterable[str], traffic_moved_at: datetime | None
) -> ShadowDue:
    """Whether a replay should run at ``now``, and why (or why not)."""
    if schedule.last_run is None:
        return ShadowDue(True, "no replay yet")
    allowed_at = schedule.budget_allows_at(now)
    if allowed_at is not None:
        return ShadowDue(
            False,
            f"the replays' CPU budget ([shadow] max_machine_share = {schedule.machine_share:g} of the host; the "
            f"last run took {schedule.cost_s or 0.0:.1f} machine-s) allows the next at {allowed_at:%H:%M:%S}",
        )
    names = set(candidates)
    if names != set(schedule.results):
        return ShadowDue(True, "the candidates changed since the last replay")
    if traffic_moved_at is not None and traffic_moved_at > schedule.last_run:
        return ShadowDue(True, f"the acceptance moved with the traffic at {traffic_moved_at:%H:%M:%S}, after the "
                               "last replay began")
    next_at = schedule.last_run + timedelta(seconds=schedule.current_wait_s)
    if now >= next_at:
        return ShadowDue(True, f"{schedule.current_wait_s:.0f} s since the last replay")
    return ShadowDue(
        False,
        f"the last replays agreed and the traffic has not moved: next at {next_at:%H:%M:%S} "
        f"(waiting {schedule.current_wait_s:.0f} s, up to {schedule.max_interval_s:.0f} s)",
    )


AGREE_ALPHA = 0.02
"""α̂ this close to the last run's agree with it whatever the intervals: replays of a few dozen samples
scatter more than their binomial intervals say (the prompt mix; the live benchmark's good draft read 0.986,
0.977, 0.983 on consecutive 48-sample runs of one phase, intervals ±0.006)."""


def _agree(old: Interval | None, new: Interval | None) -> bool:
    if old is None or new is None:
        return old is None and new is None  # a candidate still skipped (no tokenizer match, no samples)
    overlap = old[1] <= new[2] and new[1] <= old[2]
    return overlap or abs(new[0] - old[0]) <= AGREE_ALPHA


def after_run(
    schedule: ShadowSchedule,
    began: datetime,
    results: Mapping[str, Interval | None],
    cost_s: float | None = None,
) -> ShadowSchedule:
    """The schedule after a run that began at ``began``, measured ``results`` and cost ``cost_s``
    machine-seconds (its CPU-s ÷ the host's CPUs; None: not measured, the budget keeps the last cost)."""
    same = (
        schedule.last_run is not None
        and set(results) == set(schedule.results)
        and all(_agree(schedule.results[name], value) for name, value in results.items())
    )
    wait = min(2.0 * schedule.current_wait_s, schedule.max_interval_s) if same and results else schedule.interval_s
    after = replace(schedule, wait_s=wait, last_run=began, results=dict(results))
    if cost_s is None or cost_s < 0:
        return after
    # the bucket as the run began, before this run's cost was known: a first run finds it full
    before = schedule.credit(began)
    credit = (BURST_RUNS * cost_s if before is None else before) - cost_s
    return replace(after, cost_s=cost_s, credit_s=credit, credit_at=began)

"""Non-stationarity, part 2: a change detector that says when α moved, at a configured false-alarm rate.

Purely computational: ``update_change_detector(state, window, now, config) -> (decision, new state)``.

Two one-sided CUSUMs run on each window's log-likelihood ratio of "α moved by ``shift``" against
"α is still the reference α₀":

    z = S·log(α₁/α₀) + F·log((1 − α₁)/(1 − α₀)),   C ← max(0, C + z / φ),   alarm when C > h.

With likelihood-ratio increments the in-control average run length is at least e^h windows (Lorden
1971), so h = log(2·ARL₀) per side bounds the two-sided false-alarm rate by the configured one (the
measured rate, in bench/, is lower: the bound is conservative). α₀ is estimated from the windows since
the last alarm, and detection waits until that reference has ``min_reference_trials`` and
``min_reference_windows``. φ (over-dispersion, ≥ 1) shrinks the increments of correlated data, which would
otherwise alarm far too often: it is estimated from the reference's own windows
(:class:`policies.dispersion.DispersionSums`, Pearson's statistic between windows), never below the
configured ``dispersion``.
After an alarm the evidence gathered since the CUSUM left zero becomes the new reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum

from policies.acceptance import AcceptanceEvidence
from policies.dispersion import MIN_WINDOWS, DispersionSums


@dataclass(frozen=True)
class ChangeDetectorConfig:
    """How sensitive the detector is, and how often it may cry wolf."""

    window_s: float
    """Seconds between updates (one window per update): converts the rate into windows."""
    false_alarms_per_day: float = 1.0
    """Tolerated false alarms per day of a stationary α (an upper bound; measured lower)."""
    shift: float = 0.1
    """Smallest absolute change of α worth reacting to: a K decision rarely moves for less."""
    min_reference_trials: float = 2000.0
    """Checked tokens in the reference before alarms are allowed (±0.02 on α at α ≈ 0.6)."""
    dispersion: float = 1.0
    """Least over-dispersion φ ≥ 1 of the windows (1: binomial sampling alone); the reference's
    measured φ is used when larger."""
    min_reference_windows: int = 3 * MIN_WINDOWS
    """Windows in the reference before alarms are allowed (what φ is estimated from)."""

    def __post_init__(self) -> None:
        checks = (
            ("window_s", self.window_s > 0),
            ("false_alarms_per_day", self.false_alarms_per_day > 0),
            ("shift", 0 < self.shift < 1),
            ("min_reference_trials", self.min_reference_trials >= 0),
            ("dispersion", self.dispersion >= 1),
            ("min_reference_windows", self.min_reference_windows >= 0),
        )
        for name, ok in checks:
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise ValueError(f"change detector {name} is out of range: got {value!r}")

    @property
    def in_control_run_length_windows(self) -> float:
        """ARL₀: windows between false alarms when nothing changes."""
        return 86400.0 / (self.false_alarms_per_day * self.window_s)

    @property
    def threshold(self) -> float:
        """h per side: two sides at ARL 2·ARL₀ each give a combined ARL ≥ ARL₀."""
        return math.log(2.0 * max(self.in_control_run_length_windows, 1.0))


@dataclass(frozen=True)
class ChangeDetectorState:
    """Everything the detector remembers between windows. Start with ``ChangeDetectorState()``."""

    reference: AcceptanceEvidence = field(default_factory=AcceptanceEvidence)
    spread: DispersionSums = field(default_factory=DispersionSums)  # the reference's windows (φ)
    up: float = 0.0
    down: float = 0.0
    up_since: AcceptanceEvidence = field(default_factory=AcceptanceEvidence)
    down_since: AcceptanceEvidence = field(default_factory=AcceptanceEvidence)
    up_start: datetime | None = None
    down_start: datetime | None = None
    windows: int = 0
    last_alarm: datetime | None = None


class ChangeReason(StrEnum):
    WARMING_UP = "warming_up"  # reference too small to test against
    STABLE = "stable"
    ALPHA_ROSE = "alpha_rose"
    ALPHA_FELL = "alpha_fell"


@dataclass(frozen=True)
class ChangeDecision:
    reason: ChangeReason
    message: str
    alpha_reference: float | None
    alpha_recent: float | None  # since the CUSUM left zero (the new regime after an alarm)
    change_started: datetime | None
    statistic_up: float
    statistic_down: float
    threshold: float

    @property
    def changed(self) -> bool:
        return self.reason in (ChangeReason.ALPHA_ROSE, ChangeReason.ALPHA_FELL)


_EPS = 1e-4  # keeps α₀ ± shift a valid probability


def update_change_detector(
    state: ChangeDetectorState, window: AcceptanceEvidence, now: datetime, config: ChangeDetectorConfig
) -> tuple[ChangeDecision, ChangeDetectorState]:
    """Feed one window; get the decision and the next state. Purely computational."""
    h = config.threshold
    ref = state.reference
    spread = state.spread.add(window.successes, window.trials)
    warming = state.spread.windows < config.min_reference_windows
    if ref.trials < config.min_reference_trials or ref.trials <= 0 or warming:
        new = replace(state, reference=ref + window, spread=spread, windows=state.windows + 1)
        alpha_ref = ref.successes / ref.trials if ref.trials > 0 else None
        return (
            ChangeDecision(
                ChangeReason.WARMING_UP,
                f"Collecting a reference: {new.reference.trials:.0f} of "
                f"{config.min_reference_trials:.0f} checked tokens, {new.spread.windows} of "
                f"{config.min_reference_windows} windows.",
                alpha_ref,
                None,
                None,
                0.0,
                0.0,
                h,
            ),
            new,
        )
    a0 = min(max(ref.successes / ref.trials, _EPS), 1 - _EPS)
    up_alt = min(a0 + config.shift, 1 - _EPS)
    down_alt = max(a0 - config.shift, _EPS)
    phi = max(config.dispersion, state.spread.phi)
    z_up = _llr(window, a0, up_alt) / phi
    z_down = _llr(window, a0, down_alt) / phi
    up, up_since, up_start = _step(state.up, z_up, state.up_since, state.up_start, window, now)
    down, down_since, down_start = _step(state.down, z_down, state.down_since, state.down_start, window, now)
    fired = None
    if up > h and up - h >= down - h:
        fired = (ChangeReason.ALPHA_ROSE, up_since, up_start)
    elif down > h:
        fired = (ChangeReason.ALPHA_FELL, down_since, down_start)
    if fired is None:
        nxt = ChangeDetectorState(
            reference=ref + window,
            spread=spread,
            up=up,
            down=down,
            up_since=up_since,
            down_since=down_since,
            up_start=up_start,
            down_start=down_start,
            windows=state.windows + 1,
            last_alarm=state.last_alarm,
        )
        return (
            ChangeDecision(
                ChangeReason.STABLE,
                f"α stable at {a0:.3f} (CUSUM up {up:.2f}, down {down:.2f}, threshold {h:.2f}, φ {phi:.1f}).",
                a0,
                None,
                None,
                up,
                down,
                h,
            ),
            nxt,
        )
    reason, since, start = fired
    recent = since.successes / since.trials if since.trials > 0 else None
    verb = "rose" if reason is ChangeReason.ALPHA_ROSE else "fell"
    shown = f"{recent:.3f}" if recent is not None else "?"
    when = start.isoformat() if start is not None else "?"
    decision = ChangeDecision(
        reason,
        f"α {verb} from {a0:.3f} to about {shown} (change began near {when}); estimates restart from there.",
        a0,
        recent,
        start,
        up,
        down,
        h,
    )
    # The post-change evidence becomes the reference; both sides restart.
    return decision, ChangeDetectorState(reference=since, windows=state.windows + 1, last_alarm=now)


def _llr(window: AcceptanceEvidence, a0: float, a1: float) -> float:
    return window.successes * math.log(a1 / a0) + window.failures * math.log((1 - a1) / (1 - a0))


def _step(
    stat: float,
    z: float,
    since: AcceptanceEvidence,
    start: datetime | None,
    window: AcceptanceEvidence,
    now: datetime,
) -> tuple[float, AcceptanceEvidence, datetime | None]:
    new = stat + z
    if new <= 0:
        return 0.0, AcceptanceEvidence(), None
    if stat <= 0:  # the statistic leaves zero here: a change may have started with this window
        return new, window, now
    return new, since + window, start

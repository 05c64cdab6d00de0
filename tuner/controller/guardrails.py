"""Safety rails between a policy's proposal and the actuator. Purely computational, no side effects.

Each rail is a pure function of (settings, state, proposal, now) that returns ``None`` to let the
change through or a :class:`Block` naming why not. :func:`check_guardrails` runs them in a fixed,
visible order — the cheapest, most fundamental first — and returns the first block:

    paused → pending verification → known bad → evidence → gain (hysteresis on size) → streak (hysteresis in time)
    → cooldown → changes per hour → switching cost → maintenance window

Nothing here reads the clock: ``now`` is always passed in. The settings are the config file's
``[guardrails]`` section as it is (:class:`tuner.config.GuardrailsSection`: units and defaults there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from statistics import NormalDist

from tuner.config import GuardrailsSection, MaintenanceWindow


class BlockReason(StrEnum):
    PAUSED = "paused"
    PENDING_VERIFICATION = "pending_verification"
    CANARY_ELSEWHERE = "canary_elsewhere"
    KNOWN_BAD = "known_bad"
    INSUFFICIENT_EVIDENCE = "insufficient_evidence"
    GAIN_TOO_SMALL = "gain_too_small"
    NOT_PERSISTENT = "not_persistent"
    COOLDOWN = "cooldown"
    TOO_MANY_CHANGES = "too_many_changes"
    SWITCHING_COST = "switching_cost"
    OUTSIDE_MAINTENANCE_WINDOW = "outside_maintenance_window"


@dataclass(frozen=True)
class Block:
    reason: BlockReason
    message: str


@dataclass(frozen=True)
class ControllerState:
    """What the rails need to know about the past; rebuilt from the database on every tick."""

    paused: bool = False
    pending_verification: bool = False
    canary_elsewhere: str | None = None  # another replica's canary in flight (this one is its baseline)
    change_times: tuple[datetime, ...] = ()  # when configs we applied took effect, any order
    streak_target: str | None = None  # the last proposal's streak key (Proposal.streak_target)
    streak_count: int = 0  # how many decisions in a row proposed it, before this one
    failed_targets: frozenset[str] = frozenset()  # fingerprints that failed or regressed recently

    @property
    def last_change_at(self) -> datetime | None:
        return max(self.change_times) if self.change_times else None


@dataclass(frozen=True)
class Proposal:
    """A change the policy wants, with the evidence behind it."""

    target: str  # fingerprint of the proposed config (for the streak)
    predicted_gain: float  # goodput(new) / goodput(current)
    predicted_gain_ci: tuple[float, float]
    drafts: int  # evidence behind the estimate
    evidence_s: float
    needs_restart: bool = True
    extra: dict[str, float] = field(default_factory=dict)
    # expected remaining length of the regime the change answers (policies.regime); None: unknown
    horizon_s: float | None = None
    horizon_basis: str | None = None  # what that estimate went by, in words (policies.regime.basis)
    # restarts the change commits to within that regime: 2 when it serves only the load now and leaves a
    # config that serves every load (dropping a per-batch-size table's draft), so the way back is another
    restarts: int = 1
    # the way back's serving lost per second of its restart, in seconds of the current goodput: it comes
    # when the load falls back, where an engine serves fewer tokens a second (1: charged at the current rate)
    way_back_share: float = 1.0
    # seconds of the current goodput lost while the way back waits for the lower load to be sustained
    way_back_lag_s: float = 0.0
    # what makes proposals in a row the same change for the streak (None: ``target``); a K table's K where
    # the load runs, so its rows elsewhere moving with noise do not restart the count
    streak_key: str | None = None
    confidence: float = 0.95  # of ``predicted_gain_ci`` (two-sided)

    @property
    def streak_target(self) -> str:
        return self.streak_key or self.target


def next_streak(state: ControllerState, target: str | None) -> tuple[str | None, int]:
    """The streak after a decision proposing ``target`` (None: no change wanted). A different target
    restarts the count at 1, like Ray Serve's signed delay counter that resets on a direction flip."""
    if target is None:
        return None, 0
    if target == state.streak_target:
        return target, state.streak_count + 1
    return target, 1


def check_paused(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    if st.paused:
        return Block(BlockReason.PAUSED, "The controller is paused; run `spectuner resume` to let it act.")
    return None


def check_pending(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    if st.pending_verification:
        return Block(
            BlockReason.PENDING_VERIFICATION,
            "The previous change is still in its evaluation window; no new change until it is verified.",
        )
    if st.canary_elsewhere is not None:
        return Block(
            BlockReason.CANARY_ELSEWHERE,
            f"{st.canary_elsewhere}; this replica is its untouched baseline and changes nothing until it is judged.",
        )
    return None


def check_known_bad(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    if p.target in st.failed_targets:
        return Block(
            BlockReason.KNOWN_BAD,
            "This config failed to start or regressed recently; it is not tried again until that ages out.",
        )
    return None


def check_evidence(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    missing = []  # name only what is short: "2000 drafts ... needs 200 drafts" read as a contradiction
    # A change that keeps serving is verified and rolled back at the cost of one window: a smaller bar
    need = s.min_drafts if p.needs_restart else min(s.min_drafts_live, s.min_drafts)
    if p.drafts < need:
        live = "" if p.needs_restart else " for a change that does not interrupt serving"
        missing.append(f"{p.drafts} drafts of the {need} needed{live}")
    if p.evidence_s < s.min_evidence_s:
        missing.append(f"{p.evidence_s:.0f} s of the {s.min_evidence_s:.0f} s of evidence needed")
    if missing:
        return Block(
            BlockReason.INSUFFICIENT_EVIDENCE,
            f"Not enough evidence under the current config yet: only {' and '.join(missing)} "
            f"(have {p.drafts} drafts over {p.evidence_s:.0f} s).",
        )
    return None


def live_lower_end(p: Proposal, live_confidence: float) -> float:
    """The lower end of the predicted gain read at ``live_confidence`` (one-sided) instead of the interval's
    own ``p.confidence`` (two-sided): the interval's lower half rescaled on the log scale, where a ratio of
    goodputs is near normal. Never above the point estimate."""
    lo, g = p.predicted_gain_ci[0], p.predicted_gain
    if lo <= 0 or g <= 0 or lo >= g:
        return lo
    z_own = NormalDist().inv_cdf(0.5 + p.confidence / 2.0)
    z_live = NormalDist().inv_cdf(live_confidence)
    return g * (lo / g) ** (z_live / z_own)


def check_gain(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    lo, hi = p.predicted_gain_ci
    # A change that keeps serving has no downtime to repay and is rolled back if it loses: a smaller bar,
    # at a lower confidence (a wrong one costs one verification window; a missed one, the whole regime)
    bar = s.min_gain if p.needs_restart else s.min_gain_live
    if not p.needs_restart:
        lo = live_lower_end(p, s.live_gain_confidence)
    if lo <= 1.0 + bar:
        if p.needs_restart:
            return Block(
                BlockReason.GAIN_TOO_SMALL,
                f"Predicted gain {p.predicted_gain:.3f}× (interval {lo:.3f}–{hi:.3f}×) is not surely above "
                f"{1.0 + bar:.3f}×.",
            )
        return Block(
            BlockReason.GAIN_TOO_SMALL,
            f"Predicted gain {p.predicted_gain:.3f}× (lower end {lo:.3f}× at {s.live_gain_confidence:.0%} "
            f"confidence) is not above {1.0 + bar:.3f}× (the bar for a change that does not interrupt serving).",
        )
    return None


def check_streak(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    _, count = next_streak(st, p.streak_target)
    if count < s.hysteresis_ticks:
        return Block(
            BlockReason.NOT_PERSISTENT,
            f"This change has been proposed {count} time(s) in a row; it must be {s.hysteresis_ticks}.",
        )
    return None


def check_cooldown(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    last = st.last_change_at
    if last is not None:
        since_s = (now - last).total_seconds()
        if since_s < s.cooldown_s:
            return Block(
                BlockReason.COOLDOWN,
                f"The last change was {since_s:.0f} s ago; the cooldown is {s.cooldown_s:.0f} s "
                f"({s.cooldown_s - since_s:.0f} s left).",
            )
    return None


def check_rate(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    hour_ago = now - timedelta(hours=1)
    recent = sum(1 for t in st.change_times if hour_ago < t <= now)
    if recent >= s.max_changes_per_hour:
        return Block(
            BlockReason.TOO_MANY_CHANGES,
            f"{recent} change(s) in the last hour; the limit is {s.max_changes_per_hour} per hour.",
        )
    return None


def payback_s(predicted_gain: float, downtime_s: float) -> float:
    """Seconds of running at ``predicted_gain``× to make up ``downtime_s`` at zero throughput.

    Lost: downtime × goodput. Won back per second: goodput × (gain − 1). The load's goodput cancels
    (assumes the load stays as it is over the horizon)."""
    if downtime_s <= 0:
        return 0.0
    if predicted_gain <= 1.0:
        return float("inf")
    return downtime_s / (predicted_gain - 1.0)


def check_switching_cost(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    if not p.needs_restart:
        return None
    # The gain starts only once the new engine serves: the first restart's downtime comes out of the
    # regime before any of it is repaid (a 35-s restart at 1.16× needs 254 s of regime, not 219).
    lost_s = s.restart_downtime_s * (1.0 + (p.restarts - 1) * p.way_back_share) + p.way_back_lag_s
    repay_s = payback_s(p.predicted_gain, lost_s)
    needed_s = s.restart_downtime_s + repay_s
    horizon_s = s.payback_horizon_s if p.horizon_s is None else min(s.payback_horizon_s, p.horizon_s)
    if needed_s > horizon_s:
        regime = horizon_s < s.payback_horizon_s
        what = "the expected remaining length of the current regime" if regime else "the payback horizon"
        why = f": {p.horizon_basis}" if regime and p.horizon_basis else ""
        restarts = "A restart costs" if p.restarts == 1 else f"{p.restarts} restarts (there and back) cost"
        if p.restarts > 1 and (p.way_back_share < 1.0 or p.way_back_lag_s > 0):
            restarts = (
                f"{p.restarts} restarts (there and back, the way back at {p.way_back_share:.2f}× the current "
                f"goodput, after ~{p.way_back_lag_s:.0f} s of it lost waiting) cost"
            )
        return Block(
            BlockReason.SWITCHING_COST,
            f"{restarts} ~{lost_s:.0f} s of serving; at {p.predicted_gain:.3f}× it "
            f"takes {repay_s:.0f} s to repay after the {s.restart_downtime_s:.0f}-s restart ({needed_s:.0f} s in "
            f"all), longer than {what} ({horizon_s:.0f} s{why}).",
        )
    return None


def in_window(w: MaintenanceWindow, now: datetime) -> bool:
    """Whether UTC ``now`` falls in ``w`` (a window wrapping midnight belongs to its start day)."""
    t = now.timetz().replace(tzinfo=None)
    day = now.weekday()
    if w.start < w.end:
        return day in w.days and w.start <= t < w.end
    # wraps midnight: the evening part is on a listed day, the morning part on the day after one
    return (day in w.days and t >= w.start) or (((day - 1) % 7) in w.days and t < w.end)


def check_maintenance(s: GuardrailsSection, st: ControllerState, p: Proposal, now: datetime) -> Block | None:
    if not p.needs_restart or not s.maintenance_windows:
        return None
    if any(in_window(w, now) for w in s.maintenance_windows):
        return None
    spans = ", ".join(f"{w.start:%H:%M}–{w.end:%H:%M} UTC" for w in s.maintenance_windows)
    return Block(
        BlockReason.OUTSIDE_MAINTENANCE_WINDOW,
        f"Restarts happen only in a maintenance window ({spans}); it is {now:%a %H:%M} UTC.",
    )


RAILS = (
    check_paused,
    check_pending,
    check_known_bad,
    check_evidence,
    check_gain,
    check_streak,
    check_cooldown,
    check_rate,
    check_switching_cost,
    check_maintenance,
)


def check_guardrails(
    settings: GuardrailsSection, state: ControllerState, proposal: Proposal, now: datetime
) -> Block | None:
    """The first rail (in :data:`RAILS` order) that blocks ``proposal``, or None to go ahead."""
    if now.tzinfo is None:
        raise ValueError("now must be an aware UTC datetime")
    for rail in RAILS:
        block = rail(settings, state, proposal, now)
        if block is not None:
            return block
    return None

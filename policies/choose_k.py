"""Best K ∈ {0..K_max} for one batch size: maximise goodput B·E(K) / T(B, K) under the memory budget.

Purely computational, no side effects. K = 0 (speculation off) is a valid answer, and a K that breaks
the memory budget is never chosen. K = 0 means one of two things: for one K per engine it is an engine
started without a draft; inside a per-batch-size table (``k0_is_off=False``) the draft stays loaded and,
for a draft model, still runs one pass per step (``StepCostModel.draft_pass_at_k0``). Every speedup is
over plain decoding, an engine without a draft. The predicted gain is goodput(K) / goodput(off) with an interval that
combines the acceptance model's interval for E(K) and the step-cost fit's covariance (delta method on
the log scale, treating the two as independent).

When one K must serve a load that varies (no per-batch-size table), :func:`goodput_over_load` scores a
K over the batch sizes seen, weighted by time: the K a fixed-K oracle would pick, rather than the best K
at the mean batch (which chases a burst and restarts the engine twice for a five-minute spike).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from statistics import NormalDist

import numpy as np

from policies.acceptance_model import AcceptanceModel
from policies.memory import DraftFootprint, MemoryBudget, check_memory
from policies.spec_config import SpecConfig
from policies.speedup import check_k
from policies.step_cost import StepCostModel


@dataclass(frozen=True)
class KChoiceSnapshot:
    """Everything :func:`choose_k` may read. ``draft`` and ``memory`` go together (both or neither)."""

    now: datetime
    acceptance: AcceptanceModel
    step_cost: StepCostModel
    batch_size: int
    k_max: int
    draft: DraftFootprint | None = None
    memory: MemoryBudget | None = None
    current_k: int | None = None
    confidence: float = 0.95
    k0_is_off: bool = True  # K = 0 restarts without a draft; False: a table's K = 0, draft still loaded
    # When KV memory caps the batch: the sequences that fit at each K (index K; K = 0 without the draft,
    # policies.memory.KvCapacity.max_batch). ``batch_size`` is then the demand (requests running + waiting)
    # and each K runs min(demand, its cap); its speedup is over plain decoding at plain decoding's batch.
    batch_caps: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_k(self.k_max, "K_max")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch size must be an integer ≥ 1 but got {self.batch_size!r}")
        if (self.draft is None) != (self.memory is None):
            raise ValueError("a memory budget needs the draft's footprint and vice versa")
        if self.current_k is not None:
            check_k(self.current_k, "current K")
        if self.batch_caps is not None and len(self.batch_caps) <= self.k_max:
            raise ValueError(f"batch caps need one entry per K = 0..{self.k_max} but got {len(self.batch_caps)}")

    def batch_at(self, k: int) -> int:
        """The batch K runs: the batch size, or the demand up to K's memory cap."""
        if self.batch_caps is None:
            return self.batch_size
        return max(0, min(self.batch_size, self.batch_caps[k]))


class KReason(StrEnum):
    SPECULATE = "speculate"  # some K > 0 has the highest goodput
    SPECULATION_DOES_NOT_PAY = "speculation_does_not_pay"  # K = 0 has the highest goodput
    MEMORY_LIMITED = "memory_limited"  # the unconstrained best K breaks the budget; a smaller K chosen
    NO_K_FITS_MEMORY = "no_k_fits_memory"  # every K > 0 breaks the budget
    K_MAX_ZERO = "k_max_zero"


@dataclass(frozen=True)
class KOption:
    """One K evaluated at the snapshot's batch size."""

    k: int
    expected_tokens_per_step: float
    expected_tokens_ci: tuple[float, float]
    step_time_s: float
    goodput_tokens_per_s: float
    speedup: float
    speedup_ci: tuple[float, float]
    fits_memory: bool
    memory_message: str = ""


@dataclass(frozen=True)
class KDecision:
    """The chosen K with its reason, a sentence, and the predicted gain over K = 0 and over current K."""

    k: int
    reason: KReason
    message: str
    batch_size: int
    speedup: float
    speedup_ci: tuple[float, float]
    expected_tokens_per_step: float
    gain_vs_current: float | None
    gain_vs_current_ci: tuple[float, float] | None
    by_k: tuple[KOption, ...] = field(repr=False)


def evaluate_k(snapshot: KChoiceSnapshot, k: int) -> KOption:
    """Goodput and speedup of one K at the snapshot's batch size (memory check included)."""
    b = snapshot.batch_at(k)
    model = snapshot.step_cost
    e = snapshot.acceptance.expected_tokens(k)
    e_lo, e_hi = snapshot.acceptance.expected_tokens_interval(k)
    off = k == 0 and snapshot.k0_is_off
    t_0 = model.plain_step_time_s(b)
    t_k = t_0 if off else model.step_time_s(b, k)
    # plain decoding's throughput at its own batch over this K's at b (1 unless memory caps them apart)
    b_0 = max(snapshot.batch_at(0), 1)
    batch_ratio = (b / t_0) / (b_0 / model.plain_step_time_s(b_0))
    speedup = e * t_0 / t_k * batch_ratio
    z = NormalDist().inv_cdf(0.5 + snapshot.confidence / 2.0)
    # log-scale sd of E from its interval, and of T(B,0)/T(B,K) from the fit's covariance
    sd_e = (math.log(max(e_hi, 1e-12)) - math.log(max(e_lo, 1e-12))) / (2.0 * z)
    sd_t = 0.0
    # the fit's covariance says nothing of a measured cell's mean (both cells measured: E alone is uncertain)
    measured = model.is_measured(b, k) or model.is_measured(b, 0)
    if model.covariance is not None and not off and not measured:
        plain = np.array([1.0, b, 0.0, 0.0])  # T(B, 0) without a draft: the speedup's baseline
        g = model.design_row(b, k) / t_k - plain / t_0
        sd_t = math.sqrt(max(float(g @ np.array(model.covariance) @ g), 0.0))
    sd = math.hypot(sd_e, sd_t)
    if sd_t == 0.0:
        ci = (e_lo * t_0 / t_k * batch_ratio, e_hi * t_0 / t_k * batch_ratio)  # exact when only E is uncertain
    else:
        ci = (speedup * math.exp(-z * sd), speedup * math.exp(z * sd))
    fits, note = True, ""
    if snapshot.draft is not None and snapshot.memory is not None:
        check = check_memory(snapshot.draft, k, b, snapshot.memory)
        fits, note = check.fits, check.message
    return KOption(k, e, (e_lo, e_hi), t_k, b * e / t_k, speedup, ci, fits, note)


def choose_k(snapshot: KChoiceSnapshot) -> KDecision:
    """The K in 0..K_max with the highest predicted goodput that fits memory. Purely computational.

    Ties go to the smaller K (less memory, less wasted draft work).
    """
    options = tuple(evaluate_k(snapshot, k) for k in range(snapshot.k_max + 1))
    unconstrained = max(options, key=lambda o: (o.goodput_tokens_per_s, -o.k))
    feasible = [o for o in options if o.fits_memory]  # K = 0 always fits
    best = max(feasible, key=lambda o: (o.goodput_tokens_per_s, -o.k))
    b = snapshot.batch_size
    if snapshot.k_max == 0:
        reason, message = KReason.K_MAX_ZERO, f"K_max is 0 at batch {b}: speculation is off."
    elif best.k != unconstrained.k and best.k == 0:
        reason = KReason.NO_K_FITS_MEMORY
        message = (
            f"At batch {b}, K = {unconstrained.k} would give {unconstrained.speedup:.2f}× but no K > 0 fits "
            f"memory ({unconstrained.memory_message}); speculation off."
        )
    elif best.k != unconstrained.k:
        reason = KReason.MEMORY_LIMITED
        message = (
            f"At batch {b}, K = {best.k} ({best.speedup:.2f}×, {_ci(best.speedup_ci)}) is the best K "
            f"that fits memory; K = {unconstrained.k} ({unconstrained.speedup:.2f}×) does not: "
            f"{unconstrained.memory_message}"
        )
    elif best.k == 0:
        runner_up = max(options[1:], key=lambda o: o.goodput_tokens_per_s)
        reason = KReason.SPECULATION_DOES_NOT_PAY
        message = (
            f"At batch {b} speculation does not pay: the best K > 0 (K = {runner_up.k}) would run at "
            f"{runner_up.speedup:.2f}× of no speculation; K = 0."
        )
    else:
        reason = KReason.SPECULATE
        message = (
            f"At batch {b}, K = {best.k} maximises goodput: {best.expected_tokens_per_step:.2f} tokens per "
            f"step, {best.speedup:.2f}× no speculation ({_ci(best.speedup_ci)})."
        )
    gain: float | None = None
    gain_ci: tuple[float, float] | None = None
    if snapshot.current_k is not None and snapshot.current_k <= snapshot.k_max:
        cur = options[snapshot.current_k]
        gain = best.speedup / cur.speedup
        # Opposite ends, although both share α: the wider interval stands in for the step cost's model
        # error, which it does not carry (paired ends let 2-3 % predicted gains restart K = 3 → 5 and back
        # on the simulator's GPU scenarios, and live K tables change more often for no measured gain).
        gain_ci = (best.speedup_ci[0] / cur.speedup_ci[1], best.speedup_ci[1] / cur.speedup_ci[0])
    return KDecision(
        k=best.k,
        reason=reason,
        message=message,
        batch_size=b,
        speedup=best.speedup,
        speedup_ci=best.speedup_ci,
        expected_tokens_per_step=best.expected_tokens_per_step,
        gain_vs_current=gain,
        gain_vs_current_ci=gain_ci,
        by_k=options,
    )


def _ci(ci: tuple[float, float]) -> str:
    if math.isclose(ci[0], ci[1], rel_tol=1e-9):
        return "α taken as exact"
    return f"interval {ci[0]:.2f}–{ci[1]:.2f}×"


# -- one K for a varying load ---------------------------------------------------------------------------

_BIN_RATIO = 1.25  # batch sizes within 25% of each other share a bin: a day of windows is ~25 bins


def load_bins(profile: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(seconds, mean batch size) per geometric bin of the batch sizes in ``profile`` ((seconds,
    requests running) per window); windows with no request running are left out (nothing to speed up)."""
    if not profile:
        return ()
    arr = np.asarray(profile, dtype=float).reshape(-1, 2)
    seconds, batch = arr[:, 0], arr[:, 1]
    keep = (seconds > 0) & np.isfinite(batch) & (batch >= 0.5)
    seconds, batch = seconds[keep], np.maximum(batch[keep], 1.0)
    if seconds.size == 0:
        return ()
    key = np.floor(np.log(batch) / math.log(_BIN_RATIO)).astype(np.int64)
    key -= key.min()
    total_s = np.bincount(key, weights=seconds)
    total_sb = np.bincount(key, weights=seconds * batch)
    return tuple((float(s), float(sb / s)) for s, sb in zip(total_s, total_sb, strict=True) if s > 0)


@dataclass(frozen=True)
class LoadGoodput:
    """Mean generated tokens/s of one K over a load profile, with the interval from α's."""

    k: int
    tokens_per_s: float
    interval: tuple[float, float]


def goodput_over_load(
    acceptance: AcceptanceModel,
    step_cost: StepCostModel,
    bins: Sequence[tuple[float, float]],
    k: int,
    cap: int | None = None,
) -> LoadGoodput:
    """Σ seconds · B · E[tokens per step](K) / T(B, K) over the bins, per second of the profile: what one K
    would have generated over the load seen (the fixed-K oracle's criterion). K = 0 is an engine without
    a draft. ``cap``: the sequences that fit memory at this K (a bin's demand above it waits)."""
    e = acceptance.expected_tokens(k)
    e_lo, e_hi = acceptance.expected_tokens_interval(k)
    total_s = sum(s for s, _ in bins)
    step_s = step_cost.plain_step_time_s if k == 0 else (lambda b: step_cost.step_time_s(b, k))
    runs = [(s, b if cap is None else min(b, float(cap))) for s, b in bins]
    rate = sum(s * b / step_s(b) for s, b in runs if b > 0) / total_s if total_s > 0 else 0.0
    return LoadGoodput(k, e * rate, (e_lo * rate, e_hi * rate))


# -- the controller's K: over the load seen, below what failed -------------------------------------------


def failed_k_ceiling(failed: Sequence[SpecConfig], current: SpecConfig) -> int | None:
    """The smallest single K of the running draft that failed lately (did not start, or regressed): a
    larger K needs more memory and drafts more, so it would most likely fail too. None: none failed."""
    return min(
        (c.k for c in failed if c.draft == current.draft and c.k is not None and c.k > 0 and not c.k_table),
        default=None,
    )


def choose_k_over_load(
    decision: KDecision,
    acceptance: AcceptanceModel,
    step_cost: StepCostModel,
    load_profile: Sequence[tuple[float, float]],
    current_k: int,
    failed_ks: frozenset[int] = frozenset(),
    ceiling: int | None = None,
    batch_caps: tuple[int, ...] | None = None,
    per_token_assumed: bool = False,
) -> tuple[KDecision, tuple[tuple[float, float], ...]]:
    """:func:`choose_k`'s decision, re-ranked for what the controller can apply: every K is scored over
    the load profile when the load varied (one K must serve all of it, weighted by time; else at the
    decision's batch size), Ks in ``failed_ks`` and Ks at or above ``ceiling`` (except the current K)
    are left out; ``batch_caps`` (per K, as :class:`KChoiceSnapshot`'s) cap each bin's demand. With
    ``per_token_assumed`` (``StepCostModel.per_token_assumed``: fitted from steps at one K and one batch
    size, the per-token cost of verification is 0 by assumption) a move up goes at most half-way to the K the
    model predicts best (at least one step): free verification overrates larger K, and the new K's steps
    measure it. Returns the
    decision (its gain against ``current_k``) and the load bins it used."""
    bins = load_bins(load_profile)
    if len(bins) >= 2:
        scores = {
            o.k: goodput_over_load(acceptance, step_cost, bins, o.k, None if batch_caps is None else batch_caps[o.k])
            for o in decision.by_k
        }
        value = {k: g.tokens_per_s for k, g in scores.items()}
        interval = {k: g.interval for k, g in scores.items()}
        seconds = sum(s for s, _ in bins)
        over = (
            f"Over the load of the last {seconds:.0f} s (batch {bins[0][1]:.0f}–{bins[-1][1]:.0f}, weighted by "
            "time)"
        )
    else:
        value = {o.k: o.speedup for o in decision.by_k}
        interval = {o.k: o.speedup_ci for o in decision.by_k}
        over = ""
        bins = ()
    ranked_best = max((o.k for o in decision.by_k if o.fits_memory), key=lambda k: (value[k], -k))
    step_up_to = current_k + max(1, math.ceil((ranked_best - current_k) / 2)) if per_token_assumed else None
    allowed = [
        o.k
        for o in decision.by_k
        if o.fits_memory
        and (ceiling is None or o.k < ceiling or o.k == current_k)
        and o.k not in failed_ks
        and (step_up_to is None or o.k <= max(step_up_to, current_k))
    ]
    best = max(allowed, key=lambda k: (value[k], -k)) if allowed else 0
    if not over and best == decision.k:
        return decision, bins
    speedup = value[best] / value[0] if value[0] > 0 else float("nan")
    message = f"{over}, K = {best} maximises goodput: {speedup:.2f}× no speculation." if over else ""
    if best != ranked_best:
        if ranked_best in failed_ks:
            why = f"K = {ranked_best} failed lately"
        elif ceiling is not None and ranked_best >= ceiling:
            why = (
                f"K = {ranked_best} is above K = {ceiling}, which failed lately (K ≥ {ceiling} is not proposed "
                "while that failure is recent)"
            )
        else:
            why = (
                f"K = {ranked_best} is predicted best with verification taken as free (the steps so far ran one "
                "K at one batch size, which cannot measure its per-token cost); half-way there, whose steps "
                "measure it"
            )
        message = f"{why}; the best other K is {best}. {message}".strip()
    elif not over:
        message = decision.message
    cur_lo = interval[current_k][0] if current_k in interval else 0.0
    gain = value[best] / value[current_k] if current_k in value and value[current_k] > 0 else None
    gain_ci = (  # opposite ends, as choose_k's
        (interval[best][0] / interval[current_k][1], interval[best][1] / cur_lo)
        if gain is not None and cur_lo > 0 and interval[current_k][1] > 0
        else None
    )
    return replace(decision, k=best, message=message, gain_vs_current=gain, gain_vs_current_ci=gain_ci), bins

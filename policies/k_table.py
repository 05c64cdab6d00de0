"""The per-batch-size K table (vLLM's speculative config's per-batch-size rows, see ``policies.spec_config``).

Purely computational. For every batch size 1..max_batch_size the best K is chosen by
:func:`policies.choose_k.choose_k` (memory checked at that many running sequences); equal neighbours
merge into inclusive ranges ``[lo, hi, K]``. The rows are contiguous, the first starts at 1 and the last
ends at max_batch_size; K may be 0 (no drafts at that load). A table's K = 0 keeps the draft loaded: with
a draft model each step still runs its catch-up pass, so give ``step_cost`` the engine's
``draft_pass_at_k0``; speedups are over an engine without a draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from policies.acceptance_model import AcceptanceModel
from policies.choose_k import KChoiceSnapshot, KDecision, choose_k, evaluate_k
from policies.memory import DraftFootprint, MemoryBudget
from policies.spec_config import KRow, k_at
from policies.speedup import check_k
from policies.step_cost import StepCostModel


@dataclass(frozen=True)
class AcceptanceBucket:
    """An acceptance model measured for batch sizes lo..hi (inclusive), when the data carry buckets."""

    lo: int
    hi: int
    acceptance: AcceptanceModel


@dataclass(frozen=True)
class KTableSnapshot:
    now: datetime
    acceptance: AcceptanceModel
    step_cost: StepCostModel
    max_batch_size: int
    k_max: int
    draft: DraftFootprint | None = None
    memory: MemoryBudget | None = None
    acceptance_by_batch_size: Sequence[AcceptanceBucket] = ()
    confidence: float = 0.95

    def __post_init__(self) -> None:
        check_k(self.k_max, "K_max")
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max batch size must be an integer ≥ 1 but got {self.max_batch_size!r}")
        for bucket in self.acceptance_by_batch_size:
            if not 1 <= bucket.lo <= bucket.hi:
                raise ValueError(f"batch-size bucket [{bucket.lo}, {bucket.hi}] is not a range starting at ≥ 1")

    def acceptance_at(self, batch_size: int) -> AcceptanceModel:
        for bucket in self.acceptance_by_batch_size:
            if bucket.lo <= batch_size <= bucket.hi:
                return bucket.acceptance
        return self.acceptance


class KTableReason(StrEnum):
    CONSTANT = "constant"  # one K for every batch size
    VARIES_WITH_BATCH = "varies_with_batch_size"
    SPECULATION_OFF = "speculation_off"  # K = 0 everywhere


@dataclass(frozen=True)
class KTable:
    """Merged ``[lo, hi, K]`` rows plus the decision behind every batch size."""

    rows: tuple[tuple[int, int, int], ...]
    reason: KTableReason
    message: str
    min_speedup: float
    max_speedup: float
    decisions: tuple[KDecision, ...] = field(repr=False)

    def as_vllm(self) -> list[list[int]]:
        """The rows as vLLM's JSON takes them (``SpecConfig.with_table`` takes them too)."""
        return [list(row) for row in self.rows]

    def k_for(self, batch_size: int) -> int:
        for lo, hi, k in self.rows:
            if lo <= batch_size <= hi:
                return k
        raise ValueError(f"batch size {batch_size} is outside the table 1..{self.rows[-1][1]}")


def merge_ranges(ks: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """K per batch size (index 0 is batch 1) → inclusive ``(lo, hi, K)`` rows, equal neighbours merged."""
    if not ks:
        raise ValueError("need the K of at least one batch size")
    rows: list[tuple[int, int, int]] = []
    start = 1
    for b in range(2, len(ks) + 2):
        if b == len(ks) + 1 or ks[b - 1] != ks[start - 1]:
            rows.append((start, b - 1, int(ks[start - 1])))
            start = b
    return tuple(rows)


def k_table(snapshot: KTableSnapshot) -> KTable:
    """The best K for every batch size 1..max_batch_size, merged. Purely computational."""
    decisions = tuple(
        choose_k(
            KChoiceSnapshot(
                now=snapshot.now,
                acceptance=snapshot.acceptance_at(b),
                step_cost=snapshot.step_cost,
                batch_size=b,
                k_max=snapshot.k_max,
                draft=snapshot.draft,
                memory=snapshot.memory,
                confidence=snapshot.confidence,
                k0_is_off=False,
            )
        )
        for b in range(1, snapshot.max_batch_size + 1)
    )
    rows = merge_ranges([d.k for d in decisions])
    speedups = [d.speedup for d in decisions]
    table = ", ".join(f"{lo}–{hi}: K={k}" for lo, hi, k in rows)
    if all(k == 0 for _, _, k in rows):
        reason, message = (
            KTableReason.SPECULATION_OFF,
            f"Speculation does not pay at any batch size up to {snapshot.max_batch_size}: K = 0 throughout.",
        )
    elif len(rows) == 1:
        reason, message = (
            KTableReason.CONSTANT,
            (
                f"K = {rows[0][2]} is best at every batch size 1–{snapshot.max_batch_size} "
                f"({min(speedups):.2f}–{max(speedups):.2f}× no speculation)."
            ),
        )
    else:
        reason, message = (
            KTableReason.VARIES_WITH_BATCH,
            (
                f"The best K changes with load ({table}); predicted {min(speedups):.2f}–{max(speedups):.2f}× "
                "no speculation."
            ),
        )
    return KTable(rows, reason, message, min(speedups), max(speedups), decisions)


@dataclass(frozen=True)
class TableGain:
    """Generated tokens of a new table over the old one's, on one load profile, with the interval from α's."""

    gain: float
    interval: tuple[float, float]


@dataclass(frozen=True)
class _TableSum:
    """Σ seconds · speedup over a profile: the point and its interval."""

    point: float
    ci: tuple[float, float]


def _seconds_at(profile: Sequence[tuple[float, float]], max_batch_size: int) -> dict[int, float]:
    """Seconds of ``profile`` ((seconds, requests) per window) at each batch size it runs (capped)."""
    seconds_at: dict[int, float] = {}
    for dur, running in profile:
        b = min(max(1, round(running)), max_batch_size)
        seconds_at[b] = seconds_at.get(b, 0.0) + dur
    return seconds_at


def _table_sums(
    now: datetime,
    acceptance: AcceptanceModel,
    step_cost: StepCostModel,
    tables: Sequence[Sequence[KRow]],
    profile: Sequence[tuple[float, float]],
    max_batch_size: int,
    k_engine: int,
    confidence: float,
) -> list[_TableSum]:
    """Per table: Σ seconds · speedup over ``profile``, and the same at the ends of each window's interval."""
    sums = [[0.0] * 3 for _ in tables]
    # an hour of 10 s windows holds a few distinct batch sizes: evaluate each once, weighted by its seconds
    for b, dur in _seconds_at(profile, max_batch_size).items():
        snap = KChoiceSnapshot(
            now=now,
            acceptance=acceptance,
            step_cost=step_cost,
            batch_size=b,
            k_max=k_engine,
            confidence=confidence,
            k0_is_off=False,
        )
        for acc, rows in zip(sums, tables, strict=True):
            o = evaluate_k(snap, k_at(rows, b))
            for i, v in enumerate((o.speedup, *o.speedup_ci)):
                acc[i] += dur * v
    return [_TableSum(t, (lo, hi)) for t, lo, hi in sums]


def goodput_over_load(
    now: datetime,
    acceptance: AcceptanceModel,
    step_cost: StepCostModel,
    rows: Sequence[KRow],
    profile: Sequence[tuple[float, float]],
    max_batch_size: int,
    k_engine: int,
) -> float | None:
    """Generated tokens per second (in ``step_cost``'s seconds) of the table ``rows`` over ``profile``,
    time-weighted: B × E[tokens per sequence and step] / T(B, K) at each window's batch size (capped at
    ``max_batch_size``). None when the profile holds nothing to judge on."""
    seconds_at = _seconds_at(profile, max_batch_size)
    total = sum(seconds_at.values())
    if total <= 0:
        return None
    rate = 0.0
    for b, dur in seconds_at.items():
        snap = KChoiceSnapshot(
            now=now, acceptance=acceptance, step_cost=step_cost, batch_size=b, k_max=k_engine, k0_is_off=False
        )
        rate += dur * evaluate_k(snap, k_at(rows, b)).goodput_tokens_per_s
    return rate / total


def plain_goodput(step_cost: StepCostModel, load: float, max_batch_size: int) -> float:
    """Generated tokens per second (in ``step_cost``'s seconds) of an engine without a draft at ``load``
    requests (running + waiting; it runs at most ``max_batch_size``)."""
    b = min(max(1, round(load)), max_batch_size)
    return b / step_cost.plain_step_time_s(b)


def table_gain_over_load(
    now: datetime,
    acceptance: AcceptanceModel,
    step_cost: StepCostModel,
    new_rows: Sequence[KRow],
    old_rows: Sequence[KRow],
    profile: Sequence[tuple[float, float]],
    max_batch_size: int,
    k_engine: int,
    confidence: float = 0.95,
) -> TableGain | None:
    """Σ seconds · speedup(K of each table at the window's batch size) over ``profile`` ((seconds, requests
    running) per window), new over old. Both tables keep the draft loaded (a row's K = 0 still pays a draft
    model's pass when ``step_cost`` says so). None when the profile holds nothing to judge on."""
    new, old = _table_sums(
        now, acceptance, step_cost, (new_rows, old_rows), profile, max_batch_size, k_engine, confidence
    )
    if old.point <= 0 or old.ci[0] <= 0:
        return None
    # Opposite ends, as for a single K (policies.choose_k), although both tables share α: compared at the
    # same end, tables changed sooner and more often live (8 changes against 2 in a full run) and the run
    # made 0.840 × the per-phase oracle against 0.864 without (bench/results/live.md, docs/controller.md).
    return TableGain(new.point / old.point, (new.ci[0] / old.ci[1], new.ci[1] / old.ci[0]))


def off_gain_over_load(
    now: datetime,
    acceptance: AcceptanceModel,
    step_cost: StepCostModel,
    rows: Sequence[KRow],
    profile: Sequence[tuple[float, float]],
    max_batch_size: int,
    k_engine: int,
    confidence: float = 0.95,
) -> TableGain | None:
    """An engine without the draft (speculation off: speedup 1 by definition) over the table ``rows`` on
    ``profile``: what dropping the draft wins where even the table's K = 0 rows pay its pass, and its
    K = 1 rows verify twice the tokens. None when the profile holds nothing to judge on."""
    seconds = sum(dur for dur, _ in profile)
    (table_sum,) = _table_sums(now, acceptance, step_cost, (rows,), profile, max_batch_size, k_engine, confidence)
    table, (lo, hi) = table_sum.point, table_sum.ci
    if seconds <= 0 or table <= 0 or lo <= 0:
        return None
    return TableGain(seconds / table, (seconds / hi, seconds / lo))

"""Judge a change after its evaluation window: realized gain, and whether it regressed beyond noise.

Purely computational. The noise is the standard error of the difference of the mean per-window
throughput before and after (Welch); a change is a regression only if it lost more than the
tolerance AND the loss is more than ``z`` standard errors — one slow window is not a regression.

Throughput follows the load as much as the config: a change made during a burst and judged after it
would look like a regression. :func:`judge_at_matched_load` therefore compares windows at the same load
only (requests running within the same 25% band), each window's rate taken relative to the mean rate
before the change in its band; with no band in common it keeps the change and says why.

Throughput also follows the prompts: harder prompts after a change lower the acceptance α and with it
the tokens per step, whatever the config. :func:`acceptance_shift` is how much α's move alone changed
the new config's tokens per step; the caller divides the after-rates by it before judging, so a change
made just before the prompts turn hard is not rolled back for the prompts' sake (the lab benchmark did
exactly that: 0.58× "regression", all of it the switch to hard prompts).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from policies.counters import SpecCounters
from policies.spec_config import SpecConfig


class VerifyReason(StrEnum):
    IMPROVED = "improved"
    NO_WORSE = "no_worse"  # within tolerance or noise
    REGRESSED = "regressed"
    NO_DATA = "no_data"  # too few windows on one side to judge


@dataclass(frozen=True)
class Verdict:
    reason: VerifyReason
    message: str
    realized_gain: float | None
    rollback: bool


def judge(
    before_rates: Sequence[float],
    after_rates: Sequence[float],
    *,
    tolerance: float = 0.05,
    z: float = 2.0,
    min_windows: int = 3,
) -> Verdict:
    """Compare per-window generated tokens/s before and after a change."""
    if len(before_rates) < min_windows or len(after_rates) < min_windows:
        return Verdict(
            VerifyReason.NO_DATA,
            f"{len(before_rates)} window(s) before and {len(after_rates)} after the change; {min_windows} "
            "each are needed to judge it, so it is kept.",
            None,
            False,
        )
    mean_b = statistics.fmean(before_rates)
    mean_a = statistics.fmean(after_rates)
    if mean_b <= 0:
        return Verdict(VerifyReason.NO_DATA, "no tokens were generated before the change; kept.", None, False)
    gain = mean_a / mean_b
    se = math.sqrt(
        statistics.variance(before_rates) / len(before_rates) + statistics.variance(after_rates) / len(after_rates)
    )
    loss = mean_b - mean_a
    if gain < 1.0 - tolerance and loss > z * se:
        return Verdict(
            VerifyReason.REGRESSED,
            f"Throughput fell from {mean_b:.1f} to {mean_a:.1f} tokens/s ({gain:.3f}×), more than the "
            f"{tolerance:.0%} tolerance and {loss / se if se > 0 else math.inf:.1f} standard errors: rolling back.",
            gain,
            True,
        )
    if gain > 1.0 and mean_a - mean_b > z * se:
        return Verdict(
            VerifyReason.IMPROVED,
            f"Throughput rose from {mean_b:.1f} to {mean_a:.1f} tokens/s ({gain:.3f}×).",
            gain,
            False,
        )
    return Verdict(
        VerifyReason.NO_WORSE,
        f"Throughput {mean_b:.1f} → {mean_a:.1f} tokens/s ({gain:.3f}×) is within noise or tolerance; kept.",
        gain,
        False,
    )


_BAND_RATIO = 1.25


def _band(batch: float) -> int:
    """Load band of a window: requests running within 25% share one (0 and 1 running share the first)."""
    return math.floor(math.log(max(batch, 1.0)) / math.log(_BAND_RATIO))


def judge_at_matched_load(
    before_rates: Sequence[float],
    before_batches: Sequence[float | None],
    after_rates: Sequence[float],
    after_batches: Sequence[float | None],
    *,
    tolerance: float = 0.05,
    z: float = 2.0,
    min_windows: int = 3,
) -> Verdict:
    """:func:`judge` on windows at a load seen on both sides. Without batch sizes (older audit rows, an
    engine without the running gauge) it is :func:`judge` on all windows."""
    if len(before_batches) != len(before_rates) or len(after_batches) != len(after_rates):
        return judge(before_rates, after_rates, tolerance=tolerance, z=z, min_windows=min_windows)
    if any(b is None for b in (*before_batches, *after_batches)):
        return judge(before_rates, after_rates, tolerance=tolerance, z=z, min_windows=min_windows)
    before: dict[int, list[float]] = {}
    for rate, b in zip(before_rates, before_batches, strict=True):
        if b is not None:
            before.setdefault(_band(b), []).append(rate)
    after: dict[int, list[float]] = {}
    for rate, b in zip(after_rates, after_batches, strict=True):
        if b is not None:
            after.setdefault(_band(b), []).append(rate)
    common = sorted(k for k in before.keys() & after.keys() if statistics.fmean(before[k]) > 0)
    if len(before) <= 1 and len(after) <= 1 and common:
        return judge(before_rates, after_rates, tolerance=tolerance, z=z, min_windows=min_windows)  # one load
    norm_b = [r / statistics.fmean(before[k]) for k in common for r in before[k]]
    norm_a = [r / statistics.fmean(before[k]) for k in common for r in after[k]]
    if len(norm_b) < min_windows or len(norm_a) < min_windows:
        lo_b = min((b for b in before_batches if b is not None), default=0.0)
        hi_b = max((b for b in before_batches if b is not None), default=0.0)
        lo_a = min((b for b in after_batches if b is not None), default=0.0)
        hi_a = max((b for b in after_batches if b is not None), default=0.0)
        return Verdict(
            VerifyReason.NO_DATA,
            f"The load changed ({lo_b:.0f}–{hi_b:.0f} requests running before, {lo_a:.0f}–{hi_a:.0f} after): "
            f"{len(norm_b)} window(s) before and {len(norm_a)} after at a common load, {min_windows} each are needed "
            "to judge the change, so it is kept.",
            None,
            False,
        )
    verdict = judge(norm_b, norm_a, tolerance=tolerance, z=z, min_windows=min_windows)
    where = f"at matched load ({len(norm_b)} windows before, {len(norm_a)} after, {len(common)} load band(s))"
    gain = verdict.realized_gain
    text = {
        VerifyReason.REGRESSED: f"Throughput {where} fell to {gain:.3f}× of before, more than the {tolerance:.0%} "
        "tolerance and beyond noise: rolling back.",
        VerifyReason.IMPROVED: f"Throughput {where} rose {gain:.3f}×.",
        VerifyReason.NO_WORSE: f"Throughput {where} changed {gain:.3f}×: within noise or tolerance; kept.",
    }.get(verdict.reason, verdict.message)
    return Verdict(verdict.reason, text, gain, verdict.rollback)


def acceptance_shift(alpha_before: float, alpha_after: float, k_after: float) -> float:
    """E(K, α_after) / E(K, α_before), E(K, α) = (1 − α^{K+1}) / (1 − α) the tokens per step at K drafted
    tokens per step (a mean under a table: not necessarily whole). 1 when nothing was drafted."""
    for name, a in (("alpha_before", alpha_before), ("alpha_after", alpha_after)):
        if not (math.isfinite(a) and 0.0 <= a <= 1.0):
            raise ValueError(f"{name} must be in [0, 1] but got {a!r}")
    if not (math.isfinite(k_after) and k_after >= 0.0):
        raise ValueError(f"k_after must be ≥ 0 but got {k_after!r}")

    def tokens(alpha: float) -> float:
        return k_after + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k_after + 1.0)) / (1.0 - alpha)

    return tokens(alpha_after) / tokens(alpha_before)


SHIFT_MIN_DRAFTS = 200  # drafts each side needs before the acceptance shift is corrected for


def prompt_shift(
    before: SpecConfig | None,
    drafts_before: int | None,
    accepted_first_before: float | None,
    after_config: SpecConfig | None,
    after: Sequence[SpecCounters],
) -> tuple[float, str]:
    """(factor, note): how much the workload's acceptance alone moved tokens per step between a decision's
    evidence and the windows after a change of K under the same draft (:func:`acceptance_shift`); 1 for a
    draft swap (moving α is its point), or when either side drafted too little, or the decision's inputs
    lack the counts. Read at the first draft position, which every draft has at any K: a larger K's later,
    weaker positions must not pass for harder prompts."""
    if before is None or after_config is None or before.draft != after_config.draft:
        return 1.0, ""
    if drafts_before is None or drafts_before < SHIFT_MIN_DRAFTS or accepted_first_before is None:
        return 1.0, ""
    drafts_after = sum(s.drafts for s in after)
    if drafts_after < SHIFT_MIN_DRAFTS:
        return 1.0, ""
    first_after = sum(s.accepted_per_pos[0] for s in after if s.accepted_per_pos)
    alpha_before = min(max(accepted_first_before / drafts_before, 0.0), 1.0)
    alpha_after = min(max(first_after / drafts_after, 0.0), 1.0)
    k_after = sum(s.draft_tokens for s in after) / drafts_after
    shift = acceptance_shift(alpha_before, alpha_after, k_after)
    if abs(shift - 1.0) < 0.01:
        return 1.0, ""
    return shift, (
        f"Rates after the change divided by {shift:.3f}: the first draft token's acceptance moved "
        f"{alpha_before:.3f} → {alpha_after:.3f} with the prompts, which changes tokens per step under any "
        f"config (at the {k_after:.1f} tokens drafted per step after the change)."
    )

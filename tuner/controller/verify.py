"""Judge a change after its evaluation window: realized gain, and whether it regressed beyond noise.

Purely computational. The noise is the standard error of the difference of the mean per-window
throughput before and after (Welch); a change is a regression only if it lost more than the
tolerance AND the loss is more than ``z`` standard errors — one slow window is not a regression.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


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

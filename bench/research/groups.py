"""α per batch-size bucket and per workload class, and whether the groups really differ.

Purely computational. The tuner labels each window/step/request with a group key (a batch-size
bucket from :func:`batch_size_bucket`, a prompt-length bucket from :func:`prompt_length_bucket`, or any
hashable workload class) and this module estimates each group and tests a common α across them (G²,
χ² with groups − 1 degrees of freedom). Only when the groups differ is a per-group K worth it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from scipy import special, stats

from bench.research.estimators import estimate_alpha_pooled
from policies.acceptance import AlphaEstimate
from policies.counters import SpecCounters

DEFAULT_PROMPT_EDGES = (128, 512, 2048, 8192)


def batch_size_bucket(batch_size: int) -> tuple[int, int]:
    """Power-of-two buckets: 1, 2, 3–4, 5–8, 9–16, … (inclusive), matching the K table's ranges."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be an integer ≥ 1 but got {batch_size!r}")
    if batch_size <= 2:
        return (batch_size, batch_size)
    hi = 1 << (batch_size - 1).bit_length()
    return (hi // 2 + 1, hi)


def prompt_length_bucket(prompt_tokens: int, edges: Sequence[int] = DEFAULT_PROMPT_EDGES) -> str:
    """A label such as ``"129-512"``; the last bucket is open (``">8192"``)."""
    if prompt_tokens < 0:
        raise ValueError(f"prompt length cannot be negative but got {prompt_tokens}")
    if list(edges) != sorted(set(edges)) or not edges:
        raise ValueError(f"prompt-length edges must be strictly increasing but got {list(edges)}")
    lo = 0
    for edge in edges:
        if prompt_tokens <= edge:
            return f"{lo}-{edge}"
        lo = edge + 1
    return f">{edges[-1]}"


class GroupReason(StrEnum):
    GROUPS_DIFFER = "groups_differ"
    GROUPS_AGREE = "groups_agree"
    TOO_FEW_GROUPS = "too_few_groups"


@dataclass(frozen=True)
class GroupedAlpha:
    """α per group, and the test of one α for all of them."""

    estimates: dict[Hashable, AlphaEstimate] = field(repr=False)
    reason: GroupReason
    message: str
    statistic: float
    dof: int
    p_value: float | None


def estimate_by_group(
    items: Iterable[tuple[Hashable, SpecCounters]], confidence: float = 0.95, significance: float = 0.01
) -> GroupedAlpha:
    """Pool the items of each group (windows, steps or requests) and compare the groups."""
    grouped: dict[Hashable, list[SpecCounters]] = {}
    for key, counters in items:
        grouped.setdefault(key, []).append(counters)
    estimates = {key: estimate_alpha_pooled(members, confidence) for key, members in grouped.items()}
    usable = {k: e for k, e in estimates.items() if e.evidence is not None and e.evidence.trials > 0}
    if len(usable) < 2:
        return GroupedAlpha(
            estimates,
            GroupReason.TOO_FEW_GROUPS,
            "Fewer than two groups with drafts: nothing to compare.",
            0.0,
            0,
            None,
        )
    s = sum(e.evidence.successes for e in usable.values() if e.evidence is not None)
    f = sum(e.evidence.failures for e in usable.values() if e.evidence is not None)
    pooled = s / (s + f)
    g2 = 0.0
    for e in usable.values():
        assert e.evidence is not None and e.alpha is not None
        if 0 < pooled < 1:
            g2 += 2 * float(
                special.xlogy(e.evidence.successes, e.alpha / pooled)
                + special.xlogy(e.evidence.failures, (1 - e.alpha) / (1 - pooled))
            )
    dof = len(usable) - 1
    p = float(stats.chi2.sf(g2, dof))
    shown = ", ".join(f"{key}: {e.alpha:.3f}" for key, e in usable.items())
    if p < significance:
        return GroupedAlpha(
            estimates,
            GroupReason.GROUPS_DIFFER,
            f"α differs between groups ({shown}; p = {p:.2g}): choose K per group.",
            g2,
            dof,
            p,
        )
    return GroupedAlpha(
        estimates,
        GroupReason.GROUPS_AGREE,
        f"One α = {pooled:.3f} fits every group ({shown}; p = {p:.2g}).",
        g2,
        dof,
        p,
    )

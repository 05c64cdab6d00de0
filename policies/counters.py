"""Speculative-decoding counters over a window: the one input every acceptance estimator shares."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecCounters:
    """Counts for one engine and one config over a window (or since engine start).

    Notation as in docs/architecture.md: D drafts, T draft tokens, A accepted tokens, a_i accepted at 0-based
    position i. ``num_spec_tokens`` (K) is inferred from the number of positions when the source
    does not name it (vLLM's /metrics never names K).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)
    num_spec_tokens: int | None = None
    # Per-position draft counts, when the source has them (the in-engine plugin); /metrics lacks it.
    draft_tokens_per_pos: tuple[int, ...] | None = None
    generated_tokens: int = 0

    @property
    def k(self) -> int:
        """K: named explicitly, else the number of per-position counters, else T/D rounded."""
        if self.num_spec_tokens is not None:
            return self.num_spec_tokens
        if self.accepted_per_pos:
            return len(self.accepted_per_pos)
        if self.drafts > 0:
            return round(self.draft_tokens / self.drafts)
        return 0

    def __add__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pa = list(self.accepted_per_pos) + [0] * (n - len(self.accepted_per_pos))
        pb = list(other.accepted_per_pos) + [0] * (n - len(other.accepted_per_pos))
        per_pos_drafts: tuple[int, ...] | None = None
        if self.draft_tokens_per_pos is not None and other.draft_tokens_per_pos is not None:
            m = max(len(self.draft_tokens_per_pos), len(other.draft_tokens_per_pos))
            da = list(self.draft_tokens_per_pos) + [0] * (m - len(self.draft_tokens_per_pos))
            db = list(other.draft_tokens_per_pos) + [0] * (m - len(other.draft_tokens_per_pos))
            per_pos_drafts = tuple(x + y for x, y in zip(da, db, strict=True))
        k = self.num_spec_tokens if self.num_spec_tokens == other.num_spec_tokens else None
        return SpecCounters(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_per_pos=tuple(x + y for x, y in zip(pa, pb, strict=True)),
            num_spec_tokens=k,
            draft_tokens_per_pos=per_pos_drafts,
            generated_tokens=self.generated_tokens + other.generated_tokens,
        )

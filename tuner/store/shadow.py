"""Shadow evidence rows: what ``spectuner shadow run`` measured per draft candidate, and the latest of
each candidate for the draft list, the status and the controller's draft choice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select

from policies.acceptance import AcceptanceEvidence
from policies.shadow_replay import proposal_share
from tuner.store.models import ShadowEvidenceRow
from tuner.store.store import Store


@dataclass(frozen=True)
class ShadowResult:
    candidate: str
    method: str
    model_path: str | None
    computed_at: datetime
    samples: int
    output_tokens: int
    num_spec_tokens: int
    evidence: AcceptanceEvidence
    alpha: float | None
    alpha_ci: tuple[float, float] | None
    greedy_only: bool
    tokenizer_check: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def proposal_share(self) -> float | None:
        """Share of the replay's decode steps at which the candidate drafted (``policies.shadow_replay``)."""
        return proposal_share(self.evidence, self.samples, self.output_tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "method": self.method,
            "model_path": self.model_path,
            "computed_at": self.computed_at.isoformat(),
            "samples": self.samples,
            "output_tokens": self.output_tokens,
            "num_spec_tokens": self.num_spec_tokens,
            "drafts": int(self.evidence.drafts),
            "accepted_tokens": int(self.evidence.successes),
            "rejections": int(self.evidence.failures),
            "alpha": self.alpha,
            "alpha_ci": list(self.alpha_ci) if self.alpha_ci else None,
            "greedy_only": self.greedy_only,
            "tokenizer_check": self.tokenizer_check,
            "proposal_share": self.proposal_share,
            "details": self.details,
        }


def write_shadow_result(store: Store, result: ShadowResult) -> int:
    lo, hi = result.alpha_ci if result.alpha_ci else (None, None)
    with store.write_transaction() as conn:
        row_id = conn.execute(
            insert(ShadowEvidenceRow)
            .values(
                candidate=result.candidate,
                method=result.method,
                model_path=result.model_path,
                computed_at=result.computed_at,
                samples=result.samples,
                output_tokens=result.output_tokens,
                num_spec_tokens=result.num_spec_tokens,
                drafts=int(result.evidence.drafts),
                successes=result.evidence.successes,
                failures=result.evidence.failures,
                alpha=result.alpha,
                alpha_lo=lo,
                alpha_hi=hi,
                greedy_only=result.greedy_only,
                tokenizer_check=result.tokenizer_check,
                details=result.details,
            )
            .returning(ShadowEvidenceRow.id)
        ).scalar_one()
    return int(row_id)


def latest_shadow_results(store: Store, since: datetime | None = None) -> dict[str, ShadowResult]:
    """Per candidate, its newest shadow result (computed at or after ``since`` when given)."""
    newest = select(ShadowEvidenceRow.candidate, func.max(ShadowEvidenceRow.computed_at).label("at"))
    if since is not None:
        newest = newest.where(ShadowEvidenceRow.computed_at >= since)
    sub = newest.group_by(ShadowEvidenceRow.candidate).subquery()
    query = select(ShadowEvidenceRow).join(
        sub, (ShadowEvidenceRow.candidate == sub.c.candidate) & (ShadowEvidenceRow.computed_at == sub.c.at)
    )
    out: dict[str, ShadowResult] = {}
    with store.read_connection() as conn:
        for row in conn.execute(query).mappings():
            out[row["candidate"]] = _from_row(row)
    return out


def shadow_results(store: Store, since: datetime) -> list[ShadowResult]:
    """Every shadow result computed at or after ``since``, oldest first."""
    query = (
        select(ShadowEvidenceRow)
        .where(ShadowEvidenceRow.computed_at >= since)
        .order_by(ShadowEvidenceRow.computed_at, ShadowEvidenceRow.id)
    )
    with store.read_connection() as conn:
        return [_from_row(row) for row in conn.execute(query).mappings()]


def _from_row(row: Any) -> ShadowResult:
    ci = (row["alpha_lo"], row["alpha_hi"]) if row["alpha_lo"] is not None else None
    return ShadowResult(
        candidate=row["candidate"],
        method=row["method"],
        model_path=row["model_path"],
        computed_at=row["computed_at"],
        samples=int(row["samples"]),
        output_tokens=int(row["output_tokens"]),
        num_spec_tokens=int(row["num_spec_tokens"]),
        evidence=AcceptanceEvidence(float(row["successes"]), float(row["failures"]), float(row["drafts"])),
        alpha=row["alpha"],
        alpha_ci=ci,
        greedy_only=bool(row["greedy_only"]),
        tokenizer_check=row["tokenizer_check"],
        details=dict(row["details"] or {}),
    )


def shadow_evidence(store: Store, since: datetime, names: Sequence[str]) -> dict[str, AcceptanceEvidence]:
    """Per candidate in ``names``, the α evidence of its newest shadow result computed since ``since``."""
    wanted = set(names)
    return {n: r.evidence for n, r in latest_shadow_results(store, since).items() if n in wanted}

"""α by context length from the tap's stored per-request records (``policies.length_bands``): the one
reader ``spectuner status`` and the report share."""

from __future__ import annotations

from datetime import datetime

from policies.length_bands import LengthSettings, LengthView, RequestAcceptance, length_view
from tuner.store.store import Store


def context_length_view(
    store: Store,
    model_name: str,
    since: datetime | None,
    until: datetime | None,
    *,
    config_id: int | None = None,
    confidence: float = 0.95,
    edges: tuple[int, ...] | None = None,
) -> LengthView:
    """The length bands of ``model_name``'s requests in ``[since, until)`` (under ``config_id`` if given)."""
    records = store.requests(since, until, model_name=model_name, config_id=config_id)
    settings = LengthSettings(confidence=confidence) if edges is None else LengthSettings(edges, confidence=confidence)
    return length_view(
        [
            RequestAcceptance(
                r.prompt_tokens,
                r.output_tokens,
                r.num_spec_tokens,
                r.num_spec_steps,
                r.num_accepted_draft_tokens,
                r.acceptance_histogram,
                r.per_step_accepted,
                r.per_step_drafted,
            )
            for r in records
        ],
        settings,
    )

"""Candidates' prior α from the fleet (``[swap] fleet_prior``): the other engines of the same target in
this store that served a candidate's draft give it a hierarchical prior (``policies.fleet``) in place
of the operator-typed ``prior_alpha``. This engine's own history is left out here: the draft choice
adds it on top (``history``), so it is never counted twice.

An engine is one /metrics URL (all its data-parallel series together). Each engine's α evidence per
candidate is :func:`tuner.controller.evidence.measured_history` over its config periods within the
history horizon, with one :class:`HistoryCache` per engine kept in the controller's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from collectors.records import EngineKey
from policies.acceptance import AcceptanceEvidence
from policies.draft_choice import DraftCandidate
from policies.fleet import FleetPrior, prior_from_evidence
from tuner.controller.candidates import same_draft
from tuner.controller.evidence import HistoryCache, measured_history
from tuner.store import Store


def fleet_engines(store: Store, keys: Sequence[EngineKey]) -> dict[str, list[EngineKey]]:
    """The other engines serving this engine's target: /metrics URL → its series."""
    if not keys:
        return {}
    target = keys[0].model_name
    own = {k.url for k in keys}
    out: dict[str, list[EngineKey]] = {}
    for stored in store.engines():
        key = stored.key
        if key.model_name == target and key.url not in own:
            out.setdefault(key.url, []).append(key)
    return out


def with_fleet_priors(
    store: Store,
    keys: Sequence[EngineKey],
    now: datetime,
    horizon_s: float,
    candidates: Sequence[DraftCandidate],
    caches: dict[str, HistoryCache],
) -> tuple[tuple[DraftCandidate, ...], dict[str, FleetPrior]]:
    """``candidates`` with each prior α replaced by its fleet prior where the fleet has served the draft
    (the rest as configured), and every candidate's :class:`FleetPrior` (the reason included)."""
    by_engine: dict[str, dict[str, AcceptanceEvidence]] = {}
    for url, series in sorted(fleet_engines(store, keys).items()):
        cache = caches.setdefault(url, HistoryCache())
        by_engine[url] = measured_history(store, series, now, horizon_s, candidates, same_draft, cache)
    target = keys[0].model_name if keys else ""
    out: list[DraftCandidate] = []
    priors: dict[str, FleetPrior] = {}
    for c in candidates:
        evidence = {url: ev[c.name] for url, ev in by_engine.items() if c.name in ev}
        prior = prior_from_evidence(target, (c.method, c.path), evidence)
        priors[c.name] = prior
        if prior.mean is None or prior.strength_trials is None:
            out.append(c)
            continue
        out.append(
            replace(
                c,
                prior_alpha=prior.mean,
                prior_strength_trials=prior.strength_trials,
                prior_source=f"fleet ({prior.engines} engine(s))",
            )
        )
    return tuple(out), priors

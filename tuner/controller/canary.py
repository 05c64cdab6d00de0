"""Canary verification across replicas that share one store: a change goes to this replica first, is
judged against the untouched replicas over the same minutes (:func:`policies.canary.judge_canary`), and
is then promoted to them or rolled back here alone.

The sidecars of a fleet share the store and nothing else; the store is how they coordinate:

- a canary is a decision row like any change whose ``inputs["canary"]`` is its :class:`CanaryPlan`: the
  untouched replicas (peers: same target, same config in force as this one before the change, a window
  within ``peer_stale_s``) and that config, which a rollback restores;
- while a canary of a target is in flight, the other replicas of that target hold their own changes
  (their windows are its baseline) — :func:`canaries_in_flight`;
- two sidecars that record a canary at the same moment both see the other's row and both step back
  (:func:`contested`): never two canaries at once; they try again on a later tick;
- a canary that passes writes one ``promote`` order per peer (:func:`promote`); each peer's own
  controller applies it on its next tick, like an operator's override.

Samples, one per engine window after ``warmup_s`` (a restarted engine's first seconds are cold):
goodput (generated tokens per engine-second), TTFT p99 and TPOT p99 (vLLM's inter-token latency
histogram, per window), and the error rate (responses ≥ 500 per ``bucket_s`` per replica, from the
tap's request records; an error the tap made itself reaches no upstream and is not attributed). A metric
with no data on either side (no tap, an engine without the histogram) is left out and the verdict says
so; one with data on one side only keeps the canary undecided.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from collectors.records import EngineKey, RequestRecord, WindowRecord
from policies.canary import (
    CanaryDecision,
    CanarySettings,
    CanaryVerdict,
    Direction,
    MetricSamples,
    MetricSpec,
    Sample,
    judge_canary,
)
from policies.spec_config import SpecConfig
from tuner.config import CanarySection
from tuner.controller import manual
from tuner.controller.evidence import windows_under
from tuner.store import DecisionRecord, DecisionStatus, Store, StoredDecision

CANARY = "canary"  # the key of a decision's inputs that holds its plan
_TICK = timedelta(microseconds=1)


def _key_json(key: EngineKey) -> dict[str, str]:
    return {"url": key.url, "model_name": key.model_name, "engine": key.engine}


@dataclass(frozen=True)
class CanaryPlan:
    """Which replicas stay untouched as the baseline, and the config they (and the canary before the
    change) run."""

    peers: tuple[EngineKey, ...]
    previous: SpecConfig

    def to_json(self) -> dict[str, Any]:
        return {"peers": [_key_json(k) for k in self.peers], "previous": self.previous.to_vllm()}

    @classmethod
    def from_json(cls, data: object) -> CanaryPlan | None:
        """The plan in a decision's inputs; None for an ordinary decision (or an unreadable plan)."""
        if not isinstance(data, dict):
            return None
        try:
            peers = tuple(EngineKey(str(p["url"]), str(p["model_name"]), str(p["engine"])) for p in data["peers"])
            return cls(peers, SpecConfig.from_vllm(data["previous"]))
        except (KeyError, TypeError, ValueError):
            return None


def plan_of(d: StoredDecision) -> CanaryPlan | None:
    return CanaryPlan.from_json(d.decision.inputs.get(CANARY))


def find_peers(
    store: Store, keys: Sequence[EngineKey], previous: SpecConfig, now: datetime, settings: CanarySection
) -> tuple[EngineKey, ...]:
    """Replicas of this target in the store that run ``previous`` and were scraped lately (not this server)."""
    mine = {k.url for k in keys}
    model = keys[0].model_name
    since = now - timedelta(seconds=settings.peer_stale_s)
    peers = []
    for engine in store.engines():
        key = engine.key
        if key.url in mine or key.model_name != model:
            continue
        current = store.current_config(key)
        if current is None or current.config.spec.fingerprint != previous.fingerprint:
            continue
        if store.windows(key, since, now + _TICK, limit=1):
            peers.append(key)
    return tuple(sorted(peers, key=lambda k: (k.url, k.engine)))


def canaries_in_flight(store: Store, model_name: str, exclude: Sequence[EngineKey] = ()) -> list[StoredDecision]:
    """Canaries being applied or judged on engines serving ``model_name``, other than ``exclude``'s."""
    in_flight = store.decisions(status=(DecisionStatus.APPLYING, DecisionStatus.APPLIED))
    return canaries_among(in_flight, model_name, exclude)


def canaries_among(
    in_flight: Sequence[StoredDecision], model_name: str, exclude: Sequence[EngineKey] = ()
) -> list[StoredDecision]:
    """:func:`canaries_in_flight` from decisions already read (applying or applied)."""
    skip = {k.url for k in exclude}
    return [
        d
        for d in in_flight
        if plan_of(d) is not None
        and d.decision.engine is not None
        and d.decision.engine.model_name == model_name
        and d.decision.engine.url not in skip
    ]


def contested(store: Store, keys: Sequence[EngineKey], decision_id: int) -> StoredDecision | None:
    """Another replica's canary recorded alongside ours (``decision_id``): the one to step back for."""
    others = canaries_in_flight(store, keys[0].model_name, exclude=keys)
    return next((d for d in others if d.id != decision_id), None)


# -- samples --------------------------------------------------------------------------------------------
def _latency_p99(summary: Any) -> float | None:
    if summary is None or not summary.count or summary.p99_s is None or not math.isfinite(summary.p99_s):
        return None
    return float(summary.p99_s)


def window_samples(windows: Sequence[WindowRecord]) -> dict[str, list[Sample]]:
    """Per-window goodput and latency p99s at each window's end (seconds since the epoch)."""
    out: dict[str, list[Sample]] = {"goodput": [], "ttft_p99": [], "tpot_p99": []}
    for w in windows:
        if w.reset or w.duration_s <= 0:
            continue  # a restart's window mixes two engines
        t = w.end.timestamp()
        out["goodput"].append((t, w.generation_tokens / w.duration_s))
        for name, summary in (("ttft_p99", w.ttft), ("tpot_p99", w.itl)):
            p99 = _latency_p99(summary)
            if p99 is not None:
                out[name].append((t, p99))
    return out


def upstream_of(key: EngineKey) -> str:
    """The OpenAI API base the tap forwards to, from the engine series' metrics URL."""
    url = key.url.rstrip("/")
    return url[: -len("/metrics")] if url.endswith("/metrics") else url


def error_samples(requests: Sequence[RequestRecord], keys: Sequence[EngineKey], bucket_s: float) -> list[Sample]:
    """Share of responses ≥ 500 per time bucket and replica, for requests the tap sent to ``keys``' servers."""
    bucket_s = bucket_s if bucket_s > 0 else 60.0
    ups = {upstream_of(k) for k in keys}
    counts: dict[tuple[str, int], list[int]] = {}
    for r in requests:
        up = r.upstream_url.rstrip("/")
        if up not in ups:
            continue
        cell = counts.setdefault((up, math.floor(r.ts.timestamp() / bucket_s)), [0, 0])
        cell[0] += r.status_code >= 500
        cell[1] += 1
    return [((b + 0.5) * bucket_s, errors / total) for (_, b), (errors, total) in sorted(counts.items())]


def metric_specs(settings: CanarySection) -> dict[str, MetricSpec]:
    return {
        "goodput": MetricSpec("goodput", Direction.HIGHER_IS_BETTER, tolerance_rel=settings.goodput_tolerance_rel),
        "ttft_p99": MetricSpec("ttft_p99", Direction.LOWER_IS_BETTER, tolerance_rel=settings.latency_tolerance_rel),
        "tpot_p99": MetricSpec("tpot_p99", Direction.LOWER_IS_BETTER, tolerance_rel=settings.latency_tolerance_rel),
        "error_rate": MetricSpec("error_rate", Direction.LOWER_IS_BETTER, tolerance_abs=settings.error_rate_tolerance),
    }


@dataclass(frozen=True)
class CanaryJudgement:
    verdict: CanaryVerdict
    peers: tuple[EngineKey, ...]  # the untouched replicas judged against
    left_out: tuple[str, ...]  # metrics with no data on either side
    goodput_ratio: float | None  # canary ÷ baseline median goodput (the realized gain)

    def message(self) -> str:
        names = ", ".join(upstream_of(k) for k in self.peers)
        out = f"Canary against {len(self.peers)} untouched replica(s) ({names}): {self.verdict.decision.value}: "
        out += self.verdict.reason
        if self.left_out:
            out += f" Not judged (no data on either side): {', '.join(self.left_out)}."
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "canary": self.verdict.to_dict(),
            "peers": [_key_json(k) for k in self.peers],
            "left_out": list(self.left_out),
            "goodput_ratio": self.goodput_ratio,
        }


def _runs(store: Store, key: EngineKey, config: SpecConfig) -> bool:
    current = store.current_config(key)
    return current is not None and current.config.spec.fingerprint == config.fingerprint


def judge(
    store: Store,
    d: StoredDecision,
    plan: CanaryPlan,
    keys: Sequence[EngineKey],
    now: datetime,
    settings: CanarySection,
) -> CanaryJudgement | None:
    """The canary decision ``d`` judged now; None when no untouched replica is left to judge against
    (each peer still running the plan's config counts)."""
    peers = tuple(k for k in plan.peers if _runs(store, k, plan.previous))
    if not peers:
        return None
    start = d.updated_at + timedelta(seconds=settings.warmup_s)
    final = now >= d.updated_at + timedelta(seconds=settings.max_s)
    canary = window_samples(windows_under(store, keys, start, start, now + _TICK))
    baseline = window_samples(windows_under(store, peers, start, start, now + _TICK))
    if "error_rate" in settings.metrics:
        requests = store.requests(start, now + _TICK)
        canary["error_rate"] = error_samples(requests, keys, settings.bucket_s)
        baseline["error_rate"] = error_samples(requests, peers, settings.bucket_s)
    specs = metric_specs(settings)
    samples: dict[str, MetricSamples] = {}
    judged: list[MetricSpec] = []
    left_out: list[str] = []
    for name in settings.metrics:
        mine, theirs = canary.get(name, []), baseline.get(name, [])
        if not mine and not theirs:
            left_out.append(name)
            continue
        samples[name] = MetricSamples(mine, theirs)
        judged.append(specs[name])
    verdict = judge_canary(
        samples,
        judged,
        CanarySettings(
            confidence=settings.confidence,
            significance=settings.significance,
            min_samples=settings.min_samples,
            pass_score=settings.pass_score,
            bucket_s=settings.bucket_s,
        ),
        final=final,
    )
    if final and verdict.decision is CanaryDecision.UNDECIDED:  # nothing could be judged at all
        verdict = CanaryVerdict(
            CanaryDecision.ROLLBACK, verdict.score, verdict.metrics, verdict.span_s,
            f"the canary's time is up with nothing judged ({verdict.reason}); not spread.",
        )  # fmt: skip
    c_good = [v for _, v in canary["goodput"]]
    b_good = [v for _, v in baseline["goodput"]]
    ratio = None
    if c_good and b_good and statistics.median(b_good) > 0:
        ratio = statistics.median(c_good) / statistics.median(b_good)
    return CanaryJudgement(verdict, peers, tuple(left_out), ratio)


def promote(
    store: Store, d: StoredDecision, judgement: CanaryJudgement, target: SpecConfig, now: datetime
) -> list[int]:
    """One ``promote`` order per untouched replica; each replica's own controller applies it."""
    return [
        store.record_decision(
            DecisionRecord(
                created_at=now,
                action=manual.PROMOTE,
                reason="canary_passed",
                message=f"Promoted after canary decision {d.id} on {upstream_of(d.decision.engine or peer)} passed.",
                inputs={"by": "canary", "canary_decision": d.id},
                mode="canary",
                engine=peer,
                proposed_config=target.to_vllm(),
                predicted_gain=judgement.goodput_ratio,
                status=DecisionStatus.PROPOSED,
            )
        )
        for peer in judgement.peers
    ]


__all__ = [
    "CANARY",
    "CanaryJudgement",
    "CanaryPlan",
    "canaries_among",
    "canaries_in_flight",
    "contested",
    "error_samples",
    "find_peers",
    "judge",
    "plan_of",
    "promote",
    "upstream_of",
    "window_samples",
]

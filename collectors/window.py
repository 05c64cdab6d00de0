"""Turn two cumulative samples of one engine into a window of deltas, spotting engine restarts.

Pure. A restart resets every counter of the engine together, so a reset is decided per engine,
not per counter: if any counter went down, the ``_created`` time changed, or the speculative
config visibly changed (K, speculation on/off), the window counts from the restart — the delta is
the new cumulative value — and an ``EventRecord("counter_reset")`` says so. Deltas are never negative.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from collectors.exposition import E2E_LATENCY, ITL, ITL_LEGACY, TTFT
from collectors.histogram import Histogram, histogram_delta, summarize
from collectors.records import EngineSample, EventRecord, LatencySummary, WindowRecord
from policies.counters import SpecCounters

# Creation times are written with sub-millisecond precision; anything above this is a new process.
_CREATED_TOLERANCE_S = 1e-3


@dataclass(frozen=True)
class ResetCause:
    """Why a window was treated as starting at an engine restart."""

    kind: str  # "counter_decreased" | "created_changed" | "spec_config_changed"
    detail: str


def detect_reset(prev: EngineSample, cur: EngineSample) -> ResetCause | None:
    """The first sign that the engine restarted between ``prev`` and ``cur``, or None."""
    if (
        prev.created_s is not None
        and cur.created_s is not None
        and abs(cur.created_s - prev.created_s) > _CREATED_TOLERANCE_S
    ):
        return ResetCause(
            "created_changed", f"counters were re-created at {cur.created_s:.3f} (were {prev.created_s:.3f})"
        )
    for name, before, after in _counter_pairs(prev, cur):
        if after < before:
            return ResetCause("counter_decreased", f"{name} went down from {before:g} to {after:g}")
    if (prev.spec is None) != (cur.spec is None):
        state = "on" if cur.spec is not None else "off"
        return ResetCause("spec_config_changed", f"speculative decoding is now {state}")
    if (
        prev.spec is not None
        and cur.spec is not None
        and len(prev.spec.accepted_per_pos) != len(cur.spec.accepted_per_pos)
    ):
        return ResetCause(
            "spec_config_changed",
            f"the number of draft positions changed from {len(prev.spec.accepted_per_pos)} "
            f"to {len(cur.spec.accepted_per_pos)}",
        )
    for name, h in cur.histograms.items():
        old = prev.histograms.get(name)
        if old is not None and histogram_delta(old, h) is None:
            return ResetCause("counter_decreased", f"histogram {name} went down or changed its buckets")
    return None


def window_between(prev: EngineSample, cur: EngineSample) -> tuple[WindowRecord, list[EventRecord]]:
    """The window (prev.ts, cur.ts] for one engine, plus a counter_reset event when it restarted."""
    if prev.key != cur.key:
        raise ValueError(f"samples are from different engines: {prev.key} and {cur.key}")
    cause = detect_reset(prev, cur)
    events: list[EventRecord] = []
    start = prev.ts
    if cause is None:
        spec = _spec_delta(prev.spec, cur.spec) if cur.spec is not None else None
        generation = cur.generation_tokens - prev.generation_tokens
        prompt = cur.prompt_tokens - prev.prompt_tokens
        hists = {
            name: histogram_delta(prev.histograms[name], h) if name in prev.histograms else h
            for name, h in cur.histograms.items()
        }
    else:
        spec = cur.spec
        generation, prompt = cur.generation_tokens, cur.prompt_tokens
        hists = dict(cur.histograms)
        restarted = _restart_time(prev, cur)
        if restarted is not None:
            start = restarted
        events.append(
            EventRecord(
                ts=cur.ts,
                kind="counter_reset",
                message=(
                    f"engine {cur.key.engine} ({cur.key.model_name}) at {cur.key.url} restarted between "
                    f"{prev.ts.isoformat()} and {cur.ts.isoformat()}: {cause.detail}; "
                    "this window counts from the restart"
                ),
                severity="warning",
                engine=cur.key,
                data={"cause": cause.kind, "detail": cause.detail},
            )
        )
    record = WindowRecord(
        key=cur.key,
        start=start,
        end=cur.ts,
        spec=spec,
        generation_tokens=generation,
        prompt_tokens=prompt,
        requests_running=cur.requests_running,
        requests_waiting=cur.requests_waiting,
        kv_cache_usage=cur.kv_cache_usage,
        e2e_latency=_latency(hists, E2E_LATENCY),
        ttft=_latency(hists, TTFT),
        itl=_latency(hists, ITL) or _latency(hists, ITL_LEGACY),
        reset=cause is not None,
    )
    return record, events


def since_start(cur: EngineSample) -> WindowRecord:
    """The whole life of the engine as one window (what a single /metrics dump tells)."""
    start = datetime.fromtimestamp(cur.created_s, UTC) if cur.created_s is not None else cur.ts
    return WindowRecord(
        key=cur.key,
        start=min(start, cur.ts),
        end=cur.ts,
        spec=cur.spec,
        generation_tokens=cur.generation_tokens,
        prompt_tokens=cur.prompt_tokens,
        requests_running=cur.requests_running,
        requests_waiting=cur.requests_waiting,
        kv_cache_usage=cur.kv_cache_usage,
        e2e_latency=_latency(cur.histograms, E2E_LATENCY),
        ttft=_latency(cur.histograms, TTFT),
        itl=_latency(cur.histograms, ITL) or _latency(cur.histograms, ITL_LEGACY),
    )


def _counter_pairs(prev: EngineSample, cur: EngineSample) -> list[tuple[str, float, float]]:
    pairs = [
        ("vllm:generation_tokens_total", prev.generation_tokens, cur.generation_tokens),
        ("vllm:prompt_tokens_total", prev.prompt_tokens, cur.prompt_tokens),
    ]
    if prev.spec is not None and cur.spec is not None:
        p, c = prev.spec, cur.spec
        pairs += [
            ("vllm:spec_decode_num_drafts_total", p.drafts, c.drafts),
            ("vllm:spec_decode_num_draft_tokens_total", p.draft_tokens, c.draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens_total", p.accepted_tokens, c.accepted_tokens),
        ]
        pairs += [
            (f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}", a, b)
            for i, (a, b) in enumerate(zip(p.accepted_per_pos, c.accepted_per_pos, strict=False))
        ]
    return pairs


def _spec_delta(prev: SpecCounters | None, cur: SpecCounters) -> SpecCounters:
    if prev is None:
        return cur
    return SpecCounters(
        drafts=cur.drafts - prev.drafts,
        draft_tokens=cur.draft_tokens - prev.draft_tokens,
        accepted_tokens=cur.accepted_tokens - prev.accepted_tokens,
        accepted_per_pos=tuple(c - p for p, c in zip(prev.accepted_per_pos, cur.accepted_per_pos, strict=True)),
        num_spec_tokens=cur.num_spec_tokens,
        generated_tokens=cur.generated_tokens - prev.generated_tokens,
    )


def _restart_time(prev: EngineSample, cur: EngineSample) -> datetime | None:
    """When the engine restarted, if its creation time says so and lies inside the window."""
    if cur.created_s is None:
        return None
    restarted = datetime.fromtimestamp(cur.created_s, UTC)
    return restarted if prev.ts < restarted <= cur.ts else None


def _latency(hists: dict[str, Histogram | None] | dict[str, Histogram], name: str) -> LatencySummary | None:
    return summarize(hists.get(name))

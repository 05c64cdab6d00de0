"""Counters from saved ``/metrics`` dumps: one dump (totals since start) or two (the delta between).

The same parser and the same window logic as the live collector, so an offline estimate and a
stored window agree to the token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from collectors.errors import ScrapeError, ScrapeErrorReason
from collectors.exposition import parse_metrics_page
from collectors.records import EngineKey, EngineSample
from collectors.window import detect_reset, window_between
from policies.counters import SpecCounters


@dataclass(frozen=True)
class EngineCounters:
    """Spec counters of one engine over what the dump(s) cover. ``spec`` None: speculation off."""

    model_name: str
    engine: str
    spec: SpecCounters | None
    reset: bool = False  # the engine restarted between the two dumps: counts are since the restart
    note: str = ""


class DumpError(ValueError):
    """A dump that cannot be used: unreadable, or not a trustworthy /metrics page."""


def read_dump(path: Path) -> list[EngineSample]:
    """Parse one saved /metrics page; ``DumpError`` says what is wrong with it."""
    save = f"save one with `curl -s http://HOST:PORT/metrics > {path}`"
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise DumpError(f"{path}: no such file; {save}") from exc
    except IsADirectoryError as exc:
        raise DumpError(f"{path} is a directory, not a /metrics page; {save}") from exc
    except OSError as exc:
        raise DumpError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    if raw.startswith(b"\x1f\x8b"):
        raise DumpError(f"{path} is gzip-compressed: `gunzip` it first, or {save}")
    nul = raw.find(b"\x00")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        nul = exc.start if nul < 0 else min(nul, exc.start)
    if nul >= 0:
        raise DumpError(f"{path} is binary data (byte {nul}), not a text /metrics page; {save}")
    try:
        # The dump's own time is unknown; windows from dumps carry no meaningful timestamps.
        return parse_metrics_page(text, url=str(path), ts=datetime.fromtimestamp(0, UTC), source=str(path))
    except ScrapeError as exc:
        hint = ""
        if exc.reason is ScrapeErrorReason.TRUNCATED:
            hint = " (was the download interrupted?)"
        raise DumpError(f"{exc}{hint}") from exc


def engine_counters(first: list[EngineSample], second: list[EngineSample] | None) -> list[EngineCounters]:
    """Per engine: totals of ``first`` alone, or ``second`` − ``first`` (restart-aware)."""
    if second is None:
        return [EngineCounters(s.key.model_name, s.key.engine, s.spec) for s in first]
    before = {_label_key(s.key): s for s in first}
    out: list[EngineCounters] = []
    for cur in second:
        prev = before.get(_label_key(cur.key))
        if prev is None:
            out.append(
                EngineCounters(
                    cur.key.model_name,
                    cur.key.engine,
                    cur.spec,
                    reset=True,
                    note="not in the first dump: counted since it started",
                )
            )
            continue
        # Re-key the earlier sample: the two dumps have different "URLs" (their file names).
        prev = replace(prev, key=cur.key)
        window, _events = window_between(prev, cur)
        cause = detect_reset(prev, cur)
        out.append(
            EngineCounters(
                cur.key.model_name,
                cur.key.engine,
                window.spec,
                reset=window.reset,
                note=f"restarted between the dumps ({cause.detail}): counted since the restart" if cause else "",
            )
        )
    return out


def looks_swapped(first: list[EngineSample], second: list[EngineSample]) -> bool:
    """True when the second dump looks older than the first: every engine "restarted" between them
    one way, and none did the other way (the dumps were given newest first)."""
    forward = engine_counters(first, second)
    if not forward or not all(c.reset for c in forward):
        return False
    return not any(c.reset for c in engine_counters(second, first))


class MixedKError(ValueError):
    """Engines with different K cannot be summed into one α estimate."""


def total(counters: list[EngineCounters]) -> SpecCounters | None:
    """Sum over the engines that speculate; None when none does.

    Engines must share K: α̂ = A / (A + D − a_{K−1}) needs one K, and a sum across Ks would count
    an engine's full-acceptance drafts at the wrong position.
    """
    specs = [c.spec for c in counters if c.spec is not None]
    if not specs:
        return None
    # Engines that drafted nothing add nothing, and must not impose their K on the sum.
    active = [s for s in specs if s.drafts > 0] or specs[:1]
    ks = sorted({s.k for s in active})
    if len(ks) > 1:
        raise MixedKError(f"engines run different K ({', '.join(map(str, ks))}): use --by-engine")
    result = active[0]
    for s in active[1:]:
        result = result + s
    return result


def _label_key(key: EngineKey) -> tuple[str, str]:
    return key.model_name, key.engine

"""Hypothesis fuzzing of the /metrics parser on mutated real pages.

Whatever the bytes, parsing either succeeds or raises ScrapeError (nothing else escapes), and a
window between any two pages that parse is never negative.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from collectors.errors import ScrapeError
from collectors.exposition import parse_metrics_page
from collectors.records import EngineSample, WindowRecord
from collectors.window import window_between

DATA = Path(__file__).resolve().parents[2] / "data"
# Real pages from the lab engine first; synthetic multi-engine pages too.
PAGES = [p.read_text() for p in sorted(DATA.glob("lab_*.prom"))] + [
    (DATA / n).read_text() for n in ("synthetic_dp2_k3_a.prom", "synthetic_dp2_k3_b.prom", "synthetic_k5.prom")
]
T0 = datetime(2026, 12, 1, tzinfo=UTC)
NASTY_VALUES = [
    "NaN",
    "-1",
    "+Inf",
    "-Inf",
    "1e400",
    "0.5",
    "-0",
    "1_000",
    "0x10",
    "",
    "٣",
    "1e-9",
    "99999999999",
]
NASTY_TEXT = ["{", "}", '"', "\\", "\n", "#", " ", "=", ",", "\x00", "é", "_total", "\r", "\t"]


def parse(text: str) -> list[EngineSample] | None:
    try:
        samples = parse_metrics_page(text, url="http://e/metrics", ts=T0)
    except ScrapeError as err:
        assert err.reason.value and str(err)
        event(f"rejected: {err.reason.value}")
        return None
    event("parsed")
    return samples


@st.composite
def mutated_page(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(PAGES))
    lines = text.split("\n")
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["value", "char", "delete", "duplicate", "truncate", "swap", "drop", "labels"]))
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        if kind == "value" and " " in line and not line.startswith("#"):
            head = line.rsplit(" ", 1)[0]
            value = draw(st.sampled_from(NASTY_VALUES) | st.floats(allow_nan=True).map(repr))
            lines[i] = f"{head} {value}"
        elif kind == "char" and line:
            j = draw(st.integers(0, len(line)))
            lines[i] = line[:j] + draw(st.sampled_from(NASTY_TEXT) | st.text(max_size=3)) + line[j:]
        elif kind == "delete" and line:
            j = draw(st.integers(0, len(line) - 1))
            k = draw(st.integers(j + 1, min(len(line), j + 12)))
            lines[i] = line[:j] + line[k:]
        elif kind == "duplicate":
            lines.insert(i, line)
        elif kind == "truncate":
            joined = "\n".join(lines)
            cut = draw(st.integers(0, len(joined)))
            lines = joined[:cut].split("\n")
        elif kind == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "drop":
            del lines[i]
        elif kind == "labels" and "{" in line:
            lines[i] = line.replace('engine="0"', draw(st.sampled_from(['engine="1"', "", 'engine=""', "engine=0"])))
        if not lines:
            lines = [""]
    return "\n".join(lines)


def assert_not_negative(window: WindowRecord) -> None:
    assert window.generation_tokens >= 0
    assert window.prompt_tokens >= 0
    if window.spec is not None:
        s = window.spec
        assert min(s.drafts, s.draft_tokens, s.accepted_tokens, s.generated_tokens) >= 0
        assert all(a >= 0 for a in s.accepted_per_pos)
    for summary in (window.e2e_latency, window.ttft, window.itl):
        if summary is not None:
            assert summary.count >= 0 and summary.sum_s >= 0


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_page())
def test_parser_only_ever_raises_scrape_error(text: str) -> None:
    samples = parse(text)
    if samples is not None:
        for s in samples:
            assert s.generation_tokens >= 0 and s.prompt_tokens >= 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_page(), mutated_page())
def test_windows_between_any_two_good_pages_are_never_negative(first: str, second: str) -> None:
    prev_samples, cur_samples = parse(first), parse(second)
    if not prev_samples or not cur_samples:
        return
    prev_by_key = {(s.key.model_name, s.key.engine): s for s in prev_samples}
    for cur in cur_samples:
        prev = prev_by_key.get((cur.key.model_name, cur.key.engine))
        if prev is None:
            continue
        window, events = window_between(prev, replace(cur, ts=T0 + timedelta(seconds=10)))
        assert_not_negative(window)
        assert window.reset == bool(events)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=2000), st.booleans())
def test_arbitrary_bytes_never_crash(raw: bytes, newline: bool) -> None:
    parse(raw.decode("utf-8", errors="replace") + ("\n" if newline else ""))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([*NASTY_TEXT, "vllm:generation_tokens_total", "1", " 2", "model_name=", "engine"])))
def test_arbitrary_token_soup_never_crashes(tokens: list[str]) -> None:
    parse("".join(tokens) + "\n")

"""Parsing real-format vLLM /metrics pages into per-engine samples, and rejecting bad ones."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from collectors.errors import ScrapeError, ScrapeErrorReason
from collectors.exposition import E2E_LATENCY, ITL, TTFT, parse_metrics_page, spec_inconsistency
from policies.counters import SpecCounters

DATA = Path(__file__).resolve().parents[2] / "data"
TS = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def page(name: str) -> str:
    return (DATA / name).read_text()


def lab_pages() -> list[Path]:
    return sorted(DATA.glob("lab_*.prom"))


def all_pages() -> list[Path]:
    return sorted(DATA.glob("*.prom"))


def naive_value(text: str, name: str, **labels: str) -> float:
    """Independent reading of one sample: a plain line scan, no parser shared with the code."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.rindex("}") + 1]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels}")


def parse(text: str) -> list:
    return parse_metrics_page(text, url="http://engine:8000/metrics", ts=TS)


# --- good pages ----------------------------------------------------------------------------------


def test_two_engine_page_gives_one_sample_per_engine_with_the_page_values() -> None:
    text = page("synthetic_dp2_k3_b.prom")
    samples = parse(text)
    assert [(s.key.model_name, s.key.engine) for s in samples] == [("target", "0"), ("target", "1")]
    for s in samples:
        e = s.key.engine
        assert s.key.url == "http://engine:8000/metrics"
        assert s.ts == TS
        assert s.spec is not None
        assert s.spec.drafts == naive_value(text, "vllm:spec_decode_num_drafts_total", engine=e)
        assert s.spec.draft_tokens == naive_value(text, "vllm:spec_decode_num_draft_tokens_total", engine=e)
        assert s.spec.accepted_tokens == naive_value(text, "vllm:spec_decode_num_accepted_tokens_total", engine=e)
        assert s.spec.accepted_per_pos == tuple(
            naive_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", engine=e, position=str(p))
            for p in range(3)
        )
        assert s.spec.k == 3
        assert s.generation_tokens == naive_value(text, "vllm:generation_tokens_total", engine=e)
        assert s.spec.generated_tokens == s.generation_tokens
        assert s.prompt_tokens == naive_value(text, "vllm:prompt_tokens_total", engine=e)
        assert s.requests_running == naive_value(text, "vllm:num_requests_running", engine=e)
        assert s.requests_waiting == naive_value(text, "vllm:num_requests_waiting", engine=e)
        assert s.kv_cache_usage == naive_value(text, "vllm:kv_cache_usage_perc", engine=e)
        assert s.cache_config["block_size"] == "16"
        assert "engine" not in s.cache_config and "model_name" not in s.cache_config
        assert s.created_s == 1_765_000_000.0
        assert set(s.histograms) == {E2E_LATENCY, TTFT, ITL}
        buckets, count, total = s.histograms[E2E_LATENCY]
        assert count == naive_value(text, "vllm:e2e_request_latency_seconds_count", engine=e)
        assert total == naive_value(text, "vllm:e2e_request_latency_seconds_sum", engine=e)
        assert buckets[-1] == (math.inf, count)
        assert dict(buckets)[1.0] == naive_value(text, "vllm:e2e_request_latency_seconds_bucket", engine=e, le="1.0")


def test_page_without_spec_metrics_means_speculation_off() -> None:
    (sample,) = parse(page("synthetic_nospec.prom"))
    assert sample.spec is None
    assert sample.generation_tokens > 0


def test_k_is_the_number_of_positions() -> None:
    (sample,) = parse(page("synthetic_k5.prom"))
    assert sample.spec is not None and sample.spec.k == 5


@pytest.mark.parametrize("path", all_pages(), ids=lambda p: p.name)
def test_every_saved_page_parses_and_is_consistent(path: Path) -> None:
    samples = parse(path.read_text())
    assert samples, "each saved page has at least one engine"
    for s in samples:
        if s.spec is not None:
            assert spec_inconsistency(s.spec) is None


@pytest.mark.skipif(not lab_pages(), reason="no page saved from the lab engine yet")
@pytest.mark.parametrize("path", lab_pages(), ids=lambda p: p.name)
def test_real_lab_pages_match_a_naive_reading(path: Path) -> None:
    text = path.read_text()
    for s in parse(text):
        labels = {"engine": s.key.engine, "model_name": s.key.model_name}
        assert s.generation_tokens == naive_value(text, "vllm:generation_tokens_total", **labels)
        if s.spec is not None:
            assert s.spec.drafts == naive_value(text, "vllm:spec_decode_num_drafts_total", **labels)
            assert s.spec.accepted_tokens == naive_value(text, "vllm:spec_decode_num_accepted_tokens_total", **labels)


def test_escaped_label_values_are_read_by_prometheus_rules() -> None:
    text = page("synthetic_nospec.prom").replace('model_name="target"', 'model_name="my \\"big\\" model\\\\v1"')
    (sample,) = parse(text)
    assert sample.key.model_name == 'my "big" model\\v1'
    assert sample.histograms[E2E_LATENCY][1] > 0  # bucket lines took the general label path


def test_windows_line_endings_are_accepted() -> None:
    text = page("synthetic_k5.prom")
    assert parse(text.replace("\n", "\r\n"))[0].spec == parse(text)[0].spec


def test_timestamps_on_samples_are_accepted() -> None:
    text = page("synthetic_k5.prom")
    line = next(x for x in text.splitlines() if x.startswith("vllm:spec_decode_num_drafts_total"))
    text = text.replace(line, line + " 1765000000000")
    assert parse(text)[0].spec == parse(page("synthetic_k5.prom"))[0].spec


# --- bad pages: a clear typed error, never a record -------------------------------------------------


def replace_value(text: str, name: str, new: str, engine: str = "0") -> str:
    pattern = re.compile(rf"^({re.escape(name)}\{{[^}}]*engine=\"{engine}\"[^}}]*\}}) \S+$", re.M)
    out, n = pattern.subn(rf"\g<1> {new}", text, count=1)
    assert n == 1, name
    return out


SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
GEN = "vllm:generation_tokens_total"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda t: "", ScrapeErrorReason.EMPTY),
        (lambda t: "   \n\n", ScrapeErrorReason.EMPTY),
        (lambda t: t[: t.index(SPEC_DRAFTS + "{") + 60], ScrapeErrorReason.TRUNCATED),
        (lambda t: t[:-1], ScrapeErrorReason.TRUNCATED),
        (lambda t: replace_value(t, SPEC_DRAFTS, "NaN"), ScrapeErrorReason.INVALID_VALUE),
        (lambda t: replace_value(t, SPEC_DRAFTS, "-3.0"), ScrapeErrorReason.INVALID_VALUE),
        (lambda t: replace_value(t, SPEC_DRAFTS, "+Inf"), ScrapeErrorReason.INVALID_VALUE),
        (lambda t: replace_value(t, GEN, "12.5"), ScrapeErrorReason.INVALID_VALUE),
        (lambda t: replace_value(t, "vllm:num_preemptions_total", "NaN"), ScrapeErrorReason.INVALID_VALUE),
        (lambda t: replace_value(t, "vllm:kv_cache_usage_perc", "NaN"), ScrapeErrorReason.INVALID_VALUE),
        (
            lambda t: replace_value(t, "vllm:e2e_request_latency_seconds_bucket", "-1"),
            ScrapeErrorReason.INVALID_VALUE,
        ),
        (
            lambda t: replace_value(t, "vllm:spec_decode_num_drafts_created", "NaN"),
            ScrapeErrorReason.INVALID_VALUE,
        ),
        (lambda t: t + t.splitlines()[2] + "\n", ScrapeErrorReason.DUPLICATE_SERIES),
        (
            lambda t: t.replace("\n# HELP vllm:generation_tokens_total", "\nthis is not prometheus\n# HELP x", 1),
            ScrapeErrorReason.MALFORMED,
        ),
        (lambda t: replace_value(t, GEN, "12abc"), ScrapeErrorReason.MALFORMED),
        (lambda t: t.replace('position="1"', 'position="x"', 1), ScrapeErrorReason.MALFORMED),
        (lambda t: t.replace('le="0.5"', 'le="half"', 1), ScrapeErrorReason.MALFORMED),
        (lambda t: replace_value(t, SPEC_ACCEPTED, "999999"), ScrapeErrorReason.INCONSISTENT),
        (lambda t: replace_value(t, SPEC_DRAFT_TOKENS, "1"), ScrapeErrorReason.INCONSISTENT),
        (lambda t: _drop_lines(t, SPEC_DRAFTS + "{"), ScrapeErrorReason.INCONSISTENT),
        (lambda t: _drop_lines(t, 'position="1"'), ScrapeErrorReason.INCONSISTENT),
        (
            lambda t: _drop_lines(t, 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"'),
            ScrapeErrorReason.INCONSISTENT,
        ),
        (
            lambda t: replace_value(t, "vllm:e2e_request_latency_seconds_count", "1"),
            ScrapeErrorReason.INCONSISTENT,
        ),
    ],
    ids=[
        "empty",
        "blank",
        "cut-mid-line",
        "no-final-newline",
        "nan-counter",
        "negative-counter",
        "inf-counter",
        "fractional-tokens",
        "nan-unread-counter",
        "nan-gauge",
        "negative-bucket",
        "nan-created",
        "duplicate-series",
        "garbage-line",
        "garbage-value",
        "bad-position",
        "bad-le",
        "accepted-gt-drafted",
        "draft-tokens-lt-accepted",
        "missing-drafts-counter",
        "missing-position",
        "histogram-without-inf",
        "histogram-count-mismatch",
    ],
)
def test_bad_pages_raise_a_typed_error(mutate: Callable[[str], str], reason: ScrapeErrorReason) -> None:
    bad = mutate(page("synthetic_dp2_k3_b.prom"))
    with pytest.raises(ScrapeError) as info:
        parse(bad)
    assert info.value.reason is reason, str(info.value)
    assert str(info.value).startswith("http://engine:8000/metrics: ")  # says where


def _drop_lines(text: str, needle: str) -> str:
    lines = text.splitlines(keepends=True)
    kept = [x for x in lines if not (needle in x and not x.startswith("#"))]
    assert len(kept) < len(lines)
    return "".join(kept)


def test_duplicate_series_with_labels_in_another_order_is_caught() -> None:
    text = page("synthetic_k5.prom")
    line = next(x for x in text.splitlines() if x.startswith(GEN + "{"))
    value = line.rsplit(" ", 1)[1]
    with pytest.raises(ScrapeError) as info:
        parse(text + f'{GEN}{{model_name="target",engine="0"}} {value}\n')
    assert info.value.reason is ScrapeErrorReason.DUPLICATE_SERIES


def test_truncation_message_says_the_page_was_cut() -> None:
    text = page("synthetic_k5.prom")
    with pytest.raises(ScrapeError, match="cut short"):
        parse(text[: len(text) // 2])


@pytest.mark.parametrize(
    ("counters", "problem"),
    [
        (SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_pos=(6, 4, 2)), None),
        (
            SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=31, accepted_per_pos=()),
            "accepted tokens",
        ),
        (SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_pos=(6, 4, 1)), "sum to"),
        (
            SpecCounters(drafts=5, draft_tokens=30, accepted_tokens=12, accepted_per_pos=(6, 4, 2)),
            "position 0",
        ),
        (
            SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_pos=(5, 2, 5)),
            "position 2",
        ),
    ],
)
def test_spec_inconsistency_names_the_broken_invariant(counters: SpecCounters, problem: str | None) -> None:
    found = spec_inconsistency(counters)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


@pytest.mark.skipif(
    not all((DATA / n).exists() for n in ("lab_nospec.prom", "lab_weak_k5.prom")), reason="lab pages not saved"
)
def test_real_pages_without_speculation_and_at_k5() -> None:
    (off,) = parse(page("lab_nospec.prom"))
    assert off.spec is None and off.generation_tokens > 0
    (weak,) = parse(page("lab_weak_k5.prom"))
    assert weak.spec is not None and weak.spec.k == 5 and weak.spec.drafts > 0
    # A weaker draft accepts less per position than the good one at K=3.
    (good,) = parse(page("lab_good_k3_loaded.prom"))
    assert good.spec is not None
    assert weak.spec.accepted_per_pos[0] / weak.spec.drafts < good.spec.accepted_per_pos[0] / good.spec.drafts

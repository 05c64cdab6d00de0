"""Parse one vLLM ``/metrics`` page (Prometheus text format) into one ``EngineSample`` per engine.

Pure: text in, typed samples out, or a ``ScrapeError`` saying why the page cannot be trusted. A page
is all-or-nothing: one bad series rejects the page, so no record is ever built from a bad scrape.

Notes on prometheus_client's parser (the one we use): it strips ``_total`` from a counter's family
name but not from its samples, and vLLM's pages carry a separate ``<name>_created`` gauge per counter
and histogram. We therefore key on *sample* names, and use the ``_created`` values to spot an engine
restart even when the new counters have already grown past the old ones.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import parse_labels, text_string_to_metric_families

from collectors.errors import ScrapeError, ScrapeErrorReason
from collectors.records import EngineKey, EngineSample
from policies.counters import SpecCounters

SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

E2E_LATENCY = "vllm:e2e_request_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
# Older vLLM (before the inter-token rename) exposes the same histogram under this name.
ITL_LEGACY = "vllm:time_per_output_token_seconds"
LATENCY_HISTOGRAMS = (E2E_LATENCY, TTFT, ITL, ITL_LEGACY)

_SPEC_TOTALS = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)
# Counters we read, by sample name (``_total`` kept, as the parser leaves it on samples).
_COUNTER_SAMPLES = {
    f"{SPEC_DRAFTS}_total": SPEC_DRAFTS,
    f"{SPEC_DRAFT_TOKENS}_total": SPEC_DRAFT_TOKENS,
    f"{SPEC_ACCEPTED}_total": SPEC_ACCEPTED,
    f"{GENERATION_TOKENS}_total": GENERATION_TOKENS,
    f"{PROMPT_TOKENS}_total": PROMPT_TOKENS,
}
_GAUGES = {REQUESTS_RUNNING, REQUESTS_WAITING, KV_CACHE_USAGE}
_HIST_PARTS = {f"{h}{suffix}": (h, suffix) for h in LATENCY_HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")}
_ENGINE_LABELS = ("model_name", "engine")
# Fractional parts this small are float noise on an integer count, not a fractional count.
_INTEGRAL_TOLERANCE = 1e-6


@dataclass
class _Hist:
    buckets: dict[float, float] = field(default_factory=dict)
    count: float | None = None
    sum: float | None = None


@dataclass
class _Engine:
    """Mutable accumulator for one (model_name, engine) while the page is read."""

    counters: dict[str, float] = field(default_factory=dict)
    per_pos: dict[int, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    hists: dict[str, _Hist] = field(default_factory=dict)
    created_s: list[float] = field(default_factory=list)


# Sample lines of the text format: name, optional {labels}, value, optional timestamp (ms). Matched
# over the whole page at once (C speed); a page where some non-comment line does not match is
# malformed.
_VALUE = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|[Nn][Aa][Nn]|[Ii]nf(?:inity)?)"
_SAMPLE_LINES = re.compile(
    rf"^[ \t]*([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{[^\n]*\}})?[ \t]+({_VALUE})(?:[ \t]+-?\d+)?[ \t\r]*$", re.M
)
_SAMPLE_LINE = re.compile(_SAMPLE_LINES.pattern[1:-1])  # the same, for one line
_OTHER_LINES = re.compile(r"^[ \t\r]*(?:#[^\n]*)?$", re.M)  # comments and blank lines
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
# How vLLM (prometheus_client) writes labels: sorted, no escapes. Anything else takes the general path.
_VLLM_BUCKET_LABELS = re.compile(r'\{engine="([^"\\]*)",le="([^"\\]*)",model_name="([^"\\]*)"\}')
_VLLM_ENGINE_LABELS = re.compile(r'\{engine="([^"\\]*)",model_name="([^"\\]*)"\}')

# The counters α is estimated from go through prometheus_client's parser, the reference reading of
# the format.
_PARSED_SAMPLES = frozenset(f"{n}_total" for n in (*_COUNTER_SAMPLES.values(), SPEC_ACCEPTED_PER_POS))
# The rest of what we read — histogram buckets above all (over 20 per histogram per engine), gauges,
# creation times — is taken straight from the line regex: the pure-Python parser costs tens of
# microseconds a line, which would blow the per-scrape budget on a 55 KB page. Every line of the
# page is still checked for form, duplicates and counter values either way.
_FAST_SAMPLES = frozenset(
    [f"{n}_created" for n in (*_COUNTER_SAMPLES.values(), SPEC_ACCEPTED_PER_POS, *LATENCY_HISTOGRAMS)]
    + [f"{h}{suffix}" for h in LATENCY_HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")]
    + [*_GAUGES, CACHE_CONFIG_INFO]
)

_WANTED_SAMPLES = _PARSED_SAMPLES | _FAST_SAMPLES
# A vLLM counter or histogram count that is negative, NaN or infinite, anywhere on the page.
_BAD_COUNT = re.compile(
    r"^[ \t]*vllm:[a-zA-Z0-9_:]*(?:_total|_bucket|_count)(?:\{[^\n]*\})?[ \t]+"
    r"(?:-(?!0*\.?0*(?:[eE][-+]?\d+)?(?:[ \t\r]|$))|[+]?(?:[Nn][Aa][Nn]|[Ii]nf))[^\n]*$",
    re.M,
)

LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class _RawSample:
    name: str
    labels: dict[str, str]
    key: LabelKey  # sorted labels, for duplicate detection
    value: float


def _split_page(text: str, src: str) -> tuple[str, list[_RawSample]]:
    """Check every line of the page and return (the sample lines prometheus_client should parse,
    the samples read here). Raises on a malformed line, a duplicate series or a bad count.

    A page must end with a newline: the text format always does, and a page cut mid-line would
    otherwise parse as a smaller, wrong number (``12345`` cut to ``12``).
    """
    if not text.strip():
        raise ScrapeError(ScrapeErrorReason.EMPTY, "the /metrics page is empty", source=src)
    if not text.endswith("\n"):
        last = text.rsplit("\n", 1)[-1][:80]
        raise ScrapeError(
            ScrapeErrorReason.TRUNCATED,
            f"the page does not end with a newline (last line {last!r}); it was cut short",
            source=src,
        )
    body = text[:-1]
    samples = _SAMPLE_LINES.findall(body)
    lines = body.count("\n") + 1
    # Every line is a sample, a comment or blank. Cheap count first (comments start their line on
    # vLLM pages); the regex count only when that does not add up (blank or indented lines).
    if len(samples) + body.count("\n#") + body.startswith("#") != lines and (
        len(samples) + len(_OTHER_LINES.findall(body)) != lines
    ):
        raise _first_bad_line(body, src)
    series = [name + labels for name, labels, _ in samples]
    if len(set(series)) != len(series):
        seen: set[str] = set()
        for s in series:
            if s in seen:
                raise ScrapeError(
                    ScrapeErrorReason.DUPLICATE_SERIES, f"series {s} appears twice on one page", source=src
                )
            seen.add(s)
    # The regex below is the check; these substring tests (C speed) only skip it on clean pages.
    values = {v for _, _, v in samples}
    maybe_bad = any(v[0] == "-" or v[-1] in "fFnNyY" for v in values)  # -x, nan, inf, infinity
    bad = _BAD_COUNT.search(body) if maybe_bad else None
    if bad is not None:
        raise ScrapeError(
            ScrapeErrorReason.INVALID_VALUE,
            f"{bad.group(0).strip()}: a counter must be finite and non-negative",
            source=src,
        )
    keep: list[str] = []
    fast: list[_RawSample] = []
    label_cache: dict[str, tuple[dict[str, str], LabelKey]] = {}
    # Only the lines we read reach Python code; the rest was checked above, in C.
    for name, labels_text, value_text in [t for t in samples if t[0] in _WANTED_SAMPLES]:
        if name in _PARSED_SAMPLES:
            keep.append(f"{name}{labels_text} {value_text}")
            continue
        cached = label_cache.get(labels_text)
        if cached is None:
            labels = _parse_labels(labels_text, src)
            cached = label_cache[labels_text] = (labels, tuple(sorted(labels.items())))
        fast.append(_RawSample(name, cached[0], cached[1], float(value_text)))
    return "\n".join(keep) + "\n", fast


def _first_bad_line(body: str, src: str) -> ScrapeError:
    for number, line in enumerate(body.split("\n"), start=1):
        if _OTHER_LINES.fullmatch(line) is None and _SAMPLE_LINE.fullmatch(line) is None:
            return ScrapeError(
                ScrapeErrorReason.MALFORMED,
                f"line {number} is not a valid sample line: {line[:120]!r}",
                source=src,
            )
    return ScrapeError(ScrapeErrorReason.MALFORMED, "the page has lines that are not valid", source=src)


def _parse_labels(labels_text: str, src: str) -> dict[str, str]:
    if not labels_text:
        return {}
    m = _VLLM_BUCKET_LABELS.fullmatch(labels_text)
    if m is not None:
        return {"engine": m.group(1), "le": m.group(2), "model_name": m.group(3)}
    m = _VLLM_ENGINE_LABELS.fullmatch(labels_text)
    if m is not None:
        return {"engine": m.group(1), "model_name": m.group(2)}
    inner = labels_text[1:-1]
    if "\\" in inner:  # escapes: let prometheus_client's own label parser handle them
        try:
            return parse_labels(inner)
        except ValueError as exc:
            raise ScrapeError(ScrapeErrorReason.MALFORMED, f"bad labels {labels_text[:120]!r}", source=src) from exc
    labels: dict[str, str] = {}
    pos = 0
    for m in _LABEL.finditer(inner):
        if m.start() != pos or m.group(1) in labels:
            break
        labels[m.group(1)] = m.group(2)
        pos = m.end()
    if pos != len(inner):
        raise ScrapeError(ScrapeErrorReason.MALFORMED, f"bad labels {labels_text[:120]!r}", source=src)
    return labels


def _parse_families(text: str, src: str) -> list[Metric]:
    try:
        return list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on bad input
        raise ScrapeError(
            ScrapeErrorReason.MALFORMED,
            f"not valid Prometheus text format ({type(exc).__name__}: {str(exc)[:200]})",
            source=src,
        ) from exc


def parse_metrics_page(text: str, *, url: str, ts: datetime, source: str = "") -> list[EngineSample]:
    """One ``EngineSample`` per (model_name, engine) label pair found on the page, sorted by key.

    Raises ``ScrapeError`` for anything that makes the page untrustworthy: malformed text, a cut
    page, duplicate series, NaN / infinite / negative / fractional counts, spec counters that
    contradict each other. A page with no spec-decode counters gives ``spec=None`` (speculation off).
    """
    src = source or url
    text = text.removeprefix("\ufeff")  # a byte-order mark (a page saved by a Windows editor) is not a line
    kept, fast = _split_page(text, src)
    engines: dict[tuple[str, str], _Engine] = {}
    cache_config: dict[str, dict[str, str]] = {}
    seen: set[tuple[str, LabelKey]] = set()

    def add(name: str, labels: dict[str, str], key: LabelKey, value: float) -> None:
        series = (name, key)
        if series in seen:
            raise ScrapeError(
                ScrapeErrorReason.DUPLICATE_SERIES,
                f"series {_fmt(name, labels)} appears twice on one page",
                source=src,
            )
        seen.add(series)
        if name == CACHE_CONFIG_INFO:
            cache_config[labels.get("engine", "0")] = {k: v for k, v in labels.items() if k not in _ENGINE_LABELS}
            return
        model = labels.get("model_name")
        if model is None:
            return
        engine_key = (model, labels.get("engine", "0"))
        acc = engines.get(engine_key)
        if acc is None:
            acc = engines[engine_key] = _Engine()
        _accumulate(acc, name, labels, value, src)

    for family in _parse_families(kept, src):
        for sample in family.samples:
            add(sample.name, sample.labels, tuple(sorted(sample.labels.items())), float(sample.value))
    for raw in fast:
        add(raw.name, raw.labels, raw.key, raw.value)

    return [
        _build_sample(EngineKey(url=url, model_name=model, engine=engine), acc, ts, cache_config, src)
        for (model, engine), acc in sorted(engines.items())
    ]


def _accumulate(acc: _Engine, name: str, labels: dict[str, str], value: float, src: str) -> None:
    if name in _COUNTER_SAMPLES:
        acc.counters[_COUNTER_SAMPLES[name]] = value
        return
    if name == f"{SPEC_ACCEPTED_PER_POS}_total":
        pos_label = labels.get("position", "")
        if not pos_label.isdigit():
            raise ScrapeError(
                ScrapeErrorReason.MALFORMED,
                f"{_fmt(name, labels)}: position label {pos_label!r} is not a non-negative integer",
                source=src,
            )
        acc.per_pos[int(pos_label)] = value
        return
    if name.endswith("_created"):
        if not math.isfinite(value) or value < 0:
            raise ScrapeError(
                ScrapeErrorReason.INVALID_VALUE,
                f"{_fmt(name, labels)} = {value!r}: a creation time must be a finite Unix time",
                source=src,
            )
        acc.created_s.append(value)
        return
    if name in _GAUGES:
        if not math.isfinite(value) or value < 0:
            raise ScrapeError(
                ScrapeErrorReason.INVALID_VALUE,
                f"{_fmt(name, labels)} = {value!r}: must be finite and non-negative",
                source=src,
            )
        acc.gauges[name] = value
        return
    part = _HIST_PARTS.get(name)
    if part is not None:
        hist_name, suffix = part
        _check_count(name, labels, value, src, integral=False)
        hist = acc.hists.get(hist_name)
        if hist is None:
            hist = acc.hists[hist_name] = _Hist()
        if suffix == "_bucket":
            hist.buckets[_parse_le(labels.get("le"), name, labels, src)] = value
        elif suffix == "_count":
            hist.count = value
        else:
            hist.sum = value


def _build_sample(
    key: EngineKey, acc: _Engine, ts: datetime, cache_config: dict[str, dict[str, str]], src: str
) -> EngineSample:
    counters = acc.counters
    for name in (GENERATION_TOKENS, PROMPT_TOKENS):
        if name in counters:
            _check_count(f"{name}_total", _labels(key), counters[name], src, integral=True)
    return EngineSample(
        key=key,
        ts=ts,
        spec=_spec_counters(key, acc, src),
        generation_tokens=counters.get(GENERATION_TOKENS, 0.0),
        prompt_tokens=counters.get(PROMPT_TOKENS, 0.0),
        requests_running=acc.gauges.get(REQUESTS_RUNNING),
        requests_waiting=acc.gauges.get(REQUESTS_WAITING),
        kv_cache_usage=acc.gauges.get(KV_CACHE_USAGE),
        cache_config=dict(cache_config.get(key.engine, {})),
        histograms={name: _histogram(key, name, h, src) for name, h in sorted(acc.hists.items())},
        created_s=min(acc.created_s) if acc.created_s else None,
    )


def _spec_counters(key: EngineKey, acc: _Engine, src: str) -> SpecCounters | None:
    present = [n for n in _SPEC_TOTALS if n in acc.counters]
    if not present and not acc.per_pos:
        return None  # speculation is off on this engine: not an error
    missing = [n for n in _SPEC_TOTALS if n not in acc.counters]
    if missing:
        raise ScrapeError(
            ScrapeErrorReason.INCONSISTENT,
            f"engine {key.engine} ({key.model_name}) has {', '.join(present) or 'per-position counters'} "
            f"but not {', '.join(missing)}: a partial page",
            source=src,
        )
    labels = _labels(key)
    drafts = _as_int(f"{SPEC_DRAFTS}_total", labels, acc.counters[SPEC_DRAFTS], src)
    draft_tokens = _as_int(f"{SPEC_DRAFT_TOKENS}_total", labels, acc.counters[SPEC_DRAFT_TOKENS], src)
    accepted = _as_int(f"{SPEC_ACCEPTED}_total", labels, acc.counters[SPEC_ACCEPTED], src)
    positions = sorted(acc.per_pos)
    if positions != list(range(len(positions))):
        raise ScrapeError(
            ScrapeErrorReason.INCONSISTENT,
            f"engine {key.engine}: per-position counters for positions {positions}, expected 0..K-1",
            source=src,
        )
    per_pos = tuple(
        _as_int(f"{SPEC_ACCEPTED_PER_POS}_total", {**labels, "position": str(p)}, acc.per_pos[p], src)
        for p in positions
    )
    generated = _as_int(f"{GENERATION_TOKENS}_total", labels, acc.counters.get(GENERATION_TOKENS, 0.0), src)
    counters = SpecCounters(
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        accepted_per_pos=per_pos,
        generated_tokens=generated,
    )
    problem = spec_inconsistency(counters)
    if problem:
        raise ScrapeError(
            ScrapeErrorReason.INCONSISTENT, f"engine {key.engine} ({key.model_name}): {problem}", source=src
        )
    return counters


def spec_inconsistency(c: SpecCounters) -> str | None:
    """What makes these counters impossible, or None. vLLM counts a_i for a draft only when
    positions 0..i were all accepted, so a_0 ≤ D, a_i ≤ a_{i−1}, Σa_i = A ≤ T."""
    if c.accepted_tokens > c.draft_tokens:
        return f"accepted tokens {c.accepted_tokens} > draft tokens {c.draft_tokens}"
    if c.accepted_per_pos:
        if sum(c.accepted_per_pos) != c.accepted_tokens:
            return (
                f"per-position accepted counts sum to {sum(c.accepted_per_pos)}, "
                f"not to accepted tokens {c.accepted_tokens}"
            )
        if c.accepted_per_pos[0] > c.drafts:
            return f"accepted at position 0 ({c.accepted_per_pos[0]}) > drafts ({c.drafts})"
        for i in range(1, len(c.accepted_per_pos)):
            if c.accepted_per_pos[i] > c.accepted_per_pos[i - 1]:
                return (
                    f"accepted at position {i} ({c.accepted_per_pos[i]}) > at position {i - 1} "
                    f"({c.accepted_per_pos[i - 1]})"
                )
    return None


def _histogram(key: EngineKey, name: str, h: _Hist, src: str) -> tuple[tuple[tuple[float, float], ...], float, float]:
    if h.count is None or h.sum is None or math.inf not in h.buckets:
        raise ScrapeError(
            ScrapeErrorReason.INCONSISTENT,
            f"histogram {name} for engine {key.engine} lacks its _count, _sum or +Inf bucket",
            source=src,
        )
    buckets = tuple(sorted(h.buckets.items()))
    prev = 0.0
    for le, cum in buckets:
        if cum < prev:
            raise ScrapeError(
                ScrapeErrorReason.INCONSISTENT,
                f"histogram {name} for engine {key.engine}: bucket le={le} count {cum} < previous {prev}",
                source=src,
            )
        prev = cum
    if buckets[-1][1] != h.count:
        raise ScrapeError(
            ScrapeErrorReason.INCONSISTENT,
            f"histogram {name} for engine {key.engine}: +Inf bucket {buckets[-1][1]} != _count {h.count}",
            source=src,
        )
    return buckets, h.count, h.sum


def _parse_le(le: str | None, name: str, labels: dict[str, str], src: str) -> float:
    try:
        bound = float(le) if le is not None else math.nan
    except ValueError:
        bound = math.nan
    if math.isnan(bound):
        raise ScrapeError(ScrapeErrorReason.MALFORMED, f"{_fmt(name, labels)}: bad or missing 'le' label", source=src)
    return bound


def _check_count(name: str, labels: dict[str, str], value: float, src: str, *, integral: bool) -> None:
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ScrapeError(
            ScrapeErrorReason.INVALID_VALUE,
            f"{_fmt(name, labels)} = {value!r}: a counter must be a finite, non-negative number",
            source=src,
        )
    if integral and abs(value - round(value)) > _INTEGRAL_TOLERANCE:
        raise ScrapeError(
            ScrapeErrorReason.INVALID_VALUE,
            f"{_fmt(name, labels)} = {value!r}: a token count must be a whole number",
            source=src,
        )


def _as_int(name: str, labels: dict[str, str], value: float, src: str) -> int:
    _check_count(name, labels, value, src, integral=True)
    return round(value)


def _labels(key: EngineKey) -> dict[str, str]:
    return {"engine": key.engine, "model_name": key.model_name}


def _fmt(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name



"""Benchmark: parse + delta of a real vLLM /metrics page (target ≤ 5 ms per scrape).

Side by side in one run:
- ``spectuner``: what the collector does per scrape — ``parse_metrics_page`` on the new page and
  ``window_between`` against the previous sample of every engine;
- ``prometheus_client (whole page)``: the naive way, prometheus_client's parser over every line.

The pages are two saved from the lab engine minutes apart (tests/data/lab_good_k3_loaded*.prom),
else the two-engine synthetic pair. Prints the figures and writes bench/results/scrape.json.

    .venv/bin/python bench/bench_scrape.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from collectors.exposition import parse_metrics_page  # noqa: E402
from collectors.window import window_between  # noqa: E402

DATA = REPO / "tests" / "data"
RESULTS = REPO / "bench" / "results"
TARGET_MS = 5.0


def pick_pages() -> tuple[Path, str, str]:
    """(page file, its text, an earlier page of the same engines to delta against)."""
    cur, prev = DATA / "lab_good_k3_loaded_more.prom", DATA / "lab_good_k3_loaded.prom"
    if cur.exists() and prev.exists():  # real pages of one engine, minutes apart
        return cur, cur.read_text(), prev.read_text()
    cur = DATA / "synthetic_dp2_k3_b.prom"
    return cur, cur.read_text(), (DATA / "synthetic_dp2_k3_a.prom").read_text()


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    for _ in range(5):  # warm-up: imports, regex compilation, caches
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
        "min_ms": round(ordered[0], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    path, text, earlier = pick_pages()
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    prev = {s.key: s for s in parse_metrics_page(earlier, url="http://e/metrics", ts=t0)}
    t1 = t0 + timedelta(seconds=10)

    def ours() -> None:
        for sample in parse_metrics_page(text, url="http://e/metrics", ts=t1):
            window_between(prev[sample.key], sample)

    def naive() -> None:
        for family in text_string_to_metric_families(text):
            for _ in family.samples:
                pass

    # Interleave the two so machine noise hits both alike.
    ours_ms: list[float] = []
    naive_ms: list[float] = []
    for _ in range(max(1, args.repeats // 50)):
        ours_ms += timed(ours, 50)
        naive_ms += timed(naive, 10)

    engines = len(parse_metrics_page(text, url="http://e/metrics", ts=t1))
    result = {
        "benchmark": "scrape_parse_delta",
        "page": str(path.relative_to(REPO)),
        "page_bytes": len(text.encode()),
        "page_lines": text.count("\n"),
        "engines": engines,
        "target_ms": TARGET_MS,
        "spectuner_parse_and_delta": summary(ours_ms),
        "prometheus_client_whole_page_parse": summary(naive_ms),
        "speedup_vs_whole_page_parse": round(statistics.median(naive_ms) / statistics.median(ours_ms), 2),
        "meets_target": statistics.median(ours_ms) <= TARGET_MS,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            # The machine is shared: a load above the CPU count inflates medians; minima show the code.
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": os.getloadavg()[0],
        },
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scrape.json").write_text(json.dumps(result, indent=2) + "\n")

    print(f"page: {result['page']} ({result['page_bytes']} bytes, {result['page_lines']} lines, {engines} engine(s))")
    print(f"machine load (1 min) {load_before:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':38} {'min':>9} {'median':>9} {'p90':>9} {'p99':>9}")
    for label, key in (
        ("spectuner parse + delta", "spectuner_parse_and_delta"),
        ("prometheus_client, whole page", "prometheus_client_whole_page_parse"),
    ):
        s = result[key]
        assert isinstance(s, dict)
        print(f"{label:38} {s['min_ms']:>7.2f}ms {s['median_ms']:>7.2f}ms {s['p90_ms']:>7.2f}ms {s['p99_ms']:>7.2f}ms")
    print(
        f"speed-up vs whole-page parse: {result['speedup_vs_whole_page_parse']}x; "
        f"target ≤ {TARGET_MS} ms: {'met' if result['meets_target'] else 'NOT met'}"
    )
    print(f"wrote {RESULTS / 'scrape.json'}")


if __name__ == "__main__":
    main()

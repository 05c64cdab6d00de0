"""Benchmark: what a draft swap costs clients under each apply strategy, on the CPU lab engine.

Per strategy (``restart``, ``drain_hold``, ``blue_green``), one after the other, each on a fresh
engine: the lab engine starts with the weak draft at K=3 behind an in-process tap; 4 clients
(2 streaming, 2 not) send greedy completions back to back through the tap; after a steady stretch
the actuator swaps to the good draft; the load runs on a while and stops. Reported side by side:

- p50/p99 latency of requests entirely before the change (steady) and of requests that overlapped
  it (started before it ended and ended after it began), and their ratio;
- requests failed or cut short (the restart strategy's are the comparison: a plain reverse proxy
  in front of a restarting engine; a client pauses 1 s after a failure), requests held and the
  longest hold (from the front door), total change time (the apply call), drain and warm-up time.

Writes bench/results/apply.json and bench/results/apply.md.

    PYTHONPATH=. .venv/bin/python bench/bench_apply.py [--strategies restart,drain_hold,blue_green]
        [--steady-s 20] [--after-s 10]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tuner.actuators.base import ApplyStatus  # noqa: E402
from tuner.lab.apply_load import Outcome, SteadyLoad, lab_strategy_actuator  # noqa: E402
from tuner.lab.models import DEFAULT_MODELS_DIR, build_models  # noqa: E402
from tuner.lab.prompts import HARD, PREDICTABLE  # noqa: E402
from tuner.lab.serve import SERVED_MODEL_NAME, speculative_config  # noqa: E402

RESULTS = REPO / "bench" / "results"
PROMPTS = list(PREDICTABLE[:3]) + list(HARD[:3])
STRATEGIES = ("restart", "drain_hold", "blue_green")


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(latencies: list[float]) -> dict[str, Any]:
    return {"requests": len(latencies), "p50_s": quantile(latencies, 0.5), "p99_s": quantile(latencies, 0.99)}


def run_one(strategy: str, models_dir: Path, steady_s: float, after_s: float) -> dict[str, Any]:
    manifest = build_models(models_dir)
    weak, good = speculative_config(manifest, "weak", 3), speculative_config(manifest, "good", 3)
    assert weak is not None and good is not None
    with tempfile.TemporaryDirectory(prefix="bench-apply-") as work:
        actuator, tap = lab_strategy_actuator(strategy, models_dir, Path(work) / "engine")
        try:
            started = actuator.start(weak)
            if started.status is not ApplyStatus.APPLIED:
                raise RuntimeError(f"{strategy}: engine did not start: {started.message}")
            load = SteadyLoad(tap.url, SERVED_MODEL_NAME, PROMPTS, concurrency=4, max_tokens=24).start()
            time.sleep(steady_s)
            t0 = time.monotonic()
            result = actuator.apply(good)
            t1 = time.monotonic()
            time.sleep(after_s)
            outcomes: list[Outcome] = load.stop()
        finally:
            actuator.stop()
            tap.stop()
    steady = [o.latency_s for o in outcomes if o.ok and o.ended_s <= t0]
    overlap = [o for o in outcomes if o.started_s < t1 and o.ended_s > t0]
    failed = [o for o in outcomes if not o.ok]
    impact = result.impact
    row: dict[str, Any] = {
        "strategy": strategy,
        "status": result.status.value,
        "message": result.message,
        "change_s": t1 - t0,
        "requests": len(outcomes),
        "failed": len(failed),
        "failed_overlapping": sum(1 for o in overlap if not o.ok),
        "truncated_streams": sum(1 for o in failed if o.stream and o.status == 200),
        "steady": summarize(steady),
        "overlapping": summarize([o.latency_s for o in overlap if o.ok]),
        "requests_held": impact.requests_held if impact else None,
        "longest_hold_s": impact.longest_hold_s if impact else None,
        "drain_s": impact.drain_s if impact else None,
        "warmup_s": impact.warmup_s if impact else None,
        "first_errors": sorted({f"{o.status} {o.error[:80]}" for o in failed})[:3],
    }
    s99, o99 = row["steady"]["p99_s"], row["overlapping"]["p99_s"]
    row["p99_ratio_overlapping_to_steady"] = o99 / s99 if s99 and o99 else None
    return row


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Apply strategies: a draft swap (weak → good, K=3) under 4 concurrent clients",
        "",
        f"{meta['when']}, {meta['machine']}; `bench/bench_apply.py` (steady {meta['steady_s']:g} s before, "
        f"{meta['after_s']:g} s after). Latency in seconds; overlapping = requests in flight at any time during "
        "the change.",
        "",
        "| strategy | status | change s | requests | failed | held | longest hold s | drain s | warm-up s "
        "| steady p50 | steady p99 | overlapping p50 | overlapping p99 | p99 × steady |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['status']} | {fmt(r['change_s'], '.1f')} | {r['requests']} | {r['failed']} "
            f"| {fmt(r['requests_held'], 'd')} | {fmt(r['longest_hold_s'], '.1f')} | {fmt(r['drain_s'])} "
            f"| {fmt(r['warmup_s'], '.1f')} | {fmt(r['steady']['p50_s'])} | {fmt(r['steady']['p99_s'])} "
            f"| {fmt(r['overlapping']['p50_s'])} | {fmt(r['overlapping']['p99_s'])} "
            f"| {fmt(r['p99_ratio_overlapping_to_steady'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--after-s", type=float, default=10.0)
    args = parser.parse_args()
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    rows = []
    for strategy in strategies:
        print(f"== {strategy}", flush=True)
        row = run_one(strategy, args.models_dir, args.steady_s, args.after_s)
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    meta = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {platform.python_version()}, shared 2-core box",
        "steady_s": args.steady_s,
        "after_s": args.after_s,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "apply.json").write_text(json.dumps({"meta": meta, "strategies": rows}, indent=1) + "\n")
    md = markdown(rows, meta)
    (RESULTS / "apply.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

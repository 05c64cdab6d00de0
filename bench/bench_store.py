"""Store ingest: per-request and per-step rows per second, SQLite and PostgreSQL side by side.

For each backend and row kind, three ways of writing the same records in batches, measured in one
run so the ratios are honest on whatever machine runs it:

- ``store``: ``Store.write_steps`` / ``Store.write_requests`` as the collectors call them
  (validation + encoding + one transaction per batch);
- ``core``: the textbook path, a Core ``insert()`` executemany of one dict per row through the
  models' types (no validation, so it is flattered);
- ``driver``: pre-encoded rows straight to the driver the way the store sends them (SQLite: multi-row
  ``INSERT`` statements by ``executemany``; PostgreSQL: ``COPY``), one transaction per batch: the
  floor for this schema on this machine;
- ``driver_1row`` (SQLite only): the same pre-encoded rows, one row per executed statement (the
  textbook ``executemany``): what the multi-row statement saves.

SQLite runs on a file with the store's settings (WAL, synchronous=NORMAL). PostgreSQL is a throwaway
local PostgreSQL 15 (``tests/integration/pg.py``) with its default durability (fsync on).

The ``hot_paths`` case times two per-batch costs of the daemon's writer threads, each with and
without its saving, side by side on SQLite (writes ``bench/results/store_hot_paths.json``):

- ``tagging``: ``ConfigTaggingSink.write_steps`` on batches of step records of one series under one
  config, the sink's clock moving 0.5 s per batch as the step writer's does: the remembered config
  (re-checked every ``CONFIG_CACHE_TTL_S``) vs a ``config_at`` query per batch (``cache_ttl_s=0``),
  and the store's ``write_steps`` alone (no tagging) as the floor;
- ``sample_append``: ``SampleStore.append`` of one sample at a time, ``state.json`` saved at most
  every ``state_save_interval_s`` (default) vs on every append (interval 0).

    .venv/bin/python bench/bench_store.py [--rows 100000] [--batch 1000] [--repeats 3] [--cases ingest,hot_paths]

Prints tables and writes ``bench/results/store.json`` (ingest). Target: ≥ 50 000 rows/s on SQLite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sqlalchemy import insert  # noqa: E402

from collectors.records import EngineKey, RequestRecord, StepRecord  # noqa: E402
from collectors.traffic_record import RecorderSettings, SampleStore, TrafficSample  # noqa: E402
from policies.counters import SpecCounters  # noqa: E402
from tuner.store import Store, upgrade  # noqa: E402
from tuner.store.ingest import request_values, step_values  # noqa: E402
from tuner.store.records import EngineConfigRecord  # noqa: E402
from tuner.store.store import requests_t, steps_t  # noqa: E402
from tuner.store.tagging import CONFIG_CACHE_TTL_S, ConfigTaggingSink  # noqa: E402

TARGET_SQLITE_ROWS_PER_S = 50_000
RESULTS = REPO / "bench" / "results" / "store.json"
HOT_RESULTS = REPO / "bench" / "results" / "store_hot_paths.json"
T0 = datetime(2026, 3, 1, tzinfo=UTC)


def make_steps(n: int) -> list[StepRecord]:
    keys = [EngineKey("http://127.0.0.1:8000/metrics", "llama", str(e)) for e in range(2)]
    out = []
    for i in range(n):
        k = 3 + i % 3
        per_pos = tuple(max(0, 8 - 2 * p - i % 2) for p in range(k))
        out.append(
            StepRecord(
                ts=T0 + timedelta(microseconds=500 * i),
                key=keys[i % 2],
                batch_size=1 + i % 64,
                step_time_s=0.012 + (i % 17) * 1e-4,
                spec=SpecCounters(
                    drafts=8,
                    draft_tokens=8 * k,
                    accepted_tokens=sum(per_pos),
                    accepted_per_pos=per_pos,
                    num_spec_tokens=k,
                    draft_tokens_per_pos=(8,) * k,
                    generated_tokens=8 + sum(per_pos),
                ),
                num_scheduled_tokens=64 + i % 32,
            )
        )
    return out


def make_requests(n: int) -> list[RequestRecord]:
    out = []
    for i in range(n):
        hist = (i % 5, 2 + i % 3, 4, 10 + i % 7)
        steps = sum(hist)
        accepted = hist[1] + 2 * hist[2] + 3 * hist[3]
        out.append(
            RequestRecord(
                ts=T0 + timedelta(milliseconds=i),
                request_id=f"cmpl-{i:08d}",
                model_name="llama",
                prompt_tokens=100 + i % 900,
                output_tokens=steps + accepted,
                latency_s=0.4 + (i % 100) * 0.01,
                num_spec_tokens=3,
                num_spec_steps=steps,
                num_draft_tokens=3 * steps,
                num_accepted_draft_tokens=accepted,
                acceptance_histogram=hist,
                mean_acceptance_length=1 + accepted / steps,
                draft_acceptance_rate=accepted / (3 * steps),
                upstream_url="http://127.0.0.1:8000",
                streamed=bool(i % 2),
            )
        )
    return out


def step_dict(rec: StepRecord, engine_id: int) -> dict[str, Any]:
    sp = rec.spec
    return {
        "engine_id": engine_id,
        "config_id": None,
        "ts": rec.ts,
        "batch_size": rec.batch_size,
        "step_time_s": rec.step_time_s,
        "num_scheduled_tokens": rec.num_scheduled_tokens,
        "num_spec_tokens": sp.num_spec_tokens,
        "drafts": sp.drafts,
        "draft_tokens": sp.draft_tokens,
        "accepted_tokens": sp.accepted_tokens,
        "accepted_per_pos": list(sp.accepted_per_pos),
        "draft_tokens_per_pos": list(sp.draft_tokens_per_pos or ()),
        "generated_tokens": sp.generated_tokens,
    }


def request_dict(rec: RequestRecord) -> dict[str, Any]:
    return {
        "ts": rec.ts,
        "request_id": rec.request_id,
        "model_name": rec.model_name,
        "upstream_url": rec.upstream_url,
        "config_id": None,
        "prompt_tokens": rec.prompt_tokens,
        "output_tokens": rec.output_tokens,
        "latency_s": rec.latency_s,
        "num_spec_tokens": rec.num_spec_tokens,
        "drafts": rec.num_spec_steps,
        "draft_tokens": rec.num_draft_tokens,
        "accepted_tokens": rec.num_accepted_draft_tokens,
        "acceptance_histogram": list(rec.acceptance_histogram),
        "mean_acceptance_length": rec.mean_acceptance_length,
        "draft_acceptance_rate": rec.draft_acceptance_rate,
        "per_step_accepted": None,
        "per_step_drafted": None,
        "streamed": rec.streamed,
        "status_code": rec.status_code,
    }


def batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds. On a shared machine the CPU figure is what the
    code itself costs (for SQLite, which runs in-process, nearly all of it); wall time is what a
    collector sees right now, load included."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_way(url: str, way: str, kind: str, records: Sequence[Any], batch: int) -> tuple[float, float]:
    """Write ``records`` into a fresh database one way; setup is outside the timing."""
    upgrade(url)
    store = Store(url)
    # Engines exist before timing: steady state, as for a collector that has been running.
    for key in {s.key for s in records if isinstance(s, StepRecord)}:
        store.upsert_engine(key, seen_at=T0)
    ids = {engine.key: engine.id for engine in store.engines()}
    fast = store._fast_steps if kind == "steps" else store._fast_requests
    chunks = batches(records, batch)
    fn: Callable[[], None]
    if way == "store":
        write = store.write_steps if kind == "steps" else store.write_requests

        def fn() -> None:
            for chunk in chunks:
                write(chunk)

    elif way == "core":
        table = steps_t if kind == "steps" else requests_t

        def to_dict(r: Any) -> dict[str, Any]:
            return step_dict(r, ids[r.key]) if kind == "steps" else request_dict(r)

        def fn() -> None:
            for chunk in chunks:
                with store.write_transaction() as conn:
                    conn.execute(insert(table), [to_dict(r) for r in chunk])

    elif way == "driver_1row":
        encoded_1 = [
            step_values(r, ids[r.key], fast.ts) if kind == "steps" else request_values(r, fast.ts) for r in records
        ]
        chunks_1 = batches(encoded_1, batch)

        def fn() -> None:
            for chunk in chunks_1:
                with store.write_transaction() as conn:
                    cursor = conn.connection.cursor()
                    cursor.executemany(fast.sql, list(chunk))
                    cursor.close()

    else:  # driver: encoded before timing
        encoded = [
            step_values(r, ids[r.key], fast.ts) if kind == "steps" else request_values(r, fast.ts) for r in records
        ]
        encoded_chunks = batches(encoded, batch)

        def fn() -> None:
            for chunk in encoded_chunks:
                with store.write_transaction() as conn:
                    fast.execute(conn, list(chunk))

    try:
        return timed(fn)
    finally:
        store.close()


def bench_backend(
    fresh_url: Callable[[], str],
    steps: list[StepRecord],
    requests: list[RequestRecord],
    batch: int,
    repeats: int,
    *,
    sqlite: bool,
) -> dict[str, Any]:
    """Each measurement writes into its own fresh database, so every way starts from an empty
    table; the order of the ways rotates between repeats so load drifts hit them alike."""
    ways = ["store", "core", "driver", "driver_1row"] if sqlite else ["store", "core", "driver"]
    out: dict[str, Any] = {}
    for kind, records in (("steps", steps), ("requests", requests)):
        wall: dict[str, list[float]] = {way: [] for way in ways}
        cpu: dict[str, list[float]] = {way: [] for way in ways}
        for repeat in range(repeats):
            for way in ways[repeat % len(ways) :] + ways[: repeat % len(ways)]:
                wall_s, cpu_s = run_way(fresh_url(), way, kind, records, batch)
                wall[way].append(len(records) / wall_s)
                cpu[way].append(len(records) / cpu_s)
        out[kind] = {
            way: {
                "rows_per_s_median": statistics.median(wall[way]),
                "rows_per_s_best": max(wall[way]),
                "rows_per_cpu_s_median": statistics.median(cpu[way]),
                "rows_per_s_samples": wall[way],
            }
            for way in ways
        }
    return out


# --- hot paths: config tagging and the traffic record's state file ---------------------------------


def tagging_batches(batches_n: int, rows: int) -> list[list[StepRecord]]:
    """One series, a batch every 0.5 s (the step writer's flush), ``rows`` steps in each."""
    key = EngineKey("http://127.0.0.1:8000/metrics", "llama", "0")
    one = make_steps(rows)
    return [
        [replace_step(r, key, T0 + timedelta(seconds=0.5 * b, microseconds=500 * i)) for i, r in enumerate(one)]
        for b in range(batches_n)
    ]


def replace_step(rec: StepRecord, key: EngineKey, ts: datetime) -> StepRecord:
    return StepRecord(ts=ts, key=key, batch_size=rec.batch_size, step_time_s=rec.step_time_s, spec=rec.spec,
                      num_scheduled_tokens=rec.num_scheduled_tokens)


def run_tagging(url: str, way: str, batches_: Sequence[Sequence[StepRecord]]) -> tuple[float, float]:
    """Write the batches through the sink one way into a fresh database (setup untimed)."""
    upgrade(url)
    store = Store(url)
    key = batches_[0][0].key
    store.record_config(key, EngineConfigRecord(method="eagle", started_at=T0, draft_model="d", num_spec_tokens=3))
    ticks = itertools.count()
    # one lookup per batch reads the clock once: 0.5 s a batch, so re-checks come as often as live
    sink = ConfigTaggingSink(
        store, cache_ttl_s=CONFIG_CACHE_TTL_S if way == "cached" else 0, clock=lambda: 0.5 * next(ticks)
    )
    write = store.write_steps if way == "untagged" else sink.write_steps

    def fn() -> None:
        for batch in batches_:
            write(batch)

    try:
        return timed(fn)
    finally:
        store.close()


def run_appends(directory: Path, way: str, samples: Sequence[TrafficSample]) -> tuple[float, float]:
    interval = {"throttled": RecorderSettings(directory).state_save_interval_s, "every_append": 0.0}[way]
    store = SampleStore(RecorderSettings(directory, state_save_interval_s=interval))

    def fn() -> None:
        for sample in samples:
            store.append([sample])
        store.close()  # the throttled way's last save counts too

    return timed(fn)


def bench_hot_paths(tmp: str, batches_n: int, rows: int, appends: int, repeats: int) -> dict[str, Any]:
    """Per-call wall and CPU seconds (medians over ``repeats``, each into a fresh database or
    directory, the order rotating), and the ratios of the way without the saving to the way with it."""
    counter = iter(range(1_000_000))
    batches_ = tagging_batches(batches_n, rows)
    sample = TrafficSample(T0, "cmpl-1", "llama", tuple(range(512)), tuple(range(128)), True, False,
                           "response", "completions")
    samples = [replace_sample(sample, i) for i in range(appends)]
    cases: dict[str, tuple[list[str], Callable[[str], tuple[float, float]], int]] = {
        "tagging": (
            ["cached", "uncached", "untagged"],
            lambda way: run_tagging(f"sqlite:///{tmp}/hot{next(counter)}.db", way, batches_),
            batches_n,
        ),
        "sample_append": (
            ["throttled", "every_append"],
            lambda way: run_appends(Path(tmp) / f"samples{next(counter)}", way, samples),
            appends,
        ),
    }
    out: dict[str, Any] = {}
    for case, (ways, run, calls) in cases.items():
        wall: dict[str, list[float]] = {way: [] for way in ways}
        cpu: dict[str, list[float]] = {way: [] for way in ways}
        for repeat in range(repeats):
            for way in ways[repeat % len(ways) :] + ways[: repeat % len(ways)]:
                wall_s, cpu_s = run(way)
                wall[way].append(wall_s / calls)
                cpu[way].append(cpu_s / calls)
        out[case] = {
            way: {
                "wall_s_per_call_median": statistics.median(wall[way]),
                "cpu_s_per_call_median": statistics.median(cpu[way]),
                "wall_s_per_call_samples": wall[way],
            }
            for way in ways
        }
        base, saved = ways[1], ways[0]
        out[case]["calls"] = calls
        out[case][f"{base}_over_{saved}_cpu"] = statistics.median(cpu[base]) / statistics.median(cpu[saved])
        out[case][f"{base}_over_{saved}_wall"] = statistics.median(wall[base]) / statistics.median(wall[saved])
    tag = out["tagging"]
    # what tagging itself costs per batch, over the store's write alone
    floor = tag["untagged"]["cpu_s_per_call_median"]
    tag["tagging_cpu_s_per_batch"] = {way: tag[way]["cpu_s_per_call_median"] - floor for way in ("cached", "uncached")}
    return out


def replace_sample(sample: TrafficSample, i: int) -> TrafficSample:
    return TrafficSample(sample.ts + timedelta(seconds=i), f"cmpl-{i}", sample.model, sample.prompt_ids,
                         sample.output_ids, sample.greedy, sample.logprobs, sample.ids_source, sample.endpoint)


def report_hot_paths(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="spectuner-bench-hot-") as tmp:
        results = bench_hot_paths(tmp, args.tag_batches, args.tag_rows, args.appends, args.repeats)
    load_after = os.getloadavg()
    tag, app = results["tagging"], results["sample_append"]
    print(f"hot paths (SQLite), median of {args.repeats}; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    print(f"tagging: {args.tag_batches} batches of {args.tag_rows} steps, one series, 0.5 s a batch")
    for way in ("cached", "uncached", "untagged"):
        w = tag[way]
        print(f"  {way:<13} {w['wall_s_per_call_median'] * 1e3:8.3f} ms/batch wall "
              f"{w['cpu_s_per_call_median'] * 1e3:8.3f} ms/batch CPU")
    own = tag["tagging_cpu_s_per_batch"]
    print(f"  uncached ÷ cached: {tag['uncached_over_cached_cpu']:.2f} CPU, {tag['uncached_over_cached_wall']:.2f} "
          f"wall; tagging itself {own['uncached'] * 1e3:.3f} → {own['cached'] * 1e3:.3f} ms CPU a batch")
    print(f"sample append: {args.appends} appends of one sample")
    for way in ("throttled", "every_append"):
        w = app[way]
        print(f"  {way:<13} {w['wall_s_per_call_median'] * 1e6:8.1f} µs/append wall "
              f"{w['cpu_s_per_call_median'] * 1e6:8.1f} µs/append CPU")
    print(f"  every_append ÷ throttled: {app['every_append_over_throttled_cpu']:.2f} CPU, "
          f"{app['every_append_over_throttled_wall']:.2f} wall")
    payload = {
        "benchmark": "store_hot_paths",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "tag_batches": args.tag_batches,
        "tag_rows_per_batch": args.tag_rows,
        "appends": args.appends,
        "repeats": args.repeats,
        "config_cache_ttl_s": CONFIG_CACHE_TTL_S,
        "machine": _machine(load_before, load_after),
        "results": results,
    }
    _write(args.hot_out, payload)


def _machine(load_before: Any, load_after: Any) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_before": load_before,
        "load_average_after": load_after,
    }


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per kind per repeat")
    parser.add_argument("--batch", type=int, default=1000, help="rows per write call (one transaction)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cases", default="ingest,hot_paths", help="ingest and/or hot_paths")
    parser.add_argument("--tag-batches", type=int, default=200, help="hot_paths: step batches through the sink")
    parser.add_argument("--tag-rows", type=int, default=64, help="hot_paths: step records per batch")
    parser.add_argument("--appends", type=int, default=500, help="hot_paths: one-sample appends")
    parser.add_argument("--hot-out", type=Path, default=HOT_RESULTS)
    args = parser.parse_args()
    cases = args.cases.split(",")
    if unknown := set(cases) - {"ingest", "hot_paths"}:
        parser.error(f"unknown case {', '.join(sorted(unknown))}: use ingest and/or hot_paths")
    if "hot_paths" in cases:
        report_hot_paths(args)
    if "ingest" not in cases:
        return 0

    steps, requests = make_steps(args.rows), make_requests(args.rows)
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="spectuner-bench-") as tmp:
        counter = iter(range(1_000_000))
        for backend in args.backends.split(","):
            if backend == "sqlite":
                results["sqlite"] = bench_backend(
                    lambda: f"sqlite:///{tmp}/bench{next(counter)}.db",
                    steps,
                    requests,
                    args.batch,
                    args.repeats,
                    sqlite=True,
                )
            elif backend == "postgresql":
                from tests.integration.pg import PostgresServer

                with PostgresServer(fsync=True) as server:
                    results["postgresql"] = bench_backend(
                        lambda: server.create_database(f"bench{next(counter)}"),
                        steps,
                        requests,
                        args.batch,
                        args.repeats,
                        sqlite=False,
                    )
            else:
                parser.error(f"unknown backend {backend!r}: use sqlite and/or postgresql")
    load_after = os.getloadavg()

    print(f"store ingest: {args.rows} rows per kind, batches of {args.batch}, median of {args.repeats}")
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    header = (
        f"{'backend':<11} {'rows':<9} {'store/s':>9} {'core/s':>9} {'driver/s':>9} {'store÷core':>10} "
        f"{'store÷driver':>12} {'store/cpu-s':>12}"
    )
    print(header)
    print("-" * len(header))
    for backend, kinds in results.items():
        for kind, ways in kinds.items():
            s, c, d = (ways[w]["rows_per_s_median"] for w in ("store", "core", "driver"))
            ways["store_over_core"] = s / c
            ways["store_over_driver"] = s / d
            if "driver_1row" in ways:
                one_row_cpu = ways["driver_1row"]["rows_per_cpu_s_median"]
                ways["multi_row_over_1row_cpu"] = ways["driver"]["rows_per_cpu_s_median"] / one_row_cpu
            cpu = ways["store"]["rows_per_cpu_s_median"]
            print(f"{backend:<11} {kind:<9} {s:>9.0f} {c:>9.0f} {d:>9.0f} {s / c:>10.2f} {s / d:>12.2f} {cpu:>12.0f}")
    for backend, kinds in results.items():
        for kind, ways in kinds.items():
            if "multi_row_over_1row_cpu" in ways:
                print(
                    f"{backend} {kind}: multi-row statements ÷ one row per statement (driver, per CPU-s): "
                    f"{ways['multi_row_over_1row_cpu']:.2f}"
                )
    print("store/cpu-s: rows per CPU-second of this process (SQLite runs in-process, so nearly all the work;")
    print("PostgreSQL: the client side only): an estimate for one uncontended core. Wall figures carry the load.")
    if "postgresql" in results and "sqlite" in results:
        for kind in ("steps", "requests"):
            ratio = (
                results["postgresql"][kind]["store"]["rows_per_s_median"]
                / results["sqlite"][kind]["store"]["rows_per_s_median"]
            )
            results.setdefault("postgresql_over_sqlite", {})[kind] = ratio
            print(f"postgresql ÷ sqlite ({kind}): {ratio:.2f}")
    verdict = None
    if "sqlite" in results:
        worst = min(results["sqlite"][k]["store"]["rows_per_s_median"] for k in ("steps", "requests"))
        worst_cpu = min(results["sqlite"][k]["store"]["rows_per_cpu_s_median"] for k in ("steps", "requests"))
        verdict = worst >= TARGET_SQLITE_ROWS_PER_S
        print(
            f"target ≥ {TARGET_SQLITE_ROWS_PER_S} rows/s on SQLite: {'met' if verdict else 'NOT met'} in wall "
            f"time (slowest kind {worst:.0f} rows/s); per CPU-second the slowest kind does {worst_cpu:.0f}"
        )

    payload = {
        "benchmark": "store_ingest",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "rows_per_kind": args.rows,
        "batch_rows": args.batch,
        "repeats": args.repeats,
        "machine": _machine(load_before, load_after),
        "target_sqlite_rows_per_s": TARGET_SQLITE_ROWS_PER_S,
        "target_met_wall_time": verdict,
        "results": results,
    }
    _write(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fleet: N sidecars (one per engine) writing to one PostgreSQL, sustained.

One process hosts the whole fleet, as N sidecars would load the database:

- N simulated engines, each its own HTTP server on 127.0.0.1 (one asyncio loop, one listening port
  per engine) serving a real vLLM /metrics page (tests/data/lab_good_k3_loaded.prom) that evolves:
  the spec-decode counters and generation tokens are the sums of the engine's own simulated steps;
  every other counter that moved between the two saved lab pages (…loaded → …loaded_more: histograms,
  prompt tokens, cache queries) advances in proportion to the drafts, as in that real pair;
- per engine a simulated in-engine plugin making ``--steps-per-s`` steps a second (default 25: a
  40 ms decode step of a busy GPU engine), batch size a random walk in [1, 64], K=3, acceptance per
  position from the real page pair; every 0.25 s (the plugin's flush interval) its batch goes, as
  wire JSON, through the sidecar's real ingest (``StepIngestServer.ingest``: validation, then the
  ``BatchWriter`` around ``write_steps``). The plugin→sidecar HTTP hop is skipped (it does not touch
  the store and would cost the 2-core load generator 400 requests/s);
- N sidecars, each with its own ``Store`` (own connection pool), a real ``Collector`` thread scraping
  its engine every collect interval (default: the daemon's ``collect_interval_s``) through the
  daemon's ``ConfigTaggingSink`` (one config recorded per engine, so windows and steps are tagged),
  and the daemon's retention job (``run_retention`` + ``prune_deliveries``) every
  ``retention_interval_s`` on the real schedule, at a random phase per sidecar (sidecars start at
  different times); retention jobs run on a pool of 4 threads, so they can overlap as in a fleet.
  Collectors also start at a random phase within their interval.

Measured over the run: rows/s per table, latency of every ``Store.write_scrape`` / ``write_steps``
call (p50/p99/max), retention job latency and failures, PostgreSQL CPU (utime+stime of the
postmaster and its children from /proc), database growth (``pg_database_size`` and per table)
extrapolated per engine-day, and lost data: per engine, windows stored vs good scrapes − 1, breaks in
the window chain (a window must start where the previous ended), steps stored vs steps accepted, and
rollup buckets that count a window twice or miss one.

PostgreSQL is the throwaway local server of tests/integration/pg.py with fsync on.

    .venv/bin/python bench/bench_fleet_store.py [--engines 100] [--duration-s 600]
        [--collect-interval-s 10] [--steps-per-s 25] [--retention-interval-s 300] [--out DIR]

Prints the figures and writes ``fleet_store.json`` and ``fleet_store.md`` (default bench/results/).
Target: 100 engines on one 2-core PostgreSQL, p99 write latency ≤ 100 ms, no lost window.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sqlalchemy import text  # noqa: E402

from collectors.batch_writer import BatchWriter  # noqa: E402
from collectors.records import EngineKey, EngineSample, EventRecord, StepRecord, WindowRecord  # noqa: E402
from collectors.scrape import Collector  # noqa: E402
from collectors.step_ingest import StepIngestServer  # noqa: E402
from collectors.vllm_plugin.wire import WIRE_VERSION  # noqa: E402
from tuner.config import ControllerSection  # noqa: E402
from tuner.store import RetentionPolicy, Store, run_retention, upgrade  # noqa: E402
from tuner.store.deliveries import prune_deliveries  # noqa: E402
from tuner.store.records import EngineConfigRecord  # noqa: E402
from tuner.store.tagging import ConfigTaggingSink  # noqa: E402

DATA = REPO / "tests" / "data"
RESULTS = REPO / "bench" / "results"
PAGE_BEFORE, PAGE_AFTER = DATA / "lab_good_k3_loaded.prom", DATA / "lab_good_k3_loaded_more.prom"
TARGET_P99_MS = 100.0
TARGET_ENGINES = 100
MODEL = "lab-target"
K = 3
PLUGIN_FLUSH_S = 0.25  # collectors.vllm_plugin.shipper.Shipper's default flush interval
DEFAULT_COLLECT_S = float(ControllerSection.model_fields["collect_interval_s"].default)
DEFAULT_RETENTION_S = float(ControllerSection.model_fields["retention_interval_s"].default)
TABLES = ("scrape_windows", "steps", "window_rollups_1m", "events", "collector_baselines", "engine_configs")
SPEC = "vllm:spec_decode_num_"


# --- the simulated engine ------------------------------------------------------------------------


def _split(line: str) -> tuple[str, str, float]:
    """(series ``name{labels}``, metric name, value) of one sample line."""
    series, value = line.rsplit(" ", 1)
    return series, series.split("{", 1)[0], float(value)


@dataclass(frozen=True)
class PageTemplate:
    """The real page, line by line: static text, or a series and how its value evolves.

    ``kind``: ``static``; ``drafts`` / ``draft_tokens`` / ``accepted`` / ``generated`` / ``pos<i>``
    (sums of the engine's steps); ``running`` / ``kv`` (gauges from its batch); ``int`` / ``float``
    (the real pair's delta per draft times the drafts made)."""

    lines: tuple[tuple[str, str, float, float], ...]  # (series, or the whole line if static; kind; start; per draft)
    accept_per_pos: tuple[float, ...]  # accepted per draft at each position, from the real pair

    @classmethod
    def load(cls, before: Path = PAGE_BEFORE, after: Path = PAGE_AFTER) -> PageTemplate:
        a, b = before.read_text().splitlines(), after.read_text().splitlines()
        if len(a) != len(b):
            raise ValueError(f"{before.name} and {after.name} do not have the same lines")
        drafts_delta = 0.0
        pairs: list[tuple[str, str, str, float, float]] = []
        for la, lb in zip(a, b, strict=True):
            if not la or la.startswith("#"):
                pairs.append((la, la, "", 0.0, 0.0))
                continue
            series, name, va = _split(la)
            series_b, _, vb = _split(lb)
            if series != series_b:
                raise ValueError(f"{before.name} and {after.name} differ in series: {series} vs {series_b}")
            if name == f"{SPEC}drafts_total":
                drafts_delta = vb - va
            pairs.append((la, series, name, va, vb))
        if drafts_delta <= 0:
            raise ValueError(f"no drafts between {before.name} and {after.name}: nothing to replay")
        lines: list[tuple[str, str, float, float]] = []
        per_pos: dict[int, float] = {}
        for line, series, name, va, vb in pairs:
            kind = "static"
            if not name:
                pass
            elif name.startswith(SPEC) and name.endswith("_total"):
                kind = name[len(SPEC) : -len("_total")]
                if kind == "accepted_tokens_per_pos":
                    pos = int(series.split('position="', 1)[1].split('"', 1)[0])
                    per_pos[pos] = (vb - va) / drafts_delta
                    kind = f"pos{pos}"
                kind = {"drafts": "drafts", "draft_tokens": "draft_tokens", "accepted_tokens": "accepted"}.get(
                    kind, kind
                )
            elif name == "vllm:generation_tokens_total":
                kind = "generated"
            elif name == "vllm:num_requests_running":
                kind = "running"
            elif name == "vllm:kv_cache_usage_perc":
                kind = "kv"
            elif vb != va and name.endswith(("_total", "_count", "_bucket", "_sum")) and name.startswith("vllm:"):
                kind = "int" if va.is_integer() and vb.is_integer() and not name.endswith("_sum") else "float"
            lines.append((line if kind == "static" else series, kind, va, (vb - va) / drafts_delta))
        if len(per_pos) != K:
            raise ValueError(f"{before.name}: expected K={K} acceptance positions, found {sorted(per_pos)}")
        return cls(tuple(lines), tuple(per_pos[p] for p in range(K)))


@dataclass(frozen=True)
class EngineState:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = (0,) * K
    generated: int = 0
    batch: int = 16


class SimEngine:
    """One engine: its steps (made by the plugin driver) and its /metrics page (read by the server).
    The state is one immutable tuple swapped whole, so a page never mixes two steps."""

    def __init__(self, template: PageTemplate, steps_per_s: float, seed: int, now_s: float) -> None:
        self.template = template
        self.steps_per_s = steps_per_s
        self.rng = random.Random(seed)
        self.state = EngineState(batch=self.rng.randint(8, 32))
        self._last_s = now_s
        self._carry = 0.0

    def steps_until(self, now_s: float) -> list[dict[str, Any]]:
        """The wire steps made since the last call, stamped evenly over the interval."""
        due = (now_s - self._last_s) * self.steps_per_s + self._carry
        n = int(due)
        self._carry = due - n
        start, dt = self._last_s, 1.0 / self.steps_per_s
        self._last_s = now_s
        s = self.state
        drafts, draft_tokens, generated, batch = s.drafts, s.draft_tokens, s.generated, s.batch
        per_pos = list(s.accepted_per_pos)
        out = []
        rng = self.rng
        for i in range(n):
            batch = min(64, max(1, batch + rng.choice((-1, 0, 0, 1))))
            ap, prev = [], batch
            for p in range(K):  # stochastic rounding of batch × acceptance, never above the position before
                a = min(prev, int(batch * self.template.accept_per_pos[p] + rng.random()))
                ap.append(a)
                prev = a
            accepted = sum(ap)
            out.append(
                {
                    "t": start + (i + 1) * (now_s - start) / n,
                    "e": 0,
                    "b": batch,
                    "dt": dt,
                    "bs": "details",
                    "k": K,
                    "d": batch,
                    "dn": batch * K,
                    "a": accepted,
                    "ap": ap,
                    "dp": [batch] * K,
                    "g": batch + accepted,
                    "s": batch * (K + 1),
                    "r": batch,
                    "w": 0,
                }
            )
            drafts += batch
            draft_tokens += batch * K
            generated += batch + accepted
            for p in range(K):
                per_pos[p] += ap[p]
        self.state = EngineState(drafts, draft_tokens, tuple(per_pos), generated, batch)
        return out

    def page(self) -> str:
        s = self.state
        values = {
            "drafts": s.drafts,
            "draft_tokens": s.draft_tokens,
            "accepted": sum(s.accepted_per_pos),
            "generated": s.generated,
            "running": s.batch,
            "kv": min(1.0, s.batch / 64),
        }
        out = []
        for series, kind, start, per_draft in self.template.lines:
            if kind == "static":
                out.append(series)
                continue
            if kind == "int":
                value = start + math.floor(per_draft * s.drafts)
            elif kind == "float":
                value = start + per_draft * s.drafts
            elif kind.startswith("pos"):
                value = start + s.accepted_per_pos[int(kind[3:])]
            elif kind in ("running", "kv"):
                value = values[kind]
            else:
                value = start + values[kind]
            out.append(f"{series} {float(value)!r}")
        return "\n".join(out) + "\n"


class MetricsServers:
    """One asyncio loop on a thread, one listening port per engine, HTTP/1.1 keep-alive, GET only."""

    def __init__(self, engines: Sequence[SimEngine]) -> None:
        self.engines = engines
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet-metrics", daemon=True)
        self.servers: list[asyncio.Server] = []
        self.ports: list[int] = []
        self.pages_served = 0

    async def _handle(self, engine: SimEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                parts = head.split(b"\r\n", 1)[0].split()
                if len(parts) >= 2 and parts[1] == b"/metrics":
                    status, body = b"200 OK", engine.page().encode()
                    self.pages_served += 1
                else:
                    status, body = b"404 Not Found", b"not found\n"
                writer.write(
                    b"HTTP/1.1 %s\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: %d\r\n\r\n%s"
                    % (status, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, asyncio.CancelledError):
            pass  # the collector hung up, or the fleet is shutting down
        finally:
            writer.close()

    async def _start_all(self) -> None:
        for engine in self.engines:

            async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter, e: SimEngine = engine) -> None:
                await self._handle(e, r, w)

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.servers.append(server)
            self.ports.append(int(server.sockets[0].getsockname()[1]))

    async def _stop_all(self) -> None:
        for server in self.servers:
            server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> MetricsServers:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start_all(), self.loop).result(60)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop_all(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


# --- the sidecar side ----------------------------------------------------------------------------


class TimedStore(Store):
    """The store, with every scrape and step write timed (wall seconds, whole transaction)."""

    def __init__(self, url: str, latencies: dict[str, list[float]]) -> None:
        super().__init__(url)
        self.latencies = latencies

    def write_scrape(
        self,
        windows: Sequence[WindowRecord],
        events: Sequence[EventRecord] = (),
        baselines: Sequence[EngineSample] = (),
    ) -> None:
        t0 = time.perf_counter()
        super().write_scrape(windows, events, baselines)
        self.latencies["write_scrape"].append(time.perf_counter() - t0)

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        t0 = time.perf_counter()
        super().write_steps(records)
        self.latencies["write_steps"].append(time.perf_counter() - t0)


@dataclass
class Sidecar:
    engine: SimEngine
    url: str
    store: TimedStore
    collector: Collector
    ingest: StepIngestServer
    retention_phase_s: float
    retention_runs: int = 0
    thread: threading.Thread | None = None


@dataclass
class FleetRun:
    """What one run measured (everything the report prints comes from here)."""

    engines: int
    duration_s: float
    collect_interval_s: float
    steps_per_s: float
    retention_interval_s: float
    latencies: dict[str, list[float]] = field(default_factory=dict)
    retention_errors: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)


def percentiles_ms(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)] * 1e3, 2)

    return {"count": len(ordered), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(ordered[-1] * 1e3, 2)}


class PgCpu:
    """CPU seconds of a PostgreSQL server: the postmaster and its children (backends, WAL writer,
    checkpointer, autovacuum), sampled from /proc so processes that come and go are counted."""

    def __init__(self, postmaster: int | None) -> None:
        self.postmaster = postmaster
        self.tick = os.sysconf("SC_CLK_TCK")
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def _read(self) -> dict[int, float]:
        out: dict[int, float] = {}
        if self.postmaster is None:
            return out
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pid, ppid = int(entry.name), int(fields[1])
            if pid == self.postmaster or ppid == self.postmaster:
                out[pid] = (int(fields[11]) + int(fields[12])) / self.tick
        return out

    def start(self) -> None:
        self.first = self._read()
        self.last = dict(self.first)

    def sample(self) -> None:
        for pid, cpu in self._read().items():
            self.first.setdefault(pid, 0.0)  # born during the run: all its CPU is the run's
            self.last[pid] = cpu

    @property
    def seconds(self) -> float:
        return sum(self.last[pid] - self.first.get(pid, 0.0) for pid in self.last)

    @property
    def processes(self) -> int:
        return len(self.last)


def _db_sizes(store: Store) -> dict[str, int]:
    with store.read_connection() as conn:
        sizes = {"database": int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one())}
        for table in TABLES:
            sizes[table] = int(conn.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar_one())
    return sizes


def _row_counts(store: Store) -> dict[str, int]:
    with store.read_connection() as conn:
        return {t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in TABLES}


def _compact_row_bytes(store: Store, table: str) -> float | None:
    """Bytes per live row of ``table`` with its indexes, after ``VACUUM FULL`` (None when empty)."""
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM FULL {table}"))
        rows = int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
        size = int(conn.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar_one())
    return round(size / rows, 1) if rows else None


def _window_audit(store: Store, sidecars: Sequence[Sidecar]) -> dict[str, Any]:
    """Per engine: windows stored vs good scrapes − 1, and breaks in the chain of windows."""
    expected = stored = chain_breaks = worst_engine_missing = 0
    with store.read_connection() as conn:
        for sc in sidecars:
            engine_id = store.engine_id(EngineKey(sc.collector.url, MODEL, "0"))
            rows = (
                []
                if engine_id is None
                else conn.execute(
                    text("SELECT start_ts, end_ts FROM scrape_windows WHERE engine_id = :e ORDER BY end_ts"),
                    {"e": engine_id},
                ).all()
            )
            want = max(0, sc.collector.scrapes_ok - 1)
            expected += want
            stored += len(rows)
            worst_engine_missing = max(worst_engine_missing, want - len(rows))
            chain_breaks += sum(1 for prev, cur in itertools.pairwise(rows) if cur[0] != prev[1])
        # A rollup bucket must count exactly the raw windows that end in its minute.
        mismatched = conn.execute(
            text(
                "SELECT count(*) FROM (SELECT r.engine_id, r.bucket_start, sum(r.windows) AS n "
                "FROM window_rollups_1m r GROUP BY r.engine_id, r.bucket_start) r LEFT JOIN (SELECT engine_id, "
                "date_trunc('minute', end_ts) AS b, count(*) AS n FROM scrape_windows GROUP BY 1, 2) w "
                "ON w.engine_id = r.engine_id AND w.b = r.bucket_start WHERE w.n IS DISTINCT FROM r.n"
            )
        ).scalar_one()
        buckets = conn.execute(text("SELECT count(*) FROM window_rollups_1m")).scalar_one()
    return {
        "windows_expected": expected,
        "windows_stored": stored,
        "windows_lost": expected - stored,
        "worst_engine_windows_missing": worst_engine_missing,
        "window_chain_breaks": chain_breaks,
        "rollup_buckets": int(buckets),
        "rollup_buckets_miscounted": int(mismatched),
    }


def run_fleet(
    pg_url: str,
    postmaster_pid: int | None,
    *,
    engines: int,
    duration_s: float,
    collect_interval_s: float = DEFAULT_COLLECT_S,
    steps_per_s: float = 25.0,
    retention_interval_s: float = DEFAULT_RETENTION_S,
    seed: int = 1,
    progress: bool = False,
) -> FleetRun:
    """The benchmark's core: set up the fleet on ``pg_url`` (an empty database), run it for
    ``duration_s``, stop it, audit the store. The caller owns the PostgreSQL server."""
    run = FleetRun(engines, duration_s, collect_interval_s, steps_per_s, retention_interval_s)
    run.latencies = {"write_scrape": [], "write_steps": [], "retention": []}
    upgrade(pg_url)
    template = PageTemplate.load()
    rng = random.Random(seed)
    now_s = time.time()
    sims = [SimEngine(template, steps_per_s, seed * 1000 + i, now_s) for i in range(engines)]
    servers = MetricsServers(sims).start()
    sidecars: list[Sidecar] = []
    policy = RetentionPolicy()
    retention_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fleet-retention")
    stop = threading.Event()
    try:
        for sim, port in zip(sims, servers.ports, strict=True):
            url = f"http://127.0.0.1:{port}/metrics"
            store = TimedStore(pg_url, run.latencies)
            # As the daemon does at start: the config in force is recorded, so records get tagged.
            store.record_config(
                EngineKey(url, MODEL, "0"),
                EngineConfigRecord(method="eagle", started_at=datetime.now(UTC), num_spec_tokens=K),
            )
            sink = ConfigTaggingSink(store)
            collector = Collector(url, sink, interval_s=collect_interval_s)
            writer: BatchWriter[StepRecord] = BatchWriter(
                sink.write_steps, name="steps", max_queue=100_000, batch_size=2000
            )
            ingest = StepIngestServer(sink, url, token="bench", writer=writer)
            sidecars.append(Sidecar(sim, url, store, collector, ingest, rng.uniform(0, retention_interval_s)))

        admin = Store(pg_url)
        sizes_before, rows_before = _db_sizes(admin), _row_counts(admin)
        cpu = PgCpu(postmaster_pid)
        cpu.start()
        load_before = os.getloadavg()
        proc_cpu_before = time.process_time()
        t_start = time.monotonic()

        for sc in sidecars:
            sc.ingest.writer.start()

            def collect(sc: Sidecar = sc, phase_s: float = rng.uniform(0, collect_interval_s)) -> None:
                if not stop.wait(phase_s):
                    sc.collector.run(stop)

            sc.thread = threading.Thread(target=collect, name="fleet-collector", daemon=True)
            sc.thread.start()
        for sc in sidecars:  # steps start now, not at set-up time
            sc.engine.steps_until(time.time())

        def plugins() -> None:
            pid = os.getpid()
            sent = dict.fromkeys(range(engines), 0)
            while not stop.wait(PLUGIN_FLUSH_S):
                now = time.time()
                for i, sc in enumerate(sidecars):
                    steps = sc.engine.steps_until(now)
                    if not steps:
                        continue
                    sent[i] += len(steps)
                    batch = {
                        "v": WIRE_VERSION,
                        "source": {"model": MODEL, "pid": pid + i, "vllm": "bench"},
                        "counters": {"sent": sent[i], "dropped_queue_full": 0, "dropped_send_failed": 0},
                        "steps": steps,
                    }
                    sc.ingest.ingest(json.dumps(batch).encode())

        def retain(sc: Sidecar) -> None:
            t0 = time.perf_counter()
            try:
                now = datetime.now(UTC)
                run_retention(sc.store, policy, now)
                prune_deliveries(sc.store, now - timedelta(seconds=policy.events_s))
            except Exception as exc:  # a failed job is a finding, not a crash of the benchmark
                run.retention_errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            finally:
                run.latencies["retention"].append(time.perf_counter() - t0)
                sc.retention_runs += 1

        plugin_thread = threading.Thread(target=plugins, name="fleet-plugins", daemon=True)
        plugin_thread.start()
        next_report = 60.0
        load_max = load_before[0]
        due = sorted((sc.retention_phase_s, i) for i, sc in enumerate(sidecars))
        while True:
            elapsed = time.monotonic() - t_start
            if elapsed >= duration_s:
                break
            while due and due[0][0] <= elapsed:
                at, i = due.pop(0)
                retention_pool.submit(retain, sidecars[i])
                due.append((at + retention_interval_s, i))
                due.sort()
            cpu.sample()
            load_max = max(load_max, os.getloadavg()[0])
            if progress and elapsed >= next_report:
                next_report += 60.0
                w = run.latencies["write_scrape"]
                print(
                    f"  {elapsed:5.0f} s: {len(w)} scrape writes, {len(run.latencies['write_steps'])} step writes, "
                    f"PostgreSQL {cpu.seconds:.1f} CPU-s, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            time.sleep(min(1.0, max(0.05, duration_s - elapsed), max(0.05, (due[0][0] - elapsed) if due else 1.0)))
        wall_s = time.monotonic() - t_start
        stop.set()
        plugin_thread.join(30)
        for sc in sidecars:
            if sc.thread is not None:
                sc.thread.join(60)
        for sc in sidecars:
            sc.ingest.stop()  # never started as HTTP: stops its writer after flushing what is queued
        retention_pool.shutdown(wait=True)
        cpu.sample()
        proc_cpu_s = time.process_time() - proc_cpu_before
        load_after = os.getloadavg()

        sizes_after, rows_after = _db_sizes(admin), _row_counts(admin)
        audit = _window_audit(admin, sidecars)
        steps_accepted = sum(sc.ingest.stats.accepted for sc in sidecars)
        steps_rejected = sum(sc.ingest.stats.rejected for sc in sidecars)
        writer_stats = [sc.ingest.writer.stats for sc in sidecars]
        with admin.read_connection() as conn:
            backends = int(
                conn.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'")
                ).scalar_one()
            )
        admin.close()
        rows = {t: rows_after[t] - rows_before[t] for t in TABLES}
        day = 86_400.0 / wall_s / engines
        growth = {t: (sizes_after[t] - sizes_before[t]) * day for t in ("database", *TABLES)}
        horizons_s = {
            "steps": policy.steps_s,
            "scrape_windows": policy.raw_windows_s,
            "window_rollups_1m": policy.rollups_s,
            "events": policy.events_s,
        }
        steady = {t: growth[t] * horizons_s[t] / 86_400.0 for t in horizons_s}
        # Rollups are rewritten on every run (delete + insert over the lookback), so their growth in a
        # short run is mostly dead rows that vacuum reuses. Their steady state is one row per engine,
        # config and minute at the compact size of a row (table and indexes after VACUUM FULL).
        rollup_row_bytes = _compact_row_bytes(admin, "window_rollups_1m")
        if rollup_row_bytes is not None:
            steady["window_rollups_1m"] = 1440 * rollup_row_bytes * horizons_s["window_rollups_1m"] / 86_400.0
        scrape_errors: dict[str, int] = {}
        for sc in sidecars:
            for reason, n in sc.collector.errors.items():
                scrape_errors[reason] = scrape_errors.get(reason, 0) + n
        run.result = {
            "wall_s": round(wall_s, 1),
            "rows": rows,
            "rows_per_s": {t: round(n / wall_s, 1) for t, n in rows.items()},
            "rows_per_s_total": round(sum(rows.values()) / wall_s, 1),
            "write_latency": {k: percentiles_ms(v) for k, v in run.latencies.items()},
            "write_latency_all_writes": percentiles_ms(run.latencies["write_scrape"] + run.latencies["write_steps"]),
            "retention": {
                "runs": sum(sc.retention_runs for sc in sidecars),
                "errors": len(run.retention_errors),
                "first_errors": sorted(set(run.retention_errors))[:5],
            },
            "postgresql": {
                "cpu_s": round(cpu.seconds, 1),
                "cores_used": round(cpu.seconds / wall_s, 3),
                "processes": cpu.processes,
                "client_backends_at_end": backends,
            },
            "load_generator": {
                "cpu_s": round(proc_cpu_s, 1),
                "cores_used": round(proc_cpu_s / wall_s, 3),
                "pages_served": servers.pages_served,
            },
            "database_bytes": {"before": sizes_before, "after": sizes_after},
            "growth_bytes_per_engine_day": {t: round(v) for t, v in growth.items()},
            "steady_state_bytes_per_engine_at_default_retention": {t: round(v) for t, v in steady.items()},
            "rollup_bytes_per_row_compact": rollup_row_bytes,
            "scrapes_ok": sum(sc.collector.scrapes_ok for sc in sidecars),
            "scrape_errors": scrape_errors,
            "windows_per_engine_ideal": round(wall_s / collect_interval_s, 1),
            **audit,
            "steps_accepted": steps_accepted,
            "steps_rejected": steps_rejected,
            "steps_stored": rows["steps"],
            "steps_lost": steps_accepted - rows["steps"],
            "steps_dropped_by_writers": sum(w.dropped_queue_full + w.dropped_write_failed for w in writer_stats),
            "machine_load_average": {"before": load_before, "after": load_after, "max_1m": load_max},
        }
        return run
    finally:
        stop.set()
        retention_pool.shutdown(wait=False, cancel_futures=True)
        for sc in sidecars:
            sc.collector.close()
            sc.store.close()
        servers.stop()


# --- report --------------------------------------------------------------------------------------


def verdict(run: FleetRun) -> dict[str, Any]:
    r = run.result
    p99 = r["write_latency_all_writes"]["p99_ms"]
    lost = r["windows_lost"] + r["window_chain_breaks"] + r["steps_lost"] + r["rollup_buckets_miscounted"]
    # A failed scrape loses no window (the next one covers the gap) but a fleet that cannot keep up shows here.
    failed = sum(r["scrape_errors"].values()) + r["retention"]["errors"] + r["steps_dropped_by_writers"]
    ok = run.engines >= TARGET_ENGINES and p99 is not None and p99 <= TARGET_P99_MS and lost == 0 and failed == 0
    return {
        "engines_at_target": run.engines >= TARGET_ENGINES,
        "p99_write_ms": p99,
        "p99_within_target": p99 is not None and p99 <= TARGET_P99_MS,
        "nothing_lost": lost == 0,
        "failures": failed,
        "met": ok,
    }


def render_md(payload: dict[str, Any]) -> str:
    r, v, m = payload["result"], payload["verdict"], payload["machine"]
    lat = r["write_latency"]
    lines = [
        "# Fleet store benchmark (bench/bench_fleet_store.py)",
        "",
        f"Measured {payload['measured_at']}: {payload['engines']} simulated engines and sidecars on one PostgreSQL 15 "
        f"(fsync on) for {r['wall_s']} s; scrape every {payload['collect_interval_s']} s, "
        f"{payload['steps_per_s']} steps/s per engine, retention every {payload['retention_interval_s']} s "
        "per sidecar.",
        "",
        f"Machine: {m['cpus']} CPUs shared by PostgreSQL, the whole load generator and other work (load average "
        f"{m['load_average_before'][0]:.1f} before, up to {m['load_average_max_1m']:.1f} during the run). "
        "The target assumes PostgreSQL has 2 cores to itself: here it had far less.",
        "",
        f"**Target** (≥ {TARGET_ENGINES} engines, p99 write ≤ {TARGET_P99_MS:g} ms, nothing lost): "
        f"{'met' if v['met'] else 'NOT met'} (p99 {v['p99_write_ms']} ms, nothing lost: {v['nothing_lost']}, "
        f"failed scrapes/jobs/step writes: {v['failures']}).",
        "",
        "| write | calls | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("write_scrape", "write_steps", "retention"):
        s = lat[name]
        lines.append(f"| {name} | {s['count']} | {s['p50_ms']} | {s['p99_ms']} | {s['max_ms']} |")
    s = r["write_latency_all_writes"]
    lines += [
        f"| all writes | {s['count']} | {s['p50_ms']} | {s['p99_ms']} | {s['max_ms']} |",
        "",
        "| table | rows | rows/s | growth per engine-day | per engine at default retention |",
        "|---|---:|---:|---:|---:|",
    ]
    steady = r["steady_state_bytes_per_engine_at_default_retention"]
    for t in TABLES:
        g = r["growth_bytes_per_engine_day"][t] / 2**20
        st = f"{steady[t] / 2**20:.1f} MiB" if t in steady else "—"
        lines.append(f"| {t} | {r['rows'][t]} | {r['rows_per_s'][t]} | {g:.1f} MiB | {st} |")
    pg, lg = r["postgresql"], r["load_generator"]
    lines += [
        f"| database | {sum(r['rows'].values())} | {r['rows_per_s_total']} | "
        f"{r['growth_bytes_per_engine_day']['database'] / 2**20:.1f} MiB | "
        f"{sum(steady.values()) / 2**20:.1f} MiB |",
        "",
        "Growth is the size added during the run (tables with their indexes), per engine, scaled to a day. At "
        "default retention (steps 2 d, raw windows 7 d, events 90 d, rollups 400 d) a table holds its daily growth "
        "times its horizon; rollups, rewritten on every run, are counted as 1 440 rows per engine-day at "
        f"{r['rollup_bytes_per_row_compact']} bytes per compact row (after VACUUM FULL).",
        "",
        f"PostgreSQL CPU: {pg['cpu_s']} s = {pg['cores_used']} cores ({pg['processes']} processes, "
        f"{pg['client_backends_at_end']} client connections). Load generator (engines, collectors, ingest, "
        f"client side of the store): {lg['cpu_s']} s = {lg['cores_used']} cores.",
        "",
        f"Lost: windows {r['windows_lost']} of {r['windows_expected']} expected (chain breaks "
        f"{r['window_chain_breaks']}), steps {r['steps_lost']} of {r['steps_accepted']}, rollup buckets miscounted "
        f"{r['rollup_buckets_miscounted']} of {r['rollup_buckets']}; scrape errors {r['scrape_errors'] or 'none'}; "
        f"retention runs {r['retention']['runs']}, failed {r['retention']['errors']}"
        + (f" ({'; '.join(r['retention']['first_errors'])})" if r["retention"]["errors"] else "")
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=TARGET_ENGINES)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument(
        "--collect-interval-s", type=float, default=DEFAULT_COLLECT_S, help="default: the daemon's collect interval"
    )
    parser.add_argument("--steps-per-s", type=float, default=25.0, help="engine steps per second, per engine")
    parser.add_argument("--retention-interval-s", type=float, default=DEFAULT_RETENTION_S, help="default: the daemon's")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for fleet_store.json and .md")
    args = parser.parse_args()
    for name in ("engines", "duration_s", "collect_interval_s", "steps_per_s", "retention_interval_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")

    from tests.integration.pg import PostgresServer, PostgresUnavailable

    print(
        f"fleet store: {args.engines} engines for {args.duration_s:g} s, scrape every {args.collect_interval_s:g} s, "
        f"{args.steps_per_s:g} steps/s per engine, retention every {args.retention_interval_s:g} s",
        flush=True,
    )
    try:
        # A sidecar holds up to 3 connections (collector, step writer, retention) plus ping overhead.
        with PostgresServer(fsync=True, max_connections=4 * args.engines + 20) as server:
            run = run_fleet(
                server.create_database("fleet"),
                server.postmaster_pid(),
                engines=args.engines,
                duration_s=args.duration_s,
                collect_interval_s=args.collect_interval_s,
                steps_per_s=args.steps_per_s,
                retention_interval_s=args.retention_interval_s,
                progress=True,
            )
    except PostgresUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    payload = {
        "benchmark": "fleet_store",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "engines": run.engines,
        "duration_s": run.duration_s,
        "collect_interval_s": run.collect_interval_s,
        "steps_per_s": run.steps_per_s,
        "retention_interval_s": run.retention_interval_s,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "shared": "PostgreSQL, the load generator and other work share these CPUs",
            "load_average_before": run.result["machine_load_average"]["before"],
            "load_average_after": run.result["machine_load_average"]["after"],
            "load_average_max_1m": run.result["machine_load_average"]["max_1m"],
        },
        "target": {"engines": TARGET_ENGINES, "p99_write_ms": TARGET_P99_MS, "lost": 0},
        "verdict": verdict(run),
        "result": run.result,
    }
    md = render_md(payload)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet_store.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.out / "fleet_store.md").write_text(md)
    print(f"wrote {args.out / 'fleet_store.json'} and fleet_store.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: what the exporters and the alert job cost the daemon.

One run, on a SQLite store filled like a day of production (10 s windows for 2 engine series, plus
decisions and events):
- ``refresh_first_ms``: the first export refresh (counts the whole stored history);
- ``refresh_steady_ms``: later refreshes (gauges over the window + counters over new rows only),
  and its share of the default 15 s refresh interval;
- ``scrape_ms``: GET /metrics on the real endpoint (serves the last refresh; never touches the DB);
- ``alerts_per_s``: events delivered per second by one webhook sink to a local receiver.

    .venv/bin/python bench/bench_exporters.py [--hours 24] [--events 300]

Writes bench/results/exporters.json. Timings on a shared machine are noisy: the load average is
recorded with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from collectors.records import EngineKey, EventRecord, WindowRecord  # noqa: E402
from policies.counters import SpecCounters  # noqa: E402
from tuner.alerts.dispatcher import build_dispatcher  # noqa: E402
from tuner.alerts.settings import AlertsSection  # noqa: E402
from tuner.exporters.service import ExportService  # noqa: E402
from tuner.exporters.settings import ExportersSection  # noqa: E402
from tuner.store import DecisionRecord, EngineConfigRecord, Store, upgrade  # noqa: E402

RESULTS = REPO / "bench" / "results"
URL = "http://127.0.0.1:8000/metrics"
T0 = datetime(2026, 12, 1, 0, 0, tzinfo=UTC)


def fill(store: Store, hours: float) -> tuple[datetime, int]:
    keys = [EngineKey(URL, "llama", "0"), EngineKey(URL, "llama", "1")]
    n = int(hours * 360)
    for key in keys:
        store.record_config(key, EngineConfigRecord(method="draft_model", draft_model="/m/good", num_spec_tokens=3,
                                                    started_at=T0, applied_by="startup"))
        batch: list[WindowRecord] = []
        for i in range(n):
            spec = SpecCounters(drafts=400, draft_tokens=1200, accepted_tokens=700, accepted_per_pos=(300, 230, 170),
                                num_spec_tokens=3)
            start = T0 + timedelta(seconds=10 * i)
            batch.append(WindowRecord(key=key, start=start, end=start + timedelta(seconds=10), spec=spec,
                                      generation_tokens=1100.0, requests_running=4.0))
            if len(batch) == 2000:
                store.write_windows(batch)
                batch = []
        store.write_windows(batch)
    for i in range(int(hours * 60)):  # a decision a minute
        store.record_decision(DecisionRecord(created_at=T0 + timedelta(minutes=i), action="change", reason="cooldown",
                                             message="m", inputs={}, mode="auto", engine=keys[0], status="blocked"))
    store.write_events([EventRecord(ts=T0 + timedelta(minutes=i), kind="counter_reset", message="m", engine=keys[0])
                        for i in range(int(hours * 10))])
    return T0 + timedelta(seconds=10 * n), n


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--refreshes", type=int, default=20)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        upgrade(url)
        with Store(url) as store:
            t = time.perf_counter()
            now, windows = fill(store, args.hours)
            fill_s = time.perf_counter() - t
            settings = ExportersSection.model_validate({"prometheus": {"enabled": True, "port": 0}})
            svc = ExportService(store, settings, clock=lambda: now, metrics_url=URL)
            t = time.perf_counter()
            svc.start()  # includes the first refresh
            first_ms = (time.perf_counter() - t) * 1000
            steady = []
            for _ in range(args.refreshes):
                t = time.perf_counter()
                samples = svc.refresh()
                steady.append((time.perf_counter() - t) * 1000)
            assert svc.prometheus is not None
            scrape_url = f"http://127.0.0.1:{svc.prometheus.port}/metrics"
            scrapes = []
            with httpx.Client() as client:
                for _ in range(args.scrapes):
                    t = time.perf_counter()
                    client.get(scrape_url).raise_for_status()
                    scrapes.append((time.perf_counter() - t) * 1000)
            svc.stop()

            server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
            Thread(target=server.serve_forever, daemon=True).start()
            alerts = AlertsSection.model_validate({"sinks": [{"name": "hook", "kind": "webhook",
                                                               "url": f"http://127.0.0.1:{server.server_address[1]}",
                                                               "dedup_window_s": 0, "rate_limit_per_minute": 10**6}]})
            dispatcher = build_dispatcher(store, alerts, lambda: now)
            store.write_events([EventRecord(ts=now, kind="apply_rolled_back", message="m", data={"decision_id": i})
                                for i in range(args.events)])
            t = time.perf_counter()
            delivered = 0
            while delivered < args.events:
                delivered += dispatcher.poll_once().count("delivered")
            alerts_s = time.perf_counter() - t
            dispatcher.close()
            server.shutdown()

    def q(values: list[float], p: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]

    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg": os.getloadavg()},
        "store": {"hours": args.hours, "windows_per_engine": windows, "fill_s": round(fill_s, 2)},
        "samples": len(samples),
        "refresh_first_ms": round(first_ms, 1),
        "refresh_steady_ms": {"p50": round(statistics.median(steady), 1), "max": round(max(steady), 1)},
        "refresh_share_of_15s_interval": round(statistics.median(steady) / 15000, 5),
        "scrape_ms": {"p50": round(q(scrapes, 0.5), 2), "p99": round(q(scrapes, 0.99), 2)},
        "scrape_vs_refresh_ratio": round(q(scrapes, 0.5) / statistics.median(steady), 3),
        "alerts": {"events": args.events, "seconds": round(alerts_s, 2), "per_s": round(args.events / alerts_s, 1)},
    }
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "exporters.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

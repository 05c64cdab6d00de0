"""Benchmark: latency the tap adds per request, against direct calls, on the live lab engine.

One run, side by side: the same greedy completion sent in turn straight to vLLM and through two
``spectuner tap`` processes (the real command, recording into SQLite) — one on the lean upstream
client (the default), one on httpx's own transport — one request at a time. Reports p50/p99 of
each path and the added latency (tap − direct) at p50 and p99, for plain JSON completions and for
SSE streams (time to the last byte). Target: added p99 ≤ 2 ms.
Also checks that every request through the tap was recorded. Writes bench/results/tap.json.

    .venv/bin/python bench/bench_tap.py [--base-url http://127.0.0.1:PORT] [--requests 200]

Without --base-url it starts a lab engine (good draft, K=3) and stops it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tuner.lab.prompts import PREDICTABLE  # noqa: E402
from tuner.store import Store, upgrade  # noqa: E402

RESULTS = REPO / "bench" / "results"
TARGET_P99_ADDED_MS = 2.0
WARMUP = 10


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tap(upstream: str, db_url: str, http_client: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tuner.cli.main",
            "tap",
            "--upstream",
            upstream,
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            db_url,
            "--http-client",
            http_client,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/_spectuner/tap", timeout=1)
            return proc, url
        except httpx.HTTPError as exc:
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"tap did not start: {err}") from exc
            time.sleep(0.2)


def one(client: httpx.Client, url: str, body: dict[str, Any], stream: bool) -> float:
    t0 = time.perf_counter()
    if stream:
        with client.stream("POST", url, json=body) as response:
            for _ in response.iter_raw():
                pass
            status = response.status_code
    else:
        status = client.post(url, json=body).status_code
    elapsed = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {url}")
    return elapsed * 1e3


def measure(paths: dict[str, str], model: str, n: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    """Latency per path; the paths take turns request by request, in a rotating order."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    names = list(paths)
    times: dict[str, list[float]] = {name: [] for name in names}
    with httpx.Client(timeout=120) as client:
        for i in range(WARMUP):  # warm-up every path (connections, caches)
            body["prompt"] = PREDICTABLE[i % len(PREDICTABLE)]
            for name in names:
                one(client, f"{paths[name]}/v1/completions", body, stream)
        for i in range(n):
            body["prompt"] = PREDICTABLE[i % len(PREDICTABLE)]
            # Rotate which path goes first so drift and caching favour none.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                times[name].append(one(client, f"{paths[name]}/v1/completions", body, stream))
    direct = times["direct"]
    out: dict[str, Any] = {"requests_per_path": n, "max_tokens": max_tokens, "stream": stream}
    for name in names:
        t = times[name]
        entry: dict[str, Any] = {"p50_ms": round(quantile(t, 0.5), 3), "p99_ms": round(quantile(t, 0.99), 3)}
        if name != "direct":
            entry["added_p50_ms"] = round(quantile(t, 0.5) - quantile(direct, 0.5), 3)
            entry["added_p99_ms"] = round(quantile(t, 0.99) - quantile(direct, 0.99), 3)
            entry["paired_median_added_ms"] = round(statistics.median(a - b for a, b in zip(t, direct, strict=True)), 3)
            entry["ratio_p50"] = round(quantile(t, 0.5) / quantile(direct, 0.5), 4)
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="an already running vLLM lab engine")
    parser.add_argument("--model", default="lab-target")
    parser.add_argument("--requests", type=int, default=200, help="requests per path and mode")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    server = None
    if args.base_url is None:
        from tuner.lab.serve import LabServer

        server = LabServer(draft="good", k=3, workdir=REPO / ".lab" / "bench-tap")
        print("starting a lab engine (good draft, K=3)...", flush=True)
        server.start()
        base_url, model = server.base_url, server.model_name
    else:
        base_url, model = args.base_url.rstrip("/"), args.model

    tmp = Path(tempfile.mkdtemp(prefix="bench-tap-"))
    dbs = {client: f"sqlite:///{tmp / f'tap-{client}.db'}" for client in ("lean", "httpcore")}
    taps: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for client, db_url in dbs.items():
            upgrade(db_url)
            taps[client] = start_tap(base_url, db_url, client)
        paths = {"direct": base_url, **{f"tap_{client}": url for client, (_, url) in taps.items()}}
        plain = measure(paths, model, args.requests, args.max_tokens, stream=False)
        streamed = measure(paths, model, max(20, args.requests // 2), args.max_tokens, stream=True)
    finally:
        for proc, _ in taps.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        if server is not None:
            server.stop()
    recorded = {}
    for client, db_url in dbs.items():
        with Store(db_url) as store:
            recorded[client] = len(store.requests())
    sent_via_each_tap = plain["requests_per_path"] + streamed["requests_per_path"] + 2 * WARMUP

    result = {
        "benchmark": "tap_added_latency",
        "engine": "vLLM CPU lab engine, good draft, K=3" if server is not None else base_url,
        "target_p99_added_ms": TARGET_P99_ADDED_MS,
        "json": plain,
        "sse": streamed,
        "recorded_via_each_tap": recorded,
        "sent_via_each_tap": sent_via_each_tap,
        "meets_target": plain["tap_lean"]["added_p99_ms"] <= TARGET_P99_ADDED_MS,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tap.json").write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'':30} {'p50':>9} {'p99':>9} {'added p50':>10} {'added p99':>10} {'paired med':>10}")
    for label, r in (("JSON completion", plain), ("SSE stream, to last byte", streamed)):
        print(f"{label} ({r['requests_per_path']} per path, max_tokens {r['max_tokens']})")
        for name in ("direct", "tap_lean", "tap_httpcore"):
            e = r[name]
            extra = (
                f" {e['added_p50_ms']:>8.2f}ms {e['added_p99_ms']:>8.2f}ms {e['paired_median_added_ms']:>8.2f}ms"
                if name != "direct"
                else ""
            )
            print(f"  {name:28} {e['p50_ms']:>7.2f}ms {e['p99_ms']:>7.2f}ms{extra}")
    print(f"recorded per tap: {recorded} of {sent_via_each_tap} requests sent through each")
    print(
        f"target added p99 ≤ {TARGET_P99_ADDED_MS} ms (lean tap, JSON): "
        f"{'met' if result['meets_target'] else 'NOT met'}"
    )
    print(f"wrote {RESULTS / 'tap.json'}")


if __name__ == "__main__":
    main()

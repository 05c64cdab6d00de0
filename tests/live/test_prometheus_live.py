"""A real Prometheus (Debian package ``prometheus``) scrapes the session lab engine's /metrics and a
real sidecar (``spectuner run`` with its Prometheus exporter, advisory, no actuator) watching that
engine, evaluates dashboards/alerts.yml, and EVERY query of dashboards/spectuner.json — panels,
annotations, template variables — returns data (the Fleet row's too: the sidecar exports the fleet view,
a group of one engine).

The sidecar's database starts with some history (an earlier verified change, a collector failure, and
the tap's request records of long contexts on which the draft's acceptance collapsed), as a sidecar
that has run for a while has. The test's traffic goes through a real `spectuner tap` in front of the
engine, so the short-context band comes from live requests; against the stored long-context band it
makes the collapse flag and the speculation cut-off. During the test an operator pauses the
controller, which is the decision the dashboard's annotation must show.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.records import EngineKey, EventRecord, RequestRecord
from tests import dashboard_queries as DQ
from tuner.controller import manual
from tuner.engine.process import free_port
from tuner.lab.load import run_load
from tuner.lab.models import Manifest
from tuner.lab.prompts import PREDICTABLE
from tuner.lab.serve import LabServer
from tuner.report import write_report
from tuner.store import DecisionRecord, DecisionStatus, Store, upgrade

from .processes import spawn, stop

SCRAPE_S = 1


def _wait(what: str, check: Any, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None
          ) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            pytest.fail(f"{what}: the process exited with {proc.returncode}\n{tail}")
        try:
            value = check()
        except (httpx.HTTPError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(0.25)
    tail = log.read_text()[-3000:] if log else ""
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tail}")


def _seed_history(url: str, key: EngineKey, now: datetime) -> None:
    """An hour ago: a change the controller verified, and a collector failure episode."""
    with Store(url) as store:
        did = store.record_decision(
            DecisionRecord(
                created_at=now - timedelta(hours=1),
                action="change",
                reason="change_k",
                message="K 2 → 3 predicted 1.12×",
                inputs={},
                mode="auto",
                engine=key,
                proposed_config={"method": "draft_model", "model": "good", "num_speculative_tokens": 3},
                predicted_gain=1.12,
                status=DecisionStatus.APPLIED,
            )
        )
        store.update_decision(did, status=DecisionStatus.VERIFIED, at=now - timedelta(minutes=50), realized_gain=1.08)
        store.write_events(
            [
                # As collectors.scrape.Collector writes it: no engine (the page did not answer), the URL.
                EventRecord(
                    now - timedelta(minutes=55),
                    "collector_error",
                    f"scraping {key.url} failed: connection refused",
                    "warning",
                    None,
                    {"url": key.url, "reason": "connection"},
                )
            ]
        )
        store.write_requests(_long_context_history(key.model_name, now))


LONG_PROMPT_TOKENS = 1500  # band 1024-2048: the engine's own traffic (max_model_len 512) never reaches it


def _long_context_history(model_name: str, now: datetime) -> list[RequestRecord]:
    """Half an hour ago the tap stored long-context requests at K = 3 whose 100 verify steps each accepted
    0, 1, 2 and 3 drafted tokens 80, 15, 4 and 1 times: α̂ = 26 / (26 + 99) ≈ 0.21, clearly below 0.4."""
    steps = (0,) * 80 + (1,) * 15 + (2,) * 4 + (3,)
    return [
        RequestRecord(
            ts=now - timedelta(minutes=30, seconds=i),
            request_id=f"cmpl-history-{i}",
            model_name=model_name,
            prompt_tokens=LONG_PROMPT_TOKENS,
            output_tokens=128,
            latency_s=4.0,
            num_spec_tokens=3,
            num_spec_steps=100,
            num_draft_tokens=300,
            num_accepted_draft_tokens=26,
            acceptance_histogram=(80, 15, 4, 1),  # 0·80 + 1·15 + 2·4 + 3·1 = 26
            per_step_accepted=steps,
            per_step_drafted=(3,) * len(steps),
        )
        for i in range(20)
    ]


def _sidecar_config(path: Path, engine: LabServer, manifest: Manifest, db_url: str, port: int) -> None:
    draft = manifest.drafts["good"].path
    path.write_text(
        f"""
[engine]
metrics_url = "{engine.base_url}"

[speculative]
method = "draft_model"
model = "{draft}"
num_speculative_tokens = 3

[actuator]
kind = "none"

[controller]
mode = "advisory"
collect_interval_s = 1.0
decide_interval_s = 2.0
health_interval_s = 2.0

[guardrails]
min_drafts = 10
min_evidence_s = 2.0
hysteresis_ticks = 1

[policy]
evidence_window_s = 30.0

[exporters]
window_s = 20.0
refresh_interval_s = 1.0
length_refresh_s = 1.0
fleet = true
fleet_window_s = 20.0
fleet_refresh_s = 1.0

[exporters.prometheus]
enabled = true
port = {port}

[database]
url = "{db_url}"
"""
    )


@pytest.fixture
def sidecar(lab_engine: LabServer, lab_models: Manifest, tmp_path: Path) -> Iterator[tuple[str, int]]:
    db_url = f"sqlite:///{tmp_path / 'sidecar.db'}"
    upgrade(db_url)
    key = EngineKey(url=lab_engine.metrics_url, model_name=lab_engine.model_name, engine="0")
    _seed_history(db_url, key, datetime.now(UTC))
    t0 = time.monotonic()
    port = free_port()
    config = tmp_path / "spectuner.toml"
    _sidecar_config(config, lab_engine, lab_models, db_url, port)
    log = tmp_path / "sidecar.log"
    proc = spawn([sys.executable, "-m", "tuner.cli.main", "run", "--config", str(config)], log, tmp_path)
    try:
        _wait(
            "the sidecar's exporter",
            lambda: "spectuner_num_speculative_tokens{" in httpx.get(f"http://127.0.0.1:{port}/metrics").text,
            60,
            proc,
            log,
        )
        print(f"sidecar up in {time.monotonic() - t0:.1f} s")
        yield db_url, port
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.fixture
def tap(lab_engine: LabServer, sidecar: tuple[str, int], tmp_path: Path) -> Iterator[str]:
    """`spectuner tap` in front of the engine, storing per-request records in the sidecar's database."""
    port = free_port()
    log = tmp_path / "tap.log"
    argv = [sys.executable, "-m", "tuner.cli.main", "tap", "--upstream", lab_engine.base_url,
            "--listen", f"127.0.0.1:{port}", "--db", sidecar[0], "--metrics-url", lab_engine.metrics_url]
    proc = spawn(argv, log, tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait("the tap", lambda: httpx.get(f"{url}/v1/models", timeout=10).status_code == 200, 60, proc, log)
        yield url
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.fixture
def prometheus(lab_engine: LabServer, sidecar: tuple[str, int], tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("a Prometheus server is needed: run `make system-deps` (or `apt-get install -y prometheus`)",
                    pytrace=False)
    t0 = time.monotonic()
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""
global:
  scrape_interval: {SCRAPE_S}s
  evaluation_interval: {SCRAPE_S}s
rule_files:
  - {DQ.ALERTS}
scrape_configs:
  - job_name: vllm
    static_configs: [{{targets: ["127.0.0.1:{lab_engine.port}"]}}]
  - job_name: spectuner
    static_configs: [{{targets: ["127.0.0.1:{sidecar[1]}"]}}]
"""
    )
    log = tmp_path / "prometheus.log"
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
    ]
    proc = spawn(argv, log, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait("Prometheus to be ready", lambda: httpx.get(f"{base}/-/ready").status_code == 200, 30, proc, log)
        print(f"Prometheus ready in {time.monotonic() - t0:.1f} s")
        yield base
    finally:
        stop(proc)


def _range(base: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": "1s"})
    body = r.json()
    if body.get("status") != "success":
        raise AssertionError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return list(body["data"]["result"])


def _label_values(base: str, expr: str, start: float) -> list[str]:
    selector, label = DQ.label_values(DQ.substitute(expr))
    params: dict[str, Any] = {"start": start}
    if selector:
        params["match[]"] = selector
    body = httpx.get(f"{base}/api/v1/label/{label}/values", params=params).json()
    return list(body["data"]) if body.get("status") == "success" else []


def test_every_dashboard_query_returns_data(
    lab_engine: LabServer, sidecar: tuple[str, int], tap: str, prometheus: str, tmp_path: Path
) -> None:
    base = prometheus
    start = time.time()
    t_body = time.monotonic()

    def targets_up() -> bool:
        targets = httpx.get(f"{base}/api/v1/targets").json()["data"]["activeTargets"]
        return {t["labels"]["job"] for t in targets if t["health"] == "up"} == {"vllm", "spectuner"}

    _wait("Prometheus to scrape the engine and the sidecar", targets_up, 20)

    # Load for ~15 s through the tap while both are scraped; then an operator pauses the controller.
    loader = threading.Thread(
        target=run_load, args=(tap, lab_engine.model_name, PREDICTABLE), kwargs={
            "concurrency": 4, "count": 48, "max_tokens": 48}, daemon=True)
    loader.start()
    time.sleep(5)
    with Store(sidecar[0]) as store:
        manual.pause(store, datetime.now(UTC), by="test")
    loader.join(timeout=120)
    assert not loader.is_alive(), "the load did not finish"

    # Every query must return data over the test's range (what Grafana asks for when the dashboard opens).
    pending = [q for q in DQ.queries() if q.kind != "variable"]
    empty: dict[str, str] = {}

    def all_answered() -> bool:
        nonlocal pending
        now = time.time()
        still = []
        for q in pending:
            if not _range(base, DQ.substitute(q.expr), start, now):
                still.append(q)
        pending = still
        return not pending

    deadline = time.monotonic() + 30
    while not all_answered() and time.monotonic() < deadline:
        time.sleep(1)
    empty = {q.where: DQ.substitute(q.expr) for q in pending}
    assert not empty, f"dashboard queries without data: {empty}"

    # The live short-context band (through the tap) beside the stored long one: a collapse, a cut-off.
    def latest(expr: str) -> dict[str, float]:
        rows = _range(base, expr, time.time() - 5, time.time())
        return {r["metric"].get("band", ""): float(r["values"][-1][1]) for r in rows}

    by_band = _wait("the live short-context band", lambda: (b := latest("spectuner_alpha_by_context_length"))
                    and "0-512" in b and b, 30)
    assert by_band["0-512"] > 0.8 and by_band["1024-2048"] < 0.4, by_band
    assert latest("spectuner_context_length_collapse") == {"": 1.0}
    assert latest("spectuner_speculation_cutoff_context_tokens") == {"": 1024.0}

    # The fleet row: this one engine is a group of one, not an outlier of itself.
    fleet_rows = _range(base, "spectuner_fleet_group_engines", time.time() - 5, time.time())
    assert [(r["metric"]["model_name"], r["metric"]["method"], float(r["values"][-1][1])) for r in fleet_rows] == [
        (lab_engine.model_name, "draft_model", 1.0)
    ]
    assert {float(r["values"][-1][1]) for r in _range(base, "spectuner_fleet_outlier", time.time() - 5, time.time())
            } == {0.0}

    for q in DQ.queries():
        if q.kind == "variable":
            assert _label_values(base, q.expr, start), f"{q.where}: {q.expr} has no values"
    assert _label_values(base, "label_values(spectuner_alpha, model_name)", start) == [lab_engine.model_name]

    # The alert rules load and evaluate against these real series without error; none fires here.
    groups = httpx.get(f"{base}/api/v1/rules").json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 6 and all(r["health"] == "ok" for r in rules), rules
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert firing == [], firing

    # The HTML report on what the sidecar stored from the real engine: α̂ of the good draft, per position.
    with Store(sidecar[0]) as store:
        report = write_report(store, tmp_path / "report")
    assert {"alpha", "positions", "timeline", "goodput", "gains"} <= set(report.images)
    measured = [b.alpha for b in report.data.alpha if b.alpha is not None]
    assert measured and min(measured) > 0.8, measured  # the good draft (greedy agreement ≈ 0.97)
    assert [p.k for p in report.data.positions] == [3]
    print(f"test body {time.monotonic() - t_body:.1f} s")

"""`spectuner run` with the exporters and an alert hook on, supervising the fake engine (a real server
process): its Prometheus endpoint shows the engine's figures and the change it applies, a signed
webhook receives the config_applied event, and the OTLP receiver gets metrics and the decision/apply
spans (flushed at SIGTERM)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.receivers import OtlpReceiver, Receiver
from tests.integration.test_daemon import (
    kill_leftovers,
    nothing_listens,
    start_daemon,
    stop_daemon,
    wait_for,
    write_config,
)
from tuner.engine.process import free_port
from tuner.store import upgrade

SECRET = "daemon-test-hmac-key"


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(series: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    for (n, labs), v in series.items():
        if n == name and set(labels.items()) <= labs:
            return v
    return None


def test_daemon_exports_metrics_spans_and_alerts(tmp_path: Path, monkeypatch: Any) -> None:
    db_url = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(db_url)
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "spectuner.toml"
    monkeypatch.setenv("SPECTUNER_TEST_HOOK_SECRET", SECRET)  # inherited by the daemon
    with Receiver() as hook, OtlpReceiver() as otlp:
        write_config(config, port, db_url)
        # Change as soon as the evidence allows: this test is about what the change exports.
        base = config.read_text().replace("min_drafts = 300", "min_drafts = 50")
        base = base.replace("hysteresis_ticks = 2", "hysteresis_ticks = 1")
        config.write_text(
            base
            + f"""
[exporters]
window_s = 5
refresh_interval_s = 0.5

[exporters.prometheus]
enabled = true
port = {metrics_port}

[exporters.otlp]
enabled = true
endpoint = "{otlp.url}"
interval_s = 1

[alerts]
poll_interval_s = 0.5

[[alerts.sinks]]
name = "hook"
kind = "webhook"
url = "{hook.url}/spectuner"
secret_env = "SPECTUNER_TEST_HOOK_SECRET"
kinds = ["config_applied", "rollback"]
"""
        )
        proc = start_daemon(config)
        try:
            alpha = lambda: value(scrape(metrics_port), "spectuner_alpha")  # noqa: E731
            up = wait_for("the engine's α on /metrics", alpha, 40, proc)
            assert 0.7 < up < 0.9  # the fake engine accepts with α = 0.8
            series = wait_for(
                "K = 8 on /metrics",
                lambda: (s := scrape(metrics_port)) and value(s, "spectuner_num_speculative_tokens") == 8 and s,
                60,
                proc,
            )
            assert value(series, "spectuner_decisions_total", action="apply", reason="change_k") == 1
            assert value(series, "spectuner_config_info", method="ngram") == 1
            [req] = hook.wait_for(1, timeout_s=20)
            out, err = stop_daemon(proc)
        finally:
            kill_leftovers(proc, tmp_path)
        assert nothing_listens(metrics_port)
        body = json.loads(req.body)
        assert body["kind"] == "config_applied" and "K=8" in body["message"]
        expected = "sha256=" + hmac.new(SECRET.encode(), req.body, hashlib.sha256).hexdigest()
        assert req.headers["x-spectuner-signature"] == expected
        assert SECRET not in out + err
        names = {name for _, name, _, _ in otlp.metric_points()}
        assert {"spectuner_alpha", "spectuner_decisions_total", "spectuner_num_speculative_tokens"} <= names
        spans = [span for _, span in otlp.spans()]
        assert any(s.name == "spectuner.apply" for s in spans)
        assert any(s.name == "spectuner.decision" for s in spans)

"""The [exporters] and [alerts] config sections: the example file's values, safe defaults, and errors
that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.config import ConfigError, load_config, parse_config

EXAMPLE = Path(__file__).resolve().parents[4] / "docs" / "spectuner.example.toml"
MINIMAL = {
    "engine": {"metrics_url": "http://127.0.0.1:8000"},
    "speculative": {"method": "ngram", "num_speculative_tokens": 3},
}


def problems(extra: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config({**MINIMAL, **extra})
    return info.value.problems


def test_example_file_sections() -> None:
    cfg = load_config(EXAMPLE)
    p = cfg.exporters.prometheus
    assert (p.enabled, p.host, p.port) == (True, "127.0.0.1", 9464)
    assert cfg.exporters.otlp.enabled is False and cfg.exporters.otlp.endpoint == "http://127.0.0.1:4318"
    [sink] = cfg.alerts.sinks
    assert (sink.kind, sink.secret_env, sink.retries, sink.dedup_window_s) == (
        "webhook",
        "SPECTUNER_WEBHOOK_SECRET",
        3,
        300.0,
    )


def test_defaults_serve_nothing() -> None:
    cfg = parse_config(MINIMAL)
    assert not cfg.exporters.enabled and cfg.exporters.prometheus.host == "127.0.0.1"
    assert cfg.alerts.sinks == []


def test_errors_name_the_key() -> None:
    [p] = problems({"exporters": {"prometheus": {"port": 70000}}})
    assert p.startswith("exporters.prometheus.port:")
    [p] = problems({"exporters": {"otlp": {"endpoint": "127.0.0.1:4318"}}})
    assert p.startswith("exporters.otlp.endpoint:") and "http://HOST:4318" in p
    [p] = problems({"alerts": {"sinks": [{"name": "x", "kind": "webhook", "url": "http://h", "secret": "abc"}]}})
    assert p.startswith("alerts.sinks.0.secret: is not a known key")
    [p] = problems({"alerts": {"sinks": [{"name": "x", "kind": "slack"}]}})
    assert p.startswith("alerts.sinks.0:") and "url or url_env" in p

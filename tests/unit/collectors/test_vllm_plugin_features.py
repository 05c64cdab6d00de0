"""Feature detection degrades cleanly: each internal the plugin touches, removed from a copy of the
installed vLLM's source, turns the dependent feature off with a reason — never an exception — and
the plugin then answers "unsupported" (live K) or stays inert (stat logger) with one log line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.metrics.stats import IterationStats, SchedulerIterationDetails, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from collectors.vllm_plugin import env
from collectors.vllm_plugin.control import ControlServer, LiveK, vllm_lookup_builder
from collectors.vllm_plugin.features import (
    LIVE_K_FEATURES,
    PLUGIN_FEATURES,
    STAT_LOGGER_FEATURES,
    FeatureReport,
    ImportProbe,
    Requirement,
    SourceProbe,
    detect,
)
from collectors.vllm_plugin.protocol import Address
from collectors.vllm_plugin.stat_logger import SpectunerStatLogger
from tests.vllm_wheels import installed_reader

Reader = Callable[[str], str | None]
_READ = installed_reader()


def edited(module: str, old: str, new: str) -> Reader:
    """The installed vLLM's source with one edit in ``module`` (the edit must apply)."""
    original = _READ(module)
    assert original is not None and old in original, f"{old!r} not in {module}: update the test"

    def read(name: str) -> str | None:
        text = _READ(name)
        return text.replace(old, new) if name == module and text is not None else text

    return read


def test_the_installed_engine_has_every_plugin_feature() -> None:
    report = detect(SourceProbe(_READ), PLUGIN_FEATURES)
    assert report.missing == {f.name: [] for f in PLUGIN_FEATURES}


@pytest.mark.parametrize(
    ("module", "old", "new", "feature", "fragment"),
    [
        # schedule() stops reading the lookup per step: swapping it would change nothing
        (
            "vllm.v1.core.sched.scheduler",
            "self.dynamic_sd_lookup[",
            "self._k_by_batch[",
            "live_k",
            "Scheduler.schedule indexing self.dynamic_sd_lookup[...] not found",
        ),
        (
            "vllm.v1.spec_decode.dynamic.utils",
            "vllm_max_batch_size: int",
            "max_batch_size: int",
            "k_table",
            "has no parameter(s) vllm_max_batch_size",
        ),
        (
            "vllm.config.speculative",
            "num_speculative_tokens_per_batch_size:",
            "k_per_batch:",
            "k_table",
            "SpeculativeConfig has no attribute(s) num_speculative_tokens_per_batch_size",
        ),
        (
            "vllm.v1.spec_decode.metrics",
            "num_draft_tokens_per_pos: list[int]",
            "drafted_per_pos: list[int]",
            "per_step_stats",
            "SpecDecodingStats has no attribute(s) num_draft_tokens_per_pos",
        ),
        (
            "vllm.v1.metrics.loggers",
            "        engine_idx: int = 0,\n    ): ...",
            "    ): ...",
            "stat_logger_plugin",
            "StatLoggerBase.record",
        ),
        ("vllm.plugins", '"vllm.stat_logger_plugins"', '"vllm.stat_loggers"', "stat_logger_plugin", "the string"),
    ],
)
def test_a_missing_internal_turns_its_feature_off_with_the_reason(
    module: str, old: str, new: str, feature: str, fragment: str
) -> None:
    report = detect(SourceProbe(edited(module, old, new)), PLUGIN_FEATURES)
    assert not report.ok(feature)
    assert fragment in " ".join(report.missing[feature])
    others = {f.name for f in PLUGIN_FEATURES} - {feature}
    assert all(report.ok(n) for n in others), report.missing


def test_a_missing_module_and_a_broken_probe_are_reasons_not_exceptions() -> None:
    gone = detect(SourceProbe(lambda m: None if m == "vllm.v1.core.sched.scheduler" else _READ(m)), LIVE_K_FEATURES)
    assert gone.ok("k_table") and not gone.ok("live_k")
    assert "no module vllm.v1.core.sched.scheduler" in gone.missing["live_k"]

    class Broken:
        def missing(self, req: Requirement) -> list[str]:
            raise RuntimeError("boom")

    broken = detect(Broken(), LIVE_K_FEATURES)
    assert not broken.ok("live_k") and "check failed (RuntimeError: boom)" in broken.missing["live_k"][0]
    assert (
        detect(SourceProbe(lambda m: "def broken(:\n"), LIVE_K_FEATURES)
        .reason("live_k")
        .startswith("this vLLM lacks internals")
    )


def test_import_probe_reads_live_signatures() -> None:
    probe = ImportProbe()
    assert probe.missing(Requirement("function", "vllm.v1.spec_decode.dynamic.utils", name="nope")) == [
        "no vllm.v1.spec_decode.dynamic.utils.nope()"
    ]
    bad_param = Requirement(
        "function", "vllm.v1.spec_decode.dynamic.utils", name="build_dynamic_sd_schedule_lookup", names=("k",)
    )
    assert "has no parameter(s) k" in probe.missing(bad_param)[0]
    assert probe.missing(Requirement("class", "vllm.no_such_module", "X"))[0].startswith("cannot import")


def _scheduler() -> Any:
    return SimpleNamespace(
        num_spec_tokens=3,
        dynamic_sd_lookup=vllm_lookup_builder([[1, 8, 3]], 8, 3),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        vllm_config=SimpleNamespace(device_config=SimpleNamespace(device_type="cpu")),
    )


def test_live_k_without_its_internals_answers_unsupported_and_reports_features() -> None:
    report = detect(
        SourceProbe(edited("vllm.v1.core.sched.scheduler", "self.dynamic_sd_lookup[", "self.x[")), LIVE_K_FEATURES
    )
    sched = _scheduler()
    before = sched.dynamic_sd_lookup
    server = ControlServer(LiveK(sched, features=report), Address(), "tok")
    got = server.handle_line(b'{"token": "tok", "op": "get"}')
    assert got["ok"] and not got["state"]["supported"]
    assert got["state"]["features"] == {"k_table": True, "live_k": False}
    assert "K changes need a restart" in got["state"]["reason"]
    refused = server.handle_line(b'{"token": "tok", "op": "set", "table": [[1, 8, 1]]}')
    assert refused["code"] == "unsupported" and sched.dynamic_sd_lookup is before


def _config() -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="m"),
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
    )


def test_stat_logger_without_its_fields_is_inert_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(env.INGEST_URL, "http://127.0.0.1:9/v1/steps")
    report = detect(
        SourceProbe(edited("vllm.v1.spec_decode.metrics", "num_draft_tokens_per_pos: list[int]", "x: list[int]")),
        STAT_LOGGER_FEATURES,
    )
    with caplog.at_level(logging.WARNING, logger="vllm.spectuner"):
        lg = SpectunerStatLogger(_config(), 0, features=report)
        lg.record(SchedulerStats(num_running_reqs=1, spec_decoding_stats=SpecDecodingStats.new(3)), IterationStats())
    assert lg.shipper is None
    lines = [r for r in caplog.records if r.name.startswith("vllm.spectuner")]
    assert len(lines) == 1 and "per-step stats are off" in lines[0].getMessage()
    assert "num_draft_tokens_per_pos" in lines[0].getMessage()


def test_stat_logger_without_iteration_details_estimates_batch_and_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.INGEST_URL, "http://127.0.0.1:9/v1/steps")
    report = FeatureReport({f.name: [] for f in STAT_LOGGER_FEATURES} | {"iteration_details": ["gone"]})
    lg = SpectunerStatLogger(_config(), 0, features=report)
    assert lg.shipper is not None and not lg.use_details
    details = SchedulerIterationDetails(
        iteration_index=1,
        num_ctx_requests=0,
        num_ctx_tokens=0,
        num_generation_requests=4,
        num_generation_tokens=4,
        elapsed_ms=20.0,
    )
    rec = lg.step_record(SchedulerStats(num_running_reqs=2, iteration_details=details), IterationStats(), 0, 1e9, 1.0)
    assert rec is not None and rec["bs"] == "frontend" and rec["b"] == 2

"""`[shadow]` in the daemon: the in-process front door records streamed and non-streamed completions from
a real HTTP upstream, and the daemon's job replays the record in a child process and stores each
candidate's α̂ (ngram: no model needed), reporting a child that fails or overruns as an event."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from collectors.traffic_record import RecorderSettings, SampleStore, TrafficSample
from tests.integration.test_shadow_cli import OUTPUTS, PROMPT, ngram_evidence
from tests.integration.test_tap_proxy import UPSTREAM, ThreadedServer
from tuner.actuators.front_door import InProcessTap
from tuner.config import SpectunerConfig, parse_config
from tuner.daemon import Daemon
from tuner.shadow_job import ShadowJob, shadow_job
from tuner.store import Store, upgrade
from tuner.store.shadow import latest_shadow_results
from tuner.wiring import DaemonStartError, draft_candidates, traffic_recorder

pytestmark = pytest.mark.integration
T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
NGRAM = {"prompt_lookup_min": 2, "prompt_lookup_max": 3}


def write_target(d: Path) -> Path:
    """A target directory with a real word-level tokenizer.json (the fake upstream answers in words)."""
    d.mkdir(parents=True)
    vocab = {"[UNK]": 0, "ab": 1, "c": 2, "tok": 3, "tok0": 4, "tok1": 5, "tok2": 6, "x": 7}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text("{}")
    return d


def config(tmp_path: Path, db_url: str, *, off: bool = False, **shadow: Any) -> SpectunerConfig:
    data: dict[str, Any] = {
        "engine": {"metrics_url": "http://127.0.0.1:9"},
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
        "database": {"url": db_url},
        "drafts": [{"name": "lookup", "method": "ngram", "extra": NGRAM}],
    }
    if not off:
        data["shadow"] = {"record_dir": "traffic", "target": "target", **shadow}
    return parse_config(data, base_dir=tmp_path)


def test_the_in_process_front_door_records_streamed_and_plain_completions(tmp_path: Path) -> None:
    write_target(tmp_path / "target")
    cfg = config(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", record_sample_rate=1.0)
    recorder = traffic_recorder(cfg)
    assert recorder is not None
    with ThreadedServer(UPSTREAM) as upstream:
        tap = InProcessTap("127.0.0.1", 0, [upstream.url], max_hold_s=10, max_held=10, read_timeout_s=30,
                           traffic=recorder)
        tap.start()
        try:
            body = {"model": "target", "prompt": "ab c", "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{tap.url}/v1/completions", json=body).status_code == 200
            with httpx.stream("POST", f"{tap.url}/v1/completions", json={**body, "stream": True}) as r:
                r.read()
            assert httpx.get(f"{tap.url}/v1/models").status_code in (200, 404)  # not a completion: not drawn
            deadline = time.monotonic() + 10
            while recorder.stats.recorded < 2:
                assert time.monotonic() < deadline, recorder.stats_dict()
                time.sleep(0.02)
        finally:
            tap.stop()
    samples = sorted(SampleStore(RecorderSettings(tmp_path / "traffic")), key=lambda s: s.ts)
    assert [s.prompt_ids for s in samples] == [(1, 2), (1, 2)]  # "ab c", tokenised with the target's tokenizer
    assert [s.output_ids for s in samples] == [(3, 3), (4, 5, 6)]  # " tok tok"; the stream's " tok0 tok1 tok2"
    assert recorder.stats.seen == 2


def test_a_bad_record_dir_or_tokenizer_stops_the_start_with_the_key(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DaemonStartError, match=r"\[shadow\] target"):
        traffic_recorder(config(tmp_path, "sqlite:///x.db"))
    (tmp_path / "afile").write_text("")
    with pytest.raises(DaemonStartError, match=r"\[shadow\] record_dir"):
        traffic_recorder(config(tmp_path, "sqlite:///x.db", record_dir="afile/traffic"))


def record(d: Path) -> None:
    SampleStore(RecorderSettings(d)).append([
        TrafficSample(T0 + timedelta(seconds=i), f"r{i}", "m", PROMPT, out, True, False, "response", "completions")
        for i, out in enumerate(OUTPUTS)
    ])


def test_the_daemons_job_replays_the_record_in_a_child_and_stores_ngram_alpha(db_url: str, tmp_path: Path) -> None:
    write_target(tmp_path / "target")
    cfg = config(tmp_path, db_url, evaluate_interval_s=60)
    with Store(db_url) as store:
        job = shadow_job(cfg, store, lambda: draft_candidates(cfg, store))
        assert job is not None
        assert job.run_once(T0)["note"] == "no recorded samples yet"
        record(tmp_path / "traffic")
        summary = job.run_once(T0)
        (row,) = summary["candidates"]
        ev = ngram_evidence()
        assert row["candidate"] == "lookup" and row["drafts"] == ev.drafts > 0
        assert row["alpha"] == pytest.approx(ev.successes / ev.trials)
        stored = latest_shadow_results(store, T0 - timedelta(days=1))
        assert stored["lookup"].alpha == pytest.approx(row["alpha"])  # what the controller's context reads
        (event,) = [e for e in store.events() if e.kind == "shadow_evaluated"]
        assert "lookup α̂" in event.message and event.data["samples"] == 2
        assert event.data["wall_s"] > 0  # how long the child ran: a starved replay shows here
        # what it cost the host: at least the interpreter's start and its imports, at most its wall time
        assert 0 < event.data["cpu_s"] <= event.data["wall_s"] * (os.cpu_count() or 1) + 0.5


def test_the_daemons_job_waits_longer_while_replays_agree_and_runs_at_once_when_the_traffic_moves(
    db_url: str, tmp_path: Path
) -> None:
    write_target(tmp_path / "target")
    # the CPU budget off: this is the backoff alone (the next test is the budget)
    cfg = config(tmp_path, db_url, evaluate_interval_s=60, evaluate_interval_max_s=240, max_machine_share=0)
    with Store(db_url) as store:
        job = shadow_job(cfg, store, lambda: draft_candidates(cfg, store))
        assert job is not None
        assert job.run_if_due(T0) is not None  # nothing recorded yet: it looked, and will look again
        record(tmp_path / "traffic")
        assert job.run_if_due(T0 + timedelta(seconds=1))["samples"] == 2
        assert job.schedule.current_wait_s == 60
        assert job.run_if_due(T0 + timedelta(seconds=30)) is None and "next at" in (job.last_skip or "")
        assert job.run_if_due(T0 + timedelta(seconds=61)) is not None  # the same record: the same α̂
        assert job.schedule.current_wait_s == 120
        assert job.run_if_due(T0 + timedelta(seconds=150)) is None
        # the controller saw the acceptance move after that run began: a ranking may change, so run now
        moved = job.run_if_due(T0 + timedelta(seconds=150), traffic_moved_at=T0 + timedelta(seconds=100))
        assert moved is not None and job.last_skip is None
        assert len([e for e in store.events() if e.kind == "shadow_evaluated"]) == 3


def test_the_daemons_job_charges_each_replay_its_measured_cpu_against_the_budget(
    db_url: str, tmp_path: Path
) -> None:
    write_target(tmp_path / "target")
    record(tmp_path / "traffic")
    cfg = config(tmp_path, db_url, evaluate_interval_s=60, max_machine_share=0.01)
    cpus = len(os.sched_getaffinity(0))
    with Store(db_url) as store:
        job = shadow_job(cfg, store, lambda: draft_candidates(cfg, store))
        assert job is not None
        first = job.run_if_due(T0)
        assert first is not None and first["samples"] == 2
        # what the child measured, over the CPUs this host lends the daemon
        cost = job.schedule.cost_s
        assert cost is not None and cost == pytest.approx(first["cpu_s"] / cpus)
        # as if a burst had spent the bucket at T0: the traffic moving does not run a replay it cannot pay for
        job.schedule = replace(job.schedule, credit_s=0.0, credit_at=T0)
        moved_at = T0 + timedelta(seconds=1)
        refill_s = cost / 0.01  # a run's cost at 1 % of the host
        assert job.run_if_due(T0 + timedelta(seconds=refill_s / 2), traffic_moved_at=moved_at) is None
        assert "max_machine_share = 0.01" in (job.last_skip or "")
        later = T0 + timedelta(seconds=refill_s + 1)
        second = job.run_if_due(later, traffic_moved_at=moved_at)
        assert second is not None and job.last_skip is None
        # charged what this run measured: the bucket held its refill (cost + 0.01 s·share), less that
        assert job.schedule.cost_s == pytest.approx(second["cpu_s"] / cpus)
        assert job.schedule.credit_s == pytest.approx(cost + 0.01 - second["cpu_s"] / cpus)
        assert len([e for e in store.events() if e.kind == "shadow_evaluated"]) == 2


def test_a_failing_or_overrunning_replay_is_an_event_not_an_exception(db_url: str, tmp_path: Path) -> None:
    write_target(tmp_path / "target")
    record(tmp_path / "traffic")
    notmodel = tmp_path / "notmodel"
    notmodel.mkdir()  # no config.json: not a model directory
    cfg = parse_config(
        {
            "engine": {"metrics_url": "http://127.0.0.1:9"},
            "speculative": {"method": "ngram", "num_speculative_tokens": 3},
            "drafts": [{"name": "broken", "model": str(notmodel)}],
            "shadow": {"record_dir": "traffic", "target": "target"},
        },
        base_dir=tmp_path,
    )
    with Store(db_url) as store:
        job = shadow_job(cfg, store, lambda: draft_candidates(cfg, store))
        assert job is not None
        assert "exited 2" in job.run_once(T0)["error"]
        slow = ShadowJob(store, job.spec, job.candidates, timeout_s=0.001)
        assert "ran past" in slow.run_once(T0)["error"]
        failed = [e for e in store.events() if e.kind == "shadow_failed"]
        assert len(failed) == 2 and all(e.severity == "warning" for e in failed)
        assert "not a model directory" in failed[0].message


def test_the_daemon_schedules_the_job_only_when_shadow_evaluates(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'd.db'}"
    upgrade(db)
    write_target(tmp_path / "target")
    with Store(db) as store:
        assert Daemon(config(tmp_path, db), store).shadow_job is not None
        assert Daemon(config(tmp_path, db, evaluate_interval_s=0), store).shadow_job is None
        assert Daemon(config(tmp_path, db, off=True), store).shadow_job is None


def test_a_job_stopped_before_its_child_starts_never_starts_it(db_url: str, tmp_path: Path) -> None:
    # stop() can land between a run's checks and its child's start; the child must then not start (it would
    # run for up to timeout_s with the daemon's shutdown waiting on it)
    write_target(tmp_path / "target")
    record(tmp_path / "traffic")
    cfg = config(tmp_path, db_url, evaluate_interval_s=60)
    with Store(db_url) as store:
        job = shadow_job(cfg, store, lambda: draft_candidates(cfg, store))
        assert job is not None
        job.stop()
        assert job.run_once(T0) == {"samples": 0, "candidates": [], "note": "stopped with the daemon"}
        assert not [e for e in store.events() if e.kind.startswith("shadow_")]
        assert latest_shadow_results(store, T0 - timedelta(days=1)) == {}  # a child that ran would have stored α̂

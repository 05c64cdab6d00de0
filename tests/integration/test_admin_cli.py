"""The admin CLI (`spectuner status|history|apply|pause|resume|drafts`) as the real console script in
a subprocess, against real SQLite and PostgreSQL: JSON documents, exit codes, audit rows (who and
when), and a real :class:`Controller` that holds while paused and applies the override after resume.

Each subprocess pays the CLI's import time (seconds on a busy 2-core machine), so the console script
runs for one write and one read (pause, status, on SQLite) and everything else runs the same commands
in-process through typer's runner, on both backends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from collectors.records import EngineKey, EventRecord, WindowRecord
from policies.counters import SpecCounters
from policies.spec_config import SpecConfig
from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, VllmSpec
from tuner.cli.main import app
from tuner.config import ControllerSection, Mode
from tuner.controller import manual
from tuner.controller.controller import Controller
from tuner.controller.drafts import registered_drafts
from tuner.controller.settings import ControllerSettings
from tuner.store import AppliedBy, EngineConfigRecord, Store

SPECTUNER = str(Path(sys.executable).with_name("spectuner"))
URL = "http://127.0.0.1:8000/metrics"
KEY = EngineKey(URL, "lab-target", "0")
K3 = {"method": "draft_model", "model": "/drafts/good", "num_speculative_tokens": 3}


def utc_now() -> datetime:
    return datetime.now(UTC)


def cli(*args: str, user: str | None = None, timeout_s: float = 120) -> tuple[int, str, str]:
    """Run the console script; returns (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPECTUNER_DB", "SPECTUNER_USER")}
    if user is not None:
        env["SPECTUNER_USER"] = user
    done = subprocess.run(
        [SPECTUNER, *args], capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL
    )
    return done.returncode, done.stdout, done.stderr


def cli_json(*args: str, user: str | None = None) -> Any:
    code, out, err = cli(*args, "--json", user=user)
    assert code == 0, f"exit {code}: {err}"
    return json.loads(out)  # exactly one JSON document on stdout


runner = CliRunner()


def run(*args: str, user: str = "tester") -> tuple[int, str]:
    """The same commands in-process (typer's runner; stdin is not a terminal here either):
    (exit code, stdout and stderr mixed)."""
    result = runner.invoke(app, list(args), env={"SPECTUNER_USER": user, "SPECTUNER_DB": ""})
    return result.exit_code, result.output


def run_json(*args: str, user: str = "tester") -> Any:
    result = runner.invoke(app, [*args, "--json"], env={"SPECTUNER_USER": user, "SPECTUNER_DB": ""})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


class RecordingActuator(Actuator):
    """Our seam: remembers what it was asked to apply and says it worked."""

    kind = "restart"

    def __init__(self, current: VllmSpec) -> None:
        super().__init__()
        self.current = dict(current)
        self.applied: list[VllmSpec] = []

    def apply(self, config: VllmSpec) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged:
            return unchanged
        self.applied.append(dict(config))
        self.current = dict(config)
        return ApplyResult(ApplyStatus.APPLIED, "restarted", self.current, 1.0)


@pytest.fixture
def seeded(db_url: str) -> Iterator[tuple[str, Store, datetime]]:
    """An engine series at K = 3 with 5 minutes of windows (α = 0.8, i.i.d.) ending now, and one event."""
    store = Store(db_url)
    now = datetime.now(UTC)
    start = now - timedelta(seconds=300)
    record = EngineConfigRecord.of(SpecConfig.from_vllm(K3), start - timedelta(seconds=60), AppliedBy.STARTUP)
    config_id = store.record_config(KEY, record)
    per_pos = (160, 128, 102)  # 200 drafts × 0.8, 0.8², 0.8³
    store.write_windows(
        [
            WindowRecord(
                key=KEY,
                start=start + timedelta(seconds=10 * i),
                end=start + timedelta(seconds=10 * (i + 1)),
                spec=SpecCounters(200, 600, sum(per_pos), per_pos),
                generation_tokens=1000.0,
                config_id=config_id,
            )
            for i in range(30)
        ]
    )
    store.write_events([EventRecord(now - timedelta(seconds=5), "scrape_stale", "late", "warning", KEY)])
    try:
        yield db_url, store, now
    finally:
        store.close()


def test_pause_apply_resume_status_history(seeded: tuple[str, Store, datetime], backend: str) -> None:
    url, store, _ = seeded
    # The console script in a fresh interpreter on one backend (its behaviour does not depend on the
    # backend; each start costs seconds of imports); in-process on the other.
    via = cli_json if backend == "sqlite" else run_json
    settings = ControllerSettings(metrics_url=URL, controller=ControllerSection(mode=Mode.ADVISORY))
    ctl = Controller(store, RecordingActuator(K3), settings, utc_now)

    # pause: who from $SPECTUNER_USER, when = the row's time; the controller holds
    before = datetime.now(UTC)
    paused = via("pause", "--db", url, "--note", "load test", user="alice")
    after = datetime.now(UTC)
    row = store.decision(paused["audit_id"])
    assert row.decision.action == "pause" and row.status == "in_force" and row.decision.mode == "manual"
    assert row.decision.inputs["by"] == "alice" and paused["by"] == "alice"
    assert before - timedelta(seconds=1) <= row.decision.created_at <= after
    assert "load test" in row.decision.message
    assert ctl.decide(datetime.now(UTC)).reason == "paused"

    # apply without --yes and without a terminal: exit 2, nothing written
    code, out = run("apply", "--db", url, "--draft", "ngram", "--k", "4")
    assert code == 2 and "pass --yes" in out
    assert manual.pending_overrides(store) == []

    # apply --yes --by: an override row with who; the paused controller still holds
    wrote = run_json(
        "apply", "--db", url, "--draft", "ngram", "--k", "4", "--k-table", "[[1,4,4],[5,16,1]]", "--yes", "--by", "bob"
    )
    new = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 16, 1]],
    }
    assert wrote["config"] == new and wrote["previous_config"] == K3
    assert any("paused" in w for w in wrote["warnings"])
    override = store.decision(wrote["audit_id"])
    assert override.decision.action == "override" and override.status == "proposed"
    assert override.decision.inputs["by"] == "bob" and override.decision.proposed_config == new
    assert override.decision.engine == KEY
    assert ctl.decide(datetime.now(UTC)).reason == "override_waiting"
    assert ctl.actuator.applied == []  # type: ignore[attr-defined]

    # status while K = 3 is in force: α̂ over its windows (the controller's estimate)
    w = via("status", "--db", url, "--window-s", "600")["engines"][0]["window"]
    assert w["windows"] == 30 and w["drafts"] == 6000 and w["accepted_tokens"] == 11700
    assert w["draft_acceptance_rate"] == pytest.approx(11700 / 18000)
    assert w["mean_acceptance_length"] == pytest.approx(1 + 11700 / 6000)
    assert w["alpha"] == pytest.approx(11700 / (11700 + 6000 - 3060))  # A / (A + D − a_{K−1})
    assert w["alpha_ci"][0] < w["alpha"] < w["alpha_ci"][1]

    # resume: lifts the pause (status lifted), audited; the next tick applies the override
    resumed = run_json("resume", "--db", url, user="carol")
    assert resumed["by"] == "carol" and [p["audit_id"] for p in resumed["lifted"]] == [paused["audit_id"]]
    assert store.decision(paused["audit_id"]).status == "lifted"
    assert store.decision(resumed["audit_id"]).decision.inputs["by"] == "carol"
    result = ctl.decide(datetime.now(UTC))
    assert result.action == "applied", result
    assert ctl.actuator.applied == [new]  # type: ignore[attr-defined]

    # status: the new config with who applied it, nothing paused or waiting; α̂ is the config in force's,
    # which has no window yet (the old draft's windows still count for throughput)
    status = via("status", "--db", url, "--window-s", "600")
    assert status["paused"] is False and status["pending_overrides"] == []
    (engine,) = status["engines"]
    assert (engine["url"], engine["model_name"], engine["engine"]) == (URL, "lab-target", "0")
    cfg = engine["config"]
    assert (cfg["method"], cfg["num_spec_tokens"], cfg["applied_by"], cfg["by"]) == ("ngram", 4, "manual", "bob")
    assert cfg["k_table"] == [[1, 4, 4], [5, 16, 1]]
    w = engine["window"]
    assert w["windows"] == 30 and w["drafts"] == 0 and w["alpha"] is None and w["alpha_reason"] == "no_drafts"
    assert w["alpha_since"] == cfg["since"]
    assert w["throughput_tokens_per_s"] == pytest.approx(100.0)
    assert engine["events"]["warning"] == 1 and engine["events"]["critical"] == 0
    assert engine["last_decision"]["id"] == wrote["audit_id"] and engine["last_decision"]["by"] == "bob"
    assert [p["id"] for p in engine["pending"]] == [wrote["audit_id"]]  # applied, awaiting verification
    assert 0 <= engine["last_window_age_s"] < 120

    # history: newest first, who on manual rows, every kind
    hist = run_json("history", "--db", url, "--since", "1h")
    decisions = [r for r in hist["rows"] if r["kind"] == "decision"]
    manual_rows = [r for r in decisions if r["mode"] == "manual"]
    assert [(r["action"], r["by"]) for r in manual_rows] == [
        ("resume", "carol"),
        ("override", "bob"),
        ("pause", "alice"),
    ]
    assert manual_rows[1]["status"] == "applied"
    # the controller's own proposal while paused was held back (and has no "who")
    assert all(r["by"] is None and r["status"] == "blocked" for r in decisions if r["mode"] != "manual")
    times = [datetime.fromisoformat(r["ts"]) for r in hist["rows"]]
    assert times == sorted(times, reverse=True)
    kinds = {r["kind"] for r in hist["rows"]}
    assert kinds == {"decision", "event", "config"}
    configs = [r for r in hist["rows"] if r["kind"] == "config"]
    assert [(c["method"], c["applied_by"]) for c in configs] == [("ngram", "manual"), ("draft_model", "startup")]
    only = run_json("history", "--db", url, "--kind", "decisions", "--limit", "1")
    assert [r["action"] for r in only["rows"]] == ["resume"]


def test_drafts_registry(seeded: tuple[str, Store, datetime], tmp_path: Path) -> None:
    url, store, _ = seeded
    draft_dir = tmp_path / "draft-good"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 128,
                "torch_dtype": "float32",
            }
        )
    )
    added = run_json(
        "drafts", "add", "good", "--method", "draft_model", "--model", str(draft_dir), "--db", url, user="dana"
    )
    assert added["draft"]["model"] == str(draft_dir.resolve()) and added["draft"]["dtype"] == "float32"
    assert added["draft"]["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # layers × (K,V) × kv heads × head dim × 4 B
    row = store.decision(added["audit_id"])
    assert row.decision.action == "draft_add" and row.decision.inputs["by"] == "dana"

    code, out = run("drafts", "add", "good", "--method", "ngram", "--db", url)
    assert code == 2 and "already registered" in out

    listed = run_json("drafts", "list", "--db", url)
    assert [(d["name"], d["source"], d["added_by"]) for d in listed["drafts"]] == [("good", "registry", "dana")]

    # apply --draft NAME uses the registry entry
    wrote = run_json("apply", "--db", url, "--draft", "good", "--k", "2", "--yes", "--by", "dana")
    assert wrote["config"] == {"method": "draft_model", "model": str(draft_dir.resolve()), "num_speculative_tokens": 2}

    removed = run_json("drafts", "remove", "good", "--db", url, user="erin")
    assert store.decision(removed["audit_id"]).decision.inputs == {"by": "erin", "draft": {"name": "good"}}
    assert registered_drafts(store) == []
    code, out = run("drafts", "remove", "good", "--db", url)
    assert code == 2 and "no registered draft named 'good'" in out


# --- in-process (no fresh interpreter needed): argument and database errors ----------------------


def test_usage_errors_exit_2_and_write_nothing(seeded: tuple[str, Store, datetime]) -> None:
    url, store, _ = seeded
    rows_before = len(store.decisions())
    cases = [
        (("apply", "--db", url, "--config-json", "{not json", "--yes"), "not valid JSON"),
        (("apply", "--db", url, "--config-json", '{"method": "magic"}', "--yes"), "not a vLLM speculative method"),
        (
            (
                "apply",
                "--db",
                url,
                "--config-json",
                '{"method": "ngram", "num_speculative_tokens": 9}',
                "--k-max",
                "8",
                "--yes",
            ),
            "above the engine's K_max 8",
        ),
        (("apply", "--db", url, "--draft", "ngram", "--k", "3", "--k-table", "[[2,4,1]]", "--yes"), "must start at 1"),
        (("apply", "--db", url, "--draft", "nosuch", "--k", "3", "--yes"), "no draft named 'nosuch'"),
        (("apply", "--db", url, "--draft", "ngram", "--yes"), "needs --k"),
        (("apply", "--db", url, "--yes"), "give --draft NAME --k N"),
        (("apply", "--db", url, "--draft", "ngram", "--k", "2", "--config-json", "{}", "--yes"), "not both"),
        (
            ("apply", "--db", url, "--engine", "http://10.0.0.1:9/", "--draft", "ngram", "--k", "2", "--yes"),
            "no engine series scraped from http://10.0.0.1:9/metrics",
        ),
        (
            ("drafts", "add", "x", "--method", "draft_model", "--model", "/no/such/dir", "--db", url),
            "no such directory",
        ),
        (
            ("drafts", "add", "x", "--method", "ngram", "--extra-json", "[1]", "--db", url),
            "extra must be a JSON object",
        ),
        (("drafts", "add", "x", "--method", "bogus", "--db", url), "is not one of"),
        (("history", "--db", url, "--since", "last tuesday"), "--since must be a duration"),
        (("history", "--db", url, "--kind", "everything"), "everything"),
        (("status", "--db", url, "--window-s", "0"), "--window-s must be positive"),
        (("pause", "--db", url, "--by", " "), "--by cannot be empty"),
    ]
    for args, fragment in cases:
        code, out = run(*args)
        assert code == 2, (args, code, out)
        assert fragment in " ".join(out.split()), (args, out)
    assert len(store.decisions()) == rows_before


def test_old_schema_exits_2_with_the_fix_and_unreachable_exits_1(empty_db_url: str) -> None:
    for args in (("status",), ("history",), ("pause",), ("drafts", "list")):
        code, out = run(*args, "--db", empty_db_url)
        assert code == 2 and "spectuner db upgrade" in out, (args, out)
    code, out = run("status", "--db", "postgresql://spectuner:hunter2@127.0.0.1:1/spectuner")
    assert code == 1 and "cannot use the database" in out and "hunter2" not in out


def test_resume_when_not_paused_writes_nothing(seeded: tuple[str, Store, datetime]) -> None:
    url, store, _ = seeded
    assert run_json("resume", "--db", url)["audit_id"] is None
    assert store.decisions() == []


def test_config_file_gives_the_database_engine_k_max_and_candidates(
    seeded: tuple[str, Store, datetime], tmp_path: Path
) -> None:
    url = seeded[0]
    toml = tmp_path / "spectuner.toml"
    toml.write_text(
        f'[engine]\nmetrics_url = "http://127.0.0.1:8000"\n[database]\nurl = "{url}"\n'
        '[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 2\n[policy]\nk_max = 4\n'
        '[[drafts]]\nname = "lookup"\nmethod = "ngram"\nextra = { prompt_lookup_max = 4 }\n'
    )
    listed = run_json("drafts", "list", "--config", str(toml))
    assert [(d["name"], d["source"]) for d in listed["drafts"]] == [("lookup", "config")]
    code, out = run("apply", "--config", str(toml), "--draft", "ngram", "--k", "5", "--yes")
    assert code == 2 and "above the engine's K_max 4" in out
    doc = run_json("apply", "--config", str(toml), "--draft", "lookup", "--k", "4", "--yes")
    assert doc["config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert doc["engine"]["url"] == URL and doc["by"] == "tester"
    assert run_json("status", "--config", str(toml))["pending_overrides"][0]["id"] == doc["audit_id"]
    # --k defaults to the largest K of --k-table
    table = run_json("apply", "--config", str(toml), "--draft", "ngram", "--k-table", "[[1,2,3],[3,16,1]]", "--yes")
    assert table["config"]["num_speculative_tokens"] == 3

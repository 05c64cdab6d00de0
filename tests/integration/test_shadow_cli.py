"""`spectuner shadow run|forget` and the measured α̂ in `spectuner drafts list`, on SQLite and PostgreSQL
(ngram replay: no model needed; draft-model replay on the lab models is in tests/live/test_shadow_live.py)."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from collectors.traffic_record import RecorderSettings, SampleStore, TrafficSample
from policies.acceptance import AcceptanceEvidence, alpha_interval, evidence_from_draft_steps
from policies.shadow_replay import ngram_propose, replay_proposer
from tuner.cli.main import app

pytestmark = pytest.mark.integration
runner = CliRunner()
# in-process: the worker's default nice would stay on the test process
SHADOW_RUN = ("shadow", "run", "--nice", "0")
T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env={"SPECTUNER_USER": "tester", "SPECTUNER_DB": ""})
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def run_json(*args: str) -> Any:
    code, out = run(*args, "--json")
    assert code == 0, out
    return json.loads(out)


# A prompt that repeats (the lookup finds it) followed by an output that half repeats it.
PROMPT = (1, 2, 3, 4, 5, 1, 2, 3, 4, 5)
OUTPUTS = [(1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 6, 1, 2, 3, 4), (6, 7, 8, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 0, 0, 0)]


def ngram_evidence() -> AcceptanceEvidence:
    """What vLLM's prompt lookup (2..3, K = 3) accepts on OUTPUTS, replayed directly."""
    acc: list[int] = []
    drf: list[int] = []
    for out in OUTPUTS:
        r = replay_proposer(PROMPT, out, lambda ctx: ngram_propose(ctx, 2, 3, 3, 1 << 30))
        acc += r.accepted
        drf += r.drafted
    return evidence_from_draft_steps(acc, drf)


@pytest.fixture
def samples(tmp_path: Path) -> Path:
    d = tmp_path / "record"
    store = SampleStore(RecorderSettings(d))
    store.append([
        TrafficSample(T0 + timedelta(seconds=i), f"r{i}", "m", PROMPT, out, True, False, "response", "completions")
        for i, out in enumerate(OUTPUTS)
    ])
    return d


@pytest.fixture
def target(tmp_path: Path) -> Path:
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": []}))
    return d


def test_ngram_is_replayed_exactly_and_listed_with_its_interval(db_url: str, samples: Path, target: Path) -> None:
    extra = '{"prompt_lookup_min": 2, "prompt_lookup_max": 3}'
    assert run("drafts", "add", "lookup", "--method", "ngram", "--extra-json", extra, "--db", db_url)[0] == 0
    listed = run_json("drafts", "list", "--db", db_url)
    assert listed["drafts"][0]["measured"] is None  # nothing measured before the shadow run

    doc = run_json(*SHADOW_RUN, "--samples", str(samples), "--target", str(target), "--k", "3", "--db", db_url)
    (row,) = doc["candidates"]
    ev = ngram_evidence()
    assert row["drafts"] == ev.drafts > 0
    assert row["accepted_tokens"] == ev.successes and row["rejections"] == ev.failures
    assert row["alpha"] == pytest.approx(ev.successes / ev.trials)
    assert row["alpha_ci"] == pytest.approx(list(alpha_interval(ev)))
    assert not row["greedy_only"] and row["samples"] == 2

    (draft,) = run_json("drafts", "list", "--db", db_url)["drafts"]
    measured = draft["measured"]
    assert measured["source"] == "shadow" and measured["alpha"] == pytest.approx(row["alpha"])
    assert measured["alpha_ci"] == pytest.approx(row["alpha_ci"]) and measured["drafts"] == row["drafts"]
    assert measured["age_s"] >= 0


def test_bad_candidates_are_refused_with_one_line(db_url: str, samples: Path, target: Path, tmp_path: Path) -> None:
    notmodel = tmp_path / "notmodel"
    notmodel.mkdir()
    (notmodel / "config.json").write_text("{}")
    assert run("drafts", "add", "broken", "--method", "draft_model", "--model", str(notmodel), "--db", db_url)[0] == 0
    (notmodel / "config.json").unlink()  # the directory stopped being a model after registration
    code, out = run(*SHADOW_RUN, "--samples", str(samples), "--target", str(target), "--db", db_url)
    assert code == 2 and "not a model directory" in out and "Traceback" not in out

    other = tmp_path / "other"
    shutil.copytree(target, other)
    (other / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "c": 1}}, "added_tokens": []}))
    assert run("drafts", "add", "alien", "--method", "draft_model", "--model", str(other), "--db", db_url)[0] == 0
    code, out = run(
        *SHADOW_RUN, "--samples", str(samples), "--target", str(target), "--candidate", "alien", "--db", db_url
    )
    assert code == 2 and "tokenizer differs from the target's" in out

    code, out = run(*SHADOW_RUN, "--samples", str(tmp_path / "nowhere"), "--target", str(target), "--db", db_url)
    assert code == 2 and "no such directory" in out


def test_heads_need_a_canary_and_forget_deletes_the_record(db_url: str, samples: Path, target: Path) -> None:
    model = target  # any directory with a config.json registers
    assert run("drafts", "add", "head", "--method", "eagle3", "--model", str(model), "--db", db_url)[0] == 0
    doc = run_json(*SHADOW_RUN, "--samples", str(samples), "--target", str(target), "--db", db_url)
    (row,) = doc["candidates"]
    assert row["skipped"] == "needs_canary" and "hidden states" in row["why"]
    assert run_json("shadow", "forget", "--samples", str(samples)) == {"deleted_samples": 2, "directory": str(samples)}
    code, out = run(*SHADOW_RUN, "--samples", str(samples), "--target", str(target), "--db", db_url)
    assert code == 2 and "no recorded samples" in out


def test_the_newest_result_per_candidate_within_the_horizon_is_the_evidence(db_url: str) -> None:
    from policies.acceptance import AcceptanceEvidence
    from tuner.store import Store
    from tuner.store.shadow import ShadowResult, latest_shadow_results, shadow_evidence, write_shadow_result

    def result(name: str, at: datetime, s: float) -> ShadowResult:
        ev = AcceptanceEvidence(s, 10.0, 10.0)
        return ShadowResult(name, "ngram", None, at, 5, 100, 3, ev, s / (s + 10), (0.1, 0.9), False, "not_needed")

    with Store(db_url) as store:
        write_shadow_result(store, result("a", T0, 10.0))
        write_shadow_result(store, result("a", T0 + timedelta(hours=1), 30.0))
        write_shadow_result(store, result("b", T0 - timedelta(days=2), 50.0))
        latest = latest_shadow_results(store)
        assert latest["a"].evidence.successes == 30.0 and latest["a"].alpha_ci == (0.1, 0.9)
        assert latest["a"].computed_at == T0 + timedelta(hours=1)
        got = shadow_evidence(store, T0 - timedelta(days=1), ["a", "b", "c"])
        assert got == {"a": AcceptanceEvidence(30.0, 10.0, 10.0)}  # b is too old, c never measured

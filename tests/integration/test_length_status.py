"""`spectuner status` shows α by context length from the tap's per-request records (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from typer.testing import CliRunner

from collectors.records import EngineKey, RequestRecord, WindowRecord
from policies.counters import SpecCounters
from tuner.cli.main import app
from tuner.store import Store

pytestmark = pytest.mark.integration
K = 3


def test_status_shows_a_collapse_on_long_prompts_and_a_cutoff(db_url: str) -> None:
    now = datetime.now(UTC)
    key = EngineKey("http://127.0.0.1:9/metrics", "m")
    rng = np.random.default_rng(5)
    records = []
    for prompt, alpha in [(700, 0.8), (1500, 0.8), (3000, 0.65), (6000, 0.5), (20000, 0.15)]:
        for i in range(25):
            acc = []
            for _ in range(30):
                n = 0
                while n < K and rng.random() < alpha:
                    n += 1
                acc.append(n)
            hist = tuple(acc.count(j) for j in range(K + 1))
            records.append(
                RequestRecord(now - timedelta(seconds=60 + i), f"r{prompt}-{i}", "m", prompt, 60, 1.0, K, 30, 90,
                              sum(acc), hist, per_step_accepted=tuple(acc), per_step_drafted=(K,) * 30)
            )
    other = RequestRecord(now - timedelta(seconds=5), "x", "other-model", 30000, 60, 1.0, K, 30, 90, 0, (30, 0, 0, 0))
    with Store(db_url) as store:
        spec = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=20, accepted_per_pos=(8, 7, 5))
        store.write_windows([WindowRecord(key, now - timedelta(seconds=20), now - timedelta(seconds=10), spec, 50.0)])
        store.write_requests([*records, other])
    result = CliRunner().invoke(app, ["status", "--db", db_url, "--json"], env={"SPECTUNER_DB": ""})
    assert result.exit_code == 0, result.output
    (engine,) = json.loads(result.output)["engines"]
    view = engine["by_context_length"]
    assert sum(b["requests"] for b in view["bands"]) == len(records)  # the other model's request is not counted
    assert view["collapse"] is True and view["slope_ci"][1] < 0
    assert view["cutoff_tokens"] == 16384
    human = CliRunner().invoke(app, ["status", "--db", db_url], env={"SPECTUNER_DB": ""})
    assert human.exit_code == 0 and "collapses on long contexts" in human.output

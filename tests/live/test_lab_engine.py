"""The lab is real: a live vLLM engine whose /metrics and per-request metrics agree exactly."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from collectors.exposition import parse_metrics_page
from collectors.scrape import utc_now
from policies.counters import SpecCounters
from tuner.engine.process import EngineStartError, group_alive
from tuner.lab.load import run_load
from tuner.lab.models import Manifest
from tuner.lab.prompts import HARD, PREDICTABLE
from tuner.lab.serve import LabServer


def _spec_totals(server: LabServer) -> SpecCounters:
    text = httpx.get(server.metrics_url, timeout=10).text
    total = SpecCounters()
    for sample in parse_metrics_page(text, url=server.metrics_url, ts=utc_now()):
        if sample.spec is not None:
            total = total + sample.spec
    return total


def test_manifest_has_a_ladder_across_the_threshold(lab_models: Manifest) -> None:
    agree = {name: d.greedy_agreement for name, d in lab_models.drafts.items() if d.greedy_agreement is not None}
    assert agree["good"] >= 0.93
    assert 0.65 <= agree["medium"] <= 0.85
    assert agree["weak"] <= 0.32
    assert agree["random"] <= 0.1
    assert agree["copy"] == 1.0
    for d in lab_models.drafts.values():
        if d.method == "draft_model":
            assert Path(d.path, "config.json").exists()
            assert d.kv_bytes_per_token > 0 and d.params > 0


def test_metrics_counters_equal_per_request_sums(lab_engine: LabServer) -> None:
    before = _spec_totals(lab_engine)
    result = run_load(lab_engine.base_url, lab_engine.model_name, PREDICTABLE + HARD, concurrency=4,
                      count=24, max_tokens=48)
    assert result.errors == 0, result.requests[0].error
    after = _spec_totals(lab_engine)
    per_request = result.spec_totals()
    assert per_request["drafts"] > 0
    assert after.drafts - before.drafts == per_request["drafts"]
    assert after.draft_tokens - before.draft_tokens == per_request["draft_tokens"]
    assert after.accepted_tokens - before.accepted_tokens == per_request["accepted_tokens"]
    # Every request carried its own metrics, with a K+1-long histogram.
    for r in result.ok:
        assert r.spec is not None
        assert len(r.spec["acceptance_histogram"]) == lab_engine.k + 1


# The draft ladder straddling 0.4 (weak's upper bound below it, good's α̂ above 0.85) is checked in
# tests/live/test_closed_loop_live.py, on the engines the controller starts, instead of a separate start.


def test_engine_that_dies_while_starting_leaves_nothing(lab_models: Manifest, tmp_path: Path) -> None:
    server = LabServer(draft="good", k=3, workdir=tmp_path / "bad",
                       models_dir=Path(lab_models.target.path).parent,
                       extra_args=("--max-model-len", "not-a-number"))
    with pytest.raises(EngineStartError) as err:
        server.start()
    assert "not-a-number" in err.value.log_tail or "max-model-len" in err.value.log_tail
    assert not server.alive()
    assert server.last_pid is not None
    assert not group_alive(server.last_pid)  # the engine and its children are all gone

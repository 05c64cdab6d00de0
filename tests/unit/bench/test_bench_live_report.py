"""bench_live's --fixed-from: spectuner's rerun reported against an earlier run's fixed cells, said so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import bench.bench_live as bench_live

EARLIER = Path(__file__).resolve().parents[3] / "bench" / "results" / "live.json"


def run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str) -> int:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    (models / "manifest.json").write_text("{}")
    monkeypatch.setattr(bench_live, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", ["bench_live.py", "--models-dir", str(models), *argv])
    return bench_live.main()


def test_an_earlier_runs_cells_give_the_same_summary_and_the_report_says_they_are_not_side_by_side(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    earlier = json.loads(EARLIER.read_text())
    assert run(monkeypatch, tmp_path, "--no-fixed", "--no-spectuner", "--fixed-from", str(EARLIER), "--out", "t") == 0
    doc = json.loads((tmp_path / "results" / "t.json").read_text())
    assert doc["fixed"]["from_when"] == earlier["when"] and doc["cells"] == earlier["cells"]
    # no spectuner run here: the fixed configs' summary is the earlier run's
    assert doc["summary"]["fixed_mean_rate"] == earlier["summary"]["fixed_mean_rate"]
    assert doc["cell_s"] == earlier["cell_s"] and doc["visits"] == earlier["visits"]
    assert "Fixed configs from an earlier run" in (tmp_path / "results" / "t.md").read_text()


def test_fixed_cells_from_elsewhere_are_refused_when_they_cannot_apply(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, tmp_path, "--fixed-from", str(EARLIER))  # would measure its own cells too
    assert exc.value.code == 2 and "give --no-fixed with it" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, tmp_path, "--no-fixed", "--fixed-from", str(EARLIER), "--phase-s", "60")
    assert exc.value.code == 2 and "phases of another length" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, tmp_path, "--no-fixed", "--fixed-from", str(broken))
    assert exc.value.code == 2 and "broken.json" in capsys.readouterr().err


def test_the_report_lists_each_shadow_replay_with_its_candidates_alpha() -> None:
    doc = json.loads(EARLIER.read_text())
    doc["spectuner"]["shadow_runs"] = [
        {"at_s": 61.2, "kind": "shadow_evaluated", "message": "shadow replay of 17 recorded requests: …",
         "samples": 17, "alpha": {"good": 0.966, "ngram": None}, "wall_s": 41.5},
        {"at_s": 121.0, "kind": "shadow_failed", "message": "the replay exited 1: no tokenizer"},
    ]
    text = bench_live.markdown(doc)
    assert "| 61.2 | 41.5 | 17 | good 0.966, ngram — |" in text
    assert "| 121.0 | — | — | the replay exited 1: no tokenizer |" in text
    doc["spectuner"]["client_error_samples"] = [
        {"start_s": 401.2, "end_s": 415.0, "tokens": 12, "error": "RemoteProtocolError: peer closed connection"}
    ]
    assert "| 401.2 | 415.0 | 12 | RemoteProtocolError: peer closed connection |" in bench_live.markdown(doc)
    del doc["spectuner"]["shadow_runs"]  # a run without [shadow] (or an earlier file): no such table
    assert "Shadow replays" not in bench_live.markdown(doc)

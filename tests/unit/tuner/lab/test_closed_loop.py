"""The daemon config the lab writes: each draft registered with its own calibrated cost."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from policies.draft_choice import DraftCandidate
from tuner.config import SpectunerConfig, parse_config
from tuner.lab.closed_loop import LoopSettings, lab_cost_model, lab_daemon_config
from tuner.lab.models import load_manifest
from tuner.lab.serve import LabServer
from tuner.store.schema import upgrade
from tuner.store.store import Store
from tuner.wiring import draft_candidates


def _calibrated(models: Path, drafts: dict[str, dict[str, object]]) -> None:
    path = models / "manifest.json"
    data = json.loads(path.read_text())
    data["calibration"] = {"drafts": drafts}
    path.write_text(json.dumps(data))


def _registered(
    models: Path, tmp_path: Path, settings: LoopSettings
) -> tuple[SpectunerConfig, dict[str, DraftCandidate]]:
    """The daemon config the lab writes for ``settings``, parsed, and its draft candidates by name."""
    server = LabServer(draft="none", k=0, models_dir=models, workdir=tmp_path / "engine")
    url = f"sqlite:///{tmp_path / 's.db'}"
    upgrade(url)
    config = parse_config(tomllib.loads(lab_daemon_config(server, url, settings)), base_dir=tmp_path)
    with Store(url) as store:
        return config, {c.name: c for c in draft_candidates(config, store)}


def _candidates(models: Path, tmp_path: Path, settings: LoopSettings) -> dict[str, float | None]:
    _, by_name = _registered(models, tmp_path, settings)
    return {name: c.cost_ratio_for(None) for name, c in by_name.items()}


def test_a_calibrated_draft_is_registered_with_its_own_cost(fake_models: Path, tmp_path: Path) -> None:
    _, default = lab_cost_model(load_manifest(fake_models))
    _calibrated(fake_models, {"good": {"cost_ratio": 0.21}, "ngram": {"cost_ratio": None}})
    got = _candidates(fake_models, tmp_path, LoopSettings(start_draft="good", candidates=("good", "ngram")))
    # ngram keeps the lab's model ratio: its CPU proposer is not free on this engine
    assert got == {"good": 0.21, "ngram": default}


def test_an_uncalibrated_draft_takes_the_labs_model_ratio(fake_models: Path, tmp_path: Path) -> None:
    _, default = lab_cost_model(load_manifest(fake_models))
    got = _candidates(fake_models, tmp_path, LoopSettings(start_draft="good", candidates=("good", "ngram")))
    assert got == {"good": default, "ngram": default}
    assert 0 < default != 0.21


def test_the_labs_ngram_is_registered_with_the_lookup_the_lab_serves(fake_models: Path, tmp_path: Path) -> None:
    # without its keys a swap to it would run vLLM's default 5-grams and its replay would differ from both
    from tuner.lab.serve import NGRAM_LOOKUP, speculative_config

    settings = LoopSettings(start_draft="ngram", candidates=("good", "ngram"))
    config, by_name = _registered(fake_models, tmp_path, settings)
    ngram = by_name["ngram"]
    served = speculative_config(load_manifest(fake_models), "ngram", 3)
    assert served is not None
    assert dict(ngram.speculative_config) == NGRAM_LOOKUP == {k: served[k] for k in NGRAM_LOOKUP}
    assert config.speculative.extra == NGRAM_LOOKUP  # started on it: the same lookup


def test_the_labs_ngram_is_registered_with_its_measured_pass_in_seconds(fake_models: Path, tmp_path: Path) -> None:
    # a host-side proposer costs the same at any batch: priced by a ratio of the target's pass it read
    # ~55-70 ms of drafting at 64 streams, so the controller ranked ngram below no speculation there
    from policies.step_cost import StepCostModel

    own = {"draft_fixed_s": 0.0081, "draft_per_seq_s": 0.00002}
    _calibrated(fake_models, {"ngram": {"cost_ratio": None, "lookup_pass": {"model": own}}})
    _, by_name = _registered(fake_models, tmp_path, LoopSettings(start_draft="good", candidates=("good", "ngram")))
    ngram, good = by_name["ngram"], by_name["good"]
    assert (ngram.draft_fixed_s, ngram.draft_per_seq_s) == (own["draft_fixed_s"], own["draft_per_seq_s"])
    assert not good.pass_measured  # a model draft keeps its ratio
    target = StepCostModel(fixed_s=0.04, per_token_s=0.0027, draft_fixed_s=0.0, draft_per_seq_s=0.0)
    priced = ngram.beside(target, None)
    assert priced is not None
    drafting = priced.step_time_s(64, 3) - target.with_draft_ratio(0.0).step_time_s(64, 3)
    assert drafting == pytest.approx(own["draft_fixed_s"] + 64 * own["draft_per_seq_s"], rel=1e-6)

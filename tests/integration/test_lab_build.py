"""The lab builder with a shell recipe: graded drafts carried in shells, timed, the recipe kept on rebuild."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tuner.lab.models import RECIPES, Recipe, Shape, build_models, load_manifest

# A scaled-down gpu-like recipe: the same pipeline in seconds (fewer docs and steps, small shells).
SMALL_SHELLS = Recipe(
    name="test-shells",
    n_docs=600,
    target_steps=60,
    eval_prompts=8,
    eval_new_tokens=16,
    target_shell=Shape(384, 6, 6, 1024),
    draft_shell=Shape(256, 4, 4, 512),
    agreement_tolerance=0.2,
)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Torch's two spinning threads on a 2-core box that something else keeps busy wait on each other: this
    build took 14 s quiet and 260 s beside two busy loops. One thread does not wait on anyone."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_shell_recipe_builds_a_timed_ladder_and_keeps_its_recipe(tmp_path: Path, one_torch_thread: None) -> None:
    out = tmp_path / "models"
    m = build_models(out, SMALL_SHELLS)
    assert m.recipe["name"] == "test-shells"
    cfg = json.loads((Path(m.target.path) / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (384, 6, 1024)
    good = m.drafts["good"]
    assert json.loads((Path(good.path) / "config.json").read_text())["hidden_size"] == 256
    # every weighted model is timed at build; a draft's cost ratio is its 1-token step over the target's
    for info in [m.target, *(d for d in m.drafts.values() if d.method != "ngram")]:
        assert set(info.step_ms) == {"1", "4", "16", "64"}
        assert all(v > 0 for v in info.step_ms.values())
        assert info.cost_ratio == pytest.approx(info.step_ms["1"] / m.target.step_ms["1"], rel=0.01)
    assert m.drafts["copy"].cost_ratio == 1.0
    assert m.target.params > 3 * good.params
    # the ladder's order survives the shells (agreement is the trained models', the shells compute the same)
    a = {n: m.drafts[n].greedy_agreement for n in ("copy", "good", "medium", "weak")}
    assert a["copy"] == 1.0
    assert a["copy"] >= a["good"] > a["medium"] > a["weak"]  # type: ignore[operator]

    # without a recipe a directory keeps the one it was built with: cached, not rebuilt as tiny
    again = build_models(out)
    assert again.build_key == m.build_key
    assert load_manifest(out).recipe == m.recipe


def test_the_gpu_like_recipe_differs_from_tiny_in_shells_only() -> None:
    tiny, gpu = RECIPES["tiny"], RECIPES["gpu-like"]
    assert tiny.target_shell is None and gpu.target_shell is not None and gpu.draft_shell is not None
    assert tiny.target == gpu.target and tiny.key() != gpu.key()
    assert gpu.target_shell.hidden_size >= 4 * tiny.target.hidden_size
    assert Recipe.from_json(json.loads(json.dumps(RECIPES["gpu-like"].__dict__, default=lambda o: o.__dict__))) == gpu

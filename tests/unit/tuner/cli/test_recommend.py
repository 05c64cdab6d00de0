"""`spectuner recommend`: the CLI contract (docs/architecture.md), Leviathan's reference points, exit codes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from policies.step_cost import StepCostModel
from tuner.cli.recommend import register

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")  # a second command keeps typer from collapsing the group
    def _noop() -> None: ...

    return app


def invoke(app: typer.Typer, *args: str) -> tuple[int, str, Any]:
    result = CliRunner().invoke(app, ["recommend", *args])
    data = json.loads(result.stdout) if result.exit_code == 0 and "--json" in args else None
    return result.exit_code, " ".join((result.stdout + result.stderr).split()), data


@pytest.mark.parametrize(("alpha", "c", "k", "speedup"), [("0.8", "0.05", 8, 3.09), ("0.7", "0.1", 4, 1.98)])
def test_leviathan_reference_points(app: typer.Typer, alpha: str, c: str, k: int, speedup: float) -> None:
    code, _, data = invoke(app, "--alpha", alpha, "--cost-ratio", c, "--k-max", "16", "--json")
    assert code == 0
    assert data["best_k"] == k and round(data["speedup"], 2) == speedup
    assert [row["k"] for row in data["by_k"]] == list(range(17))
    assert set(data["by_k"][0]) == {"k", "speedup", "expected_tokens_per_step"}
    assert data["by_k"][k]["speedup"] == data["speedup"]
    assert data["expected_tokens_per_step"] == pytest.approx((1 - float(alpha) ** (k + 1)) / (1 - float(alpha)))
    for key in ("best_k", "speedup", "expected_tokens_per_step", "by_k", "reason", "message"):
        assert key in data


def test_human_output(app: typer.Typer) -> None:
    code, out, _ = invoke(app, "--alpha", "0.7", "--cost-ratio", "0.1", "--k-max", "6")
    assert code == 0 and "K = 4 maximises goodput" in out and "1.981×" in out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--alpha", "1.5", "--cost-ratio", "0.1", "--k-max", "4"],
            "--alpha must lie strictly between 0 and 1",
        ),
        (
            ["--alpha", "0", "--cost-ratio", "0.1", "--k-max", "4"],
            "--alpha must lie strictly between 0 and 1",
        ),
        (
            ["--alpha", "nan", "--cost-ratio", "0.1", "--k-max", "4"],
            "--alpha must lie strictly between 0 and 1",
        ),
        (["--alpha", "0.5", "--cost-ratio", "-0.1", "--k-max", "4"], "--cost-ratio cannot be negative"),
        (["--alpha", "0.5", "--cost-ratio", "0.1", "--k-max", "-1"], "--k-max cannot be negative"),
        (["--alpha", "0.5", "--k-max", "3"], "give --cost-ratio"),
        (
            ["--alpha", "0.5", "--cost-ratio", "0.1", "--k-max", "3", "--batch-sizes", "0,4"],
            "batch sizes ≥ 1",
        ),
        (
            ["--alpha", "0.5", "--cost-ratio", "0.1", "--k-max", "3", "--batch-sizes", "a-b"],
            "--batch-sizes must list",
        ),
        (
            ["--alpha", "0.5", "--cost-ratio", "0.1", "--k-max", "3", "--alpha-ci", "0.6,0.7"],
            "--alpha-ci must be",
        ),
        (
            ["--alpha", "0.5", "--cost-ratio", "0.1", "--k-max", "3", "--budget-bytes", "1GiB"],
            "--draft-params",
        ),
        (
            [
                "--alpha",
                "0.5",
                "--cost-ratio",
                "0.1",
                "--k-max",
                "3",
                "--budget-bytes",
                "lots",
                "--method",
                "ngram",
            ],
            "--budget-bytes must be a size",
        ),
    ],
)
def test_invalid_input_exits_2_with_a_clear_message(app: typer.Typer, args: list[str], fragment: str) -> None:
    code, out, _ = invoke(app, *args, "--json")
    assert code == 2
    assert fragment in out


def test_batch_sizes_add_a_vllm_table(app: typer.Typer) -> None:
    code, _, data = invoke(
        app, "--alpha", "0.7", "--cost-ratio", "0.1", "--k-max", "8", "--batch-sizes", "1,4,16,64",
        "--per-token-cost", "0.02", "--json",
    )  # fmt: skip
    assert code == 0
    assert [row["batch_size"] for row in data["per_batch_size"]] == [1, 4, 16, 64]
    table = data["num_speculative_tokens_per_batch_size"]
    assert table[0][0] == 1 and table[-1][1] == 64
    assert all(nxt[0] == row[1] + 1 for row, nxt in itertools.pairwise(table))
    ks = {row["batch_size"]: row["best_k"] for row in data["per_batch_size"]}
    assert ks[1] == 4 and ks[64] < ks[1]
    for row in data["per_batch_size"]:
        assert next(k for lo, hi, k in table if lo <= row["batch_size"] <= hi) == row["best_k"]


def test_memory_budget_limits_k(app: typer.Typer, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128, "torch_dtype": "float32"})
    )
    base = ["--alpha", "0.8", "--cost-ratio", "0.05", "--k-max", "10", "--json"]
    code, _, free = invoke(app, *base)
    assert free["best_k"] == 8
    # weights 4 MB (1 M fp32 params) + 1 sequence × (2 KiB × (1000 + K) + 16 KiB × K): K ≤ 3 fits 6.11 MB
    code, out, data = invoke(
        app, *base, "--budget-bytes", "6110000", "--draft-params", "1000000", "--draft-dtype", "float32",
        "--draft-config", str(config), "--target-kv-bytes-per-token", "16384", "--tokens-per-seq", "1000",
    )  # fmt: skip
    assert code == 0, out
    assert data["best_k"] == 3 and data["reason"] == "memory_limited"
    assert [row["fits_memory"] for row in data["by_k"]][:5] == [True, True, True, True, False]
    code, _, ngram = invoke(app, *base, "--budget-bytes", "1", "--method", "ngram")
    assert ngram["best_k"] == 8


def test_fitted_step_cost_model_from_json(app: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(StepCostModel.from_cost_ratio(0.05).to_dict()))
    code, _, data = invoke(app, "--alpha", "0.8", "--k-max", "12", "--step-cost-json", str(path), "--json")
    assert code == 0 and data["best_k"] == 8
    path.write_text("{not json")
    code, out, _ = invoke(app, "--alpha", "0.8", "--k-max", "12", "--step-cost-json", str(path), "--json")
    assert code == 2 and "not readable JSON" in out
    code, out, _ = invoke(app, "--alpha", "0.8", "--k-max", "12", "--step-cost-json", str(tmp_path / "nope.json"))
    assert code == 2 and "no such file" in out


def test_alpha_interval_gives_speedup_interval(app: typer.Typer) -> None:
    code, _, data = invoke(
        app, "--alpha", "0.8", "--cost-ratio", "0.05", "--k-max", "12", "--alpha-ci", "0.75,0.85", "--json"
    )
    assert code == 0
    lo, hi = data["speedup_ci"]
    assert lo < data["speedup"] < hi


def test_real_entry_point() -> None:
    """The installed command line, as a user runs it."""
    command = [sys.executable, "-m", "tuner.cli.main", "recommend", "--cost-ratio", "0.05", "--k-max", "16"]
    proc = subprocess.run([*command, "--alpha", "0.8", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["best_k"] == 8
    bad = subprocess.run([*command, "--alpha", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--alpha must lie strictly between 0 and 1" in " ".join(bad.stderr.split())

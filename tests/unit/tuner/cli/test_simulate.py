"""`spectuner simulate`: a scenario that does not load is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tuner.cli.main import app

SCENARIOS = Path(__file__).resolve().parents[4] / "bench" / "scenarios"


def test_cli_says_it_in_one_line_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    text = (SCENARIOS / "gpu_memory_bound.toml").read_text().replace("[controller]", "[controller]\nk_maxx = 3")
    bad.write_text(text)
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(bad), "--json"])
    assert result.exit_code == 2
    assert "k_maxx" in result.output

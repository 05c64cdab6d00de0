"""`spectuner estimate` on saved /metrics dumps: keys, sums, deltas, restarts, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from collectors.exposition import parse_metrics_page
from tuner.cli.main import app

DATA = Path(__file__).resolve().parents[3] / "data"
KEYS = {
    "num_spec_tokens",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "draft_acceptance_rate",
    "mean_acceptance_length",
    "alpha",
    "alpha_ci",
    "conditional_acceptance_by_position",
}


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["estimate", *args])
    return result.exit_code, result.output


def spec_of(name: str) -> list:
    from datetime import UTC, datetime

    return [s.spec for s in parse_metrics_page((DATA / name).read_text(), url="f", ts=datetime.now(UTC))]


def test_one_dump_sums_the_engines_since_start() -> None:
    code, out = run("--metrics-file", str(DATA / "synthetic_dp2_k3_b.prom"), "--json")
    assert code == 0, out
    data = json.loads(out)
    assert set(data) >= KEYS
    e0, e1 = spec_of("synthetic_dp2_k3_b.prom")
    assert data["drafts"] == e0.drafts + e1.drafts
    assert data["accepted_tokens"] == e0.accepted_tokens + e1.accepted_tokens
    assert data["num_spec_tokens"] == 3 and data["engines_summed"] == 2 and data["reset"] is False
    a = data["accepted_tokens"]
    d = data["drafts"]
    last = e0.accepted_per_pos[-1] + e1.accepted_per_pos[-1]
    assert data["alpha"] == pytest.approx(a / (a + d - last))  # the MLE of docs/architecture.md
    assert data["draft_acceptance_rate"] == pytest.approx(a / data["draft_tokens"])
    assert data["mean_acceptance_length"] == pytest.approx(1 + a / d)
    lo, hi = data["alpha_ci"]
    assert lo < data["alpha"] < hi
    assert len(data["conditional_acceptance_by_position"]) == 3


def test_two_dumps_give_the_delta() -> None:
    code, out = run(
        "--metrics-file",
        str(DATA / "synthetic_dp2_k3_a.prom"),
        "--metrics-file",
        str(DATA / "synthetic_dp2_k3_b.prom"),
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    a = spec_of("synthetic_dp2_k3_a.prom")
    b = spec_of("synthetic_dp2_k3_b.prom")
    assert data["drafts"] == sum(y.drafts - x.drafts for x, y in zip(a, b, strict=True))
    assert data["draft_tokens"] == sum(y.draft_tokens - x.draft_tokens for x, y in zip(a, b, strict=True))


def test_by_engine_lists_each_engine() -> None:
    code, out = run("--metrics-file", str(DATA / "synthetic_dp2_k3_b.prom"), "--by-engine", "--json")
    assert code == 0, out
    engines = json.loads(out)["engines"]
    assert [(e["model_name"], e["engine"]) for e in engines] == [("target", "0"), ("target", "1")]
    for e, spec in zip(engines, spec_of("synthetic_dp2_k3_b.prom"), strict=True):
        assert set(e) >= KEYS and e["speculation"] is True
        assert e["drafts"] == spec.drafts


def test_a_restart_between_dumps_counts_from_the_restart() -> None:
    code, out = run(
        "--metrics-file",
        str(DATA / "synthetic_dp2_k3_b.prom"),
        "--metrics-file",
        str(DATA / "synthetic_dp2_k3_restarted.prom"),
        "--by-engine",
        "--json",
    )
    assert code == 0, out
    engines = json.loads(out)["engines"]
    after = spec_of("synthetic_dp2_k3_restarted.prom")
    for e, spec in zip(engines, after, strict=True):
        assert e["reset"] is True and "restart" in e["note"]
        assert e["drafts"] == spec.drafts


@pytest.mark.skipif(not (DATA / "lab_metrics_good_k3.prom").exists(), reason="no real lab page saved")
def test_real_lab_dumps() -> None:
    code, out = run(
        "--metrics-file",
        str(DATA / "lab_metrics_good_k3_idle.prom"),
        "--metrics-file",
        str(DATA / "lab_metrics_good_k3.prom"),
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    assert data["num_spec_tokens"] == 3 and data["drafts"] > 0 and 0 < data["alpha"] <= 1


def test_human_output_names_alpha_and_the_interval() -> None:
    code, out = run("--metrics-file", str(DATA / "synthetic_k5.prom"))
    assert code == 0, out
    assert "α" in out and "interval" in out and "K (num_spec_tokens)" in out


def test_no_spec_counters_is_a_runtime_failure_that_says_speculation_is_off() -> None:
    code, out = run("--metrics-file", str(DATA / "synthetic_nospec.prom"), "--json")
    assert code == 1
    assert "speculation is off" in out


def test_engines_with_different_k_are_not_summed(tmp_path: Path) -> None:
    k5 = (DATA / "synthetic_k5.prom").read_text().replace('engine="0"', 'engine="7"')
    k3 = (DATA / "synthetic_dp2_k3_b.prom").read_text()
    # Two pages' worth of families under one name each would be duplicates; keep the K=5 spec only.
    spec5 = "".join(line + "\n" for line in k5.splitlines() if line.startswith("vllm:spec_decode"))
    mixed = tmp_path / "mixed.prom"
    mixed.write_text(k3 + spec5)
    code, out = run("--metrics-file", str(mixed), "--json")
    assert code == 2 and "--by-engine" in out
    code, out = run("--metrics-file", str(mixed), "--by-engine", "--json")
    assert code == 0, out
    assert sorted(e["num_spec_tokens"] for e in json.loads(out)["engines"]) == [3, 3, 5]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ('vllm:generation_tokens_total{engine="0",model_name="m"} 1', "cut short"),
        ("this is { not prometheus\n", "malformed"),
        ("", "empty"),
    ],
)
def test_bad_files_are_usage_errors_that_say_what_is_wrong(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "dump.prom"
    if content is not None:
        path.write_text(content)
    code, out = run("--metrics-file", str(path))
    assert code == 2
    assert message in out.replace("\n", " ")


def test_three_files_or_a_bad_confidence_are_refused() -> None:
    f = str(DATA / "synthetic_k5.prom")
    assert run("--metrics-file", f, "--metrics-file", f, "--metrics-file", f)[0] == 2
    assert run("--metrics-file", f, "--confidence", "1.5")[0] == 2


def test_a_bom_is_ignored_and_binary_or_gzip_files_are_named(tmp_path: Path) -> None:
    import gzip

    page = (DATA / "lab_metrics_good_k3.prom").read_bytes()
    bom = tmp_path / "bom.prom"
    bom.write_bytes(b"\xef\xbb\xbf" + page)
    code, out = run("--metrics-file", str(bom), "--json")
    assert code == 0, out
    _, plain = run("--metrics-file", str(DATA / "lab_metrics_good_k3.prom"), "--json")
    assert json.loads(out)["alpha"] == json.loads(plain)["alpha"]
    binary = tmp_path / "binary.prom"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    code, out = run("--metrics-file", str(binary))
    assert code == 2 and "is binary data" in out
    packed = tmp_path / "page.prom.gz"
    packed.write_bytes(gzip.compress(page))
    code, out = run("--metrics-file", str(packed))
    assert code == 2 and "gzip" in out


def test_two_dumps_given_newest_first_are_named() -> None:
    older, newer = DATA / "lab_good_k3_loaded.prom", DATA / "lab_good_k3_loaded_more.prom"
    code, out = run("--metrics-file", str(newer), "--metrics-file", str(older))
    assert code == 2 and "give the older dump first" in out
    assert run("--metrics-file", str(older), "--metrics-file", str(newer))[0] == 0
    # a real restart between the dumps is still counted since the restart, not refused
    assert run("--metrics-file", str(older), "--metrics-file", str(DATA / "lab_good_k3_restarted.prom"))[0] == 0

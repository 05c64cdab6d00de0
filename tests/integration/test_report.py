"""`spectuner report` on real databases (SQLite and PostgreSQL): the numbers behind each figure, an
empty database, a database without decisions, time ranges, and the CLI's exit codes."""

from __future__ import annotations

import base64
import json
import re
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from collectors.records import WindowRecord
from policies.acceptance import alpha_of_windows, estimate_alpha
from policies.counters import SpecCounters
from tests.integration import fleet_factories as FF
from tests.integration import report_factories as F
from tuner.cli.main import app
from tuner.cli.status_fleet import gather_fleet
from tuner.controller import manual
from tuner.report import ReportData, gather, write_report
from tuner.store import RetentionPolicy, Store, run_retention

SECTIONS = ("alpha", "positions", "timeline", "goodput", "gains")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _images(html: str) -> dict[str, bytes]:
    found = re.findall(r'<img class="figure" id="fig-(\w+)"[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    return {name: base64.b64decode(data) for name, data in found}


def test_every_figure_is_drawn_from_the_stored_history(store: Store, tmp_path: Path) -> None:
    story = F.populate(store)
    result = write_report(store, tmp_path / "out")
    data = result.data

    assert result.images == SECTIONS and result.missing == {}
    html = result.index_html.read_text()
    images = _images(html)
    assert set(images) == set(SECTIONS)
    for png in images.values():
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    # Self-contained: nothing is fetched from anywhere.
    assert not re.search(r'(src|href)="(?!data:)', html) and "<script" not in html and "<link" not in html

    # α̂ per bucket: 90 minutes of 10 s windows → 2-minute buckets; each is the pooled MLE of its windows.
    assert data.bucket_s == 120
    for bucket in data.alpha:
        inside = [w for w in story.windows if bucket.start < w.end <= bucket.end and w.spec and w.spec.drafts]
        total = sum((w.spec for w in inside if w.spec), SpecCounters())
        assert bucket.windows == len(inside) and bucket.drafts == total.drafts
        if len({w.spec.k for w in inside if w.spec}) == 1:
            assert bucket.alpha == pytest.approx(estimate_alpha(total).alpha)
    hard = [b for b in data.alpha if F._minute(21) <= b.start and b.end <= F._minute(35)]
    easy = [b for b in data.alpha if b.end <= F._minute(15)]
    assert hard and all(b.alpha_upper is not None and b.alpha_upper < 0.4 for b in hard)
    assert easy and all(b.alpha_lower is not None and b.alpha_lower > 0.4 for b in easy)
    assert all(b.alpha_lower <= b.alpha <= b.alpha_upper for b in data.alpha if b.alpha is not None)  # type: ignore[operator]

    # Per-position acceptance: one group per config; the good draft's c_i decays with position.
    assert [p.config_id for p in data.positions] == story.config_ids
    k5 = next(p for p in data.positions if p.k == 5)
    conditional = [c for c in k5.conditional_by_position if c is not None]
    assert conditional == sorted(conditional, reverse=True) and conditional[0] > 0.85

    # Goodput against K: busy, non-reset windows grouped by K; the K in force at the end is marked.
    assert [(g.k, g.chosen) for g in data.goodput] == [(3, False), (4, True), (5, False)]
    k5_rates = [
        w.generation_tokens / w.duration_s
        for w in story.windows
        if w.spec and w.spec.k == 5 and w.generation_tokens > 0 and not w.reset
    ]
    g5 = next(g for g in data.goodput if g.k == 5)
    assert g5.windows == len(k5_rates) and g5.mean_tokens_per_s == pytest.approx(statistics.fmean(k5_rates))

    # Timeline: every config with its K; decisions with status.
    assert [(c.draft, c.k) for c in data.configs] == [
        ("draft-medium", 3), ("draft-good", 3), ("draft-good", 5), ("draft-good", 3), ("draft-good", 4)
    ]
    assert [d.status for d in data.decisions] == ["verified", "rolled_back", "blocked", "verified"]

    # Predicted against realized: exactly the decisions verification measured.
    assert {d.id: d.realized_gain for d in data.gains} == pytest.approx(story.realized)
    assert next(d for d in data.gains if d.status == "rolled_back").realized_gain < 1.0  # type: ignore[operator]

    # report.json holds the plotted numbers.
    doc = json.loads(result.report_json.read_text())
    assert [b["alpha"] for b in doc["alpha"]] == pytest.approx([b.alpha for b in data.alpha])
    assert doc["gains"] == [d.id for d in data.gains] and doc["missing"] == {}
    assert "regression_rolled_back" in html and "draft_swap" in html


def test_an_empty_database_gives_a_page_that_says_what_is_missing(store: Store, tmp_path: Path) -> None:
    result = write_report(store, tmp_path)
    html = result.index_html.read_text()
    assert result.images == () and set(result.missing) == set(SECTIONS)
    assert _images(html) == {}
    for section in SECTIONS:
        assert f'id="missing-{section}"' in html
    assert 'id="missing-engines"' in html and "spectuner collect" in html
    assert 'id="missing-fleet"' in html
    doc = json.loads(result.report_json.read_text())
    assert doc["engines"] == [] and set(doc["missing"]) >= {*SECTIONS, "decisions"}


def test_a_database_without_decisions_draws_the_measurements(store: Store, tmp_path: Path) -> None:
    F.populate(store, decisions=False)
    result = write_report(store, tmp_path)
    assert result.images == ("alpha", "positions", "timeline", "goodput")
    assert set(result.missing) == {"gains"}
    html = result.index_html.read_text()
    assert 'id="missing-decisions"' in html and "No decisions in this range" in html
    assert [(g.k, g.chosen) for g in result.data.goodput] == [(3, True)]


def test_a_time_range_keeps_the_config_in_force_at_its_start(store: Store, tmp_path: Path) -> None:
    story = F.populate(store)
    since, until = F._minute(40), F._minute(70)
    data = gather(store, since=since, until=until)  # the numbers only: no need to draw here
    assert data.first is not None and data.last is not None
    assert data.first >= since - timedelta(seconds=F.WINDOW_S) and data.last < until
    # c2 (good K=3) started at 35 min and was in force at 40 min; c3 and c4 started inside.
    assert [c.config_id for c in data.configs] == story.config_ids[1:4]
    assert [d.id for d in data.decisions] == story.decision_ids[1:3]
    assert data.engines[0].windows == sum(1 for w in story.windows if since <= w.end < until)


def test_minutes_whose_raw_windows_were_pruned_come_from_the_rollups(store: Store) -> None:
    story = F.populate(store)
    full = gather(store)
    # Keep 30 minutes of raw windows: the first hour survives only as 1-minute rollups.
    policy = RetentionPolicy(raw_windows_s=1800, rollup_settle_s=60, rollup_lookback_s=600)
    run_retention(store, policy, story.end + timedelta(minutes=2))
    assert len(store.windows(F.KEY)) < len(story.windows) / 2
    pruned = gather(store)
    info = pruned.engines[0]
    assert info.rollup_minutes >= 55 and info.windows + info.rollup_minutes < len(story.windows)
    # Counts sum exactly: the same drafts and accepted tokens per config, the same α̂ overall.
    def per_config(data: ReportData) -> dict[int | None, tuple[int, list[int]]]:
        return {p.config_id: (p.drafts, p.accepted_per_pos) for p in data.positions}

    assert per_config(pruned) == per_config(full)
    assert sum(b.drafts for b in pruned.alpha) == sum(b.drafts for b in full.alpha)
    # A rollup covers the windows that ENDED in its minute: placed to within a window of the truth.
    assert pruned.first is not None and full.first is not None
    assert abs((pruned.first - full.first).total_seconds()) <= F.WINDOW_S
    assert [g.k for g in pruned.goodput] == [3, 4, 5]
    hard = [b for b in pruned.alpha if F._minute(22) <= b.start and b.end <= F._minute(34)]
    assert hard and all(b.alpha_upper is not None and b.alpha_upper < 0.4 for b in hard)


def test_buckets_where_alpha_cannot_be_estimated_are_named_not_hidden(store: Store) -> None:
    """A per-batch-size table varies K inside a window: /metrics cannot resolve α̂ there (no per-position
    draft counts). The bucket keeps its acceptance rate and the page says why α̂ is missing."""
    fixed = SpecCounters(drafts=100, draft_tokens=300, accepted_tokens=150, accepted_per_pos=(70, 50, 30))
    dynamic = SpecCounters(drafts=100, draft_tokens=200, accepted_tokens=100, accepted_per_pos=(60, 30, 10))
    windows = [
        WindowRecord(F.KEY, F._minute(i / 6), F._minute((i + 1) / 6), fixed if i < 6 else dynamic, 250.0)
        for i in range(12)
    ]
    store.write_windows(windows)
    data = gather(store)
    assert data.bucket_s == 10
    assert [b.alpha is not None for b in data.alpha] == [True] * 6 + [False] * 6
    assert all(b.reason == "dynamic_k_unresolved" and b.draft_acceptance_rate == 0.5 for b in data.alpha[6:])
    assert "6 bucket(s)" in data.notes["alpha"] and "per-batch-size" in data.notes["alpha"]
    assert "alpha" not in data.missing


# --- the fleet ---------------------------------------------------------------------------------


def test_the_fleet_section_groups_engines_pools_alpha_and_flags_the_outlier(store: Store, tmp_path: Path) -> None:
    now = datetime.now(UTC)
    written = FF.write_fleet(store, now)
    # an operator's override for one replica and one for every engine, not yet acted on
    manual.request_override(store, now, FF.NGRAM.to_vllm(), engine=FF.key("10.0.0.3"), by="alice")
    manual.request_override(store, now, FF.K3.with_k(2).to_vllm(), by="bob")
    result = write_report(store, tmp_path)
    fleet = result.data.fleet

    big, small = fleet.groups
    assert (big.target, big.method, big.draft_model) == (FF.TARGET, "draft_model", "/drafts/good")
    assert big.spec_config == FF.K3.to_vllm() and "K=3" in big.config
    healthy_and_broken = sorted(FF.REPLICAS)[:5]
    label = {h: f"{FF.TARGET}/0@{h}:8000" for h in [*FF.REPLICAS, FF.UNCONFIGURED]}
    assert sorted(e.engine for e in big.engines) == [label[h] for h in healthy_and_broken]
    # the pooled α̂ is THE α̂ over every window of the group; its interval is widened by √φ
    pooled = alpha_of_windows([c for h in healthy_and_broken for c in written[h]])
    assert pooled.alpha_ci is not None and big.alpha_binomial is not None
    assert big.alpha == pytest.approx(pooled.alpha)
    assert big.alpha_binomial == pytest.approx(list(pooled.alpha_ci))
    assert big.alpha_lower is not None and big.alpha_upper is not None
    assert big.alpha_lower < pooled.alpha_ci[0] and big.alpha_upper > pooled.alpha_ci[1] and big.dispersion > 5
    # the replica with the broken draft, and only it, is flagged, with its own α̂ and the reason
    assert [o.engine for o in big.outliers] == [label[FF.BROKEN]]
    broken = big.outliers[0]
    assert broken.alpha == pytest.approx(alpha_of_windows(written[FF.BROKEN]).alpha)
    assert "broken draft" in broken.reason
    assert {e.verdict for e in big.engines if e is not broken} == {"in_line"}
    # pending: the change in flight on one replica, the override proposed for another; the override for
    # every engine is listed once, for all
    assert [(p.engine, p.action, p.status) for p in big.pending] == [
        (label[FF.CHANGING], "change", "applied"),
        (label["10.0.0.3"], "override", "proposed"),
    ]
    assert [(p.engine, p.action) for p in fleet.pending_for_all] == [(None, "override")]
    assert small.method == "ngram" and len(small.engines) == 1 and small.outliers == [] and small.pending == []
    assert fleet.ungrouped == [label[FF.UNCONFIGURED]]

    # the same groups and intervals as `spectuner status --fleet` over the same windows
    status = gather_fleet(store, now + timedelta(seconds=1), 600)
    assert [x for g in status["groups"] for x in g["alpha_ci"]] == pytest.approx(
        [x for g in fleet.groups for x in (g.alpha_lower, g.alpha_upper)]
    )

    html = result.index_html.read_text()
    table = html[html.index('<table id="fleet-table">') :]
    table = table[: table.index("</table>")]
    assert f"[{big.alpha_lower:.3f}, {big.alpha_upper:.3f}]" in table and f"{big.dispersion:.2f}" in table
    assert f'<span class="outlier">{label[FF.BROKEN]}</span>: α̂ = ' in table
    assert "5: " in table and all(label[h] in table for h in healthy_and_broken)
    assert "change applied" in table and "override proposed" in table and "ngram" in table
    assert 'id="fleet-pending-all"' in html and label[FF.UNCONFIGURED] in html
    assert 'id="fleet-one-engine"' not in html

    doc = json.loads(result.report_json.read_text())
    g0 = doc["fleet"]["groups"][0]
    assert [o["engine"] for o in g0["outliers"]] == [label[FF.BROKEN]]
    assert [g0["alpha_lower"], g0["alpha_upper"]] == pytest.approx([big.alpha_lower, big.alpha_upper])
    assert len(g0["engines"]) == 5 and "fleet" not in doc["missing"]


def test_one_engine_is_one_group_and_the_range_picks_the_config_at_its_end(store: Store, tmp_path: Path) -> None:
    story = F.populate(store)
    result = write_report(store, tmp_path)
    (group,) = result.data.fleet.groups
    assert [e.engine for e in group.engines] == ["lab-target/0"] and group.outliers == []
    assert group.engines[0].verdict == "not_judged" and "K=4" in group.config
    # only the windows of the config in force (K=4 from 75 min)
    k4 = [w.spec for w in story.windows if w.start >= F._minute(75) and w.spec is not None]
    assert group.alpha == pytest.approx(alpha_of_windows(k4).alpha)
    assert 'id="fleet-one-engine"' in result.index_html.read_text()
    # a range ending at 40 min: the good draft at K=3 (in force from 35 min), over its windows in range
    earlier = gather(store, since=F._minute(30), until=F._minute(40)).fleet.groups[0]
    k3 = [w.spec for w in story.windows if F._minute(35) <= w.start and w.end < F._minute(40) and w.spec]
    assert "draft-good" in (earlier.draft_model or "") and "K=3" in earlier.config
    assert earlier.alpha == pytest.approx(alpha_of_windows(k3).alpha)


# --- the command --------------------------------------------------------------------------------


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["report", *args])
    return result.exit_code, result.stdout, result.output


def test_cli_writes_the_report_and_prints_json(db_url: str, tmp_path: Path) -> None:
    with Store(db_url) as store:
        F.populate(store, decisions=False)
    code, stdout, output = _run("--db", db_url, "--out", str(tmp_path / "r"), "--json")
    assert code == 0, output
    summary = json.loads(stdout)
    assert summary["images"] == ["alpha", "positions", "timeline", "goodput"]
    assert list(summary["missing"]) == ["gains"] and summary["decisions"] == 0
    assert summary["windows"] == 540 and summary["engines"] == ["lab-target/0"]
    assert Path(summary["index_html"]).is_file() and Path(summary["report_json"]).is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--since", "yesterday"], "neither a duration"),
        (["--since", "2026-11-30T09:00:00"], "no time zone"),
        (["--since", "1h", "--until", "2h"], "must be after --since"),
    ],
)
def test_cli_refuses_bad_time_ranges(args: list[str], needle: str, tmp_path: Path) -> None:
    code, _, output = _run("--db", f"sqlite:///{tmp_path / 'x.db'}", "--out", str(tmp_path / "r"), *args)
    assert code == 2 and needle in output


def test_cli_refuses_a_database_without_schema(empty_db_url: str, tmp_path: Path) -> None:
    code, _, output = _run("--db", empty_db_url, "--out", str(tmp_path / "r"))
    assert code == 2 and "spectuner db upgrade" in output
    assert not (tmp_path / "r").exists()


def test_cli_refuses_an_out_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    code, _, output = _run("--db", f"sqlite:///{tmp_path / 'x.db'}", "--out", str(tmp_path / "file"))
    assert code == 2 and "not a directory" in output


def test_cli_unreachable_database_is_a_runtime_failure(tmp_path: Path) -> None:
    code, _, output = _run("--db", "postgresql://spectuner@127.0.0.1:1/none", "--out", str(tmp_path / "r"))
    assert code == 1 and "cannot" in output and "127.0.0.1" in output

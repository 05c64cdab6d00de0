"""Schema versions on SQLite and a real PostgreSQL: one head, models == migrations, up/down/up with
data present, and the check that refuses a missing, old or too-new schema with the fix command."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from tests.integration.store_factories import T0, A, request, step, window
from tuner.store import (
    DecisionRecord,
    EngineConfigRecord,
    SchemaMissingError,
    SchemaOutOfDateError,
    SchemaTooNewError,
    Store,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    rollup_windows,
    upgrade,
)
from tuner.store.connect import make_engine
from tuner.store.models import Base
from tuner.store.schema import RevisionError, script_directory

DATA_TABLES = ("engines", "engine_configs", "scrape_windows", "requests", "steps", "decisions", "events")


def test_exactly_one_head() -> None:
    heads = script_directory().get_heads()
    assert len(heads) == 1, f"migrations/versions has several heads {heads}: merge them"
    assert heads[0] == head_revision()
    # Every revision reaches base through down_revision: a linear, complete history.
    chain = [rev.revision for rev in script_directory().walk_revisions()]
    assert chain[-1] == "0001" and chain[0] == heads[0]


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_models_and_migrations_describe_the_same_schema(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; write a migration for: {diff}"


def _fill(url: str) -> dict[str, object]:
    with Store(url) as store:
        config_id = store.record_config(A, EngineConfigRecord(method="eagle", started_at=T0, num_spec_tokens=3))
        windows = [window(i, config_id=config_id) for i in range(30)]
        store.write_windows(windows)
        store.write_requests([request(i) for i in range(5)])
        store.write_steps([step(i) for i in range(7)])
        decision_id = store.record_decision(
            DecisionRecord(
                created_at=T0,
                action="keep",
                reason="insufficient_evidence",
                message="wait",
                inputs={"drafts": 10},
                engine=A,
            )
        )
        rollup_windows(store, T0 + timedelta(hours=1))
        return {
            "windows": store.windows(A),
            "requests": store.requests(),
            "steps": store.steps(A),
            "decision": store.decision(decision_id),
            "config": store.config(config_id),
            "rollups": store.rollups(A),
        }


def test_upgrade_downgrade_upgrade_keeps_data(empty_db_url: str) -> None:
    url = empty_db_url
    assert upgrade(url).to_revision == head_revision()
    before = _fill(url)
    assert before["rollups"]

    # Down to 0001 removes the later tables only (rollups, alert deliveries); the raw data stays readable.
    result = downgrade(url, "0001")
    assert result.from_revision == head_revision() and result.to_revision == "0001"
    tables = _tables(url)
    assert not {"window_rollups_1m", "alert_deliveries", "alert_cursors"} & tables
    assert set(DATA_TABLES) <= tables
    engine = make_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM scrape_windows")).scalar_one() == 30
        assert conn.execute(text("SELECT count(*) FROM steps")).scalar_one() == 7
    engine.dispose()

    assert upgrade(url).to_revision == head_revision()
    with Store(url) as store:
        assert store.windows(A) == before["windows"]
        assert store.requests() == before["requests"]
        assert store.steps(A) == before["steps"]
        assert store.decision(before["decision"].id) == before["decision"]  # type: ignore[attr-defined]
        assert store.config(before["config"].id) == before["config"]  # type: ignore[attr-defined]
        assert store.rollups(A) == []  # dropped with its table; rebuilt from the raw windows:
        rollup_windows(store, T0 + timedelta(hours=1))
        assert store.rollups(A) == before["rollups"]


def test_downgrade_to_base_and_up_again(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    _fill(empty_db_url)
    assert downgrade(empty_db_url, "base").to_revision is None
    assert _tables(empty_db_url) <= {"alembic_version"}
    upgrade(empty_db_url)
    with Store(empty_db_url) as store:
        assert store.windows(A) == []
        store.write_windows([window(0)])


def test_store_refuses_an_old_schema_and_names_the_fix(empty_db_url: str) -> None:
    upgrade(empty_db_url, "0001")
    with pytest.raises(SchemaOutOfDateError) as info:
        Store(empty_db_url)
    message = str(info.value)
    assert "'0001'" in message and repr(head_revision()) in message
    assert f"spectuner db upgrade --db {empty_db_url}" in message
    assert info.value.fix == f"spectuner db upgrade --db {empty_db_url}"
    assert current_revision(empty_db_url) == "0001"


def test_store_refuses_a_database_without_schema(empty_db_url: str) -> None:
    with pytest.raises(SchemaMissingError, match="spectuner db upgrade --db"):
        Store(empty_db_url)
    if empty_db_url.startswith("sqlite"):
        assert not Path(empty_db_url.removeprefix("sqlite:///")).exists(), "the check must not create the file"


def test_store_refuses_a_schema_from_a_newer_spectuner(db_url: str) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(SchemaTooNewError, match="newer spectuner"):
        check_schema(db_url)


def test_unknown_revision_is_a_clear_error(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    with pytest.raises(RevisionError, match=r"Known revisions: .*0002, 0001"):
        downgrade(empty_db_url, "nope")
    assert current_revision(empty_db_url) == head_revision()

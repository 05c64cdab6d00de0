"""The time-series store: models, schema versions, the :class:`Store`, retention.

Import what you need from here; the submodules are one concept each.
"""

from tuner.store.records import (
    AppliedBy,
    DecisionRecord,
    DecisionStatus,
    EngineConfigRecord,
    RollupRecord,
    StoredConfig,
    StoredDecision,
    StoredEngine,
    WindowTotals,
)
from tuner.store.retention import RetentionPolicy, prune, rollup_windows, run_retention
from tuner.store.rows import InvalidRecordError
from tuner.store.schema import (
    SchemaError,
    SchemaMissingError,
    SchemaOutOfDateError,
    SchemaTooNewError,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from tuner.store.store import Store, UnknownRecordError
from tuner.store.url import DatabaseUrlError, resolve_db_url

__all__ = [
    "AppliedBy",
    "DatabaseUrlError",
    "DecisionRecord",
    "DecisionStatus",
    "EngineConfigRecord",
    "InvalidRecordError",
    "RetentionPolicy",
    "RollupRecord",
    "SchemaError",
    "SchemaMissingError",
    "SchemaOutOfDateError",
    "SchemaTooNewError",
    "Store",
    "StoredConfig",
    "StoredDecision",
    "StoredEngine",
    "UnknownRecordError",
    "WindowTotals",
    "check_schema",
    "current_revision",
    "downgrade",
    "head_revision",
    "prune",
    "resolve_db_url",
    "rollup_windows",
    "run_retention",
    "upgrade",
]

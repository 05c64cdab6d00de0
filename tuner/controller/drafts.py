"""The registry of draft candidates an operator added (``spectuner drafts add|remove``).

No table of its own: each change is an audit row in ``decisions`` (action ``draft_add`` or
``draft_remove``, mode ``manual``, status ``recorded``, ``inputs = {"by": who, "draft": spec}``), so
the registry has the audit log's guarantees (never pruned, who and when on every change) and the
current registry is the replay of those rows in order. The controller reads
:func:`registered_drafts` as extra swap candidates.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from policies.spec_config import RESERVED_KEYS, SpecConfig
from tuner.store import DecisionRecord, Store, StoredDecision

log = logging.getLogger(__name__)

DRAFT_ADD = "draft_add"
DRAFT_REMOVE = "draft_remove"
RECORDED = "recorded"  # the rows' status: a registry change takes effect when written

# vLLM speculative methods a registry entry may use; the first three load a draft model.
MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3"})
FREE_METHODS = frozenset({"ngram", "suffix"})
DRAFT_METHODS = MODEL_METHODS | FREE_METHODS
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}$")
# Keys the registry owns; ``extra`` may not set them (they would silently override the spec).
_RESERVED = RESERVED_KEYS


class DraftRegistryError(ValueError):
    """A registry change that cannot be made (bad spec, duplicate or unknown name); nothing written."""


@dataclass(frozen=True)
class DraftSpec:
    """One draft candidate. ``extra`` holds further vLLM speculative-config keys (e.g.
    ``prompt_lookup_max`` for ngram); ``num_params`` (parameters) and ``dtype`` size its weights;
    ``kv_bytes_per_token`` (from the draft's config.json, when known) sizes its KV cache."""

    name: str
    method: str
    model: str | None = None
    num_params: int | None = None
    dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    kv_bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise DraftRegistryError(
                f"draft name {self.name!r} is not usable: 1-64 characters, letters, digits and ._:@+- "
                "(starting with a letter or digit)"
            )
        if self.method not in DRAFT_METHODS:
            raise DraftRegistryError(
                f"draft {self.name!r}: method {self.method!r} is not one of {', '.join(sorted(DRAFT_METHODS))}"
            )
        if self.method in MODEL_METHODS and not self.model:
            raise DraftRegistryError(f"draft {self.name!r}: method {self.method!r} needs a model (a path or hub name)")
        if self.method in FREE_METHODS and self.model:
            raise DraftRegistryError(
                f"draft {self.name!r}: method {self.method!r} uses no draft model; drop the model {self.model!r}"
            )
        for label, value in (("num_params", self.num_params), ("kv_bytes_per_token", self.kv_bytes_per_token)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise DraftRegistryError(f"draft {self.name!r}: {label} must be an integer ≥ 0 but got {value!r}")
        if not isinstance(self.extra, dict):
            raise DraftRegistryError(f"draft {self.name!r}: extra must be a JSON object but got {self.extra!r}")
        clash = sorted(_RESERVED & set(self.extra))
        if clash:
            raise DraftRegistryError(
                f"draft {self.name!r}: extra may not set {', '.join(clash)} (the spec and K set them)"
            )
        for key, value in self.extra.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise DraftRegistryError(f"draft {self.name!r}: extra[{key!r}] is {value}; use a finite number")

    def to_spec_config(self, k: int) -> SpecConfig:
        """This draft at K = ``k``."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise DraftRegistryError(f"K must be an integer ≥ 0 but got {k!r}")
        return SpecConfig(self.method, self.model or None, k, extra=dict(self.extra))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftSpec:
        known = {"name", "method", "model", "num_params", "dtype", "extra", "kv_bytes_per_token"}
        return cls(**{k: v for k, v in data.items() if k in known})


def add_draft(store: Store, now: datetime, spec: DraftSpec, by: str) -> int:
    """Register ``spec``; its name must not be registered already. Returns the audit row's id."""
    if any(d.name == spec.name for d in registered_drafts(store)):
        raise DraftRegistryError(
            f"a draft named {spec.name!r} is already registered; remove it first "
            f"(`spectuner drafts remove {spec.name}`) or choose another name"
        )
    model = f" ({spec.model})" if spec.model else ""
    return store.record_decision(
        DecisionRecord(
            created_at=now,
            action=DRAFT_ADD,
            reason="manual",
            message=f"Draft {spec.name} [{spec.method}]{model} registered by {by}.",
            inputs={"by": by, "draft": spec.to_dict()},
            mode="manual",
            status=RECORDED,
        )
    )


def remove_draft(store: Store, now: datetime, name: str, by: str) -> int:
    """Unregister ``name``; it must be registered. Returns the audit row's id."""
    registered = [d.name for d in registered_drafts(store)]
    if name not in registered:
        known = ", ".join(registered) or "none"
        raise DraftRegistryError(f"no registered draft named {name!r} (registered: {known})")
    return store.record_decision(
        DecisionRecord(
            created_at=now,
            action=DRAFT_REMOVE,
            reason="manual",
            message=f"Draft {name} removed by {by}.",
            inputs={"by": by, "draft": {"name": name}},
            mode="manual",
            status=RECORDED,
        )
    )


def registry_rows(store: Store) -> list[StoredDecision]:
    """The add/remove audit rows, oldest first."""
    return [d for d in store.decisions(status=RECORDED) if d.decision.action in (DRAFT_ADD, DRAFT_REMOVE)]


def registered_drafts(store: Store) -> list[DraftSpec]:
    """The registry now: the add/remove rows replayed in order, in the order drafts were added.

    A row that cannot be replayed (written by hand, or a concurrent writer's duplicate) is logged and
    skipped, never fatal: the controller must keep running on a registry it can partly read.
    """
    current: dict[str, DraftSpec] = {}
    for row in registry_rows(store):
        data = row.decision.inputs.get("draft")
        name = data.get("name") if isinstance(data, dict) else None
        if row.decision.action == DRAFT_ADD:
            try:
                spec = DraftSpec.from_dict(data) if isinstance(data, dict) else None
            except (DraftRegistryError, TypeError) as exc:
                log.warning("draft registry: audit row %d cannot be read (%s); skipped", row.id, exc)
                continue
            if spec is not None:
                current.pop(spec.name, None)  # a duplicate add: the later one wins, placed last
                current[spec.name] = spec
        elif name in current:
            del current[name]
        else:
            log.warning("draft registry: audit row %d removes %r, which is not registered; skipped", row.id, name)
    return list(current.values())


def who_and_when(store: Store) -> dict[str, tuple[str, datetime]]:
    """For each registered draft: who added it and when (its latest add row)."""
    out: dict[str, tuple[str, datetime]] = {}
    for row in registry_rows(store):
        data = row.decision.inputs.get("draft")
        if row.decision.action == DRAFT_ADD and isinstance(data, dict) and isinstance(data.get("name"), str):
            out[data["name"]] = (str(row.decision.inputs.get("by", "?")), row.decision.created_at)
    return out

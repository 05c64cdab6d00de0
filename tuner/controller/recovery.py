"""Start-up after a crash: close the applies a daemon stop interrupted, and choose the config to start.

Nothing the controller needs survives a restart except the database: an apply left ``applying`` is
closed here (rolled back when the row says the new config had already failed to start, else failed —
a config whose apply coincided with a crash is not retried automatically), and the engine starts with
the last config recorded for it, else the config file's.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from collectors.records import EngineKey
from policies.spec_config import SpecConfig
from tuner.actuators.base import START_FAILED
from tuner.controller.audit import write_event
from tuner.store import DecisionStatus, Store, StoredConfig


def recover(store: Store, keys: Sequence[EngineKey], now: datetime) -> list[int]:
    """Close every apply a daemon stop interrupted; returns the decision ids it closed."""
    closed: list[int] = []
    for d in store.decisions(status=DecisionStatus.APPLYING):
        got = d.status_message or ""
        if got.startswith(START_FAILED):
            # The new config had already failed to start: finishing the rollback is what the daemon
            # does next (it starts the last recorded config), so it is recorded as one.
            message = (
                f"{got.split(';')[0]}; the daemon stopped while restoring the previous config, and the "
                "next daemon restarted the last recorded config"
            )
            store.update_decision(d.id, status=DecisionStatus.ROLLED_BACK, at=now, status_message=message)
            write_event(store, now, keys, "apply_rolled_back", "warning", message, d.id)
        else:
            # an operator can apply it by hand (spectuner apply)
            store.update_decision(
                d.id,
                status=DecisionStatus.FAILED,
                at=now,
                status_message="interrupted: the daemon stopped during this apply; it restarted with the last "
                "recorded config",
            )
        closed.append(d.id)
    if closed:
        write_event(
            store,
            now,
            keys,
            "apply_interrupted",
            "warning",
            f"{len(closed)} apply(s) were interrupted by a daemon stop; state recovered",
            None,
        )
    return closed


def config_to_start(current: StoredConfig | None, default: SpecConfig) -> tuple[SpecConfig, str]:
    """The config the engine should (re)start with: the last recorded one, else ``default``."""
    if current is not None:
        return current.config.spec, "database"
    return default, "config file"


__all__ = ["config_to_start", "recover"]

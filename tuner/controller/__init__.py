"""The controller: evidence from the store → policy → guardrails → actuator → verify → audit.

Modules: ``evidence`` (snapshot from the store), ``policy`` (proposal from the policies package),
``candidates`` (draft candidates), ``guardrails`` (pure rails), ``verify`` (pure realized-gain
judgement), ``manual`` (pause, resume, override rows), ``drafts`` (the operator's draft registry),
``reconcile`` (the :class:`Controller` that ties them together).

The package-level names load their modules on first use: the admin CLI imports ``manual`` and
``drafts`` and should not pay for scipy (the policies) on every command.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Block": "guardrails",
    "BlockReason": "guardrails",
    "ControllerState": "guardrails",
    "GuardrailSettings": "guardrails",
    "MaintenanceWindowSpec": "guardrails",
    "Proposal": "guardrails",
    "check_guardrails": "guardrails",
    "PolicyOutcome": "policy",
    "PolicyReason": "policy",
    "PolicySettings": "policy",
    "propose": "policy",
    "propose_k": "policy",
    "CHANGE": "reconcile",
    "Controller": "reconcile",
    "ControllerSettings": "reconcile",
    "TickResult": "reconcile",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tuner.controller' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tuner.controller.{module}"), name)


__all__ = sorted(_WHERE)

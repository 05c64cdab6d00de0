"""The controller: context from the store → policy → guardrails → actuator → verify → audit.

Modules (docs/architecture.md has the reading order): ``controller`` (the :class:`Controller`, one
decision and one verification), ``context`` (the only store reads of a decision: a typed
:class:`DecisionContext`, the :class:`ControllerMemory` carried between ticks, the audit's
:class:`DecisionInputs`), ``evidence`` (the store queries behind the context), ``policy`` (pure,
composed from ``policies/``), ``guardrails`` (pure rails), ``apply`` (actuator and audit),
``verify`` (pure realized-gain judgement), ``recovery`` (start-up after a crash), ``audit`` (rows and
events), ``settings`` (built from the config file's sections), ``step_cost`` (T(B, K) from the
plugin's steps), ``candidates`` and ``drafts`` (draft candidates and the operator's registry),
``manual`` (pause, resume, override rows).

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
    "Proposal": "guardrails",
    "check_guardrails": "guardrails",
    "PolicyOutcome": "policy",
    "PolicyReason": "policy",
    "propose": "policy",
    "propose_k": "policy",
    "PolicySettings": "settings",
    "ControllerSettings": "settings",
    "CHANGE": "audit",
    "TickResult": "audit",
    "Controller": "controller",
    "ControllerMemory": "context",
    "DecisionContext": "context",
    "DecisionInputs": "context",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tuner.controller' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tuner.controller.{module}"), name)


__all__ = sorted(_WHERE)

"""The controller: evidence from the store → policy → guardrails → actuator → verify → audit.

Modules: ``evidence`` (snapshot from the store), ``policy`` (proposal from the policies package),
``guardrails`` (pure rails), ``verify`` (pure realized-gain judgement), ``manual`` (pause, resume,
override rows), ``reconcile`` (the :class:`Controller` that ties them together).
"""

from tuner.controller.guardrails import (
    Block,
    BlockReason,
    ControllerState,
    GuardrailSettings,
    MaintenanceWindowSpec,
    Proposal,
    check_guardrails,
)
from tuner.controller.policy import PolicyOutcome, PolicyReason, PolicySettings, propose_k
from tuner.controller.reconcile import CHANGE, Controller, ControllerSettings, TickResult

__all__ = [
    "CHANGE",
    "Block",
    "BlockReason",
    "Controller",
    "ControllerSettings",
    "ControllerState",
    "GuardrailSettings",
    "MaintenanceWindowSpec",
    "PolicyOutcome",
    "PolicyReason",
    "PolicySettings",
    "Proposal",
    "TickResult",
    "check_guardrails",
    "propose_k",
]

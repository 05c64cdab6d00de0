"""Actuators: how a chosen speculative-decoding config reaches the engine.

One interface (:class:`~tuner.actuators.base.Actuator`, ``apply(config) -> ApplyResult``), idempotent:
applying the config already in force changes nothing.
"""

from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, NullActuator, config_fingerprint
from tuner.actuators.command import CommandActuator
from tuner.actuators.restart import RestartActuator
from tuner.actuators.webhook import WebhookActuator

__all__ = [
    "Actuator",
    "ApplyResult",
    "ApplyStatus",
    "CommandActuator",
    "NullActuator",
    "RestartActuator",
    "WebhookActuator",
    "config_fingerprint",
]

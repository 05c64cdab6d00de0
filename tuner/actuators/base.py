"""The actuator contract: ``apply(config) -> ApplyResult``, idempotent, never raises for an engine
that refuses a config (that is a result, not an exception)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

VllmSpec = dict[str, Any]  # vLLM's --speculative-config as a JSON object


def config_fingerprint(config: VllmSpec | None) -> str:
    """A stable text identity of a config (key order does not matter): for a valid config the same text
    as ``SpecConfig.from_vllm(config).fingerprint``, and defined for any JSON an engine reports."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


START_FAILED = "start_failed"  # progress note: the new config did not come up; restoring the old one


class ApplyStatus(StrEnum):
    APPLIED = "applied"  # the new config is in force
    UNCHANGED = "unchanged"  # it already was; nothing was done
    ROLLED_BACK = "rolled_back"  # the new config failed; the last good one is back in force
    FAILED = "failed"  # the new config failed and the old one could not be confirmed either


@dataclass(frozen=True)
class ApplyImpact:
    """What an apply cost clients, as the front door measured it (None: not measured)."""

    strategy: str  # restart, drain_hold, blue_green, rolling
    requests_held: int | None = None
    longest_hold_s: float | None = None
    requests_failed: int | None = None  # errors of our making: 502/503/504 from the tap, cut streams
    drain_s: float | None = None  # waiting for in-flight requests on the old engine
    warmup_s: float | None = None  # starting and warming the new engine while the old one served

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ApplyResult:
    status: ApplyStatus
    message: str
    config: VllmSpec | None  # what is in force afterwards, as far as the actuator knows
    downtime_s: float | None = None  # serving gap caused by the apply, when measured
    detail: str = ""  # e.g. the tail of the failed engine's log, an orchestrator's answer
    impact: ApplyImpact | None = None  # client impact, when the apply went through the front door
    replicas: tuple[Mapping[str, Any], ...] = ()  # per-replica outcomes of an apply across several engines

    @property
    def ok(self) -> bool:
        return self.status in (ApplyStatus.APPLIED, ApplyStatus.UNCHANGED)

    def event_data(self) -> dict[str, Any]:
        """What an audit event records of this apply (the controller adds its decision id)."""
        data: dict[str, Any] = {
            "status": self.status.value,
            "downtime_s": self.downtime_s,
            "detail": self.detail[-1000:],
            "config": self.config,
        }
        if self.impact is not None:
            data.update(self.impact.as_dict())
        if self.replicas:
            data["replicas"] = [dict(r) for r in self.replicas]
        return data


class Actuator(ABC):
    """Applies speculative-decoding configs to an engine.

    Contract: ``apply(config)`` returns :data:`ApplyStatus.UNCHANGED` without side effects when
    ``config`` is the one last applied successfully; otherwise it tries to put ``config`` in force and
    reports what is in force afterwards. It raises only for programming errors.
    """

    kind: str = "abstract"
    needs_restart: bool = True  # whether an apply interrupts serving (the switching-cost rail)

    def __init__(self) -> None:
        self.current: VllmSpec | None = None  # last config known to be in force
        # Milestones of a long apply (e.g. "start_failed: ..."), written to the audit row as they happen
        # so a daemon killed mid-apply can tell on restart how far the apply got.
        self.progress: Callable[[str], None] = lambda note: None

    @abstractmethod
    def apply(self, config: VllmSpec) -> ApplyResult: ...

    def needs_restart_for(self, config: VllmSpec) -> bool:
        """Whether applying ``config`` interrupts serving (the live actuator: only what it cannot do live)."""
        return self.needs_restart

    def switching_cost_s(self, config: VllmSpec) -> float | None:
        """Seconds of lost serving that applying ``config`` is expected to cost (what the switching-cost
        rail charges a change), or None: the controller then uses the median measured gap of this
        week's applies, else the configured ``restart_downtime_s``."""
        return None

    def start(self, config: VllmSpec) -> ApplyResult:
        """Bring the engine up with ``config`` (actuators that do not manage an engine just remember it)."""
        self.current = dict(config)
        return ApplyResult(ApplyStatus.UNCHANGED, "the engine is managed elsewhere", self.current)

    def ensure_running(self) -> ApplyResult | None:
        """Health job hook: restart a managed engine that died. None when there is nothing to do."""
        return None

    def stop(self) -> None:
        """Stop a managed engine (daemon shutdown). No-op for external orchestrators."""
        return None

    def _unchanged(self, config: VllmSpec) -> ApplyResult | None:
        if self.current is not None and config_fingerprint(config) == config_fingerprint(self.current):
            return ApplyResult(ApplyStatus.UNCHANGED, "this config is already in force", self.current, 0.0)
        return None


class NullActuator(Actuator):
    """Advisory deployments: nothing is ever applied."""

    kind = "none"

    def apply(self, config: VllmSpec) -> ApplyResult:
        return self._unchanged(config) or ApplyResult(
            ApplyStatus.FAILED, "no actuator is configured ([actuator] kind = 'none')", self.current
        )

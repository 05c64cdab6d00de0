"""The simulated actuator: applies a config to the :class:`~tuner.sim.engine.SimEngine` by a restart.

Same contract as the real restart actuator (``tuner.actuators.base.Actuator``): idempotent, a config
that does not start is a result (``rolled_back`` to the last good config), never an exception. Time
passes on the simulated clock: an apply advances it by the scenario's restart downtime (plus
``start_failure_s`` when the new config fails and the old one is started again), exactly as a real
restart blocks the controller while the engine is down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from policies.spec_config import SpecConfig
from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, VllmSpec
from tuner.sim.engine import SimConfig, SimEngine


class SimClock:
    """A settable clock (the controller's ``clock``); the runner and the actuator move it."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@dataclass(frozen=True)
class ApplyLog:
    at: datetime
    target: str  # config label
    status: str
    downtime_s: float


@dataclass
class ActuatorStats:
    restarts: int = 0
    failed_starts: int = 0
    downtime_s: float = 0.0
    log: list[ApplyLog] = field(default_factory=list)


class SimActuator(Actuator):
    kind = "restart"
    needs_restart = True

    def __init__(self, engine: SimEngine, clock: SimClock, start: SimConfig) -> None:
        super().__init__()
        problem = engine.start_problem(start)
        if problem is not None:
            raise ValueError(f"the scenario's start config does not start: {problem}; change [start]")
        self.engine = engine
        self.clock = clock
        self.config = start
        self.current = engine.to_spec(start).to_vllm()
        self.stats = ActuatorStats()

    def apply(self, config: VllmSpec) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged is not None:
            return unchanged
        e = self.engine.scenario.engine
        at = self.clock.now
        self.stats.restarts += 1
        try:
            target = self.engine.from_spec(SpecConfig.from_vllm(config))
        except ValueError:  # not a config vLLM would take
            target = None
        problem = (
            f"no draft of the scenario matches {config}" if target is None else self.engine.start_problem(target)
        )
        label = target.label if target is not None else str(config)
        if problem is not None:
            gap = e.restart_downtime_s + e.start_failure_s
            self.clock.advance(gap)
            self.stats.failed_starts += 1
            self.stats.downtime_s += gap
            self.stats.log.append(ApplyLog(at, label, ApplyStatus.ROLLED_BACK.value, gap))
            return ApplyResult(
                ApplyStatus.ROLLED_BACK,
                f"{label} did not come up; {self.config.label} is serving again",
                self.current,
                gap,
                detail=problem,
            )
        assert target is not None
        self.clock.advance(e.restart_downtime_s)
        self.stats.downtime_s += e.restart_downtime_s
        self.config = target
        self.current = dict(config)
        self.stats.log.append(ApplyLog(at, label, ApplyStatus.APPLIED.value, e.restart_downtime_s))
        return ApplyResult(ApplyStatus.APPLIED, f"restarted with {label}", self.current, e.restart_downtime_s)

    def start(self, config: VllmSpec) -> ApplyResult:
        return ApplyResult(ApplyStatus.UNCHANGED, "the simulated engine is already up", self.current)

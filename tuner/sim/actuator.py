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


def live_change(engine: SimEngine, old: SimConfig, new: SimConfig) -> bool:
    """Whether the engine takes ``old`` → ``new`` live (``[engine] live_k_max``): the same draft, every K
    within the K_max it runs, as the live actuator does through the plugin; anything else restarts."""
    k_max = engine.scenario.engine.live_k_max
    if not k_max or old.draft is None or new.draft != old.draft:
        return False
    ks = [row[2] for row in new.table] if new.table else [new.k]
    return max(ks) <= k_max


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
        try:
            target = self.engine.from_spec(SpecConfig.from_vllm(config))
        except ValueError:  # not a config vLLM would take
            target = None
        problem = (
            f"no draft of the scenario matches {config}" if target is None else self.engine.start_problem(target)
        )
        label = target.label if target is not None else str(config)
        if target is not None and problem is None and live_change(self.engine, self.config, target):
            self.config = target  # a live K change: no restart, no serving gap
            self.current = dict(config)
            self.stats.log.append(ApplyLog(at, label, ApplyStatus.APPLIED.value, 0.0))
            return ApplyResult(ApplyStatus.APPLIED, f"set {label} live", self.current, 0.0)
        self.stats.restarts += 1
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

    def needs_restart_for(self, config: VllmSpec) -> bool:
        try:
            target = self.engine.from_spec(SpecConfig.from_vllm(config))
        except ValueError:
            return True
        return target is None or not live_change(self.engine, self.config, target)

    def start(self, config: VllmSpec) -> ApplyResult:
        return ApplyResult(ApplyStatus.UNCHANGED, "the simulated engine is already up", self.current)

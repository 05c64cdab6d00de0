"""Rolling apply across N engine replicas behind one front door, one replica at a time.

For each replica: take it out of the door's rotation (the others keep serving, nothing is held),
drain it, restart it with the new config (its own actuator, ready on ``/v1/models``), put it back,
then ask ``verify`` (the controller's first verification window for that replica). A replica that
fails to start or a regression stops the roll: the replicas already changed go back to the old
config the same way, and the rest are never touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tuner.actuators.base import Actuator, ApplyImpact, ApplyResult, ApplyStatus, VllmSpec
from tuner.actuators.front_door import FrontDoorClient, FrontDoorError
from tuner.actuators.restart import RestartActuator

log = logging.getLogger(__name__)

Verifier = Callable[[int, VllmSpec], bool]  # (replica index, config) -> no regression


class RollingActuator(Actuator):
    """``replicas[i]`` serves at ``urls[i]``; ``verify`` defaults to "no regression"."""

    kind = "restart"
    strategy = "rolling"
    needs_restart = False  # the other replicas serve while one changes

    def __init__(
        self,
        replicas: Sequence[RestartActuator],
        urls: Sequence[str],
        door: FrontDoorClient,
        *,
        verify: Verifier | None = None,
        drain_timeout_s: float = 30.0,
    ) -> None:
        super().__init__()
        if len(replicas) != len(urls) or not replicas:
            raise ValueError("rolling apply needs one URL per replica and at least one replica")
        self.replicas = list(replicas)
        self.urls = [u.rstrip("/") for u in urls]
        self.door = door
        self.verify: Verifier = verify or (lambda index, config: True)
        self.drain_timeout_s = drain_timeout_s

    def start(self, config: VllmSpec) -> ApplyResult:
        results = [r.start(config) for r in self.replicas]
        bad = [res for res in results if not res.ok]
        self.current = dict(config) if not bad else None
        self.door.set_upstreams(self.urls)
        return bad[0] if bad else results[0]

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def _one(self, index: int, config: VllmSpec) -> ApplyResult:
        others = [u for i, u in enumerate(self.urls) if i != index]
        self.door.set_upstreams(others)  # with one replica the door holds meanwhile
        self.door.drain(self.urls[index], self.drain_timeout_s)
        try:
            return self.replicas[index].apply(config)
        finally:
            self.door.set_upstreams(self.urls)

    def apply(self, config: VllmSpec) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged:
            return unchanged
        old = self.current
        t0 = time.monotonic()
        try:
            self.door.state(new_period=True)
        except FrontDoorError as exc:
            return ApplyResult(ApplyStatus.ROLLED_BACK, f"not applied: front door unreachable ({exc})", old, 0.0)
        changed: list[int] = []
        failure = ""
        for index in range(len(self.replicas)):
            result = self._one(index, config)
            changed.append(index)
            if not result.ok:
                failure = f"replica {index} did not take the config ({result.message})"
                break
            if not self.verify(index, config):
                failure = f"replica {index} regressed in its first verification window"
                break
        if failure and old is not None:
            log.warning("rolling apply: %s; rolling back replicas %s", failure, changed)
            for index in changed:
                self._one(index, old)
        state = self.door.state()
        period = state.get("period", {})
        impact = ApplyImpact(
            self.strategy,
            int(period.get("held", 0)),
            float(period.get("longest_hold_s", 0.0)),
            int(period.get("failed", 0)),
            float(period.get("drain_s", 0.0)),
            None,
        )
        total_s = time.monotonic() - t0
        if failure:
            status = ApplyStatus.ROLLED_BACK if old is not None else ApplyStatus.FAILED
            untouched = len(self.replicas) - len(changed)
            return ApplyResult(
                status,
                f"{failure}; {len(changed)} replica(s) back on the old config, {untouched} never changed",
                old,
                0.0,
                impact=impact,
            )
        self.current = dict(config)
        return ApplyResult(
            ApplyStatus.APPLIED,
            f"{len(self.replicas)} replica(s) changed one at a time in {total_s:.1f} s",
            self.current,
            0.0,
            impact=impact,
        )

    def switching_cost_s(self, config: VllmSpec) -> float | None:
        return 0.0  # the other replicas serve; a single replica's restart is what drain-and-hold would cost


__all__ = ["RollingActuator", "Verifier"]

"""Drain-and-hold: a restart behind the front door that no client sees as an error.

Order: the tap holds new arrivals (bounded queue, bounded wait), the requests already on the old
engine finish (bounded by ``drain_timeout_s``), the engine restarts with the new config and, once it
answers ``/v1/models``, the held requests go to it, oldest first. If the new config does not come
up, the last good one is started again and the held requests go to that. Nothing that reached the
old engine is sent again; a request held past ``max_hold_s`` gets a 503 with ``Retry-After``.

Out of rotation instead of a hold: when the door also sends to other replicas (one sidecar per replica
behind a shared router), this engine is taken out of rotation, drained, restarted and put back once it
answers; new requests go to the other replicas meanwhile and nobody waits. An engine that is not
serving after the apply (it did not come up, nor did the last good config) stays out of rotation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tuner.actuators.base import ApplyImpact, ApplyResult, ApplyStatus, VllmSpec
from tuner.actuators.front_door import FrontDoorClient, FrontDoorError
from tuner.actuators.restart import RestartActuator

log = logging.getLogger(__name__)


def impact_from(strategy: str, state: Mapping[str, Any], drain_s: float | None, warmup_s: float | None) -> ApplyImpact:
    """The client impact of one change from the front door's period figures (``FrontDoor.state``)."""
    period = state.get("period", {})
    if drain_s is None and "drain_s" in period:
        drain_s = float(period["drain_s"])
    return ApplyImpact(
        strategy=strategy,
        requests_held=int(period.get("held", 0)),
        longest_hold_s=float(period.get("longest_hold_s", 0.0)),
        requests_failed=int(period.get("failed", 0)),
        drain_s=drain_s,
        warmup_s=warmup_s,
    )


class DrainHoldActuator(RestartActuator):
    """A :class:`RestartActuator` whose engine sits behind the tap's front door at ``engine_url``."""

    kind = "restart"
    strategy = "drain_hold"

    def __init__(
        self,
        argv: Sequence[str],
        engine_url: str,
        log_path: Path,
        door: FrontDoorClient,
        *,
        drain_timeout_s: float = 30.0,
        startup_timeout_s: float = 600.0,
        shutdown_timeout_s: float = 30.0,
        pass_shutdown_timeout: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        # Ready means the OpenAI API answers, not just /health: held requests go there at once.
        super().__init__(
            argv, engine_url.rstrip("/") + "/v1/models", log_path, startup_timeout_s=startup_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s, pass_shutdown_timeout=pass_shutdown_timeout, env=env,
        )
        self.engine_url = engine_url.rstrip("/")
        self.door = door
        self.drain_timeout_s = drain_timeout_s
        self.last_impact: ApplyImpact | None = None

    def lease_s(self) -> float:
        """How long the door keeps a hold if this process dies mid-apply: two starts and a drain."""
        return self.drain_timeout_s + 2 * self.startup_timeout_s + self.shutdown_timeout_s + 60.0

    def apply(self, config: VllmSpec) -> ApplyResult:
        with self._lock:
            unchanged = self._in_force(config)
            if unchanged:
                return unchanged
            others = self._other_replicas()
            if others:
                return self._apply_out_of_rotation(config, others)
            try:
                self.door.hold(self.lease_s())
            except FrontDoorError as exc:
                # Without the door a restart would fail every request in the gap: do not start one.
                status = ApplyStatus.FAILED if self.current is None else ApplyStatus.ROLLED_BACK
                return ApplyResult(status, f"not applied: the front door is unreachable ({exc})", self.current, 0.0)
            t0 = time.monotonic()
            drain_s: float | None = None
            try:
                try:
                    drain_s = float(self.door.drain(self.engine_url, self.drain_timeout_s)["drain_s"])
                except FrontDoorError as exc:  # the engine's own --shutdown-timeout still drains
                    log.error("drain-and-hold: drain through the front door failed (%s); restarting anyway", exc)
                result = self._replace(config)
            finally:
                state = self._release()
            impact = impact_from(self.strategy, state, drain_s, None)
            self.last_impact = impact
            log.info("drain-and-hold: %s in %.1f s; %s", result.status.value, time.monotonic() - t0, impact)
            return dataclasses.replace(result, impact=impact)

    def _other_replicas(self) -> list[str]:
        """The door's other upstreams in rotation (none, or the door unreachable: the hold path)."""
        try:
            upstreams = self.door.state().get("upstreams", [])
        except FrontDoorError:
            return []
        mine = self.engine_url
        return [u for u in upstreams if isinstance(u, str) and u.rstrip("/") != mine]

    def _apply_out_of_rotation(self, config: VllmSpec, others: list[str]) -> ApplyResult:
        try:
            self.door.remove_upstream(self.engine_url, new_period=True)
        except FrontDoorError as exc:
            status = ApplyStatus.FAILED if self.current is None else ApplyStatus.ROLLED_BACK
            return ApplyResult(
                status, f"not applied: could not take {self.engine_url} out of rotation ({exc})", self.current, 0.0
            )
        t0 = time.monotonic()
        drain_s: float | None = None
        try:
            drain_s = float(self.door.drain(self.engine_url, self.drain_timeout_s)["drain_s"])
        except FrontDoorError as exc:
            log.error("out of rotation: drain through the front door failed (%s); restarting anyway", exc)
        result = self._replace(config)
        serving = result.status in (ApplyStatus.APPLIED, ApplyStatus.ROLLED_BACK) and self.current is not None
        state: dict[str, Any] = {}
        note = ""
        if serving:
            try:
                state = self.door.add_upstream(self.engine_url)
            except FrontDoorError as exc:
                note = (
                    f" It could not be put back in rotation ({exc}): add it with the tap's control endpoint "
                    "(op add_upstream) once the tap answers."
                )
        else:
            note = f" {self.engine_url} stays out of rotation: {', '.join(others)} serve meanwhile."
            try:
                state = self.door.state()
            except FrontDoorError:
                state = {}
        impact = dataclasses.replace(impact_from("out_of_rotation", state, drain_s, None), requests_held=0)
        self.last_impact = impact
        log.info("out of rotation: %s in %.1f s; %s", result.status.value, time.monotonic() - t0, impact)
        return dataclasses.replace(result, message=result.message + note, impact=impact)

    def ensure_running(self) -> ApplyResult | None:
        """A dead engine is restarted with new arrivals held meanwhile, as for an apply."""
        with self._lock:
            if self.process is not None and self.process.alive():
                return None
            if self._other_replicas():
                return self._restart_out_of_rotation()
            try:
                self.door.hold(self.lease_s())
            except FrontDoorError as exc:
                log.error("drain-and-hold: front door unreachable (%s); restarting the engine without a hold", exc)
                return super().ensure_running()
            try:
                return super().ensure_running()
            finally:
                self._release()

    def _restart_out_of_rotation(self) -> ApplyResult | None:
        """A dead replica leaves the rotation (its requests would fail) until it answers again."""
        try:
            self.door.remove_upstream(self.engine_url)
        except FrontDoorError as exc:
            log.error("out of rotation: could not take the dead engine out of rotation (%s)", exc)
        result = super().ensure_running()
        if self.healthy():
            try:
                self.door.add_upstream(self.engine_url)
            except FrontDoorError as exc:
                log.error("out of rotation: could not put %s back in rotation (%s)", self.engine_url, exc)
        return result

    def _release(self) -> dict[str, Any]:
        try:
            return self.door.release([self.engine_url])
        except FrontDoorError as exc:
            # The hold's lease releases it anyway; held requests wait at most max_hold_s meanwhile.
            log.error("drain-and-hold: could not release the front door (%s); its lease will", exc)
            return {}

    def switching_cost_s(self, config: VllmSpec) -> float | None:
        """Held requests wait, they are not lost: the cost is the latency they gain, as seconds of
        serving — the longest hold times the share of the change's clients that were held (~1 at
        steady load), i.e. the last measured longest hold; before any, the last restart gap."""
        if self.last_impact is not None and self.last_impact.longest_hold_s is not None:
            return self.last_impact.longest_hold_s
        return self.last_downtime_s

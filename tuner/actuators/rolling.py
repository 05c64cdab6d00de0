"""Rolling apply across N engine replicas behind one front door, one replica at a time.

For each replica: take it out of the door's rotation (the others keep serving, nothing is held),
drain it, restart it with the new config (its own actuator, ready on ``/v1/models``), put it back
once a health check passes on a config meant for it, then ask ``verify`` (the controller's first
verification window for that replica). A replica that does not take the config, a regression or a
front door that fails stops the roll: the replicas already changed go back, the same way, to the
config they served before, and the rest are never touched.

Rotation rules: a replica is restarted only once the door has taken it out of rotation (a door that
cannot be driven leaves every replica serving as it is); it goes back in only when healthy and
serving the config it should (the target, or the one it served before); one that is down stays out
until the health job (``ensure_running``) restarts it. Only when no replica would be left in
rotation is a healthy one on another config kept in, so that clients are served. Every outcome is in
the result: ``ApplyResult.replicas`` (and its event data) has one :class:`ReplicaOutcome` per replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tuner.actuators.base import Actuator, ApplyImpact, ApplyResult, ApplyStatus, VllmSpec, config_fingerprint
from tuner.actuators.drain_hold import impact_from
from tuner.actuators.front_door import FrontDoorClient, FrontDoorError
from tuner.actuators.restart import RestartActuator

log = logging.getLogger(__name__)

Verifier = Callable[[int, VllmSpec], bool]  # (replica index, config) -> no regression


@dataclass(frozen=True)
class ReplicaOutcome:
    """What one apply left on one replica."""

    replica: int
    url: str
    # applied | unchanged | untouched | rolled_back | rollback_failed | not_rolled_back (the door failed first)
    outcome: str
    config: VllmSpec | None  # what it serves afterwards (None: it is down)
    healthy: bool
    in_rotation: bool
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
        self.rotation: set[int] = set()  # the replicas the door sends requests to, as last set

    # -- the door's rotation -----------------------------------------------------------------------
    def _set_rotation(self, indices: set[int]) -> None:
        """Point the door at these replicas (none: new arrivals wait in the door). Raises FrontDoorError."""
        self.door.set_upstreams([self.urls[i] for i in sorted(indices)])
        self.rotation = set(indices)

    def _serves(self, index: int, config: VllmSpec | None) -> bool:
        current = self.replicas[index].current
        return config is not None and current is not None and config_fingerprint(current) == config_fingerprint(config)

    def _readmit(self, index: int, *configs: VllmSpec | None) -> str:
        """Put replica ``index`` back into rotation if a health check passes and it serves one of
        ``configs``; returns "" or why the door did not take it back."""
        if not any(self._serves(index, c) for c in configs) or not self.replicas[index].healthy():
            log.warning("rolling apply: replica %d (%s) stays out of rotation: not healthy on a config meant for it",
                        index, self.urls[index])  # fmt: skip
            return ""
        try:
            self._set_rotation(self.rotation | {index})
        except FrontDoorError as exc:
            return str(exc)
        return ""

    def _restart(self, index: int, target: VllmSpec, fallback: VllmSpec | None) -> tuple[ApplyResult | None, str]:
        """Replica ``index`` out of rotation, drained, given ``target``, readmitted when healthy on
        ``target`` or ``fallback``. (None, why) when the door could not take it out: it is not touched,
        as the door may still send it requests. Else (its result, "" or why the door did not readmit it)."""
        try:
            self._set_rotation(self.rotation - {index})
        except FrontDoorError as exc:
            return None, str(exc)
        try:
            self.door.drain(self.urls[index], self.drain_timeout_s)
        except FrontDoorError as exc:  # it is out of rotation: its engine's --shutdown-timeout drains the rest
            log.error("rolling apply: draining replica %d through the door failed (%s); restarting it", index, exc)
        result = self.replicas[index].apply(target)
        return result, self._readmit(index, target, fallback)

    # -- the Actuator interface --------------------------------------------------------------------
    def start(self, config: VllmSpec) -> ApplyResult:
        results = [r.start(config) for r in self.replicas]
        up = {i for i, res in enumerate(results) if res.ok}
        self.current = dict(config) if len(up) == len(self.replicas) else None
        if up:  # a replica that did not start is never put in rotation
            try:
                self._set_rotation(up)
            except FrontDoorError as exc:
                log.error("rolling: could not point the front door at the replicas %s: %s", sorted(up), exc)
        bad = [res for res in results if not res.ok]
        return bad[0] if bad else results[0]

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def apply(self, config: VllmSpec) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged:
            return unchanged
        old = self.current
        t0 = time.monotonic()
        try:
            self.door.state(new_period=True)
        except FrontDoorError as exc:
            status = ApplyStatus.ROLLED_BACK if old is not None else ApplyStatus.FAILED
            return ApplyResult(status, f"not applied: the front door is unreachable ({exc})", old, 0.0)
        before = [r.current for r in self.replicas]  # what each replica goes back to
        outcomes = ["untouched"] * len(self.replicas)
        notes = [""] * len(self.replicas)
        changed: list[int] = []
        failure = ""
        for index in range(len(self.replicas)):
            if index in self.rotation and self._serves(index, config) and self.replicas[index].healthy():
                outcomes[index] = "unchanged"  # already there (a roll that stopped half-way)
                continue
            result, door_problem = self._restart(index, config, before[index])
            if result is None:
                failure = f"the front door failed before replica {index} left rotation ({door_problem})"
                break
            if not result.ok:
                outcomes[index] = "rolled_back" if self._serves(index, before[index]) else "rollback_failed"
                notes[index] = result.message
                failure = f"replica {index} did not take the config ({result.message})"
                break
            outcomes[index] = "unchanged" if result.status is ApplyStatus.UNCHANGED else "applied"
            if outcomes[index] == "applied":
                changed.append(index)
            if door_problem:
                failure = f"the front door did not put replica {index} back into rotation ({door_problem})"
                break
            if not self.verify(index, config):
                failure = f"replica {index} regressed in its first verification window"
                break
        settled = ""
        if failure:
            log.warning("rolling apply: %s; rolling back replicas %s", failure, changed)
            for index in changed:
                self._roll_back(index, before[index], outcomes, notes)
            settled = self._settle_rotation()
        impact = self._impact()
        replicas = tuple(self._outcome(i, outcomes[i], notes[i]) for i in range(len(self.replicas)))
        if not failure:
            self.current = dict(config)
            return ApplyResult(
                ApplyStatus.APPLIED,
                f"{len(self.replicas)} replica(s) changed one at a time in {time.monotonic() - t0:.1f} s",
                self.current, 0.0, impact=impact, replicas=tuple(r.as_dict() for r in replicas),
            )  # fmt: skip
        return self._failed(failure + (f"; {settled}" if settled else ""), old, replicas, impact)

    def _roll_back(self, index: int, config: VllmSpec | None, outcomes: list[str], notes: list[str]) -> None:
        if config is None:  # it served nothing known before: leave it on the new config
            notes[index] = "no earlier config to go back to"
            return
        result, door_problem = self._restart(index, config, config)
        if result is None:
            outcomes[index] = "not_rolled_back"
            notes[index] = f"the front door failed before it could leave rotation ({door_problem})"
            return
        outcomes[index] = "rolled_back" if result.ok and self._serves(index, config) else "rollback_failed"
        readmit = f"; the front door did not readmit it ({door_problem})" if door_problem else ""
        notes[index] = result.message + readmit

    def _settle_rotation(self) -> str:
        """After a failed roll: tell the door the rotation once more (a call that failed earlier may go
        through now); with nothing in rotation, keep the healthy replicas in. Returns a note or ""."""
        note = ""
        if not self.rotation:
            healthy = {i for i, r in enumerate(self.replicas) if r.healthy()}
            if healthy:
                note = f"no replica serves the intended config, so replica(s) {sorted(healthy)} stay in rotation"
            self.rotation = healthy
        try:
            self._set_rotation(self.rotation)
        except FrontDoorError as exc:
            note = (note + "; " if note else "") + f"the front door's rotation could not be confirmed ({exc})"
        return note

    def _impact(self) -> ApplyImpact:
        try:
            return impact_from(self.strategy, self.door.state(), None, None)
        except FrontDoorError:
            return ApplyImpact(self.strategy)  # not measured

    def _outcome(self, index: int, outcome: str, message: str) -> ReplicaOutcome:
        healthy = self.replicas[index].healthy()
        config = self.replicas[index].current if healthy else None
        return ReplicaOutcome(index, self.urls[index], outcome, config, healthy, index in self.rotation, message)

    def _failed(
        self,
        failure: str,
        old: VllmSpec | None,
        replicas: tuple[ReplicaOutcome, ...],
        impact: ApplyImpact,
    ) -> ApplyResult:
        data = tuple(r.as_dict() for r in replicas)
        untouched = sum(r.outcome == "untouched" for r in replicas)
        back = old is not None and all(r.healthy and r.in_rotation and self._serves(r.replica, old) for r in replicas)
        if back:
            self.current = old
            return ApplyResult(
                ApplyStatus.ROLLED_BACK,
                f"{failure}; every replica serves the old config again and is in rotation "
                f"({len(replicas) - untouched} back on it, {untouched} never changed)",
                old, 0.0, impact=impact, replicas=data,
            )  # fmt: skip
        self.current = None  # mixed or unknown: the next apply goes through every replica again
        problems = [self._problem(r) for r in replicas]
        rollback = "the rollback failed" if any(r.outcome == "rollback_failed" for r in replicas) else "not rolled back"
        what_to_do = "fix the cause, then apply a config again (replicas already on it are not restarted)"
        message = f"{failure}; {rollback}: " + "; ".join(p for p in problems if p) + f". To recover: {what_to_do}"
        return ApplyResult(ApplyStatus.FAILED, message, None, 0.0, impact=impact, replicas=data)

    def _problem(self, r: ReplicaOutcome) -> str:
        where = f"replica {r.replica} ({r.url})"
        log_path = self.replicas[r.replica].log_path
        if not r.healthy:
            return (
                f"{where} is down and out of rotation — check its engine log {log_path}; "
                "the health job restarts it with its last good config"
            )
        if r.outcome == "not_rolled_back":
            return f"{where} still serves the new config ({r.message}) — check the tap's control endpoint"
        if r.outcome == "rollback_failed":
            return f"{where} could not go back to the old config and serves another — check its engine log {log_path}"
        if not r.in_rotation:
            return f"{where} serves but is out of rotation"
        return ""

    def ensure_running(self) -> ApplyResult | None:
        """Health job: a dead replica is taken out of rotation and restarted with its last good config;
        a healthy replica out of rotation that serves the fleet's config (:meth:`_fleet_config`) goes back in."""
        notes: list[str] = []
        failed = False
        fleet = self._fleet_config()
        for index, replica in enumerate(self.replicas):
            if replica.process is None or not replica.process.alive():
                if index in self.rotation:
                    try:
                        self._set_rotation(self.rotation - {index})
                    except FrontDoorError as exc:
                        log.error("rolling: could not take dead replica %d out of rotation: %s", index, exc)
                result = replica.ensure_running()
                if result is not None:
                    notes.append(f"replica {index}: {result.message}")
                    failed = failed or not result.ok
            if index not in self.rotation and fleet is not None:
                problem = self._readmit(index, fleet)
                if index in self.rotation:
                    notes.append(f"replica {index} is back in rotation")
                elif problem:
                    notes.append(f"replica {index} could not be readmitted: {problem}")
        if not notes:
            return None
        status = ApplyStatus.FAILED if failed else ApplyStatus.APPLIED
        return ApplyResult(status, "; ".join(notes), self.current)

    def _fleet_config(self) -> VllmSpec | None:
        """The config in force, or (after a failed apply) the one every replica in rotation serves."""
        if self.current is not None:
            return self.current
        serving = {config_fingerprint(self.replicas[i].current): self.replicas[i].current for i in self.rotation}
        return next(iter(serving.values())) if len(serving) == 1 else None

    def switching_cost_s(self, config: VllmSpec) -> float | None:
        return 0.0  # the other replicas serve; a single replica's restart is what drain-and-hold would cost


__all__ = ["ReplicaOutcome", "RollingActuator", "Verifier"]

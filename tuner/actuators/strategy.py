"""Which restart strategy an apply uses (``[actuator] strategy``), and building it from the config."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from collectors.tap import parse_listen
from collectors.traffic_record import TrafficRecorder
from tuner.actuators.base import Actuator
from tuner.actuators.blue_green import BlueGreenActuator, with_port
from tuner.actuators.drain_hold import DrainHoldActuator
from tuner.actuators.fit import Fit, blue_green_fit, gpu_memory_utilization
from tuner.actuators.front_door import FrontDoorClient, FrontDoorError, InProcessTap, load_or_create_control_token
from tuner.actuators.restart import RestartActuator
from tuner.actuators.rolling import RollingActuator
from tuner.config import ActuatorSection, FrontDoorSection

log = logging.getLogger(__name__)


def choose_strategy(section: ActuatorSection) -> tuple[str, str]:
    """(strategy, reason) for a restart-managed engine; pure."""
    door = section.front_door
    if section.strategy != "auto":
        return section.strategy, f"configured: strategy = {section.strategy!r}"
    if door is None:
        return "restart", "auto without [actuator.front_door]: a plain restart (clients see the gap)"
    if door.blue_green_port is None:
        return "drain_hold", "auto: no blue_green_port for a second engine, so drain-and-hold"
    argv = section.restart.argv if section.restart is not None else []
    fit: Fit = blue_green_fit(door.device, gpu_memory_utilization(argv), spare_device=door.spare_gpu)
    return ("blue_green" if fit.fits else "drain_hold"), f"auto: {fit.reason}"


class _TapOwner:
    """Stops the in-process tap after the engine (the daemon's shutdown)."""

    owned_tap: InProcessTap | None = None

    def stop_tap(self) -> None:
        if self.owned_tap is not None:
            self.owned_tap.stop()
            self.owned_tap = None


class OwnedDrainHold(DrainHoldActuator, _TapOwner):
    def stop(self) -> None:
        super().stop()
        self.stop_tap()


class OwnedBlueGreen(BlueGreenActuator, _TapOwner):
    def stop(self) -> None:
        super().stop()
        self.stop_tap()


class OwnedRolling(RollingActuator, _TapOwner):
    def stop(self) -> None:
        super().stop()
        self.stop_tap()


def front_door_client(
    door: FrontDoorSection, resolve: Callable[[str], Path], traffic: TrafficRecorder | None = None
) -> tuple[FrontDoorClient, InProcessTap | None]:
    """The control client, starting the in-process tap when ``listen`` is set (recording ``traffic``
    when given: the ``[shadow]`` record)."""
    if door.listen is not None:
        host, port = parse_listen(door.listen)
        try:
            tap = InProcessTap(
                host, port, [door.engine_url], max_hold_s=door.max_hold_s, max_held=door.max_held_requests,
                read_timeout_s=door.read_timeout_s, traffic=traffic,
            )
        except OSError as exc:
            raise FrontDoorError(
                f"actuator.front_door.listen {door.listen}: cannot listen ({exc.strerror or exc}); is the port in use?"
            ) from None
        tap.start()
        return tap.client, tap
    assert door.control_url is not None and door.control_token_file is not None
    token = load_or_create_control_token(resolve(door.control_token_file))
    return FrontDoorClient(door.control_url, token), None


def build_restart_strategy(
    section: ActuatorSection,
    health_url: str,
    log_path: Path,
    env: Mapping[str, str],
    resolve: Callable[[str], Path],
    traffic: TrafficRecorder | None = None,
) -> Actuator:
    """The restart-kind actuator for ``[actuator] strategy`` (``section.restart`` must be set); an
    in-process front door records ``traffic`` when given."""
    restart = section.restart
    assert restart is not None
    strategy, reason = choose_strategy(section)
    log.info("restart strategy %s (%s)", strategy, reason)
    common = {
        "startup_timeout_s": restart.startup_timeout_s,
        "shutdown_timeout_s": restart.shutdown_timeout_s,
        "pass_shutdown_timeout": restart.pass_shutdown_timeout,
        "env": env,
    }
    door = section.front_door
    if strategy == "restart" or door is None:
        return RestartActuator(restart.argv, health_url, log_path, **common)  # type: ignore[arg-type]
    client, tap = front_door_client(door, resolve, traffic)
    actuator: OwnedDrainHold | OwnedBlueGreen | OwnedRolling
    if strategy == "rolling":
        # Each replica is the server command on its own port, a plain restart gated on /v1/models.
        replicas = [
            RestartActuator(
                with_port(restart.argv, port), f"http://127.0.0.1:{port}/v1/models",
                log_path.with_name(f"{log_path.stem}.{port}{log_path.suffix}"),
                **{**common, "env": {**env, **door.env_by_port.get(str(port), {})}},  # type: ignore[arg-type]
            )
            for port in door.replica_ports
        ]  # fmt: skip
        urls = [f"http://127.0.0.1:{port}" for port in door.replica_ports]
        actuator = OwnedRolling(replicas, urls, client, drain_timeout_s=door.drain_timeout_s)
    elif strategy == "blue_green":
        assert door.blue_green_port is not None
        actuator = OwnedBlueGreen(
            restart.argv, door.blue_green_port, log_path, client, warmup_requests=door.warmup_requests,
            drain_timeout_s=door.drain_timeout_s, env_by_port={int(p): e for p, e in door.env_by_port.items()},
            **common,  # type: ignore[arg-type]
        )
    else:
        actuator = OwnedDrainHold(
            restart.argv, door.engine_url, log_path, client, drain_timeout_s=door.drain_timeout_s,
            **common,  # type: ignore[arg-type]
        )
    actuator.owned_tap = tap
    return actuator

"""Blue/green: start the new config on a second local port while the old engine serves, warm it,
switch the front door's upstream atomically, then drain and stop the old engine. No request is held.

If the new engine does not come up (or fails its warm-up), it is stopped and the old one never
stopped serving: the result is a rollback that cost clients nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from tuner.actuators.base import START_FAILED, ApplyImpact, ApplyResult, ApplyStatus, VllmSpec
from tuner.actuators.drain_hold import impact_from
from tuner.actuators.front_door import FrontDoorClient, FrontDoorError
from tuner.actuators.restart import RestartActuator, argv_option
from tuner.engine.process import EngineProcess, EngineStartError

log = logging.getLogger(__name__)

WARMUP_PROMPT = "Hello"


def with_port(argv: Sequence[str], port: int) -> list[str]:
    """``argv`` with its ``--port`` value replaced (the server command line must name one)."""
    port_of(argv)  # it must name one
    return [
        f"--port={port}" if arg.startswith("--port=") else str(port) if i and argv[i - 1] == "--port" else arg
        for i, arg in enumerate(argv)
    ]


def port_of(argv: Sequence[str]) -> int:
    value = argv_option(argv, "--port")
    if value is None:
        raise ValueError("the server command line has no --port; blue/green needs it to start a second engine")
    return int(value)


def warm_up(base_url: str, requests: int, timeout_s: float = 120.0) -> float:
    """A few short greedy completions on a new engine before it takes traffic (first requests pay for
    lazy initialisation); returns seconds. Raises :class:`EngineStartError` if it cannot serve."""
    t0 = time.monotonic()
    try:
        models = httpx.get(f"{base_url}/v1/models", timeout=timeout_s).json()["data"]
        model = models[0]["id"]
        for _ in range(requests):
            response = httpx.post(
                f"{base_url}/v1/completions",
                json={"model": model, "prompt": WARMUP_PROMPT, "max_tokens": 4, "temperature": 0},
                timeout=timeout_s,
            )
            if response.status_code != 200:
                raise EngineStartError(f"warm-up request answered {response.status_code}: {response.text[:200]}")
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise EngineStartError(f"warm-up failed: {exc}") from exc
    return time.monotonic() - t0


class BlueGreenActuator(RestartActuator):
    """Alternates the engine between the argv's ``--port`` and ``alt_port`` behind the front door."""

    kind = "restart"
    strategy = "blue_green"
    needs_restart = False  # the old engine serves until the new one has taken over

    def __init__(
        self,
        argv: Sequence[str],
        alt_port: int,
        log_path: Path,
        door: FrontDoorClient,
        *,
        host: str = "127.0.0.1",
        warmup_requests: int = 3,
        drain_timeout_s: float = 30.0,
        startup_timeout_s: float = 600.0,
        shutdown_timeout_s: float = 30.0,
        pass_shutdown_timeout: bool = True,
        env: Mapping[str, str] | None = None,
        env_by_port: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        self.ports = (port_of(argv), alt_port)
        # Extra environment per port, e.g. disjoint CPU cores (VLLM_CPU_OMP_THREADS_BIND) so the new engine
        # does not start on a core the serving one keeps busy.
        self.env_by_port = {p: dict(e) for p, e in (env_by_port or {}).items()}
        if self.ports[0] == alt_port:
            raise ValueError(f"blue_green_port {alt_port} is the engine's own --port; pick another")
        self.host = host
        self.port = self.ports[0]
        super().__init__(
            argv, self.ready_url_for(self.port), log_path, startup_timeout_s=startup_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s, pass_shutdown_timeout=pass_shutdown_timeout, env=env,
        )
        self.door = door
        self.warmup_requests = warmup_requests
        self.drain_timeout_s = drain_timeout_s
        self.primary_log_path = log_path
        self.last_impact: ApplyImpact | None = None

    def url_for(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    def ready_url_for(self, port: int) -> str:
        return self.url_for(port) + "/v1/models"

    @property
    def engine_url(self) -> str:
        return self.url_for(self.port)

    @property
    def pid_path(self) -> Path:
        return self.primary_log_path.with_name(f"{self.primary_log_path.name}.{self.port}.pid")

    def _use_port(self, port: int) -> None:
        self.port = port
        self.health_url = self.ready_url_for(port)
        stem = self.primary_log_path
        self.log_path = stem if port == self.ports[0] else stem.with_name(f"{stem.stem}.{port}{stem.suffix}")

    def _server_env(self) -> dict[str, str]:
        return {**self.env, **self.env_by_port.get(self.port, {})}

    def _server_argv(self, config: VllmSpec | None) -> list[str]:
        return with_port(super()._server_argv(config), self.port)

    def start(self, config: VllmSpec) -> ApplyResult:
        with self._lock:
            other = self.ports[1] if self.port == self.ports[0] else self.ports[0]
            port = self.port
            self._use_port(other)
            self.reap_orphan()  # an engine a killed daemon left on the other port
            self._use_port(port)
            result = super().start(config)
            self._point_door()
            return result

    def _point_door(self) -> None:
        try:
            self.door.set_upstreams([self.engine_url])
        except FrontDoorError as exc:
            log.error("blue/green: could not point the front door at %s: %s", self.engine_url, exc)

    def ensure_running(self) -> ApplyResult | None:
        result = super().ensure_running()
        if result is not None:
            self._point_door()
        return result

    def apply(self, config: VllmSpec) -> ApplyResult:
        with self._lock:
            if not self.healthy():
                # Nothing serving: there is no old engine to keep; a plain start on this port.
                result = self._replace(config)
                self._point_door()
                return result
            unchanged = self._unchanged(config)
            if unchanged:
                return unchanged
            t0 = time.monotonic()
            old_process, old_port, old_log = self.process, self.port, self.log_path
            new_port = self.ports[1] if old_port == self.ports[0] else self.ports[0]
            try:
                self.door.state(new_period=True)
            except FrontDoorError as exc:
                return ApplyResult(
                    ApplyStatus.ROLLED_BACK, f"not applied: the front door is unreachable ({exc})", self.current, 0.0
                )
            self._use_port(new_port)
            try:
                self._launch(config)
                warmup_s = warm_up(self.engine_url, self.warmup_requests)
            except EngineStartError as exc:
                if self.process is not None:
                    self.process.stop()
                self.pid_path.unlink(missing_ok=True)
                self.process = old_process
                self._use_port(old_port)
                self.log_path = old_log
                log.warning("blue/green: the new config did not come up (%s); the old engine kept serving", exc)
                self.progress(f"{START_FAILED}: {exc}; the old engine kept serving")
                impact = ApplyImpact(self.strategy, 0, 0.0, 0, 0.0, time.monotonic() - t0)
                return ApplyResult(
                    ApplyStatus.ROLLED_BACK,
                    f"the new config did not come up ({exc}); the old engine never stopped serving",
                    self.current, 0.0, detail=exc.log_tail, impact=impact,
                )
            new_process = self.process
            self._switch_and_retire(old_port, old_process)
            self.process = new_process
            impact = impact_from(self.strategy, self._state(), None, warmup_s)
            self.current = self.last_good = dict(config)
            self.last_impact = impact
            self.last_downtime_s = 0.0
            total_s = time.monotonic() - t0
            log.info("blue/green: new config serving on port %d after %.1f s; %s", new_port, total_s, impact)
            return ApplyResult(
                ApplyStatus.APPLIED,
                f"new engine on port {new_port} took over after {total_s:.1f} s (warm-up {warmup_s:.1f} s); "
                "no request held",
                self.current, 0.0, impact=impact,
            )

    def _switch_and_retire(self, old_port: int, old_process: EngineProcess | None) -> None:
        try:
            self.door.set_upstreams([self.engine_url])
            self.door.drain(self.url_for(old_port), self.drain_timeout_s)
        except FrontDoorError as exc:
            log.error("blue/green: front door switch/drain failed (%s); stopping the old engine anyway", exc)
        if old_process is not None:
            old_process.stop()  # SIGTERM: vLLM finishes what it still has for --shutdown-timeout
        self.primary_log_path.with_name(f"{self.primary_log_path.name}.{old_port}.pid").unlink(missing_ok=True)

    def _state(self) -> dict[str, Any]:
        try:
            return dict(self.door.state())
        except FrontDoorError:
            return {}

    def switching_cost_s(self, config: VllmSpec) -> float | None:
        """~0: the old engine serves until the new one has taken over; only requests that failed during
        the last change (each a second of lost serving, a deliberately high price) count."""
        failed = self.last_impact.requests_failed if self.last_impact is not None else 0
        return float(failed or 0)


__all__ = ["BlueGreenActuator", "warm_up", "with_port"]

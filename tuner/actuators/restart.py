"""Apply a config by restarting the supervised vLLM server with a new ``--speculative-config``.

Order: drain and stop the running server (SIGTERM; vLLM finishes in-flight requests for
``--shutdown-timeout`` seconds), start it with the new config, wait for ``/health``. If the new one
does not come up in time, start the last good config again: the engine is never left down when a
config that worked before can still serve.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tuner.actuators.base import START_FAILED, Actuator, ApplyResult, ApplyStatus, VllmSpec, config_fingerprint
from tuner.engine.process import EngineProcess, EngineStartError, group_alive

log = logging.getLogger(__name__)


def server_argv(base_argv: Sequence[str], config: VllmSpec | None, shutdown_timeout_s: float | None) -> list[str]:
    """The server command line for ``config`` (``method = "off"`` or None: no speculation)."""
    argv = list(base_argv)
    if shutdown_timeout_s is not None:
        argv += ["--shutdown-timeout", f"{shutdown_timeout_s:g}"]
    if config is not None and config.get("method") not in (None, "off"):
        argv += ["--speculative-config", json.dumps(config, sort_keys=True)]
    return argv


def argv_option(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` (``--flag V`` or ``--flag=V``) on a command line, None when absent."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _reap_own_child(pid: int) -> None:
    """Reap ``pid`` if it is our own exited child (nothing happens for anyone else's)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _alive_reaping(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs. Zombies do not count: an orphaned engine's
    exited processes wait for whoever adopted them (PID 1 in a container may never reap them)."""
    _reap_own_child(pgid)
    if not group_alive(pgid):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    # Only zombies left. The leader may have exited after the first reap (a loaded CI run caught that
    # window): if it is our child, reap it now so that no zombie of ours outlives the stop.
    _reap_own_child(pgid)
    return False


class RestartActuator(Actuator):
    """Owns the engine process. Thread-safe: one apply/start/stop at a time."""

    kind = "restart"

    def __init__(
        self,
        argv: Sequence[str],
        health_url: str,
        log_path: Path,
        *,
        startup_timeout_s: float = 600.0,
        shutdown_timeout_s: float = 30.0,
        pass_shutdown_timeout: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if not argv:
            raise ValueError("the restart actuator needs the server command line (argv) but got an empty one")
        self.base_argv = list(argv)
        self.health_url = health_url
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.pass_shutdown_timeout = pass_shutdown_timeout
        self.env = dict(env or {})
        self.last_good: VllmSpec | None = None
        self.process: EngineProcess | None = None
        self.last_downtime_s: float | None = None  # the last apply's measured serving gap
        self._lock = threading.RLock()

    # -- process handling --------------------------------------------------------------------------
    @property
    def pid_path(self) -> Path:
        """Where the engine's process-group id is kept, so a daemon killed with SIGKILL can find and
        stop its orphaned engine on the next start instead of colliding with it on the port."""
        return self.log_path.with_name(self.log_path.name + ".pid")

    def reap_orphan(self) -> int | None:
        """Stop an engine left running by a previous daemon (from the pid file). Returns its pgid."""
        try:
            pgid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        if pgid <= 1 or pgid == os.getpgrp() or not group_alive(pgid):
            self.pid_path.unlink(missing_ok=True)
            return None
        log.warning("restart actuator: stopping the engine left by a previous daemon (pgid %s)", pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout_s + 10.0
        while _alive_reaping(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive_reaping(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            while _alive_reaping(pgid) and time.monotonic() < deadline + 5.0:
                time.sleep(0.1)
        self.pid_path.unlink(missing_ok=True)
        return pgid

    def _launch(self, config: VllmSpec | None) -> float:
        """Start the server with ``config`` and wait until healthy; returns seconds to healthy.
        Raises :class:`EngineStartError` (the failed process group is already stopped)."""
        self.process = EngineProcess(
            argv=self._server_argv(config),
            health_url=self.health_url,
            log_path=self.log_path,
            env=self._server_env(),
            startup_timeout_s=self.startup_timeout_s,
            stop_timeout_s=self.shutdown_timeout_s + 10.0,
        )
        self.process.start()
        self.pid_path.write_text(f"{self.process.pid}\n")
        try:
            return self.process.wait_healthy()
        except EngineStartError:
            self.process = None
            raise

    def _server_env(self) -> dict[str, str]:
        return self.env

    def _server_argv(self, config: VllmSpec | None) -> list[str]:
        return server_argv(self.base_argv, config, self.shutdown_timeout_s if self.pass_shutdown_timeout else None)

    def _stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
            self.pid_path.unlink(missing_ok=True)  # only ours: a previous daemon's is reaped, not forgotten

    def healthy(self) -> bool:
        proc = self.process
        return proc is not None and proc.alive() and proc.healthy()

    # -- the Actuator interface --------------------------------------------------------------------
    def start(self, config: VllmSpec) -> ApplyResult:
        """Start the engine with ``config`` (the daemon's first config, or the one recovered from the DB)."""
        with self._lock:
            if self.healthy() and config_fingerprint(config) == config_fingerprint(self.current):
                return ApplyResult(ApplyStatus.UNCHANGED, "the engine already runs this config", self.current, 0.0)
            self._stop()
            self.reap_orphan()
            try:
                waited_s = self._launch(config)
            except EngineStartError as exc:
                self.current = None
                return ApplyResult(ApplyStatus.FAILED, f"the engine did not start: {exc}", None, detail=exc.log_tail)
            self.current = self.last_good = dict(config)
            return ApplyResult(ApplyStatus.APPLIED, f"engine healthy after {waited_s:.1f} s", self.current, waited_s)

    def apply(self, config: VllmSpec) -> ApplyResult:
        with self._lock:
            return self._in_force(config) or self._replace(config)

    def _in_force(self, config: VllmSpec) -> ApplyResult | None:
        """UNCHANGED when the engine is up and already runs ``config`` (a dead one is restarted)."""
        return self._unchanged(config) if self.healthy() else None

    def switching_cost_s(self, config: VllmSpec) -> float | None:
        """A plain restart costs its serving gap: the last one measured (None before any: the
        controller then uses this week's median or ``restart_downtime_s``)."""
        return self.last_downtime_s

    def _replace(self, config: VllmSpec) -> ApplyResult:
        """Stop the engine, start it with ``config``; restore the last good config if that fails."""
        t0 = time.monotonic()
        self._stop()  # graceful: vLLM drains in-flight requests for --shutdown-timeout
        try:
            self._launch(config)
        except EngineStartError as exc:
            log.warning("restart actuator: new config failed to start (%s); restoring the last good one", exc)
            self.progress(f"{START_FAILED}: {exc}; restoring the last good config")
            result = self._restore(config, exc, t0)
            self.last_downtime_s = result.downtime_s
            return result
        downtime_s = self.last_downtime_s = time.monotonic() - t0
        self.current = self.last_good = dict(config)
        log.info("restart actuator: new config healthy after %.1f s of downtime", downtime_s)
        return ApplyResult(
            ApplyStatus.APPLIED,
            f"engine restarted with the new config in {downtime_s:.1f} s",
            self.current,
            downtime_s,
        )

    def _restore(self, failed: VllmSpec, error: EngineStartError, t0: float) -> ApplyResult:
        good = self.last_good
        if good is None:
            self.current = None
            return ApplyResult(
                ApplyStatus.FAILED,
                f"the new config did not come up ({error}) and there is no earlier good config to restore; "
                "the engine is down",
                None,
                detail=error.log_tail,
            )
        try:
            self._launch(good)
        except EngineStartError as exc2:
            self.current = None
            return ApplyResult(
                ApplyStatus.FAILED,
                f"the new config did not come up ({error}) and neither did the last good one ({exc2}); "
                "the engine is down — check the engine log",
                None,
                detail=exc2.log_tail,
            )
        self.current = dict(good)
        downtime_s = time.monotonic() - t0
        return ApplyResult(
            ApplyStatus.ROLLED_BACK,
            f"the new config did not come up ({error}); the last good config is serving again after {downtime_s:.1f} s",
            self.current,
            downtime_s,
            detail=error.log_tail,
        )

    def ensure_running(self) -> ApplyResult | None:
        """Restart the last good config if the engine process died (not if it is merely slow)."""
        with self._lock:
            if self.process is not None and self.process.alive():
                return None
            if self.last_good is None:
                return None
            log.warning("restart actuator: the engine is not running; starting the last good config")
            t0 = time.monotonic()
            try:
                self._launch(self.last_good)
            except EngineStartError as exc:
                self.current = None
                return ApplyResult(
                    ApplyStatus.FAILED, f"the engine died and did not restart: {exc}", None, detail=exc.log_tail
                )
            self.current = dict(self.last_good)
            return ApplyResult(
                ApplyStatus.APPLIED,
                "the engine had stopped; restarted with the last good config",
                self.current,
                time.monotonic() - t0,
            )

    def stop(self) -> None:
        with self._lock:
            self._stop()

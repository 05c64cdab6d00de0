"""Supervise one vLLM server process: start in its own process group, wait for ``/health``, stop cleanly.

The server runs in a new session so that a stop reaches the engine-core children too; a stop sends
SIGTERM (vLLM drains for ``--shutdown-timeout`` seconds), then SIGKILL to whatever is left in the group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine did not become healthy. ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FIRST_CHOSEN_PORT = 10000  # below it sit the well-known services a host is likely to run
_handed_out: deque[int] = deque(maxlen=64)
_pick = random.Random()


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports and ``bind(port=0)`` (Linux default
    when unreadable)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1", ephemeral: tuple[int, int] | None = None) -> int:
    """A port nothing is bound to, for a server we start a moment later.

    Chosen outside the ephemeral range: a port from ``bind(0)`` goes straight back to the pool that
    outgoing connections take their source ports from, and the health probes during a start open many,
    so the server that later binds it can fail with "address already in use" (a CI run lost a test so).
    Ports handed out recently are not repeated, since nothing holds them until their server binds."""
    low, high = ephemeral or ephemeral_port_range()
    candidates = [(_FIRST_CHOSEN_PORT, min(low, 65536)), (max(high + 1, _FIRST_CHOSEN_PORT), 65536)]
    spans = [(a, b) for a, b in candidates if b > a]
    for _ in range(200 if spans else 0):
        a, b = _pick.choices(spans, weights=[b - a for a, b in spans])[0]
        port = _pick.randrange(a, b)
        if port not in _handed_out and port_is_free(port, host):
            _handed_out.append(port)
            return port
    # The ephemeral range covers every port we would choose from, or all of them are taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class EngineProcess:
    """One engine server command line, supervised."""

    argv: Sequence[str]
    health_url: str
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    last_pid: int | None = field(default=None, init=False)  # kept after stop, to check nothing is left

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.alive():
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                list(self.argv),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            logf.close()
        self.last_pid = self._proc.pid
        log.info("engine started pid=%s: %s", self._proc.pid, " ".join(self.argv))

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return httpx.get(self.health_url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self) -> float:
        """Block until ``/health`` answers 200; returns seconds waited. On death or timeout the
        process group is stopped (nothing left running) and :class:`EngineStartError` raised."""
        t0 = time.monotonic()
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                self.stop()
                raise EngineStartError(
                    f"engine exited with code {code} while starting (log: {self.log_path})",
                    tail(self.log_path),
                )
            if self.healthy():
                return time.monotonic() - t0
            if time.monotonic() - t0 > self.startup_timeout_s:
                self.stop()
                raise EngineStartError(
                    f"engine not healthy after {self.startup_timeout_s:.0f}s (log: {self.log_path})",
                    tail(self.log_path),
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the whole process group, wait, then SIGKILL what is left. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine pid=%s ignored SIGTERM for %.0fs; killing", pgid, self.stop_timeout_s)
        # Children (engine core, workers) may outlive the leader briefly; make sure none remain.
        deadline = time.monotonic() + 5.0
        while group_alive(pgid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                break
            time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        self._proc = None


def group_alive(pgid: int) -> bool:
    """True while any process of the group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

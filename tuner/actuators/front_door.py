"""The actuators' side of the front door: a client for the tap's control endpoint, and a tap run
inside the sidecar's own process (``[actuator.front_door] listen``) when it does not run apart.

Both speak HTTP to ``POST /_spectuner/control`` on 127.0.0.1 with a bearer token, so the in-process
and the separate tap are driven the same way.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from collectors.front_door import CONTROL_PATH, FrontDoor
from collectors.tap import TapProxy, bind_listen, create_tap_app
from collectors.traffic_record import TrafficRecorder
from tuner.actuators.live import load_or_create_secret


class FrontDoorError(RuntimeError):
    """The tap's control endpoint did not do what was asked (unreachable, refused, bad answer)."""


def load_or_create_control_token(path: Path) -> str:
    """The control token in ``path``; a new random one written 0600 when the file does not exist.
    An empty file is an error: an empty token would let any local process drive the door."""
    return load_or_create_secret(path, "control token file", "delete it (a new one is made) or put a secret in it")


class FrontDoorClient:
    """Drives a tap's front door (thread-safe; each call is one HTTP request)."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        try:
            response = httpx.post(
                self.url + CONTROL_PATH,
                json=body,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=timeout_s or self.timeout_s,
            )
        except httpx.HTTPError as exc:
            raise FrontDoorError(f"front door {self.url} unreachable: {exc}") from exc
        if response.status_code != 200:
            raise FrontDoorError(f"front door {self.url} answered {response.status_code}: {response.text[:200]}")
        answer: dict[str, Any] = response.json()
        return answer

    def hold(self, lease_s: float, *, new_period: bool = True) -> dict[str, Any]:
        return self._call({"op": "hold", "lease_s": lease_s, "new_period": new_period})

    def release(self, upstreams: list[str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"op": "release"}
        if upstreams is not None:
            body["upstreams"] = upstreams
        return self._call(body)

    def set_upstreams(self, upstreams: list[str], *, new_period: bool = False) -> dict[str, Any]:
        return self._call({"op": "set_upstreams", "upstreams": upstreams, "new_period": new_period})

    def remove_upstream(self, upstream: str, *, new_period: bool = False) -> dict[str, Any]:
        return self._call({"op": "remove_upstream", "upstream": upstream, "new_period": new_period})

    def add_upstream(self, upstream: str) -> dict[str, Any]:
        return self._call({"op": "add_upstream", "upstream": upstream})

    def drain(self, upstream: str, timeout_s: float) -> dict[str, Any]:
        return self._call({"op": "drain", "upstream": upstream, "timeout_s": timeout_s}, timeout_s + self.timeout_s)

    def state(self, *, new_period: bool = False) -> dict[str, Any]:
        return self._call({"op": "state", "new_period": new_period})


class _ThreadServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the sidecar's main thread owns the signals
        pass


class InProcessTap:
    """A tap serving on ``host:port`` from a thread of this process: no per-request records (the
    collector reads the engine's counters), the sampled traffic record when ``traffic`` is given."""

    def __init__(
        self,
        host: str,
        port: int,
        upstreams: list[str],
        *,
        max_hold_s: float,
        max_held: int,
        read_timeout_s: float | None,
        token: str | None = None,
        traffic: TrafficRecorder | None = None,
    ) -> None:
        self.token = token or secrets.token_urlsafe(32)
        self.sock = bind_listen(host, port)
        bound_host, bound_port = self.sock.getsockname()[:2]
        self.url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
        door = FrontDoor(upstreams, max_hold_s=max_hold_s, max_held=max_held)
        self.proxy = TapProxy(
            upstreams, None, read_timeout_s=read_timeout_s, door=door, control_token=self.token, traffic=traffic
        )
        config = uvicorn.Config(
            create_tap_app(self.proxy), log_level="warning", access_log=False, lifespan="on",
            server_header=False, date_header=False, proxy_headers=False,
        )
        self.server = _ThreadServer(config)
        self.client = FrontDoorClient(self.url, self.token)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), name="spectuner-tap", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise FrontDoorError(f"the in-process tap did not start on {self.url}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sock.close()

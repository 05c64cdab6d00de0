"""Steady client load across an engine change: streaming and non-streaming greedy completions,
each kept with its timing, status, generated text and whether its stream ended properly.

Used by the live apply test and ``bench/bench_apply.py`` to check that a change failed nothing, cut no
stream and changed no answer (greedy text against an unproxied run), and to time the requests that
overlapped the change.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tuner.actuators.blue_green import BlueGreenActuator
from tuner.actuators.drain_hold import DrainHoldActuator
from tuner.actuators.front_door import InProcessTap
from tuner.actuators.restart import RestartActuator
from tuner.actuators.rolling import RollingActuator, Verifier
from tuner.engine.process import free_port
from tuner.lab.serve import LabServer

RETRY_PAUSE_S = 1.0


def side_by_side_cpu_env(ports: tuple[int, int]) -> dict[int, dict[str, str]]:
    """vLLM's CPU backend pins each engine's worker to a core ("auto": the first one): a second engine
    beside a serving one would share its pinned, busy core and take minutes to start. Blue/green on
    the lab pins the engine on each port to its own core instead (unpinned engines run far slower)."""
    cores = max(1, os.cpu_count() or 1)
    return {port: {"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)} for i, port in enumerate(ports)}


def replica_cpu_prefix(index: int) -> tuple[str, ...]:
    """``taskset -c CORE`` for replica ``index``: every process of a replica on its own core (its API
    server and engine core too, not only the worker vLLM pins), so a replica restarting beside a
    serving one is not starved by it. Empty where ``taskset`` is missing."""
    if shutil.which("taskset") is None:
        return ()
    return ("taskset", "-c", str(index % max(1, os.cpu_count() or 1)))


@dataclass(frozen=True)
class Outcome:
    prompt: str
    stream: bool
    status: int  # 0: no HTTP answer (connection refused or reset)
    text: str  # the generated text (streams: the chunks' text joined)
    complete: bool  # non-streaming: a 200 JSON body; streaming: ended with data: [DONE]
    started_s: float
    ended_s: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.complete

    @property
    def latency_s(self) -> float:
        return self.ended_s - self.started_s


def complete(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, stream: bool) -> Outcome:
    """One greedy completion; never raises for a failed request (that is an outcome)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    t0 = time.monotonic()
    try:
        if not stream:
            r = client.post(f"{url}/v1/completions", json=body)
            text, done = "", False
            if r.status_code == 200:
                text, done = r.json()["choices"][0]["text"], True
            return Outcome(prompt, False, r.status_code, text, done, t0, time.monotonic(), "" if done else r.text[:200])
        parts: list[str] = []
        done = False
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                for choice in json.loads(data).get("choices", []):
                    parts.append(choice.get("text", ""))
            if status != 200:
                r.read()
        return Outcome(prompt, True, status, "".join(parts), done, t0, time.monotonic())
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Outcome(prompt, stream, 0, "", False, t0, time.monotonic(), f"{type(exc).__name__}: {exc}")


class SteadyLoad:
    """``concurrency`` clients (even-numbered ones stream), cycling through ``prompts``, each pausing
    ``pause_s`` between its requests (0: back to back)."""

    def __init__(
        self,
        url: str,
        model: str,
        prompts: Sequence[str],
        *,
        concurrency: int = 4,
        max_tokens: int = 24,
        pause_s: float = 0.0,
    ) -> None:
        self.url, self.model, self.prompts, self.max_tokens = url, model, list(prompts), max_tokens
        self.pause_s = pause_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True, name=f"load-{i}") for i in range(concurrency)
        ]

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=600) as client:
            n = index
            while not self._stop.is_set():
                prompt = self.prompts[n % len(self.prompts)]
                outcome = complete(client, self.url, self.model, prompt, self.max_tokens, stream=index % 2 == 0)
                with self._lock:
                    self.outcomes.append(outcome)
                n += 1
                if not outcome.ok:
                    # A client retrying at once would count one outage as thousands of failures.
                    self._stop.wait(RETRY_PAUSE_S)
                elif self.pause_s > 0:
                    self._stop.wait(self.pause_s)

    def start(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(600)
        return list(self.outcomes)


def reference_texts(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy text, asked of ``url`` directly (no tap), one at a time."""
    with httpx.Client(timeout=600) as client:
        out = {}
        for p in dict.fromkeys(prompts):
            o = complete(client, url, model, p, max_tokens, stream=False)
            if not o.ok:
                raise RuntimeError(f"reference request failed: {o.status} {o.error}")
            out[p] = o.text
        return out


def lab_strategy_actuator(strategy: str, models_dir: Path, workdir: Path) -> tuple[RestartActuator, InProcessTap]:
    """A restart-kind actuator of ``strategy`` (restart, drain_hold, blue_green) for a lab engine, with
    an in-process tap in front (for ``restart`` the tap only forwards, as a plain reverse proxy would).
    Nothing is started but the tap; ``actuator.start(config)`` starts the engine."""
    port = free_port()
    bare = LabServer(draft="none", k=0, port=port, models_dir=models_dir, workdir=workdir)
    bare.tmp_dir.mkdir(parents=True, exist_ok=True)
    tap = InProcessTap("127.0.0.1", 0, [bare.base_url], max_hold_s=300.0, max_held=100, read_timeout_s=300.0)
    tap.start()
    argv, log_path = bare.argv(), bare.log_path
    timing: dict[str, Any] = {
        "startup_timeout_s": 600.0,
        "shutdown_timeout_s": 10.0,
        "pass_shutdown_timeout": False,
        "env": bare.env(),
    }
    actuator: RestartActuator
    if strategy == "blue_green":
        alt = free_port()
        actuator = BlueGreenActuator(
            argv,
            alt,
            log_path,
            tap.client,
            drain_timeout_s=60.0,
            env_by_port=side_by_side_cpu_env((port, alt)),
            **timing,
        )
    elif strategy == "drain_hold":
        actuator = DrainHoldActuator(argv, bare.base_url, log_path, tap.client, drain_timeout_s=60.0, **timing)
    else:
        actuator = RestartActuator(argv, f"{bare.base_url}/health", log_path, **timing)
    return actuator, tap


def lab_rolling_actuator(
    models_dir: Path, workdir: Path, *, verify: Verifier | None = None, drain_timeout_s: float = 60.0
) -> tuple[RollingActuator, InProcessTap]:
    """Rolling apply over two lab engine replicas behind one in-process tap, each replica a plain
    restart actuator gated on ``/v1/models`` with all its processes on its own core (two engines on
    one core start in minutes; a restart beside a serving replica on a loaded machine took > 600 s).
    Nothing is started but the tap; ``actuator.start(config)`` starts both."""
    ports = (free_port(), free_port())
    while ports[1] == ports[0]:
        ports = (ports[0], free_port())
    pins = side_by_side_cpu_env(ports)
    servers = [
        LabServer(draft="none", k=0, port=port, models_dir=models_dir, workdir=workdir / f"replica-{i}")
        for i, port in enumerate(ports)
    ]
    replicas: list[RestartActuator] = []
    for i, server in enumerate(servers):
        server.tmp_dir.mkdir(parents=True, exist_ok=True)
        assert server.port is not None
        replicas.append(
            RestartActuator(
                [*replica_cpu_prefix(i), *server.argv()],
                f"{server.base_url}/v1/models",
                server.log_path,
                startup_timeout_s=600.0,
                shutdown_timeout_s=10.0,
                pass_shutdown_timeout=False,
                env={**server.env(), **pins[server.port]},
            )
        )
    urls = [s.base_url for s in servers]
    tap = InProcessTap("127.0.0.1", 0, urls[:1], max_hold_s=300.0, max_held=100, read_timeout_s=300.0)
    tap.start()
    return RollingActuator(replicas, urls, tap.client, verify=verify, drain_timeout_s=drain_timeout_s), tap


def engine_url_of(actuator: RestartActuator) -> str:
    """Where the actuator's engine serves now (blue/green moves between two ports)."""
    url = getattr(actuator, "engine_url", None)
    if isinstance(url, str):
        return url
    return actuator.health_url.rsplit("/", 1)[0]


__all__ = [
    "Outcome",
    "SteadyLoad",
    "complete",
    "engine_url_of",
    "lab_rolling_actuator",
    "lab_strategy_actuator",
    "reference_texts",
    "replica_cpu_prefix",
]

"""Drain-and-hold and blue/green against real server processes (tests/integration/fake_engine.py)
behind a real in-process tap, with clients sending requests all through each change."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.integration.engine_fixtures import fake_engine_argv
from tuner.actuators import ApplyStatus
from tuner.actuators.blue_green import BlueGreenActuator
from tuner.actuators.drain_hold import DrainHoldActuator
from tuner.actuators.front_door import FrontDoorClient, FrontDoorError, InProcessTap
from tuner.actuators.restart import RestartActuator
from tuner.actuators.rolling import RollingActuator
from tuner.engine.process import free_port

K3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
K5 = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5}
BROKEN = {"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 3}


def served(port: int) -> dict | None:
    return httpx.get(f"http://127.0.0.1:{port}/info", timeout=5).json()["speculative_config"]


class Load:
    """Clients sending completions through the tap back to back until stopped; every status kept."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url = url
        self.statuses: list[int] = []
        self.texts: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                r = client.post(f"{self.url}/v1/completions", json={"model": "m", "max_tokens": 3, "delay_s": 0.1})
                self.statuses.append(r.status_code)
                self.texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@pytest.fixture
def tap_for() -> Iterator[object]:
    taps: list[InProcessTap] = []

    def make(upstream: str) -> InProcessTap:
        tap = InProcessTap("127.0.0.1", 0, [upstream], max_hold_s=60.0, max_held=100, read_timeout_s=60.0)
        tap.start()
        taps.append(tap)
        return tap

    yield make
    for tap in taps:
        tap.stop()


def start_drain_hold(tmp_path: Path, tap_for, *engine_args: str) -> tuple[DrainHoldActuator, InProcessTap, int]:
    port = free_port()
    tap = tap_for(f"http://127.0.0.1:{port}")
    act = DrainHoldActuator(
        fake_engine_argv(port, *engine_args), f"http://127.0.0.1:{port}", tmp_path / "engine.log", tap.client,
        drain_timeout_s=10, startup_timeout_s=30, shutdown_timeout_s=2,
    )
    assert act.start(K3).status is ApplyStatus.APPLIED
    return act, tap, port


@pytest.fixture
def drain_hold(tmp_path: Path, tap_for) -> Iterator[tuple[DrainHoldActuator, InProcessTap, int]]:
    act, tap, port = start_drain_hold(tmp_path, tap_for)
    try:
        yield act, tap, port
    finally:
        act.stop()


@pytest.fixture
def blue_green(tmp_path: Path, tap_for) -> Iterator[tuple[BlueGreenActuator, InProcessTap]]:
    port, alt = free_port(), free_port()
    tap = tap_for(f"http://127.0.0.1:{port}")
    act = BlueGreenActuator(
        fake_engine_argv(port),
        alt,
        tmp_path / "engine.log",
        tap.client,
        warmup_requests=2,
        drain_timeout_s=10,
        startup_timeout_s=30,
        shutdown_timeout_s=2,
    )
    assert act.start(K3).status is ApplyStatus.APPLIED
    try:
        yield act, tap
    finally:
        act.stop()


def test_drain_and_hold_changes_the_engine_without_failing_a_request(
    drain_hold: tuple[DrainHoldActuator, InProcessTap, int],
) -> None:
    act, tap, port = drain_hold
    with Load(tap.url) as load:
        result = act.apply(K5)
    assert result.status is ApplyStatus.APPLIED, result.message
    assert served(port) == K5
    assert load.statuses and set(load.statuses) == {200}
    assert set(load.texts) == {"t0 t1 t2"}
    impact = result.impact
    assert impact is not None and impact.strategy == "drain_hold"
    assert impact.requests_held is not None and impact.requests_held >= 1  # arrivals during the restart waited
    assert impact.requests_failed == 0 and impact.longest_hold_s is not None and impact.longest_hold_s > 0
    data = result.event_data()
    assert data["strategy"] == "drain_hold" and data["requests_held"] == impact.requests_held
    assert act.switching_cost_s(K3) == impact.longest_hold_s


def test_drain_and_hold_sends_held_requests_to_the_restored_engine_when_the_new_config_fails(
    drain_hold: tuple[DrainHoldActuator, InProcessTap, int],
) -> None:
    act, tap, port = drain_hold
    with Load(tap.url) as load:
        result = act.apply(BROKEN)
    assert result.status is ApplyStatus.ROLLED_BACK, result.message
    assert served(port) == K3
    assert set(load.statuses) == {200}
    assert result.impact is not None and result.impact.requests_failed == 0
    assert result.impact.requests_held is not None and result.impact.requests_held >= 1


def test_blue_green_switches_with_nothing_held_and_nothing_failed(
    blue_green: tuple[BlueGreenActuator, InProcessTap],
) -> None:
    act, tap = blue_green
    old_port = act.port
    with Load(tap.url) as load:
        result = act.apply(K5)
    assert result.status is ApplyStatus.APPLIED, result.message
    assert act.port != old_port and served(act.port) == K5
    with pytest.raises(httpx.HTTPError):
        served(old_port)  # the old engine is stopped
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{act.port}"]
    assert set(load.statuses) == {200}
    impact = result.impact
    assert impact is not None and impact.strategy == "blue_green"
    assert impact.requests_held == 0 and impact.requests_failed == 0
    assert impact.warmup_s is not None and impact.warmup_s > 0
    assert act.switching_cost_s(K3) == 0.0
    assert act.apply(K3).status is ApplyStatus.APPLIED and act.port == old_port  # and back again


def test_blue_green_failure_leaves_the_old_engine_serving(blue_green: tuple[BlueGreenActuator, InProcessTap]) -> None:
    act, tap = blue_green
    port = act.port
    with Load(tap.url) as load:
        result = act.apply(BROKEN)
    assert result.status is ApplyStatus.ROLLED_BACK and result.downtime_s == 0.0
    assert act.port == port and served(port) == K3 and act.current == K3
    assert set(load.statuses) == {200}


@pytest.fixture
def rolling(tmp_path: Path, tap_for) -> Iterator[tuple[RollingActuator, InProcessTap, list[int]]]:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    tap = tap_for(urls[0])
    replicas = [
        RestartActuator(
            fake_engine_argv(p),
            f"{u}/v1/models",
            tmp_path / f"engine-{p}.log",
            startup_timeout_s=30,
            shutdown_timeout_s=2,
        )
        for p, u in zip(ports, urls, strict=True)
    ]
    act = RollingActuator(replicas, urls, tap.client, drain_timeout_s=10)
    assert act.start(K3).ok
    try:
        yield act, tap, ports
    finally:
        act.stop()


def test_rolling_apply_changes_one_replica_at_a_time_without_holding(
    rolling: tuple[RollingActuator, InProcessTap, list[int]],
) -> None:
    act, tap, ports = rolling
    with Load(tap.url) as load:
        result = act.apply(K5)
    assert result.status is ApplyStatus.APPLIED, result.message
    assert [served(p) for p in ports] == [K5, K5]
    assert set(load.statuses) == {200}
    assert result.impact is not None and result.impact.requests_held == 0 and result.impact.requests_failed == 0
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{p}" for p in ports]


def test_rolling_apply_stops_and_rolls_back_on_a_regression(
    rolling: tuple[RollingActuator, InProcessTap, list[int]],
) -> None:
    act, tap, ports = rolling
    seen: list[int] = []

    def verify(index: int, config: dict) -> bool:
        seen.append(index)
        return False  # the first replica regresses

    act.verify = verify
    with Load(tap.url) as load:
        result = act.apply(K5)
    assert result.status is ApplyStatus.ROLLED_BACK and "1 never changed" in result.message
    assert seen == [0]
    assert [served(p) for p in ports] == [K3, K3] and act.current == K3
    assert set(load.statuses) == {200}


def break_starts(replica: RestartActuator) -> None:
    """From now on the replica's server command exits at once (an unknown flag), whatever the config:
    neither the new config nor the old one can come up on it."""
    replica.base_argv.append("--no-such-flag")


def replica_outcomes(result) -> dict[int, dict]:
    return {r["replica"]: r for r in result.event_data()["replicas"]}


def test_rolling_readmits_a_replica_restored_to_the_old_config_once_healthy(
    rolling: tuple[RollingActuator, InProcessTap, list[int]],
) -> None:
    act, tap, ports = rolling
    with Load(tap.url) as load:
        result = act.apply(BROKEN)  # replica 0 does not take it and restores K3 itself
    assert result.status is ApplyStatus.ROLLED_BACK, result.message
    assert [served(p) for p in ports] == [K3, K3] and act.current == K3
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{p}" for p in ports]
    assert set(load.statuses) == {200}
    outcomes = replica_outcomes(result)
    assert outcomes[0]["outcome"] == "rolled_back" and outcomes[0]["in_rotation"] and outcomes[0]["healthy"]
    assert outcomes[1]["outcome"] == "untouched" and outcomes[1]["config"] == K3


def test_rolling_keeps_a_replica_that_did_not_come_back_out_of_rotation(
    rolling: tuple[RollingActuator, InProcessTap, list[int]],
) -> None:
    act, tap, ports = rolling
    break_starts(act.replicas[1])
    with Load(tap.url) as load:
        result = act.apply(K5)
    assert result.status is ApplyStatus.FAILED, result.message
    assert "replica 1" in result.message and "out of rotation" in result.message
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{ports[0]}"]  # never the dead one
    assert served(ports[0]) == K3  # replica 0 went back to the old config
    assert load.statuses and set(load.statuses) == {200}
    outcomes = replica_outcomes(result)
    assert not outcomes[1]["healthy"] and not outcomes[1]["in_rotation"] and outcomes[1]["config"] is None
    assert outcomes[0]["outcome"] == "rolled_back" and outcomes[0]["in_rotation"]
    # Once it can start again, the health job restarts it with its last good config and readmits it.
    act.replicas[1].base_argv.remove("--no-such-flag")
    restarted = act.ensure_running()
    assert restarted is not None and restarted.ok and "replica 1 is back in rotation" in restarted.message
    assert served(ports[1]) == K3
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{p}" for p in ports]
    assert act.ensure_running() is None  # nothing left to do


def test_rolling_reports_a_rollback_that_failed(rolling: tuple[RollingActuator, InProcessTap, list[int]]) -> None:
    act, tap, ports = rolling

    def verify(index: int, config: dict) -> bool:
        break_starts(act.replicas[index])  # the regressed replica cannot be restarted with anything
        return False

    act.verify = verify
    with Load(tap.url) as load:
        result = act.apply(K5)
    assert result.status is ApplyStatus.FAILED and result.config is None, result.message
    assert "replica 0" in result.message and "rollback" in result.message and "engine log" in result.message
    assert act.current is None
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{ports[1]}"]
    assert served(ports[1]) == K3
    assert load.statuses and set(load.statuses) == {200}
    outcomes = replica_outcomes(result)
    assert outcomes[0]["outcome"] == "rollback_failed" and not outcomes[0]["in_rotation"]
    assert outcomes[1]["outcome"] == "untouched" and outcomes[1]["in_rotation"] and outcomes[1]["config"] == K3


class FailingDoor(FrontDoorClient):
    """The tap's control client whose ``op`` fails on the calls numbered in ``fail_on`` (1-based), as
    a door that did not answer would."""

    def __init__(self, door: FrontDoorClient, op: str, fail_on: set[int]) -> None:
        super().__init__(door.url, door.token)
        self.op, self.fail_on, self.calls = op, fail_on, 0

    def _call(self, body: dict, timeout_s: float | None = None) -> dict:
        if body["op"] == self.op:
            self.calls += 1
            if self.calls in self.fail_on:
                raise FrontDoorError(f"front door {self.url} unreachable: injected {self.op} failure")
        return super()._call(body, timeout_s)


def test_rolling_rolls_back_when_the_door_fails_to_readmit_a_replica(
    rolling: tuple[RollingActuator, InProcessTap, list[int]],
) -> None:
    act, tap, ports = rolling
    # set_upstreams call 1 takes replica 0 out, call 2 would put it back in: that one fails.
    act.door = FailingDoor(tap.client, "set_upstreams", {2})
    with Load(tap.url) as load:
        result = act.apply(K5)
    assert result.status is ApplyStatus.ROLLED_BACK, result.message
    assert "front door" in result.message and "replica 0" in result.message
    assert [served(p) for p in ports] == [K3, K3] and act.current == K3
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{p}" for p in ports]
    assert set(load.statuses) == {200}


def test_rolling_never_raises_when_the_door_goes_away(rolling: tuple[RollingActuator, InProcessTap, list[int]]) -> None:
    act, tap, ports = rolling

    def verify(index: int, config: dict) -> bool:
        tap.stop()  # the tap is gone after replica 0 changed: every control call fails from here on
        return True

    act.verify = verify
    result = act.apply(K5)  # must not raise
    assert result.status is ApplyStatus.FAILED and result.config is None, result.message
    assert "front door" in result.message and "replica 1" in result.message
    # No replica is restarted while the door may still send it requests: both keep serving.
    assert [served(p) for p in ports] == [K5, K3]
    assert all(r.healthy() for r in act.replicas)
    outcomes = replica_outcomes(result)
    assert outcomes[0]["config"] == K5 and outcomes[1]["outcome"] == "untouched"


def test_rolling_restarts_a_replica_out_of_rotation_when_its_drain_call_fails(
    rolling: tuple[RollingActuator, InProcessTap, list[int]],
) -> None:
    act, tap, ports = rolling
    act.door = FailingDoor(tap.client, "drain", set(range(1, 100)))
    result = act.apply(K5)  # the engine's own --shutdown-timeout drains instead
    assert result.status is ApplyStatus.APPLIED, result.message
    assert [served(p) for p in ports] == [K5, K5]
    assert tap.client.state()["upstreams"] == [f"http://127.0.0.1:{p}" for p in ports]


def test_drain_and_hold_restarts_a_dead_engine_with_arrivals_held(tmp_path: Path, tap_for) -> None:
    # Each start takes a second or more, so the restart below is still under way when the request comes.
    act, tap, port = start_drain_hold(tmp_path, tap_for, "--startup-delay-s", "1")
    try:
        assert act.process is not None and act.process.pid is not None
        os.killpg(act.process.pid, signal.SIGKILL)
        act.process.stop()  # reaps it; the health job finds it dead
        with ThreadPoolExecutor(1) as pool:
            restarted = pool.submit(act.ensure_running)
            deadline = time.monotonic() + 30
            while not tap.client.state()["holding"]:
                assert time.monotonic() < deadline and not restarted.done()
                time.sleep(0.01)
            response = httpx.post(f"{tap.url}/v1/completions", json={"model": "m", "max_tokens": 2}, timeout=60)
            result = restarted.result(timeout=60)
        assert result is not None and result.status is ApplyStatus.APPLIED
        assert response.status_code == 200 and served(port) == K3
        assert tap.client.state()["period"]["held"] == 1
    finally:
        act.stop()

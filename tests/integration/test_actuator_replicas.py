"""One sidecar per replica behind a shared router: a drain-and-hold actuator whose door also sends to
other replicas takes its own engine out of rotation instead of holding everyone (real fake-engine
processes behind a real in-process tap with two upstreams, clients sending all through)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.engine_fixtures import fake_engine_argv
from tests.integration.test_actuator_strategies import BROKEN, K3, K5, Load, served
from tuner.actuators import ApplyStatus
from tuner.actuators.drain_hold import DrainHoldActuator
from tuner.actuators.front_door import FrontDoorError, InProcessTap
from tuner.engine.process import free_port

Pair = tuple[DrainHoldActuator, DrainHoldActuator, InProcessTap]


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Pair]:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    tap = InProcessTap("127.0.0.1", 0, urls, max_hold_s=60.0, max_held=100, read_timeout_s=60.0)
    tap.start()
    acts = [
        DrainHoldActuator(
            fake_engine_argv(port),
            url,
            tmp_path / f"engine{port}.log",
            tap.client,
            drain_timeout_s=10,
            startup_timeout_s=30,
            shutdown_timeout_s=2,
        )
        for port, url in zip(ports, urls, strict=True)
    ]
    try:
        for act in acts:
            assert act.start(K3).status is ApplyStatus.APPLIED
        yield acts[0], acts[1], tap
    finally:
        for act in acts:
            act.stop()
        tap.stop()


def port_of(act: DrainHoldActuator) -> int:
    return int(act.engine_url.rsplit(":", 1)[1])


def test_a_replica_changes_out_of_rotation_while_the_other_serves(replicas: Pair) -> None:
    a, b, tap = replicas
    with Load(tap.url) as load:
        result = a.apply(K5)
    assert result.status is ApplyStatus.APPLIED, result.message
    assert served(port_of(a)) == K5 and served(port_of(b)) == K3  # the other replica untouched
    assert load.statuses and set(load.statuses) == {200}
    impact = result.impact
    assert impact is not None and impact.strategy == "out_of_rotation"
    assert impact.requests_held == 0 and impact.requests_failed == 0
    assert sorted(tap.client.state()["upstreams"]) == sorted([a.engine_url, b.engine_url])  # back in rotation


def test_a_config_that_does_not_come_up_is_rolled_back_and_the_replica_rejoins(replicas: Pair) -> None:
    a, _, tap = replicas
    with Load(tap.url) as load:
        result = a.apply(BROKEN)
    assert result.status is ApplyStatus.ROLLED_BACK, result.message
    assert served(port_of(a)) == K3
    assert set(load.statuses) == {200}
    assert a.engine_url in tap.client.state()["upstreams"]


def test_a_replica_that_cannot_serve_stays_out_of_rotation(replicas: Pair) -> None:
    a, b, tap = replicas
    a.last_good = BROKEN  # neither the new config nor the "last good" one can start
    with Load(tap.url) as load:
        result = a.apply(BROKEN | {"num_speculative_tokens": 4})
    assert result.status is ApplyStatus.FAILED
    assert "stays out of rotation" in result.message and b.engine_url in result.message
    assert tap.client.state()["upstreams"] == [b.engine_url]
    assert set(load.statuses) == {200}  # the other replica served every request meanwhile


def test_the_last_replica_in_rotation_is_never_removed(replicas: Pair) -> None:
    a, b, tap = replicas
    tap.client.remove_upstream(b.engine_url)
    with Load(tap.url) as load:
        result = a.apply(K5)  # alone in rotation: the hold path, not out of rotation
    assert result.status is ApplyStatus.APPLIED, result.message
    assert result.impact is not None and result.impact.strategy == "drain_hold"
    assert set(load.statuses) == {200}
    assert tap.client.state()["upstreams"] == [a.engine_url]
    with pytest.raises(FrontDoorError, match="only upstream in rotation"):
        tap.client.remove_upstream(a.engine_url)

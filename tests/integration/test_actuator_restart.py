"""The restart actuator against a real server process (tests/integration/fake_engine.py, not vLLM)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.engine_fixtures import fake_engine_argv
from tuner.actuators import ApplyStatus, RestartActuator
from tuner.actuators.restart import server_argv
from tuner.engine.process import free_port, group_alive

K3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
K5 = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5}


def served(port: int) -> dict | None:
    return httpx.get(f"http://127.0.0.1:{port}/info", timeout=5).json()["speculative_config"]


def make(port: int, log_path: Path) -> RestartActuator:
    return RestartActuator(
        fake_engine_argv(port),
        f"http://127.0.0.1:{port}/health",
        log_path,
        startup_timeout_s=30,
        shutdown_timeout_s=2,
    )


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[RestartActuator, int]]:
    port = free_port()
    act = make(port, tmp_path / "engine.log")
    result = act.start(K3)
    assert result.status is ApplyStatus.APPLIED, result.message + result.detail
    try:
        yield act, port
    finally:
        act.stop()


def test_server_argv() -> None:
    assert server_argv(["vllm", "serve", "m"], {"method": "off"}, 30) == [
        "vllm",
        "serve",
        "m",
        "--shutdown-timeout",
        "30",
    ]
    argv = server_argv(["vllm"], K3, None)
    assert argv[1] == "--speculative-config" and '"num_speculative_tokens": 3' in argv[2]


def test_apply_restarts_with_the_new_config_and_is_idempotent(engine: tuple[RestartActuator, int]) -> None:
    act, port = engine
    assert served(port) == K3
    old_pid = act.process.pid if act.process else None
    result = act.apply(K5)
    assert result.status is ApplyStatus.APPLIED and result.downtime_s is not None and result.downtime_s > 0
    assert served(port) == K5 and act.current == K5 and act.last_good == K5
    assert old_pid is not None and not group_alive(old_pid)  # the old engine is gone, group and all
    new_pid = act.process.pid if act.process else None
    again = act.apply(dict(reversed(list(K5.items()))))  # same config, other key order
    assert again.status is ApplyStatus.UNCHANGED
    assert act.process is not None and act.process.pid == new_pid  # no restart happened


def test_a_config_that_does_not_start_is_rolled_back(engine: tuple[RestartActuator, int], tmp_path: Path) -> None:
    act, port = engine
    bad = {"method": "draft_model", "model": str(tmp_path / "missing-draft"), "num_speculative_tokens": 4}
    result = act.apply(bad)
    assert result.status is ApplyStatus.ROLLED_BACK
    assert "did not come up" in result.message and "does not exist" in result.detail
    assert result.config == K3 and act.current == K3
    assert served(port) == K3  # the engine serves the last good config again
    assert act.healthy()


def test_health_hook_restarts_a_dead_engine(engine: tuple[RestartActuator, int]) -> None:
    act, port = engine
    assert act.ensure_running() is None  # alive: nothing to do
    assert act.process is not None and act.process.pid is not None
    os.killpg(act.process.pid, signal.SIGKILL)
    act.process._proc.wait()  # type: ignore[union-attr]  # reap, so alive() sees the death
    result = act.ensure_running()
    assert result is not None and result.status is ApplyStatus.APPLIED
    assert served(port) == K3


def test_an_orphaned_engine_is_reaped_on_start(tmp_path: Path) -> None:
    # A daemon killed with SIGKILL leaves its engine running; the next daemon must stop it first.
    port = free_port()
    first = make(port, tmp_path / "engine.log")
    assert first.start(K3).ok
    assert first.process is not None and first.process.pid is not None
    orphan = first.process.pid
    second = make(port, tmp_path / "engine.log")  # a new daemon, same files
    try:
        result = second.start(K5)
        assert result.status is ApplyStatus.APPLIED, result.message
        assert not group_alive(orphan)
        assert served(port) == K5
    finally:
        second.stop()
        first.stop()
    assert not second.pid_path.exists()


def test_start_failure_without_a_good_config_reports_down(tmp_path: Path) -> None:
    port = free_port()
    act = make(port, tmp_path / "engine.log")
    result = act.start({"method": "draft_model", "model": str(tmp_path / "nope"), "num_speculative_tokens": 2})
    assert result.status is ApplyStatus.FAILED and result.config is None and "does not exist" in result.detail
    assert not act.healthy()

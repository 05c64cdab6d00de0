"""Choosing the restart strategy (pure), the blue/green fit, the config keys and the audit fields."""

from __future__ import annotations

from typing import Any

import pytest

from tuner.actuators.base import ApplyImpact, ApplyResult, ApplyStatus
from tuner.actuators.blue_green import port_of, with_port
from tuner.actuators.fit import blue_green_fit, gpu_memory_utilization
from tuner.actuators.rolling import RollingActuator
from tuner.actuators.strategy import build_restart_strategy, choose_strategy
from tuner.config import ActuatorSection, ConfigError, parse_config

ARGV = ["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"]


def section(**door: Any) -> ActuatorSection:
    data: dict[str, Any] = {"kind": "restart", "restart": {"argv": ARGV}}
    strategy = door.pop("strategy", None)
    if strategy is not None:
        data["strategy"] = strategy
    if door:
        data["front_door"] = {"engine_url": "http://127.0.0.1:8000", "listen": "127.0.0.1:8001", **door}
    return ActuatorSection.model_validate(data)


def test_auto_without_a_front_door_is_a_plain_restart() -> None:
    assert choose_strategy(section())[0] == "restart"


def test_auto_picks_blue_green_on_cpu_and_drain_hold_when_two_gpu_engines_do_not_fit() -> None:
    strategy, reason = choose_strategy(section(blue_green_port=8002, device="cpu"))
    assert strategy == "blue_green" and "CPU" in reason
    strategy, reason = choose_strategy(section(blue_green_port=8002, device="gpu"))
    assert strategy == "drain_hold" and "0.9" in reason and "drain-and-hold" in reason
    assert choose_strategy(section(blue_green_port=8002, device="gpu", spare_gpu=True))[0] == "blue_green"
    assert choose_strategy(section(device="cpu"))[0] == "drain_hold"  # no second port


def test_gpu_fit_is_two_utilizations_plus_headroom() -> None:
    assert blue_green_fit("gpu", 0.45).fits
    assert not blue_green_fit("gpu", 0.5).fits
    assert gpu_memory_utilization([*ARGV, "--gpu-memory-utilization", "0.4"]) == 0.4
    assert gpu_memory_utilization([*ARGV, "--gpu-memory-utilization=0.3"]) == 0.3
    assert gpu_memory_utilization(ARGV) == 0.9


def test_explicit_strategies_need_their_tables() -> None:
    with pytest.raises(ValueError, match="front_door"):
        section(strategy="drain_hold")
    with pytest.raises(ValueError, match="blue_green_port"):
        section(strategy="blue_green", device="cpu")
    with pytest.raises(ValueError, match="exactly one"):
        ActuatorSection.model_validate(
            {"kind": "restart", "restart": {"argv": ARGV}, "front_door": {"engine_url": "http://127.0.0.1:8000"}}
        )
    with pytest.raises(ValueError, match="control_token_file"):
        section(listen=None, control_url="http://127.0.0.1:8001")


def test_the_config_file_takes_the_strategy_keys(tmp_path: Any) -> None:
    config = parse_config(
        {
            "engine": {"metrics_url": "http://127.0.0.1:8001"},
            "speculative": {"method": "ngram", "num_speculative_tokens": 3},
            "actuator": {
                "kind": "restart",
                "strategy": "drain_hold",
                "restart": {"argv": ARGV},
                "front_door": {"engine_url": "http://127.0.0.1:8000", "listen": "127.0.0.1:8001", "max_hold_s": 90},
            },
        },
        base_dir=tmp_path,
    )
    assert config.actuator.front_door is not None and config.actuator.front_door.max_hold_s == 90
    with pytest.raises(ConfigError):
        parse_config(
            {
                "engine": {"metrics_url": "http://x:1"},
                "actuator": {"kind": "restart", "strategy": "teleport", "restart": {"argv": ARGV}},
            },
            base_dir=tmp_path,
        )


def test_port_rewrite() -> None:
    assert with_port(ARGV, 8002)[-1] == "8002" and port_of(ARGV) == 8000
    assert with_port(["x", "--port=1"], 2) == ["x", "--port=2"]
    with pytest.raises(ValueError, match="--port"):
        with_port(["x"], 2)


def test_event_data_carries_the_strategy_and_client_impact() -> None:
    impact = ApplyImpact("drain_hold", requests_held=7, longest_hold_s=41.5, requests_failed=0, drain_s=1.2)
    data = ApplyResult(ApplyStatus.APPLIED, "ok", {"method": "ngram"}, 42.0, impact=impact).event_data()
    assert data["strategy"] == "drain_hold" and data["requests_held"] == 7 and data["longest_hold_s"] == 41.5
    assert data["requests_failed"] == 0 and data["drain_s"] == 1.2 and data["warmup_s"] is None
    assert "strategy" not in ApplyResult(ApplyStatus.APPLIED, "ok", None).event_data()


def test_blue_green_gives_each_port_its_own_extra_environment(tmp_path: Any) -> None:
    from tuner.actuators.blue_green import BlueGreenActuator
    from tuner.actuators.front_door import FrontDoorClient

    act = BlueGreenActuator(
        ARGV, 8002, tmp_path / "engine.log", FrontDoorClient("http://127.0.0.1:1", "t"), env={"A": "1"},
        env_by_port={8000: {"BIND": "0"}, 8002: {"BIND": "1"}},
    )
    assert act._server_env() == {"A": "1", "BIND": "0"} and port_of(act._server_argv(None)) == 8000
    act._use_port(8002)
    assert act._server_env() == {"A": "1", "BIND": "1"} and port_of(act._server_argv(None)) == 8002
    assert act.health_url == "http://127.0.0.1:8002/v1/models" and act.log_path.name == "engine.8002.log"


def rolling_config(tmp_path: Any, ports: list[int], argv: list[str] = ARGV) -> dict[str, Any]:
    return {
        "engine": {"metrics_url": "http://127.0.0.1:8001"},
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
        "actuator": {
            "kind": "restart",
            "strategy": "rolling",
            "restart": {"argv": argv, "log_path": "engine.log"},
            "front_door": {
                "engine_url": "http://127.0.0.1:8000",
                "control_url": "http://127.0.0.1:8001",
                "control_token_file": "tap.token",
                "replica_ports": ports,
                "env_by_port": {"8002": {"BIND": "1"}},
            },
        },
    }


def test_rolling_builds_one_restart_replica_per_port(tmp_path: Any) -> None:
    config = parse_config(rolling_config(tmp_path, [8000, 8002]), base_dir=tmp_path)
    assert choose_strategy(config.actuator)[0] == "rolling"
    act = build_restart_strategy(config.actuator, "unused", tmp_path / "engine.log", {"A": "1"}, config.resolve)
    assert isinstance(act, RollingActuator)
    assert act.urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8002"]
    assert [port_of(r.base_argv) for r in act.replicas] == [8000, 8002]
    assert [r.health_url for r in act.replicas] == [f"{u}/v1/models" for u in act.urls]
    assert [r.log_path.name for r in act.replicas] == ["engine.8000.log", "engine.8002.log"]
    assert [r.env for r in act.replicas] == [{"A": "1"}, {"A": "1", "BIND": "1"}]


@pytest.mark.parametrize(
    ("ports", "argv", "fragment"),
    [
        ([8000], ARGV, "replica_ports lists 1 distinct port(s)"),
        ([8000, 8000], ARGV, "replica_ports lists 1 distinct port(s)"),
        ([], ARGV, "replica_ports lists 0 distinct port(s)"),
        ([8000, 8002], ARGV[:-2], "no --port"),
    ],
)
def test_rolling_needs_two_replicas_and_a_port_to_replace(
    tmp_path: Any, ports: list[int], argv: list[str], fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(rolling_config(tmp_path, ports, argv), base_dir=tmp_path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


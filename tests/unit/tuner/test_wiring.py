"""Config for the plugin and the live actuator: clear errors, and what the daemon builds from it."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from collectors.step_ingest import StepFeed
from collectors.vllm_plugin import env
from policies.step_cost import StepCostModel
from tuner.actuators.live import LiveActuator
from tuner.actuators.restart import RestartActuator
from tuner.config import ConfigError, parse_config
from tuner.store.schema import upgrade
from tuner.store.store import Store
from tuner.wiring import DaemonStartError, build_actuator, build_step_ingest, controller_settings, draft_candidates


class ListSink:
    def write_windows(self, records: Any) -> None: ...
    def write_requests(self, records: Any) -> None: ...
    def write_steps(self, records: Any) -> None: ...
    def write_events(self, records: Any) -> None: ...


def base(**sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "engine": {"metrics_url": "http://127.0.0.1:8000"},
        "speculative": {"method": "draft_model", "model": "/models/d", "num_speculative_tokens": 3},
        "actuator": {"kind": "live", "live": {}, "restart": {"argv": ["vllm", "serve", "/m"]}},
        "plugin": {"ingest_listen": "127.0.0.1:8766", "control_address": "unix:/run/spt/control.sock"},
    }
    data.update(sections)
    return data


def problems(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return str(err.value)


def test_live_needs_a_control_address() -> None:
    msg = problems(base(plugin={}))
    assert "plugin.control_address is not set" in msg


def test_live_fallback_needs_its_table() -> None:
    msg = problems(base(actuator={"kind": "live", "live": {"fallback": "webhook"}}))
    assert "fallback is 'webhook' but there is no [actuator.webhook] table" in msg


@pytest.mark.parametrize(
    ("plugin", "fragment"),
    [
        ({"ingest_listen": "0.0.0.0:8766"}, "loopback only"),
        ({"ingest_listen": "127.0.0.1"}, "is not 127.0.0.1:PORT"),
        ({"control_address": "unix:ctl.sock"}, "absolute socket path"),
        ({"control_address": "10.0.0.2:9000"}, "not on loopback"),
        ({"control_address": "127.0.0.1:0"}, "needs a fixed port"),
    ],
)
def test_plugin_addresses_are_checked(plugin: dict[str, str], fragment: str) -> None:
    assert fragment in problems(base(plugin=plugin, actuator={"kind": "none"}))


def test_daemon_builds_live_over_restart_with_the_plugin_env(tmp_path: Path) -> None:
    cfg = parse_config(base(), base_dir=tmp_path)
    feed = StepFeed()
    act = build_actuator(cfg, feed)
    assert isinstance(act, LiveActuator) and act.feed is feed and act.k_max == cfg.policy.k_max
    fallback = act.fallback
    assert isinstance(fallback, RestartActuator)
    token_file = tmp_path / "plugin.token"
    assert fallback.env == {
        env.INGEST_URL: "http://127.0.0.1:8766/v1/steps",
        env.CONTROL_ADDR: "unix:/run/spt/control.sock",
        env.TOKEN_FILE: str(token_file),
    }
    # The daemon starts the engine, so it made the shared token, readable by its user only.
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token_file.read_text().strip()) > 20
    assert act.control.token == token_file.read_text().strip()
    ingest = build_step_ingest(cfg, sink=ListSink(), feed=feed)
    assert ingest is not None and ingest.url == "http://127.0.0.1:8766/v1/steps" and ingest.feed is feed
    assert ingest._token == token_file.read_text().strip().encode()
    # The same token on the next start (the engine may still hold the file).
    again = build_actuator(cfg, feed)
    assert isinstance(again, LiveActuator) and again.control.token == act.control.token


def test_skipping_the_draft_pass_at_k0_reaches_the_engine_and_the_controller(tmp_path: Path) -> None:
    """``[plugin] skip_draft_pass_at_k0``: the engine the daemon starts gets the plugin's switch, with or
    without the ingest and the control channel, and the controller prices a draft model's K = 0 without
    its pass. Unset, neither changes."""
    plugin = {**base()["plugin"], "skip_draft_pass_at_k0": True}
    cfg = parse_config(base(plugin=plugin), base_dir=tmp_path)
    act = build_actuator(cfg, StepFeed())
    assert isinstance(act, LiveActuator) and isinstance(act.fallback, RestartActuator)
    assert act.fallback.env[env.SKIP_K0_DRAFT_PASS] == "1"
    assert not controller_settings(cfg).policy.drafts_at_k0("draft_model")
    restart = {"kind": "restart", "restart": {"argv": ["vllm"]}}
    restart_only = base(plugin={"skip_draft_pass_at_k0": True}, actuator=restart)
    act = build_actuator(parse_config(restart_only, base_dir=tmp_path))
    assert isinstance(act, RestartActuator) and act.env == {env.SKIP_K0_DRAFT_PASS: "1"}
    stock = parse_config(base(), base_dir=tmp_path)
    assert controller_settings(stock).policy.drafts_at_k0("draft_model")
    stock_act = build_actuator(stock, StepFeed())
    assert isinstance(stock_act, LiveActuator) and isinstance(stock_act.fallback, RestartActuator)
    assert env.SKIP_K0_DRAFT_PASS not in stock_act.fallback.env
    assert env.env_flag(env.SKIP_K0_DRAFT_PASS, {env.SKIP_K0_DRAFT_PASS: "True"})
    # the prompt steps too: "all" in the engine, K = 0 priced as plain decoding whatever the answers' length
    both = base(plugin={"skip_draft_pass_at_k0": True, "skip_draft_pass_at_k0_prompts": True}, actuator=restart)
    cfg = parse_config(both, base_dir=tmp_path)
    act = build_actuator(cfg)
    assert isinstance(act, RestartActuator) and act.env == {env.SKIP_K0_DRAFT_PASS: "all"}
    policy = controller_settings(cfg).policy
    assert policy.k0_prompt_pass_skipped and policy.k0_skip_output_tokens(64.0) == 0.0
    assert policy.engine_step_cost(StepCostModel.from_cost_ratio(0.2), "draft_model", 64.0).k0_passes(64) == 0.0
    with pytest.raises(ConfigError, match="skip_draft_pass_at_k0_prompts = true needs skip_draft_pass_at_k0"):
        parse_config(base(plugin={"skip_draft_pass_at_k0_prompts": True}, actuator=restart), base_dir=tmp_path)
    assert not env.env_flag(env.SKIP_K0_DRAFT_PASS, {env.SKIP_K0_DRAFT_PASS: "0"})
    assert not env.env_flag(env.SKIP_K0_DRAFT_PASS, {})


def test_engine_managed_elsewhere_needs_an_existing_token_for_control_only(tmp_path: Path) -> None:
    actuator = {"kind": "live", "live": {"fallback": "command"}, "command": {"argv": ["apply"]}}
    data = base(plugin={"control_address": "127.0.0.1:8765"}, actuator=actuator)
    cfg = parse_config(data, base_dir=tmp_path)
    with pytest.raises(DaemonStartError, match=r"plugin token file .* does not exist"):
        build_actuator(cfg)
    (tmp_path / "plugin.token").write_text("shared-secret\n")
    act = build_actuator(cfg)
    assert isinstance(act, LiveActuator) and act.control.token == "shared-secret"


def test_ingest_always_has_a_token(tmp_path: Path) -> None:
    """The ingest endpoint never listens without a token: one is created (0600) for the plugin to read,
    and an empty token file is refused, not taken as "no token"."""
    actuator = {"kind": "live", "live": {"fallback": "command"}, "command": {"argv": ["apply"]}}
    cfg = parse_config(base(actuator=actuator), base_dir=tmp_path)
    ingest = build_step_ingest(cfg, sink=ListSink(), feed=StepFeed())
    token_file = tmp_path / "plugin.token"
    assert ingest is not None and ingest._token == token_file.read_text().strip().encode()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token_file.write_text("  \n")
    with pytest.raises(DaemonStartError, match="is empty"):
        build_step_ingest(cfg, sink=ListSink(), feed=StepFeed())


def test_plugin_off_means_no_ingest_and_no_env(tmp_path: Path) -> None:
    cfg = parse_config(base(plugin={}, actuator={"kind": "restart", "restart": {"argv": ["x"]}}), base_dir=tmp_path)
    act = build_actuator(cfg)
    assert isinstance(act, RestartActuator) and act.env == {}
    assert build_step_ingest(cfg, sink=ListSink(), feed=StepFeed()) is None
    assert not (tmp_path / "plugin.token").exists()


def test_live_without_ingest_verifies_by_read_back_only(tmp_path: Path) -> None:
    cfg = parse_config(base(plugin={"control_address": "127.0.0.1:8765"}), base_dir=tmp_path)
    act = build_actuator(cfg, StepFeed())
    assert isinstance(act, LiveActuator) and act.feed is None
    assert isinstance(act.fallback, RestartActuator) and env.INGEST_URL not in act.fallback.env


def test_a_drafts_measured_pass_reaches_its_candidate(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    upgrade(url)
    cfg = parse_config(
        base(drafts=[{"name": "ngram", "method": "ngram", "draft_fixed_s": 0.0095, "draft_per_seq_s": 0.00001}])
    )
    with Store(url) as store:
        (ngram,) = draft_candidates(cfg, store)
    assert (ngram.draft_fixed_s, ngram.draft_per_seq_s) == (0.0095, 0.00001)

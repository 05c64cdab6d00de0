"""The daemon's TOML config (`spectuner run --config spectuner.toml`), validated with pydantic 2.

Every problem is reported as ``key: what is wrong — what to do`` so an operator can fix the file
without reading code. Unknown keys are errors (a typo must not silently fall back to a default).
See ``docs/spectuner.example.toml`` for a commented example of every key.
"""

from __future__ import annotations

import re
import tomllib
from datetime import time
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """The config file cannot be used. ``problems`` holds one ``key: message`` line per problem."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"config {path} has {len(problems)} problem(s):\n{lines}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mode(StrEnum):
    ADVISORY = "advisory"  # decide and record, never act
    AUTO = "auto"  # act through the actuator


class EngineSection(_Section):
    """Which engine spectuner watches."""

    metrics_url: str = Field(description="vLLM server (http://HOST:PORT) or its /metrics URL")
    health_url: str | None = Field(default=None, description="default: the metrics URL's /health")
    model_name: str | None = Field(default=None, description="served model name; default: any model on the page")

    @field_validator("metrics_url", "health_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL; write http://HOST:PORT")
        return value


class RestartActuatorSection(_Section):
    """Supervise the vLLM server command and apply configs by a graceful restart."""

    argv: list[str] = Field(min_length=1, description="server command line WITHOUT --speculative-config")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="how long a start may take to be healthy")
    shutdown_timeout_s: float = Field(default=30.0, ge=0, description="drain time (vLLM --shutdown-timeout)")
    log_path: str = Field(default="engine.log", description="engine stdout/stderr, relative to the config file")
    pass_shutdown_timeout: bool = Field(
        default=True, description="append --shutdown-timeout to argv (vLLM ≥ 0.11 understands it)"
    )


class CommandActuatorSection(_Section):
    """Hand the config to an external command as JSON on stdin; exit 0 means applied."""

    argv: list[str] = Field(min_length=1)
    timeout_s: float = Field(default=60.0, gt=0)


class WebhookActuatorSection(_Section):
    """POST the config as JSON; a 2xx answer means applied."""

    url: str
    timeout_s: float = Field(default=30.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value


class ActuatorSection(_Section):
    kind: Literal["restart", "command", "webhook", "none"] = "none"
    restart: RestartActuatorSection | None = None
    command: CommandActuatorSection | None = None
    webhook: WebhookActuatorSection | None = None

    @model_validator(mode="after")
    def _table_for_kind(self) -> ActuatorSection:
        if self.kind != "none" and getattr(self, self.kind) is None:
            raise ValueError(f"kind is {self.kind!r} but there is no [actuator.{self.kind}] table; add one")
        return self


class SpeculativeSection(_Section):
    """The config the engine starts with (vLLM's --speculative-config)."""

    method: str = Field(description="draft_model, eagle, eagle3, ngram, suffix, off ...")
    model: str | None = Field(default=None, description="draft model path or name (not for ngram/suffix/off)")
    num_speculative_tokens: int = Field(ge=0, le=64)
    extra: dict[str, Any] = Field(default_factory=dict, description="more keys passed to vLLM as they are")

    @model_validator(mode="after")
    def _model_needed(self) -> SpeculativeSection:
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f'method {self.method!r} needs a draft: set model = "/path/to/draft"')
        return self

    def to_spec_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model:
            cfg["model"] = self.model
        cfg.update(self.extra)
        return cfg


class PolicySection(_Section):
    k_max: int = Field(default=8, ge=0, le=64, description="largest K the controller may choose")
    cost_ratio: float = Field(default=0.05, gt=0, lt=10, description="draft step / target step (c)")
    evidence_window_s: float = Field(default=300.0, gt=0, description="how far back a decision looks")
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)


class MaintenanceWindow(_Section):
    """A UTC time range on some weekdays (0 = Monday) in which restarts may happen."""

    days: list[int] = Field(default_factory=lambda: list(range(7)))
    start: time
    end: time

    @field_validator("days")
    @classmethod
    def _days(cls, value: list[int]) -> list[int]:
        bad = [d for d in value if not 0 <= d <= 6]
        if bad or not value:
            raise ValueError(f"days must be weekday numbers 0 (Monday) .. 6 (Sunday), got {value}")
        return value


class GuardrailsSection(_Section):
    min_drafts: int = Field(default=200, ge=0, description="drafts of evidence before any change")
    min_evidence_s: float = Field(default=60.0, ge=0, description="seconds of windows before any change")
    min_gain: float = Field(default=0.03, ge=0, description="lower end of the predicted gain must beat 1 + this")
    hysteresis_ticks: int = Field(default=2, ge=1, description="decisions in a row that must want the change")
    cooldown_s: float = Field(default=600.0, ge=0, description="quiet time after any change")
    max_changes_per_hour: int = Field(default=4, ge=0)
    restart_downtime_s: float = Field(default=60.0, ge=0, description="expected engine downtime per restart")
    payback_horizon_s: float = Field(default=3600.0, gt=0, description="gain must repay the downtime within this")
    maintenance_windows: list[MaintenanceWindow] = Field(
        default_factory=list, description="when set, restarts only inside one of them"
    )


class ControllerSection(_Section):
    mode: Mode = Mode.ADVISORY
    collect_interval_s: float = Field(default=10.0, gt=0)
    decide_interval_s: float = Field(default=60.0, gt=0)
    health_interval_s: float = Field(default=15.0, gt=0)
    retention_interval_s: float = Field(default=300.0, gt=0)
    verify_window_s: float = Field(default=300.0, gt=0, description="evaluation window after a change")
    regression_tolerance: float = Field(default=0.05, ge=0, lt=1, description="realized loss tolerated")


class DatabaseSection(_Section):
    url: str | None = None


class SpectunerConfig(_Section):
    engine: EngineSection
    actuator: ActuatorSection = Field(default_factory=ActuatorSection)
    speculative: SpeculativeSection
    policy: PolicySection = Field(default_factory=PolicySection)
    guardrails: GuardrailsSection = Field(default_factory=GuardrailsSection)
    controller: ControllerSection = Field(default_factory=ControllerSection)
    database: DatabaseSection = Field(default_factory=DatabaseSection)
    # Where the file was read from (relative paths resolve against its directory).
    base_dir: Path = Field(default=Path("."), exclude=True)

    @model_validator(mode="after")
    def _consistent(self) -> SpectunerConfig:
        if self.controller.mode is Mode.AUTO and self.actuator.kind == "none":
            raise ValueError(
                "controller.mode is 'auto' but actuator.kind is 'none': choose an actuator "
                "(restart, command, webhook) or set mode = 'advisory'"
            )
        if self.speculative.num_speculative_tokens > self.policy.k_max:
            raise ValueError(
                f"speculative.num_speculative_tokens ({self.speculative.num_speculative_tokens}) is above "
                f"policy.k_max ({self.policy.k_max}); raise k_max or start with a smaller K"
            )
        return self

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p


_FIXES = {
    "missing": "add it",
    "extra_forbidden": "remove it or check the spelling (see docs/spectuner.example.toml)",
    "literal_error": "use one of the listed values",
    "enum": "use one of the listed values",
}


def _problem(err: Any) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    fix = _FIXES.get(kind)
    if kind == "missing":
        msg = "is required"
    elif kind == "extra_forbidden":
        msg = "is not a known key"
    elif "input" in err and kind not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {err['input']!r})"
    return f"{key}: {msg}" + (f" — {fix}" if fix else "")


def parse_config(data: dict[str, Any], *, path: str = "<config>", base_dir: Path | None = None) -> SpectunerConfig:
    """Validate already-parsed TOML data. Raises :class:`ConfigError` listing every problem."""
    try:
        config = SpectunerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(path, [_problem(e) for e in exc.errors()]) from None
    if base_dir is not None:
        config = config.model_copy(update={"base_dir": base_dir})
    return config


def load_config(path: str | Path) -> SpectunerConfig:
    """Read and validate a TOML file. Raises :class:`ConfigError` (missing file, bad TOML, bad keys)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(str(p), ["file not found; write one (see docs/spectuner.example.toml)"]) from None
    except OSError as exc:
        raise ConfigError(str(p), [f"cannot read the file: {exc}"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(p), [f"not valid TOML: {exc}; fix the syntax at that line"]) from None
    return parse_config(data, path=str(p), base_dir=p.resolve().parent)

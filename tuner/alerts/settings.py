"""The ``[alerts]`` config: where events go (``[[alerts.sinks]]``) and how hard to try.

Secrets never appear in the file: a webhook's HMAC key comes from the environment variable named by
``secret_env``, and a sink URL that is itself a credential (a Slack webhook) may come from ``url_env``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Severity = Literal["info", "warning", "critical"]
SinkKind = Literal["webhook", "slack", "alertmanager", "command"]
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SinkSection(_Section):
    """One destination for alert events."""

    name: str = Field(description="unique; names the sink in logs, the delivery log and metrics")
    kind: SinkKind
    url: str | None = Field(default=None, description="http(s) URL (webhook, slack, alertmanager)")
    url_env: str | None = Field(default=None, description="read the URL from this environment variable instead")
    argv: list[str] | None = Field(default=None, description="command sink: program and arguments (no shell)")
    secret_env: str | None = Field(default=None, description="webhook: env var holding the HMAC-SHA256 key")
    headers: dict[str, str] = Field(default_factory=dict, description="extra HTTP headers")
    kinds: list[str] = Field(
        default_factory=list,
        description="event kinds or categories to send; empty: every categorised kind; ['*']: every event",
    )
    min_severity: Severity = Field(default="info", description="drop events below this severity")
    timeout_s: float = Field(default=5.0, gt=0, le=300, description="per attempt")
    retries: int = Field(default=3, ge=0, le=10, description="attempts after the first one")
    backoff_s: float = Field(default=1.0, ge=0, le=600, description="first retry delay; doubles per retry")
    backoff_max_s: float = Field(default=30.0, ge=0, le=3600, description="cap on one retry delay")
    jitter: float = Field(default=0.1, ge=0, le=0.5, description="± this fraction randomises each delay")
    rate_limit_per_minute: int = Field(default=30, ge=1, description="attempted deliveries per rolling minute")
    dedup_window_s: float = Field(default=300.0, ge=0, description="same event key delivered within this: dropped")
    resolve_after_s: float = Field(
        default=3600.0, gt=0, description="alertmanager: endsAt = startsAt + this for one-off events"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"{value!r} is not a sink name; use 1–64 letters, digits, '.', '_' or '-'")
        return value

    @field_validator("url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("is not an http(s) URL; write http://HOST:PORT/PATH")
        return value

    @field_validator("url_env", "secret_env")
    @classmethod
    def _env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV.match(value):
            raise ValueError(f"{value!r} is not an environment variable name (write the NAME, not the secret)")
        return value

    @model_validator(mode="after")
    def _kind_fields(self) -> SinkSection:
        if self.kind == "command":
            if not self.argv:
                raise ValueError(f"sink {self.name!r} is a command sink: set argv = [\"/path/to/program\", ...]")
            if self.url or self.url_env:
                raise ValueError(f"sink {self.name!r} is a command sink: remove url/url_env")
        else:
            if (self.url is None) == (self.url_env is None):
                raise ValueError(f"sink {self.name!r} ({self.kind}) needs exactly one of url or url_env")
            if self.argv:
                raise ValueError(f"sink {self.name!r} is a {self.kind} sink: argv is only for command sinks")
        if self.secret_env and self.kind != "webhook":
            raise ValueError(f"sink {self.name!r}: secret_env (HMAC signing) is only for webhook sinks")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"sink {self.name!r}: backoff_max_s ({self.backoff_max_s}) is below backoff_s")
        return self


class AlertsSection(_Section):
    enabled: bool = True
    poll_interval_s: float = Field(default=10.0, gt=0, description="how often new events are read")
    max_events_per_poll: int = Field(default=200, ge=1, description="per sink, per poll")
    new_sink_start: Literal["latest", "oldest"] = Field(
        default="latest", description="a sink seen for the first time starts after the newest event, or at the oldest"
    )
    categories: dict[str, str] = Field(
        default_factory=dict, description="more event kinds → category (added to the built-in mapping)"
    )
    sinks: list[SinkSection] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> AlertsSection:
        names = [s.name for s in self.sinks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"sink names must be unique; {', '.join(dupes)} appear more than once")
        return self

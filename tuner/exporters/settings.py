"""The ``[exporters]`` config: window and refresh, the fleet view, ``[exporters.prometheus]``, ``[exporters.otlp]``."""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


class PrometheusSection(_Section):
    enabled: bool = False
    host: str = Field(default="127.0.0.1", description="bind address; other than loopback needs allow_remote")
    port: int = Field(default=9464, ge=0, le=65535, description="0 picks a free port (tests)")
    allow_remote: bool = Field(
        default=False, description="let host be a non-loopback address (the figures then reach the network)"
    )

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> PrometheusSection:
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is not a loopback address: the exporter would serve the network; bind "
                "127.0.0.1 (and let a local Prometheus or a proxy reach it) or set allow_remote = true"
            )
        return self


class OtlpSection(_Section):
    enabled: bool = False
    endpoint: str = Field(default="http://127.0.0.1:4318", description="OTLP/HTTP base; /v1/metrics, /v1/traces added")
    interval_s: float = Field(default=30.0, gt=0, description="metric export interval")
    timeout_s: float = Field(default=10.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict, description="e.g. an auth header for a vendor endpoint")
    traces: bool = Field(default=True, description="a span per decision and per apply")

    @field_validator("endpoint")
    @classmethod
    def _http(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL; write http://HOST:4318")
        return value.rstrip("/")


class ExportersSection(_Section):
    window_s: float = Field(default=120.0, gt=0, description="figures over windows that ended in the last N s")
    refresh_interval_s: float = Field(default=15.0, gt=0, description="how often values are recomputed")
    length_window_s: float = Field(
        default=3600.0, gt=0, description="α̂ by context length over the tap's requests of the last N s"
    )
    length_refresh_s: float = Field(
        default=60.0, gt=0, description="how often those bands are re-read (each read scans that window's requests)"
    )
    fleet: bool = Field(
        default=False,
        description="export the fleet view (every engine in the database, grouped): one sidecar of the fleet is enough",
    )
    fleet_window_s: float = Field(default=300.0, gt=0, description="fleet α̂ over windows of the last N s")
    fleet_refresh_s: float = Field(
        default=60.0, gt=0, description="how often the fleet is re-read (each read scans every engine's window)"
    )
    prometheus: PrometheusSection = Field(default_factory=PrometheusSection)
    otlp: OtlpSection = Field(default_factory=OtlpSection)

    @property
    def enabled(self) -> bool:
        return self.prometheus.enabled or self.otlp.enabled

"""Hand a config to an external orchestrator by HTTP POST; a 2xx answer means applied.

Body: ``{"speculative_config": {...}}``. A JSON answer ``{"ok": false, "message": ...}`` is a refusal
even with a 2xx status."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import httpx

from collectors.redact import redact_url, scrub, url_secrets
from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, VllmSpec
from tuner.actuators.command import answer_refusal

log = logging.getLogger(__name__)


class WebhookActuator(Actuator):
    kind = "webhook"

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        super().__init__()
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive but got {timeout_s}")
        self.url = url
        # What messages, the audit log and alert sinks see: the path and query of a webhook URL are
        # often its credential (hooks.example/T0/B0/XXXX, ?token=...).
        self.shown_url = redact_url(url, hide_path=True)
        self._secrets = url_secrets(url, path_is_secret=True)
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout_s))

    def apply(self, config: VllmSpec) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged:
            return unchanged
        try:
            response = self._client.post(self.url, json={"speculative_config": config}, headers=self.headers)
        except httpx.TimeoutException:
            return ApplyResult(
                ApplyStatus.FAILED,
                f"webhook {self.shown_url} did not answer within {self.timeout_s:g} s; the config may or may not be "
                "in force — check the orchestrator",
                self.current,
            )
        except httpx.HTTPError as exc:
            return ApplyResult(
                ApplyStatus.FAILED,
                scrub(
                    f"cannot reach webhook {self.shown_url}: {type(exc).__name__}: {exc}; check [actuator.webhook] url",
                    self._secrets,
                ),
                self.current,
            )
        body = scrub(response.text[-2000:], self._secrets, limit=2000)  # an error page may echo the URL
        if not response.is_success:
            return ApplyResult(
                ApplyStatus.FAILED,
                f"webhook {self.shown_url} answered HTTP {response.status_code}; the old config stays",
                self.current,
                detail=body,
            )
        refusal = answer_refusal(response.text)
        if refusal is not None:
            return ApplyResult(
                ApplyStatus.FAILED,
                scrub(f"webhook {self.shown_url} refused the config: {refusal}", self._secrets),
                self.current,
                detail=body,
            )
        self.current = dict(config)
        log.info("webhook actuator: %s applied the config (HTTP %s)", self.shown_url, response.status_code)
        return ApplyResult(
            ApplyStatus.APPLIED, f"webhook {self.shown_url} applied the config", self.current, detail=body
        )

    def stop(self) -> None:
        self._client.close()

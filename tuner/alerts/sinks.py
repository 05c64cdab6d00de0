"""Alert sinks: one attempt to hand one event to one destination.

Each sink turns an event into its payload and makes ONE attempt; the dispatcher owns retries,
back-off, dedup and rate limits. An :class:`Attempt` says whether it worked and whether trying again
can help (a 4xx other than 408/429 will not). Error texts are scrubbed of the sink's URL and secret
before anyone logs or stores them: a Slack webhook URL is itself a credential.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from collectors.redact import scrub, url_secrets
from tuner.alerts.events import Category, alertmanager_payload, encode, generic_payload, slack_payload
from tuner.alerts.settings import SinkSection
from tuner.store.deliveries import StoredEvent

SIGNATURE_HEADER = "X-Spectuner-Signature"
_ERROR_CHARS = 500


class SinkConfigError(ValueError):
    """A sink cannot be built (a named environment variable is missing...)."""


@dataclass(frozen=True)
class Attempt:
    ok: bool
    retryable: bool = True
    status_code: int | None = None
    error: str | None = None


class Sink(Protocol):
    """Deliver one event once. Must not raise for delivery problems: return a failed Attempt."""

    name: str
    settings: SinkSection

    def send(self, event: StoredEvent) -> Attempt: ...

    def close(self) -> None: ...


def signature(secret: bytes, body: bytes) -> str:
    """``sha256=<hex HMAC-SHA256 of the exact body>``, as in the ``X-Spectuner-Signature`` header."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def _env(name: str, sink: str, what: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SinkConfigError(f"alert sink {sink!r}: environment variable {name} ({what}) is not set; export it")
    return value


class HttpSink:
    """webhook (JSON + HMAC signature), slack (``{"text": ...}``) or alertmanager (``/api/v2/alerts``)."""

    def __init__(self, settings: SinkSection, categories: Mapping[str, Category]) -> None:
        self.name = settings.name
        self.settings = settings
        self.categories = categories
        url = settings.url or _env(settings.url_env or "", settings.name, "the sink URL")
        if settings.kind == "alertmanager" and urlsplit(url).path in ("", "/"):
            url = url.rstrip("/") + "/api/v2/alerts"
        self._url = url
        secret_env = settings.secret_env
        self._secret = _env(secret_env, settings.name, "the HMAC key").encode() if secret_env else None
        self._client = httpx.Client(timeout=httpx.Timeout(settings.timeout_s), follow_redirects=False)

    def _secrets(self) -> list[str]:
        # Path and query often carry the token (Slack: /services/T../B../XXXX).
        return [*url_secrets(self._url, path_is_secret=True), self._secret.decode() if self._secret else ""]

    def body(self, event: StoredEvent) -> bytes:
        kind = self.settings.kind
        if kind == "slack":
            return encode(slack_payload(event, self.categories))
        if kind == "alertmanager":
            return encode(alertmanager_payload(event, self.categories, self.settings.resolve_after_s))
        return encode(generic_payload(event, self.categories))

    def send(self, event: StoredEvent) -> Attempt:
        body = self.body(event)
        headers = {
            **self.settings.headers,
            "Content-Type": "application/json",
            "User-Agent": "spectuner-alerts",
            "X-Spectuner-Event": event.kind,
            # The same value on every retry and re-send: receivers can drop duplicates by it.
            "X-Spectuner-Delivery": f"{self.name}-{event.id}",
        }
        if self._secret is not None:
            headers[SIGNATURE_HEADER] = signature(self._secret, body)
        try:
            response = self._client.post(self._url, content=body, headers=headers)
        except httpx.TimeoutException as exc:
            return Attempt(False, True, None, f"timed out after {self.settings.timeout_s:g} s ({type(exc).__name__})")
        except httpx.HTTPError as exc:
            return Attempt(False, True, None, scrub(f"{type(exc).__name__}: {exc}", self._secrets()))
        code = response.status_code
        if 200 <= code < 300:
            return Attempt(True, False, code)
        retryable = code >= 500 or code in (408, 429)
        text = scrub(response.text.strip(), self._secrets())
        return Attempt(False, retryable, code, f"HTTP {code}" + (f": {text}" if text else ""))

    def close(self) -> None:
        self._client.close()


class CommandSink:
    """Run ``argv`` with the event JSON on stdin; exit status 0 means delivered. No shell."""

    def __init__(self, settings: SinkSection, categories: Mapping[str, Category]) -> None:
        self.name = settings.name
        self.settings = settings
        self.categories = categories
        assert settings.argv
        self.argv = list(settings.argv)

    def send(self, event: StoredEvent) -> Attempt:
        body = encode(generic_payload(event, self.categories))
        try:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a timeout kills its children too
            )
        except OSError as exc:
            return Attempt(False, False, None, f"cannot run {self.argv[0]!r}: {exc.strerror or exc}")
        try:
            _, err = proc.communicate(body, timeout=self.settings.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Attempt(False, True, None, f"timed out after {self.settings.timeout_s:g} s; killed")
        if proc.returncode == 0:
            return Attempt(True, False)
        tail = err.decode(errors="replace").strip()[-_ERROR_CHARS:]
        return Attempt(False, True, None, f"exit status {proc.returncode}" + (f": {tail}" if tail else ""))

    def close(self) -> None:
        return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def build_sink(settings: SinkSection, categories: Mapping[str, Category]) -> Sink:
    """Raises :class:`SinkConfigError` when a named environment variable is missing."""
    if settings.kind == "command":
        return CommandSink(settings, categories)
    return HttpSink(settings, categories)

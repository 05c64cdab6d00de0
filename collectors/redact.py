"""Secrets in URLs: the one place that decides what of a URL may be printed, logged or stored.

A URL often is a credential: ``http://user:pass@host/metrics``, a Slack webhook's path, an
``?api_key=`` query. :func:`redact_url` keeps what identifies the endpoint (scheme, host, port, and
the path unless told otherwise) and hides the rest; :func:`url_secrets` lists the pieces that must
never appear in a text, and :func:`scrub` takes them out of one (an error message that echoes the URL).
Used by the collectors, the webhook actuator and the alert sinks alike (it sits in ``collectors`` so
that every layer above may import it).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlsplit, urlunsplit

HIDDEN = "***"
_MIN_SECRET_CHARS = 8  # shorter path or query pieces ("/", "/hook") are not worth scrubbing from text
_ERROR_CHARS = 500


def redact_url(url: str, *, hide_path: bool = False) -> str:
    """``url`` fit for a log line, a message or the database: the password and every query value
    replaced by ``***``; with ``hide_path`` (webhooks, whose path is the token) the path too."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return "<unparseable URL>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{port}" if port is not None else "")
    if parts.username is not None or parts.password is not None:
        user = parts.username or ""
        netloc = f"{user}{':' + HIDDEN if parts.password is not None else ''}@{netloc}"
    path = parts.path
    if hide_path and path not in ("", "/"):
        path = "/" + HIDDEN
    query = "&".join(f"{key}={HIDDEN}" for key, _ in parse_qsl(parts.query, keep_blank_values=True))
    if parts.query and not query:
        query = HIDDEN
    return urlunsplit((parts.scheme, netloc, path, query, ""))


def url_secrets(url: str, *, path_is_secret: bool = False) -> list[str]:
    """The pieces of ``url`` no text may show: the whole URL, its password, its query values (and its
    path with ``path_is_secret``), longest first."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return [url]
    pieces = [url, parts.password or "", parts.query]
    pieces += [value for _, value in parse_qsl(parts.query, keep_blank_values=True)]
    if path_is_secret:
        pieces.append(parts.path)
    keep = {p for p in pieces if p and (p == url or p == parts.password or len(p) >= _MIN_SECRET_CHARS)}
    return sorted(keep, key=len, reverse=True)


def scrub(text: str, secrets: Sequence[str], *, limit: int = _ERROR_CHARS) -> str:
    """``text`` with every given secret replaced by ``<redacted>``, cut to a loggable length."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
    return text[:limit]

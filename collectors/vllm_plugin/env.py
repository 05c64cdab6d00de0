"""The environment variables that configure the plugin inside vLLM's processes (stdlib only)."""

from __future__ import annotations

import os
from pathlib import Path

INGEST_URL = "SPECTUNER_INGEST_URL"  # http://127.0.0.1:PORT/v1/steps; unset: the stat logger is inert
CONTROL_ADDR = "SPECTUNER_CONTROL_ADDR"  # 127.0.0.1:PORT or unix:/path; unset: no control channel
TOKEN = "SPECTUNER_PLUGIN_TOKEN"  # shared secret for the control channel and the ingest endpoint
TOKEN_FILE = "SPECTUNER_PLUGIN_TOKEN_FILE"  # or a file holding it (keeps it out of `ps e` output)
QUEUE_MAX = "SPECTUNER_PLUGIN_QUEUE_MAX"  # step records held while the sidecar is slow (default 20000)
BATCH_MAX = "SPECTUNER_PLUGIN_BATCH_MAX"  # records per POST (default 512)
FLUSH_S = "SPECTUNER_PLUGIN_FLUSH_S"  # seconds between POSTs while steps arrive (default 0.25)
# "1": a decode-only K = 0 step skips the draft model's pass; "all": every K = 0 step, on an engine
# without prefix caching (collectors.vllm_plugin.k0_pass)
SKIP_K0_DRAFT_PASS = "SPECTUNER_SKIP_K0_DRAFT_PASS"


def env_flag(name: str, environ: dict[str, str] | None = None) -> bool:
    """A yes/no switch: "1", "true", "yes", "on" (any case) are yes; anything else, unset included, is no."""
    env = os.environ if environ is None else environ
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def k0_skip_mode(environ: dict[str, str] | None = None) -> str:
    """``SKIP_K0_DRAFT_PASS`` read: "all", "decode" (a yes of :func:`env_flag`) or "off"."""
    env = os.environ if environ is None else environ
    if env.get(SKIP_K0_DRAFT_PASS, "").strip().lower() == "all":
        return "all"
    return "decode" if env_flag(SKIP_K0_DRAFT_PASS, environ) else "off"


def read_token(environ: dict[str, str] | None = None) -> str | None:
    """The shared token from ``SPECTUNER_PLUGIN_TOKEN`` or the file named by ``SPECTUNER_PLUGIN_TOKEN_FILE``."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN, "").strip()
    if token:
        return token
    path = env.get(TOKEN_FILE, "").strip()
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError:
            return None
        return token or None
    return None


def env_number(name: str, default: float, environ: dict[str, str] | None = None) -> float:
    """A positive number from the environment; the default when unset or unusable (never raises:
    a typo here must not stop the engine)."""
    env = os.environ if environ is None else environ
    try:
        value = float(env.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default

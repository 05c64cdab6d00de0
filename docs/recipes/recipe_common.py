"""Shared by the fleet actuation recipes (stdlib only: they run wherever `kubectl` / `helm` do).

A recipe is a command for spectuner's command actuator: it reads ``{"speculative_config": {...}}`` on
stdin, changes vLLM's ``--speculative-config`` where the orchestrator keeps it, waits for the rollout,
and answers one JSON line on stdout: ``{"ok": true, "message": ...}``, or ``{"ok": false, "message": ...}``
— both with exit 0, so that the command actuator records the refusal's message itself (it reads a
non-zero exit as "exited with code N" and keeps the output as detail only). A refusal is also written to
stderr for a person running the recipe by hand; a recipe that crashes exits non-zero.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

FLAG = "--speculative-config"
_ALIASES = (FLAG, "--speculative_config")


class RecipeError(Exception):
    """Something the operator must see; the recipe answers ok: false with it."""


def answer(ok: bool, message: str) -> NoReturn:
    print(json.dumps({"ok": ok, "message": message}))
    if not ok:
        sys.stderr.write(f"refused: {message}\n")
    sys.exit(0)


def read_config(text: str) -> str | None:
    """vLLM's ``--speculative-config`` value for the actuator's payload; None: speculation off."""
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise RecipeError(f'stdin is not JSON ({exc}); expected {{"speculative_config": {{...}}}}') from exc
    config = payload.get("speculative_config") if isinstance(payload, dict) else None
    if not isinstance(config, dict):
        raise RecipeError('stdin must be {"speculative_config": {...}}')
    if not config or config.get("method") == "off":
        return None  # vLLM has no "off" method: no flag at all
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def with_spec(argv: Sequence[str], value: str | None) -> list[str]:
    """``argv`` with every ``--speculative-config X`` / ``--speculative-config=X`` removed and, unless
    ``value`` is None, ``--speculative-config value`` where the first one was (else at the end)."""
    out: list[str] = []
    at: int | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _ALIASES:
            at = len(out) if at is None else at
            i += 2
            continue
        if any(arg.startswith(alias + "=") for alias in _ALIASES):
            at = len(out) if at is None else at
            i += 1
            continue
        out.append(arg)
        i += 1
    if value is not None:
        at = len(out) if at is None else at
        out[at:at] = [FLAG, value]
    return out


def run(argv: Sequence[str], timeout_s: float) -> str:
    """Run one orchestrator command; its stdout, or RecipeError with its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RecipeError(f"{' '.join(argv[:3])} … did not finish within {timeout_s:g} s") from exc
    except OSError as exc:
        raise RecipeError(f"cannot run {argv[0]!r}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-500:]
        raise RecipeError(f"{' '.join(argv[:3])} … exited {done.returncode}: {tail}")
    return done.stdout


def wait_for_rollout(rollout: Sequence[str], timeout_s: float, undo: Sequence[str] | None, undone: str) -> None:
    """Run the rollout check; if it fails, run ``undo`` (None: ``--no-undo``), wait for that rollout and
    raise RecipeError saying ``undone`` (what the undo did)."""
    slack_s = 120.0  # the check's own start-up on top of its --timeout
    try:
        run(rollout, timeout_s + slack_s)
    except RecipeError as exc:
        if undo is None:
            raise RecipeError(f"rollout failed and was left as it is (--no-undo): {exc}") from exc
        run(undo, 300.0)
        run(rollout, timeout_s + slack_s)
        raise RecipeError(f"rollout failed, {undone}: {exc}") from exc


def what_was_set(value: str | None) -> str:
    return "without --speculative-config" if value is None else f"with --speculative-config {value}"


def main(body: Callable[[str], str]) -> NoReturn:
    """Run ``body(stdin) -> success message``; any RecipeError is the answer ok: false."""
    try:
        message = body(sys.stdin.read())
    except RecipeError as exc:
        answer(False, str(exc))
    answer(True, message)


def load_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RecipeError(f"{what} is not JSON: {exc}") from exc

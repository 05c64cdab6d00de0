"""Hand a config to an external orchestrator command: the config as JSON on stdin, exit 0 = applied.

The command may print a JSON object on stdout; ``{"ok": false, "message": ...}`` is a refusal even
with exit 0 (an orchestrator that reports errors in its answer, not its exit code)."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Sequence

from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, VllmSpec

log = logging.getLogger(__name__)


def answer_refusal(text: str) -> str | None:
    """The refusal message in an orchestrator's JSON answer, or None if it did not refuse."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict) and data.get("ok") is False:
        return str(data.get("message") or data.get("error") or "refused without a message")
    return None


class CommandActuator(Actuator):
    kind = "command"

    def __init__(self, argv: Sequence[str], timeout_s: float = 60.0) -> None:
        super().__init__()
        if not argv:
            raise ValueError("the command actuator needs a command line (argv) but got an empty one")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive but got {timeout_s}")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    def apply(self, config: VllmSpec) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged:
            return unchanged
        payload = json.dumps({"speculative_config": config}, sort_keys=True)
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                self.argv, input=payload, capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stderr or b"")[-2000:]
            return ApplyResult(
                ApplyStatus.FAILED,
                f"command {self.argv[0]} did not finish within {self.timeout_s:g} s; it was killed and the "
                "config may or may not be in force — check the orchestrator",
                self.current,
                detail=out.decode(errors="replace") if isinstance(out, bytes) else str(out),
            )
        except OSError as exc:
            return ApplyResult(
                ApplyStatus.FAILED,
                f"cannot run command {self.argv[0]!r}: {exc}; fix [actuator.command] argv",
                self.current,
            )
        elapsed_s = time.monotonic() - t0
        if done.returncode != 0:
            return ApplyResult(
                ApplyStatus.FAILED,
                f"command {self.argv[0]} exited with code {done.returncode}; the old config stays",
                self.current,
                detail=(done.stderr or done.stdout)[-2000:],
            )
        refusal = answer_refusal(done.stdout)
        if refusal is not None:
            return ApplyResult(
                ApplyStatus.FAILED,
                f"command {self.argv[0]} refused the config: {refusal}",
                self.current,
                detail=done.stdout[-2000:],
            )
        self.current = dict(config)
        log.info("command actuator: %s applied the config in %.1f s", self.argv[0], elapsed_s)
        return ApplyResult(
            ApplyStatus.APPLIED,
            f"command {self.argv[0]} applied the config",
            self.current,
            None,
            detail=done.stdout[-2000:],
        )

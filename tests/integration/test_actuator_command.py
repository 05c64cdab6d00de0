"""The command actuator against real processes: success, failure, refusal, timeout, idempotence."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tuner.actuators import ApplyStatus, CommandActuator

CFG = {"method": "ngram", "num_speculative_tokens": 4}


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "orchestrator.py"
    path.write_text("import json, sys, time\n" + body)
    return [sys.executable, str(path)]


def test_success_hands_the_config_on_stdin_and_is_idempotent(tmp_path: Path) -> None:
    seen = tmp_path / "seen.jsonl"
    argv = script(tmp_path, f"open({str(seen)!r}, 'a').write(sys.stdin.read() + '\\n')\nprint('{{\"ok\": true}}')\n")
    act = CommandActuator(argv, timeout_s=20)
    result = act.apply(CFG)
    assert result.status is ApplyStatus.APPLIED and act.current == CFG
    assert [json.loads(line) for line in seen.read_text().splitlines()] == [{"speculative_config": CFG}]
    assert act.apply(dict(CFG)).status is ApplyStatus.UNCHANGED
    assert len(seen.read_text().splitlines()) == 1  # the command did not run again


def test_nonzero_exit_is_a_failure_with_stderr(tmp_path: Path) -> None:
    argv = script(tmp_path, "sys.stderr.write('cluster says no\\n'); sys.exit(5)\n")
    act = CommandActuator(argv, timeout_s=20)
    act.current = {"method": "off"}
    result = act.apply(CFG)
    assert result.status is ApplyStatus.FAILED and "code 5" in result.message
    assert "cluster says no" in result.detail and act.current == {"method": "off"}  # old config kept


def test_refusal_in_the_answer_is_a_failure(tmp_path: Path) -> None:
    argv = script(tmp_path, "print(json.dumps({'ok': False, 'message': 'quota exceeded'}))\n")
    result = CommandActuator(argv, timeout_s=20).apply(CFG)
    assert result.status is ApplyStatus.FAILED and "quota exceeded" in result.message


def test_timeout_kills_the_command(tmp_path: Path) -> None:
    argv = script(tmp_path, "time.sleep(30)\n")
    t0 = time.monotonic()
    result = CommandActuator(argv, timeout_s=1.0).apply(CFG)
    assert time.monotonic() - t0 < 10
    assert result.status is ApplyStatus.FAILED and "did not finish within 1 s" in result.message


def test_missing_command_says_what_to_fix(tmp_path: Path) -> None:
    result = CommandActuator([str(tmp_path / "no-such-binary")]).apply(CFG)
    assert result.status is ApplyStatus.FAILED and "[actuator.command] argv" in result.message

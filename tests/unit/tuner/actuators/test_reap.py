"""The restart actuator's wait for an orphaned engine group leaves no zombie of ours behind."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.actuators import restart
from tuner.engine.process import group_alive


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_leader_that_exits_after_the_first_reap_is_reaped_before_the_wait_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The window a loaded CI run hit: the leader exits between the first waitpid and the scan, so the
    # scan sees only a zombie. The zombie is ours; the wait must not end with it still there.
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    deadline = time.monotonic() + 30
    while _state(child.pid) != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    calls: list[int] = []
    real = restart._reap_own_child

    def first_reap_misses(pid: int) -> None:
        calls.append(pid)
        if len(calls) > 1:
            real(pid)

    monkeypatch.setattr(restart, "_reap_own_child", first_reap_misses)
    assert not restart._alive_reaping(child.pid)
    assert not group_alive(child.pid)
    assert len(calls) == 2


def test_a_running_group_is_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert restart._alive_reaping(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not restart._alive_reaping(child.pid)

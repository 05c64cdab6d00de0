"""free_port chooses ports the kernel will not hand to an outgoing connection a moment later."""

from __future__ import annotations

import socket
from collections import deque
from pathlib import Path

import pytest

from tuner.engine import process
from tuner.engine.process import ephemeral_port_range, free_port, port_is_free


def test_a_chosen_port_is_bindable_outside_the_ephemeral_range_and_not_repeated() -> None:
    low, high = ephemeral_port_range()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)  # nothing binds them between calls, yet none comes twice
    for port in ports:
        assert not low <= port <= high
        assert port_is_free(port)


def test_a_port_in_use_or_just_handed_out_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    # A range leaving only 65534 and 65535 to choose from, 65534 taken: 65535, and then the kernel's choice.
    monkeypatch.setattr(process, "_handed_out", deque(maxlen=64))
    if not (port_is_free(65534) and port_is_free(65535)):
        pytest.skip("ports 65534-65535 are in use on this host")
    low, high = ephemeral_port_range()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 65534))
        first, second = free_port(ephemeral=(10000, 65533)), free_port(ephemeral=(10000, 65533))
    assert first == 65535
    assert second not in (65534, 65535) and low <= second <= high


def test_a_range_covering_every_port_falls_back_to_the_kernel_choice() -> None:
    assert port_is_free(free_port(ephemeral=(1024, 65535)))


def test_an_unreadable_range_file_means_the_linux_default(tmp_path: Path) -> None:
    assert ephemeral_port_range(tmp_path / "missing") == (32768, 60999)
    (tmp_path / "bad").write_text("nonsense\n")
    assert ephemeral_port_range(tmp_path / "bad") == (32768, 60999)
    (tmp_path / "ok").write_text("20000\t30000\n")
    assert ephemeral_port_range(tmp_path / "ok") == (20000, 30000)

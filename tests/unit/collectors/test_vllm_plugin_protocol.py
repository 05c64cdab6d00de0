"""The plugin's wire/protocol helpers: addresses, table ↔ lookup, per-batch K, env parsing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.vllm_plugin import env
from collectors.vllm_plugin.control import vllm_lookup_builder
from collectors.vllm_plugin.protocol import Address, AddressError, k_for_batch, lookup_to_table
from collectors.vllm_plugin.wire import drafted_k


def test_address_loopback_tcp_and_unix() -> None:
    assert Address.parse("127.0.0.1:8765") == Address(host="127.0.0.1", port=8765)
    assert Address.parse("[::1]:9") == Address(host="::1", port=9)
    assert Address.parse("unix:/run/x.sock") == Address(unix_path="/run/x.sock")
    assert str(Address.parse("unix:/run/x.sock").for_rank(2)) == "unix:/run/x.sock.2"
    assert Address.parse("127.0.0.1:8765").for_rank(1).port == 8766


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("0.0.0.0:8765", "not on loopback"),
        ("10.1.2.3:1", "not on loopback"),
        ("unix:", "no path"),
        ("unix:relative.sock", "absolute"),
        ("localhost", "HOST:PORT"),
        ("127.0.0.1:http", "HOST:PORT"),
    ],
)
def test_address_refusals_say_why(text: str, fragment: str) -> None:
    with pytest.raises(AddressError, match=fragment):
        Address.parse(text)


@st.composite
def tables(draw: st.DrawFn) -> list[list[int]]:
    """Contiguous valid tables starting at 1 (what the controller sends)."""
    rows, lo = [], 1
    for _ in range(draw(st.integers(1, 4))):
        hi = lo + draw(st.integers(0, 10))
        rows.append([lo, hi, draw(st.integers(0, 6))])
        lo = hi + 1
    return rows


@settings(max_examples=150, deadline=None)
@given(table=tables(), max_num_seqs=st.integers(1, 40), k_max=st.integers(1, 6))
def test_lookup_round_trip_matches_vllm(table: list[list[int]], max_num_seqs: int, k_max: int) -> None:
    """Our per-batch K reading of a table agrees with vLLM's own dense lookup, and the compressed
    read-back of that lookup gives the same K at every batch size."""
    lookup = vllm_lookup_builder(table, max_num_seqs, k_max)
    back = lookup_to_table(lookup)
    for b in range(1, max_num_seqs + 1):
        want = min(k_for_batch(table, b) or 0, k_max)
        assert lookup[b] == want
        assert k_for_batch(back, b) == want


def test_k_for_batch_edges() -> None:
    assert k_for_batch([], 3) is None
    assert k_for_batch([[1, 4, 5], [5, 8, 2]], 0) is None
    assert k_for_batch([[1, 4, 5], [5, 8, 2]], 100) == 2  # vLLM carries the last row forward


def test_drafted_k_is_last_position_reached() -> None:
    assert drafted_k({"dp": [4, 4, 0, 0, 0]}) == 2
    assert drafted_k({"dp": [0, 0, 0]}) == 0
    assert drafted_k({"dp": []}) == 0


def test_env_token_and_numbers(tmp_path: object) -> None:
    from pathlib import Path

    p = Path(str(tmp_path)) / "tok"
    p.write_text("  s3cret\n")
    assert env.read_token({env.TOKEN: "a"}) == "a"
    assert env.read_token({env.TOKEN_FILE: str(p)}) == "s3cret"
    assert env.read_token({env.TOKEN_FILE: str(p) + ".missing"}) is None
    assert env.read_token({}) is None
    assert env.env_number("X", 3.0, {"X": "0.5"}) == 0.5
    assert env.env_number("X", 3.0, {"X": "-1"}) == 3.0  # a typo never stops the engine
    assert env.env_number("X", 3.0, {"X": "abc"}) == 3.0

"""bench_live's wait after a live K change: a cell starts only once the engine drafts at the new K."""

from __future__ import annotations

from collections.abc import Iterator

import bench.bench_live as bench_live


def feed(steps: list[tuple[int, int]]) -> Iterator[dict[str, float]]:
    """Cumulative counters after each poll; ``steps``: (drafts, tokens per draft) made between polls."""
    drafts = tokens = 0.0
    yield {"drafts": drafts, "draft_tokens": tokens}
    for n, k in steps:
        drafts, tokens = drafts + n, tokens + n * k
        yield {"drafts": drafts, "draft_tokens": tokens}
    while True:
        yield {"drafts": drafts, "draft_tokens": tokens}


def wait(steps: list[tuple[int, int]], k: int, stepped: bool = True, timeout_s: float = 5.0) -> tuple[int, bool]:
    reads = feed(steps)
    polls = {"n": 0}

    def counters() -> dict[str, float]:
        polls["n"] += 1
        return next(reads)

    _, ok = bench_live.await_k(counters, lambda a, b: stepped, k, min_s=0.0, timeout_s=timeout_s, poll_s=0.001)
    return polls["n"], ok


def test_k0_waits_until_steps_without_drafts() -> None:
    # two polls still verify K = 5 drafts (the steps already under way), then the table's K = 0 holds
    polls, ok = wait([(64, 5), (64, 5), (0, 0), (0, 0)], 0)
    assert ok and polls == 5  # the first read, two at K = 5, two at K = 0


def test_k_above_zero_needs_drafts_of_that_length_twice_in_a_row() -> None:
    polls, ok = wait([(16, 5), (16, 3), (16, 4), (16, 3), (16, 3)], 3)
    assert ok and polls == 6  # 5, 3, then a mixed poll (4) starts the count over, then 3, 3


def test_no_drafts_at_k_above_zero_runs_out_and_says_so() -> None:
    polls, ok = wait([], 3, timeout_s=0.05)
    assert not ok and polls > 2


def test_k0_needs_the_engine_to_have_stepped() -> None:
    _, ok = wait([], 0, stepped=False, timeout_s=0.05)
    assert not ok


def test_table_k_looks_up_the_batch_size() -> None:
    table = [[1, 2, 5], [3, 6, 3], [7, 64, 0]]
    assert [bench_live.table_k(table, b) for b in (1, 3, 6, 7, 64, 80)] == [5, 3, 3, 0, 0, 0]

"""The front door's hold queue with a fake clock: bound, order, expiry (503 past the bound), cancel."""

from __future__ import annotations

import pytest

from collectors.hold import HoldQueue, Outcome, Ticket


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(max_hold_s: float = 10.0, max_held: int = 3) -> tuple[HoldQueue, FakeClock, list[Ticket]]:
    clock = FakeClock()
    decided: list[Ticket] = []
    return HoldQueue(max_hold_s=max_hold_s, max_held=max_held, clock=clock), clock, decided


def test_release_is_first_in_first_out_and_records_the_longest_hold() -> None:
    queue, clock, decided = make()
    first = queue.enter(decided.append)
    clock.now += 2
    second = queue.enter(decided.append)
    clock.now += 3
    assert first is not None and second is not None
    released = queue.release("http://new")
    assert [t.seq for t in released] == [first.seq, second.seq]
    assert decided == released  # callbacks ran in the same order
    assert all(t.outcome is Outcome.RELEASED and t.upstream == "http://new" for t in released)
    assert (first.held_s, second.held_s) == (5.0, 3.0)
    assert queue.stats.longest_hold_s == 5.0 and queue.stats.released == 2 and len(queue) == 0


def test_the_queue_is_bounded_and_a_full_queue_refuses_at_once() -> None:
    queue, _, decided = make(max_held=2)
    assert queue.enter(decided.append) is not None
    assert queue.enter(decided.append) is not None
    assert queue.enter(decided.append) is None
    assert queue.stats.refused == 1 and queue.stats.held == 2 and len(queue) == 2


def test_past_the_bound_a_held_request_expires_and_only_that_one() -> None:
    queue, clock, decided = make(max_hold_s=10.0)
    old = queue.enter(decided.append)
    clock.now += 6
    young = queue.enter(decided.append)
    clock.now += 3.9  # old held 9.9 s: not yet
    assert queue.expire() == []
    clock.now += 0.1  # old held 10 s: the bound
    assert queue.expire() == [old]
    assert old is not None and old.outcome is Outcome.EXPIRED and old.held_s == 10.0
    assert young is not None and young.outcome is None
    assert queue.stats.expired == 1 and len(queue) == 1


def test_release_expires_what_is_already_past_the_bound_instead_of_sending_it() -> None:
    queue, clock, decided = make(max_hold_s=10.0)
    late = queue.enter(decided.append)
    clock.now += 8
    ok = queue.enter(decided.append)
    clock.now += 2.5
    released = queue.release("http://new")
    assert released == [ok]
    assert late is not None and late.outcome is Outcome.EXPIRED


def test_release_of_a_count_takes_the_oldest() -> None:
    queue, _, decided = make()
    tickets = [queue.enter(decided.append) for _ in range(3)]
    assert [t.seq for t in queue.release("http://a", count=1)] == [tickets[0].seq]  # type: ignore[union-attr]
    assert [t.seq for t in queue.release("http://b", count=5)] == [t.seq for t in tickets[1:]]  # type: ignore[union-attr]


def test_a_client_cancelling_while_held_leaves_the_queue_and_frees_its_place() -> None:
    queue, clock, decided = make(max_held=1)
    ticket = queue.enter(decided.append)
    assert ticket is not None
    clock.now += 1
    assert queue.cancel(ticket) is True
    assert ticket.outcome is Outcome.CANCELLED and ticket.held_s == 1.0
    assert queue.cancel(ticket) is False  # decided once
    assert queue.release("http://new") == []  # never forwarded
    assert queue.enter(decided.append) is not None  # its place is free again
    assert queue.stats.cancelled == 1


def test_new_period_returns_the_finished_figures_and_starts_from_zero() -> None:
    queue, clock, decided = make()
    queue.enter(decided.append)
    clock.now += 4
    queue.release("http://x")
    finished = queue.new_period()
    assert finished.held == 1 and finished.longest_hold_s == 4.0
    assert queue.stats.held == 0 and queue.stats.longest_hold_s == 0.0


@pytest.mark.parametrize(("max_hold_s", "max_held"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_bounds_are_refused(max_hold_s: float, max_held: int) -> None:
    with pytest.raises(ValueError):
        HoldQueue(max_hold_s=max_hold_s, max_held=max_held, clock=FakeClock())

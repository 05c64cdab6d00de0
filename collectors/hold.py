"""The front door's hold queue: requests that arrive while no engine may take them wait here.

Plain bookkeeping with an injected clock (no I/O, no event loop), so its bound, order, expiry and
cancellation are tested with a fake clock. The tap (``collectors.front_door``) turns each
:class:`Ticket`'s outcome into what the client sees: forwarded to the released upstream, or a 503
with ``Retry-After`` when held past the bound or refused because the queue is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class Outcome(StrEnum):
    RELEASED = "released"  # forwarded to ``Ticket.upstream``
    EXPIRED = "expired"  # held past the bound: answer 503 with Retry-After
    CANCELLED = "cancelled"  # its client went away while held: nothing to answer


@dataclass
class Ticket:
    """One held request."""

    seq: int
    entered_s: float
    on_done: Callable[[Ticket], None] = field(repr=False)
    outcome: Outcome | None = None
    upstream: str | None = None
    held_s: float = 0.0


@dataclass
class HoldStats:
    """What holding cost clients over one period (one change)."""

    held: int = 0  # requests that were held (any outcome)
    released: int = 0
    expired: int = 0
    cancelled: int = 0
    refused: int = 0  # turned away at once: the queue was full
    longest_hold_s: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


class HoldQueue:
    """At most ``max_held`` requests, released first in first out, each for at most ``max_hold_s``."""

    def __init__(self, *, max_hold_s: float, max_held: int, clock: Callable[[], float]) -> None:
        if not max_hold_s > 0:
            raise ValueError(f"max_hold_s must be positive but got {max_hold_s}")
        if max_held < 1:
            raise ValueError(f"max_held must be at least 1 but got {max_held}")
        self.max_hold_s = max_hold_s
        self.max_held = max_held
        self.clock = clock
        self.stats = HoldStats()
        self._waiting: OrderedDict[int, Ticket] = OrderedDict()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, on_done: Callable[[Ticket], None]) -> Ticket | None:
        """Hold a request; None when the queue is full (the caller refuses it at once)."""
        if len(self._waiting) >= self.max_held:
            self.stats.refused += 1
            return None
        self._seq += 1
        ticket = Ticket(self._seq, self.clock(), on_done)
        self._waiting[ticket.seq] = ticket
        self.stats.held += 1
        return ticket

    def deadline_s(self, ticket: Ticket) -> float:
        return ticket.entered_s + self.max_hold_s

    def release(self, upstream: str, count: int | None = None) -> list[Ticket]:
        """Send held requests (all, or the ``count`` oldest) to ``upstream``, oldest first; those
        already past the bound expire instead."""
        self.expire()
        done: list[Ticket] = []
        while self._waiting and (count is None or len(done) < count):
            _, ticket = self._waiting.popitem(last=False)
            ticket.upstream = upstream
            self._finish(ticket, Outcome.RELEASED)
            done.append(ticket)
        return done

    def expire(self) -> list[Ticket]:
        """Give up on the requests held longer than the bound (oldest first)."""
        now = self.clock()
        done: list[Ticket] = []
        for seq, ticket in list(self._waiting.items()):
            if now - ticket.entered_s < self.max_hold_s:
                break  # FIFO: every later one entered later
            del self._waiting[seq]
            self._finish(ticket, Outcome.EXPIRED)
            done.append(ticket)
        return done

    def cancel(self, ticket: Ticket) -> bool:
        """The client left while held; False if the ticket was already decided."""
        if self._waiting.pop(ticket.seq, None) is None:
            return False
        self._finish(ticket, Outcome.CANCELLED)
        return True

    def new_period(self) -> HoldStats:
        """Start counting a new change; returns the finished period's figures."""
        old, self.stats = self.stats, HoldStats()
        return old

    def _finish(self, ticket: Ticket, outcome: Outcome) -> None:
        ticket.outcome = outcome
        ticket.held_s = max(0.0, self.clock() - ticket.entered_s)
        stats = self.stats
        stats.longest_hold_s = max(stats.longest_hold_s, ticket.held_s)
        if outcome is Outcome.RELEASED:
            stats.released += 1
        elif outcome is Outcome.EXPIRED:
            stats.expired += 1
        else:
            stats.cancelled += 1
        ticket.on_done(ticket)

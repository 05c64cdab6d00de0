"""The front door: which engine(s) the tap sends each new request to, and holding while none may.

The tap asks :meth:`FrontDoor.admit` for an upstream per request and calls :meth:`FrontDoor.done`
when the exchange (stream included) is over, so the door knows each upstream's in-flight count. An
actuator changing the engine drives the door through the tap's control endpoint
(``POST /_spectuner/control``, bearer token):

- ``hold``: new arrivals wait in a bounded queue (``collectors.hold``); requests already sent on keep
  going. A hold has a lease: if nobody releases it in time the door releases it on its own;
- ``drain``: wait (bounded) until an upstream has nothing in flight;
- ``release``: optionally set the upstreams, then send the held requests to them, oldest first;
- ``set_upstreams``: switch atomically (blue/green, rolling): new requests go to the new set, requests
  in flight on a removed upstream finish there;
- ``remove_upstream`` / ``add_upstream``: take one replica out of rotation and put it back, leaving the
  others as they are (one sidecar per replica edits only its own: two sidecars' full ``set_upstreams``
  would overwrite each other). Removing the last upstream is refused: then a hold is the way;
- ``state``: the door's state and the current period's client impact.

A request is never sent twice: held requests have reached no engine, and nothing that reached one
is replayed. Several upstreams share the load by fewest requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collectors.hold import HoldQueue, HoldStats, Outcome, Ticket

logger = logging.getLogger(__name__)

CONTROL_PATH = "/_spectuner/control"
DEFAULT_MAX_HOLD_S = 120.0  # above the lab engine's measured restart (~45-60 s on 2 cores)
DEFAULT_MAX_HELD = 1000
DEFAULT_LEASE_S = 900.0


class ControlError(ValueError):
    """A control request the door cannot act on; the message says why."""


@dataclass
class Refusal:
    """Why a request gets a 503 instead of an upstream."""

    reason: str  # "held_too_long", "hold_queue_full"
    retry_after_s: int


@dataclass
class Period:
    """Client impact since the period began (one change)."""

    started_s: float
    failed: int = 0  # requests answered with an error the tap made (502/503/504) or cut short
    drain_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class FrontDoor:
    """Loop-owned state (all methods run on the tap's event loop)."""

    def __init__(
        self,
        upstreams: list[str],
        *,
        max_hold_s: float = DEFAULT_MAX_HOLD_S,
        max_held: int = DEFAULT_MAX_HELD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not upstreams:
            raise ValueError("the front door needs at least one upstream")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.queue = HoldQueue(max_hold_s=max_hold_s, max_held=max_held, clock=clock)
        self.clock = clock
        self.holding = False
        self.inflight: Counter[str] = Counter()
        self.period = Period(clock())
        self._idle_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._lease: asyncio.TimerHandle | None = None

    # -- the request path ---------------------------------------------------------------------------
    def pick(self) -> str | None:
        """The upstream for a new request now, or None when it must be held."""
        if self.holding or not self.upstreams:
            return None
        if len(self.upstreams) == 1:
            return self.upstreams[0]
        return min(self.upstreams, key=lambda u: self.inflight[u])

    async def admit(self, client_gone: Callable[[], asyncio.Future[Any]]) -> str | Refusal | None:
        """An upstream for this request (its in-flight count taken), a refusal, or None if the client
        left while held. ``client_gone`` starts waiting for the client's disconnect."""
        upstream = self.pick()
        if upstream is not None:
            self.inflight[upstream] += 1
            return upstream
        loop = asyncio.get_running_loop()
        decided: asyncio.Future[Ticket] = loop.create_future()

        def decide(t: Ticket) -> None:
            if not decided.done():
                decided.set_result(t)

        ticket = self.queue.enter(decide)
        if ticket is None:
            self.period.failed += 1
            return Refusal("hold_queue_full", self._retry_after_s())
        gone = client_gone()
        try:
            while not decided.done():
                timeout_s = max(0.0, self.queue.deadline_s(ticket) - self.clock())
                await asyncio.wait({decided, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
                if decided.done():
                    break
                if gone.done():
                    self.queue.cancel(ticket)
                    return None
                self.queue.expire()
        except asyncio.CancelledError:  # the server is shutting down
            if not self.queue.cancel(ticket) and ticket.upstream is not None:
                self.done(ticket.upstream)
            raise
        finally:
            if not gone.done():
                gone.cancel()
        if ticket.outcome is Outcome.RELEASED and ticket.upstream is not None:
            return ticket.upstream  # its in-flight count was taken when released
        if ticket.outcome is Outcome.EXPIRED:
            self.period.failed += 1
            return Refusal("held_too_long", self._retry_after_s())
        return None

    def done(self, upstream: str, failed: bool = False) -> None:
        """The exchange with ``upstream`` is over (``failed``: the tap answered an error or cut it short)."""
        self.inflight[upstream] -= 1
        if failed:
            self.period.failed += 1
        if self.inflight[upstream] <= 0:
            del self.inflight[upstream]
            for waiter in self._idle_waiters.pop(upstream, []):
                if not waiter.done():
                    waiter.set_result(None)

    def _retry_after_s(self) -> int:
        return max(1, round(self.queue.max_hold_s / 4))

    # -- control --------------------------------------------------------------------------------------
    def hold(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.holding = True
        if self._lease is not None:
            self._lease.cancel()
        self._lease = asyncio.get_running_loop().call_later(lease_s, self._lease_ran_out)

    def _lease_ran_out(self) -> None:
        logger.warning("front door: a hold was not released within its lease; releasing to %s", self.upstreams)
        self._lease = None
        self.release(None)

    def release(self, upstreams: list[str] | None) -> list[Ticket]:
        if upstreams is not None:
            self.set_upstreams(upstreams)
        self.holding = False
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        released: list[Ticket] = []
        while len(self.queue) and (upstream := self.pick()) is not None:
            # One at a time so that, with several upstreams, each picks the least busy one.
            tickets = self.queue.release(upstream, count=1)
            self.inflight[upstream] += len(tickets)
            released += tickets
        return released

    def set_upstreams(self, upstreams: list[str]) -> None:
        self.upstreams = [u.rstrip("/") for u in upstreams]
        if self.upstreams and not self.holding and len(self.queue):
            self.release(None)

    def remove_upstream(self, upstream: str) -> None:
        upstream = upstream.rstrip("/")
        if upstream not in self.upstreams:
            return
        if self.upstreams == [upstream]:
            raise ControlError(
                f"{upstream} is the only upstream in rotation; removing it would leave none (hold instead)"
            )
        self.upstreams = [u for u in self.upstreams if u != upstream]

    def add_upstream(self, upstream: str) -> None:
        upstream = upstream.rstrip("/")
        if upstream not in self.upstreams:
            self.set_upstreams([*self.upstreams, upstream])

    async def drain(self, upstream: str, timeout_s: float) -> tuple[float, int]:
        """Wait until ``upstream`` has nothing in flight (at most ``timeout_s``): (seconds, left)."""
        upstream = upstream.rstrip("/")
        t0 = self.clock()
        if self.inflight[upstream] > 0:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle_waiters.setdefault(upstream, []).append(waiter)
            try:
                await asyncio.wait_for(waiter, timeout_s)
            except TimeoutError:
                logger.warning(
                    "front door: %d request(s) still in flight on %s after %.0f s of drain",
                    self.inflight[upstream], upstream, timeout_s,
                )
        drain_s = self.clock() - t0
        self.period.drain_s += drain_s
        return drain_s, self.inflight[upstream]

    def new_period(self) -> None:
        self.queue.new_period()
        self.period = Period(self.clock())

    def state(self) -> dict[str, Any]:
        hold: HoldStats = self.queue.stats
        return {
            "upstreams": list(self.upstreams),
            "holding": self.holding,
            "held_now": len(self.queue),
            "in_flight": dict(self.inflight),
            "period": {
                **hold.as_dict(),
                "failed": self.period.failed,
                "drain_s": self.period.drain_s,
                "elapsed_s": self.clock() - self.period.started_s,
            },
        }

    async def control(self, request: dict[str, Any]) -> dict[str, Any]:
        """One control request (the endpoint's JSON body); raises :class:`ControlError`."""
        op = request.get("op")
        if request.get("new_period"):
            self.new_period()
        answer: dict[str, Any] = {}
        if op == "hold":
            self.hold(_positive(request, "lease_s", DEFAULT_LEASE_S))
        elif op == "release":
            self.release(_upstreams(request, required=False))
        elif op == "set_upstreams":
            upstreams = _upstreams(request, required=True)
            assert upstreams is not None
            self.set_upstreams(upstreams)
        elif op in ("remove_upstream", "add_upstream"):
            upstream = _upstream(request, op)
            (self.remove_upstream if op == "remove_upstream" else self.add_upstream)(upstream)
        elif op == "drain":
            upstream = _upstream(request, op)
            drain_s, left = await self.drain(upstream, _positive(request, "timeout_s", 30.0))
            answer = {"drain_s": drain_s, "left": left}
        elif op != "state":
            raise ControlError(
                f"unknown op {op!r}; one of hold, release, set_upstreams, remove_upstream, add_upstream, drain, state"
            )
        return {**answer, **self.state()}


def _upstream(request: dict[str, Any], op: str) -> str:
    upstream = request.get("upstream")
    if not isinstance(upstream, str) or not upstream.startswith("http"):
        raise ControlError(f"{op} needs 'upstream': an http(s) URL")
    return upstream


def _positive(request: dict[str, Any], key: str, default: float) -> float:
    value = request.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ControlError(f"{key} must be a positive number of seconds but got {value!r}")
    return float(value)


def _upstreams(request: dict[str, Any], *, required: bool) -> list[str] | None:
    value = request.get("upstreams")
    if value is None and not required:
        return None
    if not isinstance(value, list) or not all(isinstance(u, str) and u.startswith("http") for u in value):
        raise ControlError("'upstreams' must be a list of http(s) URLs")
    return value

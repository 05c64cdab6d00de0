"""What a K-choice needs from acceptance: E(K) with an interval, for any K.

Purely computational. The controller's implementation is :class:`ConstantAlphaModel` (the i.i.d. model,
E(α, K) with α's interval mapped through the monotone E); the protocol lets a per-position model (with a
fitted decay beyond the observed K) stand in where one earns its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from policies.speedup import check_alpha, check_k, expected_tokens_per_step


class AcceptanceModel(Protocol):
    """Expected tokens emitted per verify step at K, and an interval for it."""

    def expected_tokens(self, k: int) -> float: ...

    def expected_tokens_interval(self, k: int) -> tuple[float, float]: ...


@dataclass(frozen=True)
class ConstantAlphaModel:
    """i.i.d. acceptance α with interval (lo, hi); E is increasing in α, so E's interval is exact."""

    alpha: float
    alpha_lo: float
    alpha_hi: float

    def __post_init__(self) -> None:
        for value in (self.alpha, self.alpha_lo, self.alpha_hi):
            check_alpha(value)
        if not self.alpha_lo <= self.alpha <= self.alpha_hi:
            raise ValueError(
                f"alpha interval must contain alpha but got {self.alpha_lo} ≤ {self.alpha} ≤ {self.alpha_hi}"
            )

    @classmethod
    def exact(cls, alpha: float) -> ConstantAlphaModel:
        """A known α (no uncertainty): what ``spectuner recommend --alpha`` means."""
        return cls(alpha, alpha, alpha)


    def expected_tokens(self, k: int) -> float:
        check_k(k)
        return expected_tokens_per_step(self.alpha, k)

    def expected_tokens_interval(self, k: int) -> tuple[float, float]:
        check_k(k)
        return (expected_tokens_per_step(self.alpha_lo, k), expected_tokens_per_step(self.alpha_hi, k))

"""The live-K control channel's protocol (stdlib only; the engine-core server and the sidecar client).

One request per connection: the client writes one JSON object and a newline, the server answers one
JSON object and a newline, then closes. Requests::

    {"token": "...", "op": "get"}
    {"token": "...", "op": "set", "table": [[lo, hi, k], ...]}

Answers: ``{"ok": true, "state": {...}}`` or ``{"ok": false, "code": CODE, "error": "sentence", "state"?: {...}}``
with CODE one of ``bad_token``, ``bad_request``, ``unsupported``, ``invalid_table``, ``internal``.
``state`` (see :class:`ControlState`) is what the scheduler uses right now, read back after a set.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_REQUEST_BYTES = 64 * 1024
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


class AddressError(ValueError):
    """A control address that is not loopback TCP or a Unix socket path."""


@dataclass(frozen=True)
class Address:
    """``unix:/path`` or ``HOST:PORT`` with a loopback HOST."""

    unix_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> Address:
        text = text.strip()
        if text.startswith("unix:"):
            path = text[len("unix:") :]
            if not path:
                raise AddressError(f"control address {text!r} has no path; write unix:/run/spectuner/control.sock")
            if not path.startswith("/"):
                # The engine and the sidecar run in different directories: a relative path would differ.
                raise AddressError(f"control address {text!r} needs an absolute socket path (unix:/abs/path)")
            return cls(unix_path=path)
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not port.isdigit():
            raise AddressError(f"control address {text!r} is not HOST:PORT or unix:/path")
        if host not in LOOPBACK_HOSTS:
            raise AddressError(
                f"control address {text!r} is not on loopback; the control channel only binds 127.0.0.1, ::1 "
                "or a Unix socket"
            )
        return cls(host=host, port=int(port))

    def for_rank(self, rank: int) -> Address:
        """Data-parallel rank ``rank`` > 0 listens at PORT+rank or PATH.rank."""
        if rank <= 0:
            return self
        if self.unix_path is not None:
            return Address(unix_path=f"{self.unix_path}.{rank}")
        return Address(host=self.host, port=self.port + rank if self.port else 0)

    def __str__(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path is not None else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ControlState:
    """What the engine core reports about live K."""

    supported: bool
    reason: str  # why not, when unsupported; "" otherwise
    vllm_version: str
    k_max: int  # the K the engine started with: no table entry may exceed it
    max_num_seqs: int
    table: list[list[int]] = field(default_factory=list)  # read back from the scheduler's lookup
    allowed_k: list[int] = field(default_factory=list)  # K values the engine can run (0..k_max on CPU)
    generation: int = 0  # bumps on every successful set
    set_count: int = 0
    refused: int = 0  # requests refused for a wrong token
    engine_index: int = 0
    pid: int = field(default_factory=os.getpid)
    # The plugin's detected features (collectors.vllm_plugin.features names → present); {} from an
    # older plugin. "k_table" False: the engine cannot take num_speculative_tokens_per_batch_size.
    features: dict[str, bool] = field(default_factory=dict)
    # "skipped": decode-only K = 0 steps skip the draft model's pass (SPECTUNER_SKIP_K0_DRAFT_PASS,
    # collectors.vllm_plugin.k0_pass); "runs": vLLM's own behaviour. k0_passes_skipped counts the skipped
    # passes, k0_passes_run the K = 0 steps that kept it (a prompt in the step).
    k0_draft_pass: str = "runs"
    k0_passes_skipped: int = 0
    k0_passes_run: int = 0
    # "skipped": steps with a prompt skip it too (SPECTUNER_SKIP_K0_DRAFT_PASS=all, an engine without prefix
    # caching); "unknown": asked, no such step seen yet; "runs": they keep it
    k0_prompt_pass: str = "runs"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ControlState:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def lookup_to_table(lookup: list[int]) -> list[list[int]]:
    """Compress vLLM's dense lookup (index = batch size, index 0 unused) back to [lo, hi, K] rows."""
    rows: list[list[int]] = []
    for batch_size in range(1, len(lookup)):
        k = int(lookup[batch_size])
        if rows and rows[-1][2] == k and rows[-1][1] == batch_size - 1:
            rows[-1][1] = batch_size
        else:
            rows.append([batch_size, batch_size, k])
    return rows


def k_for_batch(table: list[list[int]], batch_size: int) -> int | None:
    """K a table gives ``batch_size`` (vLLM carries the last row's K past the end), None for no rows."""
    if not table or batch_size < 1:
        return None
    k = table[0][2]
    for lo, hi, row_k in table:
        if lo <= batch_size <= hi:
            return int(row_k)
        if batch_size > hi:
            k = row_k
    return int(k)

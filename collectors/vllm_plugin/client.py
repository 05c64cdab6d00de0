"""The sidecar's client for the engine-core control channel (stdlib only)."""

from __future__ import annotations

import json
import socket
from typing import Any

from collectors.vllm_plugin.protocol import Address, ControlState


class ControlError(RuntimeError):
    """The control channel answered with an error (``code``) or could not be reached (``code`` = "unreachable")."""

    def __init__(self, code: str, message: str, state: ControlState | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.state = state


class ControlClient:
    """``get()`` and ``set_table()`` against one engine core's control channel."""

    def __init__(self, address: Address | str, token: str, timeout_s: float = 3.0) -> None:
        self.address = Address.parse(address) if isinstance(address, str) else address
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, request: dict[str, Any]) -> ControlState:
        payload = json.dumps({"token": self.token, **request}, separators=(",", ":")).encode() + b"\n"
        try:
            if self.address.unix_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                sock.connect(self.address.unix_path)
            else:
                sock = socket.create_connection((self.address.host, self.address.port), timeout=self.timeout_s)
        except OSError as exc:
            raise ControlError(
                "unreachable",
                f"no control channel at {self.address} ({exc}); is the engine running with "
                "SPECTUNER_CONTROL_ADDR set and spectuner installed in its environment?",
            ) from None
        try:
            with sock:
                sock.sendall(payload)
                data = b""
                while not data.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise ControlError("unreachable", f"control channel at {self.address} failed mid-request: {exc}") from None
        try:
            answer = json.loads(data)
        except ValueError:
            raise ControlError("bad_answer", f"control channel at {self.address} sent {data[:200]!r}") from None
        state = ControlState.from_json(answer["state"]) if isinstance(answer.get("state"), dict) else None
        if not answer.get("ok"):
            raise ControlError(str(answer.get("code", "error")), str(answer.get("error", "refused")), state)
        if state is None:
            raise ControlError("bad_answer", f"control channel at {self.address} answered without a state")
        return state

    def get(self) -> ControlState:
        return self._call({"op": "get"})

    def set_table(self, table: list[list[int]]) -> ControlState:
        return self._call({"op": "set", "table": table})

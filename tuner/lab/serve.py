"""Start a real vLLM OpenAI server on the lab models, on 127.0.0.1, with per-request spec metrics on.

vLLM's temp, cache and compile files go under the server's own work directory (``TMPDIR``,
``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``), so a test or demo leaves nothing in /tmp or ~/.cache.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from tuner.engine.process import EngineProcess, EngineStartError, free_port, port_is_free
from tuner.lab.models import DEFAULT_MODELS_DIR, Manifest, load_manifest

SERVED_MODEL_NAME = "lab-target"
NO_SPECULATION = "none"
# The lab's prompt lookup: 2- to 5-grams. Whatever registers the lab's ngram as a candidate passes the same
# keys, so a swap to it and its shadow replay run the lookup the fixed configs measured.
NGRAM_LOOKUP: dict[str, int] = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1
_ZMQ_SOCKET_NAME_LEN = 36  # vLLM names IPC sockets by uuid4


class LabUsageError(ValueError):
    """A bad request to the lab (unknown draft, busy port, models missing): the message names the fix."""


def parse_per_batch_size(text: str) -> list[list[int]]:
    """Parse a per-batch-size K table: JSON ``[[1,4,5],[5,16,2]]`` or ``1-4:5,5-16:2``."""
    text = text.strip()
    try:
        rows: Any = json.loads(text) if text.startswith("[") else [
            [int(r.split(":")[0].split("-")[0]), int(r.split(":")[0].split("-")[-1]), int(r.split(":")[1])]
            for r in text.split(",")
        ]
    except (ValueError, IndexError) as e:
        raise LabUsageError(
            f"cannot parse per-batch-size table {text!r}: use JSON [[lo,hi,K],...] or 'lo-hi:K,lo-hi:K'"
        ) from e
    if not isinstance(rows, list) or not rows or not all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) for x in r) for r in rows
    ):
        raise LabUsageError(f"per-batch-size table must be rows [lo, hi, K]; got {text!r}")
    if rows[0][0] != 1:
        raise LabUsageError(f"per-batch-size table must start at batch size 1; got {rows[0]}")
    for prev, row in itertools.pairwise(rows):
        if row[0] != prev[1] + 1:
            raise LabUsageError(f"per-batch-size rows must be contiguous: {prev} then {row}")
    for lo, hi, k in rows:
        if lo > hi or k < 0:
            raise LabUsageError(f"bad row [{lo}, {hi}, {k}]: need lo <= hi and K >= 0")
    return [list(r) for r in rows]


def speculative_config(
    manifest: Manifest, draft: str, k: int, per_batch_size: list[list[int]] | None = None
) -> dict[str, Any] | None:
    """The ``--speculative-config`` for a lab draft name (or ``ngram``), None for no speculation."""
    if draft == NO_SPECULATION or (k == 0 and not per_batch_size):
        return None
    if draft not in manifest.drafts:
        names = ", ".join([*manifest.drafts, NO_SPECULATION])
        raise LabUsageError(f"unknown draft {draft!r}; choose one of: {names}")
    info = manifest.drafts[draft]
    cfg: dict[str, Any]
    if info.method == "ngram":
        cfg = {"method": "ngram", "num_speculative_tokens": k, **NGRAM_LOOKUP}
    else:
        cfg = {"method": "draft_model", "model": info.path, "num_speculative_tokens": k}
    if per_batch_size:
        k_max = max(r[2] for r in per_batch_size)
        if k_max > k:
            raise LabUsageError(f"per-batch-size table uses K={k_max} above --k {k}; raise --k to {k_max}")
        cfg["num_speculative_tokens_per_batch_size"] = per_batch_size
    return cfg


def engine_tmp_dir(workdir: Path) -> tuple[Path, bool]:
    """A TMPDIR for a vLLM engine working in ``workdir``, and whether it is a private one to remove.

    ZeroMQ puts IPC sockets in TMPDIR and a socket path must fit in 107 bytes: ``workdir/tmp`` when it
    fits, else a short private directory under the system temp.
    """
    candidate = workdir / "tmp"
    if len(str(candidate)) + 1 + _ZMQ_SOCKET_NAME_LEN <= _SUN_PATH_MAX:
        return candidate, False
    return Path(tempfile.mkdtemp(prefix="spectuner-")), True


@dataclass
class LabServer:
    """A real vLLM server on the lab models. Use as a context manager, or ``start()`` / ``stop()``."""

    draft: str = "good"
    k: int = 3
    per_batch_size: list[list[int]] | None = None
    port: int | None = None
    models_dir: Path = DEFAULT_MODELS_DIR
    workdir: Path | None = None
    enforce_eager: bool = True
    max_num_seqs: int = 16
    max_model_len: int = 512
    kv_cache_gib: int = 1
    startup_timeout_s: float = 300.0
    shutdown_timeout_s: int = 5
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    _proc: EngineProcess | None = field(default=None, init=False, repr=False)
    _startup_s: float | None = field(default=None, init=False, repr=False)
    _tmp_dir: Path | None = field(default=None, init=False, repr=False)
    _owns_tmp: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.models_dir = Path(self.models_dir).resolve()
        if self.k < 0:
            raise LabUsageError(f"--k must be >= 0; got {self.k}")
        self.manifest = load_manifest_or_usage_error(self.models_dir)
        self.spec_config = speculative_config(self.manifest, self.draft, self.k, self.per_batch_size)
        if self.port is None:
            self.port = free_port()
        elif not port_is_free(self.port):
            raise LabUsageError(f"port {self.port} on 127.0.0.1 is busy; pick another with --port")
        if self.workdir is None:
            self.workdir = self.models_dir.parent / "run" / f"engine-{self.port}"
        self.workdir = Path(self.workdir).resolve()

    # -- addresses -----------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def model_name(self) -> str:
        return SERVED_MODEL_NAME

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "engine.log"

    @property
    def startup_s(self) -> float | None:
        return self._startup_s

    # -- process -------------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.manifest.target.path,
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--seed", "0",
            "--shutdown-timeout", str(self.shutdown_timeout_s),
            "--enable-per-request-metrics",
        ]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.spec_config is not None:
            args += [
                "--speculative-config", json.dumps(self.spec_config),
                "--per-request-spec-decode-metrics", "detailed",
            ]
        return args + list(self.extra_args)

    @property
    def tmp_dir(self) -> Path:
        """vLLM's TMPDIR. ZeroMQ puts IPC sockets there and a socket path must fit in 107 bytes, so a
        work directory deep in a test tree gets a short private directory instead, removed on stop."""
        assert self.workdir is not None
        if self._tmp_dir is None:
            self._tmp_dir, self._owns_tmp = engine_tmp_dir(self.workdir)
        return self._tmp_dir

    def env(self) -> dict[str, str]:
        assert self.workdir is not None
        tmp = self.tmp_dir
        return {
            "TMPDIR": str(tmp),
            "VLLM_CACHE_ROOT": str(self.workdir / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(self.workdir / "inductor"),
            "TRITON_CACHE_DIR": str(self.workdir / "triton"),
            "HF_HOME": str(self.workdir / "hf"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }

    def start(self) -> float:
        """Start and wait for health; returns the start-up time in seconds."""
        assert self.workdir is not None
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self._proc = EngineProcess(
            argv=self.argv(),
            health_url=f"{self.base_url}/health",
            log_path=self.log_path,
            env=self.env(),
            cwd=self.workdir,
            startup_timeout_s=self.startup_timeout_s,
            stop_timeout_s=self.shutdown_timeout_s + 20.0,
        )
        self._proc.start()
        self._startup_s = self._proc.wait_healthy()
        return self._startup_s

    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def last_pid(self) -> int | None:
        """The process-group id of the last start, kept after stop."""
        return self._proc.last_pid if self._proc else None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
        if self._owns_tmp and self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir, self._owns_tmp = None, False

    def __enter__(self) -> LabServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def load_manifest_or_usage_error(models_dir: Path) -> Manifest:
    try:
        return load_manifest(models_dir)
    except Exception as e:  # missing or unreadable manifest: both fixed by building
        raise LabUsageError(
            f"lab models not built in {models_dir}: run `spectuner lab build-models {models_dir}`"
        ) from e


__all__ = ["EngineStartError", "LabServer", "LabUsageError", "parse_per_batch_size", "speculative_config"]

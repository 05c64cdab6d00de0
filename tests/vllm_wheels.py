"""Official vLLM wheels, downloaded once into a cache outside the repository, read without installing.

The cache is ``$SPECTUNER_VLLM_WHEELS`` or ``~/.cache/spectuner/vllm-wheels`` (CI keeps it between
runs). A missing wheel is fetched with ``pip download --no-deps`` (≈330 MB each, once); after that
the tests need no network. If the download fails the tests FAIL with the command that seeds the
cache by hand (as the PostgreSQL tests do): a skipped matrix test would leave the support matrix in
the docs unverified without anyone noticing.

:func:`wheel_reader` gives ``module name → source text`` straight from the wheel's zip, which is what
``collectors.vllm_plugin.features.SourceProbe`` reads: nothing from the wheel is imported.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "SPECTUNER_VLLM_WHEELS"
DOWNLOAD_TIMEOUT_S = 900


class WheelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "spectuner" / "vllm-wheels")


def _cached(cache: Path, dist: str, version: str) -> Path | None:
    stem = dist.replace("-", "_")
    found = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def ensure_wheel(dist: str, version: str) -> Path:
    """The cached wheel, downloaded first if missing; :class:`WheelUnavailable` says how to seed it."""
    cache = cache_dir()
    hit = _cached(cache, dist, version)
    if hit is not None:
        return hit
    cache.mkdir(parents=True, exist_ok=True)
    # Download into a scratch folder inside the cache, then move: a killed download leaves no half wheel.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
            f"{dist}=={version}", "--dest", tmp,
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc = None
        got = _cached(Path(tmp), dist, version)
        if proc is None or proc.returncode != 0 or got is None:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1] if proc else "timed out"
            raise WheelUnavailable(
                f"{dist}=={version} is not in {cache} and could not be downloaded ({tail}); "
                f"run `python -m pip download --no-deps {dist}=={version} --dest {cache}` where the package "
                f"index is reachable, or point {CACHE_ENV} at a folder holding the wheel"
            )
        os.replace(got, cache / got.name)
    return cache / got.name


def _module_paths(module: str) -> tuple[str, str]:
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


def wheel_reader(wheel: Path) -> Callable[[str], str | None]:
    """``module → source`` from a wheel's zip (None when the wheel has no such module)."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def read(module: str) -> str | None:
        for path in _module_paths(module):
            if path in names:
                return archive.read(path).decode("utf-8")
        return None

    return read


def installed_reader() -> Callable[[str], str | None]:
    """``module → source`` of the vLLM installed here, read from its files (nothing imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise WheelUnavailable("vLLM is not installed in this environment")
    root = Path(next(iter(spec.submodule_search_locations))).parent

    def read(module: str) -> str | None:
        for path in _module_paths(module):
            if (root / path).is_file():
                return (root / path).read_text(encoding="utf-8")
        return None

    return read

"""The GPU check's gate and its engine environment.

Skipped unless ``SPECTUNER_GPU_CHECK=1`` and ``nvidia-smi -L`` lists a GPU. The engine runs in its own
virtual environment with official vLLM (the sidecar side of the test runs in this one):

- ``SPECTUNER_GPU_VENV``: that environment's folder (default: a fresh one under pytest's temp folder).
  If its Python already imports vLLM, nothing is installed (an offline GPU box: prepare it beforehand).
- ``SPECTUNER_GPU_VLLM``: the official vLLM version to install into a fresh one (default ``0.33.0``);
  a wheel already in the support-matrix cache (``tests/vllm_wheels.py``) is used from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_wheels import cache_dir

REPO = Path(__file__).resolve().parents[2]
GATE_ENV = "SPECTUNER_GPU_CHECK"
VENV_ENV = "SPECTUNER_GPU_VENV"
VERSION_ENV = "SPECTUNER_GPU_VLLM"
INSTALL_TIMEOUT_S = 420


def _gpu_listed() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if "gpu" in Path(str(i.fspath)).parts]
    if not gpu_items:
        return
    if os.environ.get(GATE_ENV) != "1":
        reason = f"GPU check: set {GATE_ENV}=1 on a CUDA machine to run it"
    elif not _gpu_listed():
        reason = "GPU check: no CUDA GPU (nvidia-smi -L lists none)"
    else:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def _imports_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm, collectors.vllm_plugin"], capture_output=True, timeout=300)
    return probe.returncode == 0


@pytest.fixture(scope="session")
def gpu_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine environment's Python, with official vLLM and spectuner (its plugin entry points)."""
    venv = Path(os.environ.get(VENV_ENV) or tmp_path_factory.mktemp("gpu-venv"))
    python = venv / "bin" / "python"
    if _imports_vllm(python):
        return python
    version = os.environ.get(VERSION_ENV, "0.33.0")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    cmd = [
        str(python),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--find-links",
        str(cache_dir()),
        f"vllm=={version}",
        str(REPO),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"installing vllm=={version} into {venv} took over {INSTALL_TIMEOUT_S} s", pytrace=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.fail(f"could not install vllm=={version} into {venv}: {tail}", pytrace=False)
    return python

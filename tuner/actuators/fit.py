"""Whether a second engine fits beside the running one (blue/green), as a pure function with a reason."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tuner.actuators.restart import argv_option

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
GPU_HEADROOM = 0.02  # CUDA context and allocator slack per process, as a share of the device


@dataclass(frozen=True)
class Fit:
    fits: bool
    reason: str


def gpu_memory_utilization(argv: Sequence[str]) -> float:
    """``--gpu-memory-utilization`` from a vLLM command line (its default when absent)."""
    value = argv_option(argv, "--gpu-memory-utilization")
    return DEFAULT_GPU_MEMORY_UTILIZATION if value is None else float(value)


def blue_green_fit(device: str, utilization: float, *, spare_device: bool = False) -> Fit:
    """Can the new engine start while the old one serves?

    - CPU: each engine takes its own ``VLLM_CPU_KVCACHE_SPACE`` from host memory — fits (the lab).
    - GPU with a spare device for the new engine: fits.
    - one GPU: both engines claim ``utilization`` of it; they fit when 2 × utilization plus headroom
      stays within the device (e.g. ``--gpu-memory-utilization 0.45``)."""
    if device == "cpu":
        # vLLM's CPU backend pins each engine to cores (VLLM_CPU_OMP_THREADS_BIND): give the engines
        # disjoint cores, or "nobind", or the new one starts on a core the old keeps busy.
        return Fit(True, "CPU engine: a second engine takes its own host memory")
    if spare_device:
        return Fit(True, "a spare GPU holds the new engine while the old one serves")
    need = 2 * utilization + GPU_HEADROOM
    if need <= 1.0:
        return Fit(True, f"two engines at --gpu-memory-utilization {utilization:g} fit one GPU ({need:.2f} ≤ 1)")
    return Fit(
        False,
        f"two engines at --gpu-memory-utilization {utilization:g} need {need:.2f} of one GPU; "
        "use drain-and-hold, a spare GPU, or a utilization ≤ "
        f"{(1.0 - GPU_HEADROOM) / 2:.2f}",
    )

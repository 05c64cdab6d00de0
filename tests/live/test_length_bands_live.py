"""Acceptance by context length on lab traffic of mixed lengths: requests through the real tap into a real
store, `spectuner status --json` bands them; each band's α̂ is checked against an independent sum of the
engine's own per-step counts from the responses the client saw."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from collectors.batch_writer import BatchWriter
from collectors.records import RequestRecord
from collectors.scrape import Collector
from collectors.tap import TapProxy, create_tap_app
from policies.acceptance import evidence_from_draft_steps
from tests.integration.test_tap_proxy import ThreadedServer
from tuner.cli.main import app
from tuner.lab.models import Manifest
from tuner.lab.prompts import HARD, PREDICTABLE
from tuner.lab.serve import LabServer
from tuner.store import Store, upgrade

pytestmark = pytest.mark.live
EDGES = (64, 128, 256)


def prompt_of(parts: int, i: int) -> str:
    pool = PREDICTABLE if i % 2 else HARD
    return " ".join(pool[(i + j) % len(pool)] for j in range(parts))


def test_status_bands_lab_traffic_by_context_length(
    lab_models: Manifest, start_lab_server: Callable[..., LabServer], tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'lengths.db'}"
    upgrade(db)
    server = start_lab_server(draft="medium", k=3)
    prompts = [prompt_of(parts, i) for parts in (1, 4, 10, 20) for i in range(10)]
    with Store(db) as store:
        assert Collector(server.metrics_url, store, timeout_s=10).collect_once().ok  # the engine's series
        writer: BatchWriter[RequestRecord] = BatchWriter(store.write_requests, name="live", flush_interval_s=0.05)
        proxy = TapProxy(server.base_url, writer)
        with ThreadedServer(create_tap_app(proxy)) as tap:

            def one(p: str) -> dict[str, object]:
                body = {"model": server.model_name, "prompt": p, "max_tokens": 32, "temperature": 0}
                r = httpx.post(f"{tap.url}/v1/completions", json=body, timeout=120)
                r.raise_for_status()
                return r.json()  # type: ignore[no-any-return]

            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(one, prompts))
            assert writer.flush(30)
    result = CliRunner().invoke(
        app, ["status", "--db", db, "--json", "--length-edges", ",".join(map(str, EDGES))], env={"SPECTUNER_DB": ""}
    )
    assert result.exit_code == 0, result.output
    (engine,) = json.loads(result.output)["engines"]
    view = engine["by_context_length"]
    # independent: band each answer by its own usage, sum vLLM's per-step counts
    expected: dict[int, list[int]] = {}
    for a in answers:
        usage, spec = a["usage"], a["metrics"]["speculative_decoding"]  # type: ignore[index]
        ctx = usage["prompt_tokens"] + usage["completion_tokens"] / 2
        lo = max([0, *[e for e in EDGES if ctx >= e]])
        if spec["per_step_accepted"] is None:
            assert spec["num_spec_steps"] == 0  # nothing drafted: no trials (status skips it too)
            continue
        acc = expected.setdefault(lo, [0, 0, 0])
        ev = evidence_from_draft_steps(spec["per_step_accepted"], spec["per_step_drafted"])
        acc[0] += int(ev.successes)
        acc[1] += int(ev.failures)
        acc[2] += 1
    got = {b["lo_tokens"]: b for b in view["bands"] if b["requests"]}
    assert set(got) == set(expected) and len(got) >= 3, view  # mixed lengths reach several bands
    for lo, (s, f, n) in expected.items():
        band = got[lo]
        assert band["requests"] == n and band["accepted_tokens"] == s
        assert band["alpha"] == pytest.approx(s / (s + f))
        assert band["alpha_ci"][0] <= band["alpha"] <= band["alpha_ci"][1]
    assert view["slope_ci"] is not None and view["slope_ci"][0] <= view["slope_per_doubling"] <= view["slope_ci"][1]
    print("\n" + json.dumps(view, indent=1))

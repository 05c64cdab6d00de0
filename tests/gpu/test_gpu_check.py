"""The GPU check: official vLLM on a CUDA machine, with the plugin, a draft and a K table.

    SPECTUNER_GPU_CHECK=1 PYTHONPATH=$PWD .venv/bin/python -m pytest -m gpu tests/gpu -s

(skipped without the variable or without a GPU; see ``tests/gpu/conftest.py`` for the engine
environment). One engine — the lab target with the ``good`` draft, K_max = 4 and the start-up table
``[[1, 1, 4], [2, 2, 2], [3, 16, 0]]``, CUDA graphs on (not eager), so the table's K values are what vLLM
captures — and one ingest server on a real SQLite store. Checks, in order:

1. per-step records add up to the engine's /metrics totals;
2. live K: when the engine reports it supported, K 4 → 2 → 0 → 4 through the live actuator takes effect
   in the step stream and greedy output equals the K = 0 output; when it reports unsupported, the
   reason is given, a set is refused with ``unsupported`` and the engine keeps serving;
3. the stat logger's CPU per step (``record()`` plus JSON encoding, on this vLLM's own stats classes,
   in the engine environment) is under 1 % of the engine's median batch-1 step time.

Budget: under 10 minutes on one GPU with the lab models cached and vLLM installed (a fresh install
adds its download time). Prints one ``GPU CHECK`` line per result.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from collectors.vllm_plugin.client import ControlClient, ControlError
from tests.gpu.conftest import REPO
from tests.live.conftest import MODELS_DIR
from tests.live.test_plugin_live import Rig, Tripwire, engine_spec_totals, live_change, plugin_rig, settle
from tuner.actuators.live import LiveActuator
from tuner.lab.load import run_load
from tuner.lab.models import build_models
from tuner.lab.prompts import PREDICTABLE
from tuner.lab.serve import LabServer

K_MAX = 4
TABLE = [[1, 1, 4], [2, 2, 2], [3, 16, 0]]
MAX_OVERHEAD = 0.01


@dataclass
class GpuLabServer(LabServer):
    """The lab server, started by the engine environment's Python with CUDA graphs on."""

    python: str = ""

    def argv(self) -> list[str]:
        args = super().argv()
        return [self.python, *args[1:], "--gpu-memory-utilization", "0.3"]


def report(what: str, **figures: object) -> None:
    print(f"GPU CHECK {what}: " + json.dumps(figures, default=str))


@pytest.fixture(scope="module")
def gpu_rig(gpu_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    build_models(MODELS_DIR)
    work = tmp_path_factory.mktemp("gpu")
    server = GpuLabServer(
        draft="good",
        k=K_MAX,
        per_batch_size=TABLE,
        models_dir=MODELS_DIR,
        workdir=work / "engine",
        enforce_eager=False,
        python=str(gpu_python),
    )
    with plugin_rig(server, work) as rig:
        version = subprocess.run(
            [str(gpu_python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=120
        ).stdout.strip()
        report("engine", vllm=version, startup_s=server.startup_s, log=str(server.log_path))
        yield rig


def test_per_step_totals_equal_metrics(gpu_rig: Rig) -> None:
    prompts = PREDICTABLE[:8]
    # Two streams: batch sizes 1 and 2 draft at K = 4 and 2 under the start-up table.
    result = run_load(
        gpu_rig.server.base_url, gpu_rig.server.model_name, prompts, concurrency=2, count=16, max_tokens=48
    )
    assert result.errors == 0
    settle(gpu_rig)
    steps = gpu_rig.store.steps(gpu_rig.key)
    engine = engine_spec_totals(gpu_rig.server.metrics_url)
    totals = {
        "drafts": sum(s.spec.drafts for s in steps),
        "draft_tokens": sum(s.spec.draft_tokens for s in steps),
        "accepted_tokens": sum(s.spec.accepted_tokens for s in steps),
    }
    report("per-step totals", steps=len(steps), plugin=totals, metrics={k: engine.get(k) for k in totals})
    assert steps and totals == {k: engine[k] for k in totals} and totals["drafts"] > 0
    per_pos = [sum(s.spec.accepted_per_pos[i] for s in steps) for i in range(K_MAX)]
    assert per_pos == [engine["per_pos"][i] for i in range(K_MAX)]
    assert gpu_rig.ingest.stats.plugin_dropped == 0


def test_live_k_takes_effect_or_says_unsupported(gpu_rig: Rig) -> None:
    client = ControlClient(gpu_rig.control_addr, gpu_rig.token)
    state = client.get()
    report("live K state", supported=state.supported, reason=state.reason, allowed_k=state.allowed_k,
           table=state.table, features=state.features)  # fmt: skip
    if not state.supported:
        assert state.reason
        with pytest.raises(ControlError) as err:
            client.set_table([[1, 16, 2]])
        assert err.value.code == "unsupported"
        result = run_load(gpu_rig.server.base_url, gpu_rig.server.model_name, PREDICTABLE[:2], count=2, max_tokens=16)
        assert result.errors == 0
        return
    assert state.allowed_k == [0, 2, 4]  # CUDA graphs: the start-up table's K values only
    draft = gpu_rig.server.spec_config
    assert draft is not None
    actuator = LiveActuator(client, Tripwire(), feed=gpu_rig.feed, k_max=K_MAX, verify_timeout_s=10)
    actuator.current = {"method": draft["method"], "model": draft["model"], "num_speculative_tokens": K_MAX,
                        "num_speculative_tokens_per_batch_size": TABLE}  # fmt: skip
    outputs: dict[int, list[str]] = {}
    delays: dict[int, float | None] = {}
    for k in (2, 0, 4):
        config = {
            **actuator.current,
            "num_speculative_tokens": k,
            "num_speculative_tokens_per_batch_size": [[1, 16, k]],
        }
        res, outputs[k] = live_change(gpu_rig, actuator, config, k, streams=1)
        delays[k] = res.decision_to_first_step_s
    same = all(texts == outputs[0] for texts in outputs.values())
    report("live K changes", decision_to_first_step_s=delays, greedy_output_unchanged=same)
    assert same, "greedy output changed with K"


def test_stat_logger_costs_under_one_percent_of_a_step(gpu_rig: Rig, gpu_python: Path) -> None:
    code = "import json, bench.bench_plugin as b; print(json.dumps(b.cpu_per_step_us()))"
    done = subprocess.run(
        [str(gpu_python), "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    cost = json.loads(done.stdout.strip().splitlines()[-1])
    run_load(gpu_rig.server.base_url, gpu_rig.server.model_name, PREDICTABLE[:4], concurrency=1, count=8, max_tokens=64)
    settle(gpu_rig)
    times = [s.step_time_s for s in gpu_rig.store.steps(gpu_rig.key) if s.step_time_s and s.batch_size == 1]
    assert len(times) >= 20, "too few timed batch-1 steps"
    step_s = statistics.median(times)
    share = cost["total_us"] / 1e6 / step_s
    report("stat logger cost", us_per_step=round(cost["total_us"], 1), median_step_ms=round(step_s * 1e3, 2),
           share=round(share, 5))  # fmt: skip
    assert share < MAX_OVERHEAD
    assert httpx.get(f"{gpu_rig.server.base_url}/health", timeout=5).status_code == 200

"""Live benchmark on the gpu-like lab: spectuner against every fixed config, per phase, with 95 % intervals.

Workload: six phases of ``--phase-s`` seconds (default 180: load regimes last minutes), prompt difficulty
and concurrency changing between them — predictable prompts at 1 → 16 → 64 streams, then hard prompts at
1 → 64 → 4 (the phase plan of ``bench/scenarios/lab_gpu_like.toml``, so the simulator runs the same plan).
Clients are closed loops of streamed greedy completions whose lengths vary around ``--max-tokens``
(so the streams do not march in step); tokens are counted when they arrive, so a phase's rate is exact
at its borders and an outage counts.

**Fixed configs** (no speculation; good, medium, weak and ngram at K = 1, 3, 5; good with the best K
table for the lab's calibrated step cost) are measured as *cells*: one config in one phase's
conditions for ``--cell-s`` seconds. One engine per draft starts at K_max with the spectuner plugin
and its K is switched live between cells, so K = 1/3/5 and the table alternate within a few seconds
of each other; every engine is visited ``--visits`` times, in forward then reverse order (and the
cells of a visit in reverse), so machine drift hits every config alike. After a live switch a cell
waits until the engine's counters show steps at the new K (``--switch-timeout-s``): the first steps
after a switch still verify drafts made at the old K. The per-phase oracle is the best fixed config of
each phase, switching for free.

**spectuner** runs the whole phase plan once: the real daemon in auto mode, K tables set live
through the plugin, a draft change restarts the engine behind the front door (drain-and-hold, so no
client request fails), starting at medium/K = 3 (the usual hand-picked start). Its ``[shadow]`` is on
(``--shadow-interval-s``, 0: off): the front door records a share of the requests and every candidate is
replayed on the newest of them, so a draft the engine is not running is ranked by its measured α.

Reported, each with its 95 % interval (``bench/live_stats.py``): spectuner ÷ the per-phase oracle,
÷ the best single fixed config, ÷ medium/K = 3 (the start) and the worst phase ÷ no speculation; per
phase: every config's rate and acceptance, spectuner's rate, its changes and time to adapt; client
errors; per phase, the CPU the sidecar's threads (daemon, front door, collectors) and the load
generator took — on the CPU lab the engine shares the same two cores with them. Targets (issue #19):
≥ 0.95, ≥ 1.0, worst phase ≥ 0.95.

    .venv/bin/python bench/bench_live.py                      # ~55 min on a quiet 2-core machine
    .venv/bin/python bench/bench_live.py --phase-s 20 --cell-s 3 --visits 1 --drafts good --out live_smoke
    .venv/bin/python bench/bench_live.py --no-fixed --fixed-from bench/results/live.json --out live_rerun
        # ~20 min: spectuner alone against an earlier run's cells (not side by side; the report says so)

Writes ``bench/results/<out>.json``, ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.live_stats import fixed_means, summarize_live  # noqa: E402
from collectors.vllm_plugin.client import ControlClient  # noqa: E402
from policies.acceptance_model import ConstantAlphaModel  # noqa: E402
from policies.k_table import KTableSnapshot, k_table  # noqa: E402
from policies.step_cost import StepCostModel  # noqa: E402
from tuner.actuators.live import load_or_create_token, plugin_env  # noqa: E402
from tuner.config import parse_config  # noqa: E402
from tuner.daemon import Daemon  # noqa: E402
from tuner.engine.process import free_port  # noqa: E402
from tuner.lab.closed_loop import LoopSettings, lab_cost_model, lab_daemon_config  # noqa: E402
from tuner.lab.models import GPU_LIKE_MODELS_DIR  # noqa: E402
from tuner.lab.prompts import PROMPT_SETS  # noqa: E402
from tuner.lab.serve import LabServer  # noqa: E402
from tuner.store import AppliedBy, Store, upgrade  # noqa: E402

RESULTS = REPO / "bench" / "results"
START = ("medium", 3)  # spectuner's default start, and the reference fixed config


@dataclass(frozen=True)
class Phase:
    prompts: str
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.prompts} c={self.concurrency}"


PHASES = (Phase("predictable", 1), Phase("predictable", 16), Phase("predictable", 64),
          Phase("hard", 1), Phase("hard", 64), Phase("hard", 4))


# -- the load: closed-loop streams, tokens timed as they arrive ------------------------------------------

@dataclass
class Request:
    start: float
    end: float
    tokens: int
    error: str | None = None


@dataclass
class StreamLoad:
    """Up to ``max_concurrency`` closed-loop clients in a background thread; ``set`` changes the
    prompts and how many clients run. Streams with continuous usage, so every token has an arrival time."""

    base_url: str
    model: str
    max_concurrency: int
    max_tokens: int
    seed: int = 0
    prompts: str = "predictable"
    concurrency: int = 0
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    busy: list[bool] = field(default_factory=list)
    streaming: list[bool] = field(default_factory=list)  # the client's current request has its first token
    _stop: bool = False
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.busy = [False] * self.max_concurrency
        self.streaming = [False] * self.max_concurrency
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name=LOAD_THREAD)
        self._thread.start()

    def set(self, phase: Phase) -> None:
        self.prompts, self.concurrency = phase.prompts, phase.concurrency

    def stop(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=600.0)

    def settled(self) -> bool:
        """No client above the current concurrency still has a request in flight, and every client below
        it is past its prefill (a jump to 64 streams queues 64 prefills first)."""
        c = self.concurrency
        return not any(self.busy[c:]) and all(self.streaming[:c])

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in list(self.arrivals) if t0 <= t < t1)

    def finished_between(self, t0: float, t1: float) -> list[Request]:
        return [r for r in list(self.requests) if t0 <= r.end < t1]

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.max_concurrency)))

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        n = i
        while not self._stop:
            if i >= self.concurrency:
                await asyncio.sleep(0.05)
                continue
            pool = PROMPT_SETS[self.prompts]
            prompt = pool[n % len(pool)]
            n += 7  # clients walk the prompt set at different offsets
            # lengths spread ±50 % around the mean so the streams fall out of step
            max_tokens = rng.randint(max(1, self.max_tokens // 2), self.max_tokens * 3 // 2)
            self.busy[i], self.streaming[i] = True, False
            try:
                req = await self._one(client, i, prompt, max_tokens)
            finally:
                self.busy[i] = False
            self.requests.append(req)
            if req.error is not None:
                await asyncio.sleep(0.5)  # an engine that is away: do not spin

    async def _one(self, client: httpx.AsyncClient, i: int, prompt: str, max_tokens: int) -> Request:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        t0 = time.perf_counter()
        seen = 0
        try:
            async with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:200]
                    return Request(t0, time.perf_counter(), seen, f"HTTP {resp.status_code}: {text}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    usage = json.loads(line[6:]).get("usage") or {}
                    total = int(usage.get("completion_tokens") or 0)
                    if total > seen:
                        self.arrivals.append((time.perf_counter(), total - seen))
                        self.streaming[i] = True
                        seen = total
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return Request(t0, time.perf_counter(), seen, f"{type(exc).__name__}: {exc}")
        return Request(t0, time.perf_counter(), seen)


_COUNTER = re.compile(r"^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)_total)(?:\{[^}]*\})? (\S+)$")


LOAD_THREAD = "bench-load"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[str, float]:
    """CPU seconds each kind of thread of this process has used (Linux ``/proc``; empty elsewhere): the
    load generator (``LOAD_THREAD``) and the sidecar's threads, a pool's workers under one name."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    task_dir = Path("/proc/self/task")
    if not task_dir.is_dir():
        return out
    for task in task_dir.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2:].split()  # after "tid (comm) ": state ... utime(11) stime(12)
        name = re.sub(r"[_-]?\d+", "", names.get(int(task.name), "native")) or "native"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
    return out


def cpu_between(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
    """The load generator's and the sidecar's CPU between two ``thread_cpu`` snapshots, as CPU seconds
    and as a share of the machine's cores over ``seconds``."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    load = delta.pop(LOAD_THREAD, 0.0)
    sidecar = sum(v for v in delta.values() if v > 0)
    cores = os.cpu_count() or 1
    return {"load_cpu_s": round(load, 1), "sidecar_cpu_s": round(sidecar, 1),
            "sidecar_machine_share": round(sidecar / max(seconds * cores, 1e-9), 3),
            "sidecar_threads": {k: round(v, 1) for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v >= 0.1}}


def spec_counters(base_url: str) -> dict[str, float]:
    """The engine's speculation counters (summed over labels); empty when it has none."""
    out: dict[str, float] = {}
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    for line in text.splitlines():
        m = _COUNTER.match(line)
        if m:
            key = m.group(1).removeprefix("vllm:spec_decode_num_").removesuffix("_total")
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def table_k(table: Sequence[Sequence[int]], batch: int) -> int:
    """The K a per-batch-size table gives ``batch`` sequences (its last row above the table)."""
    for lo, hi, k in table:
        if lo <= batch <= hi:
            return int(k)
    return int(table[-1][2])


def await_k(counters: Callable[[], dict[str, float]], stepped: Callable[[float, float], bool], k: int, *,
            min_s: float, timeout_s: float, poll_s: float = 0.25) -> tuple[float, bool]:
    """Wait until the engine drafts at ``k`` after a live table change: two polls in a row in which it
    stepped (``stepped(t0, t1)``: tokens arrived) and its drafts, if any, were ``k`` tokens long on average
    (none at all for K = 0). A fixed wait is not enough: the first step after a change still verifies drafts
    made at the old K, and at 64 streams and K = 5 a step takes ~0.7 s — a 1-s wait let the table's cell count
    K = 5 steps (the 7 Dec run's visit 0 at hard c=64: 174 tok/s, 222 in visit 1). Returns the seconds waited
    and whether the engine got there within ``timeout_s`` (an ngram draft that finds no match drafts nothing:
    then the wait runs out)."""
    t_start = time.perf_counter()
    time.sleep(min_s)
    before, t_prev, good = counters(), time.perf_counter(), 0
    while good < 2:
        if time.perf_counter() - t_start >= timeout_s:
            return time.perf_counter() - t_start, False
        time.sleep(poll_s)
        after, t_now = counters(), time.perf_counter()
        drafts = after.get("drafts", 0.0) - before.get("drafts", 0.0)
        tokens = after.get("draft_tokens", 0.0) - before.get("draft_tokens", 0.0)
        at_k = (drafts == 0 and stepped(t_prev, t_now)) if k == 0 else (drafts > 0 and abs(tokens / drafts - k) <= 0.5)
        if at_k:
            good += 1
        elif drafts > 0 or stepped(t_prev, t_now):
            good = 0  # a step at another K: start over
        before, t_prev = after, t_now
    return time.perf_counter() - t_start, True


def _settle(load: StreamLoad, ramp_s: float) -> None:
    """After a change of conditions: the old clients' requests finish and the new ones stream, then
    ``ramp_s`` more."""
    deadline = time.perf_counter() + 120.0
    while not load.settled() and time.perf_counter() < deadline:
        time.sleep(0.1)
    time.sleep(ramp_s)


# -- fixed configs: cells ---------------------------------------------------------------------------------

def best_table(manifest: Any, alpha: float, k_max: int, max_batch: int, k0_pass: bool) -> list[list[int]]:
    """The K table spectuner's policy picks for a draft of acceptance ``alpha`` on the lab's calibrated
    step cost — what an operator who knew α and the cost model would pin. ``k0_pass``: the engine's K = 0
    steps still run the draft's pass (not with ``--skip-k0-pass``)."""
    cost, _ = lab_cost_model(manifest)
    model = StepCostModel.from_dict(cost)
    table = k_table(KTableSnapshot(
        now=datetime.now(UTC), acceptance=ConstantAlphaModel(alpha, alpha, alpha),
        step_cost=model.with_draft_pass_at_k0(k0_pass), max_batch_size=max_batch, k_max=k_max,
    ))
    return table.as_vllm()


def _prompt_skip(args: argparse.Namespace) -> bool:
    return bool(args.skip_k0_pass and args.skip_k0_prompt_pass)


def engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    """vLLM arguments every engine of the run gets alike, fixed cells and spectuner's: without prefix caching
    when K = 0 steps with a prompt skip the draft too (``--skip-k0-prompt-pass``; the plugin skips them only
    where no prompt block is shared)."""
    return ("--no-enable-prefix-caching",) if _prompt_skip(args) else ()


def measure_engine(draft: str, settings: list[tuple[str, list[list[int]] | None]], args: argparse.Namespace,
                   workdir: Path, visit: int, cells: list[dict[str, Any]]) -> float:
    """One visit of one engine: every phase's conditions, every setting (a K table set live) a cell each."""
    spec = draft != "none"
    tag = f"{draft}-v{visit}"
    env: dict[str, str] = {}
    control: ControlClient | None = None
    if spec:
        token_file = workdir / f"{tag}.token"
        token = load_or_create_token(token_file, create=True)
        sock = Path(tempfile.mkdtemp(prefix="sl-")) / "ctl.sock"  # a unix socket path must stay short
        env = plugin_env(ingest_url=None, control_address=f"unix:{sock}", token_file=token_file,
                         skip_k0_draft_pass=args.skip_k0_pass, skip_k0_prompt_pass=_prompt_skip(args))
        control = ControlClient(f"unix:{sock}", token)
    server = LabServer(draft=draft, k=args.k_max if spec else 0,
                       per_batch_size=[[1, args.max_batch, 3]] if spec else None,
                       models_dir=args.models_dir, workdir=workdir / tag, max_num_seqs=args.max_batch,
                       extra_env=env, startup_timeout_s=600.0, extra_args=engine_args(args))
    print(f"== {draft} (visit {visit + 1}): starting the engine", flush=True)
    startup_s = server.start()
    load = StreamLoad(server.base_url, server.model_name, args.max_batch, args.max_tokens, seed=visit)
    load.start()
    try:
        phases = list(PHASES) if visit % 2 == 0 else list(reversed(PHASES))
        order = settings if visit % 2 == 0 else list(reversed(settings))
        for phase in phases:
            load.set(phase)
            _settle(load, args.ramp_s)
            for label, table in order:
                switch: tuple[float, bool] | None = None
                if control is not None and table is not None:
                    control.set_table(table)
                    switch = await_k(lambda: spec_counters(server.base_url), lambda a, b: load.tokens_between(a, b) > 0,
                                     table_k(table, phase.concurrency), min_s=args.switch_s,
                                     timeout_s=args.switch_timeout_s)
                before = spec_counters(server.base_url) if spec else {}
                t0 = time.perf_counter()
                time.sleep(args.cell_s)
                t1 = time.perf_counter()
                after = spec_counters(server.base_url) if spec else {}
                rate = load.tokens_between(t0, t1) / (t1 - t0)
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                cell = {"config": label, "phase": phase.name, "visit": visit, "rate": round(rate, 2),
                        "seconds": round(t1 - t0, 2)}
                if switch is not None:
                    cell["switch_s"] = round(switch[0], 2)
                    if not switch[1]:
                        cell["switch_unconfirmed"] = True
                if d.get("drafts"):
                    cell["accepted_per_draft"] = round(d["accepted_tokens"] / d["drafts"], 3)
                    cell["draft_acceptance"] = round(d["accepted_tokens"] / max(d["draft_tokens"], 1.0), 3)
                cells.append(cell)
                print(f"    {phase.name:16s} {label:14s} {rate:7.1f} tok/s", flush=True)
    finally:
        load.stop()
        server.stop()
    errors = [r.error for r in load.requests if r.error is not None]
    if errors:
        print(f"    {len(errors)} client errors on a fixed engine, e.g. {sorted(set(errors))[:3]} "
              f"(see its log {server.log_path})", flush=True)
    return startup_s


def run_fixed(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    manifest = LabServer(draft="none", k=0, models_dir=args.models_dir, workdir=workdir / "probe").manifest
    good_alpha = float(manifest.drafts["good"].greedy_agreement or 0.9)
    table = best_table(manifest, good_alpha, args.k_max, args.max_batch, k0_pass=not args.skip_k0_pass)
    plan: list[tuple[str, list[tuple[str, list[list[int]] | None]]]] = [("none", [("off", None)] * 2)]
    for draft in args.drafts:
        settings: list[tuple[str, list[list[int]] | None]] = [
            (f"{draft}/K={k}", [[1, args.max_batch, k]]) for k in (1, 3, 5)
        ]
        if draft == "good":
            settings.append(("good/table", table))
        plan.append((draft, settings))
    cells: list[dict[str, Any]] = []
    startups: dict[str, list[float]] = {}
    for visit in range(args.visits):
        for draft, settings in (plan if visit % 2 == 0 else list(reversed(plan))):
            startup_s = measure_engine(draft, settings, args, workdir, visit, cells)
            startups.setdefault(draft, []).append(round(startup_s, 1))
    return cells, {"good_table": table, "good_table_alpha": good_alpha, "startup_s": startups}


# -- spectuner --------------------------------------------------------------------------------------------

def run_spectuner(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / "spectuner"
    run_dir.mkdir(parents=True, exist_ok=True)
    server = LabServer(draft="none", k=0, models_dir=args.models_dir, workdir=run_dir / "engine",
                       max_num_seqs=args.max_batch, extra_args=engine_args(args))
    db_url = f"sqlite:///{run_dir / 'spectuner.db'}"
    upgrade(db_url)
    door = free_port()
    settings = LoopSettings(
        start_draft=args.start[0], start_k=args.start[1], candidates=tuple(d for d in args.drafts),
        per_batch_size=True, k_max=args.k_max, max_batch_size=args.max_batch,
        evidence_window_s=60.0, swap_duration_s=60.0, swap_min_drafts=300, min_drafts=200,
        cooldown_s=30.0, verify_window_s=30.0, restart_downtime_s=args.restart_downtime_s,
        startup_timeout_s=600.0, front_door_port=door, strategy="drain_hold",
    )
    doc = tomllib.loads(lab_daemon_config(server, db_url, settings, log_path=run_dir / "engine.log"))
    # K tables live through the plugin; a draft change restarts behind the front door (drain-and-hold).
    doc["actuator"]["kind"] = "live"
    doc["actuator"]["live"] = {"fallback": "restart", "k_max": args.k_max}
    sock = Path(tempfile.mkdtemp(prefix="sl-")) / "ctl.sock"
    doc["plugin"] = {"ingest_listen": f"127.0.0.1:{free_port()}", "control_address": f"unix:{sock}",
                     "token_file": str(run_dir / "plugin.token"), "skip_draft_pass_at_k0": args.skip_k0_pass,
                     "skip_draft_pass_at_k0_prompts": _prompt_skip(args)}
    doc["speculative"]["num_speculative_tokens"] = args.k_max
    table = [[1, args.max_batch, args.start[1]]]
    doc["speculative"].setdefault("extra", {})["num_speculative_tokens_per_batch_size"] = table
    if args.shadow_interval_s > 0:
        # The front door records the traffic; every candidate is replayed on its newest samples, so a
        # draft the engine is not running is ranked from measured α (docs/shadow.md), not from its prior.
        doc["shadow"] = {"record_dir": str(run_dir / "traffic"), "record_sample_rate": args.shadow_sample_rate,
                         "target": str(server.manifest.target.path), "evaluate_interval_s": args.shadow_interval_s,
                         "evaluate_interval_max_s": args.shadow_interval_max_s,
                         **({} if args.shadow_max_machine_share is None
                            else {"max_machine_share": args.shadow_max_machine_share}),
                         "max_samples": args.shadow_max_samples, "cpu_share": args.shadow_cpu_share,
                         "nice": args.shadow_nice, "k": 3, "timeout_s": 600.0}
    config = parse_config(doc, path="bench_live", base_dir=run_dir)
    client_url = f"http://127.0.0.1:{door}"
    with Store(db_url) as store:
        daemon = Daemon(config, store)
        print(f"== spectuner (auto, live K, drain-and-hold restarts): starting at {args.start[0]}/K={args.start[1]}",
              flush=True)
        thread = threading.Thread(target=daemon.run, kwargs={"install_signals": False}, daemon=True)
        t_start = time.time()
        thread.start()
        load: StreamLoad | None = None
        try:
            _wait_healthy(client_url, 600.0)
            startup_s = time.time() - t_start
            load = StreamLoad(client_url, server.model_name, args.max_batch, args.max_tokens, seed=99)
            load.start()
            t_workload, p_workload = time.time(), time.perf_counter()
            bounds: list[tuple[Phase, float, float, float]] = []
            cpu: dict[str, dict[str, Any]] = {}
            for phase in PHASES:
                load.set(phase)
                t_switch = time.perf_counter()
                cpu_before = thread_cpu()
                _settle(load, args.ramp_s)  # measured like a fixed cell: from when the phase's load is in place
                t0 = time.perf_counter()
                time.sleep(max(0.0, t_switch + args.phase_s - t0))
                bounds.append((phase, t_switch, t0, time.perf_counter()))
                cpu[phase.name] = cpu_between(cpu_before, thread_cpu(), bounds[-1][3] - t_switch)
                rate = load.tokens_between(t0, bounds[-1][3]) / (bounds[-1][3] - t0)
                print(f"    {phase.name:16s} {rate:7.1f} tok/s (settled after {t0 - t_switch:.1f} s)", flush=True)
        finally:
            if load is not None:
                load.stop()
            daemon.request_stop()  # an apply in progress completes first (the daemon's contract)
            thread.join(timeout=900.0)
            if thread.is_alive():  # never leave an engine behind
                daemon.actuator.stop()
        keys = [e.key for e in store.engines()]
        configs = [c for key in keys[:1] for c in store.configs(key)]
        decisions = store.decisions()
        # every apply's audit event: a live table has no strategy and no downtime; a restart has both
        applies = [{"kind": e.kind, "at_s": round(e.ts.timestamp() - t_workload, 1),
                    **{k: v for k, v in e.data.items() if k in ("status", "downtime_s", "strategy", "requests_held",
                                                                 "requests_failed", "longest_hold_s", "config")}}
                   for e in store.events() if isinstance(e.data, dict) and "downtime_s" in e.data]
        shadow_runs = [{"at_s": round(e.ts.timestamp() - t_workload, 1), "kind": e.kind, "message": e.message[:200],
                        **({k: e.data[k] for k in ("samples", "alpha", "wall_s", "cpu_s") if k in e.data}
                           if isinstance(e.data, dict) else {})}
                       for e in store.events() if e.kind.startswith("shadow_")]
    if args.keep_db is not None:  # windows, per-step records and decisions, for reading the misses
        args.keep_db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / "spectuner.db", args.keep_db)
    decided = {d.id: d.decision.created_at.timestamp() for d in decisions}
    changes: list[dict[str, Any]] = [
        {"decided_at_s": round(decided[c.config.decision_id] - t_workload, 1)
         if c.config.decision_id in decided else None,
         "serving_at_s": round(c.config.started_at.timestamp() - t_workload, 1),
         "applied_by": c.config.applied_by, "config": _spec_label(c.config.spec_config or {})}
        for c in configs if c.config.applied_by != AppliedBy.STARTUP
    ]
    phases: dict[str, Any] = {}
    for phase, t_switch, t0, t1 in bounds:
        rel0, rel1 = t_switch - p_workload, t1 - p_workload
        # the shadow child's CPU, spread evenly over each run's wall time (its event is stamped at its start),
        # the part inside this phase
        shadow_cpu = sum(float(r["cpu_s"]) * _overlap(r["at_s"], r["at_s"] + float(r["wall_s"]), rel0, rel1)
                         / max(float(r["wall_s"]), 1e-9)
                         for r in shadow_runs if r.get("cpu_s") is not None and r.get("wall_s"))
        share = shadow_cpu / max((rel1 - rel0) * (os.cpu_count() or 1), 1e-9)
        cpu.setdefault(phase.name, {}).update(shadow_cpu_s=round(shadow_cpu, 1), shadow_machine_share=round(share, 3))
        done = load.finished_between(t_switch, t1) if load else []
        lat = sorted(r.end - r.start for r in done if r.error is None)
        first = next((c["decided_at_s"] for c in changes
                      if c["decided_at_s"] is not None and rel0 <= c["decided_at_s"] < rel1), None)
        series = [round(load.tokens_between(a, min(a + 30.0, t1)) / max(min(30.0, t1 - a), 1e-9), 1) if load else 0.0
                  for a in _steps(t_switch, t1, 30.0)]
        row: dict[str, Any] = {
            "start_s": round(rel0, 1), "seconds": round(t1 - t0, 2), "settle_s": round(t0 - t_switch, 1),
            "rate": round((load.tokens_between(t0, t1) if load else 0) / (t1 - t0), 2),
            "rate_whole_phase": round((load.tokens_between(t_switch, t1) if load else 0) / (t1 - t_switch), 2),
            "requests": len(done), "errors": sum(1 for r in done if r.error is not None),
            "p50_latency_s": _q(lat, 0.5), "p99_latency_s": _q(lat, 0.99),
            "time_to_first_change_s": round(first - rel0, 1) if first is not None else None,
            "rate_per_30s": series,
            # what the sidecar (its threads, and the shadow's child) and the load generator took of this
            # machine's CPU, which the engine shares on the CPU lab
            "cpu": cpu.get(phase.name, {}),
        }
        phases[phase.name] = row
    restarts = [a for a in applies if a.get("strategy") or float(a.get("downtime_s") or 0.0) > 0.0]
    return {
        "start": f"{args.start[0]}/K={args.start[1]}", "startup_s": round(startup_s, 1), "phases": phases,
        "client_errors": len([r for r in load.requests if r.error is not None]) if load else 0,
        # what each failed request saw and when (s from the workload's start), to tell our doing from the
        # engine's or the load generator's
        "client_error_samples": [
            {"start_s": round(r.start - p_workload, 1), "end_s": round(r.end - p_workload, 1), "tokens": r.tokens,
             "error": r.error[:300]}
            for r in (load.requests if load else []) if r.error is not None
        ][:20],
        "changes": len(changes), "restarts": len(restarts), "config_timeline": changes, "applies": applies,
        "shadow_runs": shadow_runs,
        "shadow_settings": None if args.shadow_interval_s <= 0 else {
            "interval_s": args.shadow_interval_s, "interval_max_s": args.shadow_interval_max_s,
            "max_machine_share": args.shadow_max_machine_share,  # None: the daemon's default
            "sample_rate": args.shadow_sample_rate,
            "max_samples": args.shadow_max_samples, "cpu_share": args.shadow_cpu_share, "nice": args.shadow_nice},
        "decisions": [{"status": d.status, "reason": d.decision.reason, "message": d.decision.message[:300]}
                      for d in decisions],
    }


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _steps(t0: float, t1: float, step: float) -> list[float]:
    return [t0 + i * step for i in range(max(1, math.ceil((t1 - t0) / step)))]


def _q(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def _spec_label(spec: dict[str, Any]) -> str:
    if spec.get("method") in (None, "off") or not spec.get("num_speculative_tokens"):
        return "off"
    name = Path(str(spec.get("model") or spec.get("method"))).name.removeprefix("draft-")
    table = spec.get("num_speculative_tokens_per_batch_size")
    if table:
        return f"{name}/table[" + ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in table) + "]"
    return f"{name}/K={spec['num_speculative_tokens']}"


def _wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the engine at {base_url} did not become healthy within {timeout_s:.0f} s")


# -- report -----------------------------------------------------------------------------------------------

def summarize(cells: list[dict[str, Any]], sp: dict[str, Any] | None, cell_s: float,
              reference: str = f"{START[0]}/K={START[1]}") -> dict[str, Any]:
    by: dict[str, dict[str, list[float]]] = {}
    for c in cells:
        by.setdefault(c["phase"], {}).setdefault(c["config"], []).append(c["rate"])
    out: dict[str, Any] = {
        "fixed_mean_rate": {p: {k: round(v, 2) for k, v in m.items()} for p, m in fixed_means(by).items()}
    }
    acc: dict[str, dict[str, list[float]]] = {}
    for c in cells:
        if "accepted_per_draft" in c:
            acc.setdefault(c["phase"], {}).setdefault(c["config"], []).append(c["accepted_per_draft"])
    out["accepted_per_draft"] = {p: {k: round(sum(v) / len(v), 3) for k, v in m.items()} for p, m in acc.items()}
    if sp is None:
        return out
    s = summarize_live(by, {p: v["rate"] for p, v in sp["phases"].items()},
                       {p: v["seconds"] for p, v in sp["phases"].items()}, cell_s,
                       reference=reference)
    out.update({
        "oracle_per_phase": s.oracle_per_phase, "best_fixed": s.best_fixed, "cell_log_sd": s.cell_log_sd,
        "worst_phase": s.worst_phase,
        "targets": {
            "spectuner_vs_oracle": {**s.vs_oracle.to_json(), "target": 0.95},
            "spectuner_vs_best_fixed": {**s.vs_best_fixed.to_json(), "target": 1.0},
            f"spectuner_vs_{reference}": {**(s.vs_reference.to_json() if s.vs_reference else {}), "target": None},
            "worst_phase_vs_no_speculation": {**(s.worst_phase_vs_off.to_json() if s.worst_phase_vs_off else {}),
                                              "target": 0.95},
        },
    })
    return out


def markdown(doc: dict[str, Any]) -> str:
    names = [p.name for p in PHASES]
    s = doc["summary"]
    lines = ["# Live benchmark (gpu-like lab engine)", "",
             f"Run {doc['when']} on {doc['models_dir']}: {doc['phase_s']:.0f} s per spectuner phase, fixed configs in "
             f"{doc['cell_s']:.0f}-s cells × {doc['visits']} visits; ~{doc['max_tokens']} tokens per request; "
             f"load average {doc['load_average_before']} → {doc['load_average_after']}; "
             f"{doc['wall_s'] / 60:.1f} min.", ""]
    waits = [c["switch_s"] for c in doc.get("cells", []) if "switch_s" in c]
    if waits:
        unconfirmed = sum(1 for c in doc["cells"] if c.get("switch_unconfirmed"))
        lines += [f"A cell after a live K change starts once the engine drafts at the new K: waits median "
                  f"{sorted(waits)[len(waits) // 2]:.2f} s, longest {max(waits):.2f} s; "
                  f"{unconfirmed} of {len(waits)} not confirmed "
                  f"within {doc.get('switch_timeout_s', '?')} s (measured regardless).", ""]
    if "from" in doc["fixed"]:
        lines += [f"**Fixed configs from an earlier run** ({doc['fixed']['from_when']}, {doc['fixed']['from']}): "
                  "spectuner was not measured side by side with them, so machine drift between the runs is in "
                  "the ratios and their intervals do not cover it.", ""]
    if "targets" in s:
        lines += ["## Ratios (95 % intervals)", "", "| ratio | measured | interval | target | met |",
                  "|---|---|---|---|---|"]
        for name, t in s["targets"].items():
            if "value" not in t:
                continue
            goal = t["target"]
            met = "—" if goal is None else ("yes" if t["value"] >= goal else "**no**")
            lines.append(f"| {name} | {t['value']:.3f} | {t['lo']:.3f}–{t['hi']:.3f} | "
                         f"{'—' if goal is None else f'≥ {goal}'} | {met} |")
        lines += ["", f"Best single fixed config: {s['best_fixed']}; worst phase for spectuner: "
                  f"{s['worst_phase']}.", ""]
    lines += ["## Goodput per phase (tokens/s; fixed: geometric mean of the cells)", "",
              "| config | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    configs = sorted({c for p in s["fixed_mean_rate"].values() for c in p})
    for c in configs:
        lines.append(f"| {c} | " + " | ".join(_cell(s["fixed_mean_rate"].get(n, {}).get(c)) for n in names) + " |")
    sp = doc.get("spectuner")
    if sp:
        lines.append("| **spectuner** | " + " | ".join(f"**{sp['phases'][n]['rate']:.1f}**" for n in names) + " |")
    if "oracle_per_phase" in s:
        lines.append("| oracle | " + " | ".join(s["oracle_per_phase"][n] for n in names) + " |")
        lines.append("| cell spread (log sd) | " + " | ".join(f"{s['cell_log_sd'][n]:.3f}" for n in names) + " |")
    lines += ["", "## Accepted tokens per draft step (fixed cells)", "",
              "| config | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in sorted({c for p in s["accepted_per_draft"].values() for c in p}):
        row = [_cell(s["accepted_per_draft"].get(n, {}).get(c), 2) for n in names]
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    if sp:
        lines += ["", f"## spectuner: {sp['changes']} changes, {sp['restarts']} restarts, {sp['client_errors']} client "
                  "errors", "", "| phase | rate | requests | errors | p50 / p99 latency (s) | first change after (s) "
                  "| sidecar + shadow CPU (share of the machine) | load generator CPU s |",
                  "|---|---|---|---|---|---|---|---|"]
        for n in names:
            p = sp["phases"][n]
            c = p.get("cpu") or {}
            lines.append(f"| {n} | {p['rate']:.1f} | {p['requests']} | {p['errors']} | "
                         f"{_cell(p['p50_latency_s'], 2)} / {_cell(p['p99_latency_s'], 2)} | "
                         f"{_cell(p['time_to_first_change_s'])} | "
                         f"{_cell(c.get('sidecar_cpu_s'))} s ({_cell(c.get('sidecar_machine_share'), 3)}) + shadow "
                         f"{_cell(c.get('shadow_cpu_s'))} s ({_cell(c.get('shadow_machine_share'), 3)}) | "
                         f"{_cell(c.get('load_cpu_s'))} |")
        if sp.get("client_error_samples"):
            lines += ["", "Failed client requests:", "", "| started at (s) | ended at (s) | tokens | error |",
                      "|---|---|---|---|"]
            lines += [f"| {e['start_s']} | {e['end_s']} | {e['tokens']} | {e['error']} |"
                      for e in sp["client_error_samples"]]
        lines += ["", "| decided at (s) | serving from (s) | by | config |", "|---|---|---|---|"]
        lines += [f"| {_cell(c['decided_at_s'])} | {c['serving_at_s']} | {c['applied_by']} | {c['config']} |"
                  for c in sp["config_timeline"]]
        if sp.get("shadow_runs"):
            lines += ["", "Shadow replays of the recorded traffic (α̂ per candidate):", "",
                      "| started at (s) | took (s) | samples | α̂ |", "|---|---|---|---|"]
            lines += [f"| {r['at_s']} | {r.get('wall_s', '—')} | {r.get('samples', '—')} | "
                      + (", ".join(f"{n} {a:.3f}" if isinstance(a, float) else f"{n} —"
                                   for n, a in (r.get("alpha") or {}).items()) or r["message"]) + " |"
                      for r in sp["shadow_runs"]]
    return "\n".join(lines) + "\n"


def _cell(x: Any, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p.name for p in PHASES]
    rates = doc["summary"]["fixed_mean_rate"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    shown = ["off", "good/K=3", "good/table", "medium/K=3", "ngram/K=3"]
    series = {c: [rates.get(n, {}).get(c, 0.0) for n in names]
              for c in shown if any(c in rates.get(n, {}) for n in names)}
    if doc.get("spectuner"):
        series["spectuner"] = [doc["spectuner"]["phases"][n]["rate"] for n in names]
    width = 0.8 / max(len(series), 1)
    for i, (name, ys) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(names))], ys, width=width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=15)
    ax.set_ylabel("goodput (generated tokens/s)")
    ax.set_title("gpu-like lab: goodput per phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draft_k(text: str) -> tuple[str, int]:
    draft, _, k = text.partition(":")
    if not draft or not k.isdigit() or not 1 <= int(k) <= 8:
        raise argparse.ArgumentTypeError(f"expected DRAFT:K with K in 1..8, e.g. medium:3; got {text!r}")
    return draft, int(k)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=180.0, help="spectuner's phase length (s)")
    parser.add_argument("--cell-s", type=float, default=6.0, help="one fixed-config measurement (s)")
    parser.add_argument("--visits", type=int, default=2, help="times every fixed engine is visited")
    parser.add_argument("--ramp-s", type=float, default=4.0, help="wait after a change of phase before a cell (s)")
    parser.add_argument("--switch-s", type=float, default=0.25,
                        help="least wait after a live K change before a cell (s); then until the engine drafts at the "
                             "new K (two polls in a row), at most --switch-timeout-s")
    parser.add_argument("--switch-timeout-s", type=float, default=8.0,
                        help="most wait for the new K to show in the engine's counters (s); the cell says so")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean tokens per request (spread ±50 %%)")
    parser.add_argument("--max-batch", type=int, default=64, help="the engines' max_num_seqs")
    parser.add_argument("--k-max", type=int, default=5)
    parser.add_argument("--skip-k0-pass", action=argparse.BooleanOptionalAction, default=True,
                        help="every engine with a draft skips the draft's pass in K = 0 steps ([plugin] "
                             "skip_draft_pass_at_k0), spectuner's and the fixed ones alike")
    parser.add_argument("--skip-k0-prompt-pass", action=argparse.BooleanOptionalAction, default=True,
                        help="with --skip-k0-pass: steps with a prompt skip it too ([plugin] "
                             "skip_draft_pass_at_k0_prompts), and every engine runs without prefix caching")
    parser.add_argument("--drafts", type=lambda s: [d for d in s.split(",") if d],
                        default=["good", "medium", "weak", "ngram"], help="lab drafts measured and registered")
    parser.add_argument("--start", type=_draft_k, default=START, help="spectuner's start, DRAFT:K (medium:3)")
    parser.add_argument("--restart-downtime-s", type=float, default=45.0, help="guardrails' cost of a restart")
    parser.add_argument("--models-dir", type=Path, default=REPO / GPU_LIKE_MODELS_DIR)
    parser.add_argument("--no-spectuner", action="store_true", help="only the fixed configs")
    parser.add_argument("--no-fixed", action="store_true", help="only spectuner (no ratios)")
    parser.add_argument("--fixed-from", type=Path, default=None,
                        help="with --no-fixed: ratios against the fixed cells of an earlier result file (not side "
                             "by side: machine drift between the runs is not controlled; the report says so)")
    parser.add_argument("--shadow-interval-s", type=float, default=90.0,
                        help="spectuner's [shadow] replay interval (s); 0: no shadow evaluation")
    parser.add_argument("--shadow-interval-max-s", type=float, default=None,
                        help="the longest wait between replays while they agree (s); unset: 4 × the interval")
    parser.add_argument("--shadow-max-machine-share", type=float, default=None,
                        help="the replays' CPU budget (share of the machine over time); unset: the daemon's default")
    parser.add_argument("--shadow-sample-rate", type=float, default=0.5, help="share of requests recorded")
    parser.add_argument("--shadow-max-samples", type=int, default=48, help="newest samples per replay")
    parser.add_argument("--shadow-cpu-share", type=float, default=0.3, help="the replay's CPU cap (share of a core)")
    # The CPU engine keeps both cores busy from a session of its own; the replay child competes inside the
    # daemon's, with the front door proxying every stream. Its first replay took ~5 min at nice 19
    # (13:51 run), 364 s at nice 10 (16:35), 142 s at nice 0 (18:00 trial); the CPU-share cap still holds.
    parser.add_argument("--shadow-nice", type=int, default=0, choices=range(0, 20), metavar="0..19",
                        help="the replay child's priority drop")
    parser.add_argument("--keep-db", type=Path, default=None, help="copy spectuner's database here at the end")
    parser.add_argument("--out", default="live", help="result file stem under bench/results/")
    args = parser.parse_args()
    if not (args.models_dir / "manifest.json").exists():
        parser.error(f"no lab models in {args.models_dir}: run `make models-gpu` first")
    if args.start[0] not in args.drafts and not args.no_spectuner:
        parser.error(f"--drafts must include {args.start[0]} (spectuner's start and the reference config)")
    if args.fixed_from is not None and not args.no_fixed:
        parser.error("--fixed-from reuses an earlier run's fixed cells: give --no-fixed with it")
    earlier: dict[str, Any] | None = None
    if args.fixed_from is not None:
        try:
            earlier = json.loads(args.fixed_from.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--fixed-from {args.fixed_from}: {exc}")
        if not earlier.get("cells") or earlier.get("phase_s") != args.phase_s:
            parser.error(f"--fixed-from {args.fixed_from}: no fixed cells, or phases of another length than "
                         f"--phase-s {args.phase_s:.0f}; give a full run's result file")
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    cells: list[dict[str, Any]] = []
    fixed_info: dict[str, Any] = {}
    sp = None
    (REPO / ".lab").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bl-", dir=REPO / ".lab") as tmp:
        workdir = Path(tmp)
        if not args.no_fixed:
            cells, fixed_info = run_fixed(args, workdir)
        if not args.no_spectuner:
            sp = run_spectuner(args, workdir)
    if earlier is not None:
        cells, fixed_info = earlier["cells"], {**earlier["fixed"], "from": str(args.fixed_from),
                                               "from_when": earlier["when"]}
        args.cell_s, args.visits = earlier["cell_s"], earlier["visits"]
    doc = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"), "models_dir": str(args.models_dir),
        "phase_s": args.phase_s, "cell_s": args.cell_s,
        "switch_timeout_s": args.switch_timeout_s, "visits": args.visits, "max_tokens": args.max_tokens,
        "skip_k0_draft_pass": args.skip_k0_pass, "skip_k0_prompt_pass": _prompt_skip(args),
        "engine_args": list(engine_args(args)),
        "phases": [p.name for p in PHASES], "wall_s": round(time.time() - t0, 1),
        "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "fixed": fixed_info, "cells": cells, "spectuner": sp,
        "summary": summarize(cells, sp, args.cell_s, f"{args.start[0]}/K={args.start[1]}") if cells else {},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
    if cells:
        (RESULTS / f"{args.out}.md").write_text(markdown(doc))
        plot(doc, RESULTS / f"{args.out}.png")
        print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

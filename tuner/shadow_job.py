"""Shadow evaluation as a daemon job: every ``[shadow] evaluate_interval_s`` a child process replays the
traffic record through each draft candidate and stores the results (``shadow_evidence``), which the
controller's draft choice reads (``tuner.controller.context``).

A child process, not a thread: the replay lowers its own priority (``os.nice``) and caps its threads
and CPU share (``tuner.shadow``), which must not touch the daemon's own jobs, and a stuck replay is
stopped at ``timeout_s`` without stopping the daemon. The child is ``python -m tuner.shadow_job SPEC``
(its JSON spec on stdin, so a database password never shows in a process list); ``spectuner shadow run``
uses the same :func:`evaluate_and_store`.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from collectors.records import EngineKey, EventRecord
from collectors.traffic_record import RecorderSettings, SampleStore
from policies.draft_choice import DraftCandidate
from policies.shadow_schedule import ShadowSchedule, after_run, shadow_due
from tuner.config import SpectunerConfig
from tuner.shadow import ShadowCandidate, ShadowInputError, Throttle, evaluate, limit_resources, select_samples
from tuner.store import Store
from tuner.store.shadow import ShadowResult, write_shadow_result

log = logging.getLogger(__name__)


def evaluate_and_store(
    store: Store,
    candidates: Sequence[ShadowCandidate],
    samples: Sequence[Any],
    *,
    target: Path,
    k: int,
    threads: int,
    max_model_len: int,
    throttle: Throttle,
    now: datetime,
) -> list[dict[str, Any]]:
    """Replay ``samples`` through each candidate and store each result; one row per candidate (a
    skipped one says why). ``ShadowInputError`` for a candidate that cannot be replayed as given."""
    rows: list[dict[str, Any]] = []
    for cand in candidates:
        outcome = evaluate(
            cand, samples, target=target, k=k, threads=threads, max_model_len=max_model_len, throttle=throttle
        )
        row: dict[str, Any] = {"candidate": cand.name, "method": cand.method, "k": outcome.k}
        if outcome.skipped:
            rows.append({**row, "skipped": outcome.skipped, **outcome.details})
            continue
        alpha, ci = outcome.alpha()
        result = ShadowResult(
            candidate=cand.name,
            method=cand.method,
            model_path=cand.model,
            computed_at=now,
            samples=outcome.replay.samples,
            output_tokens=outcome.replay.output_tokens,
            num_spec_tokens=outcome.k,
            evidence=outcome.replay.evidence,
            alpha=alpha,
            alpha_ci=ci,
            greedy_only=outcome.greedy_only,
            tokenizer_check=outcome.tokenizer_check,
            details=outcome.details,
        )
        write_shadow_result(store, result)
        rows.append({**row, **result.to_json()})
    return rows


@dataclass(frozen=True)
class JobSpec:
    """What one replay run needs (the child's argument, as JSON)."""

    db_url: str
    samples_dir: str
    target: str
    candidates: list[dict[str, Any]]
    k: int = 3
    max_samples: int = 2000
    max_model_len: int = 1 << 30
    threads: int = 1
    nice: int = 19
    cpu_share: float = 0.1
    extra_env: dict[str, str] = field(default_factory=dict)


def run_spec(spec: JobSpec) -> dict[str, Any]:
    """The child's work: replay the newest samples through each candidate, store, return a summary."""
    limit_resources(spec.threads, spec.nice)
    throttle = Throttle(spec.cpu_share)
    record = SampleStore(RecorderSettings(Path(spec.samples_dir)))
    record.sweep()
    samples = select_samples(record, None, spec.max_samples)
    if not samples:
        return {"samples": 0, "candidates": []}
    cands = [
        ShadowCandidate(c["name"], c["method"], c.get("model"), dict(c.get("extra") or {})) for c in spec.candidates
    ]
    with Store(spec.db_url) as store:
        rows = evaluate_and_store(
            store, cands, samples, target=Path(spec.target), k=spec.k, threads=spec.threads,
            max_model_len=spec.max_model_len, throttle=throttle, now=datetime.now(UTC),
        )
    return {"samples": len(samples), "candidates": rows}


def main(spec_json: str | None = None) -> int:
    """``python -m tuner.shadow_job < SPEC_JSON``: prints the summary as one JSON line; exit 2 on a bad
    candidate or spec (the message on stderr), 1 on anything else."""
    try:
        spec = JobSpec(**json.loads(sys.stdin.read() if spec_json is None else spec_json))
        summary = run_spec(spec)
    except (ShadowInputError, TypeError, ValueError) as exc:
        print(f"shadow job: {exc}", file=sys.stderr)
        return 2
    # The whole child's CPU (interpreter start, imports and model loads included): what a replay run costs
    # the host, which the engine may share.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    summary["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
    print(json.dumps(summary))
    return 0


class ShadowJob:
    """The daemon's side: build the spec from the config and the candidates, run the child with a
    timeout, record what it measured (or why not) as an event."""

    def __init__(
        self,
        store: Store,
        spec: JobSpec,
        candidates: Callable[[], Sequence[DraftCandidate]],
        *,
        only: Sequence[str] = (),
        timeout_s: float = 1800.0,
        engine_key: EngineKey | None = None,
        interval_s: float = 900.0,
        max_interval_s: float | None = None,
        max_machine_share: float = 0.0,
    ) -> None:
        self.store = store
        self.spec = spec
        self.candidates = candidates  # the config's [[drafts]] and the registry, read at each run
        self.only = tuple(only)
        self.timeout_s = timeout_s
        self.engine_key = engine_key
        self.last: dict[str, Any] | None = None
        self.last_skip: str | None = None  # why the last tick ran no replay (None: it ran one)
        self.schedule = ShadowSchedule.configured(interval_s, max_interval_s, max_machine_share)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Stop a replay in progress (the daemon is shutting down): it is only ever lost work."""
        self._stopping.set()
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()

    def _candidate_rows(self) -> list[dict[str, Any]]:
        rows = []
        for c in self.candidates():
            if self.only and c.name not in self.only:
                continue
            rows.append({"name": c.name, "method": c.method, "model": c.path, "extra": dict(c.speculative_config)})
        return rows

    def run_if_due(self, now: datetime, traffic_moved_at: datetime | None = None) -> dict[str, Any] | None:
        """The daemon's tick (every ``evaluate_interval_s``): a run when :func:`shadow_due` says one is due
        (returns its summary), else None — the reason is logged and kept in ``self.last_skip``."""
        due = shadow_due(self.schedule, now, [r["name"] for r in self._candidate_rows()], traffic_moved_at)
        if not due.due:
            self.last_skip = due.reason
            log.info("shadow job: no replay now: %s", due.reason)
            return None
        self.last_skip = None
        summary = self.run_once(now)
        if summary.get("samples") and not summary.get("error"):
            results: dict[str, tuple[float, float, float] | None] = {}
            for row in summary["candidates"]:
                ci = row.get("alpha_ci")
                alpha = row.get("alpha")
                results[row["candidate"]] = (
                    (float(alpha), float(ci[0]), float(ci[1])) if isinstance(alpha, float) and ci else None
                )
            cpu_s = summary.get("cpu_s")
            cost = float(cpu_s) / host_cpus() if isinstance(cpu_s, (int, float)) else None
            self.schedule = after_run(self.schedule, now, results, cost)
        return summary

    def run_once(self, now: datetime) -> dict[str, Any]:
        """One replay run; returns its summary (also ``self.last``) and writes one event."""
        if not any(Path(self.spec.samples_dir).glob("segment-*.jsonl")):
            summary: dict[str, Any] = {"samples": 0, "candidates": [], "note": "no recorded samples yet"}
            self.last = summary
            return summary
        spec = JobSpec(**{**asdict(self.spec), "candidates": self._candidate_rows()})
        if not spec.candidates:
            summary = {"samples": 0, "candidates": [], "note": "no draft candidates to replay"}
            self.last = summary
            return summary
        env = {**os.environ, **spec.extra_env}
        # Started and registered under the lock that stop() takes after setting its flag: either stop() sees
        # the child and kills it, or the child is never started (a stop between the two left a replay
        # running for up to timeout_s and the daemon's shutdown waiting on it).
        with self._lock:
            if self._stopping.is_set():
                return self._stopped()
            proc = subprocess.Popen(
                [sys.executable, "-m", "tuner.shadow_job"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env=env,
            )
            self._proc = proc
        started = time.monotonic()
        try:
            stdout, stderr = proc.communicate(json.dumps(asdict(spec)), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return self._failed(now, f"the replay ran past [shadow] timeout_s = {self.timeout_s:.0f} s and was "
                                     "stopped; lower max_samples, raise cpu_share or timeout_s")
        finally:
            with self._lock:
                self._proc = None
        if self._stopping.is_set():
            return self._stopped()
        if proc.returncode != 0:
            why = (stderr.strip().splitlines() or ["(no output)"])[-1]
            return self._failed(now, f"the replay exited {proc.returncode}: {why}")
        try:
            summary = json.loads(stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return self._failed(now, f"the replay printed no summary: {stdout[-300:]!r}")
        measured = {
            r["candidate"]: r.get("alpha") for r in summary["candidates"] if not r.get("skipped")
        }
        text = ", ".join(f"{n} α̂ {a:.3f}" if isinstance(a, float) else f"{n} —" for n, a in measured.items())
        self.store.write_events([EventRecord(
            ts=now, kind="shadow_evaluated", engine=self.engine_key,
            message=f"shadow replay of {summary['samples']} recorded requests: {text or 'no candidate replayed'}",
            # how long the run took: a starved replay (a busy host, nice too high) shows here
            data={"samples": summary["samples"], "alpha": measured, "wall_s": round(time.monotonic() - started, 1),
                  "cpu_s": summary.get("cpu_s"),
                  "skipped": {r["candidate"]: r["skipped"] for r in summary["candidates"] if r.get("skipped")}},
        )])
        self.last = summary
        return summary

    def _stopped(self) -> dict[str, Any]:
        self.last = {"samples": 0, "candidates": [], "note": "stopped with the daemon"}
        return self.last

    def _failed(self, now: datetime, message: str) -> dict[str, Any]:
        log.warning("shadow job: %s", message)
        self.store.write_events([EventRecord(
            ts=now, kind="shadow_failed", message=message, severity="warning", engine=self.engine_key,
        )])
        summary = {"samples": 0, "candidates": [], "error": message}
        self.last = summary
        return summary


def shadow_job(
    config: SpectunerConfig, store: Store, candidates: Callable[[], Sequence[DraftCandidate]]
) -> ShadowJob | None:
    """The daemon's replay job for ``[shadow]``, or None (no record, or ``evaluate_interval_s = 0``)."""
    shadow = config.shadow
    if shadow.record_dir is None or shadow.evaluate_interval_s <= 0 or shadow.target is None:
        return None
    spec = JobSpec(
        db_url=store.url,
        samples_dir=str(config.resolve(shadow.record_dir)),
        target=str(config.resolve(shadow.target)),
        candidates=[],
        k=shadow.k,
        max_samples=shadow.max_samples,
        max_model_len=shadow.max_model_len or 1 << 30,
        threads=shadow.threads,
        nice=shadow.nice,
        cpu_share=shadow.cpu_share,
    )
    return ShadowJob(
        store, spec, candidates, only=shadow.candidates, timeout_s=shadow.timeout_s,
        interval_s=shadow.evaluate_interval_s, max_interval_s=shadow.evaluate_interval_max_s,
        max_machine_share=shadow.max_machine_share,
    )


def host_cpus() -> int:
    """The CPUs this process may run on (the replay's budget is a share of them)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


if __name__ == "__main__":
    raise SystemExit(main())

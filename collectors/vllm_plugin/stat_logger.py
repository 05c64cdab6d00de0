"""The stat-logger plugin (entry-point group ``vllm.stat_logger_plugins``), loaded in vLLM's API-server
process. vLLM calls :meth:`SpectunerStatLogger.record` once per engine step with that step's
``SchedulerStats`` (which carries ``SpecDecodingStats``) and ``IterationStats``; we turn them into one
wire record (``collectors.vllm_plugin.wire``) and hand it to the :class:`Shipper`.

Inert unless ``SPECTUNER_INGEST_URL`` is set, and inert (one log line) when this vLLM lacks a field
the record is built from (``collectors.vllm_plugin.features``: detected once, at start). ``record``
never raises (an exception there would
end vLLM's output loop) and never blocks (the shipper's queue is bounded).

Batch size and step time: with ``--enable-logging-iteration-details`` vLLM sends the scheduled
request count and the measured execution time of each step, and we use them (``bs = "details"``).
Otherwise the batch size is the running requests after the step plus those that finished in it, and
the step time is the time since the previous step's stats arrived while the engine stayed busy
(``bs = "frontend"``; exact on average, jittery per step; null for the first step after idle).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from collectors.vllm_plugin import env
from collectors.vllm_plugin.features import ITERATION_DETAILS, STAT_LOGGER_FEATURES, FeatureReport, runtime_report
from collectors.vllm_plugin.shipper import Shipper

# Under "vllm." so that vLLM's own log handler and level apply inside its processes.
log = logging.getLogger("vllm.spectuner." + __name__.rsplit(".", 1)[-1])

# One shipper per process, shared by the per-engine logger instances (data parallelism).
_shipper: Shipper | None = None
_shipper_lock = threading.Lock()
# A gap longer than this between two busy steps is not a step time (the output loop stalled).
_MAX_STEP_GAP_S = 10.0


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "unknown"


def shared_shipper(url: str, model: str) -> Shipper:
    global _shipper
    with _shipper_lock:
        if _shipper is None or _shipper.url != url:
            _shipper = Shipper(
                url,
                token=env.read_token(),
                source={"model": model, "pid": os.getpid(), "vllm": _vllm_version()},
                queue_max=int(env.env_number(env.QUEUE_MAX, 20_000)),
                batch_max=int(env.env_number(env.BATCH_MAX, 512)),
                flush_interval_s=env.env_number(env.FLUSH_S, 0.25),
            )
        return _shipper


class SpectunerStatLogger(StatLoggerBase):
    """Per-engine stat logger that ships per-step speculation stats to the spectuner sidecar."""

    def __init__(
        self, vllm_config: VllmConfig, engine_index: int = 0, *, features: FeatureReport | None = None
    ) -> None:
        self.engine_index = engine_index
        self.url = os.environ.get(env.INGEST_URL, "").strip()
        self.shipper: Shipper | None = None
        self._last_busy_mono: float | None = None
        self._errors = 0
        self._last_dropped: tuple[int, int] = (0, 0)
        self.use_details = False
        self.k_max = 0
        if not self.url:
            return  # inert
        try:  # vLLM builds loggers at engine start: nothing may raise from here
            self._start(vllm_config, features or runtime_report(STAT_LOGGER_FEATURES))
        except Exception:
            self.shipper = None
            log.exception("spectuner plugin: could not start; per-step stats are off")

    def _start(self, vllm_config: VllmConfig, features: FeatureReport) -> None:
        missing = features.reason("stat_logger_plugin", "per_step_stats")
        if missing:
            log.warning("spectuner plugin: %s; per-step stats are off", missing)
            return
        self.use_details = features.ok(ITERATION_DETAILS.name)
        spec_cfg = getattr(vllm_config, "speculative_config", None)
        self.k_max = int(getattr(spec_cfg, "num_speculative_tokens", 0) or 0) if spec_cfg is not None else 0
        names = getattr(vllm_config.model_config, "served_model_name", None) or "model"
        model = names[0] if isinstance(names, list | tuple) else str(names)
        try:
            self.shipper = shared_shipper(self.url, model)
        except ValueError as exc:
            log.error("spectuner plugin: %s; per-step stats are off", exc)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if self.shipper is None or scheduler_stats is None:
            return
        try:
            step = self.step_record(scheduler_stats, iteration_stats, engine_idx, time.time(), time.monotonic())
            if step is not None:
                self.shipper.submit(step)
        except Exception:  # never let a stats problem stop vLLM's output loop
            self._errors += 1
            if self._errors == 1:
                log.exception("spectuner plugin: could not build a step record (logged once)")

    def step_record(
        self,
        sched: SchedulerStats,
        it: IterationStats | None,
        engine_idx: int,
        now_s: float,
        now_mono: float,
    ) -> dict[str, Any] | None:
        """The wire record for one step (see ``collectors.vllm_plugin.wire``); None for a stats-only
        message that is not a step (request counts published while idle)."""
        spec = sched.spec_decoding_stats
        generated = it.num_generation_tokens if it is not None else 0
        finished = len(it.finished_requests) if it is not None else 0
        details = sched.iteration_details if self.use_details else None
        step_time_s: float | None
        scheduled: int | None = None
        if details is not None and not details.is_dummy:
            batch = details.num_ctx_requests + details.num_generation_requests
            step_time_s = details.elapsed_ms / 1000.0
            scheduled = details.num_ctx_tokens + details.num_generation_tokens
            how = "details"
        else:
            batch = sched.num_running_reqs + finished
            last = self._last_busy_mono
            gap = None if last is None else now_mono - last
            step_time_s = gap if gap is not None and gap < _MAX_STEP_GAP_S else None
            how = "frontend"
        if spec is None and batch == 0 and generated == 0:
            self._last_busy_mono = None
            return None
        # The next step's time counts from here only if requests are still in flight.
        self._last_busy_mono = now_mono if sched.num_running_reqs > 0 else None
        if spec is not None:
            k = spec.num_spec_tokens
            drafts, draft_tokens, accepted = spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens
            acc_pos = list(spec.num_accepted_tokens_per_pos)
            draft_pos = list(spec.num_draft_tokens_per_pos)
        else:
            # No drafts this step (K=0 for this batch size, a prefill-only step, or speculation off).
            k, drafts, draft_tokens, accepted = self.k_max, 0, 0, 0
            acc_pos, draft_pos = [0] * self.k_max, [0] * self.k_max
        return {
            "t": now_s,
            "e": engine_idx,
            "b": batch,
            "dt": step_time_s,
            "bs": how,
            "k": k,
            "d": drafts,
            "dn": draft_tokens,
            "a": accepted,
            "ap": acc_pos,
            "dp": draft_pos,
            "g": generated,
            "s": scheduled,
            "r": sched.num_running_reqs,
            "w": sched.num_waiting_reqs,
        }

    def log_engine_initialized(self) -> None:
        if self.shipper is not None:
            log.info("spectuner plugin: shipping per-step stats of engine %d to %s", self.engine_index, self.url)

    def log(self) -> None:
        # vLLM calls this every few seconds: say so when steps were dropped since the last time.
        if self.shipper is None:
            return
        st = self.shipper.stats
        dropped = st.dropped_queue_full + st.dropped_send_failed
        if (dropped or st.unconfirmed) and (dropped, st.unconfirmed) != self._last_dropped:
            self._last_dropped = (dropped, st.unconfirmed)
            log.warning(
                "spectuner plugin: %d step record(s) dropped so far (%d queue full, %d send failed); %d sent, "
                "%d more sent without an answer (most likely stored by a slow sidecar)",
                dropped,
                st.dropped_queue_full,
                st.dropped_send_failed,
                st.sent,
                st.unconfirmed,
            )

"""How ``spectuner run`` is assembled from its config: the actuator, the step ingest, the plugin's
environment and token, the draft candidates and the controller's settings. Everything here is built
once at start-up; :mod:`tuner.daemon` runs the loop around what it builds.
"""

from __future__ import annotations

import logging
from pathlib import Path

from collectors.records import RecordSink
from collectors.scrape import metrics_url
from collectors.step_ingest import StepFeed, StepIngestServer
from collectors.traffic_record import RecorderSettings, SampleStore, TrafficRecorder, load_tokenizer
from collectors.vllm_plugin.client import ControlClient
from collectors.vllm_plugin.wire import STEPS_PATH
from policies.draft_choice import DraftCandidate
from tuner.actuators import Actuator, CommandActuator, NullActuator, WebhookActuator
from tuner.actuators.front_door import FrontDoorError
from tuner.actuators.live import LiveActuator, plugin_env, shared_plugin_token
from tuner.actuators.strategy import build_restart_strategy
from tuner.config import SpectunerConfig
from tuner.controller.candidates import build_candidate
from tuner.controller.drafts import registered_drafts
from tuner.controller.settings import ControllerSettings
from tuner.store import Store

log = logging.getLogger(__name__)


class DaemonStartError(RuntimeError):
    """The daemon could not start (the engine did not come up, ...)."""


def health_url_for(config: SpectunerConfig) -> str:
    if config.engine.health_url:
        return config.engine.health_url
    target = metrics_url(config.engine.metrics_url)
    return target.rsplit("/", 1)[0] + "/health"


def _sidecar_starts_engine(config: SpectunerConfig) -> bool:
    a = config.actuator
    return a.kind == "restart" or (a.kind == "live" and a.live is not None and a.live.fallback == "restart")


def plugin_token(config: SpectunerConfig) -> str | None:
    """The shared plugin token (``[plugin] token_file``): mandatory whenever the ingest listens or the
    control channel is used; created 0600 when absent (``shared_plugin_token``)."""
    p = config.plugin
    try:
        return shared_plugin_token(
            config.resolve(p.token_file),
            ingest=bool(p.ingest_listen),
            control=bool(p.control_address),
            sidecar_starts_engine=_sidecar_starts_engine(config),
        )
    except ValueError as exc:
        raise DaemonStartError(f"[plugin] needs a token: {exc}") from None


def engine_plugin_env(config: SpectunerConfig) -> dict[str, str]:
    """Environment for an engine the sidecar starts, so the spectuner vLLM plugin in it finds the sidecar."""
    p = config.plugin
    if not (p.ingest_listen or p.control_address):
        return plugin_env(
            ingest_url=None,
            control_address=None,
            token_file=None,
            skip_k0_draft_pass=p.skip_draft_pass_at_k0,
            skip_k0_prompt_pass=p.skip_draft_pass_at_k0_prompts,
        )
    return plugin_env(
        ingest_url=f"http://{p.ingest_listen}{STEPS_PATH}" if p.ingest_listen else None,
        control_address=p.control_address,
        token_file=config.resolve(p.token_file),
        skip_k0_draft_pass=p.skip_draft_pass_at_k0,
        skip_k0_prompt_pass=p.skip_draft_pass_at_k0_prompts,
    )


def build_step_ingest(config: SpectunerConfig, sink: RecordSink, feed: StepFeed) -> StepIngestServer | None:
    """The per-step ingest endpoint (``[plugin] ingest_listen``), or None when it is not configured."""
    listen = config.plugin.ingest_listen
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    return StepIngestServer(
        sink,
        metrics_url(config.engine.metrics_url),
        host="127.0.0.1" if host == "localhost" else host,
        port=int(port),
        token=plugin_token(config) or "",  # never empty while ingest listens (shared_plugin_token)
        feed=feed,
        max_batch_size=config.policy.max_batch_size,
    )


def traffic_recorder(config: SpectunerConfig) -> TrafficRecorder | None:
    """The sampled traffic record an in-process front door keeps (``[shadow] record_dir``), or None."""
    shadow = config.shadow
    if shadow.record_dir is None:
        return None
    settings = RecorderSettings(
        config.resolve(shadow.record_dir),
        sample_rate=shadow.record_sample_rate,
        max_bytes=shadow.record_max_bytes,
        retention_s=shadow.record_retention_s,
    )
    try:
        store = SampleStore(settings)
    except OSError as exc:
        raise DaemonStartError(f"[shadow] record_dir {settings.directory}: cannot use it ({exc})") from None
    # Text responses are tokenised with the target's tokenizer; without one, only clients that ask for
    # return_token_ids are recorded.
    tokenize = None
    if shadow.target:
        try:
            tokenize = load_tokenizer(config.resolve(shadow.target))
        except Exception as exc:  # tokenizers raises its own exception types
            raise DaemonStartError(f"[shadow] target: cannot load the tokenizer ({exc})") from None
    return TrafficRecorder(store, tokenize)


def build_actuator(config: SpectunerConfig, feed: StepFeed | None = None, kind: str | None = None) -> Actuator:
    a = config.actuator
    kind = kind or a.kind
    if kind == "live" and a.live is not None and config.plugin.control_address:
        return LiveActuator(
            ControlClient(config.plugin.control_address, plugin_token(config) or "", a.live.control_timeout_s),
            build_actuator(config, feed, kind=a.live.fallback),  # the fallback for what cannot be live
            feed=feed if config.plugin.ingest_listen else None,  # no step stream: verify by read-back only
            k_max=a.live.k_max or config.policy.k_max,
            verify_timeout_s=a.live.verify_timeout_s,
            min_evidence_steps=a.live.min_evidence_steps,
            k0_pass_skipped=config.plugin.skip_draft_pass_at_k0,
            k0_prompt_pass_skipped=config.plugin.skip_draft_pass_at_k0_prompts,
        )
    if kind == "restart" and a.restart is not None:
        # [actuator] strategy: plain restart, or drain-and-hold / blue-green behind the front door.
        try:
            return build_restart_strategy(
                a,
                health_url_for(config),
                config.resolve(a.restart.log_path),
                env={**a.restart.env, **engine_plugin_env(config)},
                resolve=config.resolve,
                traffic=traffic_recorder(config),
            )
        except FrontDoorError as exc:  # its listen port is taken, its token file unusable...
            raise DaemonStartError(f"[actuator.front_door]: {exc}") from None
    if kind == "command" and a.command is not None:
        return CommandActuator(a.command.argv, a.command.timeout_s)
    if kind == "webhook" and a.webhook is not None:
        return WebhookActuator(a.webhook.url, a.webhook.timeout_s, a.webhook.headers)
    return NullActuator()


def controller_settings(config: SpectunerConfig) -> ControllerSettings:
    """The controller's settings: the config's sections as they are, for the engine at ``[engine] metrics_url``."""
    return ControllerSettings.from_config(config, metrics_url(config.engine.metrics_url))


def draft_candidates(config: SpectunerConfig, store: Store) -> list[DraftCandidate]:
    """The config file's ``[[drafts]]`` and the operator's registry (``spectuner drafts add``); a
    registry entry with the same name as a file entry replaces it."""
    out: dict[str, DraftCandidate] = {}
    for d in config.drafts:
        out[d.name] = build_candidate(
            d.name,
            d.method,
            str(config.resolve(d.model)) if d.model and Path(config.resolve(d.model)).exists() else d.model,
            num_params=d.num_params,
            dtype=d.dtype,
            kv_bytes=d.kv_bytes_per_token,
            prior_alpha=d.prior_alpha,
            cost_ratio=d.cost_ratio,
            extra=d.extra,
            draft_fixed_s=d.draft_fixed_s,
            draft_per_seq_s=d.draft_per_seq_s,
        )
    for spec in registered_drafts(store):
        out[spec.name] = build_candidate(
            spec.name,
            spec.method,
            spec.model,
            num_params=spec.num_params,
            dtype=spec.dtype,
            kv_bytes=spec.kv_bytes_per_token,
            extra=spec.extra,
        )
    return list(out.values())

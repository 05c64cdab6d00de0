"""Skip the draft model's pass in steps drafted at K = 0 (stdlib and vLLM only).

vLLM's model-based proposers (draft_model, EAGLE, MTP: ``SpecDecodeBaseProposer``) run the draft's
first forward at every step, K = 0 included, so that the draft's KV cache holds every token; at K = 0
the result is thrown away and an empty draft returned. Under a per-batch-size table whose K = 0 rows
cover a full batch, that pass is pure cost: on the lab engine at 64 streams the table's K = 0 made
~310 tok/s against ~370 for the target alone (bench/bench_k0_pass.py). With
``SPECTUNER_SKIP_K0_DRAFT_PASS=1`` the wrapped ``propose`` returns vLLM's own K = 0 answer (an empty
``[batch, 0]`` tensor) without the forward — in steps where every request scores one token.

A step with more than one token for some request (a prompt or a chunk of one; tokens drafted by the
step before, being verified) still runs the pass. Why: prompts are what prefix caching shares between
requests. A prompt block whose draft KV was never written would be reused with holes by every later
request with that prefix (a shared system prompt) for as long as it stays cached.

With ``SPECTUNER_SKIP_K0_DRAFT_PASS=all`` steps with a prompt in them skip the pass too — on an engine
that runs without prefix caching (``--no-enable-prefix-caching``), where no block is shared and a hole
stays with the one request that made it; with prefix caching on, ``all`` acts as ``1`` (and says why). A
K = 0 step then costs what plain decoding costs: under a short-answer load at 64 streams a prompt enters
most steps, and the decode-only skip saved little (the live benchmark's 32–96-token answers: ~63 % of the
K = 0 steps kept the pass). The price is larger: a request that began in a skipped step has no draft KV
for its prompt, so if K rises while it runs it drafts against a cache that never saw it, until it ends.

The price that remains: the draft's cache misses the tokens *generated* in skipped steps, so a request
that lived through them drafts worse once K > 0 again (its draft attends to stale slots), and so does a
later request that reuses those blocks from the prefix cache (a multi-turn chat resending an answer).
The target still verifies every token, so outputs are unchanged (greedy outputs were identical in the
benchmark); only acceptance drops, for those requests. Off by default.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from collectors.vllm_plugin import env
from collectors.vllm_plugin.features import K0_PASS_FEATURES, SKIP_K0_PASS, runtime_report

log = logging.getLogger("vllm.spectuner." + __name__.rsplit(".", 1)[-1])
# The model runs in a worker process of its own (vLLM's CPU build, multi-GPU executors), not in the engine
# core that answers the control channel: a worker publishes its counts here (≤ once a second), keyed by its
# parent, the engine core, which adds them up (``state``). Removed when the worker exits.
_COUNTS_PREFIX = "spectuner-k0-pass"
_PUBLISH_EVERY_S = 1.0


class _Counter:
    """K = 0 passes in this process (read by the control channel's ``get``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self) -> None:
        with self._lock:
            self.count += 1


SKIPPED = _Counter()  # K = 0 steps without the draft's pass
RAN = _Counter()  # K = 0 steps with a prompt (or verified drafts) in them: the pass ran
_state: dict[str, str] = {"k0_draft_pass": "runs"}
# "all" asked for: this process's verdict on prompt steps, set at its first K = 0 step with a prompt
# ("skipped", or why not); the engine core reads its workers' from what they publish
_prompts: dict[str, str | bool] = {"asked": False, "verdict": ""}
_published = {"at": float("-inf")}


def _counts_path(engine_pid: int, pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"{_COUNTS_PREFIX}-{engine_pid}-{pid}.json"


def _publish(force: bool = False) -> None:
    """Write this process's counts for its engine core to read (never raises)."""
    now = time.monotonic()
    if not force and now - _published["at"] < _PUBLISH_EVERY_S:
        return
    _published["at"] = now
    path = _counts_path(os.getppid(), os.getpid())
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"skipped": SKIPPED.count, "run": RAN.count, "prompts": _prompts["verdict"]}))
        os.replace(tmp, path)
    except OSError:
        pass


def _worker_counts() -> tuple[int, int, list[str]]:
    """Counts the engine core's workers published (its own pid is their parent's), and their verdicts on
    prompt steps (those that have one)."""
    skipped = run = 0
    verdicts: list[str] = []
    for path in Path(tempfile.gettempdir()).glob(f"{_COUNTS_PREFIX}-{os.getpid()}-*.json"):
        try:
            data = json.loads(path.read_text())
            skipped, run = skipped + int(data["skipped"]), run + int(data["run"])
            if data.get("prompts"):
                verdicts.append(str(data["prompts"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return skipped, run, verdicts


def _prompt_verdict(proposer: Any) -> str:
    """Whether this engine's prompt steps may skip the pass: "skipped", or why not. Only without prefix
    caching (vLLM's ``cache_config.enable_prefix_caching``; unknown counts as on)."""
    cache_config = getattr(getattr(proposer, "vllm_config", None), "cache_config", None)
    if getattr(cache_config, "enable_prefix_caching", True) is not False:
        return (
            "the engine runs with prefix caching, which would share prompt blocks without draft KV: steps "
            "with a prompt keep the pass (start it with --no-enable-prefix-caching to skip them too)"
        )
    return "skipped"


def _remove_published() -> None:
    with contextlib.suppress(OSError):
        _counts_path(os.getppid(), os.getpid()).unlink()


def state() -> dict[str, Any]:
    """``k0_draft_pass``: "skipped" when installed, "runs" otherwise (with ``k0_skip_reason`` when asked
    for and unavailable); ``k0_passes_skipped``: K = 0 steps that skipped the pass, in this process and in
    the workers it started (published at most a second late); ``k0_passes_run``: K = 0 steps that ran it
    while installed (a prompt in the step); ``k0_prompt_pass``: "skipped" when steps with a prompt skip it
    too (``all`` on an engine without prefix caching), "unknown" until the first such step, else "runs"
    (with ``k0_prompt_skip_reason`` when ``all`` was asked for)."""
    skipped, run, verdicts = _worker_counts()
    out: dict[str, Any] = {
        **_state,
        "k0_passes_skipped": SKIPPED.count + skipped,
        "k0_passes_run": RAN.count + run,
        "k0_prompt_pass": "runs",
    }
    if _prompts["asked"] and _state["k0_draft_pass"] == "skipped":
        verdicts = [*verdicts, str(_prompts["verdict"])] if _prompts["verdict"] else verdicts
        if not verdicts:
            out["k0_prompt_pass"] = "unknown"  # no K = 0 step with a prompt yet: the workers have not looked
        elif all(v == "skipped" for v in verdicts):
            out["k0_prompt_pass"] = "skipped"
        else:
            out["k0_prompt_skip_reason"] = next(v for v in verdicts if v != "skipped")
    return out


def install(environ: dict[str, str] | None = None) -> bool:
    """Wrap the proposer when ``SPECTUNER_SKIP_K0_DRAFT_PASS`` says so and this vLLM has what the wrapper
    needs. Returns whether the pass is now skipped. Never raises: the engine must come up regardless."""
    mode = env.k0_skip_mode(environ)
    if mode == "off":
        return False
    _prompts["asked"] = mode == "all"
    report = runtime_report(K0_PASS_FEATURES)
    if not report.ok(SKIP_K0_PASS.name):
        _state["k0_skip_reason"] = report.reason(SKIP_K0_PASS.name)
        log.warning("spectuner plugin: the draft's pass at K = 0 still runs: %s", _state["k0_skip_reason"])
        return False
    try:
        import torch
        from vllm.v1.spec_decode import llm_base_proposer

        cls = llm_base_proposer.SpecDecodeBaseProposer
        if getattr(cls.propose, "_spectuner_k0", False):
            _state["k0_draft_pass"] = "skipped"
            return True
        original = cls.propose
        signature = inspect.signature(original)

        def _prompts_skipped(self: Any) -> bool:
            if not _prompts["verdict"]:
                _prompts["verdict"] = _prompt_verdict(self)
                if _prompts["verdict"] != "skipped":
                    log.warning("spectuner plugin: %s", _prompts["verdict"])
                _publish(force=True)
            return _prompts["verdict"] == "skipped"

        def skipped(self: Any, num_speculative_tokens: int, target_token_ids: Any, args: Any, kwargs: Any) -> Any:
            """vLLM's own K = 0 answer without the forward, or None when the pass must run."""
            cad = kwargs.get("common_attn_metadata")
            if cad is None:  # passed by position (vLLM passes it by keyword)
                bound = signature.bind_partial(self, num_speculative_tokens, target_token_ids, *args, **kwargs)
                cad = bound.arguments["common_attn_metadata"]
            # a prompt (or verified drafts) in the step: keep the cache whole, unless asked not to where no
            # prompt block is shared
            if getattr(cad, "max_query_len", 2) > 1 and not (_prompts["asked"] and _prompts_skipped(self)):
                RAN.add()
                _publish(force=RAN.count == 1)
                return None
            empty = torch.empty(cad.batch_size(), 0, device=target_token_ids.device, dtype=torch.int64)
            # the state vLLM's propose() leaves behind at K = 0
            self.num_speculative_tokens = 0
            self._last_draft_probs = None
            SKIPPED.add()
            _publish(force=SKIPPED.count == 1)  # the first of each at once, then at most once a second
            return empty

        def propose(self: Any, num_speculative_tokens: int, target_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
            if num_speculative_tokens == 0:
                try:
                    empty = skipped(self, num_speculative_tokens, target_token_ids, args, kwargs)
                except Exception:  # never fail an engine step over a skip: run vLLM's own pass instead
                    if not _state.get("k0_skip_failed"):
                        _state["k0_skip_failed"] = "yes"
                        log.exception("spectuner plugin: could not skip a K = 0 draft pass; vLLM's pass runs")
                    empty = None
                if empty is not None:
                    return empty
            return original(self, num_speculative_tokens, target_token_ids, *args, **kwargs)

        propose._spectuner_k0 = True  # type: ignore[attr-defined]
        cls.propose = propose
        atexit.register(_remove_published)
    except Exception as exc:  # a wrapper that cannot go in leaves vLLM's behaviour alone
        _state["k0_skip_reason"] = f"could not wrap the proposer ({type(exc).__name__}: {exc})"
        log.warning("spectuner plugin: the draft's pass at K = 0 still runs: %s", _state["k0_skip_reason"])
        return False
    _state["k0_draft_pass"] = "skipped"
    log.info(
        "spectuner plugin: K = 0 steps skip the draft model's pass (%s=%s)",
        env.SKIP_K0_DRAFT_PASS,
        "all: steps with a prompt too, without prefix caching" if _prompts["asked"] else "1: decode-only steps",
    )
    return True

"""Feature detection: does this vLLM have every internal the plugin touches? (stdlib only)

The plugin relies on vLLM internals that are not a stable interface (``SchedulerStats``,
``Scheduler.dynamic_sd_lookup``...). Instead of pinning versions, each :class:`Feature` lists the
:class:`Requirement` s it needs — a class, a function with named parameters, an attribute a class
sets, an attribute a method indexes, a string literal — and a :class:`Probe` answers them, either
from vLLM's *source* (:class:`SourceProbe`: ``ast`` over the files, nothing imported, which is how the
tests read each release's wheel) or from the *imported* modules (:class:`ImportProbe`: the live
callables' ``inspect.signature``, the rest from the loaded modules' source; what the engine uses at
start). A missing internal turns the dependent feature off with the reason; nothing here raises.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Requirement:
    """One internal the plugin touches. ``kind``:

    - ``class``: ``module.cls`` exists;
    - ``function``: ``module.name`` is a function taking (at least) ``names`` as parameters;
    - ``method``: ``module.cls.name`` is a method taking (at least) ``names``;
    - ``attrs``: ``module.cls`` declares ``names`` (class-body annotations or ``self.X = ...`` in any method);
    - ``indexes``: ``module.cls.name``'s body indexes ``self.<names[0]>[...]`` (it reads the attribute per call),
      with the index written ``names[1]`` when given (e.g. ``len(num_scheduled_tokens)``);
    - ``literal``: the string ``names[0]`` appears as a literal in ``module`` (metric names, entry-point groups);
    - ``member``: ``names[0]`` is one of the strings of the ``Literal[...]`` alias ``module.name`` (aliases
      nested in it followed), e.g. a speculative method vLLM accepts;
    - ``calls``: ``module`` calls ``name`` somewhere.
    """

    kind: str
    module: str
    cls: str = ""
    name: str = ""
    names: tuple[str, ...] = ()

    def describe(self) -> str:
        where = ".".join(p for p in (self.module, self.cls, self.name) if p)
        if self.kind == "literal":
            return f"the string {self.names[0]!r} in {self.module}"
        if self.kind == "indexes":
            return f"{where} indexing self.{self.names[0]}[...]"
        if self.kind in ("function", "method"):
            return f"{where}({', '.join(self.names)})"
        if self.kind == "attrs":
            return f"{where}.{{{', '.join(self.names)}}}"
        return where


@dataclass(frozen=True)
class Feature:
    name: str
    what: str  # one line: what spectuner does with it
    requirements: tuple[Requirement, ...]


class Probe(Protocol):
    def missing(self, req: Requirement) -> list[str]:
        """What of ``req`` is missing (empty: satisfied). Never raises."""
        ...


@dataclass(frozen=True)
class FeatureReport:
    """Feature name → the missing internals (empty list: the feature is there)."""

    missing: dict[str, list[str]] = field(default_factory=dict)

    def ok(self, name: str) -> bool:
        return name in self.missing and not self.missing[name]

    def reason(self, *names: str) -> str:
        """One sentence naming what is missing for ``names`` ("" when all are there)."""
        gone = [f"{n}: {'; '.join(self.missing.get(n, ['not checked']))}" for n in names if not self.ok(n)]
        return "this vLLM lacks internals the plugin needs (" + " | ".join(gone) + ")" if gone else ""

    def flags(self) -> dict[str, bool]:
        return {name: not gone for name, gone in self.missing.items()}


def detect(probe: Probe, features: Iterable[Feature]) -> FeatureReport:
    out: dict[str, list[str]] = {}
    for feature in features:
        gone: list[str] = []
        for req in feature.requirements:
            try:
                gone += probe.missing(req)
            except Exception as exc:  # a probe bug must not take the engine down either
                gone.append(f"{req.describe()}: check failed ({type(exc).__name__}: {exc})")
        out[feature.name] = gone
    return FeatureReport(out)


# -- what the plugin touches -------------------------------------------------------------------------
_SCHED = "vllm.v1.core.sched.scheduler"
_DYN = "vllm.v1.spec_decode.dynamic.utils"
_STATS = "vllm.v1.metrics.stats"
_SPEC_METRICS = "vllm.v1.spec_decode.metrics"
_LOGGERS = "vllm.v1.metrics.loggers"
_PLUGINS = "vllm.plugins"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"

STAT_LOGGER = Feature(
    "stat_logger_plugin",
    "vLLM loads SpectunerStatLogger from the vllm.stat_logger_plugins entry points and calls record() per step",
    (
        Requirement("literal", _PLUGINS, names=("vllm.stat_logger_plugins",)),
        Requirement("method", _LOGGERS, "StatLoggerBase", "__init__", ("vllm_config", "engine_index")),
        Requirement(
            "method",
            _LOGGERS,
            "StatLoggerBase",
            "record",
            ("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"),
        ),
        Requirement("method", _LOGGERS, "StatLoggerBase", "log_engine_initialized"),
        Requirement("method", _LOGGERS, "StatLoggerBase", "log"),
    ),
)
STEP_STATS = Feature(
    "per_step_stats",
    "the fields one step record is built from (drafts, accepted and drafted tokens per position, batch)",
    (
        Requirement(
            "attrs", _STATS, "SchedulerStats", names=("spec_decoding_stats", "num_running_reqs", "num_waiting_reqs")
        ),
        Requirement("attrs", _STATS, "IterationStats", names=("num_generation_tokens", "finished_requests")),
        Requirement(
            "attrs",
            _SPEC_METRICS,
            "SpecDecodingStats",
            names=(
                "num_spec_tokens",
                "num_drafts",
                "num_draft_tokens",
                "num_accepted_tokens",
                "num_accepted_tokens_per_pos",
                "num_draft_tokens_per_pos",
            ),
        ),
    ),
)
ITERATION_DETAILS = Feature(
    "iteration_details",
    "exact batch size and step time per step with --enable-logging-iteration-details (else estimated)",
    (
        Requirement("attrs", _STATS, "SchedulerStats", names=("iteration_details",)),
        Requirement(
            "attrs",
            _STATS,
            "SchedulerIterationDetails",
            names=(
                "num_ctx_requests",
                "num_generation_requests",
                "num_ctx_tokens",
                "num_generation_tokens",
                "elapsed_ms",
                "is_dummy",
            ),
        ),
    ),
)
K_TABLE = Feature(
    "k_table",
    "engines start with num_speculative_tokens_per_batch_size (a per-batch-size K table)",
    (
        Requirement(
            "attrs", "vllm.config.speculative", "SpeculativeConfig", names=("num_speculative_tokens_per_batch_size",)
        ),
        Requirement(
            "function",
            _DYN,
            name="build_dynamic_sd_schedule_lookup",
            names=("num_speculative_tokens_per_batch_size", "vllm_max_batch_size", "vllm_num_speculative_tokens"),
        ),
    ),
)
LIVE_K = Feature(
    "live_k",
    "the control channel swaps Scheduler.dynamic_sd_lookup, which schedule() reads every step",
    (
        Requirement("class", _SCHED, "Scheduler"),
        Requirement("method", _SCHED, "Scheduler", "__init__"),
        Requirement(
            "attrs",
            _SCHED,
            "Scheduler",
            names=("dynamic_sd_lookup", "num_spec_tokens", "scheduler_config", "vllm_config"),
        ),
        Requirement("indexes", _SCHED, "Scheduler", "schedule", ("dynamic_sd_lookup",)),
        Requirement("literal", _PLUGINS, names=("vllm.general_plugins",)),
    ),
)

SKIP_K0_PASS = Feature(
    "skip_k0_draft_pass",
    "a decode-only K = 0 step returns no drafts without the draft model's pass (SpecDecodeBaseProposer.propose "
    "wrapped)",
    (
        Requirement("class", _PROPOSER, "SpecDecodeBaseProposer"),
        Requirement(
            "method",
            _PROPOSER,
            "SpecDecodeBaseProposer",
            "propose",
            names=("num_speculative_tokens", "target_token_ids", "common_attn_metadata"),
        ),
        # a step with a prompt in it keeps the pass: read from the step's attention metadata
        Requirement("attrs", "vllm.v1.attention.backend", "CommonAttentionMetadata", names=("max_query_len",)),
    ),
)

# What the stat logger needs to ship anything, and what live K needs (K table included).
STAT_LOGGER_FEATURES = (STAT_LOGGER, STEP_STATS, ITERATION_DETAILS)
LIVE_K_FEATURES = (K_TABLE, LIVE_K)
PLUGIN_FEATURES = (*STAT_LOGGER_FEATURES, *LIVE_K_FEATURES)
K0_PASS_FEATURES = (SKIP_K0_PASS,)


# -- probes ------------------------------------------------------------------------------------------
def _params(args: ast.arguments) -> set[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    names = {a.arg for a in every}
    if args.vararg:
        names.add("*" + args.vararg.arg)
    if args.kwarg:
        names.add("**" + args.kwarg.arg)
    return names


def _missing_params(where: str, have: set[str], want: tuple[str, ...]) -> list[str]:
    if "**kwargs" in have or any(h.startswith("**") for h in have):
        return []  # takes anything by keyword
    gone = [p for p in want if p not in have]
    return [f"{where} has no parameter(s) {', '.join(gone)}"] if gone else []


def _class_def(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _func_def(body: list[ast.stmt], name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    return None


def _declared_attrs(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for sub in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, ast.AnnAssign):
            targets = [sub.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def _indexes_self_attr(func: ast.AST, attr: str, index: str | None) -> bool:
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == attr
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
            and (index is None or ast.unparse(node.slice) == index)
        ):
            return True
    return False


def _has_literal(tree: ast.Module, text: str) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == text for n in ast.walk(tree))


def _alias_members(tree: ast.Module, alias: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The strings of ``alias = Literal[...]``, following aliases named inside it (same module)."""
    if alias in seen:
        return set()
    for node in tree.body:
        value: ast.expr | None = None
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == alias for t in targets):
                value = node.value
        if isinstance(value, ast.Subscript):
            out: set[str] = set()
            items = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
            for item in items:
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    out.add(item.value)
                elif isinstance(item, ast.Name):
                    out |= _alias_members(tree, item.id, seen | {alias})
            return out
    return set()


def _calls(tree: ast.Module, name: str) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called == name:
                return True
    return False


class SourceProbe:
    """Answers requirements from module source text; ``read(module)`` gives it (None: no such module)."""

    def __init__(self, read: Callable[[str], str | None]) -> None:
        self._read = read
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self._read(module)
            try:
                self._trees[module] = ast.parse(text) if text is not None else None
            except SyntaxError:
                self._trees[module] = None
        return self._trees[module]

    def missing(self, req: Requirement) -> list[str]:
        tree = self.tree(req.module)
        if tree is None:
            return [f"no module {req.module}"]
        if req.kind == "literal":
            return [] if _has_literal(tree, req.names[0]) else [f"no {req.describe()}"]
        if req.kind == "member":
            return [] if req.names[0] in _alias_members(tree, req.name) else [f"no {req.describe()}"]
        if req.kind == "calls":
            return [] if _calls(tree, req.name) else [f"no {req.describe()}"]
        if req.kind == "function":
            func = _func_def(tree.body, req.name)
            if func is None:
                return [f"no function {req.module}.{req.name}"]
            return _missing_params(req.describe(), _params(func.args), req.names)
        cls = _class_def(tree, req.cls)
        if cls is None:
            return [f"no class {req.module}.{req.cls}"]
        if req.kind == "class":
            return []
        if req.kind == "attrs":
            gone = [n for n in req.names if n not in _declared_attrs(cls)]
            return [f"{req.module}.{req.cls} has no attribute(s) {', '.join(gone)}"] if gone else []
        method = _func_def(cls.body, req.name)
        if method is None:
            return [f"no method {req.module}.{req.cls}.{req.name}"]
        if req.kind == "method":
            return _missing_params(req.describe(), _params(method.args), req.names)
        if req.kind == "indexes":
            index = req.names[1] if len(req.names) > 1 else None
            return [] if _indexes_self_attr(method, req.names[0], index) else [f"{req.describe()} not found"]
        return [f"unknown requirement kind {req.kind!r}"]


def _module_source(module: str) -> str | None:
    try:
        return inspect.getsource(importlib.import_module(module))
    except Exception:
        return None


class ImportProbe(SourceProbe):
    """Answers from the imported modules: functions and methods by their live ``inspect.signature``
    (what vLLM will actually call or be called with), the rest from the loaded modules' source."""

    def __init__(self) -> None:
        super().__init__(_module_source)

    def missing(self, req: Requirement) -> list[str]:
        if req.kind not in ("function", "method", "class"):
            return super().missing(req)
        try:
            obj: object = importlib.import_module(req.module)
        except Exception as exc:
            return [f"cannot import {req.module} ({type(exc).__name__}: {exc})"]
        path = [p for p in (req.cls, req.name) if p]
        for part in path:
            if not hasattr(obj, part):
                return [f"no {req.describe()}"]
            obj = getattr(obj, part)
        if req.kind == "class":
            return [] if inspect.isclass(obj) else [f"{req.describe()} is not a class"]
        if not callable(obj):
            return [f"{req.describe()} is not callable"]
        try:
            params = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):
            return super().missing(req)  # a builtin without a signature: read the source instead
        have = {
            ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in params
        }
        return _missing_params(req.describe(), have, req.names)


_runtime: dict[tuple[str, ...], FeatureReport] = {}


def runtime_report(features: tuple[Feature, ...] = PLUGIN_FEATURES) -> FeatureReport:
    """``features`` in this process's vLLM, detected once per process (cached)."""
    key = tuple(f.name for f in features)
    if key not in _runtime:
        _runtime[key] = detect(ImportProbe(), features)
    return _runtime[key]

"""Start-time checks of a loaded config against the machine it runs on: environment variables, files.

``load_config`` checks what the file says; these check what it refers to. ``spectuner run`` and
``spectuner run --check`` both call :func:`start_problems`, so ``--check`` passes exactly the configs
``run`` starts with. Each problem is a configuration error (exit 2). Nothing here writes: a missing
token file that ``run`` would create is not a problem.
"""

from __future__ import annotations

import os
from pathlib import Path

from tuner.config import SpectunerConfig

_MODEL_METHODS = ("draft_model", "eagle", "eagle3")


def _looks_like_path(model: str) -> bool:
    """A local path, not a hub name (``org/name``): absolute, ``./``, ``../`` or ``~``."""
    return model.startswith(("/", "./", "../", "~"))


def start_problems(config: SpectunerConfig) -> list[str]:
    """What would stop ``spectuner run`` with this config here, one ``where: what to do`` line each."""
    problems: list[str] = []
    a = config.alerts
    for sink in a.sinks if a.enabled else []:
        for env, what in ((sink.url_env, "the sink URL"), (sink.secret_env, "the HMAC key")):
            if env and not os.environ.get(env):
                problems.append(
                    f"[[alerts.sinks]] {sink.name}: environment variable {env} ({what}) is not set; export it"
                )
    spec = config.speculative
    models = [("[speculative] model", spec.method, spec.model)]
    models += [(f"[[drafts]] {d.name}: model", d.method, d.model) for d in config.drafts]
    for where, method, model in models:
        if method in _MODEL_METHODS and model and _looks_like_path(model):
            path = config.resolve(model)
            if not path.exists():
                problems.append(
                    f"{where} {model!r}: {path} does not exist; build or copy the draft there, or fix the path"
                )
    p = config.plugin
    if p.ingest_listen or p.control_address:
        path = config.resolve(p.token_file)
        a_ = config.actuator
        starts_engine = a_.kind == "restart" or (
            a_.kind == "live" and a_.live is not None and a_.live.fallback == "restart"
        )
        problem = _token_problem(path, created_by_run=bool(p.ingest_listen) or starts_engine)
        if problem is not None:
            problems.append(f"[plugin] token_file: {problem}")
    return problems


def _token_problem(path: Path, *, created_by_run: bool) -> str | None:
    """An existing token file must hold a secret; a missing one is fine only if ``run`` creates it."""
    if not path.exists():
        if created_by_run:
            return None
        return f"{path} does not exist; write a random secret there and give the engine the same file"
    try:
        token = path.read_text().strip()
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    return None if token else f"{path} is empty; delete it (spectuner creates one) or put a random secret in it"

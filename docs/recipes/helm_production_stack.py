"""Command-actuator recipe: set --speculative-config in a vLLM production-stack Helm release, wait for it.

    [actuator]
    kind = "command"
    [actuator.command]
    argv = ["python3", "/etc/spectuner/recipes/helm_production_stack.py",
            "--release", "vllm", "--chart", "vllm/vllm-stack", "--chart-version", "0.1.7",
            "--namespace", "llm", "--model-spec", "llama3", "--rollout-timeout-s", "900"]
    timeout_s = 960  # above --rollout-timeout-s

The chart renders each ``servingEngineSpec.modelSpec[]`` entry as a Deployment
``<release>-<modelSpec.name>-deployment-vllm`` whose container runs ``vllm serve`` with
``vllmConfig.extraArgs`` appended. Steps (docs/fleet.md): ``helm get values -o json`` (the release's own
values) → the named modelSpec's ``vllmConfig.extraArgs`` with ``--speculative-config`` replaced, added
or (method "off") removed, every other value as it was → ``helm upgrade <release> <chart> --version
<v> -f <values>`` → ``kubectl rollout status`` of that Deployment. A failed or timed-out rollout is
rolled back (``helm rollback <release>``: the previous revision) unless ``--no-undo``. Needs
recipe_common.py beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from recipe_common import RecipeError, load_json, main, read_config, run, wait_for_rollout, what_was_set, with_spec


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--release", required=True)
    p.add_argument("--chart", required=True, help="the chart the release was installed from, e.g. vllm/vllm-stack")
    p.add_argument("--chart-version", default=None, help="pin the chart version (recommended: the installed one)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--model-spec", required=True, help="the servingEngineSpec.modelSpec[].name to change")
    p.add_argument("--rollout-timeout-s", type=float, default=600.0)
    p.add_argument("--helm", default="helm")
    p.add_argument("--kubectl", default="kubectl")
    p.add_argument("--no-undo", action="store_true", help="leave a failed rollout as it is")
    return p.parse_args()


def plan_values(values: dict[str, Any], model_spec: str, value: str | None) -> dict[str, Any] | None:
    """The release's values with the flag set in that modelSpec's extraArgs; None when in force already."""
    specs = (values.get("servingEngineSpec") or {}).get("modelSpec") or []
    entry = next((s for s in specs if isinstance(s, dict) and s.get("name") == model_spec), None)
    if entry is None:
        names = [s.get("name") for s in specs if isinstance(s, dict)]
        raise RecipeError(f"no servingEngineSpec.modelSpec named {model_spec!r} in the release's values ({names})")
    vllm_config = entry.get("vllmConfig") or {}
    old = list(vllm_config.get("extraArgs") or [])
    new = with_spec(old, value)
    if new == old:
        return None
    changed: dict[str, Any] = json.loads(json.dumps(values))  # a deep copy; only this one list changes
    for s in changed["servingEngineSpec"]["modelSpec"]:
        if isinstance(s, dict) and s.get("name") == model_spec:
            s.setdefault("vllmConfig", {})
            s["vllmConfig"] = {**(s["vllmConfig"] or {}), "extraArgs": new}
    return changed


def apply(stdin: str) -> str:
    a = parse()
    value = read_config(stdin)
    ns = ["--namespace", a.namespace]
    step_s = 300.0  # helm upgrade renders and submits; the rollout is waited for separately
    values = load_json(run([a.helm, "get", "values", a.release, *ns, "-o", "json"], step_s), "helm get values")
    changed = plan_values(values if isinstance(values, dict) else {}, a.model_spec, value)
    if changed is None:
        return f"release {a.release} ({a.model_spec}) already runs this config; nothing upgraded"
    fd, path = tempfile.mkstemp(prefix="spectuner-values-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(changed, f)  # JSON is YAML: helm reads it as a values file
        version = ["--version", a.chart_version] if a.chart_version else []
        run([a.helm, "upgrade", a.release, a.chart, *ns, *version, "-f", path], step_s)
    finally:
        os.unlink(path)
    deployment = f"deployment/{a.release}-{a.model_spec}-deployment-vllm"
    rollout = [a.kubectl, *ns, "rollout", "status", deployment, f"--timeout={a.rollout_timeout_s:g}s"]
    undo = None if a.no_undo else [a.helm, "rollback", a.release, *ns]
    wait_for_rollout(rollout, a.rollout_timeout_s, undo, f"release {a.release} rolled back to its previous revision")
    return f"release {a.release}: {deployment} rolled out {what_was_set(value)}"


if __name__ == "__main__":
    main(apply)

"""Command-actuator recipe: set vLLM's --speculative-config in a Kubernetes Deployment, wait for the rollout.

    [actuator]
    kind = "command"
    [actuator.command]
    argv = ["python3", "/etc/spectuner/recipes/kubectl_patch_deployment.py",
            "--deployment", "vllm-llama", "--namespace", "llm", "--container", "vllm",
            "--rollout-timeout-s", "900"]
    timeout_s = 960  # above --rollout-timeout-s: the actuator kills a recipe that overruns

Steps (docs/fleet.md): ``kubectl get deployment`` → the container's ``args`` (or ``command``, where the
vLLM production-stack chart puts vLLM's flags) with ``--speculative-config`` replaced, added or (method
"off") removed → ``kubectl patch --type=json`` with a ``test`` of the old list first (someone else's edit
in between makes the patch fail instead of being overwritten) → ``kubectl rollout status``. A rollout
that fails or times out is undone (``kubectl rollout undo``) unless ``--no-undo``. Needs recipe_common.py
beside it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from recipe_common import (
    FLAG,
    RecipeError,
    load_json,
    main,
    read_config,
    run,
    wait_for_rollout,
    what_was_set,
    with_spec,
)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployment", required=True, help="the Deployment's name")
    p.add_argument("--namespace", default="default")
    p.add_argument("--container", default="vllm", help="the vLLM container's name in the pod template")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    p.add_argument("--rollout-timeout-s", type=float, default=600.0)
    p.add_argument("--kubectl", default="kubectl", help="the kubectl binary (or oc)")
    p.add_argument("--no-undo", action="store_true", help="leave a failed rollout as it is")
    return p.parse_args()


def plan_patch(deployment: dict[str, Any], container: str, value: str | None) -> list[dict[str, Any]] | None:
    """The RFC 6902 patch that sets the flag, or None when it is in force already."""
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    index = next((i for i, c in enumerate(containers) if c.get("name") == container), None)
    if index is None:
        names = [c.get("name") for c in containers]
        raise RecipeError(f"no container {container!r} in the Deployment's pod template (it has {names})")
    c = containers[index]
    has_flag = [f for f in ("args", "command") if any(str(a).startswith(FLAG) for a in c.get(f) or [])]
    field = has_flag[0] if has_flag else ("args" if c.get("args") else "command")
    old = list(c.get(field) or [])
    new = with_spec(old, value)
    if new == old:
        return None
    path = f"/spec/template/spec/containers/{index}/{field}"
    if field not in c:
        return [{"op": "add", "path": path, "value": new}]
    return [{"op": "test", "path": path, "value": old}, {"op": "replace", "path": path, "value": new}]


def apply(stdin: str) -> str:
    a = parse()
    value = read_config(stdin)
    kubectl = [a.kubectl, "--namespace", a.namespace, *(["--context", a.context] if a.context else [])]
    step_s = 120.0  # get / patch / undo answer in seconds; only the rollout waits long
    deployment = load_json(run([*kubectl, "get", "deployment", a.deployment, "-o", "json"], step_s), "the Deployment")
    patch = plan_patch(deployment, a.container, value)
    if patch is None:
        return f"deployment/{a.deployment} already runs this config; nothing patched"
    run([*kubectl, "patch", "deployment", a.deployment, "--type=json", "-p", json.dumps(patch)], step_s)
    rollout = [*kubectl, "rollout", "status", f"deployment/{a.deployment}", f"--timeout={a.rollout_timeout_s:g}s"]
    undo = None if a.no_undo else [*kubectl, "rollout", "undo", f"deployment/{a.deployment}"]
    wait_for_rollout(rollout, a.rollout_timeout_s, undo, f"deployment/{a.deployment} undone to its previous config")
    return f"deployment/{a.deployment} rolled out {what_was_set(value)}"


if __name__ == "__main__":
    main(apply)
